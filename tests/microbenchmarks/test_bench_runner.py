"""The benchmark's derived numbers (``microbenchmarks.runner``): each arm's time is the median of its calls, its
speedups are the fastest per-beam decode's and the cascade's time over its own (a stage gets none), and its floor
multiple and rates are taken against its own work's floor and bytes."""

import pytest
from test_bench_check import SHAPE

from microbenchmarks import runner
from microbenchmarks.arms import LibraryArm
from microbenchmarks.floors import count_flops
from microbenchmarks.runner import Rates, RunOptions, run_point
from microbenchmarks.shapes import BenchShape
from microbenchmarks.timing import TimingResult
from microbenchmarks.workload import build_workload


def _derived():
    works = {"full": {"bytes": 1_000_000, "flops": 2_000_000_000, "floor_us": 10.0},
             "prefix": {"bytes": 400_000, "flops": 1_000_000_000, "floor_us": 4.0},
             "tail": {"bytes": 600_000, "flops": 1_000_000_000, "floor_us": 6.0}}
    arms = [
        {"name": "library/auto", "work": "full", "status": "ok", "time_us": 50.0},
        {"name": "prefix/fa4", "work": "prefix", "status": "ok", "time_us": 20.0},
        {"name": "fi-decode-tc", "work": "full", "status": "ok", "time_us": 200.0},
        {"name": "fi-decode-cc", "work": "full", "status": "ok", "time_us": 100.0},
        {"name": "fi-cascade", "work": "full", "status": "ok", "time_us": 80.0},
    ]
    runner._derive(arms, works)
    return {a["name"]: a for a in arms}


def test_speedups_are_the_fastest_decode_and_the_cascade_over_the_arm():
    """Over the fastest per-beam decode variant (100 us, not 200), and decode's time over the arm's, not the inverse."""
    lib = _derived()["library/auto"]
    assert lib["speedup_vs_decode"] == pytest.approx(100.0 / 50.0) and lib["speedup_vs_cascade"] == pytest.approx(1.6)


def test_a_stage_is_judged_against_its_own_work_and_gets_no_step_speedup():
    """A prefix stage beside decode and cascade arms: its floor multiple and rate are of the prefix's floor and
    bytes, and a speedup over a whole step would compare unlike work."""
    stage = _derived()["prefix/fa4"]
    assert stage["floor_multiple"] == pytest.approx(20.0 / 4.0)
    assert stage["achieved_GBps"] == pytest.approx(400_000 / 20e-6 / 1e9)
    assert stage["speedup_vs_decode"] is None and stage["speedup_vs_cascade"] is None


def test_a_points_flops_and_work_floors_are_the_mean_and_the_max():
    """Prompt jitter gives each input set its own FLOPs; a point's FLOPs are their mean. A work's floor is the
    slower of its memory and compute times (compute bound here)."""
    shape = BenchShape(requests=3, beams=4, prompt=40, tail=6, heads=4, kv_heads=2, head_dim=16, page_size=8,
                       prompt_jitter=0.5)
    rates = Rates(copy_bandwidth=1e12, matmul_rate=1e9)
    point = run_point(shape, [LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=3, iters=1, warmup=0, plan_repeats=0), rates, "cpu")
    flops = [count_flops(build_workload(shape, "cpu", seed=i).prompt_lens_host, 6, 4, 4, 16) for i in range(3)]
    assert len(set(flops)) > 1
    assert point["flops"] == round(sum(flops) / 3)
    full = point["work"]["full"]
    assert full["floor_us"] == pytest.approx(max(full["bytes"] / 1e12, full["flops"] / 1e9) * 1e6)
    (arm,) = point["arms"]
    assert arm["floor_multiple"] == pytest.approx(arm["time_us"] / full["floor_us"])


def test_an_arms_time_is_the_median_of_its_calls(monkeypatch):
    monkeypatch.setattr(runner, "time_cpu", lambda fns, iters, warmup: TimingResult([[1.0, 5.0, 9.0], [2.0, 6.0, 7.0]]))
    point = run_point(SHAPE, [LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=2, iters=3, warmup=0, plan_repeats=0), Rates(), "cpu")
    (arm,) = point["arms"]
    assert (arm["time_us"], arm["time_min_us"], arm["time_set_medians_us"], arm["samples"]) == (5.5, 1.0, [5.0, 6.0], 6)
