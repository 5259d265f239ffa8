"""CPU: the FlashInfer and FA4 backends' plumbing, against stand-ins that implement the libraries' contracts.

``flashinfer`` and ``flash_attn.cute`` do not run here, so each backend is driven against a small
stand-in written from the documented contract (``prefix-backends.md``): FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (CSR ``qo_indptr``/``paged_kv_*`` plan, 5-D pool, base-2
``[rows, heads]`` LSE) and FA4's ``_flash_attn_fwd`` (``page_table``/``seqused_k``/``cu_seqlens_q``,
separate ``[pages, Pg, Hkv, D]`` K and V, natural-log ``[heads, rows]`` LSE). The stand-ins compute
attention from exactly the arguments they are given, so a wrong page list, view, layout or base
fails the comparison with the float32 oracle. Through the whole wrapper (prefix + Triton tail under
the interpreter) this checks that each LSE convention reaches the tail kernel intact.

What they cannot check (kernel behaviour on the GPU) the GPU tests do.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import beam_shared_prefix.attention as attention_module
import beam_shared_prefix.prefix.fa4 as fa4_module
import beam_shared_prefix.prefix.flashinfer as fi_module
from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.attention import AttentionInputError
from beam_shared_prefix.config import triton_interpret_env
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.prefix import (FA4PrefixBackend, FlashInferPrefixBackend, PrefixBackendError,
                                       ReferencePrefixBackend, TritonPrefixBackend)
from beam_shared_prefix.reference import LOG2E, reference_beam_attention, reference_prefix_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator

TOL = 2e-2


def _attend(q_rows, k, v, scale):
    """q_rows ``[n, Hq, D]``, k/v ``[T, Hkv, D]`` -> (out ``[n, Hq, D]``, natural-log lse ``[n, Hq]``)."""
    g = q_rows.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->nht", q_rows.float(), kf) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("nht,thd->nhd", torch.softmax(s, dim=-1), vf), lse


class FakePrefillWrapper:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper contract, computed in torch."""

    instances = []
    fail_plans = 0  # plans that fail like an undersized workspace before one succeeds

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 backend="auto", max_total_num_rows=None):
        self.workspace = float_workspace_buffer
        self.kv_layout = kv_layout
        self.use_cuda_graph = use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        self.backend = backend
        self.max_total_num_rows = max_total_num_rows
        self.plans = []
        FakePrefillWrapper.instances.append(self)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=False, pos_encoding_mode="NONE", sm_scale=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking=True, uniform_q_len=None):
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32, "metadata must be CPU int32 (no device sync)"
        assert causal is False and pos_encoding_mode == "NONE"
        if FakePrefillWrapper.fail_plans:
            FakePrefillWrapper.fail_plans -= 1
            raise RuntimeError("Failed to allocate memory for batch_prefill_tmp_v with size 1 in AlignedAllocator")
        if self.use_cuda_graph:
            assert len(self.bufs[0]) == len(qo_indptr), "graph mode freezes the batch size"
            assert len(self.bufs[2]) >= len(paged_kv_indices)
        self.plans.append(dict(qo=qo_indptr.clone(), kv_indptr=paged_kv_indptr.clone(), kv=paged_kv_indices.clone(),
                               last=paged_kv_last_page_len.clone(), page_size=page_size, sm_scale=sm_scale,
                               q_dtype=q_data_type, o_dtype=o_data_type, uniform_q_len=uniform_q_len))

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse=False, lse_base=None, lse_layout=None):
        p = self.plans[-1]
        assert return_lse and out is not None and lse is not None and q.dtype == p["q_dtype"]
        # (fa2 writes out and lse densely and takes every head dim as contiguous, without checking)
        assert out.is_contiguous() and lse.is_contiguous() and q.stride(-1) == 1 and paged_kv_cache.stride(-1) == 1
        assert (lse_base, lse_layout) == ("log2", "NH"), "the LSE convention is passed, not left to the defaults"
        assert lse.shape == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32
        k_cache, v_cache = paged_kv_cache.unbind(dim=1)
        pg = p["page_size"]
        for r in range(len(p["qo"]) - 1):
            pages = p["kv"][p["kv_indptr"][r]:p["kv_indptr"][r + 1]].long()
            n = (len(pages) - 1) * pg + int(p["last"][r])
            if self.kv_layout == "HND":
                k, v = k_cache[pages].transpose(1, 2), v_cache[pages].transpose(1, 2)
            else:
                k, v = k_cache[pages], v_cache[pages]
            k, v = k.reshape(-1, *k.shape[2:])[:n], v.reshape(-1, *v.shape[2:])[:n]
            a, b = int(p["qo"][r]), int(p["qo"][r + 1])
            o, lse_nat = _attend(q[a:b], k, v, p["sm_scale"])
            out[a:b] = o.to(out.dtype)
            lse[a:b] = lse_nat * LOG2E  # base 2
        return out, lse


