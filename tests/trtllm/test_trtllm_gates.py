"""Eligibility gates at the layer, batch and call level, and their invariance within the selection key.

Against the interface model (``interface_model.py``; a model, not TensorRT-LLM). Each declined case
checks that the library is not chosen and that the reason was logged (once).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch

from beam_shared_prefix import decline
from beam_shared_prefix.trtllm import gates, register, stats
from beam_shared_prefix.trtllm.gates import decline_log
from interface_model import PositionEmbeddingType, QuantMode, build

LIB = "beam_shared_prefix"


@pytest.fixture
def enabled(trt, monkeypatch):
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    return model


def library_of(layer):
    found = [f for f in layer._fmha_manager.fmha_libs if type(f).__name__ == "BeamSharedPrefixFmha"]
    return found[0] if found else None


@pytest.mark.parametrize(
    "attn_kwargs, reason",
    [
        ({}, None),
        (dict(mla=True), "MLA attention"),
        (dict(sparse_params=object()), "sparse attention"),
        (dict(predicted_tokens_per_seq=3), "speculative decoding"),
        (dict(attention_chunk_size=64), "chunked (local) attention"),
        (dict(head_dim=96), "head_dim=96 is not one of (64, 128, 256)"),
        (dict(num_heads=6, num_kv_heads=4), "num_heads=6 is not a positive multiple of num_kv_heads=4"),
        (dict(num_heads=128, num_kv_heads=1), "GQA group 128 (128/1 heads) exceeds 64"),
        (dict(num_heads=64, num_kv_heads=1), None),  # the tail kernel's widest group (MAX_GROUP_SIZE)
        (dict(quant_mode=QuantMode.FP8_KV_CACHE), "KV cache quantization (fp8 kv cache)"),
        (dict(kv_cache_dtype="nvfp4"), "KV cache quantization (kv_cache_dtype='nvfp4')"),
        (dict(kv_cache_dtype="torch.bfloat16"), None),  # plain K/V caches, as the torch dtype's string
        (dict(kv_cache_dtype="BF16"), None),
        (dict(position_embedding_type=PositionEmbeddingType.rope_gpt_neox),
         "positional embedding rope_gpt_neox is applied inside the attention backend"),
        # Applied by the backend although upstream's is_rope() leaves them out (functional.py).
        (dict(position_embedding_type=PositionEmbeddingType.yarn), "positional embedding yarn is applied inside"),
        (dict(position_embedding_type=PositionEmbeddingType.deferred), "positional embedding deferred is applied"),
        (dict(position_embedding_type=PositionEmbeddingType.alibi), "positional embedding alibi is applied inside"),
        (dict(skip_correction_threshold=0.5), ""),  # declined by Fmha.is_available itself (doc 2.1), no reason of ours
    ],
    ids=["served", "mla", "sparse", "spec-dec", "chunked", "head96", "heads6-4", "group128", "group64", "fp8-kv",
         "nvfp4-kv", "torch-bf16-kv", "bf16-kv", "rope", "yarn", "deferred", "alibi", "skip-corr"],
)
def test_layer_gates(enabled, attn_kwargs, reason):
    """Doc 2.1 (_is_available runs once per manager), 6.3 (layer-level gates) and 5.2 (RoPE ownership)."""
    trtllm = enabled.module(".trtllm")
    kwargs = dict(num_heads=4, head_dim=64, num_kv_heads=2)
    kwargs.update({k: attn_kwargs.pop(k) for k in list(attn_kwargs) if k in kwargs})
    layer = trtllm.TrtllmAttention(0, kwargs["num_heads"], kwargs["head_dim"], kwargs["num_kv_heads"], **attn_kwargs)
    assert (library_of(layer) is not None) == (reason is None)
    if reason:
        assert decline_log.seen(reason)


def _layer_with(model, **attributes):
    """A layer whose attributes are set after its constructor and before its FMHA manager (so the layer gate)
    is built, for spellings the interface model's constructor would normalise."""
    layer = model.module(".trtllm").TrtllmAttention(0, 4, 64, 2, skip_create_weights_in_init=True)
    for name, value in attributes.items():
        setattr(layer, name, value)
    layer.update_quant_config()
    return layer


