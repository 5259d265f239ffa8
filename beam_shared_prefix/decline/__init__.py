"""When the library declines a shape because the default per-beam decode would be faster.

:func:`should_decline` judges one decode step: ``R`` requests of ``W`` beams over a mean prompt of ``P`` tokens, the
layer's query and KV heads and head size, the tail generated so far and the path that serves it (the one-launch
cascade, or a prefix backend + the tail kernel: FA4, or FlashInfer, whose prefill splits each prompt over the GPU). It
returns a one-line reason naming the measured threshold, or ``None`` to serve the step. In order, it declines:

1. fewer than :data:`MIN_BEAM_WIDTH` beams: nothing is shared;
2. too few beam rows ``R x W`` to fill the GPU (:func:`min_beam_rows`): every path runs a program per request and KV
   head, per-beam decode one per beam row and KV head. :data:`MIN_BEAM_ROWS` = 120 rows at 8 KV heads, scaled by
   ``8 / Hkv`` up to 16 KV heads and an ``R x W x Hkv`` product above; fewer rows from longer prompts, on the current
   kernels at heads 128 and 256 and on the cascade's narrow tiles, more at head 256 and for GQA 1 at short prompts.
   FlashInfer's split prompt serves fewer rows from ``R x W x P >=`` :data:`MIN_BEAM_ROW_TOKENS_SPLIT_KV` where that
   was measured;
3. groups wider than :data:`WIDE_GROUP` query heads per KV head under the mean prompt of
   :data:`WIDE_GROUP_MIN_PROMPT` (or an unknown one): per-beam decode reads a beam's KV once for the whole group;
4. an unknown prompt (a CUDA graph) under :data:`MIN_BEAM_WIDTH_ANY_PROMPT` beams; an unknown prompt is judged no
   further;
5. beams narrower than 8 above 8 KV heads under :func:`narrow_beams_min_prompt`: per-beam decode has more programs to
   spread them over;
6. a tail longer than :func:`max_tail_len` (:func:`tail_decline_reason`): every beam reads its own generated tokens a
   short block at a time, so the library's step grows by a fixed time per generated token, per-beam decode's only
   with the bytes;
7. too little shared prompt: on the one-launch cascade a mean prompt under :func:`cascade_min_prompt` (by beam width
   and head size, lower for GQA 5-8 at 8 KV heads; at head 128 what the two-launch clause serves is served too), on
   the two-launch paths ``(W - 1) x P`` under :data:`MIN_SHARED_PROMPT_TOKENS`, the prompt KV that ``W - 1`` beams no
   longer re-read.

Every threshold was measured on the H200, not guessed, with a 10% margin against run-to-run noise: the grids, rounds
and speedups behind each clause, and where the rule extrapolates, are in ``docs/benchmarks-evidence.md`` ("The
decline rule's measurements (from the decline module's docstring)" and "Behind the decline rule") and
``docs/benchmarks.md`` ("The decline rule"); the comments above the constants record what each was set from.

The floors live in :mod:`.rows` (beam rows and prompts), the tail clause in :mod:`.tail`; this module applies them and
re-exports their public names. A function reads the globals of the module that defines it, so a test patches a floor
where it is defined (``decline.rows.MIN_BEAM_ROWS``), and here only what :func:`should_decline` reads itself.

The function is pure and cheap (integer arithmetic), independent of TensorRT-LLM and of the
benchmark code. Unknown quantities are passed as ``None`` and judged as described above.
"""

from __future__ import annotations

import math
from typing import Optional

from . import rows, tail
from .rows import *
from .rows import (
    _SPLIT_KV_MEASURED_FROM_WIDTH,
    _SPLIT_KV_MEASURED_SHAPES,
    _SPLIT_KV_MIN_ROW_TOKENS,
    _beam_rows_floor,
    _group,
    _narrow_head,
    _row_floor,
    _row_floor_note,
    _scaled_by_kv_heads,
    _table_value,
)
from .tail import *
from .tail import _WIDEST_GROUP as _WIDEST_GROUP  # re-exported: tests read these two
from .tail import _tail_prompt_per_token as _tail_prompt_per_token

__all__ = ["should_decline"]
__all__ += rows.__all__
__all__ += tail.__all__


