"""``beam-shared-prefix-bench``: one decode step of one attention layer, every arm, against the floor.

Examples::

    beam-shared-prefix-bench --preset A --json a.json
    beam-shared-prefix-bench --preset B-medium --sweep beams=14,30,96,256 --json sweep.json --plot sweep.png
    beam-shared-prefix-bench --requests 32 --beams 64 --prompt 1000 --tail 8 --heads 32 --kv-heads 8
    beam-shared-prefix-bench --from-json sweep.json --plot sweep.png --decline-report
    beam-shared-prefix-bench --preset B-medium --sweep tail=4,64,256 --rule   # the rule's verdicts, no GPU
    beam-shared-prefix-bench --sample 24 --seed 1 --head-dim 128 --decline-report   # random shapes: a rule audit

Without a CUDA device the CLI says so and runs the CPU reference path (the library with the torch
reference prefix and the torch tail, timed with ``time.perf_counter``) on a reduced shape, and
still writes ``--json``. Exit status: 0; 1 when an arm's output did not match the oracle or a library arm failed
(whatever became of ``--json``/``--plot``); 2 for a usage error (found before anything is measured), a ``--rule``
error, or an output that could not be written.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from typing import Dict, List, Optional, Sequence

from .shapes import PRESETS, BenchShape, ShapeError, expand_sweeps, parse_sweep, reduced_cpu_shape, sample_shapes

__all__ = ["build_parser", "resolve_shapes", "main"]

_FREE = (
    ("requests", int, "R: generation requests"),
    ("beams", int, "W: beam width"),
    ("prompt", int, "P: prompt tokens per request"),
    ("tail", int, "T: generated tokens per beam, this step's included (kv_len = P + T)"),
    ("heads", int, "Hq: query heads"),
    ("kv_heads", int, "Hkv: KV heads"),
    ("head_dim", int, "D: head size"),
    ("page_size", int, "Pg: tokens per KV page"),
    ("dtype", str, "bf16 or fp16"),
    ("prompt_jitter", float, "draw prompts uniformly in [P(1-j), P(1+j)] (default 0)"),
    ("tail_jitter", float, "draw each request's tail uniformly in [T(1-j), T], as in-flight batching mixes decode "
     "steps (default 0; T stays the longest)"),
    ("ancestry", str, "beam-search (default: histories coalesce, as a sorted beam search makes them), uniform "
     "(parents uniform over the beams: histories coalesce about 2W steps back) or independent (every beam its "
     "own parent: no shared generated rows)"),
)

# Free arguments that --sample keeps for every drawn shape (it draws the rest; --head-dim picks the models).
_SAMPLE_KEEPS = ("page_size", "dtype", "prompt_jitter", "tail_jitter", "ancestry")


def build_parser() -> argparse.ArgumentParser:
    """The ``beam-shared-prefix-bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="beam-shared-prefix-bench",
        description="Benchmark one beam-search decode step of one attention layer: this library (per prefix "
        "backend), its stages, FlashInfer per-beam decode and two-level cascade, and the memory/compute floors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets: " + "; ".join(s.label() for s in PRESETS.values()),
    )
    g = p.add_argument_group("shape")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None, help="reference workload (default A)")
    for name, typ, help_ in _FREE:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_ + " (overrides the preset)")
    g.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="vary one field over values, e.g. beams=14,30,96,256 or prompt=100,500,2000; repeat for a grid")
    g.add_argument("--sample", type=int, default=None, metavar="N",
                   help="instead of a preset and sweeps, N shapes drawn at random (seeded by --seed) over 1-128 "
                        "requests, 14-256 beams, 64-8,192-token prompts, 2-32-token tails and the heads of nine "
                        "models (microbenchmarks.shapes.sample_shapes): held-out points for --decline-report; "
                        "--head-dim keeps the models of that head size, and --page-size, --dtype, --ancestry and "
                        "the jitters apply to every drawn shape")
    g.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    a = p.add_argument_group("arms")
    a.add_argument("--arms", default=None,
                   help="comma list: auto, auto-flag, auto-flag-layer, library, fa4, triton, fa4-shared, "
                        "flashinfer-shared, prefix, tail, tail-torch, decode, decode-tc, decode-cc, cascade, reference "
                        "(default: all on a GPU, reference on CPU)")
    a.add_argument("--prefix-kernels", default="auto",
                   help="FlashInfer prefix kernel families for the library and prefix arms, comma list of "
                        "auto, fa2, fa3 (default auto: the wrapper's choice, shown in the table)")
    m = p.add_argument_group("measurement")
    m.add_argument("--sets", type=int, default=3, help="input sets (seeds: layouts and data) per point (default 3)")
    m.add_argument("--iters", type=int, default=20, help="timed calls per set (default 20)")
    m.add_argument("--warmup", type=int, default=3, help="untimed calls per set first (default 3)")
    m.add_argument("--l2-flush", choices=("read", "write", "none"), default="read",
                   help="how L2 is emptied between timed calls: read (default) leaves it full of clean lines, "
                        "as the weight-reading GEMMs before attention do; write (a memset) leaves it full of dirty "
                        "lines each timed call must write back; none keeps the previous call's data")
    m.add_argument("--no-flush-l2", action="store_true", help="same as --l2-flush none")
    m.add_argument("--no-graphs", action="store_true", help="time every arm eagerly (no CUDA graphs)")
    m.add_argument("--graph-baselines", action="store_true",
                   help="also run the FlashInfer baselines in their CUDA-graph mode (default: eager, their best "
                        "device time; host time is excluded either way)")
    m.add_argument("--fi-workspace-mb", type=int, default=512, help="float workspace of the FlashInfer baselines")
    m.add_argument("--report-errors", action="store_true",
                   help="time the library with its device error flag on (TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS=1; "
                        "off by default, as in serving); the check then also fails an arm that flags valid input")
    m.add_argument("--declare-tail", action="store_true",
                   help="construct the library's wrappers with max_tail_len set to each shape's longest tail, as "
                        "TLLM_BEAM_SHARED_PREFIX_MAX_TAIL does in TensorRT-LLM: CUDA-graph captures then leave out "
                        "paths no such tail takes (default: a capture's tail unknown, as TensorRT-LLM captures; "
                        "that variable, if set, still applies)")
    m.add_argument("--kernel-times", action="store_true",
                   help="also time every arm's kernels in a CUPTI trace (torch.profiler): the span from its first "
                        "kernel's start to its last kernel's end, without the launch and event latency that the "
                        "events include (FlashInfer's benchmarks report this); the events' time stays the "
                        "headline")
    m.add_argument("--no-check", action="store_true", help="skip the oracle check (not recommended)")
    m.add_argument("--check-requests", type=int, default=4, help="requests (all their beams) checked per set on a GPU")
    m.add_argument("--kv-layout", choices=("HND", "NHD"), default="HND")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--plan-repeats", type=int, default=200, help="re-plan calls timed per library arm (0: skip)")
    m.add_argument("--cpu", action="store_true", help="run the CPU reference path even if a GPU is present")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the results as JSON")
    o.add_argument("--plot", metavar="PATH", help="write speedup plots (PNG) against beam width / prompt length")
    o.add_argument("--from-json", metavar="PATH", action="append", default=[],
                   help="do not measure: load results written by --json (repeatable) and print/plot/merge them")
    o.add_argument("--rule", action="store_true",
                   help="do not measure (no GPU needed): print what the library's default does with each shape: the "
                        "path backend auto takes, served or the decline reason, and the longest tail served there "
                        "(with --declare-tail, CUDA-graph wrappers bounded by each shape's tail)")
    o.add_argument("--decline-report", action="store_true",
                   help="print, per point, the best library speedup over per-beam decode and whether to decline")
    e = p.add_argument_group("end to end (needs tensorrt_llm)")
    e.add_argument("--e2e-model", metavar="DIR",
                   help="instead of the layer benchmark, run beam search through TensorRT-LLM's LLM API on this model, "
                        "library on and off, with the shape's requests, beams, prompt and tail (= new tokens); "
                        "see microbenchmarks/e2e_trtllm.py")
    return p


