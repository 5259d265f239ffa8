"""Output of a run: the terminal table, the JSON document and the speedup plot.

JSON document (``schema = "beam-shared-prefix-bench/1"``)::

    {
      "schema": ..., "argv": [...], "created": ISO time,
      "environment": {"device", "gpu", "cpu_fallback", "torch", "triton", "flashinfer", "flash_attn_4",
                      "cutlass_dsl", "beam_shared_prefix", "git_commit"},
      "rates": {"copy_bandwidth_GBps", "matmul_TFLOPs", "event_overhead_us"},
      "options": {...},                     # RunOptions
      "note": str or null,                  # e.g. why the CPU path ran
      "results": [                          # one per shape point (several with --sweep)
        {"shape": {...}, "label", "sets", "prompt_lens", "tail_lens", "traffic_bytes": {...}, "flops",
         "floors": {"memory_us", "assembled_memory_us", "compute_us", "floor_us", "assembled_floor_us"},
         "work": {"full"|"prefix"|"tail": {"bytes", "flops", "floor_us"}},
         "decline_reason": str or null,    # the rule's verdict on the eager path
         "rule_paths": {"eager", "graph"} or null,   # auto's path on eager steps and on a CUDA-graph wrapper
         "plan": {arm: {"first_plan_us", "replan_us", "replan_keyed_us", "build_step_plan_us"}},
         "arms": [{"name", "kind", "work", "description", "status" (ok|skipped|failed|check_failed),
                   "reason", "graphed", "graph_error", "info", "check": {...},
                   "time_us", "time_min_us", "time_set_medians_us", "samples", "host_gaps" (only when true),
                   "speedup_vs_decode", "speedup_vs_cascade", "floor_multiple",
                   "achieved_GBps", "achieved_TFLOPs",
                   # with --kernel-times: the calls' kernel spans in a CUPTI trace
                   "kernel_us", "kernel_set_medians_us", "kernel_floor_multiple" (or "kernel_error")}],
         # only in a --from-json merge, on a point whose file had other rates or options than the first file's
         "rates", "options", "argv"}
      ]
    }
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

__all__ = [
    "SCHEMA",
    "make_document",
    "write_json",
    "load_json",
    "print_point",
    "print_summary",
    "flag_cost_line",
    "plot_speedups",
    "decline_table",
    "audit_summary",
]

SCHEMA = "beam-shared-prefix-bench/1"


def make_document(results: List[Dict], environment: Dict, rates: Dict, options: Dict, argv: Sequence[str],
                  note: Optional[str] = None) -> Dict:
    """The results document (schema ``SCHEMA``) that ``--json`` writes and :func:`load_json` reads."""
    return {
        "schema": SCHEMA,
        "argv": list(argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment,
        "rates": rates,
        "options": options,
        "note": note,
        "results": results,
    }


def _clean(obj):
    """JSON-safe: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _clean(obj.item())
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def _replace_json(doc, path: str, **dump_kwargs) -> None:
    """Write ``doc`` to ``path`` (creating parent folders) aside, then rename it over ``path``, so that a kill
    mid-write leaves the previous version. A symlink is followed (its target is written); an existing path that is
    not a regular file (``/dev/stdout``, a pipe) is written in place, never replaced."""
    path = os.path.realpath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a file path")
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, **dump_kwargs)
            f.write("\n")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(doc, f, indent=1, **dump_kwargs)
        f.write("\n")
    os.replace(partial, path)


def write_json(doc: Dict, path: str, stdout=None) -> None:
    """Write the document (creating parent folders), strictly valid JSON (no NaN/Infinity); ``path`` ``"-"``
    writes it to ``stdout`` (default ``sys.stdout``)."""
    if path == "-":
        stream = stdout or sys.stdout
        json.dump(_clean(doc), stream, indent=1, allow_nan=False)
        stream.write("\n")
        stream.flush()
        return
    _replace_json(_clean(doc), path, allow_nan=False)


