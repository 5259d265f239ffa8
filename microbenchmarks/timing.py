"""Timing: CUDA events per call with a queued backlog, CUDA-graph capture, and a CPU timer.

Device time of one call is measured between two CUDA events recorded around it. So that the host
(FA4 spends 120-210 us of Python per eager call) never starves the GPU, calls are enqueued in
chunks behind a ``torch.cuda._sleep`` spin kernel long enough to cover the chunk's host time: the
GPU then runs the chunk back to back and the events measure the kernels, not the launch gaps.
Between calls an optional L2 flush (outside the events) makes every call start cold, as a layer's KV
does in a real model; input sets are rotated call by call. Two flushes: ``read`` (the default) sums a
buffer larger than L2, leaving L2 full of clean lines, as the weight-reading GEMMs before an
attention layer do; ``write`` memsets it, leaving L2 full of dirty lines that the timed call must
write back to HBM as it misses (up to the whole L2, 50 MB on an H200, charged to the call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["GraphedCall", "capture_graph", "time_cuda", "time_cpu", "TimingResult", "L2_FLUSH_MODES", "L2Flush"]

# How L2 is emptied between timed calls (see the module docstring).
L2_FLUSH_MODES = ("read", "write", "none")


@dataclass
class TimingResult:
    """Per-call times in microseconds, grouped by input set."""

    per_set_us: List[List[float]]

    @property
    def all_us(self) -> List[float]:
        """Every per-call time, all sets together (us)."""
        return [t for s in self.per_set_us for t in s]

    @property
    def median_us(self) -> float:
        """Median per-call time over all sets (us)."""
        return float(np.median(self.all_us))

    @property
    def set_medians_us(self) -> List[float]:
        """Median per-call time of each input set (us)."""
        return [float(np.median(s)) for s in self.per_set_us]

    @property
    def min_us(self) -> float:
        """Fastest call (us)."""
        return float(np.min(self.all_us))

    def to_dict(self) -> dict:
        """JSON-ready dict of the fields (used in the results document)."""
        return {
            "median_us": self.median_us,
            "min_us": self.min_us,
            "set_medians_us": self.set_medians_us,
            "samples": len(self.all_us),
        }


class GraphedCall:
    """A CUDA graph replaying one call; ``__call__`` replays it and returns the captured result."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", result):
        self.graph = graph
        self.result = result

    def __call__(self):
        self.graph.replay()
        return self.result


def capture_graph(fn: Callable[[], object], warmup: int = 2, pool=None) -> GraphedCall:
    """Warm ``fn`` up on a side stream, then capture one call of it into a CUDA graph.

    ``fn`` must do device work only (no host sync, no planning). Raises what capture raises.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = fn()
    torch.cuda.synchronize()
    return GraphedCall(graph, result)


_CYCLES_PER_US: Optional[float] = None


def _cycles_per_us() -> float:
    """Calibrate ``torch.cuda._sleep`` (spin cycles) against CUDA events once per process."""
    global _CYCLES_PER_US
    if _CYCLES_PER_US is None:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_US = cycles / max(start.elapsed_time(end) * 1e3, 1.0)
    return _CYCLES_PER_US


class L2Flush:
    """Empties L2 between timed calls: ``read`` sums a ``nbytes`` buffer (clean lines left in L2),
    ``write`` zeroes it (dirty lines left in L2), ``none`` does nothing."""

    def __init__(self, mode: str = "read", nbytes: int = 256 << 20, device: str = "cuda"):
        if mode not in L2_FLUSH_MODES:
            raise ValueError(f"L2 flush mode {mode!r} is not one of {L2_FLUSH_MODES}")
        self.mode = mode
        # float32 so the read is one vectorised reduction; its 4-byte result is all it writes.
        self.buffer = (None if mode == "none" or nbytes <= 0
                       else torch.ones(nbytes // 4, dtype=torch.float32, device=device))
        self._sum = torch.empty((), dtype=torch.float32, device=device) if self.buffer is not None else None

    def __call__(self) -> None:
        if self.buffer is None:
            return
        if self.mode == "read":
            torch.sum(self.buffer, dim=0, out=self._sum)
        else:
            self.buffer.zero_()


def time_cuda(
    fns: Sequence[Callable[[], object]],
    iters: int = 20,
    warmup: int = 3,
    flush_l2_bytes: int = 256 << 20,
    max_backlog_us: float = 200_000.0,
    l2_flush: str = "read",
) -> TimingResult:
    """Device time of each call, ``iters`` calls per input set, sets rotated call by call.

    Args:
        fns: one callable per input set (a :class:`GraphedCall` or an eager closure).
        iters: timed calls per set.
        warmup: untimed calls per set first.
        flush_l2_bytes: bytes of the L2 flush between calls, outside the events (0: no flush).
        max_backlog_us: longest spin queued ahead of one chunk of calls.
        l2_flush: ``read``, ``write`` or ``none`` (:class:`L2Flush`).
    """
    nsets = len(fns)
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    flush = L2Flush(l2_flush, flush_l2_bytes)

    # Host time per call (enqueue only), to size the spin that keeps the GPU queue ahead.
    t0 = time.perf_counter()
    for fn in fns:
        flush()
        fn()
    host_us = (time.perf_counter() - t0) / nsets * 1e6 + 10.0
    torch.cuda.synchronize()

    total = iters * nsets
    chunk = int(max(1, min(total, max_backlog_us // host_us)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    have_sleep = hasattr(torch.cuda, "_sleep")
    cpu_per_us = _cycles_per_us() if have_sleep else 0.0
    k = 0
    while k < total:
        n = min(chunk, total - k)
        if have_sleep:
            torch.cuda._sleep(int(1.5 * n * host_us * cpu_per_us))
        for j in range(k, k + n):
            flush()
            starts[j].record()
            fns[j % nsets]()
            ends[j].record()
        k += n
    torch.cuda.synchronize()
    per_set: List[List[float]] = [[] for _ in range(nsets)]
    for j in range(total):
        per_set[j % nsets].append(starts[j].elapsed_time(ends[j]) * 1e3)
    del flush
    return TimingResult(per_set)


def time_cpu(fns: Sequence[Callable[[], object]], iters: int = 5, warmup: int = 1) -> TimingResult:
    """Wall time of each call with ``time.perf_counter`` (CPU path), sets rotated call by call."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    per_set: List[List[float]] = [[] for _ in fns]
    for j in range(iters * len(fns)):
        s = j % len(fns)
        t0 = time.perf_counter()
        fns[s]()
        per_set[s].append((time.perf_counter() - t0) * 1e6)
    return TimingResult(per_set)
