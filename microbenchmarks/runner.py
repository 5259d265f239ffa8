"""Runs the arms on one shape: build input sets, count the floors, check every arm, time it.

Per shape point: ``sets`` workloads (different seeds: different page permutations, ancestries and
data) are built; every arm is prepared on each, captured in a CUDA graph where it can be, run once
on poisoned (NaN) output buffers and compared with the float32 oracle; only arms that pass are
timed. The result is a plain dict (the JSON schema of :mod:`.report`).
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .arms import Arm, ArmSkipped, LibraryArm, RunContext
from .check import Oracle, compare, merge_results, pool_write_problem, set_write_slots, slot_fingerprint, stray_writes
from .floors import count_flops, count_traffic, floor_times, mean_traffic, stage_work
from .shapes import BenchShape
from .timing import GraphedCall, capture_graph, time_cpu, time_cuda, time_kernels
from .workload import BenchWorkload, build_workload

__all__ = ["RunOptions", "Rates", "run_point", "estimate_workload_bytes", "decline_reason", "rule_paths",
           "rule_verdict"]


@dataclass
class RunOptions:
    """How one point is measured (see the CLI's ``--help`` for each)."""

    sets: int = 3
    iters: int = 20
    warmup: int = 3
    l2_flush: str = "read"
    use_graphs: bool = True
    check: bool = True
    check_requests: int = 4
    kv_layout: str = "HND"
    seed: int = 0
    plan_repeats: int = 200
    baselines_need_pages: bool = True
    graph_baselines: bool = False
    fi_workspace_mb: int = 512
    report_errors: bool = False
    kernel_times: bool = False
    declare_tail: bool = False  # the library's wrappers get max_tail_len = the shape's longest tail


@dataclass
class Rates:
    """Rates measured in this run (``None`` on CPU)."""

    copy_bandwidth: Optional[float] = None  # bytes/s, read + write
    matmul_rate: Optional[float] = None  # FLOP/s in the benchmark dtype
    event_overhead_us: Optional[float] = None  # an empty kernel's time under the same events

    def to_dict(self) -> Dict:
        """JSON-ready dict of the fields (used in the results document)."""
        return {
            "copy_bandwidth_GBps": None if self.copy_bandwidth is None else self.copy_bandwidth / 1e9,
            "matmul_TFLOPs": None if self.matmul_rate is None else self.matmul_rate / 1e12,
            "event_overhead_us": self.event_overhead_us,
        }


def estimate_workload_bytes(shape: BenchShape, with_baseline_pages: bool = True) -> int:
    """Device bytes of one input set (pool, indirection, q/new K/V), before building it."""
    P = int(shape.prompt * (1 + shape.prompt_jitter))
    L = P + shape.tail
    Pg = shape.page_size
    n_full = P // Pg
    n_priv = -(-L // Pg) - n_full
    pages = shape.requests * (n_full + shape.beams * n_priv * (2 if with_baseline_pages else 1)) + 8
    s = 2
    pool = pages * 2 * shape.kv_heads * Pg * shape.head_dim * s
    ind = shape.requests * shape.beams * (-(-L // Pg) + 1) * Pg * 4
    act = shape.rows * (shape.heads * 2 + shape.kv_heads * 2) * shape.head_dim * s
    return pool + ind + act


def _auto_path(shape: BenchShape, eager: bool, tail_bound: Optional[int] = None):
    """``(one_launch, split_kv)``: the path backend ``"auto"`` takes for ``shape`` on a GPU with every prefix
    backend installed (the cascade, FlashInfer's split prompt, or else FA4/FlashInfer + tail), on ``eager`` steps
    or under a CUDA graph, with the wrapper's default ``shared_run="auto"`` (a long tail leaves the cascade);
    ``tail_bound``: the cascade launch's tail bound (``None``: an eager step's own tail, else none). A CUDA-graph
    wrapper judges the prompt its table can hold (the longest prompt drawn, in whole pages: ``graph_rule_prompt``),
    not the mean."""
    from beam_shared_prefix.prefix.select import cascade_serves, flashinfer_serves, graph_rule_prompt

    prompt = shape.prompt
    if not eager:
        capacity = -(-shape.longest_prompt // shape.page_size) * shape.page_size
        prompt = graph_rule_prompt(capacity, shape.heads, shape.kv_heads, shape.beams, shape.head_dim)
    split_kv = flashinfer_serves("auto", num_requests=shape.requests, mean_prompt_len=prompt,
                                 num_qo_heads=shape.heads, num_kv_heads=shape.kv_heads, beam_width=shape.beams,
                                 head_dim=shape.head_dim, eager=eager)
    one_launch = not split_kv and cascade_serves("auto", mean_prompt_len=prompt, num_qo_heads=shape.heads,
                                                 num_kv_heads=shape.kv_heads, beam_width=shape.beams,
                                                 head_dim=shape.head_dim, num_requests=shape.requests,
                                                 tail_len=shape.tail, eager=eager, tail_bound=tail_bound)
    return one_launch, split_kv


def _auto_verdict(shape: BenchShape):
    """``(one_launch, split_kv, decline reason)``: :func:`_auto_path` eagerly (the cascade's MHA tail limit applies
    to CUDA-graph replays only, and eager steps take it ahead of some of FlashInfer's split prompts), and what
    :func:`beam_shared_prefix.decline.should_decline` says of it at the shape's (longest) tail (``None``:
    served)."""
    from beam_shared_prefix.decline import should_decline

    one_launch, split_kv = _auto_path(shape, eager=True)
    reason = should_decline(shape.requests, shape.beams, shape.prompt, shape.heads, shape.kv_heads, shape.head_dim,
                            one_launch=one_launch, split_kv=split_kv, tail_len=shape.tail)
    return one_launch, split_kv, reason


def _gate_reason(shape: BenchShape) -> Optional[str]:
    """The TensorRT-LLM adapter's layer and pool gates a shape fails (``None``: it passes them): head sizes, the
    widest GQA group and the page sizes the kernels tile."""
    from beam_shared_prefix.trtllm.gates import MAX_GROUP_SIZE, SUPPORTED_HEAD_DIMS
    from beam_shared_prefix.trtllm.kv_cache import SUPPORTED_PAGE_SIZES

    if shape.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={shape.head_dim} is not one of {SUPPORTED_HEAD_DIMS}: the library does not serve it"
    if shape.heads // shape.kv_heads > MAX_GROUP_SIZE:
        return (f"GQA group {shape.heads // shape.kv_heads} exceeds {MAX_GROUP_SIZE}, the widest the tail kernel "
                f"tiles: the library does not serve it")
    if shape.page_size not in SUPPORTED_PAGE_SIZES:
        return (f"page size {shape.page_size} is not one of {SUPPORTED_PAGE_SIZES}, the tail kernel's page sizes: "
                f"TensorRT-LLM's pools of other block sizes are declined")
    return None


def decline_reason(shape: BenchShape) -> Optional[str]:
    """Why the library's default (backend ``"auto"``) on a GPU declines this shape, at its (longest) tail
    (``None``: served): the adapter's gates (:func:`rule_verdict`'s), then
    :func:`beam_shared_prefix.decline.should_decline`."""
    try:
        return _gate_reason(shape) or _auto_verdict(shape)[2]
    except ImportError:
        return None


def rule_paths(shape: BenchShape, declare_tail: bool = False) -> Optional[Dict[str, str]]:
    """``{"eager": path, "graph": path}``: the path ``auto`` takes for ``shape`` on eager steps, which
    ``decline_reason`` judges, and on a CUDA-graph wrapper, which the graphed library arms run (as
    :func:`rule_verdict` names them); ``None`` where the library's rules cannot be read (no triton, or a settings
    error in the environment)."""
    from beam_shared_prefix.config import ConfigError

    try:
        v = rule_verdict(shape, declare_tail)
    except (ImportError, ConfigError):
        return None
    return {"eager": v["path"], "graph": v["graph_path"]}


def rule_verdict(shape: BenchShape, declare_tail: bool = False) -> Dict:
    """What the library's default does with ``shape`` (eagerly), without measuring: ``path`` (``"cascade"``,
    ``"flashinfer split prompt"`` or ``"prefix + tail kernel"``, with ``" + shared-run stage"`` from
    ``SHARED_RUN_MIN_TAIL`` generated tokens where the stage tiles the shape), ``graph_path`` (the same for a
    CUDA-graph wrapper planned at this shape: eager steps take the cascade further, where host-bound, and MHA's
    tail limit binds graph replays only), ``decline_reason`` (``None``: served) and ``max_tail`` (the longest
    tail, in generated tokens per beam with this step's, that the tail clause serves at this shape). The CUDA-graph
    wrapper's tail bound is ``TLLM_BEAM_SHARED_PREFIX_MAX_TAIL``, or with ``declare_tail`` the shape's tail (as
    ``--declare-tail`` builds the measured arms)."""
    from beam_shared_prefix.config import load_settings
    from beam_shared_prefix.decline import max_tail_len
    from beam_shared_prefix.prefix.select import cascade_tail_bound, long_tail_for_shared_run
    from triton_kernels.shared_run import shared_run_supported

    one_launch, split_kv, reason = _auto_verdict(shape)
    wrapper_tail = shape.tail if declare_tail else load_settings().max_tail_len
    graph_one_launch, graph_split_kv = _auto_path(shape, eager=False, tail_bound=cascade_tail_bound(wrapper_tail))

    def path_of(cascade: bool, split: bool) -> str:
        path = "cascade" if cascade else "flashinfer split prompt" if split else "prefix + tail kernel"
        if (not cascade and long_tail_for_shared_run(shape.tail)
                and shared_run_supported(shape.heads // shape.kv_heads, shape.head_dim)[0]):
            path += " + shared-run stage"
        return path

    reason = _gate_reason(shape) or reason  # the gates first: a shape never served has no speed to judge
    return {"path": path_of(one_launch, split_kv), "graph_path": path_of(graph_one_launch, graph_split_kv),
            "decline_reason": reason,
            "max_tail": int(max_tail_len(shape.beams, shape.prompt, shape.kv_heads, shape.requests, shape.heads))}


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) < 600 else text[:600] + "..."


def _poison(prepared, fn) -> None:
    for t in prepared.poison:
        if t.is_floating_point():
            t.fill_(float("nan"))
    if isinstance(fn, GraphedCall) and isinstance(fn.result, torch.Tensor) and fn.result.is_floating_point():
        fn.result.fill_(float("nan"))


# A finite value no random K/V row equals (bf16 and fp16 hold it exactly).
WRITE_SLOT_POISON = 1000.0


def _check_arm(arm: Arm, prepared: list, fns: list, oracles: Sequence[Oracle], dtype,
               fingerprints: Sequence[torch.Tensor]) -> Tuple[Dict, List[int]]:
    """One poisoned call per input set: the checked rows against the oracle, every output element
    finite, and the pool written exactly where the step writes (:mod:`.check`). Returns the check
    and the input sets whose pool the arm changed outside the step's write slots."""
    results, corrupted = [], []
    for i, (p, fn, orc, before) in enumerate(zip(prepared, fns, oracles, fingerprints, strict=True)):
        wl = orc.wl
        _poison(p, fn)
        if arm.writes_kv:
            # So that a missing write cannot pass on an earlier arm's. Finite: a kernel that loads a
            # masked slot (and weights it 0) is not failed here; one that reads this step's K/V from
            # the cache instead of new_k/new_v is.
            set_write_slots(wl, WRITE_SLOT_POISON)
        result = fn()
        if wl.device.type == "cuda":
            torch.cuda.synchronize()
        out, lse = p.outputs(result)
        rows = orc.rows
        if arm.expect == "prefix":
            o_ref, lse_ref = orc.prefix()
            checked = compare(out[rows], o_ref, dtype, None if lse is None else lse[rows], lse_ref)
        else:
            checked = compare(out[rows], orc.full(), dtype)
        stray = stray_writes(wl, before, arm.writes_kv)
        if stray.numel():
            corrupted.append(i)
        problem = pool_write_problem(wl, stray, arm.writes_kv)
        set_write_slots(wl)  # every later arm reads the step's K/V in place, whatever this one did
        unwritten = int((~torch.isfinite(out)).sum())
        if not problem and unwritten:
            problem = f"{unwritten} non-finite output elements in all rows (an unwritten output)"
        # (a prefix stage's LSE too: the oracle compares the checked rows only, and an unwritten LSE is poisoned)
        unwritten_lse = 0 if lse is None else int((~torch.isfinite(lse)).sum())
        if not problem and unwritten_lse:
            problem = f"{unwritten_lse} non-finite LSE elements in all rows (an unwritten LSE)"
        flagged = p.device_errors() if p.device_errors is not None else []
        if not problem and flagged:
            problem = f"the kernels flagged valid input: {'; '.join(flagged)}"
        if problem:
            checked = dataclasses.replace(checked, ok=False, message=problem)
        results.append(checked)
    return merge_results(results).to_dict(), corrupted


def run_point(
    shape: BenchShape,
    arms: Sequence[Arm],
    opts: RunOptions,
    rates: Rates,
    device,
    on_arm: Optional[Callable[[str], None]] = None,
    log: Callable[[str], None] = print,
) -> Dict:
    """Measure every arm on ``shape``; returns the point's result dict (see :mod:`.report`)."""
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    sets = opts.sets
    if is_cuda:
        # The previous point's tensors are gone; return their cached blocks so they count as free.
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        need = estimate_workload_bytes(shape, opts.baselines_need_pages)
        fit = int(0.6 * free // max(need, 1))
        if fit < 1:
            raise MemoryError(
                f"{shape.label()}: one input set needs about {need / 2**30:.1f} GiB but only "
                f"{free / 2**30:.1f} GiB are free; lower --requests/--beams/--prompt."
            )
        if fit < sets:
            log(f"note: {shape.name}: {sets} input sets do not fit in memory; using {fit}.")
            sets = fit
    wls: List[BenchWorkload] = [
        build_workload(shape, device, seed=opts.seed + i, kv_layout=opts.kv_layout,
                       with_baseline_pages=opts.baselines_need_pages)
        for i in range(sets)
    ]
    oracles = [Oracle(wl, max_requests=opts.check_requests if is_cuda else wl.num_requests) for wl in wls]
    if opts.check:
        for orc in oracles:
            orc.precompute()  # before any arm writes into the pool
    elem = wls[0].q.element_size()
    # The floors of the sets, averaged: the times are medians over every set, whose prompt lengths
    # (with --prompt-jitter) and beam ancestries (distinct tail entries) differ.
    set_traffic = [count_traffic(wl.prompt_lens_host, wl.tail_lens_host, shape.beams, shape.heads, shape.kv_heads,
                                 shape.head_dim, shape.page_size, elem, wl.tail_ancestry) for wl in wls]
    set_flops = [count_flops(wl.prompt_lens_host, wl.tail_lens_host, shape.beams, shape.heads, shape.head_dim)
                 for wl in wls]
    traffic = mean_traffic(set_traffic)
    flops = int(round(sum(set_flops) / len(wls)))
    floors = floor_times(traffic, flops, rates.copy_bandwidth, rates.matmul_rate)

    def mean_work(w):
        per_set = [stage_work(w, t, f, wl.prompt_lens_host, wl.tail_lens_host, shape.beams, shape.heads, shape.head_dim,
                              shape.page_size) for t, f, wl in zip(set_traffic, set_flops, wls)]
        return {k: int(round(sum(d[k] for d in per_set) / len(per_set))) for k in ("bytes", "flops")}

    works = {w: mean_work(w) for w in ("full", "prefix", "tail")}
    for d in works.values():
        f = floor_times_simple(d["bytes"], d["flops"], rates)
        d["floor_us"] = f
    ctx = RunContext(device=device, use_graphs=opts.use_graphs and is_cuda, graph_baselines=opts.graph_baselines,
                     fi_workspace_bytes=opts.fi_workspace_mb << 20, report_errors=opts.report_errors,
                     declare_tail=opts.declare_tail)
    arm_results = []
    plan_times = {}
    for arm in arms:
        if on_arm:
            on_arm(arm.name)
        res = {"name": arm.name, "kind": arm.kind, "work": arm.work, "description": arm.description,
               "status": "ok", "reason": None, "graphed": False, "graph_error": None, "info": {}}
        prepared = []
        fns = []
        try:
            fingerprints = [slot_fingerprint(wl) for wl in wls] if opts.check else []
            for wl in wls:
                prepared.append(arm.prepare(wl, ctx))
            res["info"] = dict(prepared[0].info)
            backends = [p.info.get("backend") for p in prepared]
            if len(set(backends)) > 1:  # (each set's wrapper chose for its own prompts: the median mixes paths)
                res["info"]["backend_per_set"] = backends
            fns = [p.call for p in prepared]
            if ctx.use_graphs and all(p.capturable for p in prepared):
                try:
                    fns = [capture_graph(p.call) for p in prepared]
                    res["graphed"] = True
                except Exception as exc:  # capture is best effort: fall back to eager, say why
                    res["graph_error"] = _short_error(exc)
                    fns = [p.call for p in prepared]
                    if is_cuda:
                        torch.cuda.synchronize()
            if opts.check:
                res["check"], corrupted = _check_arm(arm, prepared, fns, oracles, wls[0].dtype, fingerprints)
                for i in corrupted:
                    # This arm wrote outside the step's slots: the next arms get a fresh pool (the
                    # same seed builds the same inputs; the references were computed first).
                    wls[i] = build_workload(shape, device, seed=opts.seed + i, kv_layout=opts.kv_layout,
                                            with_baseline_pages=opts.baselines_need_pages)
                    oracles[i].wl = wls[i]
                if not res["check"]["ok"]:
                    res["status"] = "check_failed"
                    res["reason"] = res["check"]["message"]
            if res["status"] == "ok":
                timing = (time_cuda(fns, opts.iters, opts.warmup, l2_flush=opts.l2_flush)
                          if is_cuda else time_cpu(fns, opts.iters, min(opts.warmup, 1)))
                res["time_us"] = timing.median_us
                res["time_min_us"] = timing.min_us
                res["time_set_medians_us"] = timing.set_medians_us
                res["samples"] = len(timing.all_us)
                if timing.host_gaps:
                    res["host_gaps"] = True
                if is_cuda and opts.kernel_times:
                    try:
                        spans = time_kernels(fns, opts.iters, opts.warmup, l2_flush=opts.l2_flush)
                        res["kernel_us"] = spans.median_us
                        res["kernel_set_medians_us"] = spans.set_medians_us
                    except Exception as exc:  # the events' time stands; say why the trace did not
                        res["kernel_error"] = _short_error(exc)
            if isinstance(arm, LibraryArm) and res["status"] == "ok" and opts.plan_repeats:
                plan_times[arm.name] = arm.time_plans(wls[0], ctx, opts.plan_repeats)
                res["plan"] = plan_times[arm.name]
        except ArmSkipped as exc:
            res["status"], res["reason"] = "skipped", str(exc)
        except Exception as exc:  # one broken arm must not end the run: report it
            res["status"], res["reason"] = "failed", _short_error(exc)
            res["traceback"] = traceback.format_exc(limit=6)
        finally:
            del prepared, fns
            if is_cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        arm_results.append(res)

    _derive(arm_results, works)
    plens, tlens = wls[0].prompt_lens_host, wls[0].tail_lens_host
    return {
        "shape": shape.to_dict(),
        "label": shape.label(),
        "sets": sets,
        "prompt_lens": {"mean": float(plens.mean()), "min": int(plens.min()), "max": int(plens.max())},
        "tail_lens": {"mean": float(tlens.mean()), "min": int(tlens.min()), "max": int(tlens.max())},
        "traffic_bytes": traffic.to_dict(),
        "flops": flops,
        "floors": floors,
        "work": works,
        "decline_reason": decline_reason(shape),
        "rule_paths": rule_paths(shape, opts.declare_tail),
        "arms": arm_results,
        "plan": plan_times,
    }


def floor_times_simple(nbytes: int, flops: int, rates: Rates) -> Optional[float]:
    """Floor in microseconds of ``nbytes`` moved and ``flops`` done: the max of the memory and compute
    times at the measured rates; ``None`` if no rate is known."""
    parts = []
    if rates.copy_bandwidth:
        parts.append(nbytes / rates.copy_bandwidth * 1e6)
    if rates.matmul_rate:
        parts.append(flops / rates.matmul_rate * 1e6)
    return max(parts) if parts else None


def _derive(arm_results: List[Dict], works: Dict) -> None:
    """Speedups over the best per-beam decode and the cascade, floor multiples, achieved rates."""

    def best(kind_names):
        ts = [r["time_us"] for r in arm_results if r["name"] in kind_names and r["status"] == "ok"]
        return min(ts) if ts else None

    decode = best({"fi-decode-tc", "fi-decode-cc"})
    cascade = best({"fi-cascade"})
    for r in arm_results:
        t = r.get("time_us")
        if r["status"] != "ok" or not t:
            continue
        w = works[r["work"]]
        # A stage alone is not a step: its speedup over a whole step would flatter it.
        full = r["work"] == "full"
        r["speedup_vs_decode"] = decode / t if decode and full else None
        r["speedup_vs_cascade"] = cascade / t if cascade and full else None
        r["floor_multiple"] = t / w["floor_us"] if w.get("floor_us") else None
        k = r.get("kernel_us")
        r["kernel_floor_multiple"] = k / w["floor_us"] if k and w.get("floor_us") else None
        r["achieved_GBps"] = w["bytes"] / (t * 1e-6) / 1e9
        r["achieved_TFLOPs"] = w["flops"] / (t * 1e-6) / 1e12
