"""The per-beam step checks of ``step_args`` that every launcher shares, through the launchers (a mutation-testing
pass, sixty-ninth round, found these rules unpinned).

Every case starts from a valid step of the beam-search simulator (fresh random pool and queries), changes one
argument, and expects both tail launchers (the Triton kernel, interpreted on CPU, and its torch twin) to refuse it
with a :class:`KernelInputError` naming the argument, the value and the limit, with ``out`` and the pool untouched.
The step's own K/V and ``out`` checks are the tail launcher's; ``out`` aliasing the pool is the cascade launcher's
(the tail launcher has its own overlap list).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.reference import reference_prefix_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import (
    KernelInputError,
    beam_cascade_attention,
    beam_tail_attention_merge,
    beam_tail_attention_merge_torch,
)

IMPLS = {"triton": beam_tail_attention_merge, "torch": beam_tail_attention_merge_torch}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sim(seed, prompts=(5, 3), beams=2, hq=6, hkv=2, d=64):
    return BeamSearchCacheSimulator(list(prompts), beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    page_size=16, max_seq_len=64, kv_layout="HND", dtype=torch.bfloat16,
                                    device=DEVICE, seed=seed)


def _tail_args(seed, **sim_kw):
    """A valid tail call; by default 2 requests (prompts 5, 3) of 2 beams, Hq=6, Hkv=2, D=64, pages of 16 tokens,
    max_seq_len 64 (a 4-column page table): rows = 4."""
    sim = _sim(seed, **sim_kw)
    step = sim.begin_step()
    po, pl = reference_prefix_attention(step.q, sim.kv_cache, step.prompt_page_indptr, step.prompt_page_indices,
                                        step.prompt_lens_per_request, step.beam_width, kv_layout=sim.kv_layout)
    return dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache,
                beam_page_table=step.beam_page_table, kv_lens=step.kv_lens, prompt_lens=step.prompt_lens,
                cache_indirection=step.cache_indirection, beam_width=step.beam_width, prefix_out=po, prefix_lse=pl,
                out=torch.full_like(step.q, 7.0))


def _refused(call, args, message):
    """``call(**args)`` raises KernelInputError containing ``message``; out and the pool unchanged (out may be a
    view of the pool)."""
    out_before, pool_before = args["out"].clone(), args["kv_cache"].clone()
    with pytest.raises(KernelInputError, match=re.escape(message)):
        call(**args)
    assert torch.equal(args["out"], out_before) and torch.equal(args["kv_cache"], pool_before)


def _strided(x):
    """``x`` (1-D) as a stride-2 view with the same values."""
    return torch.stack([x, x + 1000], 1)[:, 0]


BAD_STEP_ARGS = [
    ("new_k_dtype", lambda a: dict(new_k=a["new_k"].half(), new_v=a["new_v"].half()),
     "new_k has dtype torch.float16 but q has torch.bfloat16"),
    ("new_v_shape", lambda a: dict(new_v=a["new_v"][:, :1]),
     "new_k (4, 2, 64) and new_v (4, 1, 64) must have the same"),
    ("new_k_rows", lambda a: dict(new_k=a["new_k"][:3], new_v=a["new_v"][:3]),
     "new_k must be [rows=4, Hkv, D=64] like q, got (3, 2, 64)"),
    ("pool_three_planes", lambda a: dict(kv_cache=torch.zeros(a["kv_cache"].shape[0], 3, *a["kv_cache"].shape[2:],
                                                               dtype=a["kv_cache"].dtype, device=DEVICE)),
     "kv_cache dim 1 must be 2 (K, V)"),
    ("pool_head_dim", lambda a: dict(kv_cache=a["kv_cache"][..., :32]),
     "kv_cache (HND) holds Hkv=2, D=32 but new_k has Hkv=2, D=64"),
    ("empty_pool", lambda a: dict(kv_cache=a["kv_cache"][:0]), "kv_cache has 0 pages of 16 tokens; both must be >= 1"),
    ("kv_lens_longer", lambda a: dict(kv_lens=torch.cat([a["kv_lens"], a["kv_lens"][:1]])),
     "kv_lens has 5 entries but q has 4 rows"),
    ("prompt_lens_longer", lambda a: dict(prompt_lens=torch.cat([a["prompt_lens"], a["prompt_lens"][:1]])),
     "prompt_lens has 5 entries but q has 4 rows"),
    # One page-table row short of the batch: the kernel would read the row past the table.
    ("table_one_row_short", lambda a: dict(beam_page_table=a["beam_page_table"][:3]),
     "beam_page_table has 3 rows but q has 4"),
    ("indirection_one_request_short", lambda a: dict(cache_indirection=a["cache_indirection"][:1]),
     "cache_indirection has 1 request rows but the batch has R=2"),
    # One column short of max_seq_len (48 of 64 positions): the last page's positions have no column.
    ("table_one_column_short", lambda a: dict(beam_page_table=a["beam_page_table"][:, :3]),
     "beam_page_table has 3 columns of 16 tokens (48 positions) but cache_indirection covers max_seq_len=64"),
    ("out_dtype", lambda a: dict(out=a["out"].half()), "out has dtype torch.float16 but q has torch.bfloat16"),
    ("out_heads", lambda a: dict(out=a["out"][:, :5]), "out must be [rows=4, Hq=6, D=64], got (4, 5, 64)"),
    ("divisor_bool", lambda a: dict(page_index_divisor=True), "page_index_divisor=True must be an int in [1, "),
    ("beam_width_bool", lambda a: dict(beam_width=True), "beam_width=True must be an int >= 1"),
    # No position: no kv_len (>= 1) fits, so every row would be masked and the step's K/V never written.
    ("indirection_no_positions", lambda a: dict(cache_indirection=a["cache_indirection"][:, :, :0]),
     "cache_indirection is (2, 2, 0): max_seq_len=0 holds no position"),
    # The kernels take sm_scale * log2(e) as a normal float32: past it, inf (NaN out) or 0 (-inf * 0 = NaN).
    ("sm_scale_past_float32", lambda a: dict(sm_scale=1e39), "sm_scale=1e+39 is outside ["),
    ("sm_scale_under_float32", lambda a: dict(sm_scale=1e-300), "sm_scale=1e-300 is outside ["),
    ("sm_scale_bool", lambda a: dict(sm_scale=True), "sm_scale=True is a bool"),
    # bool() would read these strings as on.
    ("write_kv_string", lambda a: dict(write_kv="False"), "write_kv='False' must be True or False"),
    # An int other than 0 or 1 is no switch either: refused, not read as on.
    ("write_kv_two", lambda a: dict(write_kv=2), "write_kv=2 must be True or False"),
    ("validate_indices_string", lambda a: dict(validate_indices="off"), "validate_indices='off' must be True or False"),
]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name,change,message", BAD_STEP_ARGS, ids=[c[0] for c in BAD_STEP_ARGS])
def test_tail_launchers_refuse_bad_step_args(impl, name, change, message):
    """Each bad step argument is refused by both tail launchers, by name, before any write."""
    args = _tail_args(seed=[c[0] for c in BAD_STEP_ARGS].index(name))
    args.update(change(args))
    _refused(IMPLS[impl], args, message)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", ["kv_lens", "prompt_lens"])
def test_a_strided_length_vector_of_two_rows_is_refused(impl, name):
    """A batch of two beam rows (one request, W=2) whose lengths are a stride-2 view: read at unit stride, row 1
    would get another value. Refused, naming the stride."""
    args = _tail_args(seed=40 + len(name), prompts=(7,))
    assert args["q"].shape[0] == 2
    args[name] = _strided(args[name])
    _refused(IMPLS[impl], args, f"{name} has stride 2; the kernels read one int32 per row at unit stride")


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", ["new_k", "kv_cache", "beam_page_table", "kv_lens", "prompt_lens",
                                  "cache_indirection", "prefix_lse", "out"])
def test_tail_launchers_refuse_a_tensor_on_another_device(impl, name):
    """A tensor on another device than q's ("meta": shapes and strides without data, which a CPU machine can
    make) is refused, naming the tensor and both devices, before anything reads it."""
    args = _tail_args(seed=50)
    args[name] = args[name].to("meta")
    with pytest.raises(KernelInputError, match=re.escape(f"{name} is on meta but q is on {args['q'].device}")):
        IMPLS[impl](**args)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_switches_take_bools_numpy_bools_and_0_or_1(impl):
    """``write_kv`` as ``np.False_`` or 0 leaves the pool unwritten and ``True``/``np.True_``/1 write it (numpy 2
    names its bool type ``bool``, numpy 1 ``bool_``); a numpy bool ``sm_scale`` is refused as a bool."""
    import numpy as np

    for value, writes in ((np.False_, False), (0, False), (np.True_, True), (1, True)):
        args = _tail_args(seed=52)
        before = args["kv_cache"].clone()
        IMPLS[impl](**args, write_kv=value)
        assert torch.equal(args["kv_cache"], before) != writes, value
    _refused(IMPLS[impl], dict(_tail_args(seed=53), sm_scale=np.True_), f"sm_scale={np.True_!r} is a bool")


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("layout", ["fresh", "views_at_one_offset", "views_apart"])
def test_tail_launchers_refuse_meta_tensors_by_name(impl, layout):
    """Every tensor on the meta device (shapes without memory): the metadata checks take it, and the every-call
    overlap check names the device rather than read the addresses as an overlap ("out overlaps q") or let a kernel
    reach for the data. Fresh meta tensors sit at address 0; views at an offset (one layer of a pool, the K part of
    a fused QKV) do not, and were reported as an overlap, or, apart, failed inside the kernel or torch."""
    offsets = iter(range(1, 10**3))

    def meta(x):
        offset = {"fresh": 0, "views_at_one_offset": 1, "views_apart": next(offsets) * 10**6}[layout]
        base = torch.empty((x.shape[0] + offset, *x.shape[1:]), dtype=x.dtype, device="meta")
        return base[offset:]

    args = {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in _tail_args(seed=51).items()}
    with pytest.raises(KernelInputError, match=re.escape("out is on the meta device, which holds no data")):
        IMPLS[impl](**args)


def _cascade_args(seed):
    """A valid cascade call: 2 requests (prompts 5, 9) of 2 beams, Hq=4, Hkv=2, D=64, pages of 16 tokens."""
    sim = _sim(seed, prompts=(5, 9), beams=2, hq=4, hkv=2, d=64)
    step = sim.begin_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           step.beam_width, step.page_size, step.num_pages)
    return dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache,
                prompt_page_table=torch.from_numpy(plan.page_table.copy()).to(DEVICE),
                beam_page_table=step.beam_page_table, kv_lens=step.kv_lens, prompt_lens=step.prompt_lens,
                cache_indirection=step.cache_indirection, beam_width=step.beam_width,
                out=torch.full_like(step.q, 7.0), kv_layout=sim.kv_layout)


def _carve(shape, buffer, offset):
    """A view of ``shape`` into the flat ``buffer`` from element ``offset`` on."""
    n = math.prod(shape)
    return buffer[offset: offset + n].view(shape)


@pytest.mark.parametrize("other", ["kv_cache", "new_k", "new_v"])
def test_cascade_refuses_an_out_over_what_it_reads(other):
    """An out that shares memory with the pool (the kernel's output would overwrite cached K/V, and its K/V write
    the output) or with the step's new K or V (programs still to run would store the overwritten values into the
    pool) is refused by the cascade launcher."""
    args = _cascade_args(seed=60)
    rows, hq, d = args["q"].shape
    if other == "kv_cache":
        page_elems = args["kv_cache"][0].numel()
        args["out"] = args["kv_cache"].view(-1)[3 * page_elems: 3 * page_elems + rows * hq * d].view(rows, hq, d)
    else:  # new_k or new_v at the start of one buffer, out over all of it
        buffer = torch.full((rows * hq * d,), 7.0, dtype=args["q"].dtype, device=DEVICE)
        args[other] = _carve(args[other].shape, buffer, 0).copy_(args[other])
        args["out"] = _carve((rows, hq, d), buffer, 0)
    _refused(beam_cascade_attention, args, f"out overlaps {other} in memory")


def test_q_and_out_back_to_back_in_one_buffer_are_served():
    """q and out carved back to back from one workspace touch but share no byte: served, with the output and the
    pool of the same call on buffers of their own."""
    args = _cascade_args(seed=63)
    rows, hq, d = args["q"].shape
    pool_before = args["kv_cache"].clone()
    expected = torch.full_like(args["out"], 7.0)
    beam_cascade_attention(**dict(args, out=expected))
    expected_pool, args["kv_cache"] = args["kv_cache"], pool_before
    buffer = torch.full((2 * rows * hq * d,), 7.0, dtype=args["q"].dtype, device=DEVICE)
    args["q"] = _carve((rows, hq, d), buffer, 0).copy_(args["q"])
    args["out"] = _carve((rows, hq, d), buffer, rows * hq * d)
    beam_cascade_attention(**args)
    assert torch.equal(args["out"], expected) and torch.equal(args["kv_cache"], expected_pool)


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(cache_indirection=a["cache_indirection"][:, :, :0]), "max_seq_len=0 holds no position"),
    (lambda a: dict(write_kv="no"), "write_kv='no' must be True or False"),
    (lambda a: dict(sm_scale=1e39), "sm_scale=1e+39 is outside ["),
], ids=["indirection_no_positions", "write_kv_string", "sm_scale_past_float32"])
def test_cascade_refuses_what_the_tail_launchers_refuse(change, message):
    """The cascade launcher shares the step checks: the same bad values, refused by name before any write."""
    args = _cascade_args(seed=61)
    args.update(change(args))
    _refused(beam_cascade_attention, args, message)


def test_the_prefix_stage_refuses_a_zero_dim_out_by_name():
    """A 0-d ``out`` is refused by its shape rule, not by an IndexError from the contiguity check run before it."""
    from triton_kernels import beam_prefix_attention

    a = _cascade_args(seed=62)
    rows, hq, _ = a["q"].shape
    with pytest.raises(KernelInputError, match=re.escape("out must be [rows, Hq, D] (3-D), got shape ()")):
        beam_prefix_attention(a["q"], a["kv_cache"], a["prompt_page_table"], a["prompt_lens"][::2].contiguous(),
                              a["beam_width"], torch.empty((), dtype=a["q"].dtype, device=DEVICE),
                              torch.empty(rows, hq, device=DEVICE), kv_layout=a["kv_layout"])


@pytest.mark.parametrize("head_span,refused", [(2**31 - 1, False), (2**31, True)])
def test_a_pool_whose_heads_span_int32_is_refused_at_the_bound(head_span, refused):
    """The kernels add a head's offset within a page in int32: a pool view whose heads and slots span 2**31
    elements is refused, one element less passes. Built on the "meta" device (strides without memory) and checked
    by ``check_step_metadata`` (the launchers' metadata check; the overlap checks compare real addresses)."""
    from triton_kernels.step_args import check_step_metadata

    rows, hq, hkv, d, pg = 2, 2, 2, 64, 1
    meta = dict(device="meta")
    # [pages=1, 2, Hkv=2, Pg=1, D]: K and V planes 64 apart, the second head (head_span - D) elements on.
    kv = torch.empty(1, **meta, dtype=torch.bfloat16).as_strided((1, 2, hkv, pg, d), (2**40, d, head_span - d, d, 1))
    args = dict(q=torch.empty(rows, hq, d, dtype=torch.bfloat16, **meta),
                new_k=torch.empty(rows, hkv, d, dtype=torch.bfloat16, **meta),
                new_v=torch.empty(rows, hkv, d, dtype=torch.bfloat16, **meta), kv_cache=kv,
                beam_page_table=torch.empty(rows, 4, dtype=torch.int32, **meta),
                kv_lens=torch.empty(rows, dtype=torch.int32, **meta),
                prompt_lens=torch.empty(rows, dtype=torch.int32, **meta),
                cache_indirection=torch.empty(1, 2, 4, dtype=torch.int32, **meta), beam_width=2,
                out=torch.empty(rows, hq, d, dtype=torch.bfloat16, **meta))
    if refused:
        with pytest.raises(KernelInputError, match=re.escape(f"kv_cache's heads and slots span {2**31} elements")):
            check_step_metadata(**args)
    else:
        geom = check_step_metadata(**args)
        assert geom.kv_strides == (2**40, d, head_span - d, d)
