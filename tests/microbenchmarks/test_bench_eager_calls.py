"""The eager-call timer (``microbenchmarks.eager_calls``): its arguments, its timing arithmetic and spin guard
with the CUDA clock faked, its progressive JSON, and one real run on a GPU."""

from __future__ import annotations

import json
import types

import pytest
import torch

from microbenchmarks import eager_calls


def test_bad_arguments_are_refused_and_no_gpu_exits_cleanly(monkeypatch, capsys):
    for argv, message in [(["--arms", "fa4,decode"], "unknown: ['decode']"), (["--arms", ","], "none given"),
                          (["--shapes", "B-huge"], "unknown shapes"), (["--calls", "0"], "--calls 0 must be at least 1"),
                          (["--custom", "8x8"], "is not RxWxP")]:
        with pytest.raises(SystemExit):
            eager_calls.main(argv)
        assert message in capsys.readouterr().err, argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eager_calls.main(["--shapes", "B-short", "--custom", "4x8x500:32/8/64"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


class _FakeClock:
    """A host clock (seconds) that each faked call advances, and CUDA events that read it."""

    def __init__(self):
        self.now = 0.0
        self.spins = []

    def perf_counter(self):
        return self.now

    def event(self, enable_timing=True):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):  # ms, as torch.cuda.Event's
                return (end.t - self.t) * 1e3

        return Event()


def _fake_cuda(monkeypatch, clock):
    monkeypatch.setattr(eager_calls, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: clock.spins.append(cycles), raising=False)
    monkeypatch.setattr(eager_calls, "sleep_cycles_per_us", lambda: 1000.0)


def _costed_call(clock, calls, host_batch_costs_us, device_cost_us):
    """A call that advances the clock by its host batch's cost (us), then, past those batches, by
    ``device_cost_us`` (the device-time batches' issue)."""
    issued = [0]

    def call():
        batch = issued[0] // calls
        clock.now += (host_batch_costs_us[batch] if batch < len(host_batch_costs_us) else device_cost_us) * 1e-6
        issued[0] += 1

    return call


def test_times_are_per_call_medians_and_device_batches_outlast_their_spin(monkeypatch):
    """Host and per-call times are per-call medians over the batches; a device batch whose issue outlasts its
    spin is run again behind a spin twice as long, and a host that keeps outlasting it is an error."""
    clock = _FakeClock()
    _fake_cuda(monkeypatch, clock)
    calls = 10
    # Host batches at 50, 70 and 60 us a call; device batches issued at 150 us a call, which outlast the first
    # spin (2 x 10 calls x 70 us = 1,400 us against 1,500) and fit the doubled one, kept for the other batches.
    times = eager_calls.time_eager_calls(_costed_call(clock, calls, [50, 70, 60], 150), calls, 3, warmup=0)
    assert times["host_us"] == pytest.approx(60.0) and times["host_min_us"] == pytest.approx(50.0)
    assert times["step_us"] == pytest.approx(60.0) and times["device_us"] == pytest.approx(150.0)
    assert times["step_min_us"] == pytest.approx(50.0)
    assert clock.spins == [pytest.approx(c, abs=1) for c in (1_400_000, 2_800_000, 2_800_000, 2_800_000)]

    clock.spins.clear()
    with pytest.raises(RuntimeError, match="outlasted a 1600 us spin 4 times"):
        eager_calls.time_eager_calls(_costed_call(clock, calls, [10, 10, 10], 1e6), calls, 3, warmup=0)
    assert clock.spins == [pytest.approx(c, abs=1) for c in (200_000, 400_000, 800_000, 1_600_000)]


class _CutShort(Exception):
    pass


def test_json_is_rewritten_after_every_shape(monkeypatch, tmp_path):
    """A run cut short keeps the shapes it finished, marked incomplete; a whole run ends complete, one row per
    shape and arm, in the layout of the committed eager files."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    done = []

    def fake_measure(shape, arms, calls, batches, warmup, seed):
        if len(done) == stop_after:
            raise _CutShort
        done.append(shape.name)
        assert (calls, batches, warmup, seed) == (5, 2, 1, 3)
        return [{"shape": shape.to_dict(), "arm": f"library/{a}", "backend": a, "shared_run": False,
                 "host_us": 1.0, "host_min_us": 1.0, "step_us": 2.0, "step_min_us": 2.0, "device_us": 1.5}
                for a in arms]

    monkeypatch.setattr(eager_calls, "measure_shape", fake_measure)
    path = tmp_path / "eager.json"
    argv = ["--shapes", "B-short", "--custom", "64x30x8000,64x16x8000:32/8", "--arms", "triton,fa4", "--calls", "5",
            "--batches", "2", "--warmup", "1", "--seed", "3", "--json", str(path)]
    stop_after = 2
    with pytest.raises(_CutShort):
        eager_calls.main(argv)
    doc = json.loads(path.read_text())
    assert not doc["complete"] and [r["shape"]["name"] for r in doc["results"]] == ["B-short"] * 2 + ["64x30x8000"] * 2
    done.clear()
    stop_after = 3
    assert eager_calls.main(argv) == 0
    doc = json.loads(path.read_text())
    assert doc["complete"] and doc["argv"] == argv and (doc["calls"], doc["batches"]) == (5, 2)
    assert [(r["shape"]["name"], r["arm"]) for r in doc["results"]] == [
        (s, a) for s in ("B-short", "64x30x8000", "64x16x8000:32/8") for a in ("library/triton", "library/fa4")]
    assert doc["results"][-1]["shape"]["heads"] == 32


def _row(arm, backend, shared_run, step_us, shape="64x30x1000:32/8/64-t96"):
    return {"shape": {"name": shape}, "arm": f"library/{arm}", "backend": backend, "shared_run": shared_run,
            "host_us": step_us, "host_min_us": step_us, "step_us": step_us, "step_min_us": step_us, "device_us": 1.0}


def test_the_verdict_sets_autos_path_against_the_fastest_other_path():
    """Round 91's H100 lead at 96 tokens: auto ran FA4 + the stage (347.1 us a call) and FlashInfer + the stage took
    249.3. The verdict names that path, not the arm that timed auto's own path again (337.3, kept beside it as the
    spread of one path), nor a skipped arm; without auto, or with only auto's own path beside it, there is none."""
    rows = [_row("auto", "fa4", True, 347.1), _row("fa4+shared-run", "fa4", True, 337.3),
            _row("flashinfer+shared-run", "flashinfer", True, 249.3), _row("triton", "triton", False, 301.0),
            _row("flashinfer", "flashinfer", False, 336.1), {"shape": {"name": "x"}, "arm": "library/fa4", "skipped": "no"}]
    verdict = eager_calls.auto_verdict(rows)
    assert verdict == {"shape": "64x30x1000:32/8/64-t96", "auto_path": "FA4 + stage + tail", "auto_step_us": 347.1,
                       "best_arm": "library/flashinfer+shared-run", "best_path": "FlashInfer + stage + tail",
                       "best_step_us": 249.3, "auto_over_best": pytest.approx(347.1 / 249.3),
                       "same_path_arm": "library/fa4+shared-run", "same_path_step_us": 337.3}
    line = eager_calls.verdict_line(verdict)
    assert line == ("64x30x1000:32/8/64-t96: auto ran FA4 + stage + tail, 347.1 us a call; the fastest other path, "
                    "FlashInfer + stage + tail (library/flashinfer+shared-run), 249.3 us: auto 1.39x (FA4 + stage + "
                    "tail timed again as library/fa4+shared-run: 337.3 us)")
    cascade = eager_calls.auto_verdict([_row("auto", "triton", False, 134.9), _row("flashinfer", "flashinfer", False, 163.5)])
    assert cascade["auto_path"] == "the cascade" and cascade["auto_over_best"] == pytest.approx(134.9 / 163.5)
    assert "same_path_arm" not in cascade
    assert eager_calls.auto_verdict(rows[1:]) is None
    assert eager_calls.auto_verdict(rows[:2]) is None
    # The twin faster than every other path is still not the best, nor is the first arm of another path.
    twin_fastest = [_row("auto", "fa4", True, 347.1), _row("flashinfer", "flashinfer", False, 336.1),
                    _row("fa4+shared-run", "fa4", True, 200.0), _row("flashinfer+shared-run", "flashinfer", True, 249.3)]
    assert eager_calls.auto_verdict(twin_fastest)["best_arm"] == "library/flashinfer+shared-run"
    # A skipped auto arm gives no verdict (and does not end the run).
    skipped_auto = [{"shape": {"name": "s"}, "arm": "library/auto", "skipped": "no"}, _row("flashinfer", "flashinfer", False, 1.0)]
    assert eager_calls.auto_verdict(skipped_auto) is None