def should_decline(
    num_requests: Optional[int],
    beam_width: Optional[int],
    prompt_len: Optional[float],
    num_qo_heads: Optional[int],
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
    *,
    one_launch: bool = False,
    split_kv: bool = False,
    tail_len: Optional[float] = None,
) -> Optional[str]:
    """The reason to leave this shape to the default per-beam decode, or ``None`` to serve it.

    Args:
        num_requests: ``R``, generation requests in the batch (``None``: unknown; the row floors are not judged,
            and the tail clause judges the batch as one request).
        beam_width: ``W``, beams per request (``None``: unknown; nothing is judged).
        prompt_len: prompt length in tokens; for a batch, its mean (``None``: unknown, e.g. a
            CUDA graph that serves any prompt).
        num_qo_heads, num_kv_heads, head_dim: the layer's attention shape: the GQA group and the KV head count
            pick and scale the row floors and prompt bands, the head size the cascade's table (head 64 or head 128;
            ``None``: head 128's).
        one_launch: whether the one-launch cascade serves the batch (its own, lower thresholds);
            ``False``: a prefix backend + the tail kernel (two launches).
        split_kv: whether FlashInfer's prefix backend serves it (its prefill splits each prompt over
            the GPU, so fewer beam rows pay from :data:`MIN_BEAM_ROW_TOKENS_SPLIT_KV`); two launches.
        tail_len: generated tokens per beam, this step's included (``kv_len - prompt_len``), of the batch's
            longest-running request: each request's tail is walked by its own programs, so the longest sets
            the step's time (the grids ran one tail per batch). ``None``: unknown (a CUDA graph), not judged
            (:func:`tail_decline_reason`).

    Returns:
        A one-line reason naming the measured threshold (logged by the caller), or ``None``.

    Raises:
        ValueError: a prompt or tail length that is negative or not finite (the rule would judge it
            by accident).
    """
    for name, value in (("prompt_len", prompt_len), ("tail_len", tail_len)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite length >= 0 in tokens, or None where unknown.")
    if beam_width is None:
        return None
    w = int(beam_width)
    if w < MIN_BEAM_WIDTH:
        return f"beam width {w} < {MIN_BEAM_WIDTH}: no beams share a prompt"
    rows = None if num_requests is None else int(num_requests) * w
    group = _group(num_qo_heads, num_kv_heads)
    base = _beam_rows_floor(prompt_len, group, head_dim, num_kv_heads, w)
    least_rows = _row_floor(base, num_kv_heads, head_dim)
    if rows is not None and rows < least_rows:
        # The exception is measured at 8-30 beams and the shapes of _SPLIT_KV_MEASURED_SHAPES;
        # elsewhere few rows stay declined.
        split_measured = (split_kv and not one_launch and prompt_len is not None
                          and w >= _SPLIT_KV_MEASURED_FROM_WIDTH and (group, head_dim) in _SPLIT_KV_MEASURED_SHAPES)
        if not split_measured:
            scaled = _row_floor_note(base, group, head_dim, num_kv_heads, prompt_len, w)
            return (
                f"{int(num_requests)} requests x beam width {w} = {rows} beam rows < {least_rows}{scaled}: too few "
                f"programs to fill the GPU, per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
            )
        row_tokens = rows * float(prompt_len)
        # Measured at 8 KV heads; scaled as the rows are (at 2 KV heads FlashInfer + tail beat
        # per-beam decode only from 240,000: 0.78x-0.91x at 60,000-64,000, 1.17x-1.22x at 240,000-256,000).
        least_row_tokens = _scaled_by_kv_heads(_SPLIT_KV_MIN_ROW_TOKENS[(group, head_dim)], num_kv_heads)
        if row_tokens < least_row_tokens:
            return (
                f"{int(num_requests)} requests x beam width {w} x mean prompt {float(prompt_len):.0f} = "
                f"{row_tokens:.0f} < {least_row_tokens} with FlashInfer's split prompt and "
                f"{rows} beam rows < {least_rows}: per-beam decode is faster or within 10% here (measured on the "
                f"H200, docs/benchmarks.md)"
            )
    least_prompt = _table_value(WIDE_GROUP_MIN_PROMPT, group) if group is not None else None
    if least_prompt is not None and (prompt_len is None or float(prompt_len) < least_prompt):
        prompt = "unknown (a CUDA graph)" if prompt_len is None else f"{float(prompt_len):.0f}"
        return (
            f"{group} query heads per KV head (more than {WIDE_GROUP}) need a mean prompt of {least_prompt} "
            f"tokens, this one is {prompt}: per-beam decode reads each beam's KV once for the whole group and was "
            f"faster or within 10% at shorter prompts (measured on the H200, docs/benchmarks.md)"
        )
    if prompt_len is None:
        if w < MIN_BEAM_WIDTH_ANY_PROMPT:
            return (
                f"beam width {w} < {MIN_BEAM_WIDTH_ANY_PROMPT} with the prompt length unknown (a CUDA graph): "
                f"narrow beams pay only with long prompts (measured on the H200, docs/benchmarks.md)"
            )
        return None
    least_narrow = narrow_beams_min_prompt(w, num_kv_heads)
    if least_narrow is None or float(prompt_len) < least_narrow:
        # The tables below were measured at 8 KV heads; with more, per-beam decode has more programs
        # to spread narrow beams over and wins longer prompts (0.89x-0.98x where they served).
        served = "at every prompt measured (up to 2,000 tokens)" if least_narrow is None else (
            f"below a mean prompt of {least_narrow} tokens (this one is {float(prompt_len):.0f})")
        return (
            f"beam width {w} with {int(num_kv_heads)} KV heads (more than {NARROW_BEAMS_MEASURED_KV_HEADS}): per-beam "
            f"decode was faster or within 10% {served} (measured on the H200, docs/benchmarks.md)"
        )
    long_tail = tail_decline_reason(w, prompt_len, tail_len, num_kv_heads, num_requests, num_qo_heads)
    if long_tail is not None:
        return long_tail
    saved = (w - 1) * float(prompt_len)
    if one_launch:
        least = cascade_min_prompt(w, head_dim, group, num_kv_heads)
        if least is None:
            return (
                f"beam width {w} at head {head_dim} with the one-launch cascade: per-beam decode was faster or "
                f"within 10% at every prompt measured (up to 2,000 tokens; H200, docs/benchmarks.md)"
            )
        # Served where the cascade measured faster; at head 128 also wherever the two-launch paths
        # are (auto picks the cascade only where it beat them; not measured at head 64).
        narrow = _narrow_head(head_dim)
        two_launch_serves = saved >= MIN_SHARED_PROMPT_TOKENS and not narrow
        if float(prompt_len) < least and not two_launch_serves:
            return (
                f"mean prompt {float(prompt_len):.0f} < {least} tokens at beam width {w} with the one-launch "
                f"cascade{f' at head {head_dim}' if narrow else ''}: "
                f"per-beam decode is faster or within 10% here (measured on the H200, docs/benchmarks.md)"
            )
        return None
    if saved < MIN_SHARED_PROMPT_TOKENS:
        return (
            f"(beam width {w} - 1) x prompt {float(prompt_len):.0f} = {saved:.0f} shared prompt tokens < "
            f"{MIN_SHARED_PROMPT_TOKENS}: per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
        )
    return None
