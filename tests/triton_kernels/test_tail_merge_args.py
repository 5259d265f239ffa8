"""The launchers' byte spans (``step_args.byte_span``), which the overlap checks compare: against every element's
address, for contiguous tensors (the fast path) and strided views (the general one). The memoized checks
(``memo.memoize_metadata_check``): a verdict is reused for equal metadata only, and agrees with the check.
The public names ``tail_merge_args`` held before the split into ``step_args`` and ``memo`` still import from it, and
the conventions the kernels' package and the core package each define agree."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_shared_prefix.reference import reference_prefix_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import (
    TailLaunchConfig,
    beam_tail_attention_merge,
    beam_tail_attention_merge_torch,
    memo,
    step_args,
    tail_merge_args,
)
from triton_kernels.memo import memoize_metadata_check
from triton_kernels.step_args import (
    KernelInputError,
    byte_span,
    check_step_args,
    spans_overlap,
)
from triton_kernels.tail_merge_args import check_tail_merge_args


def addresses(x: torch.Tensor) -> torch.Tensor:
    """Every element's byte address, from its index and the strides (no formula shared with the code)."""
    offsets = torch.zeros(x.shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(x.shape, x.stride())):
        shape = [1] * x.dim()
        shape[dim] = size
        offsets = offsets + (torch.arange(size, dtype=torch.int64) * stride).view(shape)
    return x.data_ptr() + offsets * x.element_size()


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    strides=st.lists(st.integers(0, 7), min_size=4, max_size=4),
    offset=st.integers(0, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int32]),
    contiguous=st.booleans(),
)
def test_byte_span_is_the_elements_address_range(shape, strides, offset, dtype, contiguous):
    base = torch.empty(4096, dtype=dtype)
    if contiguous:
        x = base[offset:offset + int(torch.tensor(shape).prod())].view(shape)
    else:
        x = base.as_strided(shape, strides[:len(shape)], offset)
    span = byte_span(x)
    if x.numel() == 0:
        assert span is None
        return
    a = addresses(x)
    assert span == (int(a.min()), int(a.max()) + x.element_size()), (shape, x.stride(), span)


def test_spans_overlap_is_byte_exact():
    base = torch.empty(64, dtype=torch.float32)
    left, right = base[:16], base[16:32]
    assert not spans_overlap(byte_span(left), byte_span(right))
    assert spans_overlap(byte_span(base[:17]), byte_span(right))
    assert spans_overlap(byte_span(base[::4]), byte_span(base[1:2]))  # strided: the range, not the elements
    assert not spans_overlap(byte_span(base[:0]), byte_span(base))


# --------------------------------------------------------------------------------------------
# memoized checks


def test_memoized_check_keeps_a_verdict_for_equal_metadata_only(monkeypatch):
    """A kept verdict is reused only for arguments whose every tensor has the same type, shape, strides,
    dtype and device (wherever it lies) and whose scalars have the same type and value; a failing check is
    never kept, an argument no key describes is checked every time, and the store starts over when full."""
    calls = []

    @memoize_metadata_check
    def check(x, scale=None, names=()):
        calls.append(1)
        if scale is True:
            raise ValueError("a bool is not a scale")
        return (tuple(x.shape), scale)

    base = torch.randn(8, 4)
    assert check(base) == ((8, 4), None) and len(calls) == 1
    assert check(base) == ((8, 4), None) and len(calls) == 1  # kept
    assert check(base.view(8, 4)) == ((8, 4), None) and len(calls) == 1  # another view, equal metadata: kept
    assert check(base.clone()) == ((8, 4), None) and len(calls) == 1  # elsewhere, equal metadata: kept
    others = [base.as_strided((8, 4), (1, 8)), base.t(), base[:4], base.to(torch.float64),
              base[1:].view(7, 4), base.view(torch.int32), torch.nn.Parameter(base)]
    for i, other in enumerate(others):
        check(other)
        assert len(calls) == 2 + i, other.stride()
    n = len(calls)
    for kwargs in (dict(scale=1), dict(scale=1.0), dict(scale="1"), dict(names=(("a", base),)),
                   dict(names=(("a", base.t()),))):
        check(base, **kwargs)
        assert len(calls) == n + 1, kwargs
        n += 1
    for _ in range(2):
        with pytest.raises(ValueError, match="a bool is not a scale"):
            check(base, scale=True)  # True == 1 as a dict key, but its type differs: checked, and failing again
    assert len(calls) == n + 2
    check(base, names=[base])
    check(base, names=[base])  # a list: no key, checked each time
    assert len(calls) == n + 4
    monkeypatch.setattr(memo, "METADATA_CHECKS_KEPT", len(check.kept))
    check(base[:2])  # full: the store starts over with this one
    assert len(check.kept) == 1


