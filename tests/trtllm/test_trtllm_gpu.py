"""The TensorRT-LLM adapter on a GPU with the real prefix backends and the Triton tail kernel.

No TensorRT-LLM is needed: the interface model (``interface_model.py``, a model of TensorRT-LLM's
interfaces, not TensorRT-LLM) drives the library exactly as the CPU tests do, but on CUDA tensors,
with ``TLLM_BEAM_SHARED_PREFIX_BACKEND=auto`` (FA4 or FlashInfer) and the fused tail kernel, through
TensorRT-LLM's encodings: the fused-QKV row views, the strided multi-layer pool view, the block-offset
page table with its divisor. The CUDA-graph test captures the layer's forward on a graph metadata once
(doc 3.1/3.8: prepare() before capture and before every replay) and replays it while the tails grow.
Shape of the end-to-end test: Qwen3-0.6B attention (GQA 16/8, head 128), page 32, beam 16, prompts
of 300 and 173 tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch

from beam_shared_prefix.trtllm import gates, planning, register, stats
from interface_model import build

pytestmark = pytest.mark.gpu

LIB = "beam_shared_prefix"
TOL = 2e-2
SHAPE = dict(prompts=(300, 173), beam_width=16, num_qo_heads=16, num_kv_heads=8, head_dim=128, page_size=32,
             max_seq_len=384, device="cuda")


@pytest.fixture
def gpu_model(trt, monkeypatch):
    # Where the layer gate declines "auto" (neither FlashInfer nor FA4 installed), these tests, which count the steps
    # the library serves, would fail on that documented decline rather than on a fault.
    reason = gates.backend_decline_reason("auto")
    if reason is not None:
        pytest.skip(f"the layer gate declines backend=auto here: {reason}")
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "auto")
    register()
    return model


def check(setup, step, out, num_ctx_tokens=0, what=""):
    got = out[num_ctx_tokens:].view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output"
    torch.testing.assert_close(got.float(), setup.oracle(step), atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_gpu_steps_match_oracle(gpu_model, kind):
    """Eager steps on the H200: a mixed batch (context rows to fallback), then generation-only steps."""
    setup = build(gpu_model, kind=kind, **SHAPE)
    for s in range(4):
        step = setup.sim.begin_step()
        contexts = (40,) if s == 1 else ()
        out, _ = setup.run(step, context_prompt_lens=contexts)
        check(setup, step, out, sum(contexts), f"{kind} step {s}")
        setup.sim.end_step(write_kv=False)
    assert stats()["generation_forwards"] == 4 and stats()["mixed_batches"] == 1
    (wrapper,) = planning.metadata_state(setup.engine.metadata).wrappers.values()
    # The auto rule: short prompts and a small group take the one-launch cascade, others FA4/FlashInfer.
    assert wrapper.backend_name in ("triton", "fa4", "flashinfer")


def test_gpu_cuda_graph_capture_and_replay(gpu_model):
    """One capture of the layer forward on the graph metadata, replayed for 8 steps with tails growing
    from 1 to 8 tokens and beams reselected; prepare() runs before each replay and plans nothing new."""
    setup = build(gpu_model, kind="v1", **SHAPE)
    graph = setup.engine.graph_metadata(2)
    sim = setup.sim
    # Warm-up (eager, compiles the kernels), as TensorRT-LLM's graph runner does before capturing.
    step = sim.begin_step()
    qkv = setup.engine.prepare(step, metadata=graph)
    static_qkv = qkv.clone()
    out = setup.layer.forward(static_qkv, None, None, graph)
    check(setup, step, out, what="warm-up")
    sim.end_step(write_kv=False)
    # Capture on the next step's inputs.
    step = sim.begin_step()
    static_qkv.copy_(setup.engine.prepare(step, metadata=graph))
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        static_out = setup.layer.forward(static_qkv, None, None, graph)
    plans = stats()["plans"]
    for s in range(8):
        if s > 0:
            step = sim.begin_step()
            static_qkv.copy_(setup.engine.prepare(step, metadata=graph))
        static_out.fill_(float("nan"))
        cuda_graph.replay()
        torch.cuda.synchronize()
        check(setup, step, static_out, what=f"replay {s} (tail {int(step.tail_lens.max())})")
        sim.end_step(write_kv=False)
    assert stats()["plans"] == plans  # same composition: nothing re-planned between replays


@pytest.mark.parametrize("contexts", [(), (40,)], ids=["generation_only", "mixed"])
def test_gpu_a_kernel_ptxas_rejects_hands_the_call_to_fallback(gpu_model, monkeypatch, caplog, contexts):
    """A real build failure on the GPU: every launch of the library's Triton kernels asks the machine's ``ptxas`` for
    an option it does not have, so the step's first Triton kernel fails to build (Triton's ``PTXASError``; the options
    are part of Triton's cache key, so no cached binary stands in). The whole call goes to ``fallback`` (the context
    rows too, which test_trtllm_forward.py checks), and its generation rows match the oracle; one ERROR is logged; the
    next eager step is declined at ``prepare()`` and tries no build (a second would count a second failure)."""
    from beam_shared_prefix.trtllm.gates import decline_log
    from triton_kernels import launch

    monkeypatch.setattr(launch, "COMPILE_OPTIONS", {**launch.COMPILE_OPTIONS, "ptx_options": "--no-such-ptxas-option"})
    setup = build(gpu_model, kind="v1", **SHAPE)
    step = setup.sim.begin_step()
    with caplog.at_level(logging.ERROR, logger="beam_shared_prefix"):
        out, _ = setup.run(step, context_prompt_lens=contexts)
    check(setup, step, out, sum(contexts), "the failed call, served by fallback")
    assert stats()["kernel_build_failures"] == 1 and stats()["generation_forwards"] == 0
    assert decline_log.seen("a Triton kernel of the library does not build on this machine (PTXASError")
    assert any(r.levelno == logging.ERROR and "steps aside" in r.getMessage() for r in caplog.records), caplog.text
    setup.sim.end_step(write_kv=False)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    check(setup, step, out, what="the next step, declined at prepare()")
    assert stats()["delegated_steps"] == 1 and stats()["kernel_build_failures"] == 1
