"""Layer time of BeamSharedPrefixAttention per prefix backend beside FlashInfer's per-beam paged decode.

One decode step of one attention layer at the issue's shape (default: 128 requests x 96 beams x
3,000-token prompts, tails of 3, GQA 16/8, head 128, page 32, bf16, HND pool laid out as
TensorRT-LLM allocates beam search: full prompt pages shared by the beams, the partially filled last
prompt page and every generated page private per beam). Arms, measured in the same run:

- ``wrapper[<backend>]``: ``BeamSharedPrefixAttention.run`` (prefix + fused tail), per backend
  (FlashInfer fa2, fa3, auto rule; FA4), plus its prefix stage alone;
- ``per-beam decode``: ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (tensor cores and CUDA
  cores) with every beam row reading the whole prompt and its tail.

Every arm's output is first compared with the float32 oracle on the first two requests. Times are
CUDA-event medians of CUDA-graph replays (FA4's eager host overhead is not a layer cost), after
warm-up. Not a test: run ``python tests/prefix/bench_wrapper_layer.py [--json PATH]`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from beam_shared_prefix import BeamSharedPrefixAttention  # noqa: E402
from beam_shared_prefix.prefix import BACKEND_CLASSES  # noqa: E402
from beam_shared_prefix.reference import reference_beam_attention  # noqa: E402


def build_batch(R, W, P, tail, hq, hkv, d, pg, dtype, seed=0):
    """Pool, page tables and step inputs of a beam batch whose tails hold ``tail`` tokens (current included)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    kv_len = P + tail
    full, partial = divmod(P, pg)
    pages_per_row = -(-kv_len // pg)
    shared = full  # full prompt pages shared by the beams
    private = pages_per_row - full  # the partial prompt page (if any) and the tail pages, per beam
    num_pages = R * (shared + W * private)
    pool = torch.randn(num_pages, 2, hkv, pg, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    max_seq_len = pages_per_row * pg
    rows = R * W
    table = torch.empty(rows, pages_per_row, dtype=torch.int32, device=dev)
    base = torch.arange(R, device=dev, dtype=torch.int32)[:, None] * (shared + W * private)
    shared_pages = base + torch.arange(shared, device=dev, dtype=torch.int32)[None, :]  # [R, shared]
    beam_pages = (base[:, :, None] + shared + torch.arange(W * private, device=dev, dtype=torch.int32)
                  .view(1, W, private))  # [R, W, private]
    table[:, :shared] = shared_pages.repeat_interleave(W, dim=0)
    table[:, shared:] = beam_pages.reshape(rows, private)
    ind = torch.randint(0, W, (R, W, max_seq_len), generator=gen, device=dev, dtype=torch.int32)
    ind[:, :, :P] = 0
    kv_lens = torch.full((rows,), kv_len, dtype=torch.int32, device=dev)
    prompt_lens = torch.full((rows,), P, dtype=torch.int32, device=dev)
    # Beam 0's pages per request (the planner input), on the host.
    beam0 = table[::W, :-(-P // pg)].cpu()
    indptr = torch.arange(R + 1, dtype=torch.int32) * beam0.shape[1]
    q = torch.randn(rows, hq, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    new_k = torch.randn(rows, hkv, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    new_v = torch.randn(rows, hkv, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    return dict(pool=pool, table=table, ind=ind, kv_lens=kv_lens, prompt_lens=prompt_lens, indptr=indptr,
                indices=beam0.flatten(), prompt_lens_req=torch.full((R,), P, dtype=torch.int32), q=q, new_k=new_k,
                new_v=new_v, R=R, W=W, P=P, pg=pg, num_pages=num_pages)


def _median_us(launch, iters, warmup):
    for _ in range(warmup):
        launch()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def time_graph(fn, iters=50, warmup=5):
    """Median microseconds of CUDA-graph replays of ``fn`` (eager events if capture fails), and the mode."""
    fn()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - report eager time instead
        print(f"  (capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        torch.cuda.synchronize()
        return _median_us(fn, iters, warmup)
    return _median_us(graph.replay, iters, warmup)


def check_rows(out, batch, hq, what, requests=2):
    """Compare the first ``requests`` requests' rows with the float32 oracle (raises on mismatch)."""
    n = requests * batch["W"]
    ref = reference_beam_attention(
        batch["q"][:n], batch["pool"], batch["table"][:n], batch["kv_lens"][:n], batch["prompt_lens"][:n],
        batch["ind"][:requests], batch["W"], new_k=batch["new_k"][:n], new_v=batch["new_v"][:n],
    )
    err = (out[:n].float() - ref).abs().max().item()
    if not err < 3e-2:
        raise AssertionError(f"{what}: max |error| {err} against the oracle")
    return err


def wrapper_arm(batch, backend, kernel, hq, hkv, d, dtype):
    att = BeamSharedPrefixAttention("cuda", backend=backend, prefix_kernel=kernel, check=False)
    att.plan(batch["indptr"], batch["indices"], batch["prompt_lens_req"], batch["W"], hq, hkv, d, batch["pg"],
             batch["num_pages"], dtype, key="bench")
    out = torch.empty_like(batch["q"])

    def step():
        # write_kv rewrites the same K/V each replay: idempotent, so every replay sees the same cache.
        att.run(batch["q"], batch["pool"], batch["table"], batch["kv_lens"], batch["ind"], batch["new_k"],
                batch["new_v"], out=out)

    step()
    err = check_rows(out, batch, hq, f"wrapper[{backend}/{kernel}]")
    us = time_graph(step)
    prefix = att.backend
    views = att._views
    prefix_us = time_graph(lambda: prefix.run(batch["q"], batch["pool"], views["prefix_out"], views["prefix_lse"]))
    label = backend if backend != "flashinfer" else f"flashinfer-{att.backend.kernel}"
    return dict(arm=f"wrapper[{label}]", us=us, prefix_us=prefix_us, err=err)


def decode_arm(batch, hq, hkv, d, dtype, use_tensor_cores):
    import flashinfer

    rows, W, pg = batch["R"] * batch["W"], batch["W"], batch["pg"]
    # The current token's K/V must be in the cache for the decode kernel: write it first.
    pos = batch["kv_lens"].long() - 1
    page = batch["table"].gather(1, (pos // pg)[:, None]).squeeze(1).long()
    slot = pos % pg
    batch["pool"][page, 0, :, slot, :] = batch["new_k"]
    batch["pool"][page, 1, :, slot, :] = batch["new_v"]
    # Each beam's own page list: the indirection resolved per position is what a per-beam decode of
    # TensorRT-LLM does; for the timing, reading the row's pages (same bytes) is the same work.
    n_pages = batch["table"].shape[1]
    indptr = (torch.arange(rows + 1, dtype=torch.int32) * n_pages)
    indices = batch["table"].flatten()
    last = torch.full((rows,), (int(batch["kv_lens"][0]) - 1) % pg + 1, dtype=torch.int32)
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=use_tensor_cores)
    wrapper.plan(indptr, indices.cpu(), last, hq, hkv, d, pg, q_data_type=dtype, kv_data_type=dtype)
    out = torch.empty_like(batch["q"])
    us = time_graph(lambda: wrapper.run(batch["q"], batch["pool"], out=out))
    return dict(arm=f"per-beam decode ({'tensor cores' if use_tensor_cores else 'CUDA cores'})", us=us)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--beams", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--tail", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    dtype = torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    batch = build_batch(args.requests, args.beams, args.prompt, args.tail, hq, hkv, d, args.page_size, dtype)
    results = []
    arms = [("flashinfer", "fa2"), ("flashinfer", "fa3"), ("flashinfer", "auto"), ("fa4", "auto")]
    for backend, kernel in arms:
        ok, reason = BACKEND_CLASSES[backend].is_available(torch.device("cuda"), dtype, d, hq, hkv, args.page_size)
        if not ok:
            results.append(dict(arm=f"wrapper[{backend}]", skipped=reason))
            continue
        try:
            results.append(wrapper_arm(batch, backend, kernel, hq, hkv, d, dtype))
        except Exception as exc:  # report and keep measuring the other arms
            results.append(dict(arm=f"wrapper[{backend}/{kernel}]", error=f"{type(exc).__name__}: {exc}"))
    for tc in (True, False):
        try:
            results.append(decode_arm(batch, hq, hkv, d, dtype, tc))
        except Exception as exc:
            results.append(dict(arm=f"per-beam decode tc={tc}", error=f"{type(exc).__name__}: {exc}"))
    shape = (f"{args.requests} requests x {args.beams} beams x {args.prompt} prompt, tail {args.tail}, "
             f"GQA {hq}/{hkv}, head {d}, page {args.page_size}, bf16, HND")
    print(shape)
    for r in results:
        if "us" in r:
            extra = f"  (prefix alone {r['prefix_us']:.1f} us, max err {r['err']:.2e})" if "prefix_us" in r else ""
            print(f"  {r['arm']:<40} {r['us']:10.1f} us{extra}")
        else:
            print(f"  {r['arm']:<40} {r.get('skipped') or r.get('error')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=shape, results=results, device=torch.cuda.get_device_name()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
