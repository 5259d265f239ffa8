"""Sweep the one-launch cascade kernel's tiling on the GPU: ``python -m microbenchmarks.tune_cascade``.

For each shape (presets by ``--shapes``, ``RxWxP[:Hq/Hkv[/D]]`` shapes by ``--custom``, each at ``--tails`` if
given), every :class:`triton_kernels.CascadeLaunchConfig` of the grid (beams per program x
``block_n`` x ``tail_block`` x warps x stages x register cap x KV heads per program x prompt first x
pipeline stages of the prompt and the tail x tail on CUDA cores x shared-ancestry path; tiles over 128 query rows
skipped) is run on the shape's workload, compared with the default tiling's output and timed as a CUDA graph with CUDA
events, L2 flushed between calls, median of ``--iters`` calls. Tilings change the summation order
and where the softmax weights are rounded to the KV dtype before ``P V`` (relative to a different
running max), so outputs differ by a few units of the dtype; ``max |out - ref| / max |ref|`` above
the benchmark's oracle tolerance (:data:`microbenchmarks.check.OUT_TOL`) is reported as a mismatch.
With ``--prefix-only`` the prompt pass alone
(:func:`triton_kernels.beam_prefix_attention`, output and LSE to memory, as the ``triton`` prefix
backend runs it in front of the tail kernel) is tuned instead, against the prefix stage's floor.
The KV write is off unless ``--write-kv``; with it, every call stores the same K/V (the tail never
reads this step's slot from the cache), so every call still sees the same inputs.
Times are reported against the step's floor (all bytes the step must move over the copy bandwidth
measured in the same run). The default a shape is compared with is the library's own choice for
its launch, which depends on the prompt table's width (one 128-token block at B-short). It informs :func:`triton_kernels.cascade.cascade_launch_config`; it is
not a test. ``--vary FIELD=V1,V2`` (repeatable) replaces the grid by each shape's default tiling with those fields
set, so that one choice (``shared_ancestry=0,1``, ``num_warps=4,8``) is compared across shapes whose defaults differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Dict, List

import torch

from .check import OUT_TOL
from .floors import count_flops, count_traffic, measure_copy_bandwidth, stage_work
from .report import write_progress_json
from .shapes import PRESETS, BenchShape, ShapeError, tuning_shapes
from .timing import capture_graph, time_cuda
from .workload import build_workload, torch_dtype

SHAPES = {name: PRESETS[name] for name in ("A", "B-short", "B-medium", "B-long", "B-4B", "B-beam14")}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in float32; ``inf`` if ``out`` has a non-finite element."""
    a, b = out.float(), ref.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def parse_vary(specs: list[str]) -> list[dict[str, object]]:
    """``--vary`` specs (``FIELD=V1,V2``, a :class:`triton_kernels.CascadeLaunchConfig` field, dashes or
    underscores) as the product of their overrides: ``[{field: value, ...}, ...]``. Booleans take ``0``/``1``;
    the optional ints (``max_registers``, the stages) also take ``none``.

    Raises:
        ValueError: a spec without ``=`` or values, an unknown field, or a value its field cannot take."""
    from triton_kernels.cascade import CascadeLaunchConfig

    fields = {f.name: f.type for f in dataclasses.fields(CascadeLaunchConfig)}
    axes = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        field = name.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--vary {spec!r} is not FIELD=V1,V2")
        if field not in fields:
            raise ValueError(f"--vary {spec!r}: {field!r} is not a launch-config field; use one of {sorted(fields)}")
        kind = str(fields[field])
        parsed = []
        for text in (v.strip().lower() for v in values.split(",") if v.strip()):
            if text == "none" and "Optional" in kind:
                parsed.append(None)
            elif "bool" in kind and text in ("0", "1"):
                parsed.append(text == "1")
            elif "bool" not in kind and text.lstrip("-").isdigit():
                parsed.append(int(text))
            else:
                raise ValueError(f"--vary {spec!r}: {text!r} is not a value of {field} ({kind})")
        axes.append([(field, v) for v in parsed])
    return [dict(combo) for combo in itertools.product(*axes)]