def fake_fa4_fwd(q, k, v, cu_seqlens_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
                 softmax_scale=None, causal=False, num_splits=1, return_lse=False, out=None, lse=None):
    """FA4's paged varlen forward contract, computed in torch."""
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and not causal and num_splits == 1
    num_pages, pg, hkv, d = k.shape
    assert v.shape == k.shape and k.stride(-1) == 1, "K/V must be [pages, Pg, Hkv, D] views"
    assert lse.shape == (q.shape[1], q.shape[0]), "varlen LSE is [heads, total_q]"
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    for r in range(page_table.shape[0]):
        n = int(seqused_k[r])
        pages = page_table[r, :-(-n // pg)].long()
        kr, vr = k[pages].reshape(-1, hkv, d)[:n], v[pages].reshape(-1, hkv, d)[:n]
        a, b = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        o, lse_nat = _attend(q[a:b], kr, vr, softmax_scale)
        out[a:b] = o.to(out.dtype)
        lse[:, a:b] = lse_nat.t()  # natural log, heads-major
    return out, lse, None, None, None


@pytest.fixture
def fake_gpu_libs(monkeypatch):
    """Install the stand-ins and pretend the CPU is an SM90 device for the backends' rules."""
    FakePrefillWrapper.instances = []
    FakePrefillWrapper.fail_plans = 0
    fake_flashinfer = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakePrefillWrapper)
    monkeypatch.setattr(fi_module, "_FLASHINFER_STATE", {"module": fake_flashinfer})
    monkeypatch.setattr(fa4_module, "_FA4_STATE", {"fn": fake_fa4_fwd, "params": None})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=132))
    return fake_flashinfer


def make_case(prompts=(1, 37, 9, 16), beams=3, hq=4, hkv=2, d=16, pg=4, layout="HND", seed=0):
    sim = BeamSearchCacheSimulator(list(prompts), beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   page_size=pg, max_seq_len=max(prompts) + 12, kv_layout=layout,
                                   dtype=torch.bfloat16, seed=seed)
    step = sim.begin_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, beams,
                           pg, sim.num_pages)
    return sim, step, plan


def check_prefix(backend, sim, step, plan):
    hq, d = sim.num_qo_heads, sim.head_dim
    backend.plan(plan, hq, sim.num_kv_heads, d, sim.page_size, sim.dtype, 0.25)
    out = torch.full((plan.num_rows, hq, d), float("nan"), dtype=sim.dtype)
    lse = torch.full(backend.lse_shape(plan.num_rows, hq), float("nan"))
    o, desc = backend.run(step.q, sim.kv_cache, out, lse)
    ref_o, ref_lse = reference_prefix_attention(step.q, sim.kv_cache, plan.kv_page_indptr, plan.kv_page_indices,
                                                plan.prompt_lens, plan.beam_width, sm_scale=0.25,
                                                kv_layout=sim.kv_layout)
    torch.testing.assert_close(o.float(), ref_o, atol=TOL, rtol=TOL)
    torch.testing.assert_close(desc.base2_rows_heads(), ref_lse, atol=1e-3, rtol=1e-4)
    return desc


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_flashinfer_backend_plumbing(fake_gpu_libs, layout):
    sim, step, plan = make_case(layout=layout)
    backend = FlashInferPrefixBackend("cpu", kv_layout=layout)
    desc = check_prefix(backend, sim, step, plan)
    assert (desc.layout, desc.base) == ("NH", "log2")
    (wrapper,) = FakePrefillWrapper.instances
    assert wrapper.kv_layout == layout and wrapper.backend == "fa2" and not wrapper.use_cuda_graph
    p = wrapper.plans[-1]
    assert p["uniform_q_len"] == 3 and p["q_dtype"] == p["o_dtype"] == torch.bfloat16
    assert p["kv"].tolist() == plan.kv_page_indices.tolist() and p["last"].tolist() == plan.kv_last_page_len.tolist()
    assert backend.workspace_bytes >= fi_module.prefill_float_workspace_bytes(4, 3, 4, 2, 16, 132)


