"""The tiling sweep's mismatch measure (microbenchmarks/tune_tail.py) counts rounding steps of the output dtype."""

from __future__ import annotations

import pytest
import torch

from microbenchmarks.tune_tail import MISMATCH_ULPS, ulps_apart


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulps_apart_counts_rounding_steps_at_the_values_magnitude(dtype):
    eps = torch.finfo(dtype).eps
    ref = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    mag = ref.float().abs()
    spacing = torch.ldexp(torch.full_like(mag, eps), torch.frexp(mag)[1] - 1)  # of |ref|'s binade

    def away_from_zero(steps):
        return (ref.float().sign() * (mag + steps * spacing)).to(dtype)

    assert torch.equal(away_from_zero(0), ref)
    assert ulps_apart(ref, ref) == 0.0
    assert ulps_apart(away_from_zero(1), ref) == pytest.approx(1.0) and 1.0 <= MISMATCH_ULPS
    three = ref.clone()
    three[5] = away_from_zero(3)[5]
    assert ulps_apart(three, ref) == pytest.approx(3.0) and ulps_apart(three, ref) > MISMATCH_ULPS
    poisoned = ref.clone()
    poisoned[3] = float("nan")
    assert ulps_apart(poisoned, ref) == float("inf")
