"""The library's forward through the interface model: the float32 oracle, mixed batches, declines.

CPU: the reference prefix backend and the Triton tail under ``TRITON_INTERPRET=1`` (set by
tests/conftest.py; on a plain CPU the adapter would take the torch tail), or the one-launch cascade
(``TLLM_BEAM_SHARED_PREFIX_BACKEND=triton``), through :class:`BeamSearchCacheSimulator` steps with
beam reselection. The model is not TensorRT-LLM (see
``interface_model.py``); each test names the ``trtllm-interfaces.md`` section it follows.

Tolerance: bf16 output of unit-variance data, two roundings (prefix output, merged output), as in
``tests/test_attention.py``: ``atol = rtol = 2e-2``; another beam's history moves outputs by O(0.1-1).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beam_shared_prefix.trtllm import register, stats
from interface_model import build

LIB = "beam_shared_prefix"
TOL = 2e-2
# Where the tests of the Triton backend run its kernels: on a GPU where there is one (for real), else on the CPU under
# the interpreter (tests/conftest.py turns it on there).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_close(out, ref, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output (a row was not written)"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")


def gen_rows(out, num_ctx_tokens, sim):
    return out[num_ctx_tokens:].view(-1, sim.num_qo_heads, sim.head_dim)


def assert_context_rows(out, qkv, context_prompt_lens, sim):
    """The context rows at the head of ``out``: each request's causal attention over its own fused QKV rows."""
    start = 0
    for n in context_prompt_lens:
        expected = dense_causal(qkv[start : start + n], sim.num_qo_heads, sim.num_kv_heads, sim.head_dim)
        assert_close(out[start : start + n], expected, f"context request of {n} tokens")
        start += n


def selected(setup):
    return list(setup.layer._fmha_manager._cache.values())


def fallback_calls(setup):
    return setup.model.module(".fmha.fallback").FallbackFmha.calls


def dense_causal(qkv, hq, hkv, d):
    """Causal attention of one context request's fused QKV rows, float32 (the expected context output)."""
    n = qkv.shape[0]
    q = qkv[:, : hq * d].float().view(n, hkv, hq // hkv, d)
    k = qkv[:, hq * d : (hq + hkv) * d].float().view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].float().view(n, hkv, d)
    s = torch.einsum("ikgd,jkd->kgij", q, k) / math.sqrt(d)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("kgij,jkd->ikgd", s.softmax(-1), v).reshape(n, hq * d)


@pytest.mark.parametrize(
    "layout, kind, heads",
    [("new", "v1", (4, 2)), ("new", "v2", (4, 2)), ("old", "v1", (2, 2)), ("old", "v2", (6, 2))],
    ids=["new-V1-gqa2", "new-V2-gqa2", "old-V1-mha", "old-V2-gqa3"],
)
def test_forward_matches_oracle(trt, monkeypatch, layout, kind, heads):
    """Doc 2.1/2.7 (forward writes forward_args.output), 4.2/4.3 (pages through each manager's
    encoding), 5.1 (this token's K/V written at kv_len - 1); a request finishing re-plans once."""
    model = trt(layout=layout)
    # The old layout's '+' appends after fallback (doc 1.2): the exact list is the form that works.
    fmha_libs = f"+{LIB}" if layout == "new" else f"triton_custom_mask,flashinfer_trtllm_gen,{LIB},fallback"
    monkeypatch.setenv("TLLM_FMHA_LIBS", fmha_libs)
    register()
    setup = build(model, prompts=(37, 70, 16), beam_width=3, kind=kind, num_qo_heads=heads[0], num_kv_heads=heads[1])
    sim = setup.sim
    for s in range(5):
        if s == 3:
            sim.finish([sim.requests[0].rid])
        step = sim.begin_step()
        ref = setup.oracle(step)
        out, _ = setup.run(step)
        assert_close(gen_rows(out, 0, sim), ref, f"step {s}")
        if s == 0:  # the library wrote this token's K/V into each beam's own page
            for i in range(step.num_rows):
                k, v = sim.read_kv(int(step.write_page[i]), int(step.write_slot[i]))
                assert torch.equal(k, step.new_k[i]) and torch.equal(v, step.new_v[i])
        sim.end_step(write_kv=False)  # later steps read what the library wrote
    # Two cache keys (9 then 6 generation rows), both served by the library.
    assert {type(f).__name__ for f in selected(setup)} == {"BeamSharedPrefixFmha"}
    assert stats()["generation_forwards"] == 5 and fallback_calls(setup) == []
    assert stats()["plans"] == 2  # first composition, then after the request finished


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_forward_through_the_one_launch_cascade(trt, monkeypatch, kind):
    """The ``triton`` backend through the adapter: the cascade kernel reads the plan's prompt pages and
    each beam's pages through the manager's encoding (V1 block offsets with their divisor, V2 page
    indices), writes this token's K/V, and matches the oracle."""
    from beam_shared_prefix.trtllm import planning

    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "triton")
    register()
    setup = build(model, prompts=(37, 70, 16), beam_width=3, kind=kind, num_qo_heads=4, num_kv_heads=2,
                  device=KERNEL_DEVICE)
    sim = setup.sim
    for s in range(3):
        step = sim.begin_step()
        ref = setup.oracle(step)
        out, _ = setup.run(step)
        assert_close(gen_rows(out, 0, sim), ref, f"{kind} step {s}")
        for i in range(step.num_rows):
            k, v = sim.read_kv(int(step.write_page[i]), int(step.write_slot[i]))
            assert torch.equal(k, step.new_k[i]) and torch.equal(v, step.new_v[i])
        sim.end_step(write_kv=False)
    (wrapper,) = planning.metadata_state(setup.engine.metadata).wrappers.values()
    assert wrapper.backend_name == "triton" and wrapper.tail_impl == "triton"


