"""Environment settings, parsed and validated once.

| variable | values | default | meaning |
| --- | --- | --- | --- |
| ``TLLM_BEAM_SHARED_PREFIX_BACKEND`` | ``auto``, ``triton``, ``flashinfer``, ``fa4``, ``reference`` | ``auto`` | prefix backend |
| ``TLLM_BEAM_SHARED_PREFIX_CHECK`` | ``0``, ``1`` | ``0`` | check mode: sync, validate and recompute every stage |
| ``TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS`` | ``0``, ``1`` | ``0`` | device error flag: invalid indices the kernels mask are reported without a sync (about 2% slower on the H200 presets, B-beam14 3%) |
| ``TLLM_BEAM_SHARED_PREFIX_SHARED_RUN`` | ``0``, ``1`` | ``0`` | on the two-launch paths (FA4 or FlashInfer + tail), attend the generated positions that every beam of a block reads from one ancestor once per block, between the prefix and the tail (opt-in: checked on the CPU, not yet timed on a GPU) |
| ``TLLM_BEAM_SHARED_PREFIX_DECLINE`` | ``auto``, ``never`` | ``auto`` | ``auto`` declines shapes where the measured rule says the library is slower than the default kernel; ``never`` serves every supported shape |

An invalid value raises :class:`ConfigError` naming the variable, the value and the accepted values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["ConfigError", "Settings", "load_settings", "BACKENDS", "DECLINE_MODES"]

BACKENDS = ("auto", "triton", "flashinfer", "fa4", "reference")
DECLINE_MODES = ("auto", "never")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

ENV_BACKEND = "TLLM_BEAM_SHARED_PREFIX_BACKEND"
ENV_CHECK = "TLLM_BEAM_SHARED_PREFIX_CHECK"
ENV_DECLINE = "TLLM_BEAM_SHARED_PREFIX_DECLINE"
ENV_REPORT_ERRORS = "TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS"
ENV_SHARED_RUN = "TLLM_BEAM_SHARED_PREFIX_SHARED_RUN"


class ConfigError(ValueError):
    """An environment variable holds a value the library does not accept."""


@dataclass(frozen=True)
class Settings:
    """Parsed environment settings (see the module table): prefix ``backend``, ``check`` mode, ``decline``
    mode, ``report_errors`` (the device error flag), ``shared_run`` (the shared-run stage)."""

    backend: str = "auto"
    check: bool = False
    decline: str = "auto"
    report_errors: bool = False
    shared_run: bool = False


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


def load_settings(env: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse the library's environment variables (``os.environ`` by default)."""
    env = os.environ if env is None else env
    return Settings(
        backend=_choice(env, ENV_BACKEND, BACKENDS, "auto"),
        check=_flag(env, ENV_CHECK),
        decline=_choice(env, ENV_DECLINE, DECLINE_MODES, "auto"),
        report_errors=_flag(env, ENV_REPORT_ERRORS),
        shared_run=_flag(env, ENV_SHARED_RUN),
    )
