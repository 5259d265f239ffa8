"""BeamSharedPrefixAttention: plan/run over simulated beam search against the float32 oracle.

CPU tests run the reference prefix backend with both tail implementations (the Triton kernel under
``TRITON_INTERPRET=1``, so shapes stay tiny) over several steps with beam reselection and a
request finishing mid-run; they cover plan caching, run() validation and check mode. The GPU test
captures run() in a CUDA graph once and replays it for 20 steps with growing tails.

Every step comes from :class:`BeamSearchCacheSimulator` (random pool, shuffled pages, random beam
parents); outputs are NaN-poisoned before run() so an unwritten element fails, and the simulator's
``end_step(write_kv=False)`` makes later steps read the K/V the wrapper's tail kernel wrote.

Tolerance: bf16/fp16 outputs of unit-variance data (``|out| < 4``), two roundings to the dtype
(prefix output, merged output): ``atol = rtol = 2e-2`` (bf16) / ``5e-3`` (fp16). Reading another
beam's history moves outputs by O(0.1-1): ``test_tolerance_detects_a_wrong_beam`` shows the
tolerance fails it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import beam_shared_prefix
from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.attention import AttentionInputError
from beam_shared_prefix.check import BeamSharedPrefixCheckError
from beam_shared_prefix.plan import PlanError
from beam_shared_prefix.prefix import PrefixBackendError
from beam_shared_prefix.reference import reference_beam_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import shared_run as shared_run_module

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Where the device-flag tests run the Triton tail and cascade: on a GPU where there is one (for real), else on the CPU
# under the interpreter (tests/conftest.py turns it on there); the torch tail stays on the CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel_device(tail_impl):
    return KERNEL_DEVICE if tail_impl == "triton" else "cpu"


def make_sim(prompts=(5, 17, 1), beams=3, hq=4, hkv=2, d=16, pg=4, layout="HND", dtype=torch.bfloat16,
             max_seq_len=40, device="cpu", seed=0):
    return BeamSearchCacheSimulator(
        list(prompts), beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=pg,
        max_seq_len=max_seq_len, kv_layout=layout, dtype=dtype, device=device, seed=seed,
    )


def plan_step(att, sim, step, key="ids", **kw):
    """Plan ``step`` on ``att``; ``key="ids"`` keys the composition by request ids (the engine's way)."""
    k = (tuple(step.request_ids), step.beam_width) if key == "ids" else key
    return att.plan(
        step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, step.beam_width,
        sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages, sim.dtype, key=k, **kw,
    )


def oracle(sim, step):
    return reference_beam_attention(
        step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width, new_k=step.new_k, new_v=step.new_v, kv_layout=sim.kv_layout,
    )


def run_step(att, sim, step, *, engine_writes_kv=False, divisor=1):
    """Poisoned-output run() of one step; returns ``out``."""
    table = step.beam_page_table
    if divisor != 1:
        table = sim.block_offsets(table, divisor)[:, 0, :]  # TensorRT-LLM's K-field view
    kw = dict(new_k=step.new_k, new_v=step.new_v)
    if engine_writes_kv:
        for i in range(step.num_rows):  # the engine stored this step's K/V before attention
            sim.write_kv(int(step.write_page[i]), int(step.write_slot[i]), step.new_k[i], step.new_v[i])
        kw = {}
    out = torch.full_like(step.q, float("nan"))
    result = att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, out=out,
                     page_index_divisor=divisor, **kw)
    assert result is out
    return out


def assert_matches(out, ref, dtype, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN left in out (an element was not written)"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# whole steps (the torch tail on the CPU, the Triton tail on CUDA where present)


@pytest.mark.parametrize(
    "tail_impl, layout, dtype, engine_writes_kv, divisor, check",
    [
        ("torch", "HND", torch.bfloat16, False, 1, True),
        ("triton", "HND", torch.float16, False, 1, False),
        ("triton", "NHD", torch.bfloat16, True, 1, False),
        ("torch", "HND", torch.float16, True, 6, False),
    ],
    ids=["torch-HND-bf16-checkmode", "triton-HND-fp16", "triton-NHD-bf16-engine-writes-kv",
         "torch-HND-fp16-block-offsets-engine-writes-kv"],
)
def test_steps_match_oracle(tail_impl, layout, dtype, engine_writes_kv, divisor, check):
    """Several steps with beam reselection; a request finishes mid-run (re-plan); GQA group 2 and 3."""
    hq, hkv = (4, 2) if layout == "HND" else (6, 2)
    device = _kernel_device(tail_impl)
    sim = make_sim(prompts=(5, 17, 1, 8), beams=3, hq=hq, hkv=hkv, layout=layout, dtype=dtype, device=device)
    att = BeamSharedPrefixAttention(device, kv_layout=layout, backend="reference", tail_impl=tail_impl, check=check,
                                    report_errors=True)
    plans = []
    for s in range(6):
        if s == 3:
            sim.finish([sim.requests[1].rid])
        step = sim.begin_step()
        plans.append(plan_step(att, sim, step))
        ref = oracle(sim, step)
        out = run_step(att, sim, step, engine_writes_kv=engine_writes_kv, divisor=divisor)
        assert_matches(out, ref, dtype, f"step {s}")
        assert _poll_settled(att) == []
        # Later steps read the K/V the tail kernel (or the engine) stored.
        sim.end_step(write_kv=False)
    assert att.device_errors() == []  # valid steps raise no device error flag
    assert att.backend_name == "reference"
    # The tail reads the prefix state in the query's dtype: the dtype the ahead-of-time walk of every tail tiling
    # compiles (tests/triton_kernels/test_tail_merge_compile.py), which float32 state would take past its budget.
    assert att._views["prefix_out"].dtype == dtype
    assert plans[0] is plans[1] is plans[2] and plans[3] is plans[4] is plans[5] and plans[2] is not plans[3]
    assert att.num_backend_plans == 2


def test_tolerance_detects_a_wrong_beam():
    """Beams reading each other's tails differ from the oracle far beyond the tolerance."""
    sim = make_sim(beams=3)
    for _ in range(4):  # grow tails of 4 tokens first
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    ref = oracle(sim, step)
    step.cache_indirection = (step.cache_indirection + 1) % step.beam_width  # every tail from another beam
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False)
    plan_step(att, sim, step)
    out = run_step(att, sim, step)
    assert (out.float() - ref).abs().max() > 5 * TOL[torch.bfloat16]


# --------------------------------------------------------------------------------------------
# plan caching


def test_plan_caching_and_replan_on_composition_change():
    sim = make_sim(prompts=(5, 17, 1))
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False)
    step = sim.begin_step()
    first = plan_step(att, sim, step)
    assert (att.num_backend_plans, att.num_plan_builds) == (1, 1)
    for _ in range(3):  # same key: the same plan object, no planner build, no backend plan
        assert plan_step(att, sim, step) is first
    assert (att.num_backend_plans, att.num_plan_builds) == (1, 1)
    # Without a key the digest of the inputs is the key: the same inputs hit the same plan.
    by_digest = plan_step(att, sim, step, key=None)
    assert plan_step(att, sim, step, key=None) is by_digest
    assert att.num_plan_builds == 2
    sim.end_step()

    keyed = plan_step(att, sim, sim.begin_step())  # composition A again (by key): no re-plan... of the planner
    assert keyed is first
    sim.end_step()
    sim.finish([sim.requests[0].rid])  # a finished request changes the composition
    step = sim.begin_step()
    second = plan_step(att, sim, step)
    assert second is not first and second.num_requests == 2
    builds, backend_plans = att.num_plan_builds, att.num_backend_plans
    assert plan_step(att, sim, step) is second
    assert (att.num_plan_builds, att.num_backend_plans) == (builds, backend_plans)
    out = run_step(att, sim, step)
    assert_matches(out, oracle(sim, step), torch.bfloat16)


def test_plan_validation():
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", max_beam_width=2, check=False)
    with pytest.raises(PlanError, match="max_beam_width=2"):
        plan_step(att, sim, step)  # W=3 > the width the cache was sized for
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    with pytest.raises(AttentionInputError, match="float32"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, 4, 2, 16, 4,
                 sim.num_pages, torch.float32)
    with pytest.raises(AttentionInputError, match="multiple of num_kv_heads=3"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, 4, 3, 16, 4,
                 sim.num_pages, torch.bfloat16)
    for bad, why in ((-1, "max_tail_len=-1 must be >= 0"), (2.5, "max_tail_len=2.5 must be an integer")):
        with pytest.raises(AttentionInputError, match=why):
            plan_step(att, sim, step, max_tail_len=bad)
    with pytest.raises(AttentionInputError, match="run\\(\\) before plan"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection)
    with pytest.raises(AttentionInputError, match="sm_scale='abc' must be a finite positive float"):
        plan_step(att, sim, step, sm_scale="abc")
    with pytest.raises(PlanError, match="beam_width=True must be an integer, not a bool"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, True, 4, 2, 16, 4,
                 sim.num_pages, torch.bfloat16)
    with pytest.raises(PlanError, match=r"key=\[1, 2\] is not hashable"):
        plan_step(att, sim, step, key=[1, 2])
    plan_step(att, sim, step, key="composition")
    with pytest.raises(PlanError, match="key='composition' was planned for beam_width=3, now asked for 2"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 2, 4, 2, 16, 4,
                 sim.num_pages, torch.bfloat16, key="composition")
    triton_tail = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="triton")
    with pytest.raises(AttentionInputError, match="head_dim=24, GQA group 2: .* tail_impl='torch'"):
        triton_tail.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, 4, 2, 24,
                         4, sim.num_pages, torch.bfloat16)
    with pytest.raises(ValueError, match="max_beam_width=2.5 must be an integer"):
        BeamSharedPrefixAttention("cpu", max_beam_width=2.5)
    with pytest.raises(ValueError, match="backend='fast'"):
        BeamSharedPrefixAttention("cpu", backend="fast")
    with pytest.raises(ValueError, match="max_prompt_pages"):
        BeamSharedPrefixAttention("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=4)


def test_a_plan_that_fails_leaves_no_active_plan():
    """A graph-mode wrapper whose second plan grows past its fixed buffers (more query heads) refuses
    that plan, naming the shape, and run() then refuses too, instead of running the old plan's
    buffers with new shapes."""
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False, use_cuda_graph=True, max_requests=3,
                                    max_beam_width=3, max_prompt_pages=8)
    plan_step(att, sim, step)
    with pytest.raises(RuntimeError, match=r"plan of shape \(9, 8, 16\).*a new wrapper for another attention shape"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, step.beam_width,
                 2 * sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages, sim.dtype)
    with pytest.raises(AttentionInputError, match="run\\(\\) before plan\\(\\)"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection,
                new_k=step.new_k, new_v=step.new_v)


