"""Sweep the FA4 prefix's tile on the GPU: ``python -m microbenchmarks.tune_fa4``.

For each shape, the FA4 prefix backend runs with FA4's own tile and with every ``--tiles`` entry
(``tile_m x tile_n``); each output is compared with the default tile's (``max |out - ref| / max
|ref|``, reported above the oracle tolerance as a mismatch) and timed as a CUDA graph with CUDA
events, L2 flushed between calls, median of ``--iters`` calls, against the prefix stage's byte
floor. A tile with ``tile_n`` equal to the page size is refused by the backend (FA4's TMA path).
It informs :class:`beam_shared_prefix.prefix.fa4.FA4PrefixBackend`'s ``tile_mn``; it is not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple

import torch

from .arms import _step_plan
from .check import OUT_TOL
from .floors import count_flops, count_traffic, measure_copy_bandwidth, stage_work
from .shapes import PRESETS, BenchShape
from .timing import capture_graph, time_cuda
from .tune_cascade import rel_err
from .workload import build_workload, torch_dtype

SHAPES = {name: PRESETS[name] for name in ("A", "B-short", "B-medium", "B-long", "B-4B", "B-beam14")}


def parse_tiles(text: str) -> List[Tuple[int, int]]:
    """``"128x64,64x128"`` -> ``[(128, 64), (64, 128)]``."""
    tiles = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m, _, n = item.lower().partition("x")
        if not (m.isdigit() and n.isdigit()):
            raise ValueError(f"--tiles entry {item!r} is not MxN, e.g. 128x64")
        tiles.append((int(m), int(n)))
    return tiles


def tune_shape(shape: BenchShape, tiles: List[Tuple[int, int]], iters: int, bandwidth: float,
               l2_flush: str = "read") -> Dict:
    """Check and time FA4's default tile (``None``) and ``tiles`` on ``shape``; returns the prefix
    floor (us) and one result per tile (us, relative error against the default, or an error)."""
    from beam_shared_prefix.prefix.fa4 import FA4PrefixBackend

    wl = build_workload(shape, device="cuda", seed=0, with_baseline_pages=False)
    plan = _step_plan(wl)
    traffic = count_traffic(wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.kv_heads,
                            shape.head_dim, shape.page_size, wl.q.element_size(), tail_ancestry=wl.tail_ancestry)
    flops = count_flops(wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.head_dim)
    work = stage_work("prefix", traffic, flops, wl.prompt_lens_host, shape.tail, shape.beams, shape.heads,
                      shape.head_dim, shape.page_size)
    ref: Optional[torch.Tensor] = None
    results = []
    for tile in [None] + list(tiles):
        try:
            backend = FA4PrefixBackend(wl.device, kv_layout=wl.kv_layout, use_cuda_graph=True,
                                       max_requests=wl.num_requests, max_beam_width=wl.beam_width,
                                       max_prompt_pages=int(-(-wl.prompt_lens_host.max() // shape.page_size)),
                                       tile_mn=tile)
            backend.plan(plan, shape.heads, shape.kv_heads, shape.head_dim, shape.page_size, wl.dtype)
            out = torch.full_like(wl.q, float("nan"))
            lse = torch.empty(backend.lse_shape(wl.num_rows, shape.heads), dtype=torch.float32, device=wl.device)

            def call(backend=backend, out=out, lse=lse):
                return backend.run(wl.q, wl.kv_cache, out, lse, check=False)  # timed as the wrapper calls it

            call()  # compiles this tile
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            err = rel_err(out, ref)
            t = time_cuda([capture_graph(call)], iters=iters, warmup=3, l2_flush=l2_flush).median_us
        except Exception as exc:  # a tile FA4 cannot build is reported, not fatal
            results.append({"tile_mn": tile, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
            continue
        results.append({"tile_mn": tile, "us": t, "rel_err_vs_default": err})
    return {"shape": shape.name, "floor_us": work["bytes"] / bandwidth * 1e6, "all": results}


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", default="128x64,128x96,64x128,192x64",
                   help="tile_m x tile_n pairs besides FA4's own (e.g. 128x64,64x128)")
    p.add_argument("--shapes", default="B-4B", help=f"of {list(SHAPES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--l2-flush", choices=("read", "write", "none"), default="read")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        tiles = parse_tiles(args.tiles)
    except ValueError as exc:
        p.error(str(exc))
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    if not torch.cuda.is_available():
        print("tune_fa4: no CUDA device; nothing to tune.")
        return 0
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; tiles: FA4's own, {tiles}", flush=True)
    report = []
    for name in args.shapes.split(","):
        r = tune_shape(SHAPES[name], tiles, args.iters, bandwidth, args.l2_flush)
        report.append(r)
        tol = OUT_TOL[torch_dtype(SHAPES[name].dtype)]
        print(f"{name:>9}: prefix floor {r['floor_us']:.1f} us", flush=True)
        for x in r["all"]:
            label = "FA4's own" if x["tile_mn"] is None else "x".join(map(str, x["tile_mn"]))
            if "error" in x:
                print(f"{'':>11}{label:>10}: {x['error']}", flush=True)
                continue
            flag = "" if x["rel_err_vs_default"] <= tol else f"  MISMATCH (> {tol})"
            print(f"{'':>11}{label:>10}: {x['us']:.1f} us ({x['us'] / r['floor_us']:.2f}x floor), rel err "
                  f"{x['rel_err_vs_default']:.1e} vs FA4's own{flag}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "l2_flush": args.l2_flush, "shapes": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