def _valid_tail_args():
    """Arguments of a valid 2-request, 3-beam step (GQA 2, head 16, page 4), fresh random data."""
    rows, hq, hkv, d, pg = 6, 4, 2, 16, 4
    kv = torch.randn(12, 2, hkv, pg, d, dtype=torch.bfloat16)
    return dict(
        q=torch.randn(rows, hq, d, dtype=torch.bfloat16), new_k=torch.randn(rows, hkv, d, dtype=torch.bfloat16),
        new_v=torch.randn(rows, hkv, d, dtype=torch.bfloat16), kv_cache=kv,
        beam_page_table=torch.randint(0, 12, (rows, 4), dtype=torch.int32),
        kv_lens=torch.full((2 * rows,), 9, dtype=torch.int32)[:rows],
        prompt_lens=torch.full((rows,), 5, dtype=torch.int32),
        cache_indirection=torch.zeros(2, 3, 16, dtype=torch.int32), beam_width=3,
        prefix_out=torch.randn(rows, hq, d), prefix_lse=torch.randn(rows, hq),
        out=torch.empty(rows, hq, d, dtype=torch.bfloat16),
    )


# Changes to a valid argument set: some keep it valid with other metadata, some break it.
_CHANGES = [
    ("none", lambda a: {}),
    ("fresh_q", lambda a: dict(q=a["q"].clone())),
    ("q_strided_view", lambda a: dict(q=torch.randn(6, 8, 16, dtype=torch.bfloat16)[:, ::2])),
    ("q_fp16", lambda a: dict(q=a["q"].half())),
    ("q_fp16_in_place", lambda a: dict(q=a["q"].view(torch.float16))),  # the same address and shape
    ("out_is_q", lambda a: dict(out=a["q"])),
    ("out_transposed", lambda a: dict(out=a["out"].transpose(1, 2))),
    ("kv_lens_int64", lambda a: dict(kv_lens=a["kv_lens"].long())),
    ("kv_lens_strided", lambda a: dict(kv_lens=a["kv_lens"].repeat(2)[::2])),
    # the same address and shape, other strides
    ("kv_lens_strided_in_place", lambda a: dict(kv_lens=a["kv_lens"].as_strided((6,), (2,)))),
    ("narrow_page_table", lambda a: dict(beam_page_table=a["beam_page_table"][:, :3])),
    ("beam_width_2", lambda a: dict(beam_width=2)),
    ("beam_width_true", lambda a: dict(beam_width=True)),
    ("sm_scale", lambda a: dict(sm_scale=0.25)),
    ("sm_scale_negative", lambda a: dict(sm_scale=-0.25)),
    ("nhd", lambda a: dict(kv_layout="NHD")),
    ("lse_hn", lambda a: dict(prefix_lse_layout="HN")),
    ("lse_hn_transposed", lambda a: dict(prefix_lse_layout="HN", prefix_lse=a["prefix_lse"].t())),
    ("lse_ln", lambda a: dict(prefix_lse_base="ln")),
    ("prefix_out_is_out", lambda a: dict(prefix_out=a["out"])),
]


def _forget_kept_checks():
    for kept in memo._KEPT_STORES:
        kept.clear()
    assert not check_tail_merge_args.kept and not check_step_args.kept


def _step_check(prefix_out, prefix_lse, prefix_lse_layout="NH", prefix_lse_base="log2", **args):
    """:func:`check_step_args` as the cascade's launcher calls it, an extra tensor included."""
    return check_step_args(**args, extra_tensors=(("prompt_page_table", prefix_out),))


def _outcome(args, fresh=False):
    """``("ok", geometry)`` or ``("error", message)`` of :func:`check_tail_merge_args` and of
    :func:`check_step_args`; ``fresh``: with every kept verdict of every memoized check dropped first, i.e.
    the checks themselves."""
    outcomes = []
    for check in (check_tail_merge_args, _step_check):
        if fresh:
            _forget_kept_checks()
        try:
            outcomes.append(("ok", check(**args)))
        except KernelInputError as exc:
            outcomes.append(("error", str(exc)))
    return outcomes


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, len(_CHANGES) - 1), min_size=1, max_size=12))
def test_memoized_tail_check_agrees_with_the_check_itself(picks):
    """Over a sequence of argument sets (valid and not, with metadata repeating across the sequence, in both
    orders), the memoized :func:`check_tail_merge_args` and :func:`check_step_args` give the geometry or the
    error the checks themselves give."""
    base = _valid_tail_args()
    sequence = [(name, {**base, **change(base)}) for name, change in (_CHANGES[i] for i in picks + picks[::-1])]
    expected = [_outcome(args, fresh=True) for _, args in sequence]
    _forget_kept_checks()
    for (name, args), want in zip(sequence, expected, strict=True):
        assert _outcome(args) == want, name


