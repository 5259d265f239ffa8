"""Host time of the step planner: a first plan and a cached re-plan.

The default batch is preset A's (issue 6): 128 requests x 96 beams x 3,000-token prompts, page 32.
Each request lists beam 0's whole block list (prompt pages plus the generated page the tail has
opened), as the TensorRT-LLM adapter passes it, from a shuffled pool.

Cases (median of ``--reps`` timed calls, ``time.perf_counter_ns``, after warm-up):

- ``build_step_plan``: validation and every plan array, no cache (the first plan of a batch).
- ``planner miss, key`` / ``planner miss, digest``: ``StepPlanner.plan`` on an empty cache, with a
  composition key / without one (the digest of the inputs is computed, then the plan is built).
- ``planner hit, key``: ``StepPlanner.plan(..., key=key)`` on a cached key (steady-state step).
- ``planner hit, digest``: ``StepPlanner.plan(...)`` without a key on cached inputs.
- ``composition key``: building ``(tuple(request_ids), beam_width)`` from a list of ids, the
  adapter's own cost for the key.

Inputs are int32 numpy arrays by default, or CPU torch tensors with ``--inputs torch``.

Run: ``python -m microbenchmarks.bench_plan [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

from beam_shared_prefix.plan import StepPlanner, build_step_plan, cdiv

__all__ = ["make_batch", "time_ns", "run_benchmark", "main"]


def make_batch(num_requests: int, beam_width: int, prompt_len: int, page_size: int, tail_len: int = 3, seed: int = 0):
    """Planner inputs of a uniform batch: ``(indptr, indices, prompt_lens, num_cache_pages)`` (int32 numpy)."""
    prompt_pages = cdiv(prompt_len, page_size)
    listed = cdiv(prompt_len + tail_len, page_size)  # beam 0's block list, generated pages included
    # Pool: shared full prompt pages, a private partial page and private generated pages per beam.
    per_request = prompt_len // page_size + beam_width * (listed - prompt_len // page_size)
    num_cache_pages = num_requests * per_request + 1
    rng = np.random.default_rng(seed)
    indices = rng.permutation(num_cache_pages)[: num_requests * listed].astype(np.int32)
    indptr = (np.arange(num_requests + 1) * listed).astype(np.int32)
    prompt_lens = np.full(num_requests, prompt_len, dtype=np.int32)
    assert prompt_pages <= listed
    return indptr, indices, prompt_lens, num_cache_pages


def time_ns(fn: Callable[[], object], reps: int, warmup: int = 5) -> Dict[str, float]:
    """Median / min / p90 of ``reps`` timed calls of ``fn`` in microseconds."""
    for _ in range(warmup):
        fn()
    samples: List[int] = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {
        "median_us": statistics.median(samples) / 1e3,
        "min_us": samples[0] / 1e3,
        "p90_us": samples[int(0.9 * (len(samples) - 1))] / 1e3,
        "reps": reps,
    }


def run_benchmark(num_requests=128, beam_width=96, prompt_len=3000, page_size=32, reps=200, inputs="numpy"):
    """Time every case; returns ``{"config": ..., "results": {case: stats}}``."""
    indptr, indices, lens, num_pages = make_batch(num_requests, beam_width, prompt_len, page_size)
    if inputs == "torch":
        import torch

        indptr, indices, lens = (torch.from_numpy(a) for a in (indptr, indices, lens))
    args = (indptr, indices, lens, beam_width)
    request_ids = list(range(1000, 1000 + num_requests))
    key = (tuple(request_ids), beam_width)

    def miss(with_key):
        def fn():
            StepPlanner(page_size, num_pages, max_beam_width=beam_width).plan(*args, key=key if with_key else None)

        return fn

    hit_key = StepPlanner(page_size, num_pages, max_beam_width=beam_width)
    first = hit_key.plan(*args, key=key)
    hit_digest = StepPlanner(page_size, num_pages, max_beam_width=beam_width)
    hit_digest.plan(*args)
    results = {
        "build_step_plan": time_ns(
            lambda: build_step_plan(*args, page_size, num_pages, max_beam_width=beam_width), reps
        ),
        "planner miss, key": time_ns(miss(True), reps),
        "planner miss, digest": time_ns(miss(False), reps),
        "planner hit, key": time_ns(lambda: hit_key.plan(*args, key=key), reps * 10),
        "planner hit, digest": time_ns(lambda: hit_digest.plan(*args), reps),
        "composition key": time_ns(lambda: (tuple(request_ids), beam_width), reps * 10),
    }
    assert hit_key.num_builds == 1 and hit_digest.num_builds == 1, "a cached re-plan rebuilt the plan"
    assert hit_key.plan(*args, key=key) is first
    config = {
        "requests": num_requests,
        "beam_width": beam_width,
        "prompt_len": prompt_len,
        "page_size": page_size,
        "rows": num_requests * beam_width,
        "prompt_pages": int(first.total_prompt_pages),
        "listed_pages": int(len(indices)),
        "num_cache_pages": int(num_pages),
        "inputs": inputs,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    return {"config": config, "results": results}


def _print_table(report) -> None:
    c = report["config"]
    print(
        f"planner host time: {c['requests']} requests x {c['beam_width']} beams x {c['prompt_len']}-token prompts, "
        f"page {c['page_size']} ({c['prompt_pages']} prompt pages, {c['inputs']} inputs)"
    )
    header = f"{'case':<24}{'median us':>12}{'min us':>12}{'p90 us':>12}{'reps':>8}"
    print(header)
    print("-" * len(header))
    for name, r in report["results"].items():
        print(f"{name:<24}{r['median_us']:>12.2f}{r['min_us']:>12.2f}{r['p90_us']:>12.2f}{r['reps']:>8}")


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--beams", type=int, default=96)
    p.add_argument("--prompt", type=int, default=3000, help="prompt length in tokens")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=200, help="timed calls per case (x10 for the cheap cases)")
    p.add_argument("--inputs", choices=("numpy", "torch"), default="numpy")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    a = p.parse_args(argv)
    report = run_benchmark(a.requests, a.beams, a.prompt, a.page_size, a.reps, a.inputs)
    _print_table(report)
    if a.json:
        text = json.dumps(report, indent=2)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
