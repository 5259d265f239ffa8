"""Time the library's eager calls (no CUDA graph) on the GPU: ``python -m microbenchmarks.eager_calls``.

An engine that runs beam search without CUDA graphs issues each layer's ``run()`` from Python, so a call
costs the larger of its host time and its device time, and the backends differ in both: FA4 + tail pays
more host time a call than the one-launch cascade (docs/rounds.md, "The thirty-fourth round"). The CLI
times graph replays and backlogged calls, which hide host time; this tool measures it. For each shape and
library arm, over ``--batches`` batches of ``--calls`` back-to-back ``run()`` calls of one planned step
(medians over the batches):

- ``host_us``: wall time to issue the batch / calls, no sync inside (what the host pays before it can issue
  the next layer); ``host_min_us`` the fastest batch;
- ``step_us``: CUDA events around the same batch / calls (an eager caller's time a call); ``step_min_us`` the
  fastest batch's (on a noisy host the medians of one path spread by tens of us, the fastest batches less);
- ``device_us``: the batch queued behind a ``torch.cuda._sleep`` spin longer than its issue time, so the
  events bracket device time alone.

The ``--json`` document (rewritten after every shape; ``complete`` false until the end) holds one row per
shape and arm under ``results``, as the committed ``docs/results/h200/eager_*.json`` files do, and where ``auto`` and
an arm of another path were timed, the shape's verdict under ``verdicts`` (:func:`auto_verdict`: the path ``auto``
ran against the fastest other path, also printed), which is how an eager rule's miss shows. It informs
``auto``'s eager limits (``beam_shared_prefix/prefix/cascade_rule.py``); it is not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .arms import ArmSkipped, LibraryArm, RunContext
from .report import write_progress_json
from .shapes import PRESETS, ShapeError, tuning_shapes
from .timing import sleep_cycles_per_us
from .workload import build_workload

# The "-shared" arms run the shared-run stage on every step: the library arms pass ``shared_run`` explicitly, so
# TLLM_BEAM_SHARED_PREFIX_SHARED_RUN in the environment does not reach them.
ARMS = ("auto", "triton", "fa4", "flashinfer", "fa4-shared", "flashinfer-shared")
DEFAULT_SHAPES = ("B-short", "B-medium", "A")
# What a row's times are, for the --json document.
FIELDS_NOTE = ("eager (no CUDA graph) BeamSharedPrefixAttention.run() of one planned step through the CLI's "
               "LibraryArm: host_us = wall time of a batch of back-to-back calls / calls, no sync inside (median over "
               "the batches; host_min_us their minimum); step_us = CUDA events around the same batch / calls (an eager "
               "caller's time a call; step_min_us the fastest batch's); device_us = the batch queued behind a "
               "torch.cuda._sleep spin that outlasts its issue, so the events bracket device time alone. "
               "python -m microbenchmarks.eager_calls")
# Retries of a device-time batch whose issue outlasted its spin (the device then idled between calls).
SPIN_RETRIES = 3


def time_eager_calls(call: Callable[[], object], calls: int, batches: int, warmup: int) -> Dict[str, float]:
    """Host, per-call and device time (us a call, medians over ``batches``) of ``calls`` back-to-back ``call()``s.

    Raises:
        RuntimeError: the device-time batches kept outlasting their spin (``SPIN_RETRIES`` doublings).
    """
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    hosts, steps = [], []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        hosts.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        end.synchronize()
        steps.append(start.elapsed_time(end) * 1e3 / calls)
    devices = []
    spin_us = 2.0 * calls * max(hosts)
    cycles_per_us = sleep_cycles_per_us()
    for _ in range(batches):
        for _attempt in range(SPIN_RETRIES + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(spin_us * cycles_per_us))
            t0 = time.perf_counter()
            start.record()
            for _ in range(calls):
                call()
            end.record()
            issue_us = (time.perf_counter() - t0) * 1e6
            end.synchronize()
            # The spin must outlast the issue, or the events would bracket host gaps as well.
            if issue_us < spin_us:
                devices.append(start.elapsed_time(end) * 1e3 / calls)
                break
            spin_us *= 2.0
        else:
            raise RuntimeError(f"issuing {calls} calls outlasted a {spin_us / 2:.0f} us spin {SPIN_RETRIES + 1} times; "
                               f"this host is too busy to time device work behind a spin")
    return {"host_us": statistics.median(hosts), "host_min_us": min(hosts), "step_us": statistics.median(steps),
            "step_min_us": min(steps), "device_us": statistics.median(devices)}


def measure_shape(shape, arms: Sequence[str], calls: int, batches: int, warmup: int, seed: int) -> List[Dict]:
    """One row per arm of ``arms`` (library backends, :data:`ARMS`; ``-shared``: with the shared-run stage on
    every step) for ``shape``: the backend that served, the
    shared-run stage, :func:`time_eager_calls`'s times; an arm that cannot run gets ``skipped`` instead."""
    device = torch.device("cuda")
    workload = build_workload(shape, device=device, seed=seed, with_baseline_pages=False)
    rows = []
    for name in arms:
        arm = LibraryArm(name.split("-")[0], shared_run=True) if name.endswith("-shared") else LibraryArm(name)
        row = {"shape": shape.to_dict(), "arm": arm.name}
        try:
            prepared = arm.prepare(workload, RunContext(device=device, use_graphs=False))
        except ArmSkipped as exc:
            rows.append({**row, "skipped": str(exc)})
            continue
        row.update(backend=prepared.info.get("backend"), shared_run=prepared.info.get("shared_run"))
        row.update(time_eager_calls(prepared.call, calls, batches, warmup))
        rows.append(row)
    return rows