def test_graph_mode_flag_holds_each_plans_prompt_digest_in_one_buffer():
    """A CUDA-graph wrapper with the flag keeps the plan's prompt-pages digest (``PLAN_PAGE``'s reference) in a
    buffer sized by ``max_requests`` at the first plan, at one address (a captured graph reads it in place):
    a larger batch later fits, gets its own digest, and a valid step raises no bit."""
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False, use_cuda_graph=True,
                                    max_requests=3, max_beam_width=3, max_prompt_pages=8, report_errors=True)
    small = make_sim(prompts=(5, 17))
    step = small.begin_step()
    plan_step(att, small, step)
    address = att._views["plan_digest"].data_ptr()
    att.run(step.q, small.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k,
            step.new_v)
    big = make_sim(prompts=(9, 2, 30), seed=1)
    step = big.begin_step()
    plan = plan_step(att, big, step)
    assert att._views["plan_digest"].data_ptr() == address
    assert att._views["plan_digest"].tolist() == plan.prompt_pages_digest.tolist()
    att.run(step.q, big.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert att.device_errors() == []


def test_a_plan_refused_at_its_arguments_leaves_no_active_plan():
    """The same where plan() fails at its own checks, before the planner: run() with the new batch's tensors
    refuses instead of serving the previous batch's prompt pages."""
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    plan_step(att, sim, step)
    for bad in (dict(dtype=torch.float32), dict(prompt_page_indices=np.full_like(step.prompt_page_indices, -1))):
        args = dict(prompt_page_indptr=step.prompt_page_indptr, prompt_page_indices=step.prompt_page_indices,
                    prompt_lens=step.prompt_lens_per_request, beam_width=step.beam_width, num_qo_heads=sim.num_qo_heads,
                    num_kv_heads=sim.num_kv_heads, head_dim=sim.head_dim, page_size=sim.page_size,
                    num_cache_pages=sim.num_pages, dtype=sim.dtype)
        args.update(bad)
        with pytest.raises((AttentionInputError, PlanError)):
            att.plan(**args)
        with pytest.raises(AttentionInputError, match="run\\(\\) before plan\\(\\)"):
            att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection,
                    new_k=step.new_k, new_v=step.new_v)
        plan_step(att, sim, step)  # and a good plan serves again


def test_plan_refused_during_graph_capture(monkeypatch):
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(PrefixBackendError, match="captured"):
        plan_step(att, sim, step)


def test_backend_selection_on_cpu():
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="auto", check=False)
    plan_step(att, sim, step)
    assert att.backend_name == "reference"
    for requested in ("flashinfer", "fa4"):
        att = BeamSharedPrefixAttention("cpu", backend=requested, check=False)
        with pytest.raises(PrefixBackendError, match="needs a CUDA device"):
            plan_step(att, sim, step)