def test_mixed_batch_served_as_its_own_combined_library(trt, monkeypatch):
    """Doc 2.3/2.5: with no library before it taking the CONTEXT phase, the library answers the
    phase-less question for a mixed batch; the context rows go to fallback (context_only call), the
    generation rows are served here."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, prompts=(37, 70), beam_width=3)
    sim = setup.sim
    step = sim.begin_step()
    ref = setup.oracle(step)
    contexts = (20, 33)
    out, qkv = setup.run(step, context_prompt_lens=contexts)
    ctx_tokens = sum(contexts)
    assert_close(gen_rows(out, ctx_tokens, sim), ref, "generation rows")
    assert_context_rows(out, qkv, contexts, sim)
    assert [type(f).__name__ for f in selected(setup)] == ["BeamSharedPrefixFmha"]
    assert fallback_calls(setup) == ["prepare_workspace", "run_context"]
    assert stats()["mixed_batches"] == 1 and stats()["generation_forwards"] == 1


@pytest.mark.parametrize(
    "layout, params", [("new", "interface"), ("new", "phased"), ("old", "phased")], ids=["new-b", "new-a", "old-a"]
)
def test_mixed_batch_combined_with_an_earlier_context_library(trt, monkeypatch, layout, params):
    """Doc 2.3/2.5/7.1: when a library listed before this one takes the CONTEXT phase (trtllm-gen on
    SM100), the library declines the phase-less question and answers GENERATION, and the manager builds
    CombinedFmha(context=that library, generation=this one). The generation half reads either
    FmhaParams variant (doc 0.2 a/b)."""
    model = trt(layout=layout, params=params, sm100=True)
    fmha_libs = f"+{LIB}" if layout == "new" else f"triton_custom_mask,flashinfer_trtllm_gen,{LIB},fallback"
    monkeypatch.setenv("TLLM_FMHA_LIBS", fmha_libs)
    register()
    setup = build(model, prompts=(37, 70), beam_width=3)
    sim = setup.sim
    step = sim.begin_step()
    ref = setup.oracle(step)
    out, qkv = setup.run(step, context_prompt_lens=(24,))
    assert_close(gen_rows(out, 24, sim), ref, "generation rows")
    assert_close(out[:24], dense_causal(qkv[:24], sim.num_qo_heads, sim.num_kv_heads, sim.head_dim), "context rows")
    (choice,) = selected(setup)
    assert type(choice).__name__ == "CombinedFmha"
    assert type(choice._context_impl).__name__ == "FlashInferTrtllmGenFmha"
    assert type(choice._generation_impl).__name__ == "BeamSharedPrefixFmha"
    assert model.module(".fmha.flashinfer_trtllm_gen").FlashInferTrtllmGenFmha.calls == ["run_context"]
    assert stats()["combined_generation_calls"] == 1 and "run_generation" not in fallback_calls(setup)
    # The next generation-only step is the library's alone (another cache key: no contexts).
    sim.end_step(write_kv=False)
    step = sim.begin_step()
    out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, sim), setup.oracle(step), "generation-only step")


def test_unknown_fmha_params_variant_fails_clearly(trt, monkeypatch):
    """Doc 0.2: FmhaParams variants differ; one the library cannot read is an error naming the fields."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model)
    ours = next(f for f in setup.layer._fmha_manager.fmha_libs if type(f).__name__ == "BeamSharedPrefixFmha")

    class OtherParams:
        def __init__(self):
            self.query = torch.zeros(1)
            self.metadata = None

    with pytest.raises(RuntimeError, match=r"FmhaParams has none of the fields.*\['metadata', 'query'\]"):
        ours.run_generation(OtherParams())


def test_per_step_decline_hands_the_step_to_fallback(monkeypatch, with_decline):
    """Per-step decline (docs/trtllm.md): a short-prompt batch is handed to fallback at run time while the
    selection (cached per key, doc 2.4) stays with the library; a long-prompt batch of the same key is
    served. Sanity check on: the cached choice never disagrees with a fresh selection."""
    monkeypatch.setenv("TRTLLM_FMHA_CACHE_SANITY_CHECK", "1")
    model = with_decline()
    short = build(model, prompts=(20, 30), beam_width=8)
    step = short.sim.begin_step()
    out, _ = short.run(step)
    assert_close(gen_rows(out, 0, short.sim), short.oracle(step), "short prompts (fallback)")
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0
    assert fallback_calls(short) == ["prepare_workspace", "run_generation"]
    # Same layer, same cache key (2 requests x 8 beams), long prompts: the library serves it.
    long_sim_setup = build(model, prompts=(90, 120), beam_width=8, seed=3)
    long_sim_setup.layer = short.layer
    step = long_sim_setup.sim.begin_step()
    out, _ = long_sim_setup.run(step)
    assert_close(gen_rows(out, 0, long_sim_setup.sim), long_sim_setup.oracle(step), "long prompts (library)")
    assert stats()["generation_forwards"] == 1
    assert [type(f).__name__ for f in selected(short)] == ["BeamSharedPrefixFmha"]