@pytest.mark.parametrize("attributes, reason", [
    (dict(quant_mode=SimpleNamespace(has_kv_cache_quant=True)), "KV cache quantization (quantized KV cache)"),
    (dict(quant_mode=SimpleNamespace(has_kv_cache_quant=False)), None),
    (dict(position_embedding_type="rope_gpt_neox"),
     "positional embedding 'rope_gpt_neox' is applied inside the attention backend"),
    (dict(position_embedding_type="learned_absolute"), None),
    (dict(position_embedding_type="PositionEmbeddingType.learned_absolute"), None),
], ids=["kv-quant-property", "no-kv-quant-property", "rope-by-name", "learned-absolute-by-name",
        "learned-absolute-by-enum-name"])
def test_layer_gates_read_other_spellings(enabled, attributes, reason):
    """The bindings' ``QuantMode.has_kv_cache_quant`` is a property, not a method (True declines, False serves),
    and a ``position_embedding_type`` that is not an int may be applied inside the backend (declined, named), except
    the name ``learned_absolute``, the module's own embedding (served, as its value 0 is)."""
    layer = _layer_with(enabled, has_fp8_kv_cache=False, has_fp4_kv_cache=False, **attributes)
    assert (library_of(layer) is not None) == (reason is None)
    if reason:
        assert decline_log.seen(reason)


def _hide_packages(monkeypatch, *names):
    """Make ``importlib.util.find_spec`` report ``names`` as not installed (the gates' only probe)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


@pytest.mark.parametrize("backend, hidden, cuda, reason", [
    ("flashinfer", ("flashinfer",), False, "pip install 'beam-shared-prefix[flashinfer]'"),
    ("fa4", ("flash_attn",), False, "pip install 'beam-shared-prefix[fa4]'"),
    # A bare install on a GPU: "auto" would run the torch reference prefix wherever it does not pick the cascade.
    ("auto", ("flashinfer", "flash_attn"), True, ("no GPU prefix backend installed (neither flashinfer nor "
                                                  "flash-attn-4); pip install 'beam-shared-prefix[flashinfer]'")),
    # Off the GPU the reference prefix is the path, so a bare install serves.
    ("auto", ("flashinfer", "flash_attn"), False, None),
], ids=["flashinfer", "fa4", "auto_bare_gpu", "auto_bare_cpu"])
def test_layer_gate_names_a_missing_backend(enabled, monkeypatch, backend, hidden, cuda, reason):
    """A backend that is not installed declines the layer with the install command."""
    _hide_packages(monkeypatch, *hidden)
    monkeypatch.setattr(gates, "_cuda_available", lambda: cuda)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", backend)
    register()  # re-reads the settings
    layer = enabled.module(".trtllm").TrtllmAttention(0, 4, 64, 2)
    if reason is None:
        assert gates.backend_decline_reason(backend) is None
        assert library_of(layer) is not None
    else:
        assert reason in gates.backend_decline_reason(backend)
        assert library_of(layer) is None
        assert decline_log.seen(reason)


def test_triton_backend_declines_a_shape_it_cannot_tile_without_its_fallback(enabled, monkeypatch):
    """backend=triton: a layer the cascade kernel does not tile (head 256) would fall back to FlashInfer
    at plan time; without FlashInfer it is declined at selection, with the reason, not failed mid-serving."""
    _hide_packages(monkeypatch, "flashinfer")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "triton")
    register()  # re-reads the settings
    trtllm = enabled.module(".trtllm")
    assert library_of(trtllm.TrtllmAttention(0, 4, 64, 2)) is not None  # tiled: served
    assert library_of(trtllm.TrtllmAttention(1, 4, 256, 2)) is None
    assert decline_log.seen("head_dim=256 is not tiled by the cascade kernel")


def test_triton_backend_serves_a_shape_it_cannot_tile_with_its_fallback(enabled, monkeypatch):
    """backend=triton with FlashInfer installed: the layer the cascade does not tile (head 256) is served, its
    plan falling back to FlashInfer (the decline above is for FlashInfer missing only)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(name, None)
                        if name == "flashinfer" else real(name, *a))
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", "triton")
    register()  # re-reads the settings
    assert library_of(enabled.module(".trtllm").TrtllmAttention(1, 4, 256, 2)) is not None
    assert not decline_log.seen("is not tiled by the cascade kernel")


