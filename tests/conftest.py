"""Shared test configuration.

- ``@pytest.mark.gpu`` tests are skipped, with the reason, when CUDA is absent.
- ``@pytest.mark.gpu_exclusive`` tests (those that compare two timings) hold the GPU alone on a CUDA machine: with
  ``pytest -n 8`` they wait for the other workers' tests to end, and the others wait for them (a lock file). A
  kernel from another process inside a timed call would count in its time.
- ``@pytest.mark.trtllm`` tests are skipped, with the reason, when ``tensorrt_llm`` does not import.
- ``@pytest.mark.interpreter`` tests (Triton kernels on CPU tensors) are skipped, with the reason, on a
  CUDA machine, where the interpreter is off.
- CPU runs of Triton kernels use the interpreter: ``TRITON_INTERPRET=1`` is set here, before any
  test module imports Triton, unless CUDA is present (then kernels run for real).
- Tests that read the committed measurements (``docs/results``, through :mod:`h200_grids` or by path) are marked
  ``results`` here, and skipped with the reason where the folder holds no grids: a GPU machine's copy of the
  checkout leaves them behind (a device call carries at most 64 MiB), and those tests judge the rules, not the GPU.
  In CI (``CI`` set) they are never skipped: missing grids fail them.
"""

import contextlib
import fcntl
import glob
import importlib.util
import inspect
import os
import re
import sys
import tempfile

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


_RESULTS_DIR = os.path.join(_ROOT, "docs", "results")
# What a test's own source names when it reads docs/results: h200_grids' folder, its grid reader (and
# test_decline's wrapper of it), or the path itself.
_READS_RESULTS = ("RESULTS", "grid_points(", '"docs" / "results"', "docs/results")


def _holds_results() -> bool:
    """Whether :data:`_RESULTS_DIR` holds committed grids (``*/*.json``); a device copy may keep the folder empty."""
    return bool(glob.glob(os.path.join(_RESULTS_DIR, "*", "*.json")))


_HELPER_CALL = re.compile(r"\b(_[A-Za-z0-9_]+)\(")


def _reads_results(function, namespace, depth=2) -> bool:
    """Whether ``function``'s source, or that of a module helper it calls (``_name(``, ``depth`` calls down), names
    one of :data:`_READS_RESULTS`."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # pragma: no cover  (no Python source behind it)
        return False
    if any(token in source for token in _READS_RESULTS):
        return True
    helpers = {namespace.get(name) for name in _HELPER_CALL.findall(source)} - {None, function}
    return depth > 0 and any(inspect.isfunction(h) and _reads_results(h, namespace, depth - 1) for h in helpers)


def pytest_collection_modifyitems(config, items):
    has_trtllm = None
    skip_results = not _holds_results() and not os.environ.get("CI")
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _reads_results(function, vars(item.module)):
            item.add_marker(pytest.mark.results)
            if skip_results:
                item.add_marker(pytest.mark.skip(reason=f"reads the committed measurements, and {_RESULTS_DIR} holds "
                                                        f"no grids (a device call's copy of the checkout leaves them)"))
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


_GPU_LOCK_PATH = os.path.join(tempfile.gettempdir(), f"beam_shared_prefix_gpu_{os.getuid()}.lock")
_gpu_lock_files = {}


def _gpu_lock_file(suffix: str):
    if suffix not in _gpu_lock_files:
        _gpu_lock_files[suffix] = open(_GPU_LOCK_PATH + suffix, "a+")  # noqa: SIM115  (held for the session)
    return _gpu_lock_files[suffix]


@contextlib.contextmanager
def _gpu_held(exclusive: bool):
    """A readers-writer lock over the GPU across processes (``flock``). A writer first takes the turnstile, which
    stops new readers, so the writer is not starved by readers that keep overlapping."""
    lock, turnstile = _gpu_lock_file(""), _gpu_lock_file(".turn")
    if exclusive:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX)
    else:
        fcntl.flock(turnstile, fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        if exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_share(request):
    """On a CUDA machine with several pytest workers, ``gpu_exclusive`` tests hold the GPU alone (see the top)."""
    if not HAS_CUDA or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with _gpu_held(request.node.get_closest_marker("gpu_exclusive") is not None):
        yield