def test_query_rows_the_step_does_not_hold_fail_clearly(trt, monkeypatch):
    """A call with one query row more than the step's generation rows, under a selection cached for the key
    (the call gate runs on a cache miss only), stops with the counts rather than leave a row unwritten."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, prompts=(37, 70), beam_width=3)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), "a valid step")
    setup.sim.end_step(write_kv=False)
    qkv = setup.engine.prepare(setup.sim.begin_step())
    with pytest.raises(RuntimeError, match=r"got 7 query rows but the step holds 0 context tokens and 2 requests x "
                                           r"3 beams = 6 generation rows"):
        setup.layer.forward(torch.cat([qkv, qkv[:1]]), None, None, setup.engine.metadata)


def _served_by_us(trt, monkeypatch, **build_kwargs):
    """The interface model with the library registered, a layer on it (``build_kwargs`` to :func:`build`), and the
    layer's library instance: ``(model, setup, ours)``."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, seed=int(torch.randint(0, 2**31 - 1, ())), **build_kwargs)
    (ours,) = [f for f in setup.layer._fmha_manager.fmha_libs if type(f).__name__ == "BeamSharedPrefixFmha"]
    return model, setup, ours


def _forward_args(model, setup, qkv):
    args = model.module(".interface").AttentionForwardArgs(is_fused_qkv=True, update_kv_cache=True,
                                                           attention_window_size=setup.sim.max_seq_len)
    args.output = torch.empty(qkv.shape[0], setup.sim.num_qo_heads * setup.sim.head_dim, dtype=qkv.dtype)
    return args


def test_a_step_that_cannot_be_planned_without_a_fallback_library_stops(trt, monkeypatch):
    """A step whose planning failed cannot run on the library; with no ``fallback`` library to hand it to, the forward
    stops with the reason instead of running a wrapper that holds no plan."""
    from beam_shared_prefix.prefix.base import PrefixBackendError
    from beam_shared_prefix.trtllm import planning

    def refuse(*args, **kwargs):
        raise PrefixBackendError("flashinfer failed to import (simulated)")

    monkeypatch.setattr(planning, "_new_wrapper", refuse)
    model, setup, ours = _served_by_us(trt, monkeypatch)
    monkeypatch.setattr(ours, "_get_delegate", lambda: None)
    qkv = setup.engine.prepare(setup.sim.begin_step())
    with pytest.raises(RuntimeError, match=r"planning failed: flashinfer failed to import \(simulated\), and no "
                                           r"'fallback' library to hand the step to"):
        ours.forward(qkv, None, None, setup.engine.metadata, _forward_args(model, setup, qkv))
    assert stats()["generation_forwards"] == 0


def _tail_that_does_not_build(monkeypatch):
    """Make the Triton tail's launch raise what Triton raises when ``ptxas`` fails; returns the list of its calls.
    Its tests are ``interpreter`` tests: on a CUDA machine the model's CPU tensors take the torch tail, which launches
    nothing (test_trtllm_gpu.py fails a real ``ptxas`` there)."""
    from triton.runtime.errors import PTXASError

    from triton_kernels import tail_merge

    calls = []

    def fail(*args, **kwargs):
        calls.append(args[0])
        raise PTXASError("ptxas fatal   : Value 'sm_90a' is not defined for option 'gpu-name' (simulated)")

    monkeypatch.setattr(tail_merge, "launch", fail)
    return calls


def test_only_tritons_build_failures_are_handed_over():
    """What counts as a kernel that does not build: Triton's own errors, and its install missing an NVIDIA tool
    (raised from ``triton/knobs.py``). Any other error of a launch (a device fault, an input refusal) propagates."""
    from triton import knobs
    from triton.runtime.errors import OutOfResources, PTXASError

    from beam_shared_prefix.trtllm.fmha import _is_kernel_build_error

    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError(f"{fn} raised nothing")

    def not_triton():
        raise RuntimeError("Cannot find ptxas-blackwell")

    missing_tool = raised(lambda: knobs.env_nvidia_tool("ptxas-of-no-install").get())
    assert str(missing_tool) == "Cannot find ptxas-of-no-install"
    assert _is_kernel_build_error(missing_tool)
    assert _is_kernel_build_error(PTXASError("ptxas fatal"))
    assert _is_kernel_build_error(OutOfResources(300_000, 232_448, "shared memory"))
    assert not _is_kernel_build_error(raised(not_triton))  # the same words, raised outside Triton
    assert not _is_kernel_build_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not _is_kernel_build_error(ValueError("q must be bf16 or fp16"))


