"""Presets, free arguments and sweeps of the benchmark CLI (CPU, no measurement)."""

from dataclasses import replace

import pytest

from microbenchmarks.cli import build_parser, resolve_shapes
from microbenchmarks.shapes import (
    PRESETS,
    SAMPLE_HEADS,
    SAMPLE_RANGES,
    BenchShape,
    ShapeError,
    expand_sweeps,
    parse_custom_shapes,
    parse_sweep,
    reduced_cpu_shape,
    sample_shapes,
    tuning_shapes,
)

# The reference workloads as issue 6 states them: (R, W, P, T, Hq, Hkv); all bf16, head 128, page 32.
ISSUE_PRESETS = {
    "A": (128, 96, 3000, 3, 16, 8),
    "B-short": (64, 30, 100, 4, 16, 8),
    "B-medium": (64, 30, 500, 4, 16, 8),
    "B-long": (64, 30, 2000, 4, 16, 8),
    "B-4B": (64, 30, 500, 4, 32, 8),
    "B-beam14": (64, 14, 500, 4, 16, 8),
}


def test_presets_are_the_issue_workloads():
    assert set(PRESETS) == set(ISSUE_PRESETS)
    for name, (R, W, P, T, hq, hkv) in ISSUE_PRESETS.items():
        s = PRESETS[name]
        assert (s.requests, s.beams, s.prompt, s.tail, s.heads, s.kv_heads) == (R, W, P, T, hq, hkv), name
        assert (s.head_dim, s.page_size, s.dtype, s.prompt_jitter, s.name) == (128, 32, "bfloat16", 0.0, name)


def parse(argv):
    return resolve_shapes(build_parser().parse_args(argv))


def test_cli_preset_free_arguments_and_default():
    assert parse([]) == [PRESETS["A"]]
    assert parse(["--preset", "B-long"]) == [PRESETS["B-long"]]
    (s,) = parse(["--preset", "B-medium", "--beams", "7", "--kv-heads", "4", "--dtype", "fp16", "--head-dim", "64",
                  "--page-size", "16", "--tail", "9", "--requests", "3", "--prompt", "77", "--heads", "12"])
    assert (s.requests, s.beams, s.prompt, s.tail, s.heads, s.kv_heads, s.head_dim, s.page_size, s.dtype) == (
        3, 7, 77, 9, 12, 4, 64, 16, "float16")
    assert s.name == "custom"
    # An override equal to the preset's value keeps the preset's name.
    assert parse(["--preset", "B-medium", "--beams", "30"])[0].name == "B-medium"
    (s,) = parse(["--preset", "B-medium", "--ancestry", "Independent"])
    assert (s.ancestry, s.name) == ("independent", "custom") and s.label().endswith(" independent ancestry")
    assert PRESETS["B-medium"].ancestry == "beam-search" and "ancestry" not in PRESETS["B-medium"].label()


def test_cli_sweeps_form_a_grid():
    shapes = parse(["--preset", "B-medium", "--sweep", "beams=14,30", "--sweep", "prompt=100,500,2000"])
    assert [(s.beams, s.prompt) for s in shapes] == [(14, 100), (14, 500), (14, 2000), (30, 100), (30, 500), (30, 2000)]
    assert all(s.heads == 16 and s.requests == 64 for s in shapes)
    assert shapes[0].name == "B-medium[beams=14,prompt=100]"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("beams=14,30,96,256", ("beams", [14, 30, 96, 256])),
        ("prompt=100, 500", ("prompt", [100, 500])),
        ("kv-heads=2,4", ("kv_heads", [2, 4])),
        ("head_dim=64,128", ("head_dim", [64, 128])),
        ("dtype=bf16,fp16", ("dtype", ["bfloat16", "float16"])),
        ("ancestry=beam_search,Independent", ("ancestry", ["beam-search", "independent"])),
    ],
)
def test_parse_sweep(text, expected):
    assert parse_sweep(text) == expected


@pytest.mark.parametrize(
    "text,needle",
    [("beams", "KEY=V1"), ("width=3", "unknown"), ("beams=", "no values"), ("beams=3,x", "'x'"),
     ("beams=3,3", "twice"), ("dtype=fp8", "fp8"), ("ancestry=greedy", "'greedy'")],
)
def test_parse_sweep_errors_name_the_value(text, needle):
    with pytest.raises(ShapeError, match=needle):
        parse_sweep(text)