def resolve_shapes(args) -> List[BenchShape]:
    """The base shape (preset with free overrides) expanded by the sweeps, or ``--sample``'s shapes.

    Raises:
        ShapeError: ``--sample`` with a preset, a sweep or a shape field it draws (requests, beams, prompt, tail,
            heads, KV heads).
    """
    if getattr(args, "sample", None) is not None:
        kept = {name: getattr(args, name) for name in _SAMPLE_KEEPS if getattr(args, name) is not None}
        pinned = [f"--{name.replace('_', '-')}" for name, _, _ in _FREE
                  if name not in _SAMPLE_KEEPS and name != "head_dim" and getattr(args, name) is not None]
        pinned += ["--preset"] if args.preset else []
        pinned += ["--sweep"] if args.sweep else []
        if pinned:
            raise ShapeError(f"--sample draws the shape; drop {', '.join(pinned)} (--head-dim picks the models, "
                             f"and {', '.join('--' + k.replace('_', '-') for k in _SAMPLE_KEEPS)} apply to every "
                             f"drawn shape).")
        return sample_shapes(args.sample, args.seed, head_dim=args.head_dim, **kept)
    base = PRESETS[args.preset or "A"]
    overrides = {name: getattr(args, name) for name, _, _ in _FREE if getattr(args, name) is not None}
    if overrides:
        changed = {k: v for k, v in overrides.items() if getattr(base, k) != v}
        base = replace(base, name="custom" if changed else base.name, **overrides)
    sweeps = [parse_sweep(s) for s in args.sweep]
    both = [key for key, _ in sweeps if key in overrides]
    if both:
        raise ShapeError(f"{', '.join('--' + k.replace('_', '-') for k in both)} given both as a flag and in --sweep; "
                         f"the sweep would replace the flag: give it once.")
    return expand_sweeps(base, sweeps)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device_name: str, gpu: bool, cpu_fallback: bool) -> Dict:
    """Versions (python, torch, CUDA, triton, flashinfer...) and git commit recorded in the results JSON."""
    import torch

    # A copy of the tree without its git metadata (a remote GPU machine) names its commit here.
    commit = os.environ.get("BEAM_SHARED_PREFIX_GIT_COMMIT") or None
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=5, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
        except Exception:
            commit = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name,
        "gpu": gpu,
        "cpu_fallback": cpu_fallback,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "flashinfer": _version("flashinfer-python"),
        "flash_attn_4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "beam_shared_prefix": _version("beam-shared-prefix") or "source tree",
        "git_commit": commit,
    }


