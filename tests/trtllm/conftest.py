"""Fixtures of the TensorRT-LLM integration tests.

``trt(**config)`` installs the interface model (``interface_model.py``: a model of TensorRT-LLM's
interfaces, not TensorRT-LLM) under the real module names for one test; ``with_decline(...)`` installs it with
the library registered and the decline rule on. ``library_env`` gives every
test a clean slate: no stray ``TLLM_*`` variables, the reference prefix backend (the CPU path), the
decline rule off unless a test turns it on, and none of the library's caches from an earlier test.
"""

from __future__ import annotations

import os

import pytest

from interface_model import TrtModel

LIBRARY_VARS = (
    "TLLM_FMHA_LIBS",
    "TLLM_BEAM_SHARED_PREFIX_BACKEND",
    "TLLM_BEAM_SHARED_PREFIX_CHECK",
    "TLLM_BEAM_SHARED_PREFIX_DECLINE",
    "TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS",
    "TRTLLM_FMHA_CACHE_SANITY_CHECK",
)


_HERE = os.path.dirname(os.path.abspath(__file__))


def reset_library_state() -> None:
    """Forget every process-global cache of the library (hook, classes, states, adapters, logs)."""
    from beam_shared_prefix import _autoload
    from beam_shared_prefix.trtllm import fmha, gates, kv_cache, planning, registration

    _autoload.uninstall()
    fmha._classes.clear()
    planning._states.clear()
    planning._instances.clear()
    planning._logged_device_errors.clear()
    planning.retired_families.clear()
    kv_cache._adapters.clear()
    gates.decline_log.reset()
    gates.slow_step_log.reset()
    registration._settings = None
    for counters in (fmha.stats, planning.stats):
        for key in counters:
            counters[key] = 0


@pytest.fixture
def library_env(monkeypatch):
    for name in LIBRARY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "reference")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINE", "never")
    reset_library_state()
    yield monkeypatch
    reset_library_state()


@pytest.fixture
def trt(library_env):
    """Factory: ``trt(layout="new"|"old", plus=..., params=..., sm100=...)`` -> installed ``TrtModel``."""
    models = []

    def make(**config) -> TrtModel:
        model = TrtModel(**config).install()
        models.append(model)
        return model

    yield make
    for model in reversed(models):
        model.uninstall()


@pytest.fixture
def with_decline(trt, monkeypatch):
    """Factory: ``with_decline(backend=None, any_rows=True)`` -> the installed model with the library registered and
    the decline rule on (``backend``: the prefix backend the rule judges). ``any_rows`` lets the interface model's
    2-request batches past the beam-rows threshold (tested on its own in tests/test_decline.py), so that a test can
    judge the prompt and width parts of the rule."""
    from beam_shared_prefix import decline
    from beam_shared_prefix.trtllm import register

    def make(backend=None, any_rows=True) -> TrtModel:
        model = trt(layout="new")
        monkeypatch.setenv("TLLM_FMHA_LIBS", "+beam_shared_prefix")
        monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINE", "auto")
        if backend is not None:
            monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", backend)
        if any_rows:
            monkeypatch.setattr(decline.rows, "MIN_BEAM_ROWS", 1)  # where min_beam_rows reads it
        register()
        return model

    return make