def test_launch_configurations_take_ints_not_bools():
    """``True`` is an int equal to 1 in Python; a launch configuration takes it for no power of two."""
    assert [step_args.is_pow2(x) for x in (1, 2, 64, True, 0, 3, 2.0)] == [True, True, True, False, False, False,
                                                                           False]


def test_tail_merge_args_keeps_the_names_it_exported():
    """Every public name ``tail_merge_args`` exported before the split still imports from it, as the owner module's
    object (``TailMergeInputError`` is ``KernelInputError``, here and in the package)."""
    import triton_kernels

    for name in tail_merge_args.__all__:
        kept = getattr(tail_merge_args, name)
        for owner in (step_args, memo):
            if hasattr(owner, name):
                assert kept is getattr(owner, name), name
    for name in ("KV_DTYPES", "KV_LAYOUTS", "is_pow2", "pool_layout", "resolve_sm_scale", "runs_interpreted"):
        assert getattr(tail_merge_args, name) is getattr(step_args, name), name
    assert tail_merge_args.TailMergeInputError is step_args.KernelInputError is triton_kernels.TailMergeInputError
    assert triton_kernels.KernelInputError is step_args.KernelInputError
    assert not hasattr(tail_merge_args, "METADATA_CHECKS_KEPT")  # patch memo's: a copy here would patch nothing


def test_conventions_agree_with_the_core_package():
    """The conventions defined both here and in the core package (which cannot import this package: its
    ``__init__`` imports Triton) agree: ``LOG2E``, the KV layouts, the LSE layouts and bases."""
    from beam_shared_prefix import reference
    from beam_shared_prefix.prefix import base

    assert step_args.LOG2E == reference.LOG2E == base.LOG2E
    assert step_args.KV_LAYOUTS == base.KV_LAYOUTS
    assert tail_merge_args.LSE_LAYOUTS == base.LSE_LAYOUTS
    assert tail_merge_args.LSE_BASES == base.LSE_BASES


# Argument checks a mutation-testing pass found unpinned (sixty-ninth round).


IMPLS = {"triton": beam_tail_attention_merge, "torch": beam_tail_attention_merge_torch}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _args(seed):
    """A valid call: 2 requests (prompts 5, 3) of 2 beams, Hq=6, Hkv=2, D=64, pages of 16; rows = 4."""
    sim = BeamSearchCacheSimulator([5, 3], beam_width=2, num_qo_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                                   max_seq_len=64, kv_layout="HND", dtype=torch.bfloat16, device=DEVICE, seed=seed)
    step = sim.begin_step()
    po, pl = reference_prefix_attention(step.q, sim.kv_cache, step.prompt_page_indptr, step.prompt_page_indices,
                                        step.prompt_lens_per_request, step.beam_width, kv_layout=sim.kv_layout)
    return dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache,
                beam_page_table=step.beam_page_table, kv_lens=step.kv_lens, prompt_lens=step.prompt_lens,
                cache_indirection=step.cache_indirection, beam_width=step.beam_width, prefix_out=po.float(),
                prefix_lse=pl, out=torch.full_like(step.q, 7.0))


def _refused(impl, args, message):
    """``impl(**args)`` raises KernelInputError whose message contains ``message``; out and the pool unchanged."""
    out_before, pool_before = args["out"].clone(), args["kv_cache"].clone()
    with pytest.raises(KernelInputError, match=re.escape(message)):
        IMPLS[impl](**args)
    assert torch.equal(args["out"], out_before) and torch.equal(args["kv_cache"], pool_before)


def _strided_int32(values):
    """``values`` (int32 [n]) as a view of stride 2 (every other element of a wider buffer)."""
    return torch.stack([values, values + 1000], 1)[:, 0]


