"""Registration of the library in TensorRT-LLM's FMHA registry (``FMHA_LIBS``).

TensorRT-LLM picks an attention library per layer from ``FMHA_LIBS`` (an ordered dict; order is
priority), filtered by ``TLLM_FMHA_LIBS`` (trtllm-interfaces.md, section 1). An out-of-tree
library appears by being inserted into that dict *in place* (other modules hold the same object),
*before* ``fallback`` (which accepts nearly everything, so anything after it is unreachable).
``DEFAULT_FMHA_LIBS`` is left alone: the library stays opt-in (``TLLM_FMHA_LIBS=+beam_shared_prefix``).

Two facts shape this module:

- The registry lives at ``tensorrt_llm._torch.attention.backends.fmha.registry`` in current trees
  and at ``tensorrt_llm._torch.attention_backend.fmha.registry`` in older ones (section 0.1); both
  are handled, each with a subclass built on that tree's own ``Fmha``/``PhasedFmha`` classes.
- Older registries append ``+name`` entries *after* ``fallback`` (section 1.2). There the delta
  form can never select the library; :func:`register_into` detects it from the registry's own
  parser and logs the exact list that works.

Nothing here imports torch at module import; :func:`register_into` runs when TensorRT-LLM is
being imported anyway.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import List, Optional

from .._autoload import ENV_FMHA_LIBS, LIB_NAME, REGISTRY_MODULES
from ..config import Settings, load_settings, unknown_variables

__all__ = [
    "LIB_NAME",
    "FALLBACK_NAME",
    "register",
    "register_into",
    "current_settings",
    "reload_settings",
    "exact_list_that_works",
]

logger = logging.getLogger("beam_shared_prefix.trtllm")

FALLBACK_NAME = "fallback"
#: Marks the classes this package builds, so re-registration is idempotent.
OUT_OF_TREE_MARK = "_beam_shared_prefix_out_of_tree"

_lock = threading.RLock()
_settings: Optional[Settings] = None
_warned_unknown: set = set()


def reload_settings() -> Settings:
    """Parse the ``TLLM_BEAM_SHARED_PREFIX_*`` variables again (raises ``ConfigError`` on a bad value)."""
    global _settings
    with _lock:
        _settings = load_settings()
        for line in unknown_variables():
            if line not in _warned_unknown:  # once a process: registration runs once per registry module
                _warned_unknown.add(line)
                logger.warning("beam_shared_prefix: %s", line)
        return _settings


def current_settings() -> Settings:
    """The settings parsed at registration (parsed now if registration has not run)."""
    if _settings is None:
        return reload_settings()
    return _settings


def _fmha_package(registry_module_name: str) -> str:
    # "...fmha.registry" -> "...fmha"
    return registry_module_name.rsplit(".", 1)[0]


def _insert_before_fallback(libs: dict, cls) -> None:
    """Put ``LIB_NAME -> cls`` right before ``fallback`` in the dict ``libs``, in place."""
    names = list(libs)
    current = libs.get(LIB_NAME)
    if current is not None and getattr(current, OUT_OF_TREE_MARK, False):
        cls = current  # already registered by this package (possibly through the other path)
    if current is cls and FALLBACK_NAME in names and names.index(LIB_NAME) < names.index(FALLBACK_NAME):
        return
    if current is not None and current is not cls:
        logger.info(
            "beam_shared_prefix: replacing the registry's own %r entry (%s) with the installed package's "
            "library.", LIB_NAME, getattr(current, "__qualname__", current)
        )
    items = [(name, value) for name, value in libs.items() if name != LIB_NAME]
    ordered = []
    for name, value in items:
        if name == FALLBACK_NAME:
            ordered.append((LIB_NAME, cls))
        ordered.append((name, value))
    if FALLBACK_NAME not in libs:
        ordered.append((LIB_NAME, cls))
        logger.warning(
            "beam_shared_prefix: this TensorRT-LLM's FMHA_LIBS has no %r entry; the library was appended "
            "last. Context requests then need another library that accepts them.", FALLBACK_NAME
        )
    # A dict has no positional insert: rebuild it in place so every holder of the object sees it.
    libs.clear()
    libs.update(ordered)


def exact_list_that_works(enabled_names) -> str:
    """The exact-list ``TLLM_FMHA_LIBS`` value that enables the same libraries with ours before fallback."""
    names = [n for n in enabled_names if n != LIB_NAME]
    if FALLBACK_NAME in names:
        names.insert(names.index(FALLBACK_NAME), LIB_NAME)
    else:
        names.append(LIB_NAME)
    return ",".join(names)


def _check_enabled_order(registry) -> None:
    """Warn when the registry's parse of ``TLLM_FMHA_LIBS`` puts the library after ``fallback``, or enables it without
    ``fallback``."""
    parse = getattr(registry, "_parse_fmha_libs_env", None)
    value = os.environ.get(ENV_FMHA_LIBS, "")
    if parse is None or not value.strip():
        return
    try:
        enabled = list(parse())
    except ValueError as exc:  # TensorRT-LLM raises this itself when it builds the model
        logger.warning("beam_shared_prefix: %s=%r is rejected by this TensorRT-LLM: %s", ENV_FMHA_LIBS, value, exc)
        return
    if LIB_NAME in enabled and FALLBACK_NAME not in enabled:
        logger.warning(
            "beam_shared_prefix: %s=%r enables %s but not %r. The library serves generation rows only: a context-only "
            "batch (every prefill and warm-up) needs another enabled library to accept it, or TensorRT-LLM raises 'No "
            "TRT-LLM attention FMHA library supports this request'. Keep the defaults with '+%s', or use the exact "
            "list:\n    %s=%s",
            ENV_FMHA_LIBS,
            value,
            LIB_NAME,
            FALLBACK_NAME,
            LIB_NAME,
            ENV_FMHA_LIBS,
            exact_list_that_works([*enabled, FALLBACK_NAME]),
        )
    elif LIB_NAME in enabled and enabled.index(LIB_NAME) > enabled.index(FALLBACK_NAME):
        logger.warning(
            "beam_shared_prefix: this TensorRT-LLM appends '+' entries of %s after %r, where the library can "
            "never be selected (the fallback library accepts every request first). Use the exact list form "
            "instead:\n    %s=%s",
            ENV_FMHA_LIBS,
            FALLBACK_NAME,
            ENV_FMHA_LIBS,
            exact_list_that_works(enabled),
        )


def register_into(registry):
    """Register the library in one FMHA registry module; returns the registered class.

    Idempotent. Parses the library's settings first, so an invalid
    ``TLLM_BEAM_SHARED_PREFIX_*`` value fails here, at start-up, listing the accepted values.
    """
    from .fmha import fmha_class_for  # torch and TensorRT-LLM's FMHA modules are loaded by now

    reload_settings()
    libs = getattr(registry, "FMHA_LIBS", None)
    if not isinstance(libs, dict):
        raise RuntimeError(
            f"beam_shared_prefix: {registry.__name__} has no FMHA_LIBS dict; this TensorRT-LLM's FMHA registry "
            f"is not supported. Remove {LIB_NAME} from {ENV_FMHA_LIBS}."
        )
    with _lock:
        cls = libs.get(LIB_NAME)
        if cls is None or not getattr(cls, OUT_OF_TREE_MARK, False):
            cls = fmha_class_for(_fmha_package(registry.__name__))
        _insert_before_fallback(libs, cls)
    _check_enabled_order(registry)
    from .planning import try_install_prepare_hook

    try_install_prepare_hook(cls)
    return libs[LIB_NAME]


def register() -> List[str]:
    """Register the library in every FMHA registry this TensorRT-LLM has; returns their module names.

    The explicit counterpart of the start-up hook: call it in a process whose start-up did not
    run ``beam_shared_prefix_autoload.pth`` (for example an embedded interpreter), before any model
    is built. Raises ``RuntimeError`` when no registry module exists.
    """
    done = []
    for name in REGISTRY_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (name == missing or name.startswith(missing + ".")):
                continue  # this layout does not exist in the installed tree
            raise
        register_into(module)
        done.append(name)
    if not done:
        raise RuntimeError(
            "beam_shared_prefix: no TensorRT-LLM FMHA registry found (looked for "
            + " and ".join(REGISTRY_MODULES)
            + "). This TensorRT-LLM predates pluggable FMHA libraries; upgrade it or remove "
            + f"{LIB_NAME} from {ENV_FMHA_LIBS}."
        )
    return done
