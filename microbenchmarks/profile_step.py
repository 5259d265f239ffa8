"""Run one kernel of the step on a preset's workload a few times, for a profiler: ``python -m
microbenchmarks.profile_step --preset B-short --kernel cascade``.

It builds the preset's workload (seed 0, as the benchmark does) and launches the chosen kernel
``--calls`` times with its default tiling, nothing else: the first launch compiles, so a profiler
skips it, e.g.::

    ncu -k regex:beam_cascade -s 1 -c 1 --set full -o prof python -m microbenchmarks.profile_step --preset B-short
    ncu -k regex:beam_tail -s 1 -c 1 --set full -o prof python -m microbenchmarks.profile_step --kernel tail

Kernels: ``cascade`` (the one-launch step, KV write on), ``prefix`` (its prompt pass alone),
``tail`` (the tail kernel on a random prefix state: its time does not depend on the state's values).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from .arms import _step_plan
from .shapes import PRESETS, BenchShape
from .workload import build_workload

KERNELS = ("cascade", "prefix", "tail")


def launch(kernel: str, shape: BenchShape, calls: int, device: str = "cuda") -> torch.Tensor:
    """Launch ``kernel`` ``calls`` times on ``shape``'s workload, synchronize, and return its output
    ``[rows, Hq, D]`` (``device`` "cpu" runs the kernels under ``TRITON_INTERPRET=1``, for tests)."""
    import triton_kernels

    wl = build_workload(shape, device=device, seed=0, with_baseline_pages=False)
    plan = _step_plan(wl)
    table = torch.from_numpy(plan.page_table.copy()).to(device)
    prompt_lens = torch.from_numpy(plan.prompt_lens.astype(np.int32)).to(device)
    out = torch.full_like(wl.q, float("nan"))
    rows, heads = wl.q.shape[0], wl.q.shape[1]
    lse = torch.empty(rows, heads, device=device, dtype=torch.float32)
    prefix_out = torch.randn_like(wl.q)
    prefix_lse = torch.randn(rows, heads, device=device, dtype=torch.float32)
    for _ in range(calls):
        if kernel == "cascade":
            triton_kernels.beam_cascade_attention(
                wl.q, wl.new_k, wl.new_v, wl.kv_cache, table, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                wl.cache_indirection, wl.beam_width, out, kv_layout=wl.kv_layout, write_kv=True)
        elif kernel == "prefix":
            triton_kernels.beam_prefix_attention(wl.q, wl.kv_cache, table, prompt_lens, wl.beam_width, out, lse,
                                                 kv_layout=wl.kv_layout)
        else:
            triton_kernels.beam_tail_attention_merge(
                wl.q, wl.new_k, wl.new_v, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                wl.cache_indirection, wl.beam_width, prefix_out, prefix_lse, out, kv_layout=wl.kv_layout)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="B-short", choices=sorted(PRESETS))
    p.add_argument("--kernel", default="cascade", choices=KERNELS)
    p.add_argument("--calls", type=int, default=3, help="launches (the first one compiles)")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls {args.calls} must be >= 1")
    if not torch.cuda.is_available():
        print("profile_step: no CUDA device; nothing to profile.")
        return 0
    launch(args.kernel, PRESETS[args.preset], args.calls)
    print(f"profile_step: {args.calls} launches of {args.kernel} at {args.preset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