@pytest.mark.interpreter
@pytest.mark.parametrize("contexts", [(), (20, 33)], ids=["generation_only", "mixed"])
def test_a_kernel_that_does_not_build_hands_the_call_over_and_retires_the_family(trt, monkeypatch, caplog, contexts):
    """A Triton kernel that fails to build at its first launch (here ``ptxas``) does not fail the engine's step: the
    whole call, context rows too, goes to ``fallback`` (the oracle's output), the reason is logged once as an ERROR,
    and every later eager step of the layer family is declined at ``prepare()``, so the failing launch is not tried
    again."""
    from beam_shared_prefix.trtllm.gates import decline_log

    _, setup, _ = _served_by_us(trt, monkeypatch, prompts=(37, 70), beam_width=3)
    launches = _tail_that_does_not_build(monkeypatch)
    sim = setup.sim
    step = sim.begin_step()
    ref = setup.oracle(step)
    with caplog.at_level(logging.ERROR, logger="beam_shared_prefix"):
        out, qkv = setup.run(step, context_prompt_lens=contexts)
    ctx_tokens = sum(contexts)
    assert_close(gen_rows(out, ctx_tokens, sim), ref, "generation rows, served by fallback")
    assert_context_rows(out, qkv, contexts, sim)
    assert len(launches) == 1
    assert fallback_calls(setup)[1:] == (["run_context"] if contexts else []) + ["run_generation"]
    assert stats()["kernel_build_failures"] == 1 and stats()["generation_forwards"] == 0
    assert decline_log.seen("a Triton kernel of the library does not build on this machine (PTXASError: PTXAS error: ptxas fatal")
    assert any(r.levelno == logging.ERROR and "steps aside" in r.getMessage() for r in caplog.records), caplog.text
    sim.end_step(write_kv=False)
    step = sim.begin_step()
    out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, sim), setup.oracle(step), "the next step, declined at prepare()")
    assert len(launches) == 1 and stats()["delegated_steps"] == 1 and stats()["kernel_build_failures"] == 1


@pytest.mark.interpreter
def test_a_kernel_that_does_not_build_in_a_combined_fmha_hands_its_generation_half_over(trt, monkeypatch):
    """As the generation half of a ``CombinedFmha`` (an earlier library takes the context rows), a kernel that fails
    to build hands the generation rows to ``fallback``'s ``run_generation``; the family is retired."""
    from beam_shared_prefix.trtllm import planning

    model = trt(layout="new", params="interface", sm100=True)
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, prompts=(37, 70), beam_width=3)
    launches = _tail_that_does_not_build(monkeypatch)
    sim = setup.sim
    step = sim.begin_step()
    ref = setup.oracle(step)
    out, qkv = setup.run(step, context_prompt_lens=(24,))
    assert_close(gen_rows(out, 24, sim), ref, "generation rows, served by fallback")
    assert_context_rows(out, qkv, (24,), sim)
    assert type(selected(setup)[0]).__name__ == "CombinedFmha"
    assert len(launches) == 1 and fallback_calls(setup)[-1:] == ["run_generation"]
    assert stats()["kernel_build_failures"] == 1 and stats()["combined_generation_calls"] == 0
    assert len(planning.retired_families) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["cuda_graph", "no_fallback"])
def test_a_kernel_that_does_not_build_where_no_step_can_be_handed_over_stops_clearly(trt, monkeypatch, case):
    """Inside a CUDA-graph step, or with no ``fallback`` library, the build failure cannot be handed over: the call
    stops with the reason and what to do, and the family is not retired."""
    from beam_shared_prefix.trtllm import planning

    model, setup, ours = _served_by_us(trt, monkeypatch, prompts=(37, 70), beam_width=3)
    _tail_that_does_not_build(monkeypatch)
    qkv = setup.engine.prepare(setup.sim.begin_step())
    if case == "cuda_graph":
        monkeypatch.setattr(planning.metadata_state(setup.engine.metadata), "is_cuda_graph", True)
        match = r"PTXASError: PTXAS error: ptxas fatal.*in a CUDA-graph step, which cannot hand the step to the default kernel"
    else:
        monkeypatch.setattr(ours, "_get_delegate", lambda: None)
        match = r"PTXASError: PTXAS error: ptxas fatal.*and no 'fallback' library to hand the step to"
    with pytest.raises(RuntimeError, match=match):
        ours.forward(qkv, None, None, setup.engine.metadata, _forward_args(model, setup, qkv))
    assert planning.retired_families == {} and stats()["kernel_build_failures"] == 0


@pytest.mark.parametrize("contexts", [(12,), ()], ids=["mixed", "no_context_rows"])
def test_a_mixed_batch_is_served_only_where_fallback_takes_its_context_rows(trt, monkeypatch, contexts):
    """Serving a mixed batch itself, the library hands its context rows to ``fallback``: where ``fallback`` declines
    them the batch is declined (logged), not taken with rows nobody serves. A batch without context rows is not a
    mixed batch: served whatever ``fallback`` says of context rows."""
    model, setup, ours = _served_by_us(trt, monkeypatch)
    fallback = model.module(".fmha.fallback").FallbackFmha
    original = fallback._is_supported

    def no_context(self, q, k, v, metadata, forward_args, *, phase=None):
        if phase is not None and str(getattr(phase, "value", phase)).lower() == "context":
            return False
        return original(self, q, k, v, metadata, forward_args, phase=phase)

    monkeypatch.setattr(fallback, "_is_supported", no_context)
    qkv = setup.engine.prepare(setup.sim.begin_step(), context_prompt_lens=contexts)
    assert setup.engine.metadata.num_contexts == len(contexts)
    assert ours.is_supported(qkv, None, None, setup.engine.metadata, _forward_args(model, setup, qkv)) == (not contexts)
    if contexts:
        from beam_shared_prefix.trtllm.gates import decline_log

        assert decline_log.seen("mixed batch: the 'fallback' library declines its context rows")