def test_auto_rejudges_the_backend_when_the_request_count_changes_it(monkeypatch):
    """Eager ``auto`` caches its choice per answer of the rule, and the cascade's answer depends on the
    request count (few programs at GQA 4: FA4 from 257 tokens; many: the cascade): a batch of 2
    requests and one of 65 with the same prompts must each be judged, with their own count."""
    import beam_shared_prefix.attention as attention_module

    calls = []

    def resolve(requested, *args, num_requests=None, **kw):
        calls.append(num_requests)
        return "reference"

    monkeypatch.setattr(attention_module, "resolve_prefix_backend", resolve)
    att = BeamSharedPrefixAttention("cpu", backend="auto", check=False)
    pg, prompt, hq, hkv, d, w = 32, 300, 8, 2, 128, 16  # GQA 4, one 16-beam block per request
    for requests in (2, 65, 2):
        pages = -(-prompt // pg)
        indptr = [i * pages for i in range(requests + 1)]
        indices = list(range(requests * pages))
        att.plan(indptr, indices, [prompt] * requests, w, hq, hkv, d, pg, requests * pages + 1, torch.bfloat16)
    assert calls == [2, 65]  # the third batch reuses the first answer's choice


@pytest.mark.parametrize("graph,shared_run", [(False, "auto"), (False, "off"), (True, "auto")])
def test_only_cuda_graphs_judge_the_cascade_tail_limit(monkeypatch, graph, shared_run):
    """At MHA (head 128) the cascade's tail limit (``CASCADE_MAX_TAIL``) is a rule for CUDA-graph replays: the
    eager wrapper judges the backend once per composition as ``eager`` and keeps it past the limit (only the
    shared-run stage's threshold, far above, moves it); a CUDA-graph wrapper judges it at its first plan's
    tail, past the limit here, and keeps it."""
    import beam_shared_prefix.attention as attention_module
    from beam_shared_prefix.prefix.select import CASCADE_MAX_TAIL

    calls = []

    def resolve(requested, *args, tail_len=None, shared_run=True, eager=False, **kw):
        calls.append((tail_len, shared_run, eager))
        return "reference"

    monkeypatch.setattr(attention_module, "resolve_prefix_backend", resolve)
    requests, w, prompt, pg, h, d = 2, 4, 100, 32, 2, 128
    pages = -(-prompt // pg)
    caps = dict(max_requests=requests, max_beam_width=w, max_prompt_pages=pages) if graph else {}
    att = BeamSharedPrefixAttention("cpu", backend="auto", check=False, shared_run=shared_run,
                                    use_cuda_graph=graph, **caps)
    limit = CASCADE_MAX_TAIL[(1, d)]
    first = limit + 1 if graph else 1
    for tail in range(first, limit + 4):
        att.plan([0, pages, 2 * pages], list(range(2 * pages)), [prompt] * requests, w, h, h, d, pg, 2 * pages + 1,
                 torch.bfloat16, key="one composition", max_tail_len=tail)
    assert calls == [(first, shared_run != "off", not graph)], calls
    assert att.num_backend_plans == 1


@pytest.mark.parametrize("graph,wrapper_bound,step_tail,rule_bound", [
    (True, None, 4, None),  # a capture without max_tail_len keeps the shared-ancestry path, whatever the first tail
    (True, 8, 4, 16),
    (True, 64, 4, None),  # past CASCADE_SHORT_TAIL the launch is not bounded
    (False, None, 4, 16),  # an eager launch is bounded by its own tail
    (False, 8, 40, None),
])
def test_the_rule_hears_the_launch_tail_bound(monkeypatch, graph, wrapper_bound, step_tail, rule_bound):
    """``auto`` judges the cascade with the tail bound its launch will get (GQA 5-8 at head 128 take it only where
    that bound leaves the shared-ancestry path out): the wrapper's ``max_tail_len`` under CUDA graphs, the step's
    own tail on eager calls (:func:`beam_shared_prefix.prefix.cascade_rule.cascade_tail_bound`)."""
    import beam_shared_prefix.attention as attention_module

    calls = []

    def resolve(requested, *args, tail_bound=None, **kw):
        calls.append(tail_bound)
        return "reference"

    monkeypatch.setattr(attention_module, "resolve_prefix_backend", resolve)
    requests, w, prompt, pg, hq, hkv, d = 2, 4, 100, 32, 16, 2, 128
    pages = -(-prompt // pg)
    caps = {"max_requests": requests, "max_beam_width": w, "max_prompt_pages": pages} if graph else {}
    att = BeamSharedPrefixAttention("cpu", backend="auto", check=False, use_cuda_graph=graph,
                                    max_tail_len=wrapper_bound, **caps)
    att.plan([0, pages, 2 * pages], list(range(2 * pages)), [prompt] * requests, w, hq, hkv, d, pg, 2 * pages + 1,
             torch.bfloat16, max_tail_len=step_tail)
    assert calls == [rule_bound], calls


@pytest.mark.parametrize("check", [False, True])
def test_shared_run_stage_serves_coalesced_steps(check, monkeypatch):
    """With ``shared_run`` the two-launch path puts the shared-run stage between the prefix and the tail:
    steps whose beams descend from one ancestor for their first generated positions (then diverge) match
    the oracle, and the stage did take runs (the tail skipped positions); in check mode too. (The stage looks
    for runs from 4 cached positions here, not 32, to keep the steps short.)"""
    monkeypatch.setattr(shared_run_module, "SHARED_RUN_MIN_CACHED_TAIL", 4)
    sim = make_sim(prompts=(9, 30), beams=5, hq=4, hkv=2, d=64, pg=8, max_seq_len=48, seed=5, device=KERNEL_DEVICE)
    att = BeamSharedPrefixAttention(KERNEL_DEVICE, backend="reference", tail_impl="triton", check=check,
                                    report_errors=True, shared_run=True)
    longest_skip = 0
    for s in range(12):
        step = sim.begin_step()
        plan_step(att, sim, step)
        ref = oracle(sim, step)
        out = run_step(att, sim, step)
        assert_matches(out, ref, sim.dtype, f"step {s}")
        longest_skip = max(longest_skip, int(att._views["tail_skip"].max()))
        shared = np.zeros((len(sim.requests), sim.beam_width), np.int64) if s < 6 else None
        sim.end_step(parents=shared, write_kv=False)
    assert longest_skip >= 5, longest_skip
    assert att.device_errors() == []


@pytest.mark.parametrize("bad_len", [-40, -2**31 + 1])
@pytest.mark.parametrize("path", ["cascade", "shared_run"])
def test_a_beam_length_below_its_prompt_beside_long_tails_reads_nothing_outside(path, bad_len, monkeypatch):
    """One beam's kv_len below its prompt (the flag names it) while its request's other beams cache tails long
    enough for the run every beam shares (the cascade's shared-ancestry scan; the shared-run stage): the scan's end
    sits below its start, and far below it the int32 difference wraps. Nothing is read before the page table or
    cache_indirection (each given as a view into a buffer whose leading guard is set two ways: every output equal),
    every output is finite, and the other request's rows match the oracle."""
    monkeypatch.setattr(shared_run_module, "SHARED_RUN_MIN_CACHED_TAIL", 4)
    W = 3
    sim = make_sim(prompts=(5, 9), beams=W, hq=4, hkv=2, d=64, pg=4, max_seq_len=24, seed=2, device=KERNEL_DEVICE)
    for _ in range(2):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    backend = "triton" if path == "cascade" else "reference"
    att = BeamSharedPrefixAttention(KERNEL_DEVICE, backend=backend, tail_impl="triton", check=False,
                                    report_errors=True, shared_run=path == "shared_run")
    plan_step(att, sim, step)
    assert att.backend_name == backend
    kv_lens = step.kv_lens.clone()
    kv_lens[:W] = torch.tensor([24, bad_len, 24], dtype=torch.int32)  # request 0: beam 1 invalid, 0 and 2 long

    def guarded(x, value, guard=64):
        buf = torch.empty(guard + x.numel(), dtype=x.dtype, device=x.device)
        buf[:guard] = value
        buf[guard:] = x.reshape(-1)
        return buf[guard:].view(x.shape)

    outs = []
    for page in (0, 1):
        pool = sim.kv_cache.clone()
        outs.append(att.run(step.q, pool, guarded(step.beam_page_table, page), kv_lens,
                            guarded(step.cache_indirection, page), step.new_k, step.new_v).float())
    assert any("kv_len" in e for e in att.device_errors())
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    if path == "shared_run":  # the run the stage found stays within request 0's cached tail (no wrapped length)
        assert 0 <= int(att._views["tail_skip"][:W].min()) <= int(att._views["tail_skip"][:W].max()) <= 24 - 1 - 5
    ref = oracle(sim, step)
    assert_matches(outs[0][W:], ref[W:], sim.dtype, "request 1")


@pytest.mark.parametrize("mode,graph", [("auto", False), ("auto", True), ("on", False), ("off", False)])
def test_shared_run_follows_the_tail(monkeypatch, mode, graph):
    """``shared_run="auto"`` launches the shared-run stage from the plan whose ``max_tail_len`` reaches
    ``SHARED_RUN_MIN_TAIL`` (lowered here to keep the interpreter's steps short): within one composition the
    stage switches on without a backend re-plan, and every step matches the oracle. ``"on"`` runs it on every
    step, ``"off"`` on none; under CUDA graphs the first plan's verdict is kept (here: a short tail, so
    never)."""
    from beam_shared_prefix.prefix import cascade_rule

    monkeypatch.setattr(cascade_rule, "SHARED_RUN_MIN_TAIL", 5)
    monkeypatch.setattr(shared_run_module, "SHARED_RUN_MIN_CACHED_TAIL", 4)
    sim = make_sim(prompts=(9, 30), beams=5, hq=4, hkv=2, d=64, pg=8, max_seq_len=48, seed=7, device=KERNEL_DEVICE)
    caps = dict(max_requests=2, max_beam_width=5, max_prompt_pages=4) if graph else {}
    att = BeamSharedPrefixAttention(KERNEL_DEVICE, backend="reference", tail_impl="triton", check=False,
                                    shared_run=mode, use_cuda_graph=graph, **caps)
    assert att.shared_run == mode
    active, plans, skipped = [], [], 0
    for s in range(9):
        step = sim.begin_step()
        longest_tail = int((step.kv_lens - step.prompt_lens).max())
        assert longest_tail == s + 1
        plan_step(att, sim, step, max_tail_len=longest_tail)
        active.append(att.shared_stage_active)
        plans.append(att.num_backend_plans)
        out = run_step(att, sim, step)
        assert_matches(out, oracle(sim, step), sim.dtype, f"step {s}")
        if att.shared_stage_active:
            skipped = max(skipped, int(att._views["tail_skip"].max()))
        sim.end_step(parents=np.zeros((len(sim.requests), sim.beam_width), np.int64), write_kv=False)
    expected = {"auto": [t >= 5 for t in range(1, 10)], "on": [True] * 9, "off": [False] * 9}[mode]
    if graph:
        expected = [False] * 9
    assert active == expected
    assert plans == [1] * 9, plans  # one composition: the stage switching on re-plans no backend
    assert (skipped > 0) == any(expected), skipped


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_CHECK", "1")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "reference")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_SHARED_RUN", "1")
    att = BeamSharedPrefixAttention("cpu")
    assert att.check and att.requested_backend == "reference" and att.shared_run == "on"
    monkeypatch.delenv("TLLM_BEAM_SHARED_PREFIX_SHARED_RUN")
    assert BeamSharedPrefixAttention("cpu").shared_run == "auto"
    with pytest.raises(ValueError, match="shared_run='sometimes' is not accepted"):
        BeamSharedPrefixAttention("cpu", shared_run="sometimes")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_CHECK", "0")
    assert not BeamSharedPrefixAttention("cpu").check
    assert beam_shared_prefix.BeamSharedPrefixAttention is BeamSharedPrefixAttention


# --------------------------------------------------------------------------------------------
# run() validation


def _mutations(sim, step):
    rows, hq, d = step.q.shape
    other = torch.zeros_like(sim.kv_cache)
    return {
        "q rows": (dict(q=step.q[:-1]), "R\\*W=3\\*3=9"),
        "q dtype": (dict(q=step.q.half()), "q has dtype float16"),
        "q strided head dim": (dict(q=step.q.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        "pool layout": (dict(kv_cache=other.transpose(2, 3)), "check kv_layout"),
        "pool pages": (dict(kv_cache=other[:-1]), "re-plan with the current pool"),
        "pool dtype": (dict(kv_cache=other.half()), "kv_cache has dtype float16"),
        "table dtype": (dict(beam_page_table=step.beam_page_table.long()), "int32"),
        "kv_lens length": (dict(kv_lens=step.kv_lens[:-1]), "one per beam row"),
        "kv_lens strided": (dict(kv_lens=torch.stack([step.kv_lens, step.kv_lens], 1)[:, 0]), "kv_lens has stride 2"),
        "indirection width": (dict(cache_indirection=step.cache_indirection[:, :2]), ">= W=3"),
        "new_k alone": (dict(new_k=step.new_k, new_v=None), "both new_k and new_v"),
        "new_k heads": (dict(new_k=step.new_k[:, :1], new_v=step.new_v[:, :1]), "Hkv=2"),
        "out shape": (dict(out=torch.empty(rows, hq, d + 1, dtype=step.q.dtype)), "out must be"),
        "divisor": (dict(page_index_divisor=0), "page_index_divisor=0"),
    }


def _after_a_valid_run():
    """``(sim, step, wrapper, run() arguments)`` after one valid ``run()`` of a fresh planned step."""
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    plan_step(att, sim, step)
    args = dict(q=step.q, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table, kv_lens=step.kv_lens,
                cache_indirection=step.cache_indirection, new_k=step.new_k, new_v=step.new_v)
    att.run(**args)
    return sim, step, att, args


@pytest.mark.parametrize("case", list(_mutations(make_sim(), make_sim().begin_step())))
def test_run_validation_errors(case):
    """Each bad argument fails, every time, after a valid call."""
    sim, step, att, args = _after_a_valid_run()
    change, message = _mutations(sim, step)[case]
    args.update(change)
    for _ in range(2):
        with pytest.raises(AttentionInputError, match=message):
            att.run(**args)


@pytest.mark.parametrize("case", ["out rows overlap", "pool K and V alias", "pool pages overlap", "divisor past int32"])
def test_run_refuses_layouts_whose_writes_collide(case):
    """Layouts no shape check sees: an ``out`` whose rows share memory, a pool whose K and V planes or
    pages overlap (each passes every shape and dtype check; the kernels would write over their own
    output or read K and V from one memory), a page divisor past the kernels' int32."""
    from triton_kernels.step_args import KernelInputError

    sim, step, att, args = _after_a_valid_run()
    rows, hq, d = step.q.shape
    pool = sim.kv_cache
    if case == "out rows overlap":
        args["out"] = torch.empty(1, hq, d, dtype=step.q.dtype).expand(rows, hq, d)
        error, message = KernelInputError, r"out of shape .* overlap in memory"
    elif case == "pool K and V alias":
        args["kv_cache"] = pool[:, :1].expand(-1, 2, -1, -1, -1)
        error, message = KernelInputError, r"kv_cache of shape .* overlap in memory"
    elif case == "pool pages overlap":
        flat = pool.flatten()
        args["kv_cache"] = flat.as_strided(pool.shape, (pool.stride(0) // 2,) + pool.stride()[1:])
        error, message = KernelInputError, r"kv_cache of shape .* overlap in memory"
    else:
        args["page_index_divisor"] = 2**31
        error, message = AttentionInputError, r"page_index_divisor=2147483648 must be an int in \[1, 2147483647\]"
    kv_before = sim.kv_cache.clone()
    with pytest.raises(error, match=message):
        att.run(**args)
    assert torch.equal(sim.kv_cache, kv_before)  # refused before any write


def test_run_checks_are_judged_against_the_current_plan():
    """``run()`` judges its arguments against the current plan and layout: after a valid call, a plan for fewer
    requests refuses the first batch's q, and a wrapper on the other KV layout refuses the same pool view."""
    sim, step, att, args = _after_a_valid_run()
    indptr, indices = step.prompt_page_indptr, step.prompt_page_indices
    att.plan(indptr[1:] - indptr[1], indices[int(indptr[1]):], step.prompt_lens_per_request[1:], step.beam_width,
             sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages, sim.dtype,
             key=(tuple(step.request_ids[1:]), step.beam_width))
    with pytest.raises(AttentionInputError, match="re-plan when the batch changes"):
        att.run(**args)
    assert sim.kv_layout == "HND" and sim.num_kv_heads != sim.page_size
    other_layout = BeamSharedPrefixAttention("cpu", backend="reference", check=False, kv_layout="NHD")
    plan_step(other_layout, sim, step)
    with pytest.raises(AttentionInputError, match="check kv_layout='NHD'"):
        other_layout.run(**args)


# --------------------------------------------------------------------------------------------
# check mode


def _check_setup():
    sim = make_sim()
    for _ in range(2):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=True)
    plan_step(att, sim, step)
    return sim, step, att


def test_check_mode_passes_correct_results_and_stops_on_a_wrong_prefix(monkeypatch):
    sim, step, att = _check_setup()
    run_step(att, sim, step)  # correct: no error
    backend = att.backend
    real_run = backend._run

    def wrong_prefix(q, kv_cache, out, lse):
        o, desc = real_run(q, kv_cache, out, lse)
        o[2, 1] += 0.5  # one head of one row off
        return o, desc

    monkeypatch.setattr(backend, "_run", wrong_prefix)  # the backend's launch, behind run()'s checks
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'prefix'.*prefix output") as info:
        run_step(att, sim, step)
    assert info.value.stage == "prefix"


def test_check_mode_catches_a_non_finite_prefix_lse(monkeypatch):
    sim, step, att = _check_setup()
    backend = att.backend
    real_run = backend._run

    def nan_lse(q, kv_cache, out, lse):
        o, desc = real_run(q, kv_cache, out, lse)
        desc.tensor[1, 0] = float("nan")
        return o, desc

    monkeypatch.setattr(backend, "_run", nan_lse)  # the backend's launch, behind run()'s checks
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'prefix'.*non-finite"):
        run_step(att, sim, step)


def test_check_mode_catches_a_wrong_tail(monkeypatch):
    sim, step, att = _check_setup()
    real_tail = att._tail_function()

    def wrong_tail(*args, **kwargs):
        out = real_tail(*args, **kwargs)
        out[-1] = 0.0
        return out

    monkeypatch.setattr(att, "_tail_function", lambda: wrong_tail)
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'tail'.*attention output"):
        run_step(att, sim, step)


def test_check_mode_catches_a_missing_kv_write(monkeypatch):
    sim, step, att = _check_setup()
    real_tail = att._tail_function()
    monkeypatch.setattr(att, "_tail_function",
                        lambda: (lambda *a, **kw: real_tail(*a, **{**kw, "write_kv": False})))
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'tail'.*was not stored"):
        run_step(att, sim, step)


def test_check_mode_catches_a_page_outside_the_pool():
    sim, step, att = _check_setup()
    table = step.beam_page_table.clone()
    table[3, 0] = sim.num_pages + 3  # request 1, beam 0: a prompt page the prefix reads
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'indices'.*outside the pool") as info:
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert info.value.stage == "indices"
    bad_ind = step.cache_indirection.clone()
    pos = int(step.prompt_lens[0])
    bad_ind[0, 1, pos] = 7  # beam 7 of 3
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'indices'.*not a beam"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, bad_ind, step.new_k, step.new_v)


@pytest.mark.parametrize("change", ["prompt length", "prompt page", "page count"])
def test_check_mode_holds_a_key_to_its_inputs(change):
    """A caller's key is taken on trust (a hit does no array work); a key reused after the prompt changed
    would read the old plan's positions. Check mode compares the hit's plan with the inputs and names the
    difference, while the unchanged inputs pass."""
    sim, step, att = _check_setup()
    plan_step(att, sim, step)  # a hit with the same inputs
    indptr, indices = step.prompt_page_indptr.clone(), step.prompt_page_indices.clone()
    lens = step.prompt_lens_per_request.clone()
    if change == "prompt length":
        r = int(torch.nonzero(lens % sim.page_size != 0)[0])  # one token longer, on as many pages
        lens[r] += 1
        match = rf"prompt length of request {r}: \d+ in the key's plan"
    elif change == "prompt page":
        indices[int(indptr[1])] = (indices[int(indptr[1])] + 1) % sim.num_pages
        match = r"prompt page of request 1, flat index"
    else:
        lens[1] += sim.page_size
        free = min(set(range(sim.num_pages)) - set(step.beam_page_table.flatten().tolist()))
        indices = torch.cat([indices[: int(indptr[2])], indices.new_tensor([free]), indices[int(indptr[2]):]])
        indptr[2:] += 1
        match = r"request 1 has \d+ prompt pages in the key's plan"
    key = (tuple(step.request_ids), step.beam_width)
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"stage 'plan'.*{match}.*equal keys must mean equal"):
        att.plan(indptr, indices, lens, step.beam_width, sim.num_qo_heads, sim.num_kv_heads, sim.head_dim,
                 sim.page_size, sim.num_pages, sim.dtype, key=key)
    assert att.active_plan is None


def test_check_mode_catches_a_table_the_plan_does_not_match():
    """A prompt page inside the pool but not the plan's (a plan from another batch, a table in another
    encoding): the prefix would read the plan's pages, the tail and the KV write the table's."""
    sim, step, att = _check_setup()
    W = step.beam_width
    table = step.beam_page_table.clone()
    table[W, 0] = (table[W, 0] + 1) % sim.num_pages  # request 1, beam 0, first prompt page
    kv_before = sim.kv_cache.clone()
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*beam_page_table\[{W}, 0\].*prompt page 0 of request 1"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert torch.equal(sim.kv_cache, kv_before)  # stopped before any kernel wrote


def test_check_mode_catches_a_write_onto_shared_kv():
    """This step's K/V written onto another request's prompt page, or two beams writing one slot, would
    overwrite K/V that other rows read in this and every later step, and the oracle reads the same pool:
    the index stage refuses both before any kernel runs. Beams whose lengths differ are refused too (a
    beam reading another's position past that beam's length reads a slot written in this step)."""
    sim, step, att = _check_setup()
    W, pg = step.beam_width, sim.page_size
    row = W + 1  # request 1, beam 1
    col = int(step.kv_lens[row] - 1) // pg
    kv_before = sim.kv_cache.clone()
    table = step.beam_page_table.clone()
    table[row, col] = int(step.prompt_page_indices[int(step.prompt_page_indptr[2])])  # request 2's first prompt page
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"stage 'indices'.*row {row} .*a prompt page of request 2"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    table = step.beam_page_table.clone()
    table[row + 1, col] = table[row, col]  # beam 2 writes where beam 1 does
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"rows {row} and {row + 1} both write"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    kv_lens = step.kv_lens.clone()
    kv_lens[row] -= 1
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"kv_lens\[{row}\]=.*differs from beam 0's"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert torch.equal(sim.kv_cache, kv_before)
    # Columns no kernel reads (a beam other than 0, inside the prompt) may hold anything.
    table = step.beam_page_table.clone()
    table[row, 0] = -7
    out = att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    torch.testing.assert_close(out.float(), oracle(sim, step).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("entry,source,message", [
    ((1, 2), (2, 1), (r"row 1 \(request 0, beam 1\) writes .* into page \d+ \(its column 2\), which row 2 "
                      r"\(request 0, beam 2\) also holds at column 1")),
    ((1, 2), (1, 1), (r"row 1 \(request 0, beam 1\) writes .* \(its column 2\), which the same row also holds at "
                      r"column 1")),
    ((1, 2), (7, 0), r"row 1 \(request 0, beam 1\) writes .* which row 7 \(request 2, beam 1\) also holds at column 0"),
    ((2, 1), (1, 1), (r"row 1 \(request 0, beam 1\) holds page \d+ at column 1, .* and row 2 \(request 0, beam 2\) "
                      r"also holds it at column 1")),
    ((1, 1), (0, 1), (r"row 0 \(request 0, beam 0\) holds page \d+ at column 1, .* and row 1 \(request 0, beam 1\) "
                      r"also holds it at column 1")),
    ((2, 1), (0, 0), r"row 2 \(request 0, beam 2\) holds page \d+ at column 1, .* it is a prompt page of request 0"),
], ids=["write-on-other-beams", "write-on-own-earlier", "write-on-other-requests", "copies-shared",
        "beam0s-partial-page-shared", "copy-on-its-prompt-page"])
def test_check_mode_catches_a_page_held_twice_past_the_prompt(entry, source, message):
    """From its prompt's partly filled last page on, each beam holds its own pages (its copy of that page, then
    one page a generated column): the K/V of its own positions, which beams read through ``cache_indirection``.
    A page held twice there (a write page another row or column holds, two beams on one copy, a beam on beam 0's
    partly filled prompt page after its first generated token) or one of its request's full prompt pages held
    there keeps two positions in one slot, with every index inside the pool and no slot written twice in the step:
    check mode refuses it before any kernel writes."""
    sim = make_sim()
    for _ in range(6):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()  # request 0: a 5-token prompt, position 11 (column 2); request 2: a 1-token prompt
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=True)
    plan_step(att, sim, step)
    W, pg = step.beam_width, sim.page_size
    assert int(step.kv_lens[1] - 1) // pg == 2 and int(step.prompt_lens[1]) // pg == 1
    assert int(step.kv_lens[2 * W + 1] - 1) // pg == 1 and int(step.prompt_lens[2 * W + 1]) == 1
    run_step(att, sim, step)  # the table as the simulator keeps it passes
    table = step.beam_page_table.clone()
    table[entry] = table[source]
    kv_before = sim.kv_cache.clone()
    with pytest.raises(BeamSharedPrefixCheckError, match=f"stage 'indices'.*{message}"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert torch.equal(sim.kv_cache, kv_before)


@pytest.mark.parametrize("edit,message", [
    (lambda kv, plen, cap: kv.__setitem__(4, int(plen[4])),  # the prompt alone: the length printed twice
     r"kv_lens\[4\]=(\d+) but the plan's prompt length of row 4 is \1: .* \(>= \d+\)"),
    (lambda kv, plen, cap: kv[3:6].fill_(cap + 1), r"kv_lens\[3\]=\d+ exceeds the cache capacity of \d+ positions"),
    (lambda kv, plen, cap: kv.__setitem__(5, int(kv[5]) - 1),
     r"kv_lens\[5\]=\d+ \(request 1, beam 2\) differs from beam 0"),
], ids=["under-the-prompt", "past-the-cache", "beams-apart"])
def test_check_mode_names_a_kv_length_no_beam_search_produces(edit, message):
    """Check mode's ``"indices"`` stage holds ``kv_lens`` to the rules of :mod:`beam_shared_prefix.kv_lens`: each row
    counts its prompt and this step's token, fits its cache, and moves with its request's beam 0."""
    sim, step, att = _check_setup()
    kv_lens = step.kv_lens.clone()
    capacity = min(step.cache_indirection.shape[2], step.beam_page_table.shape[1] * sim.page_size)
    edit(kv_lens, step.prompt_lens, capacity)
    with pytest.raises(BeamSharedPrefixCheckError, match=f"stage 'indices'.*{message}"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, kv_lens, step.cache_indirection, step.new_k, step.new_v)


def test_check_mode_takes_copies_of_one_request_as_one():
    """A padded CUDA-graph batch repeats one dummy request: its copies list the same pages and write the
    same slots, which is one request's write, not a collision (nor a write onto another's prompt page)."""
    from beam_shared_prefix.check import check_indices
    from beam_shared_prefix.plan import build_step_plan

    # request 0: a 5-token prompt on pages 0-1; requests 1 and 2: copies of a one-token dummy on page 2.
    plan = build_step_plan([0, 2, 3, 4], [0, 1, 2, 2], [5, 1, 1], 2, 4, 16)
    table = torch.tensor([[0, 1], [0, 3], [2, 5], [4, 6], [2, 5], [4, 6]], dtype=torch.int32)
    kv_lens = torch.tensor([7, 7, 2, 2, 2, 2], dtype=torch.int32)
    pool = torch.zeros(16, 2, 1, 4, 8, dtype=torch.bfloat16)
    check_indices(plan, pool, 4, table, kv_lens, torch.zeros(3, 2, 8, dtype=torch.int32))
    table[1, 1] = 1  # request 0's beam 1 onto beam 0's partly filled prompt page: refused
    with pytest.raises(BeamSharedPrefixCheckError, match="row 1 .* a prompt page of request 0"):
        check_indices(plan, pool, 4, table, kv_lens, torch.zeros(3, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("bad_len", [0, 10_000])
def test_engine_written_kv_with_an_invalid_length_fails_clearly(bad_len):
    """``new_k=None`` reads this step's K/V back from the cache at ``kv_len - 1``: an invalid length is
    clamped there (no index error, which on a GPU would be a device-side assert) and check mode names it."""
    sim, step, att = _check_setup()
    kv_lens = step.kv_lens.clone()
    kv_lens[1] = bad_len
    with pytest.raises(BeamSharedPrefixCheckError, match=r"stage 'indices'.*kv_lens\[1\]"):
        att.run(step.q, sim.kv_cache, step.beam_page_table, kv_lens, step.cache_indirection)
    att.check = False
    out = att.run(step.q, sim.kv_cache, step.beam_page_table, kv_lens, step.cache_indirection)
    assert out.shape == step.q.shape


def _flagged_setup(tail_impl, steps=3):
    """The ``steps``-th step (from the third: earlier generated tokens to gather) planned on a wrapper with the
    device error flag and without check mode: ``(sim, step, att)``."""
    device = _kernel_device(tail_impl)
    sim = make_sim(device=device)
    for _ in range(steps - 1):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention(device, backend="reference", tail_impl=tail_impl, check=False, report_errors=True)
    plan_step(att, sim, step)
    return sim, step, att


def _poll_settled(att):
    """``poll_device_errors`` once the queued work has finished. On CUDA a poll reads the copy of the flag
    that the previous poll queued (it never waits), so this polls, waits for the device, and polls again;
    elsewhere one poll reads the flag itself."""
    if att.error_flags.device.type != "cuda":
        return att.poll_device_errors()
    early = att.poll_device_errors()
    torch.cuda.synchronize(att.error_flags.device)
    return early + att.poll_device_errors()


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
def test_bad_indices_without_check_mode_raise_the_device_flag(tail_impl):
    """Without check mode nothing syncs: a row whose write slot has no page, or an indirection entry
    that is not a beam, is masked by the kernel and reported through the device error flag, each kind
    once by ``poll_device_errors`` and all of them by ``device_errors`` (which resets the flag). On CUDA
    a poll sees a kind one poll late: the first poll after the bad run returns nothing yet."""
    sim, step, att = _flagged_setup(tail_impl)
    table = step.beam_page_table.clone()
    table[4, int(step.kv_lens[4] - 1) // sim.page_size] = -1  # row 4 has no page for this step's token
    bad_ind = step.cache_indirection.clone()
    bad_ind[0, 1, int(step.prompt_lens[0])] = 7  # beam 7 of 3
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    if att.error_flags.device.type == "cuda":
        torch.cuda.synchronize(att.error_flags.device)
        assert att.poll_device_errors() == []  # no earlier poll queued a copy to read
    # (beams that read their generated positions 16-18 from row 4's page see the same -1)
    first = _poll_settled(att)
    assert [m for m in first if "write slot" in m and "K/V not written" in m], first
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, bad_ind, step.new_k, step.new_v)
    (second,) = _poll_settled(att)  # only the new kind
    assert "cache_indirection entry outside [0, beam_width)" in second
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert _poll_settled(att) == []  # kinds already reported
    assert sorted(att.device_errors()) == sorted(first + [second]) and att.device_errors() == []
    off = BeamSharedPrefixAttention(step.q.device, backend="reference", tail_impl=tail_impl)  # the default: no flag
    assert off.error_flags is None and off.device_errors() == [] and off.poll_device_errors() == []


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
@pytest.mark.parametrize("bad_len", [1, 2**31 - 1])
def test_bad_lengths_without_check_mode_raise_the_device_flag(tail_impl, bad_len):
    """``kv_len == 1`` on a row planned with a longer prompt is not a padding row's (those are planned with
    a one-token prompt); ``INT32_MAX`` is past the cache. Both are masked and flagged; the torch tail sizes
    its gather by the cache, not by the bad length (which would allocate rows x 2**31 entries)."""
    sim, step, att = _flagged_setup(tail_impl)
    assert int(step.prompt_lens[3]) > 1
    kv_lens = step.kv_lens.clone()
    kv_lens[3] = bad_len
    out = att.run(step.q, sim.kv_cache, step.beam_page_table, kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert torch.isfinite(out.float()).all()
    assert [m for m in att.device_errors() if "kv_len" in m], bad_len


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
@pytest.mark.parametrize("engine_wrote_kv", [False, True])
def test_a_beam_writing_onto_beam0s_prompt_page_raises_the_flag(tail_impl, engine_wrote_kv):
    """Beam 1 of request 0 given beam 0's copy of the prompt's partly filled last page (a table that shares
    it among beams, as block reuse must not): every index is inside the pool, so only the beams' agreement
    sees it. Without check mode the flag names it (and the held page); check mode refuses the step."""
    sim, step, att = _flagged_setup(tail_impl)
    col = int(step.kv_lens[1] - 1) // sim.page_size
    assert int(step.prompt_lens[0]) // sim.page_size == col and int(step.prompt_lens[0]) % sim.page_size
    table = step.beam_page_table.clone()
    table[1, col] = table[0, col]
    new_kv = () if engine_wrote_kv else (step.new_k, step.new_v)
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, *new_kv)
    shared, held = att.device_errors()  # (in bit order; each row's write page is held by the other row too)
    assert "beam 0's page of the same page-table column" in shared, shared
    assert "is held elsewhere in its request" in held, held
    att.check = True
    with pytest.raises(BeamSharedPrefixCheckError, match=r"row 1 \(request 0, beam 1\) writes .* a prompt page"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, *new_kv)


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
@pytest.mark.parametrize("case,check_message", [
    ("two_beams_share", r"rows 4 and 5 both write this step's K/V to page"),
    ("on_full_prompt_page", r"row 4 \(request 1, beam 1\) writes .* a prompt page of request 1"),
    ("held_at_earlier_column", (r"row 4 \(request 1, beam 1\) writes .* which row 5 \(request 1, beam 2\) also holds "
                                r"at column 5")),
    ("own_column_mid_page", r"row 4 \(request 1, beam 1\) writes .* which the same row also holds at column 5"),
])
def test_a_write_page_held_elsewhere_in_the_request_raises_the_flag(tail_impl, case, check_message):
    """Request 1's beams 1 and 2 given one write page, or beam 1's write slot on the request's first prompt page
    (a full page every beam reads), or (at the eighth step, the first token of the request's third generated page)
    beam 1's write page held by beam 2 at the column before, or (at the tenth, that page's third token) by beam 1
    itself at the column before: no index is out of the pool and no beam is on beam 0's page of its column. Without
    check mode the page-table audit names it, and the same step with the table as given raises nothing; check mode
    refuses the step."""
    earlier, mid_page = case == "held_at_earlier_column", case == "own_column_mid_page"
    sim, step, att = _flagged_setup(tail_impl, steps=8 if earlier else 10 if mid_page else 3)
    col = int(step.kv_lens[3] - 1) // sim.page_size
    assert int(step.prompt_lens[3]) == 17 and col == (4 if case in ("two_beams_share", "on_full_prompt_page") else 6)
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert att.device_errors() == []
    table = step.beam_page_table.clone()
    if case == "two_beams_share":
        table[5, col] = table[4, col]
    elif earlier:
        assert int(step.kv_lens[4] - 1) == col * sim.page_size  # the write page's first token
        table[4, col] = table[5, col - 1]
    elif mid_page:
        assert int(step.kv_lens[4] - 1) == col * sim.page_size + 2  # the write page's third token
        table[4, col] = table[4, col - 1]  # (so the page's first two tokens were written there too)
    else:
        table[4, col] = table[3, 0]
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    (message,) = att.device_errors()
    assert "write page (position kv_len - 1) is held elsewhere in its request" in message, message
    att.check = True
    with pytest.raises(BeamSharedPrefixCheckError, match=check_message):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
def test_a_write_page_another_request_holds_raises_the_flag(tail_impl):
    """Request 1's beam 1 given request 0's beam 2's copy of its prompt's partly filled page (a block handed out
    twice): every index is in the pool and no page is shared inside a request, so only the page-table audit sees it.
    Without check mode the flag names it, and the same step with the table as given raises nothing; check mode refuses
    the step."""
    sim, step, att = _flagged_setup(tail_impl, steps=4)
    col = int(step.kv_lens[4] - 1) // sim.page_size
    other_col = int(step.kv_lens[2] - 1) // sim.page_size - 1
    assert other_col >= int(step.prompt_lens[2]) // sim.page_size
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert att.device_errors() == []
    table = step.beam_page_table.clone()
    table[4, col] = table[2, other_col]
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    (message,) = att.device_errors()
    assert "held by a row of another request" in message, message
    att.check = True
    with pytest.raises(BeamSharedPrefixCheckError, match=r"row 4 \(request 1, beam 1\) writes .* row 2 \(request 0"):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
def test_the_page_table_audit_runs_once_a_step(tail_impl, monkeypatch):
    """The audit rides with the first layer the wrapper served (its pool view) and with the first run() after each
    plan() if that layer has not run: two layers over two plans, in either order, audit once a step, never in the
    other layer's runs. Without the flag, or with ``page_table_audit=False``, nothing is audited."""
    import triton_kernels
    from triton_kernels import device_errors

    audits = []

    def counted(real):
        def audit(*args, **kwargs):
            audits.append(kwargs.get("beam_width", args[3] if len(args) > 3 else None))
            return real(*args, **kwargs)
        return audit

    monkeypatch.setattr(triton_kernels, "audit_page_table", counted(triton_kernels.audit_page_table))
    monkeypatch.setattr(device_errors, "write_page_rules_bad_torch",
                        counted(device_errors.write_page_rules_bad_torch))
    sim, step, att = _flagged_setup(tail_impl)
    layers = [sim.kv_cache, sim.kv_cache.clone()]  # two layers' pool views (distinct addresses)

    def run(layer):
        att.run(step.q, layers[layer], step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k,
                step.new_v)
        return len(audits)

    assert [run(0), run(1), run(0)] == [1, 1, 2]  # layer 0 audits; a run of it with no plan between is a step too
    plan_step(att, sim, step)
    assert [run(1), run(0), run(1)] == [3, 4, 4]  # the first run after plan() audits, and layer 0 still does
    assert audits == [step.beam_width] * 4 and att.device_errors() == []
    for kwargs in (dict(), dict(report_errors=True, page_table_audit=False)):  # no flag; the flag without the audit
        off = BeamSharedPrefixAttention(step.q.device, backend="reference", tail_impl=tail_impl, check=False,
                                        **kwargs)
        plan_step(off, sim, step)
        off.run(step.q, layers[0], step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
        assert len(audits) == 4 and off.device_errors() == []


def test_the_audit_workspace_starts_over_before_its_stamp_wraps(monkeypatch):
    """The audit's stamp, an int32 the audit advances on the device, would wrap after 2**31 audits: the wrapper zeroes
    the holders and sets the stamp back to 1, at the same addresses, at the plan() where plan() calls and audited runs
    reach ``AUDIT_RESTART`` (here 4), and the audits after it still judge: a valid step raises nothing, and a write page
    another request holds raises its bit."""
    import beam_shared_prefix.attention as attention_module

    monkeypatch.setattr(attention_module, "AUDIT_RESTART", 4)
    sim, step, att = _flagged_setup("triton", steps=4)  # one plan()
    workspace = att._audit_workspace

    def run(table=step.beam_page_table):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)

    run()
    run()
    assert workspace.audit_state.tolist() == [3] and workspace.page_holders.any()
    plan_step(att, sim, step)  # the fourth use: the workspace starts over
    assert att._audit_workspace is workspace
    assert workspace.audit_state.tolist() == [1] and not workspace.page_holders.any()
    run()
    assert att.device_errors() == [] and workspace.audit_state.tolist() == [2]
    table = step.beam_page_table.clone()
    col, other_col = int(step.kv_lens[4] - 1) // sim.page_size, int(step.kv_lens[2] - 1) // sim.page_size - 1
    table[4, col] = table[2, other_col]  # (as in test_a_write_page_another_request_holds_raises_the_flag)
    run(table)
    (message,) = att.device_errors()
    assert "held by a row of another request" in message, message


def test_counted_graph_replays_start_the_audit_workspace_over(monkeypatch):
    """A graph replay runs no Python: note_graph_replay() counts it toward ``AUDIT_RESTART`` (here 4) with the plan()
    and audited runs, and the fourth use starts the workspace over at the same addresses."""
    import beam_shared_prefix.attention as attention_module

    monkeypatch.setattr(attention_module, "AUDIT_RESTART", 4)
    sim, step, att = _flagged_setup("triton", steps=4)  # one plan()
    workspace = att._audit_workspace
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    att.note_graph_replay()
    assert workspace.audit_state.tolist() == [2] and workspace.page_holders.any()
    att.note_graph_replay()
    assert att._audit_workspace is workspace
    assert workspace.audit_state.tolist() == [1] and not workspace.page_holders.any()
    plain = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="triton", check=False)
    plain.note_graph_replay()  # no audit: nothing to count


def _trtllm_warmup_step(n, divisor, seed=0, device="cpu"):
    """TensorRT-LLM's CUDA-graph warm-up, as in :func:`test_trtllm_warmup_requests_raise_no_bit`: 2 beams, pages
    of 4; a dummy request of ``n`` tokens on pages 3 and 11 for both beams, then a padding request (pages 20, 21).
    Returns ``(plan_args, run_args)`` for ``plan()`` and ``run()``, the tensors on ``device``."""
    W, pg, hq, hkv, d, num_pages = 2, 4, 4, 2, 64, 32
    shared, padding = [3, 11], [20, 21]  # the dummy's pages (both beams); the padding beams' one page each
    table = torch.tensor([shared + [0, 0], shared + [0, 0], [padding[0], 0, 0, 0], [padding[1], 0, 0, 0]],
                         dtype=torch.int32) * divisor
    kv_lens = torch.tensor([n, n, 1, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_pages, 2, hkv, pg, d, generator=g).bfloat16()
    q = torch.randn(2 * W, hq, d, generator=g).bfloat16()
    new_k, new_v = (torch.randn(2 * W, hkv, d, generator=g).bfloat16() for _ in range(2))
    # (the adapter's plan: prompts of min(prompt_len, kv_len - 1) and at least 1 token, beam 0's pages)
    plan_args = (np.array([0, 2, 3]), np.array(shared + padding[:1]), np.array([n - 1, 1]), W, hq, hkv, d, pg,
                 num_pages, torch.bfloat16)
    run_args = (q, kv_cache, table, kv_lens, torch.zeros(2, W, 16, dtype=torch.int32), new_k, new_v)
    return plan_args, tuple(t.to(device) for t in run_args)


def _graph_wrapper(device="cpu", **kwargs):
    """A CUDA-graph wrapper for :func:`_trtllm_warmup_step` (the warm-up runs on the graph's metadata)."""
    return BeamSharedPrefixAttention(device, use_cuda_graph=True, max_requests=2, max_beam_width=2, max_prompt_pages=4,
                                     **kwargs)


def test_a_graph_wrappers_audit_keeps_its_pool_size():
    """Graphs captured on a use_cuda_graph=True wrapper hold its audit workspace: a plan for a pool of another size
    is refused, naming both sizes, rather than freeing the workspace under them."""
    plan_args, _ = _trtllm_warmup_step(8, 1)
    att = _graph_wrapper(backend="reference", tail_impl="triton", check=False, report_errors=True)
    att.plan(*plan_args)
    workspace = att._audit_workspace
    with pytest.raises(AttentionInputError, match=r"num_cache_pages=64: .* audit was set up for a pool of 32 pages"):
        att.plan(*plan_args[:8], 64, plan_args[9])
    att.plan(*plan_args)
    assert att._audit_workspace is workspace


@pytest.mark.parametrize("backend,tail_impl", [("reference", "torch"), ("reference", "triton"), ("triton", "triton")])
@pytest.mark.parametrize("divisor", [1, 2])
def test_trtllm_warmup_requests_raise_no_bit(backend, tail_impl, divisor):
    """TensorRT-LLM's CUDA-graph warm-up: a dummy request of ``n`` tokens, all of them context to the KV cache,
    served as a generation row with ``prompt_len = n - 1`` and ``kv_len = n``. With ``n`` a multiple of the
    page size the beams share every page, the write slot's too (the KV manager shares a full last context
    block), which is valid there; next to it a padding request (``kv_len`` 1). No bit, in any encoding; and
    check mode on the CUDA-graph wrapper it runs on passes the step (the real rows' output matches the oracle,
    the shared slot holds its beams' K/V)."""
    device = _kernel_device(tail_impl)
    plan_args, run_args = _trtllm_warmup_step(8, divisor, device=device)
    att = BeamSharedPrefixAttention(device, backend=backend, tail_impl=tail_impl, check=False, report_errors=True)
    att.plan(*plan_args)
    assert att.backend_name == backend
    att.run(*run_args, page_index_divisor=divisor)
    assert att.device_errors() == []
    att = _graph_wrapper(device, backend=backend, tail_impl=tail_impl, check=True)
    att.plan(*plan_args)
    att.run(*run_args, page_index_divisor=divisor)


def test_run_takes_a_numpy_page_index_divisor():
    """A numpy integer divisor (a pool's shape arithmetic in numpy gives one) serves as the same Python int; a
    numpy float or bool is still refused."""
    plan_args, run_args = _trtllm_warmup_step(8, 2)
    outs = []
    for divisor in (2, np.int64(2), np.int32(2)):
        att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False)
        att.plan(*plan_args)
        out = torch.full_like(run_args[0], float("nan"))
        pool = run_args[1].clone()
        outs.append((att.run(run_args[0], pool, *run_args[2:], out=out, page_index_divisor=divisor), pool))
    for out, pool in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(pool, outs[0][1])
    assert not outs[0][0].isnan().any()
    for bad in (np.float64(2.0), np.bool_(True)):
        with pytest.raises(AttentionInputError, match="page_index_divisor=.* must be an int"):
            att.run(*run_args, page_index_divisor=bad)


def test_check_mode_holds_the_warmups_shared_slot_to_one_of_its_beams(monkeypatch):
    """The slot a warm-up request's beams share may hold any one of their K/V, but not what was there before:
    a tail that wrote nothing is still caught."""
    plan_args, run_args = _trtllm_warmup_step(8, 1)
    att = _graph_wrapper(backend="reference", tail_impl="torch", check=True)
    att.plan(*plan_args)
    real_tail = att._tail_function()
    monkeypatch.setattr(att, "_tail_function",
                        lambda: (lambda *a, **kw: real_tail(*a, **{**kw, "write_kv": False})))
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=r"stage 'tail'.*K of row 0 was not stored at .* share, by any of its beams"):
        att.run(*run_args)


def test_check_mode_takes_the_warmups_shared_slot_element_by_element():
    """The beams' stores to the slot they share race per element (a program per KV head, lanes within one
    store): a slot holding head 0 of beam 0 and head 1 of beam 1 is a result of that race; an element of
    neither beam is not."""
    from beam_shared_prefix.check import WarmupRows, check_kv_write

    W, pg, hkv, d = 2, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(4, 2, hkv, pg, d, generator=g)
    new_k, new_v = torch.randn(W, hkv, d, generator=g), torch.randn(W, hkv, d, generator=g)
    table, kv_lens = torch.tensor([[0, 2], [0, 2]]), torch.tensor([8, 8])
    warm = WarmupRows(torch.zeros(W, dtype=torch.bool), torch.ones(W, dtype=torch.bool), W)
    for plane, new in ((0, new_k), (1, new_v)):  # page 2, slot 3: head 0 from beam 0, head 1 from beam 1
        pool[2, plane, 0, 3], pool[2, plane, 1, 3] = new[0, 0], new[1, 1]
    check_kv_write(pool, "HND", pg, table, kv_lens, new_k, new_v, 1, warm)
    pool[2, 1, 1, 3, 5] += 1.0
    with pytest.raises(BeamSharedPrefixCheckError, match=r"V of row 0 was not stored .* by any of its beams"):
        check_kv_write(pool, "HND", pg, table, kv_lens, new_k, new_v, 1, warm)


@pytest.mark.parametrize("layout", ["write_mid_page", "second_token", "padding_with_a_prompt", "eager_wrapper"])
def test_check_mode_takes_no_other_layout_for_the_warmup(layout):
    """Check mode's warm-up exemptions are exactly TensorRT-LLM's layouts: beams sharing the write slot only at
    the first generated token, in the last slot of a page (a full context block) and on a CUDA-graph wrapper
    (where TensorRT-LLM runs its warm-up); ``kv_len`` 1 only with a one-token planned prompt. The same sharing
    in the middle of a page (a partly filled block, which each beam gets a copy of), at a later token, or on an
    eager wrapper (where it is a real request's table sharing its prompt's partly filled last page), and a
    one-token ``kv_len`` under a longer prompt are refused."""
    n = {"write_mid_page": 7, "second_token": 8, "padding_with_a_prompt": 8, "eager_wrapper": 8}[layout]
    plan_args, run_args = _trtllm_warmup_step(n, 1)
    plan_args, run_args = list(plan_args), list(run_args)
    if layout == "second_token":  # the 8 tokens as a 6-token prompt and two generated: beam 0's table
        plan_args[2] = np.array([6, 1])
        run_args[4] = torch.zeros(2, 2, 16, dtype=torch.int32)
        match = r"row 1 \(request 0, beam 1\) writes .* a prompt page"
    elif layout == "padding_with_a_prompt":
        plan_args[1], plan_args[2] = np.array([3, 11, 20, 21]), np.array([7, 5])
        plan_args[0] = np.array([0, 2, 4])
        match = r"kv_lens\[2\]=1 but the plan's prompt length of row 2 is 5"
    else:
        match = r"row 1 \(request 0, beam 1\) writes .* a prompt page"
    if layout == "eager_wrapper":
        att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=True)
    else:
        att = _graph_wrapper(backend="reference", tail_impl="torch", check=True)
    att.plan(*plan_args)
    with pytest.raises(BeamSharedPrefixCheckError, match=f"stage 'indices'.*{match}"):
        att.run(*run_args)


@pytest.mark.parametrize("backend,tail_impl,shared_run", [
    ("reference", "torch", "off"), ("reference", "triton", "off"), ("reference", "triton", "on"),
    ("triton", "triton", "off")])
@pytest.mark.parametrize("column", ["last", "first"])
def test_a_table_unlike_the_plan_raises_the_flag(backend, tail_impl, shared_run, column):
    """Beam 0 of request 1 given another page (request 0's first, inside the pool, as a table of another batch or
    pool would be) where its prompt ends, or at its first prompt page: the prefix reads the plan's pages, the tail
    the table's. Without check mode the page-table audit names it (beam 0's prompt pages against the plan's digest),
    on the two-launch path (also after the shared-run stage) and on the cascade; at the prompt's last page this
    step's token is written there, so the audit names that too. Check mode refuses the step."""
    device = _kernel_device(tail_impl)
    sim = make_sim(d=64, device=device)  # (a head size the cascade tiles)
    for _ in range(2):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention(device, backend=backend, tail_impl=tail_impl, check=False, report_errors=True,
                                    shared_run=shared_run)
    plan_step(att, sim, step)
    assert att.backend_name == backend
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k,
            step.new_v)
    assert ("tail_skip" in att._views) == (shared_run == "on")
    assert att.device_errors() == []  # the plan's own table
    W, last = step.beam_width, (int(step.prompt_lens[step.beam_width]) - 1) // sim.page_size
    col = last if column == "last" else 0
    assert last > 0
    table = step.beam_page_table.clone()
    table[W, col] = table[0, 0]  # request 0's first page
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    assert int(step.kv_lens[W] - 1) // sim.page_size == last  # (its write page)
    messages = att.device_errors()
    assert "are not the pages the prefix read there" in messages[0], messages
    if column == "last":
        assert len(messages) == 2 and "held by a row of another request" in messages[1], messages
    else:
        assert len(messages) == 1, messages
    att.check = True
    match = rf"\[{W}, {col}\].* but the plan's prompt page {col} of request 1"
    with pytest.raises(BeamSharedPrefixCheckError, match=match):
        att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
def test_engine_written_kv_without_a_page_raises_the_flag(tail_impl):
    """``new_k=None`` (the engine wrote this step's K/V): a row whose write slot has no page entry
    is read back from a clamped slot, and reported (WRITE_PAGE), not read silently."""
    sim, step, att = _flagged_setup(tail_impl)
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection)
    assert att.device_errors() == []
    table = step.beam_page_table.clone()
    table[1, int(step.kv_lens[1] - 1) // sim.page_size] = -1
    att.run(step.q, sim.kv_cache, table, step.kv_lens, step.cache_indirection)
    assert [m for m in att.device_errors() if "write slot" in m]


def test_check_mode_off_runs_no_check(monkeypatch):
    from beam_shared_prefix import check as chk

    def boom(*a, **k):
        raise AssertionError("a check ran with check mode off")

    for name in ("check_indices", "check_prefix_stage", "expected_output", "check_output_stage", "check_kv_write"):
        monkeypatch.setattr(chk, name, boom)
    sim = make_sim()
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False)
    plan_step(att, sim, step)
    assert_matches(run_step(att, sim, step), oracle(sim, step), torch.bfloat16)


# --------------------------------------------------------------------------------------------
# GPU: check mode with the device's backend, CUDA graph


def _skip_unless_backend(name, dtype, head_dim, hq, hkv, page_size):
    from beam_shared_prefix.prefix import BACKEND_CLASSES

    ok, reason = BACKEND_CLASSES[name].is_available(torch.device("cuda"), dtype, head_dim, hq, hkv, page_size, "HND")
    if not ok:
        pytest.skip(f"{name} backend unavailable: {reason}")


@pytest.mark.gpu
def test_check_mode_on_gpu_passes_and_catches_a_wrong_prefix(monkeypatch):
    """Check mode with backend=auto on the GPU: correct steps pass, a corrupted prefix names the stage."""
    sim = make_sim(prompts=(1, 37, 300), beams=4, hq=16, hkv=8, d=128, pg=32, max_seq_len=330, device="cuda")
    att = BeamSharedPrefixAttention("cuda", backend="auto", check=True)
    for s in range(3):
        step = sim.begin_step()
        plan_step(att, sim, step)
        assert_matches(run_step(att, sim, step), oracle(sim, step), torch.bfloat16, f"step {s}")
        sim.end_step(write_kv=False)
    step = sim.begin_step()
    plan_step(att, sim, step)
    real_run = att.backend._run

    def wrong_prefix(q, kv_cache, out, lse):
        o, desc = real_run(q, kv_cache, out, lse)
        o[5].mul_(-1)
        return o, desc

    monkeypatch.setattr(att.backend, "_run", wrong_prefix)  # the backend's launch, behind run()'s checks
    with pytest.raises(BeamSharedPrefixCheckError, match="stage 'prefix'"):
        run_step(att, sim, step)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,shared_run,report_errors", [
    ("flashinfer", False, False), ("fa4", False, False), ("reference", False, False), ("fa4", True, False),
    ("flashinfer", True, False), ("flashinfer", False, True), ("fa4", True, True)])