def test_tail_group_limit_matches_the_kernel():
    from beam_shared_prefix.trtllm.gates import MAX_GROUP_SIZE
    from triton_kernels.tail_merge import MAX_GROUP_SIZE as KERNEL_MAX_GROUP_SIZE

    assert MAX_GROUP_SIZE == KERNEL_MAX_GROUP_SIZE


@pytest.mark.parametrize(
    "backend, serving, dtype, reason",
    [
        ("fa4", {"fa4"}, "bfloat16", None),
        ("fa4", {"flashinfer"}, "float16", None),  # FA4 declines fp16; FlashInfer, its fallback, serves
        ("fa4", set(), "float16", "TLLM_BEAM_SHARED_PREFIX_BACKEND=fa4: no prefix backend serves float16"),
        ("auto", set(), "float16", "fa4: no fa4; flashinfer: no flashinfer"),  # else: the reference prefix on the GPU
        ("auto", {"flashinfer"}, "float16", None),
        ("flashinfer", {"fa4"}, "bfloat16", "flashinfer: no flashinfer"),
        ("triton", set(), "bfloat16", None),  # the cascade tiles 16/8 at head 128
        ("reference", set(), "bfloat16", None),
    ],
)
def test_prefix_shape_gate(monkeypatch, backend, serving, dtype, reason):
    """Once the layer's pool is known (dtype, page size): a configured backend none of whose prefix
    kernels serve the shape declines the layer, instead of raising in ``prepare()`` (or running the
    torch reference prefix on the GPU, for ``auto``)."""
    from beam_shared_prefix.prefix.select import BACKEND_CLASSES
    from beam_shared_prefix.trtllm.gates import prefix_shape_decline_reason

    for name in ("fa4", "flashinfer"):
        monkeypatch.setattr(BACKEND_CLASSES[name], "is_available",
                            classmethod(lambda cls, *a, _n=name: (_n in serving, f"no {_n}")))
    prefix_shape_decline_reason.cache_clear()
    try:
        got = prefix_shape_decline_reason(backend, "cuda:0", dtype, 128, 16, 8, 32)
        cpu = prefix_shape_decline_reason(backend, "cpu", dtype, 128, 16, 8, 32)
    finally:
        prefix_shape_decline_reason.cache_clear()
    assert cpu is None  # off the GPU the reference prefix is the library's path
    if reason is None:
        assert got is None
    else:
        assert reason in got and "install flashinfer-python" in got


def forward_args(model, setup, **overrides):
    interface = model.module(".interface")
    out = torch.empty(0)
    fields = dict(output=None, is_fused_qkv=True, update_kv_cache=True, attention_window_size=setup.sim.max_seq_len)
    fields.update(overrides)
    args = interface.AttentionForwardArgs(**{k: v for k, v in fields.items() if k != "output"})
    args.output = fields["output"] if fields["output"] is not None else out
    return args


