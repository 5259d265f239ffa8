"""Timing: CUDA events per call with a queued backlog, CUDA-graph capture, kernel spans, a CPU timer.

Device time of one call is measured between two CUDA events recorded around it. So that the host
(FA4 spends 120-210 us of Python per eager call) never starves the GPU, calls are enqueued in
chunks behind a ``torch.cuda._sleep`` spin kernel long enough to cover the chunk's host time: the
GPU then runs the chunk back to back and the events measure the kernels, not the launch gaps. A chunk
whose issue outlasts its spin (a busy CPU) is a try that may hold host gaps: the calls are timed again
behind a spin twice as long, up to ``_BACKLOG_TRIES`` tries (:attr:`TimingResult.host_gaps` if all fail).
Between calls an optional L2 flush (outside the events) makes every call start cold, as a layer's KV
does in a real model; input sets are rotated call by call. Two flushes: ``read`` (the default) sums a
buffer larger than L2, leaving L2 full of clean lines, as the weight-reading GEMMs before an
attention layer do; ``write`` memsets it, leaving L2 full of dirty lines that the timed call must
write back to HBM as it misses (up to the whole L2, 50 MB on an H200, charged to the call).

What the events cannot separate. Two events around one launch also measure the launch itself: on
the H200 an empty kernel measures about 4 us this way (:func:`measure_event_overhead`), a quarter of
a 16 us floor. :func:`time_kernels` measures the same calls a second way, as FlashInfer's
benchmarks do: the span of each call's kernels in the CUPTI trace (``torch.profiler``), from its
first kernel's start to its last kernel's end, with the gaps between kernels of one call included.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["GraphedCall", "capture_graph", "time_cuda", "time_cpu", "time_kernels", "call_spans_us",
           "measure_event_overhead", "TimingResult", "L2_FLUSH_MODES", "L2Flush", "CALL_START", "CALL_END",
           "sleep_cycles_per_us"]

# How L2 is emptied between timed calls (see the module docstring).
L2_FLUSH_MODES = ("read", "write", "none")


@dataclass
class TimingResult:
    """Per-call times in microseconds, grouped by input set; ``host_gaps``: the host outran the queued spin in
    every try, so a call's time may include a wait on the host (a busy CPU)."""

    per_set_us: List[List[float]]
    host_gaps: bool = False

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

    @classmethod
    def from_rotated(cls, calls_us: Sequence[float], nsets: int, host_gaps: bool = False) -> "TimingResult":
        """Group per-call times of calls that rotate over ``nsets`` input sets (call ``j`` ran set ``j % nsets``)."""
        return cls([[float(t) for t in calls_us[s::nsets]] for s in range(nsets)], host_gaps)

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


def sleep_cycles_per_us() -> float:
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


# The spin ahead of each chunk lasts this many times the chunk's probed host time; each retry after the host outran
# a spin doubles it (a busy CPU can enqueue slower than it did when probed).
_SPIN_MARGIN = 1.5
_BACKLOG_TRIES = 3


def _run_backlogged(fns: Sequence[Callable[[], object]], total: int, warmup: int, enqueue: Callable[[int], None],
                    max_backlog_us: float = 200_000.0, margin: float = _SPIN_MARGIN) -> Tuple[int, bool]:
    """Warm every call up, then ``enqueue(j)`` for ``j < total`` in chunks, each queued behind a
    ``torch.cuda._sleep`` spin of ``margin`` times the chunk's host time, so the GPU runs the chunk back
    to back (no host gap inside or between calls); returns after the device finishes. The host time is
    probed by enqueueing the first calls once more, unqueued: returns how many (they come first), and
    whether every chunk was enqueued within its spin (if not, the GPU may have waited on the host
    inside a call, which would then count in its time)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    # Host time per call (enqueue only, measured on the first calls), to size the spin.
    probe = min(len(fns), total)
    t0 = time.perf_counter()
    for j in range(probe):
        enqueue(j)
    host_us = (time.perf_counter() - t0) / max(probe, 1) * 1e6 + 10.0
    torch.cuda.synchronize()
    chunk = int(max(1, min(total, max_backlog_us // host_us)))
    have_sleep = hasattr(torch.cuda, "_sleep")
    cpu_per_us = sleep_cycles_per_us() if have_sleep else 0.0
    covered = True
    k = 0
    while k < total:
        n = min(chunk, total - k)
        spin_us = margin * n * host_us
        t0 = time.perf_counter()
        if have_sleep:
            torch.cuda._sleep(int(spin_us * cpu_per_us))
        for j in range(k, k + n):
            enqueue(j)
        # The spin started no earlier than it was queued: a chunk enqueued within it never ran dry.
        covered &= not have_sleep or (time.perf_counter() - t0) * 1e6 <= spin_us
        k += n
    torch.cuda.synchronize()
    return probe, covered


def _run_until_covered(fns: Sequence[Callable[[], object]], total: int, warmup: int, enqueue: Callable[[int], None],
                       max_backlog_us: float,
                       around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """:func:`_run_backlogged` until a try enqueues every chunk within its spin, up to ``_BACKLOG_TRIES`` tries, the
    spin doubled each time (the warm-up in full only at the first); each try runs inside a fresh ``around()``.
    Returns ``(probe, covered, what the last try's around() gave)``."""
    for attempt in range(_BACKLOG_TRIES):
        with around() as held:
            probe, covered = _run_backlogged(fns, total, warmup if attempt == 0 else 1, enqueue, max_backlog_us,
                                             margin=_SPIN_MARGIN * 2**attempt)
        if covered:
            break
    return probe, covered, held


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
    total = iters * nsets
    flush = L2Flush(l2_flush, flush_l2_bytes)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]

    def enqueue(j: int) -> None:
        flush()
        starts[j].record()
        fns[j % nsets]()
        ends[j].record()

    _, covered, _ = _run_until_covered(fns, total, warmup, enqueue, max_backlog_us)  # (once the device is done)
    del flush
    return TimingResult.from_rotated([starts[j].elapsed_time(ends[j]) * 1e3 for j in range(total)], nsets,
                                     host_gaps=not covered)