def test_sweep_values_are_validated_and_fields_not_repeated():
    with pytest.raises(ShapeError, match="kv_heads=3"):
        expand_sweeps(PRESETS["A"], [parse_sweep("kv-heads=3")])
    with pytest.raises(ShapeError, match="twice"):
        expand_sweeps(PRESETS["A"], [parse_sweep("beams=2"), parse_sweep("beams=4")])


@pytest.mark.parametrize(
    "kwargs,needle",
    [(dict(beams=0), "beams=0"), (dict(heads=12, kv_heads=8), "multiple of kv_heads=8"),
     (dict(head_dim=60), "head_dim=60"), (dict(prompt_jitter=1.5), "prompt_jitter"), (dict(dtype="int8"), "int8"),
     (dict(ancestry="sampled"), "ancestry='sampled'.*beam-search, uniform, independent")],
)
def test_shape_validation(kwargs, needle):
    base = dict(requests=2, beams=4, prompt=10, tail=2)
    base.update(kwargs)
    with pytest.raises(ShapeError, match=needle):
        BenchShape(**base)


def test_cli_rejects_bad_values_with_usage_error(capsys):
    from microbenchmarks.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--sweep", "beams=0"])
    assert exc.value.code == 2
    assert "beams=0" in capsys.readouterr().err


def test_parse_custom_shapes_reads_the_tuning_tools_items():
    """``RxWxP[:Hq/Hkv[/D]]`` items at B-medium's heads or the item's, named by the item; a malformed one is
    named with the form it must take."""
    a, b, c, d = parse_custom_shapes("8x8x500,64X4x100,2x12x6000:32/4,1x8x50:8/1/64")
    assert (a.requests, a.beams, a.prompt, a.heads, a.kv_heads, a.name) == (8, 8, 500, 16, 8, "8x8x500")
    assert (b.requests, b.beams, b.prompt) == (64, 4, 100)
    assert (c.requests, c.beams, c.prompt, c.heads, c.kv_heads, c.head_dim) == (2, 12, 6000, 32, 4, 128)
    assert (d.heads, d.kv_heads, d.head_dim) == (8, 1, 64)
    assert (a.tail, a.page_size, a.dtype) == (PRESETS["B-medium"].tail, 32, "bfloat16")
    assert parse_custom_shapes("") == []
    for bad in ("8x8", "8x8x500:32/5", "8x8x500:32", "8x8x500:16/8/64/2", "8x0x500"):
        with pytest.raises(ShapeError, match=f"'{bad}' is not RxWxP"):
            parse_custom_shapes(bad)