@pytest.mark.parametrize(
    "case, reason",
    [
        ("served", None),
        ("context_only", "context-only attention call"),
        ("separate_kv", "separate K/V inputs"),
        ("no_kv_update", "update_kv_cache=False"),
        ("full_mask", "attention mask"),
        ("mask_data", "custom attention mask data"),
        ("sinks", "attention sinks"),
        ("rel_bias", "relative attention bias"),
        ("fp8_out", "quantized (FP8) attention output"),
        ("sliding", "sliding-window attention"),
        ("fp32", "query dtype float32"),
        ("out_dtype", "output dtype float16 differs"),
        ("two_tokens", "more than one query token per generation row"),
        ("block_sparse", ""),  # declined by Fmha.is_supported itself (doc 2.1), before our hook
        ("fused_with_k", "separate K/V inputs"),
        ("no_output", "no preallocated output"),
        ("wrong_columns", "does not hold (num_heads + 2 * num_kv_heads) * head_dim columns"),
        ("window_one_short", "sliding-window attention"),
        ("one_row_short", "more than one query token per generation row"),
        ("pool_dtype", "KV pool dtype torch.float16 differs from the query dtype torch.bfloat16"),
        ("qkv_one_element_in", "is not 16-byte aligned (FlashInfer's and FA4's prefix kernels move 16-byte vectors)"),
        ("qkv_four_elements_in", "is not 16-byte aligned"),  # 8 bytes off: aligned for 8-byte vectors only
        ("qkv_odd_row_pitch", "with a row pitch of 1026 bytes is not 16-byte aligned"),
        ("generation_only_of_mixed", None),  # CombinedFmha's call: q holds the generation rows only
    ],
)
def test_call_gates(enabled, case, reason):
    """Doc 2.7 (forward arguments), 6.3 (request-level gates): each is fixed per layer or in the key. Declined
    calls log their reason and raise nothing."""
    setup = build(enabled, dtype=torch.float16 if case == "pool_dtype" else torch.bfloat16)
    ours = library_of(setup.layer)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, (12,) if case == "generation_only_of_mixed" else ())
    m = setup.engine.metadata
    interface = enabled.module(".interface")
    out = torch.empty(qkv.shape[0], 4 * 64, dtype=qkv.dtype)
    kw, q, k, v = {}, qkv, None, None
    if case == "context_only":
        kw["attention_input_type"] = interface.AttentionInputType.context_only
    elif case == "separate_kv":
        q, k, v = qkv[:, : 4 * 64], qkv[:, 256:384], qkv[:, 384:]
        kw["is_fused_qkv"] = False
    elif case == "no_kv_update":
        kw["update_kv_cache"] = False
    elif case == "full_mask":
        kw["attention_mask"] = interface.PredefinedAttentionMask.FULL
    elif case == "mask_data":
        kw["attention_mask_data"] = torch.ones(1)
    elif case == "sinks":
        kw["attention_sinks"] = torch.zeros(4)
    elif case == "rel_bias":
        kw["relative_attention_bias"] = torch.zeros(1)
    elif case == "fp8_out":
        kw["out_scale"] = torch.ones(1)
    elif case == "sliding":
        kw["attention_window_size"] = 32
    elif case == "fp32":
        q = qkv.float()
        out = out.float()
    elif case == "out_dtype":
        out = out.half()
    elif case == "two_tokens":
        q = torch.cat([qkv, qkv[:1]])
    elif case == "block_sparse":
        kw["sparse_runtime_params"] = interface.SparseRuntimeParams(block_sparse_inputs=torch.ones(1))
    elif case == "fused_with_k":
        k = qkv[:, 256:384]
    elif case == "wrong_columns":
        q = torch.cat([qkv, qkv[:, :64]], dim=1)
    elif case == "window_one_short":
        kw["attention_window_size"] = setup.sim.max_seq_len - 1
    elif case == "one_row_short":
        q = qkv[:-1]
    elif case == "pool_dtype":
        q, out = qkv.to(torch.bfloat16), out.to(torch.bfloat16)
    elif case in ("qkv_one_element_in", "qkv_four_elements_in"):
        elements = 1 if case == "qkv_one_element_in" else 4
        q = torch.empty(qkv.numel() + elements, dtype=qkv.dtype)[elements:].view(qkv.shape).copy_(qkv)
    elif case == "qkv_odd_row_pitch":
        q = torch.cat([qkv, qkv[:, :1]], dim=1)[:, :-1]
    elif case == "generation_only_of_mixed":
        q, out = qkv[12:], out[12:]
        kw["attention_input_type"] = interface.AttentionInputType.generation_only
    args = forward_args(enabled, setup, output=out, **kw)
    if case == "no_output":
        args.output = None
    supported = ours.is_supported(q, k, v, m, args)
    assert supported == (reason is None)
    if reason:
        assert decline_log.seen(reason)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("one_beam_engine", "an engine without beam search"),
        ("spec_dec", "speculative decoding"),
        ("cross", "cross attention"),
        ("helix", "helix (context) parallelism"),
        ("no_indirection", "no cache_indirection"),
        ("narrow_indirection", "sized for fewer beams"),
        ("extra_tokens", "num_extra_kv_tokens=2"),
        ("no_cache", "KV cache not in use"),
        ("manager", "unsupported KV cache manager"),
        ("page8", "tokens_per_block=8 is not one of (16, 32, 64, 128)"),
        ("context_only_batch", "no generation rows"),
        ("one_beam_engine_width_1", "an engine without beam search"),
        ("indirection_fewer_requests", "cache_indirection holds 1 requests but the batch has 2"),
        ("no_block_offsets", "no kv_cache_block_offsets (paged KV cache required)"),
        ("kv_factor_1", "kv_factor=1 (the library needs separate K and V"),
        ("linear_attention", "recurrent (linear-attention) state"),
    ],
)
def test_batch_gates(enabled, case, reason):
    """Doc 3 (metadata fields), 3.3 (beam_width is 1 on context-only steps), 4 (managers), 6.3 (batch gates)."""
    setup = build(enabled, page_size=8 if case == "page8" else 16)
    ours = library_of(setup.layer)
    step = setup.sim.begin_step()
    contexts = (12,) if case == "context_only_batch" else ()
    if case == "context_only_batch":
        setup.sim.requests.clear()  # the engine's view: only the new request this step
        step.request_ids = []
        step.q = step.q[:0]
        step.new_k, step.new_v = step.new_k[:0], step.new_v[:0]
        step.kv_lens, step.prompt_lens = step.kv_lens[:0], step.prompt_lens[:0]
    qkv = setup.engine.prepare(step, contexts)
    m = setup.engine.metadata
    if case == "one_beam_engine":
        m.cache_indirection = m.cache_indirection[:, :1]
    elif case == "spec_dec":
        m.use_spec_decoding = True
    elif case == "cross":
        m.is_cross = True
    elif case == "helix":
        m.enable_helix = True
    elif case == "no_indirection":
        m.cache_indirection = None
    elif case == "narrow_indirection":
        m.cache_indirection = m.cache_indirection[:, :2]
    elif case == "extra_tokens":
        m.kv_cache_params.num_extra_kv_tokens = 2
    elif case == "no_cache":
        m.kv_cache_params.use_cache = False
    elif case == "one_beam_engine_width_1":  # a one-beam engine: width 1 and a one-beam indirection buffer
        m.cache_indirection = m.cache_indirection[:, :1]
        m.beam_width = 1
    elif case == "indirection_fewer_requests":
        m.cache_indirection = m.cache_indirection[:1]
    elif case == "no_block_offsets":
        m.kv_cache_block_offsets = None
    elif case == "kv_factor_1":
        setup.manager.kv_factor = 1
    elif case == "linear_attention":
        setup.manager.is_linear_attention = True
    elif case == "manager":
        class PagedCache:  # not one of the two managers, though it has every attribute
            pass

        fake = PagedCache()
        fake.__dict__.update(vars(setup.manager))
        m.kv_cache_manager = fake
    out = torch.empty(qkv.shape[0], 4 * 64, dtype=qkv.dtype)
    assert not ours.is_supported(qkv, None, None, m, forward_args(enabled, setup, output=out))
    assert decline_log.seen(reason)