def _resources(cfg_call, module=None, launcher: str = "_launch") -> Dict:
    """Registers, spills and shared memory of the kernel a call compiles (from Triton's launch result), read by
    wrapping ``module.launcher``, the function the call launches through (the cascade's ``_launch`` by default)."""
    if module is None:
        import triton_kernels.cascade as module

    seen = {}
    launch = getattr(module, launcher)

    def spy(*args, **kwargs):
        seen["kernel"] = launch(*args, **kwargs)
        return seen["kernel"]

    setattr(module, launcher, spy)
    try:
        cfg_call()
    finally:
        setattr(module, launcher, launch)
    k = seen.get("kernel")
    try:
        return {"regs": int(k.n_regs), "spills": int(k.n_spills), "smem": int(k.metadata.shared)}
    except (AttributeError, TypeError):
        return {}


def _cascade_call(wl, table, cfg, out, write_kv=False):
    import triton_kernels

    def call():
        return triton_kernels.beam_cascade_attention(
            wl.q, wl.new_k, wl.new_v, wl.kv_cache, table, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
            wl.cache_indirection, wl.beam_width, out, kv_layout=wl.kv_layout, write_kv=write_kv, launch_config=cfg,
        )

    return call


def _prefix_call(wl, table, prompt_lens, cfg, out, lse):
    import triton_kernels

    def call():
        return triton_kernels.beam_prefix_attention(wl.q, wl.kv_cache, table, prompt_lens, wl.beam_width, out, lse,
                                                    kv_layout=wl.kv_layout, launch_config=cfg)

    return call


