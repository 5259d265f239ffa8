"""Sweep the fused tail kernel's tiling on the GPU: ``python -m microbenchmarks.tune_tail``.

For each shape, every :class:`triton_kernels.TailLaunchConfig` in the grid is checked against the
default tiling's output (same inputs, so any difference beyond float32 summation order is a bug)
and timed as a CUDA graph with CUDA events, L2 flushed between calls, median of ``--iters`` calls.
The result table shows each shape's default tiling beside the best one, and the byte floor of the
tail stage. It informs :func:`triton_kernels.tail_merge.tail_launch_config`; it is not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import Dict, List

import torch

from .floors import count_traffic, measure_copy_bandwidth, stage_work
from .shapes import PRESETS, BenchShape
from .timing import capture_graph, time_cuda
from .workload import build_workload

DEFAULT_SHAPES = [
    dataclasses.replace(PRESETS["A"], tail=1, name="A-t1"),
    dataclasses.replace(PRESETS["A"], tail=3, name="A-t3"),
    dataclasses.replace(PRESETS["A"], tail=8, name="A-t8"),
    dataclasses.replace(PRESETS["A"], tail=32, name="A-t32"),
    PRESETS["B-short"],
    PRESETS["B-medium"],
    PRESETS["B-4B"],
    PRESETS["B-beam14"],
]


def _tail_call(wl, cfg, out, prefix_out, prefix_lse):
    import triton_kernels

    def call():
        return triton_kernels.beam_tail_attention_merge(
            wl.q, wl.new_k, wl.new_v, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
            wl.cache_indirection, wl.beam_width, prefix_out, prefix_lse, out, kv_layout=wl.kv_layout,
            launch_config=cfg,
        )

    return call


def tune_shape(shape: BenchShape, grid: List, iters: int, bandwidth: float) -> Dict:
    from triton_kernels.tail_merge import TailLaunchConfig, tail_launch_config

    wl = build_workload(shape, device="cuda", seed=0, with_baseline_pages=False)
    rows = wl.num_rows
    gen = torch.Generator(device="cuda").manual_seed(1)
    prefix_out = torch.randn(wl.q.shape, generator=gen, device="cuda").to(wl.q.dtype)
    prefix_lse = torch.randn(rows, shape.heads, generator=gen, device="cuda") * 4 + 8
    default = tail_launch_config(shape.heads // shape.kv_heads, shape.kv_heads, shape.head_dim)
    ref = torch.empty_like(wl.q)
    _tail_call(wl, default, ref, prefix_out, prefix_lse)()
    torch.cuda.synchronize()

    traffic = count_traffic(
        wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.kv_heads, shape.head_dim,
        shape.page_size, wl.q.element_size(), tail_ancestry=wl.tail_ancestry,
    )
    tail_bytes = stage_work("tail", traffic, 0, wl.prompt_lens_host, shape.tail, shape.beams,
                            shape.heads, shape.head_dim, shape.page_size)["bytes"]
    floor_us = tail_bytes / bandwidth * 1e6

    results = []
    group_pad = default.group_pad
    for kvh, bt, nw in grid:
        if kvh * group_pad * shape.head_dim > 8192 or kvh > shape.kv_heads:
            continue
        cfg = TailLaunchConfig(group_pad, kvh, bt, nw, default.tokens_outer)
        out = torch.full_like(wl.q, float("nan"))
        call = _tail_call(wl, cfg, out, prefix_out, prefix_lse)
        try:
            call()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            graphed = capture_graph(call)
            t = time_cuda([graphed], iters=iters, warmup=3).median_us
        except Exception as exc:  # a config that does not compile is reported, not fatal
            results.append({"config": dataclasses.asdict(cfg), "error": str(exc)[:200]})
            continue
        results.append({"config": dataclasses.asdict(cfg), "us": t, "max_abs_diff_vs_default": err})
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    dflt = next((r for r in ok if r["config"] == dataclasses.asdict(default)), None)
    return {
        "shape": shape.name or str(shape),
        "rows": rows,
        "floor_us": floor_us,
        "tail_bytes": tail_bytes,
        "default": dflt,
        "best": best,
        "all": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-heads-per-prog", default="1,2,4,8")
    p.add_argument("--block-t", default="1,2,4")
    p.add_argument("--num-warps", default="2,4,8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default=",".join(s.name for s in DEFAULT_SHAPES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_tail: no CUDA device; nothing to tune.")
        return 0
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    grid = list(itertools.product(ints(args.kv_heads_per_prog), ints(args.block_t), ints(args.num_warps)))
    names = args.shapes.split(",")
    shapes = [s for s in DEFAULT_SHAPES if s.name in names]
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {len(grid)} tilings per shape", flush=True)
    report = []
    for shape in shapes:
        r = tune_shape(shape, grid, args.iters, bandwidth)
        report.append(r)
        d, b = r["default"], r["best"]
        fmt = lambda x: "-" if x is None else f"{x['us']:.1f} us {tuple(x['config'].values())[:4]}"  # noqa: E731
        print(f"{r['shape']:>10}: floor {r['floor_us']:.1f} us | default {fmt(d)} | best {fmt(b)}", flush=True)
        for x in sorted((x for x in r["all"] if "us" in x), key=lambda x: x["us"])[:5]:
            print(f"{'':>12}{x['us']:.1f} us {tuple(x['config'].values())[:4]} diff {x['max_abs_diff_vs_default']:.1e}")
        bad = [x for x in r["all"] if "us" in x and not x["max_abs_diff_vs_default"] < 1e-2]
        if bad:
            print(f"{'':>12}MISMATCH in {len(bad)} tilings", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "shapes": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
