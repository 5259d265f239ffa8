"""Sweep the fused tail kernel's tiling on the GPU: ``python -m microbenchmarks.tune_tail``.

For each shape, every :class:`triton_kernels.TailLaunchConfig` in the grid (``kv_heads_per_prog`` x
``block_t`` x ``num_warps`` x ``index_block`` x ``grouped``; ``index_block`` 0 is the tile-at-a-time
index chain)
is checked against the default tiling's output and timed as a CUDA graph with CUDA events, L2
flushed between calls, median of ``--iters`` calls. Tilings sum in different orders in float32, so
their bf16/fp16 outputs may differ by a rounding step; a difference beyond ``MISMATCH_ULPS`` units
in the last place of the output dtype (at the value's magnitude) is reported as a mismatch (a bug).
The result table shows each shape's default tiling beside the best one, the byte floor of the tail
stage, and the tilings closest to each shape's best across all shapes (geometric mean). It informs
:func:`triton_kernels.tail_merge.tail_launch_config`; it is not a test.

Each distinct set of constexprs compiles once (about 1 s); the default grid (the sixth round's: KV
heads per program 1/2/4/8 x 1/2/4 warps x both kernels, one token per iteration; 24 tilings) runs
the six default shapes in about a minute on the H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from typing import Dict, List

import torch

from .floors import count_traffic, measure_copy_bandwidth, stage_work
from .report import write_progress_json
from .shapes import PRESETS, BenchShape, ShapeError, tuning_shapes
from .timing import capture_graph, time_cuda
from .workload import build_workload

SHAPES = [
    dataclasses.replace(PRESETS["A"], tail=1, name="A-t1"),
    dataclasses.replace(PRESETS["A"], tail=3, name="A-t3"),
    dataclasses.replace(PRESETS["A"], tail=8, name="A-t8"),
    dataclasses.replace(PRESETS["A"], tail=32, name="A-t32"),
    PRESETS["B-short"],
    PRESETS["B-medium"],
    PRESETS["B-4B"],
    PRESETS["B-beam14"],
]
DEFAULT_SHAPES = ["A-t3", "A-t32", "B-short", "B-medium", "B-4B", "B-beam14"]
# The prefix output's dtype (--prefix-dtype): the query's, as the library's wrapper passes it (None), or float32, which
# direct callers of the tail kernel may pass and which takes more registers in some tiles.
PREFIX_DTYPES = {"query": None, "float32": torch.float32}
# bf16 outputs of tilings that differ only in float32 summation order can round one step apart.
MISMATCH_ULPS = 2.0


def ulps_apart(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` in units of the output dtype's spacing at ``max(|out|, |ref|)``.

    The spacing of a float with ``m`` mantissa bits at ``x`` in ``[2^e, 2^(e+1))`` is ``2^(e-m)``;
    magnitudes below ``2^-10`` count as ``2^-10`` so values near zero do not divide by nothing.
    NaN anywhere gives ``inf``.
    """
    eps = torch.finfo(out.dtype).eps
    a, b = out.float(), ref.float()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -10))  # x = f * 2^exponent, f in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(a, eps), exponent - 1)
    return ((a - b).abs() / spacing).max().item()


def _tail_call(wl, cfg, out, prefix_out, prefix_lse, error_flags=None):
    import triton_kernels

    def call():
        return triton_kernels.beam_tail_attention_merge(
            wl.q, wl.new_k, wl.new_v, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
            wl.cache_indirection, wl.beam_width, prefix_out, prefix_lse, out, kv_layout=wl.kv_layout,
            launch_config=cfg, error_flags=error_flags,
        )

    return call