def test_a_pool_view_of_another_head_size_is_declined(enabled):
    """A layer whose head size is not its pool view's (``[pages, 2, Hkv, page_size, D]``): declined at the call, with
    the reason, not run over K/V of another layout."""
    setup = build(enabled, seed=int(torch.randint(0, 2**31 - 1, ())))  # a pool of head 64
    wide = enabled.module(".trtllm").TrtllmAttention(setup.manager.served_layer_idx, 4, 128, 2)  # (kept alive)
    ours = library_of(wide)
    assert ours is not None
    setup.engine.prepare(setup.sim.begin_step())
    m = setup.engine.metadata
    rows = int(m.num_generations)
    q = torch.randn(rows, (4 + 2 * 2) * 128).to(torch.bfloat16)
    out = torch.empty(rows, 4 * 128, dtype=q.dtype)
    assert not ours.is_supported(q, None, None, m, forward_args(enabled, setup, output=out))
    assert decline_log.seen("is not [pages, 2, Hkv, page_size, D]")


@pytest.mark.parametrize("misalignment", ["address", "page_pitch"])
def test_a_pool_view_that_is_not_16_byte_aligned_is_declined(enabled, monkeypatch, misalignment):
    """A layer whose pool view starts off a 16-byte boundary, or whose pages lie 2 bytes more than a multiple of 16
    apart (TensorRT-LLM's never do): the wrapper would refuse every call for FlashInfer and FA4, mid-serving; the
    layer is declined once instead, with the reason."""
    setup = build(enabled, seed=5)
    manager = setup.manager
    real = manager.get_buffers

    def shifted(layer_idx, kv_layout="HND"):
        pool = real(layer_idx, kv_layout=kv_layout)
        if misalignment == "address":
            return torch.empty(pool.numel() + 1, dtype=pool.dtype)[1:].view(pool.shape).copy_(pool)
        pitched = torch.empty(pool.shape[0], pool[0].numel() + 1, dtype=pool.dtype)[:, :-1]
        return pitched.unflatten(1, pool.shape[1:]).copy_(pool)

    monkeypatch.setattr(manager, "get_buffers", shifted)
    ours = library_of(setup.layer)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, ())
    out = torch.empty(qkv.shape[0], 4 * 64, dtype=qkv.dtype)
    assert not ours.is_supported(qkv, None, None, setup.engine.metadata, forward_args(enabled, setup, output=out))
    assert decline_log.seen("KV pool view (address") and decline_log.seen("is not 16-byte aligned")