def test_each_shape_with_auto_gets_its_verdict_printed_and_kept(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    times = {"auto": 300.0, "triton": 290.0, "flashinfer": 250.0}

    def fake_measure(shape, arms, calls, batches, warmup, seed):
        return [_row(a, "triton" if a == "auto" else a, False, times[a], shape.name) for a in arms]

    monkeypatch.setattr(eager_calls, "measure_shape", fake_measure)
    path = tmp_path / "eager.json"
    assert eager_calls.main(["--shapes", "", "--custom", "4x8x200,8x8x200", "--arms", "auto,triton,flashinfer",
                             "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert [(v["shape"], v["best_path"], round(v["auto_over_best"], 2)) for v in doc["verdicts"]] == [
        ("4x8x200", "FlashInfer + tail", 1.2), ("8x8x200", "FlashInfer + tail", 1.2)]
    out = capsys.readouterr().out
    assert out.count("auto ran the cascade, 300.0 us a call; the fastest other path, FlashInfer + tail") == 2, out


def test_shared_arms_turn_the_stage_on(monkeypatch):
    """The library arms pass ``shared_run`` explicitly (the environment does not change a timing), so the stage is
    measured through the ``-shared`` arms, which build their wrappers with it on; the plain arms keep it off."""
    from microbenchmarks import arms as arms_module

    built = []

    class Spy(arms_module.LibraryArm):
        def prepare(self, workload, ctx):
            built.append((self.backend, self.shared_run))
            raise arms_module.ArmSkipped("spy")

    monkeypatch.setattr(eager_calls, "LibraryArm", Spy)
    monkeypatch.setattr(eager_calls, "build_workload", lambda *a, **k: None)
    monkeypatch.setattr(torch, "device", lambda *a: "cuda")
    rows = eager_calls.measure_shape(eager_calls.tuning_shapes(list(eager_calls.PRESETS.values()), "", "4x8x200")[0], ["fa4", "fa4-shared",
                                     "flashinfer-shared"], 1, 1, 0, 0)
    assert built == [("fa4", "off"), ("fa4", "on"), ("flashinfer", "on")], built
    assert [r["skipped"] for r in rows] == ["spy"] * 3


@pytest.mark.gpu
def test_eager_calls_time_a_small_shape(tmp_path):
    path = tmp_path / "eager.json"
    assert eager_calls.main(["--shapes", "", "--custom", "4x8x200", "--arms", "triton,auto", "--calls", "10",
                             "--batches", "3", "--warmup", "3", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["complete"] and len(doc["results"]) == 2
    for row in doc["results"]:
        assert "skipped" not in row, row
        assert row["backend"] in ("triton", "fa4", "flashinfer"), row
        assert 0 < row["host_min_us"] <= row["host_us"] and row["step_us"] > 0 and row["device_us"] > 0, row
        assert 0 < row["step_min_us"] <= row["step_us"], row
        # An eager call is no faster than its device work, nor (beyond event noise) than issuing it.
        assert row["step_us"] >= 0.9 * row["device_us"] and row["step_us"] >= 0.9 * row["host_min_us"], row
    assert doc["results"][0]["backend"] == "triton"
