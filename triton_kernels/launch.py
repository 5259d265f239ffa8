"""How this package launches its kernels: under the tensors' device, with the compiler options they were tuned with,
and as programmatic dependents of the kernel before them where the GPU has that.

FP fusion (LLVM's and ptxas's contraction of a multiply and an add into one FMA) is on in every measurement in
``docs/``: it is Triton's default from 3.4 to 3.9. Triton 3.9 warns once a process that the default turns off in
3.10 (``TRITON_DEFAULT_FP_FUSION``), which would change the kernels' code and rounding under the rules fitted to
them, and would put that warning in every serving log. Asking for it at each launch keeps the measured code on any
Triton version and keeps the warning out. On Triton 3.9, ``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off;
Triton 3.4-3.6 have no such switch, and their ``TRITON_DEFAULT_FP_FUSION=0`` no longer reaches these kernels.

Programmatic dependent launch (PDL, SM90 and newer). A launcher that asks for it (``pdl=True``) gets Triton's
``launch_pdl=True`` and the kernel's ``PDL`` constexpr, whose first statement is then ``gdc_wait()``: the kernel may
be scheduled while the kernel before it in the stream finishes, and waits there, before any load or store, for that
kernel to complete and its writes to be visible. Nothing is read early, so the order of the step is the stream's
whatever the kernel before wrote; what it saves is the launch gap. In a CUDA graph of layers on an H200
(``docs/rounds.md``, "The eightieth round") the cascade behind a producer that releases its dependents took 1.4-1.5
us less a layer at B-short and B-medium, 0.7 us behind a cuBLAS GEMM; on an H100 behind the GEMM, nothing. It
follows TensorRT-LLM's switch, ``TRTLLM_ENABLE_PDL`` (on unless ``"0"``), read once a process per device. Never
under the interpreter (no PTX to run) nor on ROCm.
"""

from __future__ import annotations

import os

import torch

from .step_args import runs_interpreted

__all__ = ["COMPILE_OPTIONS", "PDL_ENV", "launch", "pdl_enabled"]

#: Compiler options of every launch of this package's kernels (the ahead-of-time compile tests use them too).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

#: TensorRT-LLM's PDL switch, which this package follows: PDL unless it is ``"0"``.
PDL_ENV = "TRTLLM_ENABLE_PDL"

# device index -> PDL on (read once: TensorRT-LLM reads its switch once a process; the launchers stay cheap).
_PDL_BY_DEVICE: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: an NVIDIA CUDA device of compute capability 9.0 or newer (not ROCm,
    whose MI300 also reports 9.x), and ``TRTLLM_ENABLE_PDL`` not ``"0"``. Cached per device for the process
    (``pdl_enabled.cache_clear()`` forgets)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _PDL_BY_DEVICE.get(index)
    if on is None:
        on = (os.environ.get(PDL_ENV, "1") != "0" and torch.version.hip is None
              and torch.cuda.get_device_capability(index)[0] >= 9)
        _PDL_BY_DEVICE[index] = on
    return on


pdl_enabled.cache_clear = _PDL_BY_DEVICE.clear


def launch(kernel, grid, args, meta, device: torch.device, pdl: bool = False):
    """Run ``kernel[grid](*args, **meta, **COMPILE_OPTIONS)`` and return what it returns.

    ``device`` is the device of the launch's tensors. On CUDA the launch runs under it, so that a batch on another
    GPU than the current one runs on that GPU, on its current stream; elsewhere (CPU tensors under
    ``TRITON_INTERPRET=1``, whose interpreter drops compiler options) it runs as it is. ``pdl``: the kernel takes a
    ``PDL`` constexpr (``gdc_wait()`` first); where :func:`pdl_enabled`, it is set and the launch is a programmatic
    dependent.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            # (the interpreter, which CUDA tensors may run under, cannot run the wait's inline PTX)
            if pdl and not runs_interpreted(kernel) and pdl_enabled(device):
                return kernel[grid](*args, **meta, PDL=True, launch_pdl=True, **COMPILE_OPTIONS)
            return kernel[grid](*args, **meta, **COMPILE_OPTIONS)
    return kernel[grid](*args, **meta, **COMPILE_OPTIONS)
