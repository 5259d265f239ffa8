"""The launchers' byte spans (``_byte_span``), which the overlap checks compare: against every element's
address, for contiguous tensors (the fast path) and strided views (the general one)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels.tail_merge_args import _byte_span, _spans_overlap


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
    span = _byte_span(x)
    if x.numel() == 0:
        assert span is None
        return
    a = addresses(x)
    assert span == (int(a.min()), int(a.max()) + x.element_size()), (shape, x.stride(), span)


def test_spans_overlap_is_byte_exact():
    base = torch.empty(64, dtype=torch.float32)
    left, right = base[:16], base[16:32]
    assert not _spans_overlap(_byte_span(left), _byte_span(right))
    assert _spans_overlap(_byte_span(base[:17]), _byte_span(right))
    assert _spans_overlap(_byte_span(base[::4]), _byte_span(base[1:2]))  # strided: the range, not the elements
    assert not _spans_overlap(_byte_span(base[:0]), _byte_span(base))
