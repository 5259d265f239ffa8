"""The KV-length rules of a beam-search step (beam_shared_prefix/kv_lens.py), against a row-by-row reading of them."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_shared_prefix.kv_lens import KvLensProblem, kv_capacity, kv_lens_problem


def _first_problem_by_rows(kv_rows, beam_width, capacity, least):
    """The rules read one row at a time, in the documented order: short rows, then long rows, then beams apart."""
    least = [least] * len(kv_rows) if np.isscalar(least) else list(least)
    for i, (k, lo) in enumerate(zip(kv_rows, least)):
        if k < lo:
            return ("too_short", i, k, lo)
    for i, k in enumerate(kv_rows):
        if k > capacity:
            return ("too_long", i, k, capacity)
    for i, k in enumerate(kv_rows):
        beam0 = kv_rows[i - i % beam_width]
        if k != beam0:
            return ("beams_differ", i, k, beam0)
    return None


@settings(max_examples=400, deadline=None)
@given(data=st.data(), requests=st.integers(1, 5), beam_width=st.integers(1, 4), capacity=st.integers(1, 40),
       per_row_least=st.booleans())
def test_the_first_problem_is_the_rules_read_row_by_row(data, requests, beam_width, capacity, per_row_least):
    # Lengths mostly shared by a request's beams (the valid case), sometimes apart, around both bounds.
    per_request = data.draw(st.lists(st.integers(0, capacity + 2), min_size=requests, max_size=requests))
    kv_rows = [k for k in per_request for _ in range(beam_width)]
    for i in data.draw(st.lists(st.integers(0, len(kv_rows) - 1), max_size=2)):
        kv_rows[i] = data.draw(st.integers(0, capacity + 2))
    least = (data.draw(st.lists(st.integers(1, capacity), min_size=len(kv_rows), max_size=len(kv_rows)))
             if per_row_least else 1)
    got = kv_lens_problem(np.array(kv_rows, dtype=np.int32), beam_width, capacity,
                          least=np.array(least) if per_row_least else least)
    expected = _first_problem_by_rows(kv_rows, beam_width, capacity, least)
    assert (None if got is None else tuple(got)) == expected


@pytest.mark.parametrize("kv_rows,beam_width,least,expected", [
    ([5, 5, 7, 7], 2, 1, None),
    ([5, 5, 7, 6], 2, 1, KvLensProblem("beams_differ", 3, 6, 7)),
    ([5, 5, 0, 0], 2, 1, KvLensProblem("too_short", 2, 0, 1)),
    ([5, 5, 9, 9], 2, [6, 6, 1, 1], KvLensProblem("too_short", 0, 5, 6)),
    ([5, 5, 17, 17], 2, 1, KvLensProblem("too_long", 2, 17, 16)),
    ([], 3, 1, None),
])
def test_each_rule_names_the_row_its_value_and_the_limit(kv_rows, beam_width, least, expected):
    least = np.array(least) if isinstance(least, list) else least
    assert kv_lens_problem(np.array(kv_rows, dtype=np.int64), beam_width, 16, least=least) == expected


def test_capacity_is_the_page_table_or_cache_indirection_whichever_is_shorter():
    assert kv_capacity(4, 32, 200) == 128
    assert kv_capacity(8, 32, 200) == 200


def test_padding_rows_are_the_short_rows_the_device_rule_spares():
    """``padding_rows`` is the kernels' exemption read back: of the rows under ``prompt + 1``, exactly those
    ``triton_kernels.device_errors.kv_len_bad`` (its torch twin) does not flag."""
    import torch

    from beam_shared_prefix.kv_lens import padding_rows
    from triton_kernels.device_errors import kv_len_bad_torch

    kv, prompt = torch.meshgrid(torch.arange(0, 5), torch.arange(0, 5), indexing="ij")
    short = kv < prompt + 1
    spared = short & ~kv_len_bad_torch(kv - 1, prompt, 1 << 20)
    assert torch.equal(padding_rows(kv, prompt), spared)
    assert padding_rows(np.array([1, 1, 2]), np.array([1, 2, 1])).tolist() == [True, False, False]


def test_lengths_that_are_no_whole_int_rows_are_refused():
    """A float length (5.9 and 5.2 cut to 5 would pass as equal beams) or a row count that is no whole number of
    requests is refused, not judged on converted values."""
    with pytest.raises(TypeError, match="kv_rows must hold integers, got dtype float64"):
        kv_lens_problem(np.array([5.9, 5.2]), 2, 16)
    with pytest.raises(ValueError, match="3 KV lengths are not whole requests of beam_width=2 rows"):
        kv_lens_problem(np.array([5, 5, 5]), 2, 16)