def write_progress_json(doc: Dict, path: str) -> None:
    """Write a sweep tool's document (``tune_cascade``, ``tune_tail``, ``eager_calls``) after each shape it finishes,
    so that a run cut short by a time limit keeps what it measured (``doc["complete"]`` says whether it ran to the
    end)."""
    _replace_json(doc, path)


def load_json(path: str) -> Dict:
    """Read a results document written by :func:`write_json`; refuses another schema."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}, not a results document; write it with this "
                         f"CLI's --json.")
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r} is not {SCHEMA!r}; write it with this CLI's --json.")
    missing = [k for k in ("results", "environment", "rates") if k not in doc]
    if missing or not isinstance(doc["results"], list):
        raise ValueError(f"{path}: a results document without {missing or ['a results list']}; write it with this "
                         f"CLI's --json.")
    return doc


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _us(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.2f} ms" if x >= 10_000 else f"{x:.1f} us"


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    import sys

    # Logs and pipes get a wide table instead of rich's default 80 columns. No markup: the tables and lines carry
    # bracketed text of their own ("[declined by the rule: ...]", "[host]"), which rich would take for style tags.
    options = dict(markup=False, emoji=False)
    return Console(**options) if sys.stdout.isatty() else Console(width=220, **options)


def _num(x, unit: str) -> str:
    """Three significant digits with a unit, ``-`` for None."""
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}{unit}"
    if x >= 10:
        return f"{x:.1f}{unit}"
    return f"{x:.3g}{unit}"


def _has_kernel_times(point: Dict) -> bool:
    return any("kernel_us" in a or "kernel_error" in a for a in point["arms"])


def _kernel_cell(a: Dict) -> str:
    if a.get("kernel_error"):
        return "trace failed"
    if a.get("kernel_us") is None:
        return "-"
    return f"{_us(a['kernel_us'])} ({_num(a.get('kernel_floor_multiple'), 'x')})"


def point_header(point: Dict) -> List[str]:
    """The table's columns for one point (a kernel-span column when the run traced kernels)."""
    if _has_kernel_times(point):
        return HEADER[:6] + ["kernels (x floor)"] + HEADER[6:]
    return list(HEADER)


def point_rows(point: Dict) -> List[List[str]]:
    """Table rows of one point: floors first, then every arm."""
    rows = []
    fl = point.get("floors") or {}
    tb = point.get("traffic_bytes")
    if tb:
        rows.append(["floor: memory", "", _us(fl.get("memory_us")), "", "", "", f"{tb['total'] / 1e6:.3g} MB", "", ""])
        rows.append(["floor: memory, assembled", "", _us(fl.get("assembled_memory_us")), "", "", "",
                     f"{tb['assembled'] / 1e6:.3g} MB", "", "+ prefix o/lse round trip"])
    if point.get("flops") is not None:
        rows.append(["floor: compute", "", _us(fl.get("compute_us")), "", "", "", "", _num(point["flops"] / 1e9, " GFLOP"), ""])
    floor_rows = len(rows)
    for a in point["arms"]:
        if a["status"] == "ok":
            chk = a.get("check")
            chk_s = "-" if not chk else f"ok {chk['rel_err']:.1e}"
            info = a.get("info") or {}
            extra = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("first_plan_us",))
            rows.append([
                a["name"],
                "graph" if a.get("graphed") else "eager",
                _us(a["time_us"]),
                _num(a.get("speedup_vs_decode"), "x"),
                _num(a.get("speedup_vs_cascade"), "x"),
                _num(a.get("floor_multiple"), "x"),
                _num(a.get("achieved_GBps"), " GB/s"),
                _num(a.get("achieved_TFLOPs"), " TFLOP/s"),
                chk_s + (f"; {extra}" if extra else "") + (f"; graph: {a['graph_error'][:60]}" if a.get("graph_error") else "")
                + ("; host gaps: the CPU enqueued slower than the queued spin, times may include waits on it"
                   if a.get("host_gaps") else ""),
            ])
        else:
            rows.append([a["name"], "", a["status"], "", "", "", "", "", (a.get("reason") or "")[:160]])
    if _has_kernel_times(point):
        for i, r in enumerate(rows):  # one row per arm after the floors', in order
            r.insert(6, "" if i < floor_rows else _kernel_cell(point["arms"][i - floor_rows]))
    return rows