def tune_shape(shape: BenchShape, grid: List, iters: int, bandwidth: float, prefix_dtype: str = "query",
               error_flags: bool = False) -> Dict:
    """Check and time every tiling of ``grid`` (``(kv_heads_per_prog, block_t, num_warps, index_block,
    grouped)`` tuples) on ``shape`` (CUDA); ``bandwidth`` in bytes/s gives the tail's byte floor; ``prefix_dtype``
    (``PREFIX_DTYPES``) is the prefix output's dtype, the query's or float32. ``error_flags`` times the kernels'
    device-error-flag builds (``TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS=1``), each tiling with its own ``int32 [1]``
    word, which must stay 0 on this valid input. Returns the shape's ``default``, ``best`` and ``all`` results (times in us,
    mismatch in ulps of the output dtype)."""
    from triton_kernels import tail_merge
    from triton_kernels.device_errors import decode_error_flags, new_error_flags
    from triton_kernels.tail_merge import TailLaunchConfig, tail_launch_config

    from .tune_cascade import _resources

    wl = build_workload(shape, device="cuda", seed=0, with_baseline_pages=False)
    rows = wl.num_rows
    gen = torch.Generator(device="cuda").manual_seed(1)
    prefix_out = torch.randn(wl.q.shape, generator=gen, device="cuda").to(PREFIX_DTYPES[prefix_dtype] or wl.q.dtype)
    prefix_lse = torch.randn(rows, shape.heads, generator=gen, device="cuda") * 4 + 8
    default = tail_launch_config(shape.heads // shape.kv_heads, shape.kv_heads, shape.head_dim, wl.num_rows)
    ref = torch.empty_like(wl.q)
    _tail_call(wl, default, ref, prefix_out, prefix_lse)()
    torch.cuda.synchronize()

    traffic = count_traffic(
        wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.kv_heads, shape.head_dim,
        shape.page_size, wl.q.element_size(), tail_ancestry=wl.tail_ancestry,
    )
    tail_bytes = stage_work("tail", traffic, 0, wl.prompt_lens_host, shape.tail, shape.beams,
                            shape.heads, shape.head_dim, shape.page_size)["bytes"]
    # The stage's traffic counts the prefix output at the query's element size; float32 state reads more.
    tail_bytes += prefix_out.numel() * (prefix_out.element_size() - wl.q.element_size())
    floor_us = tail_bytes / bandwidth * 1e6

    results = []
    group_pad = default.group_pad
    configs = []
    # Query tiles past 8,192 elements are left out, unless the default's is as large (G = 33-64 at head 256).
    max_tile = max(8192, default.kv_heads_per_prog * group_pad * shape.head_dim)
    for kvh, bt, nw, ib, grouped in grid:
        if kvh * group_pad * shape.head_dim > max_tile or kvh > shape.kv_heads or (ib and ib < bt):
            continue
        if grouped and (bt != 1 or ib):  # the grouped kernel walks one token at a time
            continue
        configs.append(TailLaunchConfig(group_pad, kvh, bt, nw, default.tokens_outer, ib, bool(grouped)))
    if default not in configs:
        configs.append(default)
    for cfg in configs:
        out = torch.full_like(wl.q, float("nan"))
        flags = new_error_flags(wl.q.device) if error_flags else None
        call = _tail_call(wl, cfg, out, prefix_out, prefix_lse, flags)
        try:
            res = _resources(call, tail_merge, "launch")
            torch.cuda.synchronize()
            err = ulps_apart(out, ref)
            if flags is not None and int(flags.item()):
                raise RuntimeError(f"error flags {decode_error_flags(int(flags.item()))} on valid input")
            graphed = capture_graph(call)
            t = time_cuda([graphed], iters=iters, warmup=3).median_us
        except Exception as exc:  # a config that does not compile is reported, not fatal
            results.append({"config": dataclasses.asdict(cfg), "error": str(exc)[:200]})
            continue
        results.append({"config": dataclasses.asdict(cfg), "us": t, "ulps_vs_default": err, **res})
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    dflt = next((r for r in ok if r["config"] == dataclasses.asdict(default)), None)
    return {
        "shape": shape.name or str(shape),
        "rows": rows,
        "prefix_dtype": str(prefix_out.dtype).replace("torch.", ""),
        "error_flags": error_flags,
        "floor_us": floor_us,
        "tail_bytes": tail_bytes,
        "default": dflt,
        "best": best,
        "all": results,
    }


def _key(config: Dict) -> tuple:
    """(kv_heads_per_prog, block_t, num_warps, index_block, grouped) of a result's config."""
    return (config["kv_heads_per_prog"], config["block_t"], config["num_warps"], config["index_block"],
            int(config.get("grouped", False)))


def _across_shapes(report: List[Dict]) -> List[tuple]:
    """(geometric mean of time / shape's best, worst ratio, key) for tilings timed on every shape."""
    ratios: Dict[tuple, List[float]] = {}
    for r in report:
        for x in r["all"]:
            if "us" in x:
                ratios.setdefault(_key(x["config"]), []).append(x["us"] / r["best"]["us"])
    rows = []
    for key, rs in ratios.items():
        if len(rs) == len(report):
            rows.append((math.exp(sum(math.log(v) for v in rs) / len(rs)), max(rs), key))
    return sorted(rows)


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-heads-per-prog", default="1,2,4,8")
    p.add_argument("--block-t", default="1")
    p.add_argument("--num-warps", default="1,2,4")
    p.add_argument("--index-block", default="0", help="0: the tile-at-a-time index chain; e.g. 0,16,32")
    p.add_argument("--grouped", default="0,1", help="1: the kernel with the group in each thread's registers")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {[s.name for s in SHAPES]}")
    p.add_argument("--tails", default=None,
                   help="run each shape at these tails instead of its own (e.g. 4,64,256; names gain -tN)")
    p.add_argument("--custom", default=None,
                   help="extra shapes RxWxP[:Hq/Hkv[/D]] (default 16/8, D 128; page 32), e.g. 8x8x500,2x12x6000:32/4")
    p.add_argument("--prefix-dtype", choices=sorted(PREFIX_DTYPES), default="query",
                   help="dtype of the prefix output the tail merges: the query's (the library's wrapper) or float32")
    p.add_argument("--error-flags", action="store_true",
                   help="time the device-error-flag builds (each call ORs bad-index bits into an int32 word)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    grid = list(itertools.product(
        ints(args.kv_heads_per_prog), ints(args.block_t), ints(args.num_warps), ints(args.index_block),
        ints(args.grouped)))
    try:
        shapes = tuning_shapes(SHAPES, args.shapes, args.custom, args.tails)
    except ShapeError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        print("tune_tail: no CUDA device; nothing to tune.")
        return 0
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {len(grid)} tilings per shape "
          f"(kv_heads_per_prog, block_t, num_warps, index_block, grouped)", flush=True)
    report = []
    doc = {"bandwidth": bandwidth, "prefix_dtype": args.prefix_dtype, "error_flags": args.error_flags,
           "complete": False, "shapes": report}
    for shape in shapes:
        r = tune_shape(shape, grid, args.iters, bandwidth, args.prefix_dtype, args.error_flags)
        report.append(r)
        if args.json:
            write_progress_json(doc, args.json)
        d, b = r["default"], r["best"]
        fmt = lambda x: "-" if x is None else f"{x['us']:.1f} us {_key(x['config'])}"  # noqa: E731
        print(f"{r['shape']:>10}: floor {r['floor_us']:.1f} us | default {fmt(d)} | best {fmt(b)}", flush=True)
        for x in sorted((x for x in r["all"] if "us" in x), key=lambda x: x["us"])[:5]:
            print(f"{'':>12}{x['us']:.1f} us {_key(x['config'])} {x['ulps_vs_default']:.1f} ulp vs default, "
                  f"regs {x.get('regs')} spills {x.get('spills')}")
        bad = [x for x in r["all"] if "us" in x and not x["ulps_vs_default"] <= MISMATCH_ULPS]
        if bad:
            worst = max(bad, key=lambda x: x["ulps_vs_default"])
            print(f"{'':>12}MISMATCH in {len(bad)} tilings (> {MISMATCH_ULPS} ulp of the output dtype), worst "
                  f"{worst['ulps_vs_default']:.1f} ulp at {_key(worst['config'])}", flush=True)
        errors = [x for x in r["all"] if "error" in x]
        if errors:
            print(f"{'':>12}{len(errors)} tilings failed, e.g. {errors[0]}", flush=True)
    if len(report) > 1 and all(r["best"] for r in report):
        print("closest to each shape's best (geometric mean of time / best, worst), over all shapes:")
        for gm, worst, key in _across_shapes(report)[:8]:
            print(f"{'':>12}{key}: {100 * (gm - 1):.1f}% mean, {100 * (worst - 1):.1f}% worst")
    if args.json:
        write_progress_json({**doc, "complete": True}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