@pytest.mark.parametrize("q_scaling", [2.0, 0.5])
def test_the_softmax_scale_follows_q_scaling(trt, monkeypatch, q_scaling):
    """TensorRT-LLM scales the logits by 1 / (sqrt(D) x q_scaling): the library's step matches the oracle at that
    scale."""
    _, setup, ours = _served_by_us(trt, monkeypatch, layer_kwargs=dict(q_scaling=q_scaling))
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    family = ours._family(setup.engine.metadata, torch.bfloat16)
    assert family.sm_scale == pytest.approx(1.0 / (math.sqrt(setup.sim.head_dim) * q_scaling))
    assert stats()["generation_forwards"] == 1
    from beam_shared_prefix.reference import reference_beam_attention

    ref = reference_beam_attention(step.q, setup.sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                   step.cache_indirection, step.beam_width, new_k=step.new_k, new_v=step.new_v,
                                   sm_scale=family.sm_scale)
    assert_close(gen_rows(out, 0, setup.sim), ref, "q_scaling")


@pytest.mark.parametrize("head_dim,served", [(64, True), (256, False)])
def test_per_step_decline_follows_the_serving_path(with_decline, head_dim, served):
    """8 beams over a mean prompt of 45 tokens under ``auto``: at head 64 the one-launch cascade
    serves, from 32 tokens at this width; at head 256 (which the cascade does not tile) a prefix
    backend + the tail kernel would, from (8 - 1) x 86 tokens (docs/benchmarks.md, "The decline rule")."""
    # The rule judges the GPU choice of `auto`; on this CPU the wrapper then runs the torch path.
    model = with_decline(backend="auto")
    setup = build(model, prompts=(40, 50), beam_width=8, head_dim=head_dim)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), f"head_dim={head_dim}")
    assert stats()["generation_forwards"] == (1 if served else 0)
    assert stats()["delegated_steps"] == (0 if served else 1)


@pytest.mark.parametrize("prompts,graph,served,reason", [
    ((90, 120), False, True, None),
    ((20, 30), False, False, "mean prompt 25 < 50 tokens at beam width 4"),
    ((90, 120), True, False, "beam width 4 < 8 with the prompt length unknown"),
])
def test_narrow_beams_are_judged_per_step(with_decline, caplog, prompts, graph, served, reason):
    """4 beams: the selection takes the library (the beam width alone decides nothing: the rule's
    verdict needs the prompt length); each step is then judged. Eagerly the one-launch cascade serves
    4 beams at head 128 from a mean prompt of 50 tokens; a CUDA-graph step serves any prompt, so it follows the
    unknown-prompt rule (8 beams or more) and goes to fallback, at capture as at every replay."""
    model = with_decline(backend="auto")  # the rule judges auto's GPU choice
    setup = build(model, prompts=prompts, beam_width=4, head_dim=128)  # head 128's table (head 64: from 250)
    step = setup.sim.begin_step()
    metadata = setup.engine.graph_metadata(len(prompts)) if graph else None
    with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
        out, _ = setup.run(step, metadata=metadata)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), f"prompts={prompts} graph={graph}")
    assert [type(f).__name__ for f in selected(setup)] == ["BeamSharedPrefixFmha"]
    assert stats()["generation_forwards"] == (1 if served else 0)
    assert stats()["delegated_steps"] == (0 if served else 1)
    if reason is not None:
        assert reason in caplog.text


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("qo_heads,kv_heads", [(4, 2), (16, 8)])
def test_long_tails_are_judged_every_step(with_decline, caplog, graph, qo_heads, kv_heads):
    """8 beams over a mean prompt of 105 tokens: the rule serves at most 4 generated tokens per beam there
    (16 beam rows x 2 KV heads ask 20,000 / 32 = 625 prompt tokens per generated token, x 8 KV heads
    20,000 / 128 = 157; docs/benchmarks.md), so as the beams grow their tails the fifth step is handed
    over eagerly. A CUDA-graph step cannot be: it keeps its captured library path and logs why that is
    slow, once, judged with the layer's group (2 here; an unknown one would be judged as 8)."""
    model = with_decline(backend="auto")
    setup = build(model, prompts=(90, 120), beam_width=8, head_dim=128, num_qo_heads=qo_heads,
                  num_kv_heads=kv_heads)
    sim = setup.sim
    metadata = setup.engine.graph_metadata(2) if graph else None
    for tail in range(1, 6):
        step = sim.begin_step()
        with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
            out, _ = setup.run(step, metadata=metadata)
        assert_close(gen_rows(out, 0, sim), setup.oracle(step), f"tail {tail} graph={graph}")
        sim.end_step()
        served = graph or tail <= 4
        assert stats()["generation_forwards"] == (tail if graph else min(tail, 4)), tail
        assert stats()["delegated_steps"] == (0 if served else 1), tail
    row_kv_heads = 16 * kv_heads
    slow = (f"tail 5 generated tokens per beam > 4 (beam width 8 and 16 beam rows with {kv_heads} KV heads "
            f"(20,000 / {row_kv_heads} row-KV-heads) needs {-(-20_000 // row_kv_heads)} prompt tokens per "
            f"generated token")
    assert slow in caplog.text, caplog.text
    assert ("a CUDA-graph step runs its captured library path although" in caplog.text) == graph


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("qo_heads,served", [(16, True), (32, False)])
def test_groups_above_16_need_long_prompts_every_step(with_decline, caplog, graph, qo_heads, served):
    """One KV head, 8 beams over a mean prompt of 105 tokens: at 16 query heads the step is served, at 32
    it needs 500 tokens (32/1 lost at 100 up to 1,920 beam rows; docs/benchmarks.md), and a CUDA-graph step,
    whose prompt is unknown, is handed over there at capture as at replay: the planner passes the layer's
    query heads on both paths."""
    model = with_decline(backend="auto")
    setup = build(model, prompts=(90, 120), beam_width=8, head_dim=128, num_qo_heads=qo_heads, num_kv_heads=1)
    step = setup.sim.begin_step()
    metadata = setup.engine.graph_metadata(2) if graph else None
    with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
        out, _ = setup.run(step, metadata=metadata)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), f"{qo_heads}/1 graph={graph}")
    assert stats()["generation_forwards"] == (1 if served else 0)
    assert stats()["delegated_steps"] == (0 if served else 1)
    if not served:
        prompt = "unknown (a CUDA graph)" if graph else "105"
        assert f"32 query heads per KV head (more than 16) need a mean prompt of 500 tokens, this one is {prompt}" \
            in caplog.text, caplog.text


