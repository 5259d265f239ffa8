"""The rules a beam-search decode step's KV lengths obey, written once.

Each beam row's ``kv_len`` counts its prompt, its generated tokens and this step's token. So it is at least the
row's least length (1; the prompt length + 1 where the plan is known, but for :func:`padding_rows`) and at most the
positions its cache covers (:func:`kv_capacity`: past them the kernels mask the row, and this step's K/V would not be
stored). The beams of one request advance together: a beam that reads another beam's position past its own length
reads a slot being written in this step.

The TensorRT-LLM adapter's planning (which hands a step that breaks a rule to the default kernel) and check mode
(which stops at it) both ask :func:`kv_lens_problem` and word its answer for their own reader. The launchers' check
of the index values (``triton_kernels.step_args.check_tail_index_values``) has its own copy, since
``triton_kernels`` imports nothing of this package; so do the kernels' device rule
(``triton_kernels.device_errors.kv_len_bad``) and its torch twin.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["KvLensProblem", "kv_capacity", "kv_lens_problem", "padding_rows"]


class KvLensProblem(NamedTuple):
    """The first KV length that breaks a rule (tokens throughout).

    ``kind``: ``"too_short"`` (under the row's least length), ``"too_long"`` (past the capacity) or ``"beams_differ"``
    (not the length of its request's beam 0). ``row``: the beam row, request-major (``r * W + b``). ``value``: its
    ``kv_len``. ``limit``: the least length, the capacity, or beam 0's ``kv_len``, by ``kind``.
    """

    kind: str
    row: int
    value: int
    limit: int


def padding_rows(kv_rows, prompt_rows):
    """Whether each row is TensorRT-LLM's warm-up or CUDA-graph padding row: no prompt and one token
    (``kv_len`` 1), planned with a one-token prompt, whose least length is 1, not 2. ``kv_rows`` and
    ``prompt_rows`` (per row) are int arrays or tensors of one kind; returns bool of that kind."""
    return (kv_rows == 1) & (prompt_rows == 1)


def kv_capacity(table_columns: int, page_size: int, max_seq_len: int) -> int:
    """Positions a beam row can hold: its page table's ``table_columns`` x ``page_size`` tokens, and no more than
    ``cache_indirection``'s ``max_seq_len`` (its last dimension)."""
    return min(int(table_columns) * int(page_size), int(max_seq_len))


def kv_lens_problem(kv_rows: np.ndarray, beam_width: int, capacity: int,
                    least: int | np.ndarray = 1) -> KvLensProblem | None:
    """The first broken rule of one step's KV lengths, or ``None``.

    Args:
        kv_rows: int ``[R * W]``, one ``kv_len`` per beam row, request-major (a host array).
        beam_width: ``W``, which divides the row count.
        capacity: the most positions a row can hold (:func:`kv_capacity`).
        least: the least ``kv_len`` of every row (an int), or of each row (int ``[R * W]``).

    Checked in this order: a row under its least length, a row past the capacity, beams of a request apart. The
    common case costs three vector passes; the offender is looked up only on a failure.
    """
    kv_rows = np.asarray(kv_rows).reshape(-1)
    if kv_rows.size and kv_rows.dtype.kind not in "iu":  # (a float would be cut, and beams 5.9 and 5.2 judged equal)
        raise TypeError(f"kv_rows must hold integers, got dtype {kv_rows.dtype}.")
    if kv_rows.size % int(beam_width):
        raise ValueError(f"{kv_rows.size} KV lengths are not whole requests of beam_width={int(beam_width)} rows.")
    kv_rows = kv_rows.astype(np.int64, copy=False)
    if kv_rows.size == 0:
        return None
    per_request = kv_rows.reshape(-1, int(beam_width))
    least_rows = np.broadcast_to(np.asarray(least, dtype=np.int64), kv_rows.shape)
    if (kv_rows >= least_rows).all() and kv_rows.max() <= capacity and (per_request == per_request[:, :1]).all():
        return None
    short = np.flatnonzero(kv_rows < least_rows)
    if short.size:
        i = int(short[0])
        return KvLensProblem("too_short", i, int(kv_rows[i]), int(least_rows[i]))
    long = np.flatnonzero(kv_rows > capacity)
    if long.size:
        i = int(long[0])
        return KvLensProblem("too_long", i, int(kv_rows[i]), int(capacity))
    r, b = (int(v) for v in np.argwhere(per_request != per_request[:, :1])[0])
    return KvLensProblem("beams_differ", r * int(beam_width) + b, int(per_request[r, b]), int(per_request[r, 0]))
