"""Environment settings, parsed and validated once.

| variable | values | default | meaning |
| --- | --- | --- | --- |
| ``TLLM_BEAM_SHARED_PREFIX_BACKEND`` | ``auto``, ``triton``, ``flashinfer``, ``fa4``, ``reference`` | ``auto`` | prefix backend |
| ``TLLM_BEAM_SHARED_PREFIX_CHECK`` | ``0``, ``1`` (also false/true, off/on, no/yes, any case) | ``0`` | check mode: sync, validate and recompute every stage |
| ``TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS`` | ``0``, ``1`` | ``0`` | device error flag: invalid indices the kernels mask, and tables wrong only together (beams' lengths, write pages held by two rows or by another request, a plan of another batch: the page-table audit, once a step), are reported without a sync (its cost: ``docs/design.md``) |
| ``TLLM_BEAM_SHARED_PREFIX_SHARED_RUN`` | ``auto``, ``1``, ``0`` | ``auto`` | the shared-run stage: on the two-launch paths (FA4 or FlashInfer + tail), attend the generated positions that every beam of a block reads from one ancestor once per block, between the prefix and the tail. ``auto``: on for steps whose longest tail is at least ``SHARED_RUN_MIN_TAIL`` (96) generated tokens, where it measured faster, and off under CUDA graphs (a captured step's tail is unknown); ``1``: on every step; ``0``: never |
| ``TLLM_BEAM_SHARED_PREFIX_MAX_TAIL`` | an int >= 1 | unset | the longest tail any step will have, in generated tokens per beam (its own included); where it is at most 16 the cascade's CUDA-graph captures leave out the long-tail (shared-ancestry) path, 1-26% a step in some tilings at short tails. A longer step stays exact, logs a warning once, and runs without that path |
| ``TLLM_BEAM_SHARED_PREFIX_DECLINE`` | ``auto``, ``never`` | ``auto`` | ``auto`` declines shapes where the measured rule says the library is slower than the default kernel; ``never`` serves every supported shape |

An invalid value raises :class:`ConfigError` naming the variable, the value and the accepted values. A variable with the
prefix that is none of these (a misspelling) is named by :func:`unknown_variables`, which registration logs.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import List, Mapping, Optional

__all__ = ["ConfigError", "Settings", "load_settings", "BACKENDS", "DECLINE_MODES", "SHARED_RUN_MODES",
           "shared_run_mode", "triton_interpret_env", "unknown_variables", "ENV_PREFIX", "ENV_VARIABLES"]

BACKENDS = ("auto", "triton", "flashinfer", "fa4", "reference")
DECLINE_MODES = ("auto", "never")
#: The shared-run stage: ``auto`` (by the step's tail), ``on`` (every step), ``off``.
SHARED_RUN_MODES = ("auto", "on", "off")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

ENV_BACKEND = "TLLM_BEAM_SHARED_PREFIX_BACKEND"
ENV_CHECK = "TLLM_BEAM_SHARED_PREFIX_CHECK"
ENV_DECLINE = "TLLM_BEAM_SHARED_PREFIX_DECLINE"
ENV_REPORT_ERRORS = "TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS"
ENV_SHARED_RUN = "TLLM_BEAM_SHARED_PREFIX_SHARED_RUN"
ENV_MAX_TAIL = "TLLM_BEAM_SHARED_PREFIX_MAX_TAIL"
ENV_PREFIX = "TLLM_BEAM_SHARED_PREFIX_"
#: Every variable the library reads.
ENV_VARIABLES = (ENV_BACKEND, ENV_CHECK, ENV_DECLINE, ENV_REPORT_ERRORS, ENV_SHARED_RUN, ENV_MAX_TAIL)


class ConfigError(ValueError):
    """An environment variable holds a value the library does not accept."""


@dataclass(frozen=True)
class Settings:
    """Parsed environment settings (see the module table): prefix ``backend``, ``check`` mode, ``decline``
    mode, ``report_errors`` (the device error flag), ``shared_run`` (the shared-run stage: one of
    :data:`SHARED_RUN_MODES`), ``max_tail_len`` (the longest tail any step will have; ``None``: unset)."""

    backend: str = "auto"
    check: bool = False
    decline: str = "auto"
    report_errors: bool = False
    shared_run: str = "auto"
    max_tail_len: int | None = None


def _choice(env: Mapping[str, str], name: str, accepted, default: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in accepted:
        raise ConfigError(f"{name}={raw!r} is not accepted; use one of: {', '.join(accepted)} (default {default}).")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not accepted; use 1 (on) or 0 (off).")


def shared_run_mode(value) -> str:
    """The shared-run mode of a setting: ``"auto"``, ``True``/``"on"``/``"1"`` (``"on"``), ``False``/``"off"``/``"0"``
    (``"off"``). Raises ``ValueError`` naming the accepted values otherwise."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in _TRUE:
        return "on"
    if text in _FALSE and text != "":
        return "off"
    raise ValueError(
        f"shared_run={value!r} is not accepted; use 'auto' (by the step's tail), True/'on' or False/'off'."
    )