def test_a_beam_width_one_step_is_handed_over_and_not_cached(enabled):
    """TensorRT-LLM's eager warm-up can run generation rows with ``beam_width`` left at 1 on an engine
    sized for beams (``model_engine`` sets ``max_beam_width`` only with a ``cache_indirection`` buffer
    or in graph warm-up), and the selection key holds no beam width. Such a step is selected and
    handed to ``fallback`` as a whole: declining it at selection would cache ``fallback`` for the
    key's real beam steps. Both orders: the width-1 step first, and after a served beam step."""
    setup = build(enabled, prompts=(37,), beam_width=4)
    sim, engine, layer = setup.sim, setup.engine, setup.layer
    ours = library_of(layer)

    def forward(step, beam_width=None):
        qkv = engine.prepare(step, beam_width=beam_width)
        out = torch.empty(qkv.shape[0], 4 * 64, dtype=qkv.dtype)
        layer.forward(qkv, None, None, engine.metadata, output=out)
        return out

    for order in ("width-1 first", "beam step first"):
        before = dict(stats())
        if order == "beam step first":
            forward(sim.begin_step())
            sim.end_step()
        forward(sim.begin_step(), beam_width=1)  # the warm-up's metadata: 4 rows, beam_width 1
        sim.end_step(write_kv=False)
        forward(sim.begin_step())
        sim.end_step()
        after = stats()
        assert after["delegated_steps"] - before["delegated_steps"] == 1, order
        served = 2 if order == "beam step first" else 1
        assert after["generation_forwards"] - before["generation_forwards"] == served, order
    assert decline_log.seen("beam width 1 on this step (4 generation rows; a warm-up or dummy step)")
    cached = list(layer._fmha_manager._cache.values())
    assert cached and all(lib is ours for lib in cached), cached  # the key kept the library


def test_a_beam_width_one_step_with_more_rows_than_request_slots_is_not_declined_at_selection(enabled):
    """A width-1 warm-up step has one id a row, so its rows may outnumber cache_indirection's request slots. Declined at
    selection, the verdict would be cached for the key's real beam steps (the key holds no width): the batch gate
    leaves the count to beam steps, and the step gate hands the width-1 step over."""
    from beam_shared_prefix.trtllm.gates import batch_decline_reason

    setup = build(enabled, prompts=(37, 20), beam_width=4)  # 8 rows
    setup.engine.prepare(setup.sim.begin_step(), beam_width=1)
    m = setup.engine.metadata
    m.cache_indirection = m.cache_indirection[:2]  # 2 request slots for 8 one-beam rows
    assert m.beam_width == 1 and batch_decline_reason(m) is None
    m.beam_width = 4  # the same count at the engine's width: 2 requests of 4 beams fit 2 slots
    assert batch_decline_reason(m) is None
    m.cache_indirection = m.cache_indirection[:1]
    assert "cache_indirection holds 1 requests but the batch has 2" in batch_decline_reason(m)


