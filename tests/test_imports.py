"""Import hygiene: the core package must import without its optional, heavy dependencies.

Each case imports modules in a fresh interpreter (the test process has already imported torch,
Triton and maybe more) and lists which of the forbidden top-level modules ended up in
``sys.modules``. FlashInfer, flash-attn and TensorRT-LLM are imported lazily inside the functions
that use them; Triton only when a tail kernel is launched; the planner alone needs only numpy.
"""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OPTIONAL = ["flashinfer", "flash_attn", "cutlass", "tensorrt_llm"]


def _loaded_after_import(modules, watched):
    """Import ``modules`` in a fresh interpreter; return the subset of ``watched`` it loaded."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {list(watched)!r} if m in sys.modules)))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TLLM_FMHA_LIBS", None)  # the installed .pth would register the TensorRT-LLM adapter
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"importing {modules} failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_package_import_is_numpy_only():
    # `import beam_shared_prefix` exposes the planner; the wrapper is a lazy attribute.
    assert _loaded_after_import(["beam_shared_prefix"], ["torch", "triton"] + _OPTIONAL) == []


@pytest.mark.parametrize(
    "modules",
    [
        ["beam_shared_prefix.attention", "beam_shared_prefix.prefix", "beam_shared_prefix.reference"],
        ["beam_shared_prefix.check", "beam_shared_prefix.testing", "beam_shared_prefix.decline"],
    ],
    ids=["wrapper-and-backends", "check-testing-decline"],
)
def test_core_modules_import_no_optional_backend(modules):
    assert _loaded_after_import(modules, ["triton"] + _OPTIONAL) == []


def test_tail_kernel_package_needs_only_torch_and_triton():
    assert _loaded_after_import(["triton_kernels"], _OPTIONAL) == []