def test_cuda_graph_replay_matches_oracle(backend, shared_run, report_errors, monkeypatch):
    """Plan, capture run() once, replay 20 steps with growing tails and beam reselection (with
    ``shared_run``, the first 8 steps give every beam one parent, so the stage takes runs under the graph; it
    looks for them from 4 cached positions, not 32, a value the graph captures). With ``report_errors`` the
    captured kernels carry the device error flag and the plan's last prompt pages: valid steps raise no bit."""
    monkeypatch.setattr(shared_run_module, "SHARED_RUN_MIN_CACHED_TAIL", 4)
    dtype, d, hq, hkv, pg, W = torch.bfloat16, 128, 16, 8, 32, 4
    _skip_unless_backend(backend, dtype, d, hq, hkv, pg)
    sim = make_sim(prompts=(1, 37, 300), beams=W, hq=hq, hkv=hkv, d=d, pg=pg, dtype=dtype, max_seq_len=400,
                   device="cuda", seed=3)
    R, rows = len(sim.requests), len(sim.requests) * W
    att = BeamSharedPrefixAttention("cuda", backend=backend, use_cuda_graph=True, max_requests=R, max_beam_width=W,
                                    max_prompt_pages=sim.max_pages_per_seq, check=False, shared_run=shared_run,
                                    report_errors=report_errors)
    # Captured inputs: the step's tensors are copied in before every replay.
    step = sim.begin_step()
    static = dict(q=step.q.clone(), new_k=step.new_k.clone(), new_v=step.new_v.clone(),
                  table=step.beam_page_table.clone(), kv_lens=step.kv_lens.clone(), ind=step.cache_indirection.clone())
    out = torch.full_like(step.q, float("nan"))

    def load(step):
        static["q"].copy_(step.q)
        static["new_k"].copy_(step.new_k)
        static["new_v"].copy_(step.new_v)
        static["table"].copy_(step.beam_page_table)
        static["kv_lens"].copy_(step.kv_lens)
        static["ind"].copy_(step.cache_indirection)

    def call():
        return att.run(static["q"], sim.kv_cache, static["table"], static["kv_lens"], static["ind"],
                       static["new_k"], static["new_v"], out=out)

    plan_step(att, sim, step)
    load(step)
    ref = oracle(sim, step)
    call()  # eager warm-up: compiles the Triton (and FA4) kernels outside the capture
    assert_matches(out, ref, dtype, "eager step 0")
    sim.end_step(write_kv=False)
    plans = att.num_backend_plans

    graph = torch.cuda.CUDAGraph()
    longest_skip = 0
    step = sim.begin_step()
    plan_step(att, sim, step)
    load(step)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        call()
    for s in range(20):
        if s:
            step = sim.begin_step()
            plan_step(att, sim, step)
            load(step)
        ref = oracle(sim, step)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, ref, dtype, f"replay {s} (tails {(step.kv_lens - step.prompt_lens).tolist()[::W]})")
        if shared_run:
            longest_skip = max(longest_skip, int(att._views["tail_skip"].max()))
        one_parent = np.zeros((R, W), np.int64) if shared_run and s < 8 else None
        sim.end_step(parents=one_parent, write_kv=False)
    assert att.num_backend_plans == plans, "the composition did not change, yet the backend was re-planned"
    assert not shared_run or longest_skip >= 8, longest_skip
    assert rows == out.shape[0]
    assert att.device_errors() == []


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_run_under_capture_needs_a_graph_wrapper(monkeypatch, use_cuda_graph):
    """The capture check on the host (the GPU test below captures for real): an eager wrapper refuses run() while the
    stream captures, before it launches anything; a graph wrapper runs."""
    sim = make_sim(prompts=(5, 7), beams=2)
    step = sim.begin_step()
    kwargs = dict(use_cuda_graph=True, max_requests=2, max_beam_width=2, max_prompt_pages=4) if use_cuda_graph else {}
    att = BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch", check=False, **kwargs)
    plan_step(att, sim, step)
    monkeypatch.setattr(att, "_capturing", lambda: True)
    out = torch.full_like(step.q, float("nan"))
    args = (step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    if use_cuda_graph:
        att.run(*args, out=out)
        assert_matches(out, oracle(sim, step), step.q.dtype)
        return
    with pytest.raises(AttentionInputError, match="use_cuda_graph=False"):
        att.run(*args, out=out)
    assert torch.isnan(out).all()


@pytest.mark.gpu
def test_capturing_an_eager_wrappers_run_is_refused():
    """A use_cuda_graph=False wrapper's tables move when a later plan() needs more room, so a graph of its run() would
    replay on freed memory: run() under capture is refused by name, and the wrapper serves eagerly afterwards."""
    sim = make_sim(prompts=(5, 37), beams=2, d=64, pg=16, device="cuda", seed=4)
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cuda", backend="reference", tail_impl="triton", check=False)
    plan_step(att, sim, step)
    args = (step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    out = torch.full_like(step.q, float("nan"))
    att.run(*args, out=out)  # eager warm-up (compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(AttentionInputError, match="captured into a CUDA graph on a wrapper built with "
                                                  "use_cuda_graph=False"):
        with torch.cuda.graph(graph):
            att.run(*args, out=out)
    out.fill_(float("nan"))
    att.run(*args, out=out)
    assert_matches(out, oracle(sim, step), step.q.dtype, "eager after the refused capture")


def test_a_cpu_0_wrapper_serves_cpu_tensors():
    """torch puts every CPU tensor on "cpu": a wrapper made on "cpu:0" serves them (it used to refuse each one)."""
    sim = make_sim(prompts=(5, 7), beams=2)
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu:0", backend="reference", tail_impl="torch", check=False)
    plan_step(att, sim, step)
    assert_matches(run_step(att, sim, step), oracle(sim, step), sim.dtype)


@pytest.mark.parametrize("interpret, expected", [("0", "torch"), ("1", "triton")])
def test_auto_tail_impl_on_cpu_follows_the_interpreter(monkeypatch, interpret, expected):
    """On a plain CPU the fused kernel cannot launch, so "auto" takes the torch tail; under
    TRITON_INTERPRET=1 (the CPU test mode) it takes the Triton kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert BeamSharedPrefixAttention("cpu", backend="reference").tail_impl == expected
    assert BeamSharedPrefixAttention("cpu", backend="reference", tail_impl="torch").tail_impl == "torch"


def test_the_cascade_launch_hears_the_tail_bound(monkeypatch, caplog):
    """The cascade's launch is bounded by the step's tail (``cascade_tail_bound``: 16 generated tokens where the
    tail is within it, else none): on eager steps the plan's ``max_tail_len`` (else the wrapper's), under CUDA
    graphs only the wrapper's (a capture keeps its launches; a longer plan logs a warning once). Outputs stay the
    oracle's, check mode on."""
    from beam_shared_prefix.prefix.select import CASCADE_SHORT_TAIL
    from beam_shared_prefix.prefix.triton import TritonPrefixBackend
    from triton_kernels.cascade import SHARED_ANCESTRY_MIN_TAIL

    assert CASCADE_SHORT_TAIL == SHARED_ANCESTRY_MIN_TAIL  # the longest tail that never takes the path
    heard, run_step_fn = [], TritonPrefixBackend.run_step

    def recording(self, *args, **kwargs):
        heard.append(kwargs.get("max_tail_len"))
        return run_step_fn(self, *args, **kwargs)

    monkeypatch.setattr(TritonPrefixBackend, "run_step", recording)
    sim = make_sim(prompts=(5, 9), beams=3, d=64, max_seq_len=48, device=KERNEL_DEVICE)
    eager = BeamSharedPrefixAttention(KERNEL_DEVICE, backend="triton", check=True, max_tail_len=None)
    graph = BeamSharedPrefixAttention(KERNEL_DEVICE, backend="triton", check=True, use_cuda_graph=True,
                                      max_requests=2, max_beam_width=3, max_prompt_pages=4, max_tail_len=8)
    for plan_tail in (None, 1, 20, 30):
        step = sim.begin_step()
        for att in (eager, graph):
            plan_step(att, sim, step, max_tail_len=plan_tail)
            with caplog.at_level("WARNING", logger="beam_shared_prefix"):
                out = run_step(att, sim, step)
            torch.testing.assert_close(out.float(), oracle(sim, step).float(), atol=2e-2, rtol=2e-2)
        sim.end_step(write_kv=False)
    short = CASCADE_SHORT_TAIL
    assert heard == [None, short, short, short, None, short, None, short], heard
    warnings = [r for r in caplog.records if "exceeds max_tail_len=8" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    with pytest.raises(ValueError, match=r"max_tail_len=0 must be >= 1"):
        BeamSharedPrefixAttention(KERNEL_DEVICE, backend="triton", max_tail_len=0)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", "5")
    assert BeamSharedPrefixAttention(KERNEL_DEVICE, backend="triton").max_tail_len == 5


# Argument checks a mutation-testing pass found unpinned (sixty-ninth round).


def _sim(seed=0):
    """3 requests (prompts 5, 17, 1) of 3 beams, Hq=4, Hkv=2, D=16, pages of 4 tokens, bf16: rows = 9."""
    return BeamSearchCacheSimulator([5, 17, 1], beam_width=3, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                    page_size=4, max_seq_len=40, kv_layout="HND", dtype=torch.bfloat16, device="cpu",
                                    seed=seed)


def _plan(att, sim, step):
    return att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, step.beam_width,
                    sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages, sim.dtype,
                    key=(tuple(step.request_ids), step.beam_width))