def test_step_gate_names_rows_that_are_not_beams_of_the_listed_requests(enabled):
    """Rows of more requests than ``request_ids`` lists per beam width (single-beam requests on a beam
    engine, say) are not planned as beams of fewer requests: the step goes to ``fallback``."""
    from beam_shared_prefix.trtllm.gates import step_decline_reason

    setup = build(enabled, prompts=(37, 70), beam_width=3)
    setup.engine.prepare(setup.sim.begin_step())
    m = setup.engine.metadata
    assert step_decline_reason(m) is None
    m.request_ids = list(m.request_ids) + [99, 100]
    assert step_decline_reason(m) == "4 generation request ids for 6 rows of beam width 3 (expected 2, one per request)"
    m.request_ids = m.request_ids[:1]
    assert "1 generation request ids for 6 rows" in step_decline_reason(m)
    m.request_ids = m.request_ids + [99]
    m.seq_lens = torch.ones(7, dtype=torch.int32)  # 7 rows: 2 requests of 3 beams and a stray row
    assert step_decline_reason(m) == "7 generation rows are not a multiple of beam_width=3"


def test_a_layer_the_prefix_gate_declines_is_neither_selected_nor_planned(enabled, monkeypatch):
    """A layer whose pool no configured prefix backend serves (here: FlashInfer failing to import,
    simulated) goes to ``fallback``, and ``prepare()`` does not plan it (which would raise there)."""
    from beam_shared_prefix.trtllm import fmha

    monkeypatch.setattr(fmha, "prefix_shape_decline_reason", lambda *a, **k: "flashinfer: import failed (simulated)")
    setup = build(enabled)
    before = dict(stats())
    setup.run(setup.sim.begin_step())
    assert stats()["generation_forwards"] == before["generation_forwards"]
    assert stats()["wrappers"] == before["wrappers"]  # nothing planned
    assert decline_log.seen("flashinfer: import failed (simulated)")


def test_a_layer_whose_pool_is_not_half_precision_is_not_planned(enabled):
    """A float32 KV pool (and query): the call gate declines the layer, and ``prepare()`` does not plan its family
    either (host work no forward would use)."""
    setup = build(enabled, dtype=torch.float32)
    before = dict(stats())
    out, _ = setup.run(setup.sim.begin_step())
    assert stats()["generation_forwards"] == before["generation_forwards"]
    assert stats()["wrappers"] == before["wrappers"]  # nothing planned
    assert decline_log.seen("query dtype float32")
    assert torch.isfinite(out.float()).all()  # the fallback's output


@pytest.mark.parametrize("capability,decline,reason", [
    ((9, 0), "auto", None),
    ((8, 0), "auto", "this GPU is SM80, and the library's speed rules and kernel tiles were measured on Hopper"),
    ((10, 0), "auto", "this GPU is SM100"),
    ((12, 0), "never", None),
])
def test_gpus_the_rules_were_not_measured_on_are_declined_unless_asked(enabled, monkeypatch, capability, decline,
                                                                        reason):
    """The decline rule and ``auto``'s choices are H200 measurements and the tiles were sized for Hopper's shared
    memory: with ``TLLM_BEAM_SHARED_PREFIX_DECLINE=auto`` another architecture is declined (whole layers, before
    selection and planning), with ``never`` it is served. (The pool is on the CPU here; its device is made to
    look like a GPU of ``capability``.)"""
    from beam_shared_prefix.trtllm import fmha, gates, registration

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = gates.device_decline_reason.__wrapped__("cuda:0", decline)
    assert (got is None) == (reason is None) and (reason is None or reason in got)
    assert gates.device_decline_reason.__wrapped__("cpu", decline) is None
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINE", decline)
    registration.reload_settings()  # (read at registration, which the fixture did)
    monkeypatch.setattr(fmha, "device_decline_reason", lambda device, mode: gates.device_decline_reason.__wrapped__(
        "cuda:0", mode))
    setup = build(enabled)
    before = dict(stats())
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    torch.testing.assert_close(out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim).float(), setup.oracle(step),
                               atol=2e-2, rtol=2e-2)
    chosen = {type(f).__name__ for f in setup.layer._fmha_manager._cache.values()}
    assert ("BeamSharedPrefixFmha" in chosen) == (reason is None), chosen  # (the step rule may still hand it over)
    if reason is not None:
        assert stats()["wrappers"] == before["wrappers"]  # a declined layer is not planned either
        assert decline_log.seen(reason)