def graph_path_note(point: Dict) -> Optional[str]:
    """Where a graphed ``library/auto`` arm (or ``auto-flag``'s ``library/auto+flag``) ran another path than the
    eager one the rule's verdict judges (its time is then not the eager step's): a note naming both, else ``None``."""
    paths = point.get("rule_paths") or {}
    auto = [a["name"] for a in point.get("arms", [])
            if a.get("name", "").split("+")[0] == "library/auto" and a.get("graphed")]
    if not auto or paths.get("eager") == paths.get("graph"):
        return None
    return (f"the rule judges the eager path ({paths['eager']}); {' and '.join(auto)} ran a CUDA graph, whose path "
            f"is {paths['graph']}")


HEADER = ["arm", "mode", "time (median)", "vs decode", "vs cascade", "x floor", "achieved", "TFLOP/s", "check / notes"]


def print_point(point: Dict, console=None) -> None:
    """Print one point's table (rich when available, plain text otherwise)."""
    console = console or _console()
    title = point["label"]
    if point.get("decline_reason"):
        title += f"  [declined by the rule: {point['decline_reason']}]"
    note = graph_path_note(point)
    if note:
        title += f"  [{note}]"
    rows = point_rows(point)
    header = point_header(point)
    if console is not None:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for h in header:
            table.add_column(h, overflow="fold", no_wrap=h in ("arm", "time (median)"))
        for r in rows:
            style = "dim" if r[0].startswith("floor") else ("red" if r[2] in ("failed", "check_failed") else None)
            table.add_row(*r, style=style)
        console.print(table)
    else:
        print(title)
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        for r in [header] + rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    line = flag_cost_line(point)
    if line:
        (console.print(line) if console is not None else print(line))
    plan = point.get("plan") or {}
    for name, p in plan.items():
        line = (f"plan ({name}): first {_fmt(p.get('first_plan_us'), '.0f')} us, cached re-plan "
                f"{_fmt(p.get('replan_us'), '.1f')} us (digest key), {_fmt(p.get('replan_keyed_us'), '.1f')} us "
                f"(composition key); StepPlan build {_fmt(p.get('build_step_plan_us'), '.0f')} us  [host]; "
                f"backend re-plans in cached calls: {p.get('backend_plans_in_cached_replans', '-')}")
        (console.print(line) if console is not None else print(line))


def flag_cost_line(point: Dict) -> Optional[str]:
    """The device error flag's cost at a point where an arm ran with and without it (``auto-flag``, a model's first
    layer with the page-table audit, or ``auto-flag-layer``, its later layers, next to ``auto``): ``None`` elsewhere."""
    arms = {a["name"]: a for a in point["arms"] if a["status"] == "ok"}
    parts = []
    for suffix, what in (("+flag", "with"), ("+flag-layer", "in a later layer (no audit)")):
        pairs = [(arms[name[:-len(suffix)]], a) for name, a in arms.items()
                 if name.endswith(suffix) and name[:-len(suffix)] in arms]
        if not pairs:
            continue
        off, on = pairs[0]
        part = f"{_us(on['time_us'])} {what} ({on['time_us'] / off['time_us']:.3f}x"
        if off.get("kernel_us") and on.get("kernel_us"):
            part += f", kernels {on['kernel_us'] / off['kernel_us']:.3f}x"
        parts.append((off, part + ")"))
    if not parts:
        return None
    off = parts[0][0]
    return (f"device error flag ({off['name']}): {_us(off['time_us'])} without; "
            + "; ".join(part for _, part in parts))


