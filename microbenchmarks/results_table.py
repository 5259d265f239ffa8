"""Markdown tables of benchmark JSON for ``docs/benchmarks.md``: ``python -m microbenchmarks.results_table``.

Reads documents written by ``beam-shared-prefix-bench --json`` (schema in :mod:`microbenchmarks.report`)
and prints, per shape point, one table: every arm's median time, its speedup over per-beam decode (the
faster of the tensor-core and CUDA-core variants) and over FlashInfer's cascade, and its multiple of the
floor. Library arms are compared with the whole step's floor, stage arms (``prefix/*``, ``tail/*``)
with their own stage's floor; stage arms get no speedups (they do only part of the step).

``--plan`` prints the host planning times instead (one row per point and library arm), ``--decline``
one row per point of a decline grid: the library's best time, the best per-beam decode, the speedup,
and the verdict of the rule now in :mod:`beam_shared_prefix.decline`.

Usage::

    python -m microbenchmarks.results_table docs/results/h200/A.json [more.json ...]
    python -m microbenchmarks.results_table --plan docs/results/h200/A.json
    python -m microbenchmarks.results_table --decline docs/results/h200/decline_g2.json

Every number printed comes from the JSON; nothing is measured here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence

from beam_shared_prefix.decline import should_decline

from .report import load_json, rule_now

__all__ = ["point_markdown", "plan_markdown", "decline_markdown", "main"]


def _us(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.2f} ms" if x >= 10_000 else f"{x:.1f} us"


def _x(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else (f"{x:.1f}x" if x >= 10 else f"{x:.2f}x")


def _rate(x: Optional[float]) -> str:
    """A measured rate, or "-" where none was measured (the CPU path)."""
    return "-" if x is None else f"{x:.0f}"


def _shape_line(point: Dict, rates: Dict) -> str:
    s = point["shape"]
    fl = point["floors"]
    return (
        f"{s['requests']} x {s['beams']} beams x {s['prompt']}-token prompts, tail {s['tail']}, "
        f"{s['heads']}/{s['kv_heads']} heads. Floor {_us(fl['floor_us'])} (memory {_us(fl['memory_us'])}, "
        f"compute {_us(fl['compute_us'])}; assembled {_us(fl['assembled_floor_us'])}) at "
        f"{_rate(rates.get('copy_bandwidth_GBps'))} GB/s and {_rate(rates.get('matmul_TFLOPs'))} TFLOP/s."
        + (f" An empty kernel measures {rates['event_overhead_us']:.1f} us with the events."
           if rates.get("event_overhead_us") else "")
    )


def point_markdown(point: Dict, rates: Dict) -> str:
    """One shape point as a markdown table (arm, time, vs decode, vs cascade, x floor; with kernel
    spans in the run, their time and multiple of the floor too)."""
    work = point.get("work") or {}
    spans = any(a.get("kernel_us") for a in point["arms"])
    lines = [
        f"**{point['shape'].get('name') or point['label']}**: {_shape_line(point, rates)}",
        "",
        "| arm | time | vs per-beam decode | vs cascade | x floor |" + (" kernels (x floor) |" if spans else ""),
        "| --- | --- | --- | --- | --- |" + (" --- |" if spans else ""),
    ]
    for a in point["arms"]:
        name = a["name"]
        if a["status"] != "ok":
            lines.append(f"| {name} | {a['status']} | | | |" + (" |" if spans else ""))
            continue
        kernels = (f" {_us(a['kernel_us'])} ({_x(a.get('kernel_floor_multiple'))}) |" if a.get("kernel_us")
                   else " - |") if spans else ""
        if a["kind"] == "stage":
            own = (work.get(a["work"]) or {}).get("floor_us")
            floor = f"{_x(a.get('floor_multiple'))} (own floor {_us(own)})"
            lines.append(f"| {name} | {_us(a['time_us'])} | - | - | {floor} |" + kernels)
        else:
            bold = "**" if a["kind"] == "library" else ""
            lines.append(
                f"| {bold}{name}{bold} | {bold}{_us(a['time_us'])}{bold} | {_x(a.get('speedup_vs_decode'))} | "
                f"{_x(a.get('speedup_vs_cascade'))} | {_x(a.get('floor_multiple'))} |" + kernels
            )
    return "\n".join(lines)


def plan_markdown(docs: Sequence[Dict]) -> str:
    """Host planning times of every point that has them, one row per library arm (microseconds)."""
    lines = [
        "| point | arm | cached re-plan, composition key | cached re-plan, digest key | first plan | StepPlan build |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for doc in docs:
        for point in doc["results"]:
            for name, p in (point.get("plan") or {}).items():
                lines.append(
                    f"| {point['shape'].get('name') or point['label']} | {name} | {p['replan_keyed_us']:.1f} us | "
                    f"{p['replan_us']:.1f} us | {p['first_plan_us']:.0f} us | {p['build_step_plan_us']:.0f} us |"
                )
    return "\n".join(lines)


def _best_time(arms: Sequence[Dict], names: Sequence[str]):
    ok = [a for a in arms if a["name"] in names and a["status"] == "ok"]
    return min(ok, key=lambda a: a["time_us"]) if ok else None


def decline_markdown(doc: Dict) -> str:
    """A decline grid as a markdown table, with the verdict of the rule in ``beam_shared_prefix.decline``: for a point
    with a ``library/auto`` arm, what the library decides for the shape (:func:`~.report.rule_now`, FlashInfer's split
    prompt and the cascade included); for a grid of one backend's arms, the rule for that backend's path."""
    lines = [
        "| beams W | prompt P | (W-1) x P | library | per-beam decode (best) | speedup | measured | rule |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in doc["results"]:
        s = p["shape"]
        mean_prompt = (p.get("prompt_lens") or {}).get("mean", s["prompt"])
        libs = [a for a in p["arms"] if a["kind"] == "library" and a["status"] == "ok" and "+flag" not in a["name"]]
        # What the library serves: its auto arm where the grid has one, else its fastest arm.
        auto = [a for a in libs if a["name"] == "library/auto"]
        lib = auto[0] if auto else (min(libs, key=lambda a: a["time_us"]) if libs else None)
        dec = _best_time(p["arms"], ("fi-decode-tc", "fi-decode-cc"))
        speedup = None if lib is None or dec is None else dec["time_us"] / lib["time_us"]
        measured = "-" if speedup is None else ("slower" if speedup < 1 else "faster")
        if auto:  # the library's own verdict for what auto did with the shape (its split prompt included)
            rule = rule_now(s)
        else:  # a grid of one backend's arms: the rule for that backend's path
            one_launch = lib is not None and (lib.get("info") or {}).get("backend") == "triton"
            rule = should_decline(s["requests"], s["beams"], mean_prompt, s["heads"], s["kv_heads"], s["head_dim"],
                                  one_launch=one_launch, tail_len=s.get("tail"))
        lines.append(
            f"| {s['beams']} | {mean_prompt:.0f} | {(s['beams'] - 1) * mean_prompt:.0f} | "
            f"{'-' if lib is None else _us(lib['time_us']) + ' (' + lib['name'] + ')'} | "
            f"{'-' if dec is None else _us(dec['time_us']) + ' (' + dec['name'] + ')'} | {_x(speedup)} | "
            f"{measured} | {'decline' if rule else 'serve'} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Print the requested markdown for the given JSON files; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="python -m microbenchmarks.results_table", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="JSON documents written by beam-shared-prefix-bench --json")
    parser.add_argument("--decline", action="store_true", help="print the decline-grid table instead")
    parser.add_argument("--plan", action="store_true", help="print the host planning times instead")
    args = parser.parse_args(argv)
    docs = [load_json(path) for path in args.files]
    if args.plan:
        out = [plan_markdown(docs)]
    elif args.decline:
        out = [decline_markdown(doc) for doc in docs]
    else:
        out = [point_markdown(p, p.get("rates") or doc["rates"]) for doc in docs for p in doc["results"]]
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