def measure_event_overhead(iters: int = 50, l2_flush: str = "read") -> float:
    """Median event time (us) of a one-element kernel under :func:`time_cuda`: the least any call
    measures with these events (launch and event latency, no bytes)."""
    x = torch.zeros(1, device="cuda")
    return time_cuda([lambda: x.add_(1.0)], iters=iters, warmup=3, l2_flush=l2_flush).median_us


# Kernel names that bracket each call in a trace (the flush and the backlog's spin fall outside).
CALL_START = "_bench_call_start"
CALL_END = "_bench_call_end"


def call_spans_us(kernels: Sequence[tuple]) -> List[float]:
    """Per-call kernel spans (us) from a trace's kernels ``(name, start_us, end_us)``.

    Each call is bracketed by a ``CALL_START`` and a ``CALL_END`` kernel; its span runs from the
    earliest start to the latest end among the kernels between them (gaps between them included).
    Kernels outside a bracket (flushes, spins, warm-up) are ignored. Raises ``ValueError`` for a
    call with no kernel or a bracket left open (the trace lost records).
    """
    spans: List[float] = []
    current: Optional[list] = None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if CALL_START in name:
            if current is not None:
                raise ValueError(f"call {len(spans)}: a second start before its end (the trace lost records)")
            current = []
        elif CALL_END in name:
            if not current:
                raise ValueError(f"call {len(spans)} has no kernel in the trace")
            spans.append(max(e for _, e in current) - min(b for b, _ in current))
            current = None
        elif current is not None:
            current.append((start, end))
    if current is not None:
        raise ValueError(f"call {len(spans)}: no end in the trace (it lost records)")
    return spans


def time_kernels(
    fns: Sequence[Callable[[], object]],
    iters: int = 20,
    warmup: int = 3,
    l2_flush: str = "read",
    flush_l2_bytes: int = 256 << 20,
    max_backlog_us: float = 200_000.0,
) -> TimingResult:
    """Kernel span of each call (us) in a CUPTI trace, ``iters`` calls per set, sets rotated call by
    call, L2 flushed between calls and calls queued as in :func:`time_cuda` (host gaps would land
    inside a multi-kernel call's span). Launch and event latency are not in it."""
    from torch.profiler import ProfilerActivity, profile

    from triton_kernels.launch import COMPILE_OPTIONS

    from .markers import _bench_call_end as call_end
    from .markers import _bench_call_start as call_start

    nsets = len(fns)
    total = iters * nsets
    flush = L2Flush(l2_flush, flush_l2_bytes)
    tick = torch.zeros(1, dtype=torch.int32, device="cuda")

    def enqueue(j: int) -> None:
        flush()
        call_start[(1,)](tick, **COMPILE_OPTIONS)  # (no Triton 3.9 warning about FP fusion from the markers)
        fns[j % nsets]()
        call_end[(1,)](tick, **COMPILE_OPTIONS)

    enqueue(0)  # compiles the markers outside the trace
    torch.cuda.synchronize()
    probe, covered, prof = _run_until_covered(fns, total, warmup, enqueue, max_backlog_us,
                                              around=lambda: profile(activities=[ProfilerActivity.CUDA]))
    if not covered:  # a span with a host gap inside would pass for kernel time: report none rather than a wrong one
        raise RuntimeError(f"the host enqueued slower than the queued spin in {_BACKLOG_TRIES} tries (up to "
                           f"{_SPIN_MARGIN * 2**(_BACKLOG_TRIES - 1):g}x its probed time): kernel spans would include "
                           "host gaps; time on an idle CPU, or with events only (leave out --kernel-times)")
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    spans = call_spans_us(kernels)
    if len(spans) != probe + total:
        raise RuntimeError(f"the kernel trace holds {len(spans)} calls, expected {probe + total}: the profiler "
                           "dropped records; time with events only (leave out --kernel-times)")
    return TimingResult.from_rotated(spans[probe:], nsets)


def time_cpu(fns: Sequence[Callable[[], object]], iters: int = 5, warmup: int = 1) -> TimingResult:
    """Wall time of each call with ``time.perf_counter`` (CPU path), sets rotated call by call."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    calls_us = []
    for j in range(iters * len(fns)):
        t0 = time.perf_counter()
        fns[j % len(fns)]()
        calls_us.append((time.perf_counter() - t0) * 1e6)
    return TimingResult.from_rotated(calls_us, len(fns))
