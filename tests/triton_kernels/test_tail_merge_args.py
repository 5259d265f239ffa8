"""The launchers' byte spans (``step_args.byte_span``), which the overlap checks compare: against every element's
address, for contiguous tensors (the fast path) and strided views (the general one). The memoized checks
(``memo.memoize_metadata_check``): a verdict is reused for equal metadata only, and agrees with the check.
The public names ``tail_merge_args`` held before the split into ``step_args`` and ``memo`` still import from it, and
the conventions the kernels' package and the core package each define agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels import memo, step_args, tail_merge_args
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
