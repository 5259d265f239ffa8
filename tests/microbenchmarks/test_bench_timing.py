"""Kernel spans from a trace (``call_spans_us``, the table's kernel column) and, on a GPU, ``time_kernels``
against the events around the same calls."""

import random

import pytest
import torch

from microbenchmarks.report import point_header, point_rows
from microbenchmarks.timing import CALL_END, CALL_START, call_spans_us


def _trace(calls, seed=0):
    """Kernels ``(name, start, end)`` of ``flush, CALL_START, <call kernels>, CALL_END, spin`` per call,
    shuffled (a trace need not come sorted); ``calls``: per call a list of ``(start, end)`` offsets."""
    kernels, t = [("warm-up kernel", 0.0, 1.0)], 10.0
    for call in calls:
        kernels += [("reduce_kernel<flush>", t, t + 58), (CALL_START, t + 61, t + 62)]
        base = t + 70
        kernels += [(f"k{i}", base + s, base + e) for i, (s, e) in enumerate(call)]
        t = base + max(e for _, e in call) + 5
        kernels += [(CALL_END, t, t + 1), ("spin_kernel", t + 2, t + 500)]
        t += 510
    random.Random(seed).shuffle(kernels)
    return kernels


def test_spans_run_from_first_start_to_last_end_of_each_call():
    # One kernel; two kernels with a gap (counted); overlapping kernels (counted once).
    calls = [[(0.0, 28.5)], [(0.0, 10.0), (12.0, 30.0)], [(0.0, 20.0), (5.0, 9.0), (3.0, 25.0)]]
    assert call_spans_us(_trace(calls)) == pytest.approx([28.5, 30.0, 25.0])


@pytest.mark.parametrize("broken,match", [
    ([(CALL_START, 1e6, 1e6 + 1), (CALL_END, 1e6 + 2, 1e6 + 3)], "call 1 has no kernel"),
    ([(CALL_START, 1e6, 1e6 + 1), ("k", 1e6 + 2, 1e6 + 3)], "call 1: no end"),
    ([(CALL_START, 1e6, 1e6 + 1), (CALL_START, 1e6 + 2, 1e6 + 3)], "call 1: a second start"),
])
def test_a_lost_record_is_an_error_not_a_zero(broken, match):
    with pytest.raises(ValueError, match=match):
        call_spans_us(_trace([[(0.0, 5.0)]]) + broken)


def test_flushes_and_spins_never_count_towards_a_call():
    # The flush (58 us) and the spin (498 us) sit outside the brackets.
    (span,) = call_spans_us(_trace([[(0.0, 3.0)]]))
    assert span == pytest.approx(3.0)


def test_table_shows_kernel_spans_only_when_traced():
    arm = {"name": "library/auto", "kind": "library", "status": "ok", "time_us": 32.0, "floor_multiple": 2.0,
           "graphed": True, "info": {}, "check": {"rel_err": 1e-3}}
    skipped = {"name": "library/fa4", "kind": "library", "status": "skipped", "reason": "declines"}
    point = {"label": "p", "arms": [arm, skipped], "floors": {}, "traffic_bytes": None}
    assert "kernels (x floor)" not in point_header(point)
    assert all(len(r) == len(point_header(point)) for r in point_rows(point))
    arm.update(kernel_us=28.5, kernel_floor_multiple=1.78)
    header, rows = point_header(point), point_rows(point)
    col = header.index("kernels (x floor)")
    assert all(len(r) == len(header) for r in rows)
    assert rows[0][col] == "28.5 us (1.78x)" and rows[1][col] == "-"


def test_table_notes_times_that_may_hold_host_gaps():
    arm = {"name": "fi-cascade", "kind": "baseline", "status": "ok", "time_us": 28.6, "floor_multiple": 21.2,
           "graphed": False, "info": {}, "check": {"rel_err": 4.8e-3}}
    point = {"label": "p", "arms": [arm], "floors": {}, "traffic_bytes": None}
    notes = point_header(point).index("check / notes")
    assert point_rows(point)[0][notes] == "ok 4.8e-03"
    arm["host_gaps"] = True
    assert point_rows(point)[0][notes].startswith("ok 4.8e-03; host gaps: the CPU enqueued slower than the queued spin")