def test_a_family_that_fails_to_plan_is_handed_over(enabled, monkeypatch):
    """A refusal while planning inside ``prepare()`` hands the step to ``fallback`` (logged) instead of
    failing TensorRT-LLM's step."""
    from beam_shared_prefix.prefix.base import PrefixBackendError
    from beam_shared_prefix.trtllm import planning

    def refuse(*args, **kwargs):
        raise PrefixBackendError("flashinfer failed to import (simulated)")

    monkeypatch.setattr(planning, "_new_wrapper", refuse)
    setup = build(enabled)
    before = dict(stats())
    setup.run(setup.sim.begin_step())
    assert stats()["delegated_steps"] - before["delegated_steps"] == 1
    assert stats()["generation_forwards"] == before["generation_forwards"]
    assert decline_log.seen("planning failed: flashinfer failed to import (simulated)")


def test_decline_reason_logged_once(enabled, caplog):
    """A reason is logged once per process, not once per call."""
    setup = build(enabled)
    ours = library_of(setup.layer)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step)
    args = forward_args(enabled, setup, output=torch.empty(qkv.shape[0], 256, dtype=qkv.dtype), attention_window_size=32)
    with caplog.at_level(logging.DEBUG, logger="beam_shared_prefix.trtllm"):
        for _ in range(3):
            assert not ours.is_supported(qkv, None, None, setup.engine.metadata, args)
    assert caplog.text.count("sliding-window attention") == 1


def test_reasons_differing_in_numbers_are_logged_once(caplog):
    """Per-step reasons name counts and prompt lengths; a server that sees many of them keeps and logs
    one line per kind of reason, not one per value."""
    decline_log.reset()
    with caplog.at_level(logging.DEBUG, logger="beam_shared_prefix.trtllm"):
        for prompt in range(100, 600):
            decline_log(logging.INFO, f"step handed to 'fallback': mean prompt {prompt} < 1000 tokens")
        decline_log(logging.INFO, "step handed to 'fallback': another kind")
    assert caplog.text.count("step handed to") == 2
    assert len(decline_log._seen) == 2 and decline_log.seen("mean prompt 100 < 1000")


# 8 beams judged by the two-launch rule (the CPU backend), 4 beams by the cascade's (auto's GPU choice).
@pytest.mark.parametrize("beam_width,backend", [(8, "reference"), (4, "auto")])
def test_selection_is_invariant_within_the_cache_key(enabled, monkeypatch, beam_width, backend):
    """Doc 2.4: nothing the library checks varies inside a selection-cache key. The manager's sanity
    check re-runs the uncached selection on every hit: prompt and KV lengths that change, requests that
    finish and join, a CUDA-graph metadata (is_cuda_graph is not in the key) and the decline rule on
    (prompt length is judged per step) never make the library's answer disagree with the cached one,
    also at 4 beams, where the rule's verdict changes with the prompt and with the CUDA graph."""
    monkeypatch.setenv("TRTLLM_FMHA_CACHE_SANITY_CHECK", "1")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINE", "auto")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_BACKEND", backend)
    monkeypatch.setattr(decline.rows, "MIN_BEAM_ROWS", 1)  # 2 requests: judge the prompt part of the rule
    register()
    setup = build(enabled, prompts=(20, 90), beam_width=beam_width, max_seq_len=160, head_dim=128)
    sim = setup.sim
    graph = setup.engine.graph_metadata(2)
    for s in range(6):
        if s == 2:
            sim.finish([sim.requests[0].rid])
            sim.add_requests([17])  # a short prompt joins; mean prompt length drops below the threshold
        step = sim.begin_step()
        metadata = graph if s % 2 else None
        out, _ = setup.run(step, metadata=metadata)
        assert not torch.isnan(out).any()
        sim.end_step(write_kv=False)
    assert len(setup.layer._fmha_manager._cache) == 1
    assert stats()["delegated_steps"] >= 1 and stats()["generation_forwards"] >= 1


def test_layer_without_pages_on_this_manager_declines(enabled):
    """Doc 4.2 (layer_offsets): a layer whose cache is not on the step's manager is declined, not an error."""
    setup = build(enabled)
    stray = enabled.module(".trtllm").TrtllmAttention(99, 4, 64, 2)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step)
    out = torch.empty(qkv.shape[0], 256, dtype=qkv.dtype)
    assert not library_of(stray).is_supported(qkv, None, None, setup.engine.metadata, forward_args(enabled, setup, output=out))
    assert decline_log.seen("layer 99 is not in the KV cache manager's layer_offsets")