def test_the_longest_tail_decides(with_decline, caplog):
    """Each request's tail is walked by its own programs, so a step takes as long as its longest tail: a
    request that joins late lowers the mean tail (5 and 1: 3) but not the longest (5), and the step is
    handed over (8 beams, 2 KV heads, prompts under 800 tokens: 4 generated tokens at most)."""
    model = with_decline(backend="auto")
    setup = build(model, prompts=(90, 120), beam_width=8, head_dim=128)
    sim = setup.sim
    for step_no in range(5):
        if step_no == 4:
            sim.finish([sim.requests[1].rid])
            sim.add_requests([100])
        step = sim.begin_step()
        with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
            out, _ = setup.run(step)
        assert_close(gen_rows(out, 0, sim), setup.oracle(step), f"step {step_no}")
        sim.end_step()
    assert stats()["generation_forwards"] == 4 and stats()["delegated_steps"] == 1
    assert "tail 5 generated tokens per beam > 4" in caplog.text


def test_few_beam_rows_go_to_fallback(with_decline, caplog):
    """2 requests x 8 beams = 16 beam rows: one program per request and KV head leaves the GPU idle and
    per-beam decode was faster on the H200 (R x W < 120, docs/benchmarks.md), so the step goes to
    fallback even with prompts the width's table serves."""
    model = with_decline(backend="auto", any_rows=False)
    setup = build(model, prompts=(90, 120), beam_width=8, head_dim=128)
    step = setup.sim.begin_step()
    with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
        out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), "few rows (fallback)")
    assert stats()["generation_forwards"] == 0 and stats()["delegated_steps"] == 1
    assert "16 beam rows < 480 (120 x 8 / 2 KV heads)" in caplog.text


@pytest.mark.parametrize("flashinfer_installed", [True, False], ids=["flashinfer", "no_flashinfer"])
def test_few_beam_rows_with_long_prompts_are_served(monkeypatch, with_decline, caplog, flashinfer_installed):
    """2 requests x 8 beams with 3,800-4,000-token prompts (GQA 16/8, head 128): under ``auto`` FlashInfer's
    split prompt serves so few requests, and 16 rows x 3,900 tokens >= 60,000 measured faster than
    per-beam decode on the H200 (docs/benchmarks.md), so the library serves the step. Without FlashInfer
    installed ``auto`` would run the cascade there, which has no such exception: the step is handed
    to the fallback (the rule judges the path that would run, not the one a full install would)."""
    from beam_shared_prefix.prefix import select

    real = select._installed
    monkeypatch.setattr(select, "_installed",
                        lambda name: flashinfer_installed if name == "flashinfer" else real(name))
    model = with_decline(backend="auto", any_rows=False)
    setup = build(model, prompts=(3800, 4000), beam_width=8, head_dim=128, max_seq_len=4096, num_qo_heads=16,
                  num_kv_heads=8)
    step = setup.sim.begin_step()
    with caplog.at_level("DEBUG", logger="beam_shared_prefix.trtllm"):
        out, _ = setup.run(step)
    assert_close(gen_rows(out, 0, setup.sim), setup.oracle(step), "few rows, long prompts")
    if flashinfer_installed:
        assert stats()["generation_forwards"] >= 1 and stats()["delegated_steps"] == 0
    else:
        assert stats()["generation_forwards"] == 0 and stats()["delegated_steps"] == 1
        assert "16 beam rows < 48" in caplog.text


