"""How this package launches its kernels: under the tensors' device, with the compiler options they were tuned with.

FP fusion (LLVM's and ptxas's contraction of a multiply and an add into one FMA) is on in every measurement in
``docs/``: it is Triton's default from 3.4 to 3.9. Triton 3.9 warns once a process that the default turns off in
3.10 (``TRITON_DEFAULT_FP_FUSION``), which would change the kernels' code and rounding under the rules fitted to
them, and would put that warning in every serving log. Asking for it at each launch keeps the measured code on any
Triton version and keeps the warning out. On Triton 3.9, ``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off;
Triton 3.4-3.6 have no such switch, and their ``TRITON_DEFAULT_FP_FUSION=0`` no longer reaches these kernels.
"""

from __future__ import annotations

import torch

__all__ = ["COMPILE_OPTIONS", "launch"]

#: Compiler options of every launch of this package's kernels (the ahead-of-time compile tests use them too).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def launch(kernel, grid, args, meta, device: torch.device):
    """Run ``kernel[grid](*args, **meta, **COMPILE_OPTIONS)`` and return what it returns.

    ``device`` is the device of the launch's tensors. On CUDA the launch runs under it, so that a batch on another
    GPU than the current one runs on that GPU, on its current stream; elsewhere (CPU tensors under
    ``TRITON_INTERPRET=1``, whose interpreter drops compiler options) it runs as it is.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            return kernel[grid](*args, **meta, **COMPILE_OPTIONS)
    return kernel[grid](*args, **meta, **COMPILE_OPTIONS)
