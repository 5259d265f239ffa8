"""GPU: the whole step (prefix backend + fused tail) against the float32 oracle, per backend.

For every backend (FlashInfer fa2, FlashInfer fa3, FA4) a simulated batch with prompts of 1, 37,
500 and 3,000 tokens runs 12 plain simulator steps (tails of 12 tokens, crossing pages) and then
4 steps through ``BeamSharedPrefixAttention.run`` with random beam reselection; each of those is
compared with :func:`reference_beam_attention`. The pool is a strided per-layer view of a
three-layer pool whose other layers hold NaN (TensorRT-LLM's ``get_buffers(layer, "HND")``).

Accuracy bar: the largest error against the float32 oracle may be at most twice that of a plain
16-bit torch implementation on the same gathered KV (scores, softmax and ``P @ V`` in the dtype,
cuBLAS accumulating in fp32), plus an absolute floor of ``1e-3`` (bf16) / ``2e-4`` (fp16), below
one rounding step of the outputs.

Coverage without the full cartesian product: each case fixes one value of every axis, and the four
cases together cover beams 2/16/96/256, page sizes 16/32/64, GQA 16/8, 32/8, 12/4 and MHA 8/8,
bf16 and fp16 (FA4 runs its cases in bf16, its only dtype), for every backend. Head size 128
throughout, except FA4's 96-beam case at head size 64 (FA4 serves 64 and 128; FlashInfer's
head-64 modules would add minutes of JIT for no new path).
"""

from __future__ import annotations

import pytest
import torch

from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.plan import cdiv
from beam_shared_prefix.prefix import BACKEND_CLASSES
from beam_shared_prefix.reference import beam_kv_positions, gather_beam_kv, reference_beam_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator

pytestmark = pytest.mark.gpu

PROMPTS = (1, 37, 500, 3000)
WARM_STEPS = 12
CHECKED_STEPS = 4
FLOOR = {torch.bfloat16: 1e-3, torch.float16: 2e-4}

CASES = {
    "w2-16/8-pg16-bf16": dict(beams=2, hq=16, hkv=8, pg=16, dtype=torch.bfloat16),
    "w16-32/8-pg32-fp16": dict(beams=16, hq=32, hkv=8, pg=32, dtype=torch.float16),
    "w96-12/4-pg64-bf16": dict(beams=96, hq=12, hkv=4, pg=64, dtype=torch.bfloat16),
    "w256-8/8-pg32-fp16": dict(beams=256, hq=8, hkv=8, pg=32, dtype=torch.float16),
}
BACKENDS = {"fi-fa2": ("flashinfer", "fa2"), "fi-fa3": ("flashinfer", "fa3"), "fa4": ("fa4", "auto")}


def layered_pool(pool: torch.Tensor, layers: int = 3, layer: int = 1) -> torch.Tensor:
    big = torch.full((pool.shape[0], layers, *pool.shape[1:]), float("nan"), dtype=pool.dtype, device=pool.device)
    big[:, layer] = pool
    return big[:, layer]


def plain_torch_attention(sim, step, chunk_rows: int = 32) -> torch.Tensor:
    """Attention of every beam row computed with plain torch ops in the 16-bit dtype (the bar to beat)."""
    dtype, pg, W = sim.dtype, sim.page_size, step.beam_width
    rows, hq, d = step.q.shape
    hkv = sim.num_kv_heads
    g = hq // hkv
    scale = 1.0 / d ** 0.5
    max_len = int(step.kv_lens.max())
    out = torch.empty(rows, hq, d, dtype=dtype, device=step.q.device)
    t = torch.arange(max_len, device=step.q.device)[None, :]
    for a in range(0, rows, chunk_rows):
        b = min(rows, a + chunk_rows)
        idx = torch.arange(a, b, device=step.q.device)
        page, slot, valid = beam_kv_positions(step.beam_page_table, step.cache_indirection, step.prompt_lens,
                                              step.kv_lens, W, pg, idx, max_len)
        k, v = gather_beam_kv(sim.kv_cache, sim.kv_layout, page, slot)
        cur = (t == step.kv_lens[a:b, None].long() - 1)[..., None, None]
        k = torch.where(cur, step.new_k[a:b, None].float(), k).to(dtype)
        v = torch.where(cur, step.new_v[a:b, None].float(), v).to(dtype)
        qd = step.q[a:b].reshape(b - a, hkv, g, d)
        s = torch.einsum("nhgd,nthd->nhgt", qd, k) * scale
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[a:b] = torch.einsum("nhgt,nthd->nhgd", p, v).reshape(b - a, hq, d)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_whole_step_matches_oracle(backend_id, case):
    backend, kernel = BACKENDS[backend_id]
    cfg = dict(CASES[case])
    dtype, d = cfg["dtype"], 128
    if backend == "fa4":
        dtype = torch.bfloat16
        if cfg["beams"] == 96:
            d = 64
    beams, hq, hkv, pg = cfg["beams"], cfg["hq"], cfg["hkv"], cfg["pg"]
    ok, reason = BACKEND_CLASSES[backend].is_available(torch.device("cuda"), dtype, d, hq, hkv, pg, "HND")
    if not ok:
        pytest.skip(f"{backend} unavailable: {reason}")
    if kernel == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer fa3 needs an SM90 GPU")

    tail_cap = WARM_STEPS + CHECKED_STEPS + 2
    max_seq_len = max(PROMPTS) + tail_cap
    # Pool: the prompts plus every beam's private pages for the tail (and the private copy of a
    # partial last prompt page), not the simulator's default of every sequence at max_seq_len.
    num_pages = sum(cdiv(p, pg) + beams * (cdiv(tail_cap, pg) + 2) for p in PROMPTS) + 16
    sim = BeamSearchCacheSimulator(
        list(PROMPTS), beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=pg,
        max_seq_len=max_seq_len, num_pages=num_pages, dtype=dtype, device="cuda", seed=11,
    )
    sim.kv_cache = layered_pool(sim.kv_cache)
    for _ in range(WARM_STEPS):
        sim.begin_step()
        sim.end_step()

    att = BeamSharedPrefixAttention("cuda", backend=backend, prefix_kernel=kernel if backend == "flashinfer" else "auto",
                                    check=False)
    report = []
    for s in range(CHECKED_STEPS):
        step = sim.begin_step()
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, beams, hq, hkv, d,
                 pg, sim.num_pages, dtype, key=(tuple(step.request_ids), beams))
        ref = reference_beam_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                       step.cache_indirection, beams, new_k=step.new_k, new_v=step.new_v)
        plain = plain_torch_attention(sim, step)
        out = torch.full_like(step.q, float("nan"))
        att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection,
                step.new_k, step.new_v, out=out)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"step {s}: NaN left in out"
        err = (out.float() - ref).abs().max().item()
        err_plain = (plain.float() - ref).abs().max().item()
        report.append((s, err, err_plain))
        assert err <= 2 * err_plain + FLOOR[dtype], (
            f"step {s}: max |error| {err:.3g} vs plain {str(dtype)[6:]} torch {err_plain:.3g} "
            f"(bar: 2x + {FLOOR[dtype]:g}); backend {att.backend_name}"
        )
        sim.end_step(write_kv=False)  # later steps read the K/V the tail kernel wrote
    assert att.backend_name == backend and att.num_backend_plans == 1
    if backend == "flashinfer":
        assert att.backend.kernel == kernel
    print(f"[{backend_id} {case} d{d}] (step, max err, plain max err): {report}")