def print_summary(doc: Dict, console=None) -> None:
    """One line per point with the library arms' speedups (sweeps)."""
    console = console or _console()
    lines = []
    for p in doc["results"]:
        libs = [a for a in p["arms"] if a["kind"] == "library" and a["status"] == "ok"]
        parts = [f"{a['name']}: {_us(a['time_us'])} ({_fmt(a.get('speedup_vs_decode'), '.2f')}x decode, "
                 f"{_fmt(a.get('floor_multiple'), '.2f')}x floor"
                 + (f"; kernels {_us(a['kernel_us'])}, {_fmt(a.get('kernel_floor_multiple'), '.2f')}x"
                    if a.get("kernel_us") else "") + ")" for a in libs]
        note = graph_path_note(p)
        lines.append(f"{p['label']}: " + ("; ".join(parts) if parts else "no library arm ran")
                     + (f"  [{note}]" if note else ""))
    for line in lines:
        (console.print(line) if console is not None else print(line))


# Every field a sweep can vary (a line per combination of the others), so that no two series share a line.
_SHAPE_FIELDS = ("requests", "beams", "prompt", "tail", "heads", "kv_heads", "head_dim", "page_size", "dtype",
                 "prompt_jitter", "tail_jitter", "ancestry")


def _series(doc: Dict, field: str):
    """``{line label: [(x, speedup)]}`` over the points, x = the shape field, library arms only.

    One line per library arm and per combination of the other shape fields that vary in the
    document (a grid sweep gives one line per value of the other swept field).
    """
    varying = [f for f in _SHAPE_FIELDS if f != field and len({str(p["shape"].get(f)) for p in doc["results"]}) > 1]
    out: Dict[str, List] = {}
    for p in doc["results"]:
        x = p["shape"][field]
        tag = ",".join(f"{f}={p['shape'].get(f)}" for f in varying)
        for a in p["arms"]:
            if a["kind"] == "library" and a["status"] == "ok" and a.get("speedup_vs_decode"):
                label = a["name"] + (f" [{tag}]" if tag else "")
                out.setdefault(label, []).append((x, a["speedup_vs_decode"]))
    return {k: sorted(v) for k, v in out.items()}


