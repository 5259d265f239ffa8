"""End-to-end arm: beam search through TensorRT-LLM's LLM API, library on and off.

Each variant runs in its own child process, because ``TLLM_FMHA_LIBS`` must be set before
TensorRT-LLM builds the model (the registry reads it once per process):

- ``off``: ``TLLM_FMHA_LIBS`` without ``beam_shared_prefix`` (TensorRT-LLM's default kernels);
- ``on``: ``TLLM_FMHA_LIBS=+beam_shared_prefix``.

Both use ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` so that the model runs in the child itself and the
library's host counters (:func:`beam_shared_prefix.trtllm.stats`) and its planning time are visible.
Per variant: ``R`` random prompts of ``P`` token ids, beam width ``W``, ``--max-tokens`` new tokens
(``ignore_eos``), ``--warmup`` untimed and ``--repeats`` timed ``generate`` calls. Reported:
prompts/s (median), the library's planned steps, its attention-layer forwards served and handed
to the default kernel (one per layer and step), and host planning time per ``prepare()`` call and
per planned step (the ``prepare()`` hook, timed here by wrapping
:func:`beam_shared_prefix.trtllm.planning.plan_metadata`).

Forwards replayed inside a CUDA graph run no Python, so with CUDA graphs on, ``generation_forwards``
counts only eager layer forwards (warm-up and capture); ``steps_planned`` counts every step.

TensorRT-LLM trees that still have ``enable_trtllm_sampler`` (before ``sampler_type``) run beam
search only with that sampler, which is switched on here; their documentation also asks for the
overlap scheduler and CUDA graphs off with beam search (``--disable-overlap-scheduler
--no-cuda-graph``). Current trees have only the Torch sampler, which wants a real ``end_id``: it is
read from the checkpoint (``generation_config.json``, else ``config.json``; ``--end-id`` overrides),
and ``ignore_eos`` still runs every beam for ``--max-tokens`` steps.

Run: ``python -m microbenchmarks.e2e_trtllm --model /path/to/Qwen3-0.6B --requests 8 --beams 16
--prompt 500 --max-tokens 4 --json e2e.json``. Needs ``tensorrt_llm`` (it fails with a clear
message otherwise) and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["TrtllmMissing", "require_tensorrt_llm", "variant_env", "beam_search_llm_kwargs", "checkpoint_end_id",
           "main"]

LIB = "beam_shared_prefix"


class TrtllmMissing(RuntimeError):
    """``tensorrt_llm`` is not importable here."""


def _missing(why: str) -> TrtllmMissing:
    return TrtllmMissing(
        f"the end-to-end arm needs TensorRT-LLM, which {why}. Run it on a machine with tensorrt_llm installed "
        f"(pip install tensorrt_llm), or use the layer-level benchmark: beam-shared-prefix-bench --preset A."
    )


def require_tensorrt_llm(import_it: bool = True):
    """Import ``tensorrt_llm`` (or, with ``import_it=False``, only find it: the parent process does
    not start TensorRT-LLM's runtime) or raise :class:`TrtllmMissing` saying what to do."""
    import importlib.util

    if not import_it:
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise _missing("is not installed here")
        return None
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        raise _missing(f"does not import here ({type(exc).__name__}: {exc})") from None
    return tensorrt_llm


def checkpoint_end_id(model_dir: str) -> int:
    """The end-of-sequence token id of a Hugging Face checkpoint directory: ``eos_token_id`` of its
    ``generation_config.json``, else of its ``config.json`` (the first id where it is a list).

    Raises ``ValueError`` naming the files read when neither has one (pass ``--end-id``)."""
    read = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        read.append(name)
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0:
            return eos
    raise ValueError(
        f"no eos_token_id in {', '.join(read) or 'generation_config.json or config.json (neither exists)'} under "
        f"{model_dir!r}; TensorRT-LLM's Torch sampler needs a real end_id: pass --end-id ID."
    )


def beam_search_llm_kwargs(llm_arg_fields, disable_overlap_scheduler: bool = False) -> Dict[str, bool]:
    """Extra ``LLM(...)`` arguments beam search needs on this TensorRT-LLM, from the names of its LLM
    arguments (``TorchLlmArgs.model_fields``): ``enable_trtllm_sampler=True`` on trees that have that
    switch (their Torch sampler had no beam search; current trees have only the Torch sampler, with
    beam search), and ``disable_overlap_scheduler`` when asked."""
    extra = {}
    if "enable_trtllm_sampler" in llm_arg_fields:
        extra["enable_trtllm_sampler"] = True
    if disable_overlap_scheduler:
        extra["disable_overlap_scheduler"] = True
    return extra


def variant_env(variant: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The child environment of a variant (``on``/``off``); see the module docstring."""
    env = dict(os.environ if base is None else base)
    libs = [x for x in env.get("TLLM_FMHA_LIBS", "").split(",") if x.strip() and x.strip().lstrip("+-") != LIB]
    if variant == "on":
        if libs and not any(x.strip().startswith(("+", "-")) for x in libs):
            # An exact list: the library goes before ``fallback``, which takes whatever is left.
            names = [x.strip() for x in libs]
            libs.insert(names.index("fallback") if "fallback" in names else len(libs), LIB)
        else:
            libs.append("+" + LIB)
    elif variant != "off":
        raise ValueError(f"variant={variant!r}; use 'on' or 'off'.")
    if libs:
        env["TLLM_FMHA_LIBS"] = ",".join(libs)
    else:
        env.pop("TLLM_FMHA_LIBS", None)
    env["TLLM_WORKER_USE_SINGLE_PROCESS"] = "1"
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m microbenchmarks.e2e_trtllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (Hugging Face checkpoint) for TensorRT-LLM's LLM API")
    p.add_argument("--requests", type=int, default=8, help="prompts per generate() call (default 8)")
    p.add_argument("--beams", type=int, default=16, help="beam width (default 16)")
    p.add_argument("--prompt", type=int, default=500, help="prompt tokens (default 500)")
    p.add_argument("--max-tokens", type=int, default=4, help="new tokens per beam (default 4)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="off,on", help="comma list of off, on (default off,on)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run without CUDA graphs")
    p.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="run without the overlap scheduler (older TensorRT-LLM needs it off for beam search)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.5, help="free GPU memory fraction for the KV cache")
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn from [10, vocab)")
    p.add_argument("--end-id", type=int, default=None,
                   help="end-of-sequence token id (default: the checkpoint's eos_token_id); ignore_eos stays on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--child", metavar="VARIANT", help=argparse.SUPPRESS)
    p.add_argument("--child-out", metavar="PATH", help=argparse.SUPPRESS)
    return p


def _timed_planning():
    """Wrap the library's per-step planning to accumulate host time; returns the accumulator."""
    acc = {"calls": 0, "total_us": 0.0}
    from beam_shared_prefix.trtllm import planning

    original = planning.plan_metadata

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc["calls"] += 1
            acc["total_us"] += (time.perf_counter() - t0) * 1e6

    planning.plan_metadata = timed  # the prepare() hook looks the name up at call time
    return acc


def run_child(args) -> Dict:
    """One variant, in this process (the parent set its environment)."""
    require_tensorrt_llm()
    import random

    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    if args.child == "on":
        # The start-up hook registers the library where the package's .pth file is installed; this
        # does it explicitly (idempotent), so the arm does not depend on how the package was installed.
        from beam_shared_prefix.trtllm import register

        register()
    plan_acc = _timed_planning() if args.child == "on" else None
    kv_kwargs = dict(enable_block_reuse=False, free_gpu_memory_fraction=args.kv_cache_fraction)
    try:
        kv_config = KvCacheConfig(use_kv_cache_manager_v2=False, **kv_kwargs)  # beam search needs manager V1
    except (TypeError, ValueError):
        kv_config = KvCacheConfig(**kv_kwargs)
    llm_kwargs = dict(
        model=args.model,
        max_beam_width=args.beams,
        # Requests, not beams; older trees also refuse a SamplingParams.n above it (n = the beam width).
        max_batch_size=max(args.requests, args.beams),
        max_seq_len=args.prompt + args.max_tokens + 8,
        max_num_tokens=max(8192, args.requests * (args.prompt + 8)),
        kv_cache_config=kv_config,
        skip_tokenizer_init=True,
    )
    if not args.no_cuda_graph:
        from tensorrt_llm.llmapi import CudaGraphConfig

        llm_kwargs["cuda_graph_config"] = CudaGraphConfig(batch_sizes=[args.requests])
    else:
        llm_kwargs["cuda_graph_config"] = None
    llm_kwargs.update(beam_search_llm_kwargs(_llm_arg_fields(), args.disable_overlap_scheduler))
    # No tokenizer is loaded, so the end id is given; with ignore_eos every beam runs max_tokens steps.
    end_id = args.end_id if args.end_id is not None else checkpoint_end_id(args.model)
    sampling = SamplingParams(max_tokens=args.max_tokens, n=args.beams, best_of=args.beams, use_beam_search=True,
                              ignore_eos=True, end_id=end_id)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    with LLM(**llm_kwargs) as llm:
        for _ in range(args.warmup):
            llm.generate(prompts, sampling, use_tqdm=False)
        stats_before = _library_stats() if args.child == "on" else {}
        plan_before = dict(plan_acc) if plan_acc else None
        walls = []
        outputs = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
    beams_returned = [len(o.outputs) for o in outputs] if outputs else []
    res = {
        "variant": args.child,
        "wall_s": walls,
        "wall_s_median": statistics.median(walls),
        "prompts_per_s": args.requests / statistics.median(walls),
        "beams_returned": beams_returned,
        "top_beam_tokens": [list(o.outputs[0].token_ids) for o in outputs] if outputs else [],
    }
    if args.child == "on":
        after = _library_stats()
        res["library_stats_timed"] = {k: after.get(k, 0) - stats_before.get(k, 0) for k in after}
        calls = plan_acc["calls"] - plan_before["calls"]
        total = plan_acc["total_us"] - plan_before["total_us"]
        planned = res["library_stats_timed"].get("steps_planned", 0)
        res["plan_calls_timed"] = calls
        # Every prepare() call (context-only and declined steps too), and per step the library planned.
        res["plan_host_us_per_prepare"] = total / calls if calls else None
        res["plan_host_us_per_planned_step"] = total / planned if planned else None
    return res


def _llm_arg_fields():
    """Names of the PyTorch backend's LLM arguments (empty where this tree does not expose them)."""
    try:
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
    except ImportError:
        return set()
    return set(getattr(TorchLlmArgs, "model_fields", {}))


def _library_stats() -> Dict[str, int]:
    from beam_shared_prefix.trtllm import stats

    return dict(stats())


def _run_variant(args, variant: str, argv: Sequence[str]) -> Dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{variant}.json")
        cmd = [sys.executable, "-m", "microbenchmarks.e2e_trtllm", *argv, "--child", variant, "--child-out", out]
        proc = subprocess.run(cmd, env=variant_env(variant))
        if proc.returncode != 0 or not os.path.exists(out):
            return {"variant": variant, "error": f"child exited with status {proc.returncode} (see its output above)"}
        with open(out) as f:
            return json.load(f)


def main(argv: Optional[Sequence[str]] = None, json_stdout=None) -> int:
    """Entry point; ``--json -`` writes the document to ``json_stdout`` (default ``sys.stdout``) and the report
    to stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    json_stdout = json_stdout or sys.stdout
    with contextlib.ExitStack() as stack:
        if args.json == "-":
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        return _main(args, argv, json_stdout)


def _main(args, argv: List[str], json_stdout) -> int:
    try:
        require_tensorrt_llm(import_it=bool(args.child))
    except TrtllmMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.child:
        res = run_child(args)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("on", "off"):
            print(f"error: --variants {v!r} is not on or off", file=sys.stderr)
            return 2
    if args.end_id is None:
        try:  # here, before any child spends minutes building the model
            checkpoint_end_id(args.model)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    results = [_run_variant(args, v, argv) for v in variants]
    by = {r["variant"]: r for r in results}
    summary = {}
    if "on" in by and "off" in by and "prompts_per_s" in by["on"] and "prompts_per_s" in by["off"]:
        summary["speedup"] = by["on"]["prompts_per_s"] / by["off"]["prompts_per_s"]
        summary["top_beams_equal"] = by["on"]["top_beam_tokens"] == by["off"]["top_beam_tokens"]
    for r in results:
        if "error" in r:
            print(f"{r['variant']}: FAILED: {r['error']}")
            continue
        line = f"{r['variant']}: {r['prompts_per_s']:.2f} prompts/s (median wall {r['wall_s_median'] * 1e3:.1f} ms)"
        if r["variant"] == "on":
            st = r.get("library_stats_timed", {})
            per_step = r.get("plan_host_us_per_planned_step")
            per_prepare = r.get("plan_host_us_per_prepare")
            line += (f"; library: {st.get('steps_planned', 0)} steps planned, {st.get('generation_forwards', 0)} eager "
                     f"layer forwards served, {st.get('delegated_steps', 0)} layer forwards handed to the default "
                     f"kernel; host planning "
                     + ("-" if per_step is None else f"{per_step:.1f} us per planned step")
                     + ("" if per_prepare is None else f" ({per_prepare:.1f} us per prepare())"))
        print(line)
    if summary:
        print(f"speedup on/off: {summary['speedup']:.2f}x; top beams identical: {summary['top_beams_equal']}")
    if args.json:
        doc = {"schema": "beam-shared-prefix-e2e/1", "args": vars(args), "results": results, "summary": summary}
        if args.json == "-":
            json.dump(doc, json_stdout, indent=1)
            json_stdout.write("\n")
        else:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