def _planned(seed=0):
    """``(sim, step, wrapper, run() arguments)`` of a fresh planned step whose valid run() has been made once."""
    sim = _sim(seed)
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    _plan(att, sim, step)
    args = dict(q=step.q, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table, kv_lens=step.kv_lens,
                cache_indirection=step.cache_indirection, new_k=step.new_k, new_v=step.new_v,
                out=torch.empty_like(step.q))
    att.run(**args)
    return sim, step, att, args


def _refused(att, sim, args, message):
    """run(args) raises AttentionInputError matching ``message`` (twice: a refusal is never remembered as a
    pass), and the pool is unchanged."""
    pool_before = sim.kv_cache.clone()
    for _ in range(2):
        with pytest.raises(AttentionInputError, match=message):
            att.run(**args)
    assert torch.equal(sim.kv_cache, pool_before)


# Tensors on a device other than the wrapper's: "meta" tensors carry shapes, strides and dtypes but no data, so a
# CPU machine can hand one over; each must be refused by name before anything reads it.
@pytest.mark.parametrize("name", ["q", "kv_cache", "beam_page_table", "kv_lens", "cache_indirection", "new_k",
                                  "new_v", "out"])
def test_run_refuses_a_tensor_on_another_device(name):
    """An argument on another device than the wrapper's (here ``meta``, the others on ``cpu``) is refused,
    naming the argument and both devices."""
    sim, _, att, args = _planned(seed=1)
    args[name] = args[name].to("meta")
    if name in ("new_k", "new_v", "out"):
        message = rf"{name} must be bfloat16 \[.*\] on cpu, got bfloat16 .* on meta"
    else:
        message = rf"{name} is on meta but the wrapper runs on cpu"
    _refused(att, sim, args, message)


