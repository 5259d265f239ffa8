"""Two one-thread kernels whose names bracket each call in a kernel trace (:func:`.timing.time_kernels`)."""

import triton
import triton.language as tl

__all__ = ["_bench_call_start", "_bench_call_end"]


@triton.jit
def _bench_call_start(tick_ptr):
    """Launched just before a timed call: its kernels come after this one."""
    tl.store(tick_ptr, tl.load(tick_ptr) + 1)


@triton.jit
def _bench_call_end(tick_ptr):
    """Launched just after a timed call: its kernels came before this one."""
    tl.store(tick_ptr, tl.load(tick_ptr) + 1)