def tune_shape(shape: BenchShape, grid: List[tuple], iters: int, bandwidth: float, write_kv: bool = False,
               l2_flush: str = "read", prefix_only: bool = False, variants: list[dict] | None = None) -> Dict:
    """Check and time every tiling of ``grid`` (``(beams, block_n, tail_block, num_warps, num_stages,
    max_registers, heads_per_program, prompt_first, prompt_stages, tail_stages, tail_on_cores,
    shared_ancestry)``,
    ``max_registers`` and the stages 0 for the defaults), and the shape's default tiling with each of
    ``variants``' field overrides (:func:`parse_vary`), on
    ``shape``; returns the shape's ``floor_us``, ``default``, ``best`` and ``all`` results (us, ulps)."""
    import numpy as np

    from beam_shared_prefix.plan import build_step_plan
    from triton_kernels.cascade import (
        CascadeLaunchConfig,
        cascade_launch_config,
        launch_multiprocessors,
    )

    wl = build_workload(shape, device="cuda", seed=0, with_baseline_pages=False)
    plan = build_step_plan(wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(),
                           wl.prompt_lens_host.astype(np.int32), wl.beam_width, shape.page_size, wl.num_pages)
    table = torch.from_numpy(plan.page_table.copy()).cuda()
    group = shape.heads // shape.kv_heads
    # The library's own choice for this launch: the prompt table's width and the program count are part of it.
    default = cascade_launch_config(shape.beams, group, shape.head_dim, table.shape[1] * shape.page_size,
                                    shape.requests, shape.kv_heads, launch_multiprocessors(wl.q.device))
    prompt_lens = torch.from_numpy(plan.prompt_lens.astype("int32")).cuda()

    def make_call(cfg, out):
        if prefix_only:
            lse = torch.full(out.shape[:2], float("nan"), dtype=torch.float32, device=out.device)
            return _prefix_call(wl, table, prompt_lens, cfg, out, lse)
        return _cascade_call(wl, table, cfg, out, write_kv)

    ref = torch.empty_like(wl.q)
    make_call(default, ref)()
    torch.cuda.synchronize()
    traffic = count_traffic(wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.kv_heads,
                            shape.head_dim, shape.page_size, wl.q.element_size(), tail_ancestry=wl.tail_ancestry)
    flops = count_flops(wl.prompt_lens_host, shape.tail, shape.beams, shape.heads, shape.head_dim)
    full = stage_work("prefix" if prefix_only else "full", traffic, flops, wl.prompt_lens_host, shape.tail,
                      shape.beams, shape.heads, shape.head_dim, shape.page_size)
    floor_us = full["bytes"] / bandwidth * 1e6

    configs = []
    for beams, block_n, tail_block, warps, stages, max_regs, heads, prompt_first, prompt_stages, tail_stages, cores, \
            shared in grid:
        if cores and prompt_first:  # the core tail runs before the prompt
            continue
        cfg = CascadeLaunchConfig(beams, default.group_pad, block_n, tail_block, warps, stages, max_regs or None,
                                  heads, bool(prompt_first), prompt_stages or None, tail_stages or None, bool(cores),
                                  bool(shared) and not cores)  # (the core tail has no shared-ancestry path)
        if cfg.block_m > 128 or cfg.block_m < 16 or (warps > 4 and cfg.block_m < 64) or (
                beams * tail_block < 32 and not cores) or cfg in configs:
            continue
        configs.append(cfg)
    for overrides in variants or []:
        cfg = dataclasses.replace(default, **overrides)
        if cfg not in configs:
            configs.append(cfg)
    if default not in configs:
        configs.append(default)
    results = []
    for cfg in configs:
        out = torch.full_like(wl.q, float("nan"))
        call = make_call(cfg, out)
        try:
            res = _resources(call)
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            t = time_cuda([capture_graph(call)], iters=iters, warmup=3, l2_flush=l2_flush).median_us
        except Exception as exc:  # a tiling that does not compile is reported, not fatal
            results.append({"config": dataclasses.asdict(cfg), "error": str(exc)[-300:]})
            continue
        results.append({"config": dataclasses.asdict(cfg), "us": t, "rel_err_vs_default": err, **res})
    ok = [r for r in results if "us" in r]
    return {
        "shape": shape.name,
        "floor_us": floor_us,
        "default": next((r for r in ok if r["config"] == dataclasses.asdict(default)), None),
        "best": min(ok, key=lambda r: r["us"]) if ok else None,
        "all": results,
    }