@pytest.mark.gpu
@pytest.mark.gpu_exclusive
def test_kernel_spans_match_the_calls_and_leave_out_the_launch():
    from microbenchmarks.timing import capture_graph, time_cuda, time_kernels

    a = torch.randn(8 << 20, device="cuda")
    b, c = torch.empty_like(a), torch.zeros(1, device="cuda")

    def two_kernels():
        b.copy_(a)
        c.add_(1.0)

    fns = [two_kernels, capture_graph(two_kernels)]
    spans = time_kernels(fns, iters=6, warmup=2)
    events = time_cuda(fns, iters=6, warmup=2)
    assert [len(s) for s in spans.per_set_us] == [6, 6]
    # A 64 MiB copy moves 64 MiB over at most ~5 TB/s: no span can be shorter than ~13 us.
    assert min(spans.all_us) > 64 * 2**20 / 5e12 * 1e6
    # The events add the launch (and the graph's) latency; the spans do not.
    assert spans.median_us < events.median_us


@pytest.mark.gpu
def test_a_host_slower_than_its_probe_is_caught_and_retried_with_a_longer_spin(monkeypatch):
    """The backlog tells a chunk issued within its spin from one whose issue outlasted it (a host 5 ms a call slower
    than its probe); a measurement whose every try outlasts its spin keeps its event times, flagged ``host_gaps``,
    and refuses its kernel spans, after spins of 1.5x, 3x and 6x the probed host time; a steady host is not flagged."""
    import time

    from microbenchmarks import timing

    x = torch.zeros(1, device="cuda")
    enqueued = []

    def enqueue(j, slow_after):
        enqueued.append(j)
        if len(enqueued) > slow_after:  # past the probe: a host 5 ms slower per call than it measured
            time.sleep(0.005)
        x.add_(1.0)

    probe, covered = timing._run_backlogged([lambda: x.add_(1.0)] * 2, 8, 1, lambda j: enqueue(j, 10**9))
    assert (probe, covered) == (2, True) and enqueued == [0, 1, *range(8)]
    enqueued.clear()
    probe, covered = timing._run_backlogged([lambda: x.add_(1.0)] * 2, 8, 1, lambda j: enqueue(j, 2))
    assert (probe, covered) == (2, False)

    # Every try outran its spin: the events' times are kept and flagged, the kernel spans refused; each try
    # doubled the spin.
    margins, real = [], timing._run_backlogged

    def outrun(*args, margin=timing._SPIN_MARGIN):
        margins.append(margin)
        return real(*args, margin=margin)[0], False

    monkeypatch.setattr(timing, "_run_backlogged", outrun)
    fns = [lambda: x.add_(1.0)]
    result = timing.time_cuda(fns, iters=4, warmup=1)
    assert result.host_gaps and len(result.all_us) == 4 and min(result.all_us) > 0
    assert margins == [timing._SPIN_MARGIN * 2**k for k in range(timing._BACKLOG_TRIES)]
    with pytest.raises(RuntimeError, match="host enqueued slower than the queued spin"):
        timing.time_kernels(fns, iters=4, warmup=1)
    monkeypatch.undo()
    assert not timing.time_cuda(fns, iters=4, warmup=1).host_gaps


def test_time_is_the_median_call_not_the_mean():
    from microbenchmarks.timing import TimingResult

    r = TimingResult([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    assert r.median_us == 3.5 and r.set_medians_us == [2.0, 4.0] and r.min_us == 1.0


def test_rotated_calls_group_by_set():
    from microbenchmarks.timing import TimingResult

    assert TimingResult.from_rotated([1, 10, 2, 20, 3, 30], 2).per_set_us == [[1, 2, 3], [10, 20, 30]]