def test_tuning_shapes_pick_presets_and_custom_shapes_at_each_tail():
    """The tuning tools' ``--shapes``, ``--custom`` and ``--tails``: named presets in the order named, then the
    custom shapes, each at every tail (``-tN`` names); an unknown name, a bad tail or no shape is refused."""
    known = [PRESETS["B-short"], PRESETS["B-4B"]]
    shapes = tuning_shapes(known, "B-4B,B-short", "8x8x500:16/16", "4,64")
    assert [(s.name, s.tail) for s in shapes] == [("B-4B-t4", 4), ("B-4B-t64", 64), ("B-short-t4", 4),
                                                  ("B-short-t64", 64), ("8x8x500:16/16-t4", 4),
                                                  ("8x8x500:16/16-t64", 64)]
    assert shapes[4].kv_heads == 16 and shapes[0].heads == 32
    assert tuning_shapes(known, "B-short") == [PRESETS["B-short"]]
    for names, custom, tails, needle in (("A", None, None, "unknown shapes ['A']"), ("", None, None, "no shapes"),
                                         ("B-short", None, "4,0", "must list positive integers")):
        with pytest.raises(ShapeError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            tuning_shapes(known, names, custom, tails)


def test_reduced_cpu_shape_keeps_the_attention_shape():
    for s in PRESETS.values():
        r = reduced_cpu_shape(s)
        assert (r.heads, r.kv_heads, r.head_dim, r.page_size, r.dtype) == (s.heads, s.kv_heads, s.head_dim, s.page_size, s.dtype)
        assert r.requests <= 2 and r.beams <= 8 and r.tail <= 5
        # Shared full pages and a private partial page both appear when the preset's prompt allows.
        assert r.prompt // r.page_size >= 1 and (r.prompt % r.page_size or r.prompt == s.prompt)
    # A large page would make the 2.5-page prompt long (a 65,536-token page: a prompt of 163,841 tokens).
    r = reduced_cpu_shape(replace(PRESETS["A"], page_size=65536, prompt=200_000))
    assert (r.page_size, r.prompt) == (32, 81)
    # A sweep point's name keeps only the swept values the reduction did not change.
    names = [reduced_cpu_shape(p).name for p in expand_sweeps(PRESETS["B-medium"], [("beams", [4, 30]),
                                                                                       ("heads", [32])])]
    assert names == ["B-medium[beams=4,heads=32]-cpu", "B-medium[heads=32]-cpu"]


def test_each_point_records_the_rule_with_its_tail():
    """The JSON's ``decline_reason`` is the library's rule at the point's tail: B-medium's 4 generated
    tokens are served; 64 of them over 100-token prompts were 0.49x-1.71x of per-beam decode on the
    H200 (docs/rounds.md, "The twenty-first round") and are declined at 64 x 30 (1.71x, but past
    the band's 6 prompt tokens per generated token: 16 tokens at most)."""
    from microbenchmarks.runner import decline_reason

    medium = PRESETS["B-medium"]
    assert decline_reason(medium) is None
    long_tail = BenchShape(requests=64, beams=medium.beams, prompt=100, tail=64, heads=16, kv_heads=8)
    assert "tail 64 generated tokens per beam > 14 (beam width 30 and 1920 beam rows" in decline_reason(long_tail)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_shapes_are_seeded_and_inside_their_ranges(seed):
    """The same seed draws the same shapes, another seed others; every draw inside :data:`SAMPLE_RANGES`, with one
    model's heads, and a per-beam decode under the byte cap."""
    cap = 8e9
    shapes = sample_shapes(40, seed, max_decode_bytes=cap)
    assert shapes == sample_shapes(40, seed, max_decode_bytes=cap)
    assert shapes != sample_shapes(40, seed + 10, max_decode_bytes=cap)
    for s in shapes:
        for field, (low, high) in SAMPLE_RANGES.items():
            assert low <= getattr(s, field) <= high, (s.label(), field)
        assert (s.heads, s.kv_heads, s.head_dim) in SAMPLE_HEADS
        assert s.requests * s.beams * (s.prompt + s.tail) * s.kv_heads * s.head_dim * 4 <= cap
    # Log-uniform over a wide range: both ends of each field are reached in a sample of this size.
    assert min(s.beams for s in shapes) < 30 and max(s.beams for s in shapes) > 96
    assert min(s.prompt for s in shapes) < 256 and max(s.prompt for s in shapes) > 1024


def test_sample_shapes_reject_a_bad_count_cap_head_size_or_fixed_field():
    with pytest.raises(ShapeError, match=r"--sample 0 must be in \[1, 10000\]"):
        sample_shapes(0)
    with pytest.raises(ShapeError, match="is below the smallest sampled shape's"):
        sample_shapes(3, max_decode_bytes=1e3)
    with pytest.raises(ShapeError, match=r"--head-dim 96: no sampled model has it; use one of \[64, 128\]"):
        sample_shapes(3, head_dim=96)
    with pytest.raises(ShapeError, match="--sample draws beams; they cannot be fixed"):
        sample_shapes(3, beams=30)


@pytest.mark.parametrize("seed", [3, 4])
def test_sample_seeds_still_draw_the_audited_shapes(seed):
    """The fifty-first round's audit (``audit_round51_seed{3,4}.json``) names its shapes by seed: the sampler must
    draw them again, or the documented audit no longer says which shapes it ran."""
    import json
    import pathlib

    doc = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "results" / "h200"
                      / f"audit_round51_seed{seed}.json").read_text())
    fields = ("requests", "beams", "prompt", "tail", "heads", "kv_heads", "head_dim")
    audited = [tuple(p["shape"][f] for f in fields) for p in doc["results"]]
    assert [tuple(getattr(s, f) for f in fields) for s in sample_shapes(len(audited), seed)] == audited


def test_the_cpu_path_keeps_a_tail_of_up_to_5_tokens():
    from microbenchmarks.shapes import PRESETS, reduced_cpu_shape

    assert {n: reduced_cpu_shape(s).tail for n, s in PRESETS.items()} == {n: min(s.tail, 5) for n, s in PRESETS.items()}