def _key(config: Dict) -> tuple:
    return (config["beams_per_program"], config["block_n"], config["tail_block"], config["num_warps"],
            config["num_stages"], config.get("max_registers"), config.get("heads_per_program", 1),
            int(config.get("prompt_first", False)), config.get("prompt_stages"), config.get("tail_stages"),
            int(config.get("tail_on_cores", False)), int(config.get("shared_ancestry", False)))


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--beams", default="16,32,64", help="beams per program")
    p.add_argument("--block-n", default="32,64")
    p.add_argument("--tail-block", default="1,2")
    p.add_argument("--num-warps", default="4,8")
    p.add_argument("--num-stages", default="2,3")
    p.add_argument("--max-registers", default="0", help="register caps per thread (0: the compiler's choice)")
    p.add_argument("--heads-per-program", default="1", help="KV heads per program")
    p.add_argument("--prompt-first", default="0", help="0: tail then prompt; 1: prompt then tail")
    p.add_argument("--prompt-stages", default="0", help="pipeline stages of the prompt loop (0: num_stages)")
    p.add_argument("--tail-stages", default="0", help="pipeline stages of the tail loop (0: num_stages)")
    p.add_argument("--tail-on-cores", default="0", help="0: masked tensor-core tail blocks; 1: the tail on CUDA "
                   "cores, before the prompt (prompt_first 1 is skipped with it)")
    p.add_argument("--shared-ancestry", default="1",
                   help="0: every tail position per beam; 1: the run all beams of a tile share, once (from 16 "
                        "cached positions; the tail-on-cores tilings have no such path)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--l2-flush", choices=("read", "write", "none"), default="read",
                   help="how L2 is emptied between timed calls (microbenchmarks.timing.L2Flush)")
    p.add_argument("--write-kv", action="store_true",
                   help="time with the step's KV write (it stores the same K/V at every call)")
    p.add_argument("--prefix-only", action="store_true",
                   help="tune the prompt pass alone (beam_prefix_attention), not the one-launch step")
    p.add_argument("--top", type=int, default=4, help="tilings listed per shape")
    p.add_argument("--default-only", action="store_true", help="time only each shape's default tiling")
    p.add_argument("--vary", action="append", default=[], metavar="FIELD=V1,V2",
                   help="time each shape's default tiling with a launch-config field set to each value, instead of "
                        "the grid (repeatable: the product), e.g. --vary shared-ancestry=0,1")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)} ('' for none)")
    p.add_argument("--custom", default=None,
                   help="extra shapes RxWxP[:Hq/Hkv[/D]] (default 16/8, D 128; page 32), e.g. 64x30x500:16/16")
    p.add_argument("--tails", default=None,
                   help="run each shape at these tails instead of its own (e.g. 4,16,64; names gain -tN)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    try:
        shapes = tuning_shapes(SHAPES.values(), args.shapes, args.custom, args.tails)
    except ShapeError as exc:
        p.error(str(exc))
    try:
        variants = parse_vary(args.vary)
    except ValueError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        print("tune_cascade: no CUDA device; nothing to tune.")
        return 0
    grid = [] if args.default_only or args.vary else list(itertools.product(
        ints(args.beams), ints(args.block_n), ints(args.tail_block), ints(args.num_warps), ints(args.num_stages),
        ints(args.max_registers), ints(args.heads_per_program), ints(args.prompt_first), ints(args.prompt_stages),
        ints(args.tail_stages), ints(args.tail_on_cores), ints(args.shared_ancestry)))
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {len(grid) or len(variants)} tilings per shape "
          f"(beams, block_n, tail_block, num_warps, num_stages, max_registers, heads_per_program, prompt_first, "
          f"prompt_stages, tail_stages, tail_on_cores, shared_ancestry)", flush=True)
    report = []
    doc = {"bandwidth": bandwidth, "l2_flush": args.l2_flush, "prefix_only": args.prefix_only, "complete": False,
           "shapes": report}
    for shape in shapes:
        name = shape.name
        r = tune_shape(shape, grid, args.iters, bandwidth, args.write_kv, args.l2_flush, args.prefix_only, variants)
        report.append(r)
        if args.json:
            write_progress_json(doc, args.json)
        fmt = lambda x: "-" if x is None else f"{x['us']:.1f} us ({x['us'] / r['floor_us']:.2f}x) {_key(x['config'])}"  # noqa: E731
        print(f"{name:>9}: floor {r['floor_us']:.1f} us | default {fmt(r['default'])} | best {fmt(r['best'])}",
              flush=True)
        for x in sorted((x for x in r["all"] if "us" in x), key=lambda x: x["us"])[:args.top]:
            print(f"{'':>11}{x['us']:.1f} us {_key(x['config'])} rel err {x['rel_err_vs_default']:.1e} vs default, "
                  f"regs {x.get('regs')} spills {x.get('spills')} smem {x.get('smem')}")
        tol = OUT_TOL[torch_dtype(shape.dtype)]
        bad = [x for x in r["all"] if "us" in x and not x["rel_err_vs_default"] <= tol]
        if bad:
            print(f"{'':>11}MISMATCH in {len(bad)} tilings (rel err > {tol}), e.g. {_key(bad[0]['config'])} "
                  f"{bad[0]['rel_err_vs_default']:.1e}", flush=True)
        errors = [x for x in r["all"] if "error" in x]
        if errors:
            print(f"{'':>11}{len(errors)} tilings failed, e.g. {errors[0]}", flush=True)
    if args.json:
        write_progress_json({**doc, "complete": True}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