def test_a_masked_index_is_logged_at_the_next_prepare(trt, monkeypatch, caplog):
    """With ``TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS=1`` and without check mode, a bad
    ``cache_indirection`` entry is masked by the tail (no fault, no sync), and the device error flag
    brings it to the log at a later ``prepare()`` (the flag is read every ``DEVICE_ERROR_POLL_STEPS``
    steps), as an ERROR naming the value and its cause, once."""
    from beam_shared_prefix.trtllm import planning

    monkeypatch.setattr(planning, "DEVICE_ERROR_POLL_STEPS", 3)
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", "1")
    register()
    setup = build(model, prompts=(37, 70), beam_width=3)
    sim = setup.sim
    logged_at = []
    for s in range(8):
        step = sim.begin_step()
        if s == 1:  # an entry that is no beam, at a generated position of request 0, beam 1
            step.cache_indirection[0, 1, int(step.prompt_lens[0])] = 7
        with caplog.at_level("ERROR", logger="beam_shared_prefix.trtllm"):
            setup.run(step)
        logged_at.append(len([r for r in caplog.records if r.levelname == "ERROR"]))
        sim.end_step(write_kv=False)
    # polls at steps 0, 3 and 6 (their prepare() runs before their forward): step 1's bit is read at 3
    assert logged_at == [0, 0, 0, 1, 1, 1, 1, 1]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "cache_indirection entry outside [0, beam_width)" in errors[0].getMessage()
    assert stats()["device_errors"] == 1 and stats()["generation_forwards"] == 8


def test_warmup_requests_that_share_their_blocks_log_no_error(trt, monkeypatch, caplog):
    """TensorRT-LLM's CUDA-graph warm-up serves dummy requests whose ``n`` tokens are all context to its KV cache
    (``prompt_len = n - 1``, ``kv_len = n``); with ``n`` a multiple of the block size the manager shares every
    block among the beams, the write slot's too. Valid there: with the flag on, the adapter serves such steps and
    logs no ERROR at the later ``prepare()`` calls that read the flag."""
    from beam_shared_prefix.trtllm import planning

    monkeypatch.setattr(planning, "DEVICE_ERROR_POLL_STEPS", 1)
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", "1")
    register()
    setup = build(model, prompts=(31, 15), beam_width=3)  # blocks of 16: n = 32 and 16
    sim = setup.sim
    for req in sim.requests:  # the warm-up's blocks: every beam on beam 0's
        for b in range(1, sim.beam_width):
            req.pages[b] = list(req.pages[0])
    step = sim.begin_step()
    assert (step.kv_lens % sim.page_size == 0).all() and torch.equal(step.kv_lens, step.prompt_lens + 1)
    with caplog.at_level("ERROR", logger="beam_shared_prefix.trtllm"):
        for _ in range(3):  # (each prepare() reads the flag the previous forward left)
            setup.run(step)
    assert stats()["generation_forwards"] == 3 and stats()["device_errors"] == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def _trtllm_graph_warmup_batch(sim, long_len, reuse):
    """The dummy batch TensorRT-LLM's engine captures a generation CUDA graph with
    (``_create_cuda_graph_warmup_request``, the V1 manager's ``add_dummy_requests``): generation requests
    with no context pass, a long one first (``n = long_len`` tokens: ``prompt_len = n - 1``, ``kv_len = n``),
    then one-token ones (``prompt_len 0``, ``kv_len 1``, a block per beam). The beams share every context
    block but the last, which is per beam with block reuse on, and shared too with reuse off when it is full.
    Built on requests of ``n - 1`` and 1 prompt tokens (the simulator's first step is ``kv_len = n``); returns
    the ``before`` hook that gives the one-token requests their lengths and leaves the engine's
    ``cache_indirection`` as TensorRT-LLM does for dummies, unfilled (here: no beam at all). ``long_len`` 1:
    one-token requests only (the eager warm-up's generation dummies, ``_create_warmup_request``)."""
    long_req = sim.requests[0]
    if not reuse and long_len % sim.page_size == 0:
        for b in range(1, sim.beam_width):
            long_req.pages[b] = list(long_req.pages[0])
    real = 0 if long_len == 1 else 1  # requests with their own lengths

    def before(m):
        W = m.beam_width
        cached = list(m.kv_cache_params.num_cached_tokens_per_seq)
        m.kv_cache_params.num_cached_tokens_per_seq = cached[:real * W] + [0] * (len(cached) - real * W)
        m.prompt_lens = list(m.prompt_lens[:real * W]) + [0] * (len(m.prompt_lens) - real * W)
        m.cache_indirection.fill_(W + 5)

    return before


@pytest.mark.parametrize("backend,check,flag", [
    ("reference", "0", "1"), ("triton", "0", "1"), ("reference", "1", "0"), ("triton", "1", "0"),
], ids=["prefix+tail-flag", "cascade-flag", "check-mode", "cascade-check-mode"])
@pytest.mark.parametrize("long_len,reuse", [(32, False), (32, True), (27, False), (1, False)],
                         ids=["full-block-reuse-off", "full-block-reuse-on", "partial-block", "one-token-only"])