def _dedupe(shapes: Sequence[BenchShape]) -> List[BenchShape]:
    seen, out = set(), []
    for s in shapes:
        key = tuple(v for k, v in asdict(s).items() if k != "name")
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _progress(total: int, enabled: bool):
    """A rich progress bar (or a no-op when rich is missing or there is one step)."""
    if not enabled:
        return None
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    # No markup: a swept shape's name ("custom[requests=8,...]") would read as a style tag and vanish.
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


#: The largest count of timed calls, sets, warm-up calls, re-plans or checked requests a flag takes (a typo past it
#: would allocate events for hours of calls); also the FlashInfer workspace's MiB.
MAX_REPEATS = 100_000


def _probe_output_folder(flag: str, path: str, parser) -> None:
    """The file ``path`` names (a symlink's target) can be written after the run: a device or a pipe is written in
    place, as the writer does; otherwise a probe file is written and removed in its folder, or in the nearest folder
    that exists (the writer makes the rest), so that a folder that takes no file is found before the run."""
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isfile(real):
        return
    folder = os.path.dirname(real)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        if not os.path.isdir(folder):
            raise NotADirectoryError(20, "not a directory")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".bsp-probe-"):
            pass
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot write into {folder} ({exc.strerror or exc}); give a writable path")


def _check_outputs(args, parser) -> None:
    """``--json`` and ``--plot`` checked before anything is measured, so that a bad path costs no run."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        if not path.strip():
            parser.error(f"{flag} '': give a file path")
        if os.path.isdir(os.path.realpath(path)):
            parser.error(f"{flag} {path} is a directory; give a file path")
        if flag == "--json" and path == "-":  # stdout
            continue
        _probe_output_folder(flag, path, parser)
    if args.plot is not None:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError as exc:
            parser.error(f"--plot needs matplotlib ({exc}); pip install 'beam-shared-prefix[bench]'")
        kind = os.path.splitext(args.plot)[1].lstrip(".").lower()
        kinds = FigureCanvasBase.get_supported_filetypes()
        if kind not in kinds:
            parser.error(f"--plot {args.plot}: {kind or 'no extension'} is not an image type matplotlib writes; end "
                         f"the name with one of {sorted(kinds)}")


def _arms(parser, args, kernels, cpu: bool):
    from .arms import parse_arm_list

    try:
        arms = parse_arm_list(args.arms, kernels, cpu=cpu)
    except ValueError as exc:
        parser.error(str(exc))
    if args.report_errors and any(getattr(a, "report_errors", False) for a in arms):
        parser.error("--report-errors puts the device error flag on every library arm, so auto-flag would time the "
                     "same wrapper as auto: drop --report-errors to time the flag's cost, or auto-flag")
    return arms


def _emit(doc: Dict, args, log) -> int:
    from .report import audit_summary, decline_table, plot_speedups, print_point, print_summary, write_json

    for point in doc["results"]:
        print_point(point)
    if len(doc["results"]) > 1:
        print_summary(doc)
    if args.decline_report:
        rows = decline_table(doc)
        log("decline report (best library arm vs best per-beam decode; decline where speedup < 1):")
        for r in rows:
            sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            tail = f"{r['shortest_tail']}-{r['tail']}" if r["shortest_tail"] < r["tail"] else r["tail"]
            auto = ("" if r["auto_over_best"] is None
                    else f"; auto ({r['auto_backend']}) {r['auto_over_best']:.2f}x the best arm's time")
            log(f"  R={r['requests']} W={r['beams']} P={r['prompt']} T={tail} {r['heads']}/{r['kv_heads']} "
                f"D={r['head_dim']}: {sp} ({r['best_arm']}) -> "
                f"{'unmeasured' if r['decline'] is None else 'DECLINE' if r['decline'] else 'serve'}"
                f"; rule now: {r['rule_now'] or 'serve'}"
                + ("" if r["rule_now"] == r["rule_says"] else f" (when measured: {r['rule_says'] or 'serve'})")
                + auto)
        log(audit_summary(rows))
    status = 0
    if args.json:
        try:
            write_json(doc, args.json, stdout=args.json_stdout)
            log(f"wrote {'the JSON document to stdout' if args.json == '-' else args.json}")
        except OSError as exc:
            log(f"--json {args.json}: could not write it ({exc})")
            status = 2
    if args.plot:
        try:
            titles = plot_speedups(doc, args.plot)
            log(f"wrote {args.plot} ({'; '.join(titles)})")
        except ImportError as exc:
            log(f"--plot needs matplotlib ({exc}); pip install 'beam-shared-prefix[bench]'")
            status = 2
        except (OSError, ValueError, TypeError) as exc:
            log(f"--plot {args.plot}: could not plot ({type(exc).__name__}: {exc})")
            status = 2
    # After the outputs, whatever became of them: a wrong result outranks a usage error.
    failed = [(p["label"], a["name"]) for p in doc["results"] for a in p["arms"] if a.get("status") == "check_failed"]
    crashed = [(p["label"], a["name"]) for p in doc["results"] for a in p["arms"]
               if a.get("status") == "failed" and a.get("kind") == "library"]
    if failed:
        log("ORACLE CHECK FAILED: " + "; ".join(f"{name} at {label}" for label, name in failed))
    if crashed:
        log("LIBRARY ARM FAILED: " + "; ".join(f"{name} at {label}" for label, name in crashed))
    return 1 if failed or crashed else status


def _print_rule(shapes: Sequence[BenchShape], log, declare_tail: bool = False) -> int:
    """``--rule``: the library's verdict on each shape, from the decline rule alone (``declare_tail``: CUDA-graph
    wrappers bounded by each shape's tail)."""
    from beam_shared_prefix.config import ConfigError

    from .runner import rule_verdict

    for s in shapes:
        try:
            v = rule_verdict(s, declare_tail)
        except ConfigError as exc:
            log(f"error: {exc}")
            return 2
        verdict = "serve" if v["decline_reason"] is None else f"decline: {v['decline_reason']}"
        path = v["path"]
        if v["graph_path"] != path:
            path += f" (eager; {v['graph_path']} under a CUDA graph)"
        log(f"{s.label()}: {path}, tails served up to {v['max_tail']} generated tokens -> {verdict}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``beam-shared-prefix-bench`` and ``python -m microbenchmarks``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.json_stdout = sys.stdout  # where `--json -` goes, captured before the redirect below
    with contextlib.ExitStack() as stack:
        if args.json == "-":  # the document alone on stdout: the table, the log and the progress go to stderr
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        return _main(parser, args, argv)


# What --from-json takes: the replayed files and the outputs.
_FROM_JSON_FLAGS = ("help", "from_json", "json", "plot", "decline_report")


def _main(parser: argparse.ArgumentParser, args, argv: List[str]) -> int:
    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.list_presets:
        for s in PRESETS.values():
            log(s.label())
        return 0
    _check_outputs(args, parser)
    if args.no_flush_l2 and args.l2_flush != "read":
        parser.error(f"--no-flush-l2 with --l2-flush {args.l2_flush}: give one of them")
    if args.from_json:
        # Every flag but the outputs: shape, arm and rule flags, and those of measuring (--sets, --prefix-kernels,
        # --e2e-model, ...), which a replay would otherwise ignore without a word.
        given = [a.option_strings[0] for a in parser._actions
                 if a.dest not in _FROM_JSON_FLAGS and a.option_strings and getattr(args, a.dest) != a.default]
        if given:
            parser.error(f"--from-json replays measured files; {', '.join(given)} would change nothing there: drop "
                         f"{'it' if len(given) == 1 else 'them'}")
        from .report import load_json, make_document

        paths = list(dict.fromkeys(os.path.realpath(p) for p in args.from_json))  # a file named twice counts once
        try:
            docs = [load_json(p) for p in paths]
        except (OSError, ValueError) as exc:
            parser.error(f"--from-json: {exc}")
        machines = {(d["environment"].get("device"), d["environment"].get("gpu")) for d in docs}
        if len(machines) > 1:
            parser.error(f"--from-json: the files come from different machines {sorted(map(str, machines))}; their "
                         f"floors and timings do not compare, so merge only one machine's files")
        # A point from a file measured at other rates or with other options carries its own: the document's are the
        # first file's.
        first = (docs[0]["rates"], docs[0].get("options", {}))
        results = [r if (d["rates"], d.get("options", {})) == first
                   else dict(r, rates=d["rates"], options=d.get("options", {}), argv=d.get("argv", []))
                   for d in docs for r in d["results"]]
        merged = make_document(results, docs[0]["environment"], docs[0]["rates"],
                               docs[0].get("options", {}), docs[0].get("argv", []), docs[0].get("note"))
        return _emit(merged, args, log)

    # The library's settings from the environment, read before anything is measured (as --rule reads them): a bad
    # value is a usage error, not a library arm skipped. Check mode syncs and runs the oracle every call: the CLI's
    # library arms never time it (they pass check=False); the end-to-end arm's engine reads the environment itself.
    from beam_shared_prefix.config import ConfigError, load_settings

    try:
        settings = load_settings()
    except ConfigError as exc:
        parser.error(str(exc))
    if settings.check and not args.rule:
        log("TLLM_BEAM_SHARED_PREFIX_CHECK is on in this environment; "
            + ("the end-to-end arm's engine reads it, so its timings include check mode's syncs and oracle: unset it "
               "to time serving." if args.e2e_model else
               "the timed library arms run with check mode off (its syncs and oracle would be timed). The CLI's own "
               "oracle check runs unless --no-check."))

    if args.e2e_model:
        from . import e2e_trtllm

        try:
            shapes = resolve_shapes(args)
        except ShapeError as exc:
            parser.error(str(exc))
        if len(shapes) != 1:
            parser.error(f"--e2e-model takes one shape, not {len(shapes)}: drop --sweep / --sample")
        # The model fixes its heads, head size, page size and dtype; the layer benchmark's own flags do nothing there.
        ignored = [f"--{name.replace('_', '-')}" for name, _, _ in _FREE
                   if name not in ("requests", "beams", "prompt", "tail") and getattr(args, name) is not None]
        ignored += [flag for flag, on in (("--plot", args.plot), ("--arms", args.arms is not None),
                                          ("--rule", args.rule), ("--decline-report", args.decline_report)) if on]
        if ignored:
            parser.error(f"--e2e-model runs the model's own attention shape; {', '.join(ignored)} would change "
                         f"nothing there: drop {'it' if len(ignored) == 1 else 'them'} (see python -m "
                         f"microbenchmarks.e2e_trtllm --help for the end-to-end arm's own options)")
        (base,) = shapes
        log(f"end to end on {args.e2e_model}: {base.requests} requests x {base.beams} beams, prompt {base.prompt}, "
            f"{base.tail} new tokens per beam (heads, head size and page size are the model's)")
        e2e_argv = ["--model", args.e2e_model, "--requests", str(base.requests), "--beams", str(base.beams),
                    "--prompt", str(base.prompt), "--max-tokens", str(base.tail), "--seed", str(args.seed)]
        return e2e_trtllm.main(e2e_argv + (["--json", args.json] if args.json else []), json_stdout=args.json_stdout)

    try:
        shapes = resolve_shapes(args)
        from beam_shared_prefix.prefix.flashinfer import PREFIX_KERNELS

        prefix_kernels = [k.strip().lower() for k in args.prefix_kernels.split(",") if k.strip()]
        for k in prefix_kernels:
            if k not in PREFIX_KERNELS:
                raise ShapeError(f"--prefix-kernels: {k!r} is not one of {', '.join(PREFIX_KERNELS)}.")
        for name, value, low in (("--sets", args.sets, 1), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                 ("--plan-repeats", args.plan_repeats, 0), ("--check-requests", args.check_requests, 1),
                                 ("--fi-workspace-mb", args.fi_workspace_mb, 1)):
            if not low <= value <= MAX_REPEATS:
                raise ShapeError(f"{name}={value} must be in [{low}, {MAX_REPEATS}].")
        if not 0 <= args.seed < 2**63:
            raise ShapeError(f"--seed={args.seed} must be in [0, 2**63).")
    except ShapeError as exc:
        parser.error(str(exc))
        return 2  # unreachable: parser.error exits
    if args.rule:
        if args.json is not None or args.plot is not None:
            parser.error("--rule prints each shape's verdict and measures nothing: drop --json/--plot, or drop --rule")
        return _print_rule(shapes, log, args.declare_tail)
    import torch

    from .arms import default_cpu_arms, default_gpu_arms
    from .report import make_document
    from .runner import Rates, RunOptions, run_point

    gpu = torch.cuda.is_available() and not args.cpu
    note = None
    if gpu:
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        kernels = [None if k == "auto" else k for k in prefix_kernels]
        arms = _arms(parser, args, kernels, cpu=False) if args.arms is not None else default_gpu_arms(kernels)
    else:
        device = torch.device("cpu")
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        reason = "--cpu was given" if args.cpu else "no CUDA GPU was found (torch.cuda.is_available() is False)"
        full = shapes
        shapes = _dedupe([reduced_cpu_shape(s) for s in shapes])
        note = (f"{reason}: ran the CPU reference path (torch reference prefix + torch tail, float32 math, "
                f"time.perf_counter) on reduced shapes {[s.label() for s in shapes]} instead of "
                f"{[s.label() for s in full]}; these timings say nothing about GPU speed.")
        log(f"No GPU: {note}")
        arms = _arms(parser, args, ("auto",), cpu=True) if args.arms is not None else default_cpu_arms()
    opts = RunOptions(
        sets=args.sets, iters=args.iters, warmup=args.warmup, l2_flush="none" if args.no_flush_l2 else args.l2_flush,
        use_graphs=not args.no_graphs, check=not args.no_check, check_requests=args.check_requests,
        kv_layout=args.kv_layout, seed=args.seed, plan_repeats=args.plan_repeats,
        baselines_need_pages=any(a.kind == "baseline" for a in arms), graph_baselines=args.graph_baselines,
        fi_workspace_mb=args.fi_workspace_mb, report_errors=args.report_errors, kernel_times=args.kernel_times,
        declare_tail=args.declare_tail,
    )
    if not args.declare_tail and os.environ.get("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", "").strip():
        log(f"TLLM_BEAM_SHARED_PREFIX_MAX_TAIL={os.environ['TLLM_BEAM_SHARED_PREFIX_MAX_TAIL'].strip()} bounds the "
            f"library arms' tails (as in serving); --declare-tail sets each shape's own.")
    if not gpu:
        capped = {name: (value, cap) for name, value, cap in (("--sets", opts.sets, 2), ("--iters", opts.iters, 3),
                                                               ("--plan-repeats", opts.plan_repeats, 20))
                  if value > cap}
        opts.sets = min(opts.sets, 2)
        opts.iters = min(opts.iters, 3)
        opts.plan_repeats = min(opts.plan_repeats, 20)
        if capped:
            log("CPU path: " + ", ".join(f"{n} {v} capped at {c}" for n, (v, c) in capped.items()))
        if opts.kernel_times:
            log("CPU path: --kernel-times needs a GPU (CUPTI); ignored")
            opts.kernel_times = False

    rates = Rates()
    if gpu:
        from .floors import measure_copy_bandwidth, measure_matmul_rate
        from .timing import measure_event_overhead
        from .workload import torch_dtype

        log("measuring copy bandwidth and matmul rate ...")
        rates.copy_bandwidth = measure_copy_bandwidth(device)
        dtypes = {s.dtype for s in shapes}
        rate_by_dtype = {d: measure_matmul_rate(torch_dtype(d), device) for d in dtypes}
        rates.matmul_rate = min(rate_by_dtype.values())
        rates.event_overhead_us = measure_event_overhead(l2_flush=opts.l2_flush)
        log(f"copy bandwidth {rates.copy_bandwidth / 1e12:.2f} TB/s, matmul "
            + ", ".join(f"{d} {r / 1e12:.0f} TFLOP/s" for d, r in rate_by_dtype.items())
            + f"; an empty kernel measures {rates.event_overhead_us:.1f} us with these events")

    results = []
    skipped: List[str] = []
    progress = _progress(len(shapes) * len(arms), enabled=sys.stdout.isatty() or len(shapes) > 1)
    if progress is not None:
        progress.start()
        task = progress.add_task("benchmark", total=len(shapes) * len(arms))
    try:
        for shape in shapes:
            started = [0]

            def on_arm(name, _shape=shape, _started=started):
                if _started[0]:
                    progress.advance(task, 1)
                _started[0] += 1
                progress.update(task, description=f"{_shape.name}: {name}")

            try:
                point = run_point(shape, arms, opts, rates, device, on_arm=None if progress is None else on_arm,
                                  log=log)
            except MemoryError as exc:  # one point too large: the others are still measured and written
                log(f"{shape.label()}: skipped: {exc}")
                skipped.append(shape.label())
                if progress is not None:
                    progress.advance(task, len(arms) - max(started[0] - 1, 0))
                continue
            if progress is not None:
                progress.advance(task, len(arms) - max(started[0] - 1, 0))
            results.append(point)
    finally:
        if progress is not None:
            progress.stop()
    if skipped:
        note = (f"{note} " if note else "") + f"Skipped (one input set does not fit in memory): {skipped}."
    doc = make_document(results, environment(device_name, gpu, not gpu), rates.to_dict(), asdict(opts),
                        ["beam-shared-prefix-bench"] + argv, note)
    return _emit(doc, args, log)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