def _every_other(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x``'s values in a view whose ``dim`` steps over every other element of a NaN buffer twice as long."""
    shape = list(x.shape)
    shape[dim] *= 2
    view = torch.full(shape, float("nan"), dtype=x.dtype)[(slice(None),) * dim + (slice(None, None, 2),)]
    view.copy_(x)
    return view


# (name, change of the arguments, the refusal); each change is one a direct caller could make by mistake.
BAD_RUN_ARGS = [
    ("out_int32", lambda a: dict(out=a["out"].int()), r"out must be torch.bfloat16 \[12, 4, 64\] .* got torch.int32"),
    ("lse_int32", lambda a: dict(lse=a["lse"].int()), r"lse must be torch.float32 .* got torch.int32"),
    ("q_missing_rows", lambda a: dict(q=a["q"][:4]), r"q must be torch.bfloat16 \[12, 4, 64\] .* \[4, 4, 64\]"),
    ("pool_in_the_other_layout", lambda a: dict(kv_cache=a["kv_cache"].transpose(2, 3)), r"kv_cache \(HND\) has Hkv=4"),
    ("pool_of_fewer_pages", lambda a: dict(kv_cache=a["kv_cache"][:3]), r"kv_cache has 3 pages but the plan"),
    ("out_transposed", lambda a: dict(out=a["out"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"out \(strides \[256, 1, 4\]\) must be contiguous"),
    ("lse_strided", lambda a: dict(lse=_every_other(a["lse"], 0)), r"lse \(strides .*\) must be contiguous"),
    ("q_head_dim_strided", lambda a: dict(q=_every_other(a["q"], 2)), r"q's last dim has stride 2"),
    ("out_is_q", lambda a: dict(out=a["q"]), r"out overlaps q in memory"),
    ("lse_inside_out", lambda a: dict(lse=a["out"].view(torch.float32).flatten()[:a["lse"].numel()].view(a["lse"].shape)),
     r"out overlaps lse in memory"),
    # (round 91's mutation review: each family's member that matters, which the cases above left unpinned)
    ("out_inside_the_pool", lambda a: dict(out=a["kv_cache"].view(-1)[:a["out"].numel()].view(a["out"].shape)),
     r"out overlaps kv_cache in memory"),
    ("lse_inside_q", lambda a: dict(lse=a["q"].view(torch.float32).flatten()[:a["lse"].numel()].view(a["lse"].shape)),
     r"lse overlaps q in memory"),
    ("pool_one_page_short", lambda a: dict(kv_cache=a["kv_cache"][:-1]), r"kv_cache has \d+ pages but the plan"),
    ("pool_head_dim_strided", lambda a: dict(kv_cache=_every_other(a["kv_cache"], 4)), r"kv_cache's last dim has stride 2"),
    ("pool_of_other_kv_heads", lambda a: dict(kv_cache=torch.cat([a["kv_cache"]] * 2, dim=2)), r"kv_cache \(HND\) has Hkv=4"),
]


@pytest.mark.parametrize("change,match", [c[1:] for c in BAD_RUN_ARGS], ids=[c[0] for c in BAD_RUN_ARGS])
@pytest.mark.parametrize("name", ["reference", "flashinfer", "fa4", "triton"])
def test_a_backend_called_directly_refuses_arguments_that_do_not_match_its_plan(fake_gpu_libs, monkeypatch, name, change,
                                                                                match):
    """The backends are public, and a direct caller has no wrapper to check its arguments. The libraries check some
    (FlashInfer and FA4 refuse an int32 out, in their own words), not others: FlashInfer's fa2 kernel writes a
    transposed out as if it were dense, reads a pool in the other layout (its Hkv and page size from the pool's
    shape) and a pool of too few pages, and neither writes around an out that is q. ``run()`` now checks every
    argument against the plan first, by name, writing nothing; the wrapper, which checks the same, passes
    ``check=False``. The valid call is served."""
    monkeypatch.setattr(FA4PrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))  # (CPU)
    # The Triton kernel runs on CPU tensors only interpreted; on a CUDA machine (interpreter off) its backend declines a
    # CPU plan, so the refusals are checked with that gate lifted and the valid call is served only where it can run.
    triton_runs_here = triton_interpret_env()
    if not triton_runs_here:
        monkeypatch.setattr(TritonPrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    backend = {"reference": ReferencePrefixBackend, "flashinfer": FlashInferPrefixBackend, "fa4": FA4PrefixBackend,
               "triton": TritonPrefixBackend}[name]("cpu")
    sim, step, plan = make_case(d=64)  # Hq 4, Hkv 2, page 4: the other layout's pool has another shape
    backend.plan(plan, 4, 2, 64, sim.page_size, sim.dtype, 0.25)
    args = dict(q=step.q.clone(), kv_cache=sim.kv_cache.clone(),
                out=torch.full((plan.num_rows, 4, 64), float("nan"), dtype=sim.dtype),
                lse=torch.full(backend.lse_shape(plan.num_rows, 4), float("nan")))
    good = {k: v.clone() for k, v in args.items()}
    args.update(change(args))
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(PrefixBackendError, match=match):
        backend.run(**args)
    for k, v in args.items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0, equal_nan=True, msg=f"{k} was written by a refused run()")
    if name != "triton" or triton_runs_here:
        out, desc = backend.run(**good)
        ref_o, ref_lse = reference_prefix_attention(good["q"], good["kv_cache"], plan.kv_page_indptr,
                                                    plan.kv_page_indices, plan.prompt_lens, plan.beam_width,
                                                    sm_scale=0.25, kv_layout=sim.kv_layout)
        torch.testing.assert_close(out.float(), ref_o, atol=TOL, rtol=TOL)
        torch.testing.assert_close(desc.base2_rows_heads(), ref_lse, atol=1e-3, rtol=1e-4)


def _at_an_offset(x: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """``x``'s values in a contiguous view that starts ``elements`` elements into a larger buffer."""
    view = torch.full((x.numel() + elements,), float("nan"), dtype=x.dtype)[elements:].view(x.shape)
    view.copy_(x)
    return view


def _odd_page_pitch(pool: torch.Tensor) -> torch.Tensor:
    """``pool``'s values in a view whose pages lie one element (2 bytes) more apart than their size."""
    view = torch.full((pool.shape[0], pool[0].numel() + 1), float("nan"), dtype=pool.dtype)[:, :-1]
    view = view.unflatten(1, pool.shape[1:])
    view.copy_(pool)
    return view


# (name, change, what the refusal names); each passes the plan's shape checks but not a 16-byte vector's alignment.
UNALIGNED_RUN_ARGS = [
    ("q_one_element_in", lambda a: dict(q=_at_an_offset(a["q"])), r"q \(address 0x[0-9a-f]+, strides \[256, 64, 1\]"),
    ("out_one_element_in", lambda a: dict(out=_at_an_offset(a["out"])), r"out \(address"),
    ("lse_one_element_in", lambda a: dict(lse=_at_an_offset(a["lse"])), r"lse \(address .* its address must be"),
    ("q_odd_row_pitch", lambda a: dict(q=torch.cat([a["q"], a["q"][:, :, :1]], dim=2)[:, :, :64]),
     r"q \(address 0x[0-9a-f]+, strides \[260, 65, 1\], 2-byte elements\) is not 16-byte aligned"),
    ("q_four_elements_in", lambda a: dict(q=_at_an_offset(a["q"], 4)), r"q \(address"),  # 8 bytes off: 8-aligned only
    ("pool_one_element_in", lambda a: dict(kv_cache=_at_an_offset(a["kv_cache"])), r"kv_cache \(address"),
    ("pool_odd_page_pitch", lambda a: dict(kv_cache=_odd_page_pitch(a["kv_cache"])),
     r"kv_cache \(address 0x[0-9a-f]+, strides \[\d+, .*, 2-byte elements\) is not 16-byte aligned"),
]


@pytest.mark.parametrize("change,match", [c[1:] for c in UNALIGNED_RUN_ARGS], ids=[c[0] for c in UNALIGNED_RUN_ARGS])
@pytest.mark.parametrize("name", ["flashinfer", "fa4", "reference"])
def test_a_backend_whose_kernels_move_16_byte_vectors_refuses_unaligned_tensors(fake_gpu_libs, monkeypatch, name,
                                                                                change, match):
    """FlashInfer's and FA4's kernels load and store 16-byte vectors and assume the alignment without checking it
    (on a GPU: a misaligned-address fault, which ends the CUDA context, or a misread). A tensor one element into
    its buffer, or a q whose row pitch is no multiple of 16 bytes, is refused by name there, writing nothing; the
    reference backend, which has no such kernel, serves the same call."""
    monkeypatch.setattr(FA4PrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    backend = {"reference": ReferencePrefixBackend, "flashinfer": FlashInferPrefixBackend,
               "fa4": FA4PrefixBackend}[name]("cpu")
    sim, step, plan = make_case(d=64)
    backend.plan(plan, 4, 2, 64, sim.page_size, sim.dtype, 0.25)
    args = dict(q=step.q.clone(), kv_cache=sim.kv_cache.clone(),
                out=torch.full((plan.num_rows, 4, 64), float("nan"), dtype=sim.dtype),
                lse=torch.full(backend.lse_shape(plan.num_rows, 4), float("nan")))
    args.update(change(args))
    if not backend.moves_16_byte_vectors:
        out, desc = backend.run(**args)
        ref_o, _ = reference_prefix_attention(args["q"], args["kv_cache"], plan.kv_page_indptr, plan.kv_page_indices,
                                              plan.prompt_lens, plan.beam_width, sm_scale=0.25)
        torch.testing.assert_close(out.float(), ref_o, atol=TOL, rtol=TOL)
        return
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(PrefixBackendError, match=match + r".*which \w+PrefixBackend's kernels need") as refusal:
        backend.run(**args)
    for k, v in args.items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0, equal_nan=True, msg=f"{k} was written by a refused run()")
    # The fix the message names serves the call (x.contiguous() would keep an unaligned address).
    name = str(refusal.value).split("run(): ", 1)[1].split(" ", 1)[0]
    advice, follow = {
        "q": ("q.clone(memory_format=torch.contiguous_format)", lambda x: x.clone(memory_format=torch.contiguous_format)),
        "out": ("torch.empty(out.shape, dtype=out.dtype, device=out.device)",
                lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device)),
        "lse": ("torch.empty(lse.shape, dtype=torch.float32, device=lse.device)",
                lambda x: torch.empty(x.shape, dtype=torch.float32, device=x.device)),
        # (the pool's fix is a pool of aligned pitches and address, such as a fresh dense copy)
        "kv_cache": ("page, head and token pitches and address are multiples of 16 bytes",
                     lambda x: x.clone(memory_format=torch.contiguous_format)),
    }[name]
    assert advice in str(refusal.value)
    args[name] = follow(args[name])
    out, _ = backend.run(**args)
    torch.testing.assert_close(out.float(), reference_prefix_attention(
        args["q"], args["kv_cache"], plan.kv_page_indptr, plan.kv_page_indices, plan.prompt_lens, plan.beam_width,
        sm_scale=0.25)[0], atol=TOL, rtol=TOL)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["flashinfer", "fa4"])
def test_the_wrapper_refuses_an_unaligned_q_or_pool_for_a_16_byte_vector_backend(fake_gpu_libs, monkeypatch, backend):
    """The wrapper calls its backend unchecked (it checked the call itself), so it asks the alignment of the two
    tensors it hands to FlashInfer or FA4 from the caller: a q one element into its buffer, or a pool whose page
    pitch is no multiple of 16 bytes, is refused by name, before any launch; the aligned step is served."""
    for cls in (FA4PrefixBackend, FlashInferPrefixBackend):
        monkeypatch.setattr(cls, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    monkeypatch.setattr(attention_module, "resolve_prefix_backend", lambda requested, *a, **k: requested)
    sim = BeamSearchCacheSimulator([5, 17, 1], beam_width=3, num_qo_heads=6, num_kv_heads=2, head_dim=16, page_size=4,
                                   max_seq_len=40, dtype=torch.bfloat16, seed=4)
    att = BeamSharedPrefixAttention("cpu", backend=backend, tail_impl="torch")
    step = sim.begin_step()
    att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, 6, 2, 16, 4,
             sim.num_pages, torch.bfloat16)
    pool = sim.kv_cache
    for name, q, kv_cache in (("q", _at_an_offset(step.q), pool), ("kv_cache", step.q, _odd_page_pitch(pool))):
        out = torch.full_like(step.q, float("nan"))
        with pytest.raises(AttentionInputError, match=rf"{name} \(address .* is not 16-byte aligned.* the {backend} "
                                                      rf"prefix kernels need"):
            att.run(q, kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v,
                    out=out)
        assert torch.isnan(out).all()
    out = att.run(step.q, pool, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k, step.new_v)
    ref = reference_beam_attention(step.q, pool, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                   step.cache_indirection, 3, new_k=step.new_k, new_v=step.new_v)
    torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)


