"""The Triton prefix backend (the cascade kernel) and the wrapper's one-launch path, against the oracle.

On a CPU the kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py), on a GPU for real. Every
step comes from :class:`BeamSearchCacheSimulator`; outputs are NaN-poisoned before ``run()``, and later
steps read the K/V the wrapper wrote (``end_step(write_kv=False)``). Tolerance as in
``tests/test_attention.py`` (bf16 ``2e-2``).
"""

from __future__ import annotations

import pytest
import torch

import beam_shared_prefix.attention as attention_module
from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.check import BeamSharedPrefixCheckError
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.prefix import TritonPrefixBackend
from beam_shared_prefix.prefix.select import CASCADE_MAX_MEAN_PROMPT
from beam_shared_prefix.reference import reference_beam_attention, reference_prefix_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator

TOL = 2e-2


def make_sim(device, prompts=(5, 17, 1, 8), beams=3, hq=4, hkv=2, d=64, pg=8, layout="HND", seed=0):
    return BeamSearchCacheSimulator(list(prompts), beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    page_size=pg, max_seq_len=48, kv_layout=layout, dtype=torch.bfloat16,
                                    device=device, seed=seed)


def oracle(sim, step):
    return reference_beam_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                    step.cache_indirection, step.beam_width, new_k=step.new_k, new_v=step.new_v,
                                    kv_layout=sim.kv_layout)


def plan(att, sim, step):
    return att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                    step.beam_width, sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages,
                    torch.bfloat16, key=(tuple(step.request_ids), step.beam_width))


def run(att, sim, step, *, engine_writes_kv=False, divisor=1):
    table = step.beam_page_table if divisor == 1 else sim.block_offsets(step.beam_page_table, divisor)[:, 0, :]
    kw = dict(new_k=step.new_k, new_v=step.new_v)
    if engine_writes_kv:
        for i in range(step.num_rows):
            sim.write_kv(int(step.write_page[i]), int(step.write_slot[i]), step.new_k[i], step.new_v[i])
        kw = {}
    out = torch.full_like(step.q, float("nan"))
    assert att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, out=out,
                   page_index_divisor=divisor, **kw) is out
    return out


