"""The cascade step inside a model-like CUDA graph, with and without programmatic dependent launch:
``python -m microbenchmarks.layer_graph --preset B-short``.

The benchmark CLI times one step between two CUDA events, so the gap between the step and the kernel before it in a
model (what PDL saves, :mod:`triton_kernels.launch`) never shows there. Here a graph holds ``--layers`` layers of a
QKV projection (``torch.mm`` of ``[rows, --hidden]`` by ``[--hidden, (Hq + 2 Hkv) D]``), a RoPE-like elementwise
Triton kernel that reads it and writes ``q``, ``new_k`` and ``new_v`` (views of one buffer, as TensorRT-LLM passes
fused QKV; with ``trigger`` it releases its dependents as it starts, as PDL-aware producers do), and the one-launch
cascade step (KV write on) of the preset's workload. Arms, interleaved, each a graph:

- ``producer``: GEMM + RoPE-like kernel; ``cascade``: the steps alone, PDL off and on;
- ``layer``: the three, PDL off and on, with and without the producer's trigger.

Per-layer time = replay time / layers, the median over ``--rounds`` x ``--reps`` replays, each between CUDA events
(no L2 flush: the GEMM's weights and the step's pages stream through it as in a model). Every arm's output must equal
the PDL-off layer's bit for bit, every element written (over NaN). The PDL switch is TensorRT-LLM's
``TRTLLM_ENABLE_PDL``, set per arm. Cascade presets only (the ones whose ``auto`` path is the cascade: B-short,
B-medium, B-long, B-beam14); compute capability 9.0 or newer (the producer's trigger and PDL are Hopper's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

from .arms import _step_plan
from .shapes import PRESETS
from .workload import build_workload

__all__ = ["main", "time_layers"]

CASCADE_PRESETS = ("B-short", "B-medium", "B-long", "B-beam14")


def _rope_like_kernel():
    """A Triton kernel ``dst = 0.75 src + 0.01`` over ``n`` elements whose ``TRIGGER`` releases its dependents first
    (``griddepcontrol.launch_dependents``, emitted directly: Triton 3.4's ``gdc_launch_dependents`` does not build)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_like(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, (x * 0.75 + 0.01).to(dst_ptr.dtype.element_ty), mask=ok)

    return rope_like


def time_layers(preset: str, layers: int = 16, reps: int = 50, rounds: int = 3, hidden: int = 1024,
                seed: int = 0) -> dict:
    """Build the arms' graphs for ``preset`` on the current CUDA device, check their outputs and time them.

    Returns ``{"median_us_per_layer": {arm: us}, "outputs_equal": {arm: bool}, "all_written": bool, ...}``; times
    in microseconds per layer. Restores ``TRTLLM_ENABLE_PDL`` as it found it.
    """
    import triton

    import triton_kernels
    from triton_kernels.launch import PDL_ENV, pdl_enabled

    capability = torch.cuda.get_device_capability()
    if capability[0] < 9:
        raise ValueError(f"layer_graph needs compute capability 9.0 or newer (programmatic dependent launch); this "
                         f"GPU is {capability[0]}.{capability[1]}: run it on Hopper or later.")
    wl = build_workload(PRESETS[preset], device="cuda", seed=seed, with_baseline_pages=False)
    prompt_table = torch.from_numpy(_step_plan(wl).page_table.copy()).cuda()
    rows, hq, d = wl.q.shape
    hkv = wl.new_k.shape[1]
    width = (hq + 2 * hkv) * d
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(rows, hidden, device="cuda", dtype=wl.q.dtype, generator=gen)
    w = torch.randn(hidden, width, device="cuda", dtype=wl.q.dtype, generator=gen) / hidden ** 0.5
    raw = torch.empty(rows, width, device="cuda", dtype=wl.q.dtype)
    qkv = torch.empty_like(raw)
    q = qkv[:, :hq * d].view(rows, hq, d)
    new_k = qkv[:, hq * d:(hq + hkv) * d].view(rows, hkv, d)
    new_v = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
    out = torch.empty_like(wl.q)
    rope_like = _rope_like_kernel()
    block = 2048
    saved = os.environ.get(PDL_ENV)

    def set_pdl(on: bool) -> None:
        os.environ[PDL_ENV] = "1" if on else "0"
        pdl_enabled.cache_clear()

    def producer(trigger: bool) -> list[Callable[[], None]]:
        def rope():
            rope_like[(triton.cdiv(raw.numel(), block),)](raw, qkv, raw.numel(), BLOCK=block, TRIGGER=trigger)
        return [lambda: torch.mm(x, w, out=raw), rope]

    def step(pdl: bool) -> list[Callable[[], None]]:
        def run():
            set_pdl(pdl)
            triton_kernels.beam_cascade_attention(q, new_k, new_v, wl.kv_cache, prompt_table, wl.beam_page_table,
                                                  wl.kv_lens, wl.prompt_lens, wl.cache_indirection, wl.beam_width,
                                                  out, kv_layout=wl.kv_layout, write_kv=True)
        return [run]

    arms: dict[str, list[Callable[[], None]]] = {
        "producer": producer(False),
        "cascade, PDL off": step(False),
        "cascade, PDL on": step(True),
        "layer, PDL off": producer(False) + step(False),
        "layer, PDL on": producer(False) + step(True),
        "layer, PDL off, trigger": producer(True) + step(False),
        "layer, PDL on, trigger": producer(True) + step(True),
    }
    graphs, outs = {}, {}
    try:
        for name, fns in arms.items():
            for _ in range(3):  # compile and warm outside the capture
                for f in fns:
                    f()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(layers):
                    for f in fns:
                        f()
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            graphs[name], outs[name] = graph, out.clone()
    finally:
        if saved is None:
            os.environ.pop(PDL_ENV, None)
        else:
            os.environ[PDL_ENV] = saved
        pdl_enabled.cache_clear()
    # Every step arm reads the same queries (the producer arm, captured and replayed first, wrote them).
    ref = outs["layer, PDL off"]
    equal = {n: bool(torch.equal(o, ref)) for n, o in outs.items() if n not in ("producer", "layer, PDL off")}
    written = all(bool(torch.isfinite(o).all()) for n, o in outs.items() if n != "producer")
    times: dict[str, list[float]] = {n: [] for n in arms}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            for _ in range(3):
                graph.replay()
            for _ in range(reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1000.0 / layers)
    return {"preset": preset, "layers": layers, "rows": rows, "hidden": hidden,
            "device": torch.cuda.get_device_name(), "outputs_equal": equal,
            "all_written": written,
            "median_us_per_layer": {n: statistics.median(t) for n, t in times.items()},
            "samples": len(times["producer"])}


def main(argv=None) -> int:
    """CLI entry point (``argv`` as for argparse); returns the exit status (1 if an output differs)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="B-short", choices=CASCADE_PRESETS)
    p.add_argument("--layers", type=int, default=16, help="layers a graph (default 16)")
    p.add_argument("--reps", type=int, default=50, help="timed replays of each graph a round (default 50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the arms, interleaved (default 3)")
    p.add_argument("--hidden", type=int, default=1024, help="the QKV projection's input width (default 1024)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    for name in ("layers", "reps", "rounds", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    if not torch.cuda.is_available():
        print("layer_graph: no CUDA device; nothing to time (the graphs and PDL need a GPU).")
        return 0
    if torch.cuda.get_device_capability()[0] < 9:
        print("layer_graph: this GPU is older than Hopper (compute capability 9.0); it has no programmatic dependent "
              "launch to time.")
        return 0
    res = time_layers(args.preset, args.layers, args.reps, args.rounds, args.hidden)
    t = res["median_us_per_layer"]
    print(f"{res['preset']} on {res['device']}: {res['rows']} rows, {res['layers']} layers a graph, "
          f"{res['samples']} replays an arm; outputs equal: {all(res['outputs_equal'].values())}, "
          f"every element written: {res['all_written']}")
    for name, us in t.items():
        print(f"  {name:26s} {us:8.2f} us a layer")
    print(f"  PDL saves {t['layer, PDL off'] - t['layer, PDL on']:+.2f} us a layer behind the plain producer, "
          f"{t['layer, PDL off, trigger'] - t['layer, PDL on, trigger']:+.2f} behind the triggering one, "
          f"{t['cascade, PDL off'] - t['cascade, PDL on']:+.2f} between steps alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(res["outputs_equal"].values()) and res["all_written"] else 1


if __name__ == "__main__":
    sys.exit(main())
