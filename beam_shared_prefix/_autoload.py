"""Start-up hook: register the library with TensorRT-LLM in every process that asks for it.

``beam_shared_prefix_autoload.pth`` (installed into ``site-packages``) runs, in every Python
process at start-up::

    'beam_shared_prefix' in os.environ.get('TLLM_FMHA_LIBS', '') and <this module>.install()

so a process whose ``TLLM_FMHA_LIBS`` does not mention the library pays one dictionary lookup and
imports nothing. When it is mentioned, :func:`install` puts a small finder at the front of
``sys.meta_path``. The finder does nothing until TensorRT-LLM's FMHA registry module is imported
(``tensorrt_llm._torch.attention.backends.fmha.registry`` or, on older trees,
``tensorrt_llm._torch.attention_backend.fmha.registry``); it then wraps that module's loader so
that, right after the registry module has executed, :func:`beam_shared_prefix.trtllm.register_into`
inserts the library into ``FMHA_LIBS`` before ``fallback``. TensorRT-LLM's worker processes (MPI
or spawned) run their own start-up, so they register themselves the same way, before any layer is
built.

This module imports only the standard library: it runs at interpreter start-up, and must not pull
in torch (or anything heavy) there.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
from typing import Callable, Dict, List, Mapping, Optional

__all__ = [
    "LIB_NAME",
    "ENV_FMHA_LIBS",
    "REGISTRY_MODULES",
    "env_names_library",
    "install",
    "uninstall",
    "is_installed",
    "when_imported",
]

LIB_NAME = "beam_shared_prefix"
ENV_FMHA_LIBS = "TLLM_FMHA_LIBS"
#: The registry module on the current (first) and the older (second) source layout.
REGISTRY_MODULES = (
    "tensorrt_llm._torch.attention.backends.fmha.registry",
    "tensorrt_llm._torch.attention_backend.fmha.registry",
)

_lock = threading.RLock()
_callbacks: Dict[str, List[Callable]] = {}
_guard = threading.local()


def env_names_library(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``TLLM_FMHA_LIBS`` names this library as one of its entries.

    Any entry counts (``beam_shared_prefix``, ``+beam_shared_prefix`` or ``-beam_shared_prefix``):
    TensorRT-LLM rejects an unknown name in either form, so the library must be registered
    whenever the variable mentions it. Registration alone never enables it (it stays opt-in).
    """
    env = os.environ if env is None else env
    value = env.get(ENV_FMHA_LIBS) or ""
    for token in value.split(","):
        name = token.strip()
        if name[:1] in ("+", "-"):
            name = name[1:].strip()
        if name == LIB_NAME:
            return True
    return False


def _module_ready(name: str):
    """The fully executed module ``name`` from ``sys.modules``, or ``None``."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None  # mid-import: its loader will still run the callbacks if we wrapped it
    return module


def _run_callbacks(name: str, module) -> None:
    with _lock:
        callbacks = list(_callbacks.get(name, ()))
    for callback in callbacks:
        callback(module)


class _PostImportLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks registered for the module."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # Introspection (inspect.getsource, importlib.resources) should see the real loader.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_callbacks(self._name, module)

    def __getattr__(self, item):
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader another finder returns for a watched module."""

    def find_spec(self, fullname, path=None, target=None):
        with _lock:
            watched = fullname in _callbacks
        if not watched or getattr(_guard, "active", False):
            return None
        _guard.active = True  # a finder that recurses into sys.meta_path must not re-enter us
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _guard.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


_finder: Optional[_PostImportFinder] = None


def _ensure_finder() -> None:
    global _finder
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def is_installed() -> bool:
    """Whether the post-import finder sits in ``sys.meta_path``."""
    return _finder is not None and _finder in sys.meta_path


def when_imported(name: str, callback: Callable) -> None:
    """Run ``callback(module)`` once ``name`` has been imported (now, if it already has been).

    The callback runs right after the module's own code, inside the import statement that loads
    it; an exception it raises propagates out of that import.
    """
    with _lock:
        callbacks = _callbacks.setdefault(name, [])
        if callback not in callbacks:
            callbacks.append(callback)
    _ensure_finder()
    module = _module_ready(name)
    if module is not None:
        callback(module)


def _register_registry(module) -> None:
    # Imported here, not at the top: this is the first point where TensorRT-LLM (and torch) are
    # being loaded anyway.
    from beam_shared_prefix.trtllm.registration import register_into

    register_into(module)


def install(env: Optional[Mapping[str, str]] = None) -> bool:
    """Install the registration hook when ``TLLM_FMHA_LIBS`` names the library.

    Returns True when installed (or already installed), False when the variable does not name
    the library (then nothing is changed). Imports only the standard library unless a registry
    module is already loaded, in which case it registers right away.
    """
    if not env_names_library(env):
        return False
    for name in REGISTRY_MODULES:
        when_imported(name, _register_registry)
    return True


def uninstall() -> None:
    """Remove the finder and forget every callback (tests)."""
    global _finder
    with _lock:
        _callbacks.clear()
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
