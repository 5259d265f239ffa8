"""The device side of programmatic dependent launch (:mod:`triton_kernels.launch`): the wait a dependent kernel
runs before its first load.

``griddepcontrol.wait`` (PTX, SM90 and newer) blocks until the kernels this one depends on have completed and
their writes are visible; in a kernel not launched as a dependent it returns at once. Triton ships it as
``triton.language.extra.cuda.gdc_wait``, but Triton 3.4's (the oldest this package accepts) fails to build
(its ``_builder`` keyword predates 3.4's ``_semantic``), so the package emits the instruction itself.
"""

import triton
import triton.language as tl

__all__ = ["wait_for_prior_grids"]


@triton.jit
def wait_for_prior_grids():
    """``griddepcontrol.wait``; call it only under a ``PDL`` constexpr (the CPU interpreter cannot run it)."""
    # The asm must return a value to be emitted; the dummy register is never read. Not pure: kept in place.
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
