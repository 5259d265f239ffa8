"""The tuning and profiling tools: tune_tail and tune_cascade mismatch measures, tune_fa4 tiles, profile_step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from microbenchmarks.tune_tail import MISMATCH_ULPS, ulps_apart


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulps_apart_counts_rounding_steps_at_the_values_magnitude(dtype):
    eps = torch.finfo(dtype).eps
    ref = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    mag = ref.float().abs()
    spacing = torch.ldexp(torch.full_like(mag, eps), torch.frexp(mag)[1] - 1)  # of |ref|'s binade

    def away_from_zero(steps):
        return (ref.float().sign() * (mag + steps * spacing)).to(dtype)

    assert torch.equal(away_from_zero(0), ref)
    assert ulps_apart(ref, ref) == 0.0
    assert ulps_apart(away_from_zero(1), ref) == pytest.approx(1.0) and 1.0 <= MISMATCH_ULPS
    three = ref.clone()
    three[5] = away_from_zero(3)[5]
    assert ulps_apart(three, ref) == pytest.approx(3.0) and ulps_apart(three, ref) > MISMATCH_ULPS
    poisoned = ref.clone()
    poisoned[3] = float("nan")
    assert ulps_apart(poisoned, ref) == float("inf")


def test_tune_cascade_mismatch_measure_and_no_gpu_exit(monkeypatch, capsys):
    """tune_cascade compares tilings by relative error (their P V roundings differ) and exits 0 without a GPU."""
    from microbenchmarks import tune_cascade

    ref = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    near = ref + 1e-3 * ref.abs().max()
    assert tune_cascade.rel_err(ref, ref) == 0.0
    assert tune_cascade.rel_err(near, ref) == pytest.approx(1e-3, rel=1e-3)
    poisoned = ref.clone()
    poisoned[0, 0] = float("nan")
    assert tune_cascade.rel_err(poisoned, ref) == float("inf")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune_cascade.main(["--shapes", "B-short"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_tune_cascade_varies_fields_of_the_default_tiling(monkeypatch, capsys):
    """``--vary FIELD=V1,V2`` (repeatable) gives the product of overrides of the default tiling's fields, booleans as
    0/1 and ``none`` for the optional ints; an unknown field or a value its field cannot take is named before the
    device is looked for."""
    from microbenchmarks import tune_cascade
    from triton_kernels.cascade import cascade_launch_config

    variants = tune_cascade.parse_vary(["shared-ancestry=0,1", "num_warps=4,8"])
    assert variants == [{"shared_ancestry": a, "num_warps": w} for a in (False, True) for w in (4, 8)]
    assert tune_cascade.parse_vary(["max_registers=none,168"]) == [{"max_registers": None}, {"max_registers": 168}]
    assert tune_cascade.parse_vary([]) == [{}]
    default = cascade_launch_config(30, 4, 64)
    assert [dataclasses.replace(default, **v).shared_ancestry for v in tune_cascade.parse_vary(["shared_ancestry=1"])] \
        == [True]
    for spec, message in [("warps=4", "'warps' is not a launch-config field"), ("num_warps", "is not FIELD=V1,V2"),
                          ("shared_ancestry=2", "'2' is not a value of shared_ancestry"),
                          ("block_n=none", "'none' is not a value of block_n")]:
        with pytest.raises(ValueError, match=message):
            tune_cascade.parse_vary([spec])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        tune_cascade.main(["--shapes", "B-short", "--vary", "warps=4"])
    assert "'warps' is not a launch-config field" in capsys.readouterr().err
    assert tune_cascade.main(["--shapes", "B-short", "--vary", "shared_ancestry=0,1"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_tune_fa4_parses_tiles_and_exits_without_a_gpu(monkeypatch, capsys):
    """tune_fa4 reads ``MxN`` tiles, names a malformed one, and exits 0 without a GPU."""
    from microbenchmarks import tune_fa4

    assert tune_fa4.parse_tiles("128x64, 64X128") == [(128, 64), (64, 128)]
    with pytest.raises(ValueError, match="'128-64' is not MxN"):
        tune_fa4.parse_tiles("128-64")
    with pytest.raises(SystemExit):
        tune_fa4.main(["--tiles", "128by64"])
    assert "is not MxN" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune_fa4.main(["--shapes", "B-4B"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_profile_step_cli_without_a_gpu(monkeypatch, capsys):
    """profile_step validates its arguments and exits 0 without a GPU."""
    from microbenchmarks import profile_step

    with pytest.raises(SystemExit):
        profile_step.main(["--calls", "0"])
    assert "--calls 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_step.main(["--kernel", "decode"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile_step.main(["--preset", "B-4B", "--kernel", "tail"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["cascade", "prefix", "tail"])
def test_profile_step_launches_each_kernel(kernel):
    """Each of profile_step's kernels runs on a reduced preset (the interpreter on CPU) and writes
    every output element (the buffer starts as NaN)."""
    from microbenchmarks import profile_step
    from microbenchmarks.shapes import PRESETS, reduced_cpu_shape

    out = profile_step.launch(kernel, reduced_cpu_shape(PRESETS["B-short"]), calls=1, device="cpu")
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("tool", ["tune_tail", "tune_cascade"])
def test_tuning_tools_take_custom_shapes_and_tails(monkeypatch, capsys, tool):
    """``--custom RxWxP[:Hq/Hkv]`` adds shapes (``parse_custom_shapes``); a malformed one, or no shape at all, is
    named before the device is looked for; ``--tails`` runs each shape at those tails; no GPU exits 0."""
    import importlib

    module = importlib.import_module(f"microbenchmarks.{tool}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        module.main(["--custom", "8x0x500"])
    assert "'8x0x500' is not RxWxP[:Hq/Hkv[/D]] with positive integers" in capsys.readouterr().err
    if tool == "tune_cascade":
        with pytest.raises(SystemExit):
            module.main(["--shapes", ""])
        assert "no shapes" in capsys.readouterr().err
    assert module.main(["--shapes", "B-short", "--custom", "8x8x500:16/16", "--tails", "16,64"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


class _CutShort(Exception):
    pass


@pytest.mark.parametrize("tool", ["tune_tail", "tune_cascade"])
def test_tuning_tools_keep_each_finished_shape_in_their_json(monkeypatch, tmp_path, tool):
    """The document is rewritten after every shape: a run cut short (a time limit) keeps the shapes it finished,
    marked incomplete, and a whole run ends marked complete with every shape."""
    import importlib
    import json

    module = importlib.import_module(f"microbenchmarks.{tool}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module, "measure_copy_bandwidth", lambda device: 4.0e12)
    done = []

    def fake_tune_shape(shape, *args):
        if len(done) == stop_after:
            raise _CutShort
        done.append(shape.name)
        return {"shape": shape.name, "floor_us": 1.0, "default": None, "best": None, "all": []}

    monkeypatch.setattr(module, "tune_shape", fake_tune_shape)
    path = tmp_path / "tune.json"
    argv = ["--shapes", "B-short,B-medium,B-4B", "--json", str(path)]
    stop_after = 2
    with pytest.raises(_CutShort):
        module.main(argv)
    doc = json.loads(path.read_text())
    assert not doc["complete"] and [s["shape"] for s in doc["shapes"]] == ["B-short", "B-medium"]
    assert not (tmp_path / "tune.json.partial").exists()
    done.clear()
    stop_after = 3
    assert module.main(argv) == 0
    doc = json.loads(path.read_text())
    assert doc["complete"] and [s["shape"] for s in doc["shapes"]] == ["B-short", "B-medium", "B-4B"]


def test_tune_tail_times_the_prefix_dtype_and_flag_builds_it_is_asked_for(monkeypatch, tmp_path):
    """``--prefix-dtype float32`` and ``--error-flags`` reach every shape's tuning and the document; the defaults are
    the query's dtype, as the library's wrapper passes it, and the flagless build; an unknown dtype is refused."""
    import json

    from microbenchmarks import tune_tail

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_tail, "measure_copy_bandwidth", lambda device: 4.0e12)
    seen = []

    def fake_tune_shape(shape, grid, iters, bandwidth, prefix_dtype="query", error_flags=False):
        seen.append((prefix_dtype, error_flags))
        return {"shape": shape.name, "floor_us": 1.0, "default": None, "best": None, "all": []}

    monkeypatch.setattr(tune_tail, "tune_shape", fake_tune_shape)
    path = tmp_path / "tune.json"
    assert tune_tail.main(["--shapes", "B-short,B-4B", "--prefix-dtype", "float32", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert seen == [("float32", False)] * 2 and doc["prefix_dtype"] == "float32" and doc["error_flags"] is False
    seen.clear()
    assert tune_tail.main(["--shapes", "B-short", "--error-flags", "--json", str(path)]) == 0
    assert seen == [("query", True)] and tune_tail.PREFIX_DTYPES["query"] is None
    assert json.loads(path.read_text())["error_flags"] is True
    with pytest.raises(SystemExit):
        tune_tail.main(["--prefix-dtype", "float16"])


@pytest.mark.gpu
def test_tune_tail_times_float32_prefix_state_and_counts_its_bytes():
    """On a GPU, a float32 prefix state reaches the kernel: the default tiling writes every output element (the buffer
    starts as NaN, which compares as infinitely many ulps), compiles without spills and is timed; and the tail floor
    counts the state's two extra bytes per element. (The kernel's float32-state results against the oracle are
    ``test_tail_merge.py``'s, whose prefix state is float32 by default.)"""
    import dataclasses

    from microbenchmarks import tune_tail
    from microbenchmarks.shapes import PRESETS

    shape = dataclasses.replace(PRESETS["B-short"], requests=4, name="small")
    runs = {d: tune_tail.tune_shape(shape, [], iters=3, bandwidth=1e12, prefix_dtype=d) for d in ("query", "float32")}
    assert runs["float32"]["prefix_dtype"] == "float32" and runs["query"]["prefix_dtype"] == "bfloat16"
    for run in runs.values():
        assert run["default"] is not None and run["default"]["us"] > 0
        assert run["default"]["ulps_vs_default"] == 0.0 and run["default"]["spills"] == 0
    state_elements = shape.requests * shape.beams * shape.heads * shape.head_dim
    assert runs["float32"]["tail_bytes"] - runs["query"]["tail_bytes"] == 2 * state_elements


@pytest.mark.gpu
def test_tune_tail_times_the_error_flag_build_against_the_flagless_output():
    """On a GPU, ``error_flags=True`` times the flag build of every tiling (here the default's and one more) with its
    word left 0 on this valid input (a set bit fails the tiling): the default's flag build writes the flagless default's
    output to the ulp (the flag adds only integer work), the other tiling within the mismatch bound (its own rounding);
    the document says which build it timed."""
    from microbenchmarks import tune_tail
    from microbenchmarks.shapes import PRESETS

    shape = dataclasses.replace(PRESETS["B-short"], requests=4, name="small")
    run = tune_tail.tune_shape(shape, [(1, 1, 4, 0, 0)], iters=3, bandwidth=1e12, error_flags=True)
    assert run["error_flags"] is True and run["default"] is not None
    timed = [r for r in run["all"] if "us" in r]
    assert len(timed) == len(run["all"]) == 2, run["all"]
    assert all(r["us"] > 0 and r["ulps_vs_default"] <= tune_tail.MISMATCH_ULPS for r in timed)
    assert run["default"]["ulps_vs_default"] == 0.0