@pytest.mark.gpu
def test_a_backend_made_for_cuda_refuses_tensors_on_two_gpus():
    """A backend made for ``"cuda"`` (no index) is held to the current GPU, where plan() puts its tables; before, it
    took the four tensors on any GPUs, and FlashInfer and FA4 compare only out and lse with q's device. Needs two
    GPUs (skipped, with the reason, on one)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    backend = ReferencePrefixBackend("cuda")
    sim, step, plan = make_case(d=64)
    backend.plan(plan, 4, 2, 64, sim.page_size, sim.dtype, 0.25)
    q, pool = step.q.to("cuda:0"), sim.kv_cache.to("cuda:1")
    out = torch.empty(plan.num_rows, 4, 64, dtype=sim.dtype, device="cuda:0")
    lse = torch.empty(backend.lse_shape(plan.num_rows, 4), device="cuda:0")
    assert backend.device == torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(PrefixBackendError, match=rf"kv_cache is on cuda:1 but the backend runs on {backend.device}"):
        backend.run(q, pool, out, lse)


def test_a_backends_unchecked_run_still_needs_a_plan(fake_gpu_libs):
    """``check=False`` (the wrapper's call) skips the argument checks, not the plan: an unplanned backend is
    refused by name, not run on stale or missing buffers."""
    for cls in (ReferencePrefixBackend, FlashInferPrefixBackend, FA4PrefixBackend, TritonPrefixBackend):
        t = torch.zeros(1)
        with pytest.raises(PrefixBackendError, match=r"run\(\) before plan\(\); call plan\(\) first"):
            cls("cpu").run(t, t, t, t, check=False)


class _OrderedPlanEvent:
    """A stand-in for the CUDA event recorded after each plan: logs its record and wait into a shared list."""

    def __init__(self, log):
        self.log, self.id = log, sum(1 for e in log if e[0] == "record")
        self.log.append(("record", self.id))

    def synchronize(self):
        self.log.append(("wait", self.id))


def test_flashinfer_waits_for_a_wrappers_last_plan_copy_before_planning_it_again(fake_gpu_libs, monkeypatch):
    """FlashInfer's plan() copies its pinned host buffer to the device asynchronously; planning the same wrapper
    again before that copy ran (a host ahead of the GPU) would overwrite the buffer under it. Each plan records an
    event, and the next plan of that wrapper waits for it first; a wrapper dropped for a larger workspace waits too,
    as its pinned buffer goes back to the host allocator."""
    log = []
    monkeypatch.setattr(fi_module, "record_plan_copy", lambda device: _OrderedPlanEvent(log))
    monkeypatch.setattr(FakePrefillWrapper, "plan", lambda self, *a, _plan=FakePrefillWrapper.plan, **k: (
        log.append(("plan", FakePrefillWrapper.instances.index(self))), _plan(self, *a, **k))[1])
    sim, step, plan = make_case()
    backend = FlashInferPrefixBackend("cpu")
    check_prefix(backend, sim, step, plan)
    check_prefix(backend, sim, step, plan)
    assert log == [("plan", 0), ("record", 0), ("wait", 0), ("plan", 0), ("record", 1)]
    log.clear()
    FakePrefillWrapper.fail_plans = 1  # an undersized workspace: it grows, the wrappers are re-created
    check_prefix(backend, sim, step, plan)
    assert log == [("wait", 1), ("plan", 0), ("wait", 1), ("plan", 1), ("record", 0)]


def test_flashinfer_workspace_grows_and_retries_after_an_allocation_failure(fake_gpu_libs):
    sim, step, plan = make_case()
    backend = FlashInferPrefixBackend("cpu")
    FakePrefillWrapper.fail_plans = 2
    check_prefix(backend, sim, step, plan)
    first = fi_module.prefill_float_workspace_bytes(4, 3, 4, 2, 16, 132)
    assert backend.workspace_bytes == 4 * first  # doubled twice
    assert len(FakePrefillWrapper.instances) == 3  # wrappers re-created on the new buffer
    graph = FlashInferPrefixBackend("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=3, max_prompt_pages=10)
    FakePrefillWrapper.fail_plans = 1
    with pytest.raises(PrefixBackendError, match="plan failed"):
        check_prefix(graph, sim, step, plan)


def test_flashinfer_workspace_follows_workspace_size_when_offered(fake_gpu_libs, monkeypatch):
    sim, step, plan = make_case()
    exact = 64 * 2**20
    monkeypatch.setattr(FakePrefillWrapper, "workspace_size", lambda self, *a, **k: (exact, 1 << 20), raising=False)
    backend = FlashInferPrefixBackend("cpu")
    check_prefix(backend, sim, step, plan)
    assert backend.workspace_bytes >= exact
    graph = FlashInferPrefixBackend("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=3, max_prompt_pages=10)
    exact = 2**34  # more than the graph-mode estimate: refused before planning, with the fix named
    with pytest.raises(PrefixBackendError, match="cannot grow in CUDA-graph mode"):
        check_prefix(graph, sim, step, plan)


def test_flashinfer_graph_mode_wrapper_per_batch_size_and_frozen_family(fake_gpu_libs, monkeypatch):
    backend = FlashInferPrefixBackend("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=96,
                                      max_prompt_pages=80)
    sim, step, plan = make_case(prompts=(300, 280), beams=96, pg=4, hq=2, hkv=1, d=64)
    check_prefix(backend, sim, step, plan)
    assert backend.kernel == "fa3"  # 96 beams over 300-token prompts on SM90
    w = FakePrefillWrapper.instances[-1]
    assert w.use_cuda_graph and len(w.bufs[0]) == 3 and len(w.bufs[2]) == 2 * 80 and w.max_total_num_rows == 2 * 96
    # Same batch size, now short prompts: the rule would say fa2, but the captured family stays.
    sim2, step2, plan2 = make_case(prompts=(5, 9), beams=96, pg=4, hq=2, hkv=1, d=64, seed=1)
    check_prefix(backend, sim2, step2, plan2)
    assert backend.kernel == "fa3" and FakePrefillWrapper.instances[-1] is w and len(w.plans) == 2
    # Another batch size gets its own graph wrapper, chosen by the rule.
    sim3, step3, plan3 = make_case(prompts=(5, 9, 3), beams=96, pg=4, hq=2, hkv=1, d=64, seed=2)
    check_prefix(backend, sim3, step3, plan3)
    assert backend.kernel == "fa2" and FakePrefillWrapper.instances[-1] is not w
    assert all(i.workspace is backend._workspace for i in FakePrefillWrapper.instances)
    # A larger attention shape needs more workspace than the first plan's sizing, at any capacity: the refusal
    # names the fix that works (a graph wrapper per attention shape), not larger capacities.
    sim4, step4, plan4 = make_case(prompts=(5, 9), beams=96, pg=4, hq=16, hkv=1, d=64, seed=3)
    with pytest.raises(PrefixBackendError, match=r"use a CUDA-graph wrapper per attention shape \(heads and head "):
        backend.plan(plan4, 16, 1, 64, 4, torch.bfloat16, 0.25)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fa4_backend_plumbing(fake_gpu_libs, monkeypatch, layout):
    monkeypatch.setattr(FA4PrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    sim, step, plan = make_case(layout=layout)
    backend = FA4PrefixBackend("cpu", kv_layout=layout)
    desc = check_prefix(backend, sim, step, plan)
    assert (desc.layout, desc.base) == ("HN", "ln")
    # Graph mode: the page table keeps max_prompt_pages columns, at a fixed address.
    graph = FA4PrefixBackend("cpu", kv_layout=layout, use_cuda_graph=True, max_requests=6, max_beam_width=3,
                             max_prompt_pages=12)
    check_prefix(graph, sim, step, plan)
    table = graph._views["page_table"]
    assert table.shape == (4, 12)
    sim2, step2, plan2 = make_case(prompts=(3, 30), layout=layout, seed=1)
    check_prefix(graph, sim2, step2, plan2)
    assert graph._views["page_table"].data_ptr() == table.data_ptr()


class FlashInfer06PrefillWrapper(FakePrefillWrapper):
    """The wrapper of the FlashInfer TensorRT-LLM pins (``flashinfer-python==0.6.0`` in its ``requirements.txt``;
    0.6.14 beside 1.3.0rc22), with the signatures of both wheels' ``BatchPrefillWithPagedKVCacheWrapper``: no
    ``max_total_num_rows`` (graph mode caps the rows at the first plan's), no ``uniform_q_len``, and ``run()``
    without ``lse_base``/``lse_layout``, returning its native base-2 ``[rows, heads]`` LSE."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf,
                         paged_kv_indices_buf, paged_kv_last_page_len_buf, backend)
        self.row_cap = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        rows = int(qo_indptr[-1])
        if self.use_cuda_graph:
            if self.row_cap is not None and rows > self.row_cap:
                raise ValueError(f"The total number of rows in qo_indptr {rows} in cuda graph mode cannot exceed the "
                                 f"number of rows set during initialization {self.row_cap}.")
            self.row_cap = self.row_cap or rows
        super().plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                     head_dim_qk, page_size, causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                     q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
                     non_blocking=non_blocking)

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False,
            enable_pdl=None, window_left=None):
        # The stand-in's LSE is already base 2 and [rows, heads]; the parent checks a caller that can pass the keywords.
        return super().run(q, paged_kv_cache, out=out, lse=lse, return_lse=return_lse, lse_base="log2",
                           lse_layout="NH")