def test_run_refuses_a_query_of_another_head_size():
    """A q with the plan's rows and heads but another head size (32, planned 16) is refused against the plan."""
    sim, step, att, args = _planned(seed=2)
    rows, hq, d = step.q.shape
    args["q"] = torch.randn(rows, hq, 2 * d, dtype=step.q.dtype)
    _refused(att, sim, args, r"q has shape \(9, 4, 32\) but the plan needs \[R\*W=3\*3=9, Hq=4, D=16\]")


def test_run_refuses_a_pool_whose_head_dim_is_strided():
    """A pool view of the planned shape whose head dim has stride 2 (every other element of a wider pool) is
    refused by the wrapper, naming the strides."""
    sim, _, att, args = _planned(seed=3)
    pool = sim.kv_cache
    wide = torch.randn(*pool.shape[:-1], 2 * pool.shape[-1], dtype=pool.dtype)
    args["kv_cache"] = wide[..., ::2]
    assert args["kv_cache"].shape == pool.shape and args["kv_cache"].stride(-1) == 2
    before = wide.clone()
    with pytest.raises(AttentionInputError, match=r"kv_cache's head dim must be contiguous \(stride 1\)"):
        att.run(**args)
    assert torch.equal(wide, before)


def test_run_refuses_a_pool_without_k_and_v_planes():
    """A 5-D pool whose dim 1 is not 2 (K, V) is refused by the wrapper with the layouts it takes."""
    sim, _, att, args = _planned(seed=4)
    pool = sim.kv_cache
    args["kv_cache"] = torch.randn(pool.shape[0], 3, *pool.shape[2:], dtype=pool.dtype)
    _refused(att, sim, args, r"kv_cache must be \[pages, 2, Hkv, Pg, D\] \(HND\)")


