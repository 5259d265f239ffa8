"""The tail merge's own argument checks: its prefix state (:func:`check_tail_merge_args`, the per-beam step
arguments of :func:`~triton_kernels.step_args.check_step_args` plus ``prefix_out`` and ``prefix_lse``) and
``tail_skip`` (:func:`check_tail_skip`). Their callers are the launchers that take the tail merge's
arguments: the fused tail kernel's, its unfused torch twin, and the shared-run stage's, which takes them
without this step's K/V (``reads_step_kv=False``) and writes the tail kernel's ``tail_skip``.

The checks every launcher shares (the step's arguments, index values, device, the helpers, ``KernelInputError``)
are in :mod:`triton_kernels.step_args`, the verdict cache in :mod:`triton_kernels.memo`; the public names this
module held before that split are re-exported here (``TailMergeInputError`` is ``KernelInputError``).

Everything here is host-only and needs no device sync (shapes, dtypes, strides, devices and layout strings).
Every error is a :class:`~triton_kernels.step_args.KernelInputError` whose message names the argument, the
value found, the limit and the fix. The metadata part of :func:`check_tail_merge_args` keeps its verdicts
(:func:`~triton_kernels.memo.memoize_metadata_check`; a failing check is never kept); its overlap check, which
reads addresses, runs on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memo import memoize_metadata_check
from .step_args import (  # noqa: F401  (the names not used here are this module's exports before the split)
    KV_DTYPES,
    KV_LAYOUTS,
    LOG2E,
    StepGeometry,
    TailMergeInputError,
    check_step_args,
    check_step_metadata,
    check_tail_index_values,
    check_written_overlaps,
    fail,
    index_tensors,
    is_pow2,
    need_dim,
    need_dtype,
    need_last_dim_contiguous,
    need_tensor,
    need_vector,
    overlapping_elements,
    pool_layout,
    resolve_sm_scale,
    runs_interpreted,
    step_writes,
)

__all__ = [
    "LOG2E",
    "TailMergeInputError",
    "StepGeometry",
    "TailMergeGeometry",
    "check_step_args",
    "overlapping_elements",
    "check_tail_merge_args",
    "check_tail_index_values",
    "check_tail_skip",
    "memoize_metadata_check",
]

# LSE_LAYOUTS and LSE_BASES have twins in beam_shared_prefix.prefix.base, a light module that cannot import this
# package (whose __init__ imports Triton), and this package imports nothing of beam_shared_prefix;
# tests/triton_kernels/test_tail_merge_args.py holds each pair equal.
PREFIX_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LSE_LAYOUTS = ("NH", "HN")
LSE_BASES = ("log2", "ln")


@dataclass(frozen=True)
class TailMergeGeometry(StepGeometry):
    """:class:`StepGeometry` plus how the prefix state's LSE is read.

    Attributes:
        lse_strides: element strides ``(row, head)`` of ``prefix_lse``, whatever the layout.
        lse_scale: multiplier turning ``prefix_lse`` into base 2 (1 for log2, log2(e) for ln).
    """

    lse_strides: tuple[int, int] = (0, 0)
    lse_scale: float = 1.0


def _tail_merge_metadata(
    q,
    new_k,
    new_v,
    kv_cache,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    prefix_out,
    prefix_lse,
    out,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    prefix_lse_layout="NH",
    prefix_lse_base="log2",
    reads_step_kv=True,
    write_kv=False,
    error_flags=None,
    tail_skip=None,
) -> TailMergeGeometry:
    """Validate the arguments of ``beam_tail_attention_merge`` without a device sync (with
    ``reads_step_kv=False``, those of ``beam_shared_run_attention``: ``new_k``, ``new_v`` and ``out`` ``None``).
    ``write_kv``, ``error_flags`` and ``tail_skip`` are read by the overlap check alone (it runs on every call).

    Returns the :class:`TailMergeGeometry` the kernel is launched with; raises
    :class:`KernelInputError` naming the offending value, its limit and the fix.
    """
    need_tensor("prefix_out", prefix_out)
    need_tensor("prefix_lse", prefix_lse)
    if prefix_lse_layout not in LSE_LAYOUTS:
        fail(f"prefix_lse_layout={prefix_lse_layout!r} is not supported; use 'NH' ([rows, heads], FlashInfer) or "
             f"'HN' ([heads, rows], FA4).")
    if prefix_lse_base not in LSE_BASES:
        fail(f"prefix_lse_base={prefix_lse_base!r} is not supported; use 'log2' (FlashInfer) or 'ln' (FA4).")
    geom = check_step_metadata(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width, out,
        sm_scale=sm_scale, kv_layout=kv_layout, page_index_divisor=page_index_divisor,
        extra_tensors=(("prefix_out", prefix_out), ("prefix_lse", prefix_lse)), reads_step_kv=reads_step_kv,
    )
    num_rows, num_qo_heads, head_dim = geom.num_rows, geom.num_qo_heads, geom.head_dim
    need_dim("prefix_out", prefix_out, 3, "[rows, Hq, D]")
    need_dtype("prefix_out", prefix_out, PREFIX_OUT_DTYPES)
    if tuple(prefix_out.shape) != (num_rows, num_qo_heads, head_dim):
        fail(f"prefix_out must be [rows={num_rows}, Hq={num_qo_heads}, D={head_dim}], got {tuple(prefix_out.shape)}.")
    need_last_dim_contiguous("prefix_out", prefix_out)
    need_dim("prefix_lse", prefix_lse, 2, "[rows, Hq] (NH) or [Hq, rows] (HN) float32")
    need_dtype("prefix_lse", prefix_lse, (torch.float32,))
    want = (num_rows, num_qo_heads) if prefix_lse_layout == "NH" else (num_qo_heads, num_rows)
    if tuple(prefix_lse.shape) != want:
        fail(
            f"prefix_lse has shape {tuple(prefix_lse.shape)} but layout {prefix_lse_layout!r} needs {want}; "
            f"pass prefix_lse_layout='HN' for [heads, rows] (FA4) or 'NH' for [rows, heads] (FlashInfer)."
        )
    if prefix_lse_layout == "NH":
        lse_strides = (prefix_lse.stride(0), prefix_lse.stride(1))
    else:
        lse_strides = (prefix_lse.stride(1), prefix_lse.stride(0))
    return TailMergeGeometry(**{f: getattr(geom, f) for f in StepGeometry.__dataclass_fields__},
                             lse_strides=lse_strides, lse_scale=1.0 if prefix_lse_base == "log2" else LOG2E)


def _tail_merge_overlaps(q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection,
                         beam_width, prefix_out, prefix_lse, out, *, reads_step_kv=True, write_kv=False,
                         error_flags=None, tail_skip=None, **_) -> None:
    if reads_step_kv:  # (otherwise there is no out: the shared-run stage, which checks its own writes)
        check_written_overlaps(step_writes(write_kv), (
            ("out", out), ("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache),
            ("prefix_out", prefix_out), ("prefix_lse", prefix_lse), ("tail_skip", tail_skip),
            ("error_flags", error_flags)) + index_tensors(beam_page_table, kv_lens, prompt_lens, cache_indirection))


check_tail_merge_args = memoize_metadata_check(_tail_merge_metadata, every_call=_tail_merge_overlaps)


def check_tail_skip(tail_skip, num_rows: int, device) -> None:
    """``tail_skip`` (the shared-run stage's output, the tail kernel's input) is a contiguous int32
    ``[rows]`` tensor on ``device``; raises :class:`KernelInputError` naming what it got."""
    need_vector("tail_skip", tail_skip, torch.int32, "rows", num_rows, device,
                "allocate torch.empty(rows, dtype=torch.int32, device=q.device) and fill it with "
                "beam_shared_run_attention.")