def test_flashinfer_06_serves_through_its_own_signatures(fake_gpu_libs):
    """FlashInfer 0.6.x takes every argument whose loss would change results; the rest are left out, and its LSE is
    read as its native base-2 ``[rows, heads]``, eagerly and in CUDA-graph mode (one row count per batch size)."""
    fake_gpu_libs.BatchPrefillWithPagedKVCacheWrapper = FlashInfer06PrefillWrapper
    sim, step, plan = make_case()
    desc = check_prefix(FlashInferPrefixBackend("cpu"), sim, step, plan)
    assert (desc.layout, desc.base) == ("NH", "log2")
    (wrapper,) = FakePrefillWrapper.instances
    assert wrapper.plans[-1]["uniform_q_len"] is None and wrapper.plans[-1]["sm_scale"] == 0.25
    graph = FlashInferPrefixBackend("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=3, max_prompt_pages=10)
    for seed in (1, 2):
        sim, step, plan = make_case(prompts=(6, 30, 2, 11), seed=seed)
        check_prefix(graph, sim, step, plan)
    assert FakePrefillWrapper.instances[-1].row_cap == 4 * 3 and len(FakePrefillWrapper.instances[-1].plans) == 2
    # A wrapper whose first plan had fewer rows refuses more later: named as this backend's plan failure.
    graph = FlashInferPrefixBackend("cpu", use_cuda_graph=True, max_requests=4, max_beam_width=3, max_prompt_pages=10)
    check_prefix(graph, *make_case(beams=2))
    with pytest.raises(PrefixBackendError, match=r"FlashInfer fa2 plan failed for 4 requests x 3 beams .* cannot "
                                                 r"exceed the number of rows set during initialization 8"):
        check_prefix(graph, *make_case(beams=3))


class PdlRecordingPrefillWrapper(FakePrefillWrapper):
    """The stand-in with FlashInfer 0.7.4's ``enable_pdl`` keyword on ``run()`` (``None``: FlashInfer's default, on
    wherever the device has PDL), recording what each call passed."""

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse=False, lse_base=None, lse_layout=None,
            enable_pdl=None):
        self.pdl_passed = getattr(self, "pdl_passed", []) + [enable_pdl]
        return super().run(q, paged_kv_cache, out=out, lse=lse, return_lse=return_lse, lse_base=lse_base,
                           lse_layout=lse_layout)