def test_run_names_the_pools_page_count_and_the_plans():
    """A pool of fewer pages than the plan's is refused with both counts in their places."""
    sim, _, att, args = _planned(seed=5)
    pages = sim.kv_cache.shape[0]
    args["kv_cache"] = torch.zeros_like(sim.kv_cache)[: pages - 3]
    _refused(att, sim, args, rf"kv_cache has {pages - 3} pages but the plan was made for a pool of {pages}; "
                             rf"re-plan with the current pool \(num_cache_pages={pages - 3}\)")


def test_run_refuses_a_page_table_with_fewer_rows_than_the_batch():
    """A page table of R*W - 1 rows (the kernels would read one row past it) is refused by the wrapper."""
    sim, step, att, args = _planned(seed=6)
    args["beam_page_table"] = step.beam_page_table[:-1]
    _refused(att, sim, args, r"beam_page_table must be int32 \[>= 9, max_pages\], got torch.int32 \(8, ")


def test_run_refuses_an_indirection_with_fewer_requests_than_the_batch():
    """A cache_indirection of R - 1 request rows is refused by the wrapper."""
    sim, step, att, args = _planned(seed=7)
    args["cache_indirection"] = step.cache_indirection[:2]
    _refused(att, sim, args, r"cache_indirection must be int32 \[>= R=3, >= W=3, max_seq_len\]")


