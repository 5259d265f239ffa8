"""Shared test configuration.

- ``@pytest.mark.gpu`` tests are skipped, with the reason, when CUDA is absent.
- ``@pytest.mark.trtllm`` tests are skipped, with the reason, when ``tensorrt_llm`` does not import.
- ``@pytest.mark.interpreter`` tests (Triton kernels on CPU tensors) are skipped, with the reason, on a
  CUDA machine, where the interpreter is off.
- CPU runs of Triton kernels use the interpreter: ``TRITON_INTERPRET=1`` is set here, before any
  test module imports Triton, unless CUDA is present (then kernels run for real).
"""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton makes a kernel interpreted or compiled when it is decorated, at import. Some tests set
# TRITON_INTERPRET for a moment (to ask what a CPU would be offered); had one of them been the first to
# import the kernels on a CUDA machine, every later launch in the session would go to the interpreter with
# the variable unset again, and fail inside Triton (seen on the H200 running tests/prefix/test_triton_backend.py
# alone). Import them here, under the session's own setting.
try:
    import triton_kernels  # noqa: F401
except ImportError:  # pragma: no cover  (Triton missing: the kernel tests say so themselves)
    pass

import pytest  # noqa: E402


def _trtllm_importable() -> bool:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False
    try:
        import tensorrt_llm  # noqa: F401

        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    has_trtllm = None
    for item in items:
        if item.get_closest_marker("interpreter") is not None and HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="runs Triton on CPU tensors, which needs TRITON_INTERPRET=1; "
                                                    "it is off on a CUDA machine (the GPU tests cover the kernel)"))
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("trtllm") is not None:
            if has_trtllm is None:
                has_trtllm = _trtllm_importable()
            if not has_trtllm:
                item.add_marker(pytest.mark.skip(reason="needs tensorrt_llm, which does not import here"))


@pytest.fixture
def device():
    """``cuda`` when available, else ``cpu`` (Triton kernels then run under TRITON_INTERPRET=1)."""
    return "cuda" if HAS_CUDA else "cpu"