@pytest.mark.parametrize("pdl", [True, False])
def test_flashinfer_launches_follow_the_librarys_pdl_switch(fake_gpu_libs, monkeypatch, pdl):
    """FlashInfer's prefill defaults to PDL on SM90 whatever ``TRTLLM_ENABLE_PDL`` says; the backend passes the
    library's own verdict for its device (``triton_kernels.launch.pdl_enabled``) on every call, so the switch turns
    off every launch of the step. A ``run()`` without the keyword (older wheels, the plain stand-in) gets none."""
    import triton_kernels.launch as launch_module

    asked = []
    monkeypatch.setattr(launch_module, "pdl_enabled", lambda device: asked.append(device) or pdl)
    fake_gpu_libs.BatchPrefillWithPagedKVCacheWrapper = PdlRecordingPrefillWrapper
    backend = FlashInferPrefixBackend("cpu")
    for seed in (1, 2):
        check_prefix(backend, *make_case(seed=seed))
    (wrapper,) = FakePrefillWrapper.instances
    assert wrapper.pdl_passed == [pdl, pdl] and asked and set(asked) == {torch.device("cpu")}


@pytest.mark.parametrize("version, named", [
    ("0.6.0", True), ("0.6.14", True), ("0.7.3", True), ("0.7.4", False), ("0.7.4+cu130", False), ("0.8.0rc1", False),
    ("", False),
])
def test_an_older_flashinfer_is_named_once(monkeypatch, caplog, version, named):
    """A FlashInfer older than the one the library was measured with serves, and is named once, with the version."""
    import importlib.machinery
    import logging
    import sys
    import types

    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.__version__ = version
    module.BatchPrefillWithPagedKVCacheWrapper = FlashInfer06PrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi_module, "_FLASHINFER_STATE", {})
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix"):
        assert fi_module._import_flashinfer() is module and fi_module._import_flashinfer() is module
    named_lines = [r.getMessage() for r in caplog.records if "older than 0.7.4" in r.getMessage()]
    expected = (f"beam_shared_prefix: flashinfer {version} is older than 0.7.4, the oldest this library was tested and "
                "measured with. It serves (its wrapper's arguments are checked at every plan), but its speed here is "
                "unmeasured; docs/trtllm.md, 'Inside a TensorRT-LLM environment'.")
    assert named_lines == ([expected] if named else [])