BAD_PREFIX_STATE = [
    # A layout string the launcher does not know is refused by name, not read as one of the two it does.
    ("lse_layout_string", lambda a: dict(prefix_lse_layout="nh"), "prefix_lse_layout='nh' is not supported"),
    ("prefix_out_int32", lambda a: dict(prefix_out=a["prefix_out"].to(torch.int32)),
     "prefix_out has dtype int32; supported: bfloat16, float16, float32"),
    ("prefix_out_float64", lambda a: dict(prefix_out=a["prefix_out"].double()),
     "prefix_out has dtype float64; supported: bfloat16, float16, float32"),
    # Fewer rows than q: the kernel would read rows past its end.
    ("prefix_out_rows", lambda a: dict(prefix_out=a["prefix_out"][:-1]), "prefix_out must be [rows=4, Hq=6, D=64]"),
    ("prefix_out_heads", lambda a: dict(prefix_out=a["prefix_out"][:, :3]), "prefix_out must be [rows=4, Hq=6, D=64]"),
    ("prefix_out_strided_head_dim",
     lambda a: dict(prefix_out=a["prefix_out"].repeat_interleave(2, dim=2)[:, :, ::2]),
     "prefix_out has last-dim stride 2; the head dim must be contiguous"),
    ("prefix_lse_float16", lambda a: dict(prefix_lse=a["prefix_lse"].half()),
     "prefix_lse has dtype float16; supported: float32"),
    ("out_aliases_prefix_out", lambda a: dict(out=a["prefix_out"].to(torch.bfloat16), prefix_out=None),
     "out overlaps prefix_out"),
]


def _apply(args, change):
    update = change(args)
    if "prefix_out" in update and update["prefix_out"] is None:  # out and prefix_out one buffer (bf16, both valid)
        update["prefix_out"] = update["out"]
    args.update(update)
    return args


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name,change,message", BAD_PREFIX_STATE, ids=[c[0] for c in BAD_PREFIX_STATE])
def test_launcher_refuses_a_bad_prefix_state(impl, name, change, message):
    """Each bad prefix state (layout string, dtype, shape, stride, aliasing with out) is refused by name."""
    args = _apply(_args(seed=[c[0] for c in BAD_PREFIX_STATE].index(name)), change)
    if name == "out_aliases_prefix_out":  # out is the prefix state itself: only the pool must stay untouched
        pool_before = args["kv_cache"].clone()
        with pytest.raises(KernelInputError, match=re.escape(message)):
            IMPLS[impl](**args)
        assert torch.equal(args["kv_cache"], pool_before)
        return
    _refused(impl, args, message)


def test_launcher_refuses_prefix_lse_aliasing_out():
    """An out whose bytes hold the prefix LSE (the kernel would overwrite the LSE it merges) is refused."""
    args = _args(seed=11)
    rows, hq, d = args["q"].shape
    buffer = torch.zeros(rows * hq * d, dtype=torch.bfloat16, device=DEVICE)
    args["out"] = buffer.view(rows, hq, d)
    args["prefix_lse"] = buffer[: 2 * rows * hq].view(torch.float32).view(rows, hq)
    pool_before = args["kv_cache"].clone()
    for impl in sorted(IMPLS):
        with pytest.raises(KernelInputError, match="out overlaps prefix_lse"):
            IMPLS[impl](**args)
    assert torch.equal(args["kv_cache"], pool_before)


def test_tail_kernel_refuses_a_bad_tail_skip():
    """tail_skip (the shared-run stage's output) must be a contiguous int32 [rows] tensor on q's device: other
    lengths, dtypes and strides are refused by the tail launcher, naming what it got."""
    zeros = dict(device=DEVICE)
    for bad, got in ((torch.zeros(2, dtype=torch.int32, **zeros), "torch.int32 (2,)"),
                     (torch.zeros(4, dtype=torch.int64, **zeros), "torch.int64 (4,)"),
                     (_strided_int32(torch.zeros(4, dtype=torch.int32, **zeros)), "torch.int32 (4,) strides (2,)")):
        args = _args(seed=13)
        args["tail_skip"] = bad
        _refused("triton", args,
                 f"tail_skip must be a contiguous int32 [rows=4] tensor on {args['q'].device}, got {got}")


def test_grouped_tiling_takes_one_token_and_no_index_blocks():
    """A grouped launch configuration with block_t 2 or an index block is refused before the launch."""
    args = _args(seed=14)
    for config, got in ((TailLaunchConfig(8, 1, 2, 4, index_block=0, grouped=True), "block_t=2, index_block=0"),
                        (TailLaunchConfig(8, 1, 1, 4, index_block=4, grouped=True), "block_t=1, index_block=4")):
        _refused("triton", dict(args, launch_config=config),
                 f"launch_config.grouped=True takes block_t=1 and index_block=0, got {got}")


def test_tail_launcher_refuses_tail_skip_on_another_device():
    """tail_skip on another device than q is refused by name before the kernel reads it, naming both devices: on a
    GPU a CPU tensor, on a CPU machine "meta" (shapes without data)."""
    args = _args(seed=15)
    other = "meta" if args["q"].device.type == "cpu" else "cpu"
    args["tail_skip"] = torch.zeros(4, dtype=torch.int32, device=other)
    message = (f"tail_skip must be a contiguous int32 [rows=4] tensor on {args['q'].device}, got torch.int32 (4,) "
               f"strides (1,) on {other}")
    _refused("triton", args, message)
