"""Integer helpers for the launchers' host code.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects on recent Triton
(3.9: about 4.5 us a call from Python), and the launchers call them per layer and step in eager mode;
these are the same integer functions in plain Python.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(numerator: int, divisor: int) -> int:
    """``ceil(numerator / divisor)`` for ints, ``divisor > 0``."""
    return -(-numerator // divisor)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