def test_the_measured_flashinfer_is_the_extras_floor():
    import pathlib
    import re

    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    floors = set(re.findall(r'"flashinfer-python>=([\d.]+)"', pyproject))
    assert floors == {fi_module.FLASHINFER_FLOOR}


def test_flashinfer_without_a_semantic_argument_declines(fake_gpu_libs):
    """A FlashInfer whose plan() lost ``sm_scale`` (a rename) would run with its default scale: refused by
    name instead of the argument being dropped like the optional ones."""

    class RenamedScale(FakePrefillWrapper):
        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, causal=False, pos_encoding_mode="NONE", softmax_scale=None,
                 q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True, uniform_q_len=None):
            raise AssertionError("planned without sm_scale")

    fake_gpu_libs.BatchPrefillWithPagedKVCacheWrapper = RenamedScale
    _, _, plan = make_case()
    with pytest.raises(PrefixBackendError, match=r"takes no \['sm_scale'\]: it would run with its own defaults"):
        FlashInferPrefixBackend("cpu").plan(plan, 4, 2, 16, 4, torch.bfloat16, 0.25)


def test_fa4_without_scale_or_causal_declines(monkeypatch):
    """An FA4 whose forward lost ``softmax_scale`` or ``causal`` would run with its defaults: declined."""
    import importlib.machinery
    import sys
    import types

    def forward(q, k, v, cu_seqlens_q=None, seqused_k=None, max_seqlen_q=None, page_table=None, causal=False,
                return_lse=False, out=None, lse=None):
        raise AssertionError("called without softmax_scale")

    modules = {}
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name != "flash_attn.cute.interface")
        modules[name] = module
    modules["flash_attn.cute.interface"]._flash_attn_fwd = forward
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fa4_module, "_FA4_STATE", {})
    assert fa4_module._import_fa4_forward() is None
    assert "lacks ['softmax_scale']" in fa4_module._FA4_STATE["reason"]