def test_trtllm_graph_warmup_then_real_requests(trt, monkeypatch, caplog, backend, check, flag, long_len, reuse):
    """TensorRT-LLM's own CUDA-graph warm-up sequence, then serving: the dummy batch (see
    ``_trtllm_graph_warmup_batch``) forwarded on the graph's metadata raises nothing, logs no ERROR with the
    flag, passes check mode, and its long request matches the oracle; then the dummies are freed, real
    requests take their place and the same metadata serves them exactly."""
    from beam_shared_prefix.trtllm import planning

    monkeypatch.setattr(planning, "DEVICE_ERROR_POLL_STEPS", 1)
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", backend)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_CHECK", check)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", flag)
    register()
    setup = build(model, prompts=(max(long_len - 1, 1), 1, 1), beam_width=3, max_seq_len=96,
                  device=KERNEL_DEVICE if backend == "triton" else "cpu")
    sim, W = setup.sim, 3
    metadata = setup.engine.graph_metadata(3)
    before = _trtllm_graph_warmup_batch(sim, long_len, reuse)
    with caplog.at_level("ERROR", logger="beam_shared_prefix.trtllm"):
        for _ in range(2):  # TensorRT-LLM runs the warm-up forward before it captures
            step = sim.begin_step()
            out, _ = setup.run(step, metadata=metadata, before=before)
            rows = gen_rows(out, 0, sim)
            assert torch.isfinite(rows.float()).all()
            if long_len > 1:
                assert_close(rows[:W], setup.oracle(step)[:W], "the warm-up's long request")
        sim.finish([req.rid for req in sim.requests])
        sim.add_requests([40, 23, 9])
        for s in range(3):
            step = sim.begin_step()
            out, _ = setup.run(step, metadata=metadata)
            assert_close(gen_rows(out, 0, sim), setup.oracle(step), f"real step {s}")
            sim.end_step(write_kv=False)
    assert stats()["generation_forwards"] == 5 and stats()["device_errors"] == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def _live_pages(sim):
    return sorted({page for req in sim.requests for beam in req.pages for page in beam})


@pytest.mark.parametrize("backend,check", [("reference", "0"), ("triton", "0"), ("reference", "1")],
                         ids=["prefix+tail", "cascade", "check-mode"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_serving_sequences_match_the_oracle_and_write_only_their_slots(trt, monkeypatch, backend, check,
                                                                              data):
    """A serving loop as in-flight batching drives it: requests finish and join between steps (freed pages come
    back under other requests), beams are reselected, eager steps carry context requests, and CUDA-graph
    metadata of each batch size alternates with the eager one. Every step matches the float32 oracle, and
    the pool's pages of the live requests differ from before the step only at each row's write slot, which
    holds this step's K/V (a stale plan, a wrong page or a write into shared K/V fails here). On the reference
    prefix + the Triton tail, on the one-launch cascade, and in check mode (which must pass every such step)."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", backend)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_CHECK", check)
    register()
    beam_width = data.draw(st.integers(2, 4), label="beam_width")
    prompts = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=3), label="prompts")
    setup = build(model, prompts=tuple(prompts), beam_width=beam_width, seed=data.draw(st.integers(0, 2**16)),
                  max_batch_size=6, device=KERNEL_DEVICE if backend == "triton" else "cpu")
    sim, graphs = setup.sim, {}
    served = stats()["generation_forwards"]
    num_steps = data.draw(st.integers(3, 6), label="steps")
    for s in range(num_steps):
        if len(sim.requests) > 1 and data.draw(st.booleans(), label=f"finish at {s}"):
            sim.finish([sim.requests[data.draw(st.integers(0, len(sim.requests) - 1))].rid])
        if len(sim.requests) < 4 and data.draw(st.booleans(), label=f"join at {s}"):
            sim.add_requests([data.draw(st.integers(1, 60), label=f"joining prompt at {s}")])
        graph = data.draw(st.booleans(), label=f"graph at {s}")
        contexts = () if graph else tuple(data.draw(st.lists(st.integers(1, 20), max_size=1), label=f"contexts {s}"))
        step = sim.begin_step()
        ref = setup.oracle(step)
        live = torch.tensor(_live_pages(sim))
        before = sim.kv_cache.clone()
        metadata = None
        if graph:
            metadata = graphs.setdefault(len(sim.requests), setup.engine.graph_metadata(len(sim.requests)))
        out, _ = setup.run(step, context_prompt_lens=contexts, metadata=metadata)
        assert_close(gen_rows(out, sum(contexts), sim), ref, f"step {s} ({'graph' if graph else 'eager'})")
        expected = before.clone()
        for i in range(step.num_rows):  # this step's K/V at each row's own slot, nothing else
            page, slot = int(step.write_page[i]), int(step.write_slot[i])
            expected[page, 0, :, slot], expected[page, 1, :, slot] = step.new_k[i], step.new_v[i]
        differ = (sim.kv_cache[live] != expected[live]).flatten(1).any(1)
        assert not differ.any(), (f"step {s}: pages {live[differ].tolist()} differ from the pool before the step with "
                                  f"this step's K/V at each row's write slot")
        sim.end_step(write_kv=False)  # later steps read what the library wrote
    assert stats()["generation_forwards"] == served + num_steps
    from beam_shared_prefix.trtllm import planning

    metadata = [setup.engine.metadata, *graphs.values()]
    wrappers = [w for m in metadata for w in planning.metadata_state(m).wrappers.values()]
    assert {w.backend_name for w in wrappers} == {backend} and {w.check for w in wrappers} == {check == "1"}