def plot_speedups(doc: Dict, path: str) -> List[str]:
    """Speedup over per-beam decode against beam width and against prompt length (matplotlib).

    One panel per swept field among ``beams`` and ``prompt`` that takes at least two values (and has
    speedups: a per-beam decode arm ran); otherwise one bar chart of every arm's time at each point.
    Returns the panel titles drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for field, label in (("beams", "beam width"), ("prompt", "prompt length (tokens)")):
        values = {p["shape"][field] for p in doc["results"]}
        if len(values) >= 2 and _series(doc, field):
            panels.append((field, label))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        titles = []
        for ax, (field, label) in zip(axes[0], panels, strict=True):
            for name, pts in _series(doc, field).items():
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=name)
            ax.axhline(1.0, color="grey", lw=1, ls="--")
            ax.set_xlabel(label)
            ax.set_ylabel("speedup over per-beam decode (x)")
            xs_all = [p["shape"][field] for p in doc["results"]]
            if field == "beams" or max(xs_all) >= 20 * max(1, min(xs_all)):
                ax.set_xscale("log", base=2)
            title = f"speedup vs {label}"
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            titles.append(title)
    else:
        fig, axes = plt.subplots(len(doc["results"]), 1, figsize=(9, 3.2 * len(doc["results"])), squeeze=False)
        titles = []
        for ax, p in zip(axes[:, 0], doc["results"], strict=True):
            arms = [a for a in p["arms"] if a["status"] == "ok"]
            ax.barh([a["name"] for a in arms], [a["time_us"] for a in arms], color="tab:blue")
            fl = p["floors"].get("floor_us")
            if fl:
                ax.axvline(fl, color="red", ls="--", lw=1, label=f"floor {fl:.0f} us")
                ax.legend(fontsize=8)
            ax.set_xscale("log")
            ax.set_xlabel("time per step and layer (us, median)")
            ax.set_title(p["label"], fontsize=9)
            titles.append(p["label"])
    env = doc.get("environment", {})
    fig.suptitle(f"beam-shared-prefix on {env.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return titles


def decline_table(doc: Dict, margin: float = 1.0) -> List[Dict]:
    """Per point: the best library arm's speedup over per-beam decode and whether it is below ``margin``,
    and ``library/auto``'s time over the best library arm's (``auto_over_best``; ``None`` without both).

    The decline rule is fitted to the points where ``decline`` is true (see docs/benchmarks.md).
    """
    rows = []
    for p in doc["results"]:
        # (auto with the error flag is auto, timed for the flag's cost: not another library arm)
        libs = [a for a in p["arms"] if a["kind"] == "library" and a["status"] == "ok" and a.get("speedup_vs_decode")
                and "+flag" not in a["name"]]
        best = max(libs, key=lambda a: a["speedup_vs_decode"]) if libs else None
        auto = next((a for a in libs if a["name"] == "library/auto"), None)
        others = [a for a in libs if a["name"] != "library/auto"]
        fastest = min(others, key=lambda a: a["time_us"]) if others else None
        sh = p["shape"]
        rows.append({
            "requests": sh["requests"], "beams": sh["beams"], "prompt": sh["prompt"], "tail": sh["tail"],
            "shortest_tail": (p.get("tail_lens") or {}).get("min", sh["tail"]),
            "heads": sh["heads"], "kv_heads": sh["kv_heads"], "head_dim": sh["head_dim"],
            "best_arm": None if best is None else best["name"],
            "speedup": None if best is None else best["speedup_vs_decode"],
            "decline": None if best is None else best["speedup_vs_decode"] < margin,
            "rule_says": p.get("decline_reason"),
            "rule_now": rule_now(sh),
            "auto_backend": None if auto is None else (auto.get("info") or {}).get("backend"),
            "auto_over_best": (None if auto is None or fastest is None
                               else auto["time_us"] / min(auto["time_us"], fastest["time_us"])),
        })
    return rows


def audit_summary(rows: Sequence[Dict], slack: float = 1.05) -> str:
    """One line judging the rule over :func:`decline_table`'s rows (held-out points, e.g. ``--sample``): how many
    it serves and how many of those the best library arm lost to per-beam decode (the worst ratio), how many it
    declines and how many of those the library would have won (the largest missed speedup), and at how many
    served points ``library/auto`` was within ``slack`` of the fastest library arm (the worst ratio)."""
    measured = [r for r in rows if r["speedup"] is not None]
    served = [r for r in measured if not r["rule_now"]]
    declined = [r for r in measured if r["rule_now"]]
    lost = [r["speedup"] for r in served if r["decline"]]
    missed = [r["speedup"] for r in declined if not r["decline"]]
    ratios = [r["auto_over_best"] for r in served if r["auto_over_best"] is not None]
    parts = [f"audit over {len(measured)} measured points: served {len(served)}, "
             + (f"{len(lost)} slower than per-beam decode (worst {min(lost):.2f}x)" if lost
                else "none slower than per-beam decode"),
             f"declined {len(declined)}, "
             + (f"{len(missed)} where the library was faster (up to {max(missed):.2f}x)" if missed
                else "none where the library was faster")]
    if ratios:
        parts.append(f"auto within {slack:.2f}x of the fastest library arm at {sum(x <= slack for x in ratios)} of "
                     f"{len(ratios)} served (worst {max(ratios):.2f}x)")
    return "; ".join(parts)


def rule_now(shape: Dict) -> Optional[str]:
    """The decline reason the library's rule gives ``shape`` (a results document's shape dict) today;
    the document's own ``decline_reason`` is the rule of the day it was measured."""
    from dataclasses import fields

    from .runner import decline_reason
    from .shapes import BenchShape

    known = {f.name for f in fields(BenchShape)}
    return decline_reason(BenchShape(**{k: v for k, v in shape.items() if k in known}))