# The prefix each backend's eager call runs, for the verdict lines (the cascade is one launch, prefix and tail).
PREFIXES = {"fa4": "FA4", "flashinfer": "FlashInfer", "reference": "reference"}


def path_name(row: Dict) -> str:
    """The path a timed row ran: ``the cascade``, or its prefix, the shared-run stage where it ran, and the tail."""
    if row.get("backend") == "triton":
        return "the cascade"
    prefix = PREFIXES.get(row.get("backend"), str(row.get("backend")))
    return f"{prefix} + stage + tail" if row.get("shared_run") else f"{prefix} + tail"


def auto_verdict(rows: Sequence[Dict]) -> Optional[Dict]:
    """One shape's rows (from :func:`measure_shape`) judged as the eager rule is: the path ``auto`` ran and its time a
    call (``step_us``, us) against the fastest arm that ran another path (``best_*``; ``auto_over_best`` their ratio,
    above 1 where ``auto`` was slower: the rule's miss), and, where an arm also ran ``auto``'s path, that arm's time
    (``same_path_*``: the spread of two timings of one path, the scale a miss is read against). ``None`` without a
    timed ``auto`` row and a timed row of another path."""
    timed = [r for r in rows if "skipped" not in r]
    auto = next((r for r in timed if r["arm"] == "library/auto"), None)
    if auto is None:
        return None
    others = [r for r in timed if r["arm"] != "library/auto"]
    other_paths = [r for r in others if path_name(r) != path_name(auto)]
    if not other_paths:
        return None
    best = min(other_paths, key=lambda r: r["step_us"])
    verdict = {"shape": auto["shape"]["name"], "auto_path": path_name(auto), "auto_step_us": auto["step_us"],
               "best_arm": best["arm"], "best_path": path_name(best), "best_step_us": best["step_us"],
               "auto_over_best": auto["step_us"] / best["step_us"]}
    twin = next((r for r in others if path_name(r) == path_name(auto)), None)
    if twin is not None:
        verdict.update(same_path_arm=twin["arm"], same_path_step_us=twin["step_us"])
    return verdict


def verdict_line(verdict: Dict) -> str:
    """:func:`auto_verdict` as one terminal line."""
    line = (f"{verdict['shape']}: auto ran {verdict['auto_path']}, {verdict['auto_step_us']:.1f} us a call; the fastest "
            f"other path, {verdict['best_path']} ({verdict['best_arm']}), {verdict['best_step_us']:.1f} us: auto "
            f"{verdict['auto_over_best']:.2f}x")
    if "same_path_arm" in verdict:
        line += f" ({verdict['auto_path']} timed again as {verdict['same_path_arm']}: {verdict['same_path_step_us']:.1f} us)"
    return line


def _parse_arms(text: str) -> List[str]:
    arms = [a.strip().lower() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"--arms {text!r}: use a comma list of {', '.join(ARMS)} (library backends; "
                         f"unknown: {unknown or 'none given'})")
    return arms


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"presets, of {list(PRESETS)}")
    p.add_argument("--custom", default=None,
                   help="extra shapes RxWxP[:Hq/Hkv[/D]] (default 16/8, D 128; page 32), e.g. 64x30x8000,64x16x8000:32/8")
    p.add_argument("--tails", default=None, help="run each shape at these tails instead of its own (e.g. 4,64)")
    p.add_argument("--arms", default="triton,fa4,auto", help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--calls", type=int, default=100, help="back-to-back run() calls a batch")
    p.add_argument("--batches", type=int, default=7, help="batches a measurement (medians over them)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    p.add_argument("--seed", type=int, default=0, help="the workload's input set")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        arms = _parse_arms(args.arms)
        shapes = tuning_shapes(list(PRESETS.values()), args.shapes, args.custom, args.tails)
    except (ShapeError, ValueError) as exc:
        p.error(str(exc))
    for name in ("calls", "batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be at least 1")
    if not torch.cuda.is_available():
        print("eager_calls: no CUDA device; nothing to time.")
        return 0
    rows: List[Dict] = []
    verdicts: List[Dict] = []
    doc = {"note": FIELDS_NOTE, "argv": list(sys.argv[1:] if argv is None else argv), "calls": args.calls,
           "batches": args.batches, "complete": False, "results": rows, "verdicts": verdicts}
    for shape in shapes:
        shape_rows = measure_shape(shape, arms, args.calls, args.batches, args.warmup, args.seed)
        for row in shape_rows:
            rows.append(row)
            if "skipped" in row:
                print(f"{shape.label():44s} {row['arm']:16s} skipped: {row['skipped']}", flush=True)
            else:
                print(f"{shape.label():44s} {row['arm']:16s} {row['backend']!s:10s} host {row['host_us']:7.1f} us "
                      f"(min {row['host_min_us']:6.1f})  a call {row['step_us']:7.1f} us (min {row['step_min_us']:6.1f})  "
                      f"device {row['device_us']:7.1f} us",
                      flush=True)
        verdict = auto_verdict(shape_rows)
        if verdict is not None:
            verdicts.append(verdict)
            print(verdict_line(verdict), flush=True)
        if args.json:
            write_progress_json(doc, args.json)
    if args.json:
        write_progress_json({**doc, "complete": True}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
