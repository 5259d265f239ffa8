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


def test_fp16_is_held_to_its_own_tolerance():
    """An error of 1e-2 of the reference's largest entry passes bf16 (2e-2) but not fp16 (4e-3)."""
    from microbenchmarks.check import compare

    ref = torch.randn(6, 4, 8)
    off = ref.clone()
    off[0, 0, 0] += 1e-2 * ref.abs().max()  # 1e-2 relative: inside bf16's 2e-2, outside fp16's 4e-3
    assert compare(off.to(torch.bfloat16), ref, torch.bfloat16).ok
    r = compare(off.to(torch.float16), ref, torch.float16)
    assert not r.ok and r.tol == 4e-3


def test_rel_err_is_the_max_error_over_the_max_reference():
    """The metric itself: ``max |out - ref| / max |ref|``; an error of 1.5x the tolerance fails."""
    from microbenchmarks.check import compare

    ref = torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(7)) * 2 - 1  # |x| < 1 but one entry
    ref[0, 0, 0] = 4.0
    out = ref.clone()
    out[1, 1, 1] += 4.0 * 0.03  # 0.03 relative: 1.5x bf16's 2e-2
    r = compare(out, ref, torch.bfloat16)
    assert r.rel_err == pytest.approx(0.03) and r.ref_max_abs == 4.0 and not r.ok


def test_an_arm_that_fails_on_one_input_set_fails():
    """Input sets differ in pages, ancestry and data: a layout-dependent bug may fail on one only, in either order."""
    from microbenchmarks.check import compare, merge_results

    ref = torch.randn(6, 4, 8)
    good = compare(ref.to(torch.bfloat16), ref, torch.bfloat16)
    bad = compare(torch.zeros_like(ref).to(torch.bfloat16), ref, torch.bfloat16)
    for order in ((good, bad), (bad, good)):
        merged = merge_results(order)
        assert not merged.ok and "relative error" in merged.message


def _arm_that(fault):
    """The reference library arm with one fault after its call: V not written at the step's slot (``no_v_write``),
    K/V stored over the previous position's slot (``early_write``), or (a prefix stage) a stray write at the step's
    slot."""
    from microbenchmarks.arms import PrefixStageArm
    from microbenchmarks.check import set_write_slots

    class Faulty(Arm):
        writes = fault in ("no_v_write", "early_write")
        kind = "library" if writes else "stage"
        expect = "full" if writes else "prefix"
        work = "full" if writes else "prefix"
        writes_kv = writes
        name = f"faulty/{fault}"
        description = "a deliberately broken arm"

        def prepare(self, wl, ctx):
            inner = (LibraryArm("reference", tail_impl="torch") if self.writes
                     else PrefixStageArm("reference")).prepare(wl, ctx)

            def call():
                saved = wl.kv_cache.clone()
                result = inner.call()
                if fault == "no_v_write":
                    wl.kv_cache[:, 1] = saved[:, 1]  # (HND: [pages, K/V, Hkv, page, D]) V left as it was
                elif fault == "early_write":
                    page, slot, _ = write_slots(wl)
                    wl.kv_cache[page, :, :, slot - 1, :] = 7.0  # K/V over the previous position's slot
                else:
                    set_write_slots(wl, 0.0)
                return result

            return Prepared(call=call, outputs=inner.outputs, poison=inner.poison, capturable=False, keep=inner.keep,
                            device_errors=inner.device_errors, info=inner.info)

    return Faulty()


@pytest.mark.parametrize("fault,message", [("no_v_write", "this step's V of row"),
                                           ("stage_writes_the_step_slot", "which this step does not write")])
def test_the_pool_is_checked_for_V_and_for_arms_that_do_not_write(fault, message):
    point = run_point(SHAPE, [_arm_that(fault)], RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0), Rates(), "cpu")
    (arm,) = point["arms"]
    assert arm["status"] == "check_failed" and message in arm["reason"], arm["reason"]


def test_a_broken_first_arm_cannot_corrupt_the_reference_of_the_next():
    """The oracle is computed before any arm runs: an arm that writes a wrong slot fails, and a good arm after it
    (on the rebuilt pool) passes against the true reference, even when the broken arm runs first."""
    point = run_point(SHAPE, [_arm_that("early_write"), LibraryArm("reference", tail_impl="torch")],
                      RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0), Rates(), "cpu")
    broken, good = point["arms"]
    assert broken["status"] == "check_failed" and "a K/V write to a wrong slot" in broken["reason"], broken["reason"]
    assert good["status"] == "ok", good.get("reason")