def _shared_run(env: Mapping[str, str]) -> str:
    raw = env.get(ENV_SHARED_RUN)
    if raw is None or raw.strip() == "":
        return "auto"
    try:
        return shared_run_mode(raw)
    except ValueError:
        raise ConfigError(f"{ENV_SHARED_RUN}={raw!r} is not accepted; use auto (by the step's tail, the default), "
                          f"1 (on) or 0 (off).") from None


def _max_tail(env: Mapping[str, str]) -> int | None:
    raw = env.get(ENV_MAX_TAIL)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    # isdecimal and ASCII: str.isdigit also takes superscripts ('²'), which int() refuses.
    if not (text.isascii() and text.isdecimal()) or int(text) < 1:
        raise ConfigError(f"{ENV_MAX_TAIL}={raw!r} is not accepted; use an integer >= 1 (the longest tail in generated "
                          f"tokens per beam), or leave it unset where the tail is unknown.")
    return int(text)


def triton_interpret_env(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton for its interpreter, read as Triton reads it (``1``, ``true``,
    ``on``, ``yes``, any case), without importing Triton."""
    env = os.environ if env is None else env
    return env.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


_PARSERS = {
    "backend": lambda env: _choice(env, ENV_BACKEND, BACKENDS, "auto"),
    "check": lambda env: _flag(env, ENV_CHECK),
    "decline": lambda env: _choice(env, ENV_DECLINE, DECLINE_MODES, "auto"),
    "report_errors": lambda env: _flag(env, ENV_REPORT_ERRORS),
    "shared_run": _shared_run,
    "max_tail_len": _max_tail,
}


def unknown_variables(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """One line for each variable of ``env`` (``os.environ`` by default) that starts with :data:`ENV_PREFIX` but is none
    the library reads (a misspelling would leave that setting at its default without a word), naming the closest
    variable it reads where one is close."""
    env = os.environ if env is None else env
    lines = []
    # Matched on the part after the prefix: with it, every name is close to every other.
    known = [v.removeprefix(ENV_PREFIX) for v in ENV_VARIABLES]
    for name in sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in ENV_VARIABLES):
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1, cutoff=0.75)
        hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else f"the library reads {', '.join(ENV_VARIABLES)}"
        lines.append(f"{name} is not a setting of this library and is ignored; {hint}")
    return lines


def load_settings(env: Optional[Mapping[str, str]] = None, fields=None) -> Settings:
    """Parse the library's environment variables (``os.environ`` by default): every one, or only the
    :class:`Settings` ``fields`` named (the others keep their defaults, and an invalid value there is not read)."""
    env = os.environ if env is None else env
    return Settings(**{name: parse(env) for name, parse in _PARSERS.items() if fields is None or name in fields})
