"""The benchmark's gate before timing (``microbenchmarks/check.py`` through ``runner.run_point``): arms
that corrupt the pool, skip the KV write, leave output rows unwritten or raise the device error flag
on valid input fail, whatever the order of arms."""

from __future__ import annotations

import pytest
import torch

from microbenchmarks import cli
from microbenchmarks.arms import Arm, LibraryArm, Prepared
from microbenchmarks.check import write_slots
from microbenchmarks.runner import Rates, RunOptions, run_point
from microbenchmarks.shapes import BenchShape

SHAPE = BenchShape(requests=3, beams=3, prompt=37, tail=5, heads=4, kv_heads=2, head_dim=16, page_size=16)


class BrokenLibrary(Arm):
    """The reference library arm, then one fault: the KV write one slot early, no KV write, or the
    output of the middle request left unwritten."""

    kind = "library"
    writes_kv = True

    def __init__(self, fault: str):
        self.fault = fault
        self.name = f"broken/{fault}"
        self.description = "a deliberately broken arm"

    def prepare(self, wl, ctx) -> Prepared:
        inner = LibraryArm("reference", tail_impl="torch").prepare(wl, ctx)
        out, = inner.poison

        def call():
            saved = wl.kv_cache.clone() if self.fault != "early_write" else None
            result = inner.call()
            page, slot, _ = write_slots(wl)
            if self.fault == "early_write":  # this step's K/V written at kv_len - 2 instead
                wl.kv_cache[page, :, :, slot - 1, :] = wl.kv_cache[page, :, :, slot, :].clone()
                wl.kv_cache[page, :, :, slot, :] = float("nan")
            elif self.fault == "no_write":
                wl.kv_cache.copy_(saved)
            elif self.fault == "middle_request_unwritten":
                out[SHAPE.beams:2 * SHAPE.beams] = float("nan")
            return result

        flagged = (lambda: ["a spurious device error"]) if self.fault == "flags_valid_input" else inner.device_errors
        return Prepared(call=call, outputs=inner.outputs, poison=inner.poison, capturable=False, keep=inner.keep,
                        device_errors=flagged)


@pytest.mark.parametrize("fault, message", [
    ("early_write", "a K/V write to a wrong slot"),
    ("no_write", "is not at kv_len - 1"),
    ("middle_request_unwritten", "non-finite output elements in all rows"),
    ("flags_valid_input", "the kernels flagged valid input: a spurious device error"),
])
def test_a_broken_arm_fails_and_the_next_arm_still_passes(fault, message, monkeypatch):
    """The reference is computed before any arm runs and the pool is repaired after each check, so
    the arm after a broken one is judged on the true inputs. The oracle checks the first and last
    requests only (as on a GPU, a subset): the unwritten middle one is caught by the all-rows check."""
    from microbenchmarks import runner
    from microbenchmarks.check import Oracle, pick_check_requests

    assert pick_check_requests(SHAPE.requests, 2, 0) == [0, 2]
    monkeypatch.setattr(runner, "Oracle", lambda wl, max_requests: Oracle(wl, max_requests=2))
    good = LibraryArm("reference", tail_impl="torch")
    # A good arm first: the broken one must not pass on the K/V an earlier arm stored.
    point = run_point(SHAPE, [good, BrokenLibrary(fault), good],
                      RunOptions(sets=2, iters=1, warmup=0, plan_repeats=0), Rates(), "cpu")
    before, broken, after = point["arms"]
    assert broken["status"] == "check_failed" and message in broken["reason"], broken["reason"]
    assert before["status"] == after["status"] == "ok", (before.get("reason"), after.get("reason"))


def test_a_stage_arm_gets_no_step_speedup():
    from microbenchmarks.arms import PrefixStageArm

    point = run_point(SHAPE, [PrefixStageArm("reference"), LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0), Rates(), "cpu")
    # (no decode arm ran here, so both are None; the rule is that a stage never gets one)
    assert point["arms"][0]["speedup_vs_decode"] is None


def test_a_crashed_library_arm_gives_exit_status_1(tmp_path, capsys):
    from test_bench_cli import synthetic_doc

    from microbenchmarks.report import write_json

    doc = synthetic_doc()
    arm = next(a for a in doc["results"][0]["arms"] if a["kind"] == "library")
    arm.update(status="failed", reason="RuntimeError: CUDA error: an illegal memory access was encountered")
    src = tmp_path / "crashed.json"
    write_json(doc, str(src))
    assert cli.main(["--from-json", str(src)]) == 1
    assert "LIBRARY ARM FAILED" in capsys.readouterr().out


@pytest.fixture
def wrappers_made(monkeypatch):
    """Every :class:`BeamSharedPrefixAttention` the test builds, in order (a spy on its constructor)."""
    from beam_shared_prefix import attention

    made = []
    real_init = attention.BeamSharedPrefixAttention.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(attention.BeamSharedPrefixAttention, "__init__", spy)
    return made


def test_report_errors_times_the_library_with_its_flag_and_checks_it(monkeypatch, wrappers_made):
    """``--report-errors``: the library arms' wrappers get the device error flag (whatever the
    environment says), valid input raises none, and the check reads it."""
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", "0")
    point = run_point(SHAPE, [LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0, report_errors=True), Rates(), "cpu")
    (arm,) = point["arms"]
    assert arm["status"] == "ok", arm.get("reason")
    assert wrappers_made and all(w.error_flags is not None for w in wrappers_made)


def test_the_flag_arm_times_auto_with_its_flag_next_to_auto(monkeypatch, capsys, wrappers_made):
    """``auto-flag`` and ``auto-flag-layer``: only those arms' wrappers get the device error flag (``--report-errors``
    off), the second without the page-table audit (a model's later layers); valid input raises none, and the point
    prints the flag's cost as ratios of the arms measured in the same run."""
    from microbenchmarks.arms import parse_arm_list
    from microbenchmarks.report import flag_cost_line, print_point

    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", "1")  # (ignored: each arm says what it runs)
    point = run_point(SHAPE, parse_arm_list("auto,auto-flag,auto-flag-layer", cpu=True),
                      RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0), Rates(), "cpu")
    assert [(a["name"], a["status"]) for a in point["arms"]] == [("library/auto+torch-tail", "ok"),
                                                                 ("library/auto+torch-tail+flag", "ok"),
                                                                 ("library/auto+torch-tail+flag-layer", "ok")]
    assert sorted((w.error_flags is not None, w.page_table_audit) for w in wrappers_made) == [
        (False, False), (True, False), (True, True)]
    line = flag_cost_line(point)
    times = [a["time_us"] for a in point["arms"]]
    assert line is not None and f"({times[1] / times[0]:.3f}x)" in line and f"({times[2] / times[0]:.3f}x)" in line
    print_point(point, console=None)
    assert line in capsys.readouterr().out


@pytest.mark.parametrize("declare", [False, True])
def test_declare_tail_bounds_the_library_wrappers(monkeypatch, wrappers_made, declare):
    """``--declare-tail``: the library arms' wrappers are built with ``max_tail_len`` set to the shape's longest tail
    (what ``TLLM_BEAM_SHARED_PREFIX_MAX_TAIL`` gives TensorRT-LLM's); without it, unknown (the variable unset)."""
    monkeypatch.delenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", raising=False)
    point = run_point(SHAPE, [LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0, declare_tail=declare), Rates(), "cpu")
    (arm,) = point["arms"]
    assert arm["status"] == "ok", arm.get("reason")
    assert wrappers_made and {w.max_tail_len for w in wrappers_made} == {SHAPE.tail if declare else None}, [
        w.max_tail_len for w in wrappers_made]
