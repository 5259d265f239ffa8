"""The launchers' plain-Python integer helpers against Triton's own, over the ranges the launchers use."""

from __future__ import annotations

import triton

from triton_kernels.host_ints import cdiv, next_power_of_2


def test_cdiv_matches_triton():
    for divisor in (1, 2, 3, 4, 7, 16, 32, 64):
        for numerator in range(700):
            assert cdiv(numerator, divisor) == triton.cdiv(numerator, divisor), (numerator, divisor)


def test_next_power_of_2_matches_triton():
    for n in range(5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for n in (2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