@pytest.mark.parametrize("capability,page_size,beams,declined", [
    ((9, 0), 128, 3, True),  # the TMA paged path (page size = key tile)
    ((9, 0), 256, 1, False),  # SM90 masks pages larger than its tile
    ((10, 0), 256, 1, True),  # SM100's one-row decode kernel loads 128-token units
    ((10, 0), 256, 2, False),
    ((10, 0), 96, 1, False),
])
def test_fa4_declines_the_kernels_that_load_whole_pages(fake_gpu_libs, monkeypatch, capability, page_size, beams,
                                                         declined):
    """The slots past a prompt in its last page hold unwritten memory: NaN bits there poison V even at zero
    weight, so FA4's kernels that load whole pages are declined, at plan() and in ``auto``'s choice."""
    from beam_shared_prefix.prefix import choose_prefix_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(FA4PrefixBackend, "is_available", classmethod(
        lambda cls, device, dtype, head_dim, hq=None, hkv=None, page_size=None, layout="HND":
        (fa4_module.whole_page_reason(device, page_size) is None, fa4_module.whole_page_reason(device, page_size))))
    reason = fa4_module.whole_page_reason("cuda", page_size, beams)
    assert (reason is not None) == declined
    sim, step, plan = make_case(prompts=(page_size + 5, 3), beams=beams, pg=page_size)
    backend = FA4PrefixBackend("cpu")
    if declined:
        with pytest.raises(PrefixBackendError, match="loads whole|reads whole pages"):
            backend.plan(plan, 4, 2, 16, page_size, torch.bfloat16, 0.25)
    else:
        check_prefix(backend, sim, step, plan)
    name, why = choose_prefix_backend("cuda", torch.bfloat16, 128, 64, 8, page_size, mean_prompt_len=4000,
                                      beam_width=beams, num_requests=128)
    assert (name != "fa4") == declined and (not declined or any(reason in w for w in why))
    # An explicit backend="fa4" falls back to FlashInfer there, as for any shape FA4 does not serve.
    from beam_shared_prefix.prefix import resolve_prefix_backend

    monkeypatch.setattr(FlashInferPrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    assert resolve_prefix_backend("fa4", "cuda", torch.bfloat16, 128, 64, 8, page_size,
                                  beam_width=beams) == ("flashinfer" if declined else "fa4")


@pytest.mark.parametrize("requested", ["auto", "fa4"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_a_one_beam_plan_is_not_served_by_a_wider_plans_fa4(fake_gpu_libs, monkeypatch, requested, graph):
    """On SM100 with pages of 256 tokens one beam rules FA4 out (:func:`fa4_module.whole_page_reason`): a wrapper that
    planned two beams on FA4 chooses afresh for one beam, as a new wrapper does (it reused FA4 from its choice cache,
    whose plan then refused the step)."""
    from beam_shared_prefix.prefix import select

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(FA4PrefixBackend, "is_available", classmethod(
        lambda cls, device, dtype, head_dim, hq=None, hkv=None, page_size=None, layout="HND":
        (fa4_module.whole_page_reason(device, page_size) is None, fa4_module.whole_page_reason(device, page_size))))
    monkeypatch.setattr(FlashInferPrefixBackend, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    real = select.resolve_prefix_backend  # asked as on the GPU the wrapper would run on
    monkeypatch.setattr(attention_module, "resolve_prefix_backend",
                        lambda requested, device, *a, **k: real(requested, "cuda", *a, **k))
    caps = dict(use_cuda_graph=True, max_requests=1, max_beam_width=4, max_prompt_pages=2) if graph else {}

    def plan(att, beams):  # GQA 16, where neither the cascade nor FlashInfer's split prompt is preferred
        att.plan([0, 2], [0, 1], [300], beams, 16, 1, 128, 256, 8, torch.bfloat16)
        return att.backend_name

    assert plan(BeamSharedPrefixAttention("cpu", backend=requested, tail_impl="triton", **caps), 1) == "flashinfer"
    att = BeamSharedPrefixAttention("cpu", backend=requested, tail_impl="triton", **caps)
    assert [plan(att, 2), plan(att, 1), plan(att, 2)] == ["fa4", "flashinfer", "fa4"]


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["flashinfer", "fa4"])
def test_wrapper_steps_through_each_lse_convention(fake_gpu_libs, monkeypatch, backend):
    """Whole steps with the stand-in prefix and the Triton tail: NH/log2 and HN/ln reach the tail intact."""
    for cls in (FA4PrefixBackend, FlashInferPrefixBackend):
        monkeypatch.setattr(cls, "is_available", classmethod(lambda cls, *a, **k: (True, "")))
    monkeypatch.setattr(attention_module, "resolve_prefix_backend", lambda requested, *a, **k: requested)
    sim = BeamSearchCacheSimulator([5, 17, 1], beam_width=3, num_qo_heads=6, num_kv_heads=2, head_dim=16, page_size=4,
                                   max_seq_len=40, dtype=torch.bfloat16, seed=4)
    att = BeamSharedPrefixAttention("cpu", backend=backend, tail_impl="triton", check=True)
    for _ in range(3):
        step = sim.begin_step()
        att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, 3, 6, 2, 16, 4,
                 sim.num_pages, torch.bfloat16, key=tuple(step.request_ids))
        ref = reference_beam_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                       step.cache_indirection, 3, new_k=step.new_k, new_v=step.new_v)
        out = torch.full_like(step.q, float("nan"))
        att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, step.new_k,
                step.new_v, out=out)
        torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)
        sim.end_step(write_kv=False)
    assert att.backend_name == backend and att.num_backend_plans == 1


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("strided", [False, True], ids=["pool", "layer-view"])
def test_kv_planes_read_each_slot_as_the_layout_places_it(kv_layout, strided):
    """``kv_planes``' ``k[page, slot]`` is the slot's ``[Hkv, D]``, element by element as the layout places it, on a
    pool and on a strided layer view of a bigger one (TensorRT-LLM's); the planes are views (a write lands in the
    pool), and the kernels' torch twin reads the same elements."""
    from beam_shared_prefix.prefix.base import kv_planes
    from triton_kernels.tail_merge_torch import _pool_kv

    pages, heads, page_size, dim = 5, 3, 4, 8
    shape = (pages, 2, heads, page_size, dim) if kv_layout == "HND" else (pages, 2, page_size, heads, dim)
    pool = torch.randn(shape, dtype=torch.float32)
    if strided:  # the layer's slice of a [pages, layers, 2, ...] buffer
        pool = torch.randn(pages, 3, *shape[1:], dtype=torch.float32)[:, 1]
    k, v = kv_planes(pool, kv_layout)
    assert k.shape == v.shape == (pages, page_size, heads, dim)
    for page in range(pages):
        for slot in range(page_size):
            for h in range(heads):
                index = (h, slot) if kv_layout == "HND" else (slot, h)
                assert torch.equal(k[page, slot, h], pool[(page, 0, *index)])
                assert torch.equal(v[page, slot, h], pool[(page, 1, *index)])
    for which, plane in enumerate((k, v)):
        assert torch.equal(_pool_kv(pool, kv_layout, which), plane)
    k[2, 3, 1] = 7.0
    assert torch.all(pool[(2, 0, 1, 3) if kv_layout == "HND" else (2, 0, 3, 1)] == 7.0)