def test_is_available_names_its_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = TritonPrefixBackend.is_available("cpu", torch.bfloat16, 128, 16, 8, 32)
    assert not ok and "needs a CUDA device" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonPrefixBackend.is_available("cpu", torch.bfloat16, 128, 16, 8, 32) == (True, "")
    for args, reason in [((torch.float32, 128, 16, 8), "dtype"), ((torch.bfloat16, 96, 16, 8), "head_dim=96"),
                         ((torch.bfloat16, 128, 64, 4), "GQA group 16")]:
        ok, why = TritonPrefixBackend.is_available("cpu", *args, 32)
        assert not ok and reason in why, why


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-buffers"])
def test_prefix_stage_matches_reference(device, graph):
    """``run()`` (the prompt pass alone): output and base-2 LSE; graph mode keeps the table's address."""
    sim = make_sim(device, prompts=(9, 33, 1))
    step = sim.begin_step()
    backend = TritonPrefixBackend(device, use_cuda_graph=graph, max_requests=4, max_beam_width=3, max_prompt_pages=8)
    step_plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3,
                                sim.page_size, sim.num_pages)
    backend.plan(step_plan, sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, torch.bfloat16)
    table_ptr = backend.prompt_page_table.data_ptr()
    out = torch.full_like(step.q, float("nan"))
    lse = torch.full(backend.lse_shape(step.num_rows, sim.num_qo_heads), float("nan"), device=step.q.device)
    _, desc = backend.run(step.q, sim.kv_cache, out, lse)
    want_o, want_lse = reference_prefix_attention(step.q, sim.kv_cache, step.prompt_page_indptr,
                                                  step.prompt_page_indices, step.prompt_lens_per_request, 3)
    assert (desc.layout, desc.base) == ("NH", "log2")
    torch.testing.assert_close(out.float(), want_o.float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(desc.base2_rows_heads(), want_lse.float(), atol=1e-3, rtol=1e-3)
    if graph:
        assert backend.prompt_page_table.shape == (3, 8)
        step_plan2 = build_step_plan([0, 1, 2], [3, 4], [2, 7], 3, sim.page_size, sim.num_pages)
        backend.plan(step_plan2, sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, torch.bfloat16)
        assert backend.prompt_page_table.data_ptr() == table_ptr


@pytest.mark.parametrize(
    "layout, engine_writes_kv, divisor, check",
    [("HND", False, 1, False), ("NHD", True, 6, False), ("HND", False, 1, True)],
    ids=["hnd", "nhd-engine-writes-kv-block-offsets", "hnd-checkmode"],
)
def test_wrapper_runs_the_step_in_one_launch(device, monkeypatch, layout, engine_writes_kv, divisor, check):
    """backend='triton': the fused step over several steps (a request finishes mid-run), prefix pass
    alone only in check mode."""
    calls = {"run": 0, "run_step": 0}
    for name in calls:
        orig = getattr(TritonPrefixBackend, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(TritonPrefixBackend, name, spy)
    sim = make_sim(device, layout=layout, hq=6, hkv=2, seed=3)
    att = BeamSharedPrefixAttention(device, kv_layout=layout, backend="triton", check=check)
    for s in range(5):
        if s == 3:
            sim.finish([sim.requests[1].rid])
        step = sim.begin_step()
        plan(att, sim, step)
        ref = oracle(sim, step)
        out = run(att, sim, step, engine_writes_kv=engine_writes_kv, divisor=divisor)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL, msg=lambda m: f"step {s}: {m}")
        sim.end_step(write_kv=False)
    assert att.backend_name == "triton" and att.num_backend_plans == 2
    assert calls == {"run": 5 if check else 0, "run_step": 5}


def test_torch_tail_uses_the_prompt_pass_then_the_unfused_tail(device):
    sim = make_sim(device, seed=5)
    att = BeamSharedPrefixAttention(device, backend="triton", tail_impl="torch", check=False)
    for _ in range(3):
        step = sim.begin_step()
        plan(att, sim, step)
        torch.testing.assert_close(run(att, sim, step).float(), oracle(sim, step).float(), atol=TOL, rtol=TOL)
        sim.end_step(write_kv=False)


def test_check_mode_names_a_bad_page(device):
    sim = make_sim(device, seed=7)
    for _ in range(2):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention(device, backend="triton", check=True)
    plan(att, sim, step)
    step.beam_page_table[3, 0] = sim.num_pages + 5  # request 1, beam 0: a prompt page the prefix reads
    with pytest.raises(BeamSharedPrefixCheckError, match="outside"):
        run(att, sim, step)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph-mode"])
def test_auto_rule_is_decided_per_side_of_the_prompt_threshold(monkeypatch, graph):
    """Eagerly, the wrapper asks the rule with the batch's mean prompt once per (shape, side of the
    threshold); in CUDA-graph mode once per shape (a captured run() cannot switch kernels), with the
    longest prompt its table serves (twice the one-block limit here; one beam block: judged at that limit)."""
    asked = []

    def resolve(requested, *a, mean_prompt_len=None, beam_width=None, **k):
        assert beam_width == 4
        asked.append(mean_prompt_len)
        return "reference"

    monkeypatch.setattr(attention_module, "resolve_prefix_backend", resolve)
    att = BeamSharedPrefixAttention("cpu", backend="auto", tail_impl="torch", check=False, use_cuda_graph=graph,
                                    max_requests=2, max_beam_width=4,
                                    max_prompt_pages=CASCADE_MAX_MEAN_PROMPT * 2 // 32)
    pg, pages = 32, 4096

    def plan_lens(lens):
        n = [-(-p // pg) for p in lens]
        indptr = [0]
        for k in n:
            indptr.append(indptr[-1] + k)
        att.plan(indptr, list(range(indptr[-1])), lens, 4, 16, 8, 128, pg, pages, torch.bfloat16)

    plan_lens([100, 300])
    plan_lens([120, 300])  # same side: no new decision
    long_prompt = CASCADE_MAX_MEAN_PROMPT * 2
    plan_lens([long_prompt, long_prompt])
    assert asked == ([CASCADE_MAX_MEAN_PROMPT] if graph else [200.0, float(long_prompt)])