@pytest.mark.parametrize("engine_kv", [False, True], ids=["new_kv_given", "engine_wrote_kv"])
@pytest.mark.parametrize("cut, message", [
    # (the table first: with the engine's K/V the wrapper reads the write slot through it before any launch)
    ("table", r"beam_page_table has 0 columns of 4 tokens \(0 positions\) but cache_indirection covers max_seq_len=40"),
    ("indirection", r"the plan's longest prompt has 17 tokens but this cache holds 16 positions a row \(beam_page_table "
                    r"10 columns of 4 tokens, cache_indirection max_seq_len 16\)"),
], ids=["table_of_no_columns", "cache_shorter_than_the_prompt"])
def test_run_refuses_a_cache_too_short_for_the_plan(cut, message, engine_kv):
    """A page table of no columns crashed inside the engine-K/V gather (an out-of-range index, on a GPU a device
    assert); a cache_indirection view shorter than the plan's 17-token prompt was served, every row of that request
    past the cache, so its K/V was never written and the cascade's rows differed from the two-launch paths'. Both are
    refused by the wrapper from shapes alone, the pool unchanged."""
    sim, step, att, args = _planned(seed=9)
    if cut == "table":
        args["beam_page_table"] = step.beam_page_table[:, :0]
    else:
        args["cache_indirection"] = step.cache_indirection[:, :, :16]
    if engine_kv:
        args["new_k"] = args["new_v"] = None
    _refused(att, sim, args, message)


@pytest.mark.parametrize("name", ["q", "kv_lens"])
def test_run_refuses_a_sparse_tensor_by_its_layout(name):
    """A sparse tensor is refused by its layout (its strides read as 0, and the refusal said to pass .contiguous())."""
    sim, _, att, args = _planned(seed=11)
    args[name] = args[name].to_sparse()
    _refused(att, sim, args, rf"{name} has layout torch.sparse_coo; the kernels read dense tensors")


@pytest.mark.parametrize("name", ["new_k", "out"])
def test_run_refuses_an_optional_tensor_that_is_not_one(name):
    """An optional tensor argument given as a list is refused by name (it raised AttributeError on ``.shape``)."""
    sim, _, att, args = _planned(seed=10)
    args[name] = args[name].tolist()
    _refused(att, sim, args, rf"{name} must be a torch.Tensor or None, got list")


def test_a_graph_wrapper_refuses_the_torch_tail():
    """The torch tail reads the longest tail back to the host (``tail_merge_torch``): a captured graph cannot, so a
    CUDA-graph wrapper on a GPU refuses it when built, and a shape no capturable tail serves says so instead of
    advising it. (Built and planned only: a CPU machine can name a CUDA device. On the CPU, graph mode runs the
    same host logic with the torch tail, as tests here do, and captures nothing.)"""
    caps = dict(use_cuda_graph=True, max_requests=2, max_beam_width=4, max_prompt_pages=4)
    with pytest.raises(ValueError, match="use_cuda_graph=True cannot take tail_impl='torch' on a GPU"):
        BeamSharedPrefixAttention("cuda:0", backend="reference", tail_impl="torch", **caps)
    att = BeamSharedPrefixAttention("cuda:0", backend="reference", tail_impl="triton", **caps)
    with pytest.raises(AttentionInputError, match="head_dim=96.*no CUDA-graph wrapper serves this shape") as info:
        att.plan([0, 1], [0], [3], 2, 4, 2, 96, 4, 8, torch.bfloat16)
    assert "tail_impl='torch'" not in str(info.value)


@pytest.mark.parametrize("name", ["use_cuda_graph", "check", "report_errors", "page_table_audit"])
def test_on_off_options_take_bools_only(name):
    """``bool("0")`` is True: a string (the environment's variables take strings, these options do not) is refused
    instead of turning the option on; True, False, 0 and 1 are taken."""
    extra = {"use_cuda_graph": dict(max_requests=2, max_beam_width=4, max_prompt_pages=4),
             "page_table_audit": dict(report_errors=True)}.get(name, {})  # (the audit runs with the device flag)
    for raw in ("0", "off", "false", "1", 2, 0.0):
        with pytest.raises(ValueError, match=rf"{name}={raw!r} is not accepted; pass True or False"):
            BeamSharedPrefixAttention("cpu", backend="reference", **{name: raw}, **extra)
    for value in (False, 0, True, 1):
        if name == "use_cuda_graph" and value:
            continue  # a CUDA graph needs a GPU
        att = BeamSharedPrefixAttention("cpu", backend="reference", **{name: value}, **extra)
        on = {"use_cuda_graph": att.use_cuda_graph, "check": att.check, "report_errors": att.error_flags is not None,
              "page_table_audit": att.page_table_audit}[name]
        assert on == bool(value), (name, value)


def test_run_takes_kv_lens_of_exactly_one_entry_per_row():
    """kv_lens longer than R*W (one entry per beam row) is refused, as a shorter one is."""
    sim, step, att, args = _planned(seed=8)
    args["kv_lens"] = torch.cat([step.kv_lens, step.kv_lens[:1]])
    _refused(att, sim, args, r"kv_lens must be int32 \[9\] \(one per beam row\), got torch.int32 \(10,\)")


@pytest.mark.parametrize("change", ["heads", "dtype"])
def test_run_checks_new_v_on_its_own(change):
    """new_v is held to the plan by itself: a valid new_k does not let a new_v of other heads or dtype through."""
    sim, step, att, args = _planned(seed=9)
    if change == "heads":
        args["new_v"] = torch.randn(step.num_rows, 1, sim.head_dim, dtype=sim.dtype)
        got = r"bfloat16 \(9, 1, 16\)"
    else:
        args["new_v"] = step.new_v.half()
        got = r"float16 \(9, 2, 16\)"
    _refused(att, sim, args, rf"new_v must be bfloat16 \[9, Hkv=2, D=16\] on cpu, got {got}")


@pytest.mark.parametrize("name", ["new_k", "out"])
def test_run_refuses_step_tensors_of_another_dtype(name):
    """new_k (with new_v) or out in float16 under a bfloat16 plan is refused by the wrapper, naming both dtypes."""
    sim, step, att, args = _planned(seed=10)
    if name == "new_k":
        args["new_k"], args["new_v"] = step.new_k.half(), step.new_v.half()
    else:
        args["out"] = torch.empty_like(step.q, dtype=torch.float16)
    _refused(att, sim, args, rf"{name} must be bfloat16 \[9, .*\] on cpu, got float16")


@pytest.mark.parametrize("hq,hkv,d", [(4, 0, 16), (0, 2, 16), (4, 2, 0)])
def test_plan_refuses_zero_heads_or_head_size(hq, hkv, d):
    """Zero KV heads, zero query heads or head size 0 is refused by plan() as an AttentionInputError naming the
    value (not a division by zero)."""
    sim = _sim(seed=11)
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    name = "head_dim" if d == 0 else ("num_kv_heads" if hkv == 0 else "num_qo_heads")
    with pytest.raises(AttentionInputError, match=f"{name}=0"):
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, hq, hkv, d,
                 sim.page_size, sim.num_pages, sim.dtype)


@pytest.mark.parametrize("name", ["max_requests", "max_beam_width", "max_prompt_pages", "max_tail_len"])
def test_constructor_refuses_zero_capacities(name):
    """A capacity (or tail bound) of 0 is refused at construction, naming it and its lower bound."""
    with pytest.raises(ValueError, match=rf"{name}=0 must be >= 1"):
        BeamSharedPrefixAttention("cpu", backend="reference", **{name: 0})


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_constructor_refuses_a_device_it_cannot_run_on(device):
    """A meta wrapper planned and then refused every call with a wrong diagnosis ("out overlaps q", every meta
    address being 0); the constructor now names the devices it runs on."""
    with pytest.raises(ValueError, match=rf"device='{device}': the wrapper runs on a CUDA device or the CPU"):
        BeamSharedPrefixAttention(device, backend="reference")


@pytest.mark.parametrize("sm_scale,message", [
    (True, "sm_scale=True is a bool"),
    (1e39, "sm_scale=1e+39 is outside ["),  # sm_scale * log2(e) is inf in float32: NaN out
    (1e-300, "sm_scale=1e-300 is outside ["),  # 0 in float32: a masked score's -inf * 0 is NaN
], ids=["bool", "past_float32", "under_float32"])
def test_plan_refuses_a_scale_the_kernels_cannot_hold(sm_scale, message):
    sim = _sim(seed=3)
    step = sim.begin_step()
    att = BeamSharedPrefixAttention("cpu", backend="reference", check=False)
    with pytest.raises(AttentionInputError, match=re.escape(message)):
        plan_step(att, sim, step, sm_scale=sm_scale)


@pytest.mark.parametrize("tail_impl", ["torch", "triton"])
def test_a_step_with_grad_tracked_inputs_is_served_without_autograd(tail_impl):
    """q, new_k and new_v from a projection run outside ``torch.no_grad()`` require grad. The torch tail wrote K
    into the pool, then failed inside torch before V (the step half written, the pool left requiring grad), and the
    reference prefix chained every step into an autograd graph on the wrapper's persistent buffer. Both paths now
    run without autograd, as the kernels do: served, equal to the oracle, nothing left requiring grad."""
    device = _kernel_device(tail_impl)  # (the Triton tail on a CPU tensor needs the interpreter)
    sim = make_sim(prompts=(5, 17, 1), beams=3, hq=4, hkv=2, d=16, pg=4, device=device, seed=4)
    att = BeamSharedPrefixAttention(device, backend="reference", tail_impl=tail_impl, check=False)
    for _ in range(2):
        step = sim.begin_step()
        _plan(att, sim, step)
        q, new_k, new_v = (x.detach().clone().requires_grad_(True) for x in (step.q, step.new_k, step.new_v))
        want = reference_beam_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                        step.cache_indirection, step.beam_width, new_k=step.new_k, new_v=step.new_v)
        out = att.run(q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, new_k=new_k,
                      new_v=new_v, out=torch.full_like(step.q, float("nan")))
        assert not out.requires_grad and out.grad_fn is None and not sim.kv_cache.requires_grad
        kept = [v for v in att._views.values() if isinstance(v, torch.Tensor)]  # the wrapper's persistent buffers
        assert kept and not any(v.requires_grad for v in kept), [v.grad_fn for v in kept]
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
        sim.end_step()
