"""Argument checks shared by the Triton launchers (the fused tail merge's, the one-launch cascade's and the
shared-run stage's) and the tail merge's unfused torch twin: the decode step's per-beam arguments
(:func:`check_step_args`), the index values of check mode, the device, and the helpers the launchers' own
checks are written with (:func:`fail`, :func:`need_tensor`, :func:`need_dim`, :func:`need_dtype`,
:func:`need_last_dim_contiguous`, :func:`byte_span`, :func:`spans_overlap`, ...). The tail merge's own
checks (the prefix state, ``tail_skip``) are in :mod:`triton_kernels.tail_merge_args`; the verdict cache
of the metadata-only checks is :mod:`triton_kernels.memo`.

Everything here is host-only and needs no device sync (shapes, dtypes, strides, devices, layout
strings and the bounds that follow from shapes alone), except :func:`check_tail_index_values`,
which reads lengths, page indices and ``cache_indirection`` back from the device and is meant for
check mode (``validate_indices=True``).

Every error is a :class:`KernelInputError` (``TailMergeInputError`` is the same class, under the name it
had when these checks were the tail merge's alone) whose message names the argument, the value found,
the limit and the fix.

The checks run per layer and step in eager mode. All but the overlap checks read metadata only
(shapes, strides, dtypes, devices and the Python scalars passed), so :func:`memoize_metadata_check`
keeps their verdicts on metadata seen before (a failing check is never kept); the overlap checks,
which read addresses, run on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from .memo import memoize_metadata_check

__all__ = [
    "KV_DTYPES",
    "KV_LAYOUTS",
    "LOG2E",
    "KernelInputError",
    "StepGeometry",
    "TailMergeInputError",
    "byte_span",
    "check_device",
    "check_pool_extent",
    "check_written_overlaps",
    "step_writes",
    "check_step_args",
    "check_step_metadata",
    "check_tail_index_values",
    "fail",
    "index_tensors",
    "is_pow2",
    "need_dim",
    "need_distinct_elements",
    "need_dtype",
    "need_flag",
    "need_last_dim_contiguous",
    "need_page_index_divisor",
    "need_table_covers_indirection",
    "need_tensor",
    "need_unit_stride",
    "overlapping_elements",
    "pool_layout",
    "resolve_sm_scale",
    "runs_interpreted",
    "SM_SCALE_RANGE",
    "spans_overlap",
]

# LOG2E and KV_LAYOUTS have twins in the core package (beam_shared_prefix.reference.LOG2E,
# beam_shared_prefix.prefix.base.KV_LAYOUTS): those light modules cannot import this package (whose __init__
# imports Triton), and this package imports nothing of beam_shared_prefix.
# tests/triton_kernels/test_tail_merge_args.py holds each pair equal.
LOG2E = 1.4426950408889634

KV_DTYPES = (torch.bfloat16, torch.float16)
KV_LAYOUTS = ("HND", "NHD")
_INT32_MAX = 2**31 - 1  # page_index_divisor is a compile-time int32 of the kernels
# The kernels take ``sm_scale * LOG2E`` as a float32 scalar: it must be a normal float32 (a subnormal one flushes to
# 0 on the GPU, and a 0 scale times a masked -inf score is NaN), so the scale lies in this range.
_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38
SM_SCALE_RANGE = (_F32_TINY / LOG2E, _F32_MAX / LOG2E)


def is_pow2(x) -> bool:
    """Whether ``x`` is a power of two as a launch configuration takes it: an ``int``, not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and (x & (x - 1)) == 0


def runs_interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter, on CPU tensors: decided by
    ``TRITON_INTERPRET`` when ``triton.jit`` decorated it (at import), in Triton's own spelling (1, true, on, yes)."""
    return type(kernel).__name__ == "InterpretedFunction"


class KernelInputError(ValueError):
    """An argument a launcher (the tail merge's, the cascade's, the shared-run stage's) or the tail merge's torch
    twin refuses; the message names the value, the limit and the fix."""


# The name of KernelInputError when the checks were the tail merge's alone; callers catch it (public API).
TailMergeInputError = KernelInputError


@dataclass(frozen=True)
class StepGeometry:
    """Sizes and element strides of one decode step's launch, derived from validated arguments.

    Attributes:
        num_rows: beam rows ``R*W``.
        beam_width: ``W``.
        num_qo_heads, num_kv_heads, group_size: ``Hq``, ``Hkv``, ``G = Hq // Hkv``.
        head_dim: ``D``.
        page_size: ``Pg`` tokens per page.
        num_pages: pages in the pool (page numbers must lie in ``[0, num_pages)``).
        max_seq_len: positions ``cache_indirection`` covers per sequence (``kv_len`` upper bound).
        sm_scale: softmax scale applied to ``q . k``.
        kv_strides: element strides ``(page, k_or_v, head, slot)`` of the pool, whatever the layout.
    """

    num_rows: int
    beam_width: int
    num_qo_heads: int
    num_kv_heads: int
    group_size: int
    head_dim: int
    page_size: int
    num_pages: int
    max_seq_len: int
    sm_scale: float
    kv_strides: Tuple[int, int, int, int]

    @property
    def num_requests(self) -> int:
        """``R = rows / W``."""
        return self.num_rows // self.beam_width


def pool_layout(kv_cache: torch.Tensor, kv_layout: str) -> Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]]:
    """``((pages, Hkv, Pg, D), (page, k_or_v, head, slot) element strides)`` of a 5-D ``[pages, 2, ...]`` pool."""
    s = kv_cache.stride()
    if kv_layout == "HND":  # [pages, 2, Hkv, Pg, D]
        num_pages, _, heads, page_size, dim = kv_cache.shape
        return (num_pages, heads, page_size, dim), (s[0], s[1], s[2], s[3])
    num_pages, _, page_size, heads, dim = kv_cache.shape  # NHD: [pages, 2, Pg, Hkv, D]
    return (num_pages, heads, page_size, dim), (s[0], s[1], s[3], s[2])


def fail(msg: str) -> None:
    """Raise :class:`KernelInputError` with ``msg`` (which names the value, its limit and the fix)."""
    raise KernelInputError(msg)


def need_tensor(name: str, x) -> None:
    """``x`` is a dense (strided) ``torch.Tensor``: the kernels address its elements by shape and strides."""
    if not isinstance(x, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if x.layout != torch.strided:  # the kernels address elements by shape and strides
        fail(f"{name} has layout {x.layout}; the kernels read dense tensors. Pass {name}.to_dense().")


def need_flag(name: str, value) -> bool:
    """``value`` is a switch, returned as a bool: ``True``/``False``, a numpy bool, or the int 0 or 1 (as the
    wrapper's constructor takes them); anything else is refused, since ``bool()`` would read ``"False"`` or
    ``"off"`` as on."""
    if isinstance(value, bool):
        return value
    if isinstance(value, np.bool_) or (type(value) is int and value in (0, 1)):
        return bool(value)
    fail(f"{name}={value!r} must be True or False (a {type(value).__name__} is not read as a switch).")


def need_dim(name: str, x: torch.Tensor, ndim: int, what: str) -> None:
    """``x`` has ``ndim`` dims (``what`` describes the expected shape in the message)."""
    if x.dim() != ndim:
        fail(f"{name} must be {what} ({ndim}-D), got shape {tuple(x.shape)}.")


def need_dtype(name: str, x: torch.Tensor, allowed) -> None:
    """``x.dtype`` is one of ``allowed``."""
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        fail(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; supported: {names}. Cast it before the call.")


def need_vector(name: str, x, dtype: torch.dtype, length: str, n: int, device, fix: str) -> None:
    """``x`` is a contiguous ``dtype`` ``[n]`` tensor on ``device`` (``length`` names ``n`` in the message, ``fix``
    says what to pass instead)."""
    if (not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != 1 or x.shape[0] != n
            or (n and x.stride(0) != 1) or x.device != torch.device(device)):
        got = (f"{x.dtype} {tuple(x.shape)} strides {tuple(x.stride())} on {x.device}" if isinstance(x, torch.Tensor)
               else type(x).__name__)
        fail(f"{name} must be a contiguous {str(dtype).replace('torch.', '')} [{length}={n}] tensor on {device}, "
             f"got {got}; {fix}")


def need_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    """``x`` (at least 1-D) has a unit-stride last dim and no negative stride."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        fail(
            f"{name} has last-dim stride {x.stride(-1)}; the head dim must be contiguous (stride 1). "
            f"Pass {name}.contiguous() or a view whose last dim is contiguous."
        )
    if any(s < 0 for s in x.stride()):
        fail(f"{name} has a negative stride {tuple(x.stride())}; pass a view with non-negative strides.")


def overlapping_elements(x: torch.Tensor) -> Optional[str]:
    """Why two elements of ``x`` share memory, or ``None``: with its dims ordered by stride, each stride
    must span the extent of the dims below it (a contiguous or gapped layout). A written tensor
    (``out``, the pool) whose rows or K and V planes overlap would have its writes overwrite each
    other, or read K and V from one memory."""
    extent = 1
    for stride, size in sorted((s, n) for n, s in zip(x.shape, x.stride(), strict=True) if n > 1):
        if stride < extent:
            return (f"shape {tuple(x.shape)} with strides {tuple(x.stride())} has elements that overlap in memory "
                    f"(a stride of {stride} under an extent of {extent})")
        extent = stride * size
    return None


def need_table_covers_indirection(beam_page_table: torch.Tensor, page_size: int, max_seq_len: int) -> None:
    """Raise :class:`KernelInputError` unless the ``[rows, max_pages]`` page table's columns hold every position of a
    ``cache_indirection`` of ``max_seq_len`` positions (``max_pages * page_size >= max_seq_len``): a position past the
    table would have no page."""
    max_pages = beam_page_table.shape[1]
    if max_pages * page_size < max_seq_len:
        need = -(-max_seq_len // page_size)
        raise KernelInputError(
            f"beam_page_table has {max_pages} columns of {page_size} tokens ({max_pages * page_size} positions) "
            f"but cache_indirection covers max_seq_len={max_seq_len}; pass a page table with at least "
            f"{need} columns, or a cache_indirection view limited to {max_pages * page_size} positions."
        )


def need_distinct_elements(name: str, x: torch.Tensor, fix: str) -> None:
    """``x`` (a tensor the kernels write) has no two elements in one memory location; ``fix`` ends the message."""
    why = overlapping_elements(x)
    if why is not None:
        fail(f"{name} of {why}; its writes would overwrite each other. {fix}")


def need_unit_stride(name: str, x: torch.Tensor) -> None:
    """A 1-D per-row tensor the kernels index as ``ptr + row`` (no stride argument)."""
    if x.shape[0] > 1 and x.stride(0) != 1:
        fail(f"{name} has stride {x.stride(0)}; the kernels read one int32 per row at unit stride. "
             f"Pass {name}.contiguous().")


def need_page_index_divisor(page_index_divisor) -> None:
    """``page_index_divisor`` (what a page-table entry is divided by to give a page) is an int the int32 entries
    can hold: 1 for page numbers, ``layers * kv_factor`` for TensorRT-LLM's block offsets."""
    if (isinstance(page_index_divisor, bool) or not isinstance(page_index_divisor, int) or page_index_divisor < 1
            or page_index_divisor > _INT32_MAX):
        fail(f"page_index_divisor={page_index_divisor!r} must be an int in [1, {_INT32_MAX}] (1 for page numbers, "
             f"layers*kv_factor for block offsets, which are int32).")


def byte_span(x: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``[first, last + 1)`` byte addresses of a tensor's elements (non-negative strides), ``None`` when empty."""
    numel = x.numel()
    if numel == 0:
        return None
    start = x.data_ptr()
    # Per layer and step in eager mode: a contiguous tensor's span is its numel (one C call, not ~4 us of
    # Python over its shape and strides).
    if x.is_contiguous():
        return start, start + numel * x.element_size()
    extent = 1
    for n, s in zip(x.shape, x.stride(), strict=True):
        extent += (n - 1) * s
    return start, start + extent * x.element_size()


def spans_overlap(sa, sb) -> bool:
    """Whether two :func:`byte_span` results share a byte (an empty tensor's ``None`` shares none)."""
    if sa is None or sb is None:
        return False
    return sa[0] < sb[1] and sb[0] < sa[1]


def check_pool_extent(kv_cache: torch.Tensor, kv_layout: str):
    """The pool (5-D, in ``kv_layout``) has pages of at least one token, and a page's heads and slots span less than
    int32 elements: the kernels add a KV head's offset in int32 (the page term is int64), which a view with the heads
    outside the pages could overflow. Returns :func:`pool_layout`'s result."""
    layout = (num_pages, pool_heads, page_size, pool_dim), kv_strides = pool_layout(kv_cache, kv_layout)
    if num_pages < 1 or page_size < 1:
        fail(f"kv_cache has {num_pages} pages of {page_size} tokens; both must be >= 1.")
    head_span = (pool_heads - 1) * kv_strides[2] + (page_size - 1) * kv_strides[3] + pool_dim
    if head_span >= 2**31:
        fail(f"kv_cache's heads and slots span {head_span} elements within a page (strides "
             f"{tuple(kv_cache.stride())}), past int32; pass a pool view whose pages hold their heads "
             f"([pages, 2, Hkv, Pg, D] or [pages, 2, Pg, Hkv, D]).")
    return layout


def check_step_metadata(
    q,
    new_k,
    new_v,
    kv_cache,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    out,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    extra_tensors=(),
    reads_step_kv=True,
    write_kv=False,
    error_flags=None,
) -> StepGeometry:
    """Validate the per-beam arguments of one decode step's launch, without a device sync.

    Shared by the tail kernel's launcher (which adds the prefix state) and the one-launch cascade
    kernel's (which adds the prompt page table). ``extra_tensors`` are ``(name, tensor)`` pairs that
    must be on q's device and must not overlap ``out``. A launch that neither reads this step's K/V
    nor writes an output (the shared-run stage) passes ``reads_step_kv=False`` and ``new_k``, ``new_v``
    and ``out`` as ``None``; the KV head count then comes from the pool. ``write_kv`` (the launch stores this step's
    K/V in the pool) and ``error_flags`` are read by the overlap check alone. Not memoized: :func:`check_step_args`
    is this check with its verdicts kept (and the overlap check run on every call); a memoized check that
    builds on it (``tail_merge_args.check_tail_merge_args``) calls it directly.

    Returns the :class:`StepGeometry`; raises :class:`KernelInputError` naming the offending
    value, its limit and the fix.
    """
    step_kv = bool(reads_step_kv)
    names = (("q", q),) + ((("new_k", new_k), ("new_v", new_v)) if step_kv else ()) + (
        ("kv_cache", kv_cache), ("beam_page_table", beam_page_table), ("kv_lens", kv_lens),
        ("prompt_lens", prompt_lens), ("cache_indirection", cache_indirection),
    ) + ((("out", out),) if step_kv else ()) + tuple(extra_tensors)
    for name, x in names:
        need_tensor(name, x)
    if kv_layout not in KV_LAYOUTS:
        fail(f"kv_layout={kv_layout!r} is not supported; use 'HND' ([pages, 2, Hkv, Pg, D]) or "
             f"'NHD' ([pages, 2, Pg, Hkv, D]).")
    need_page_index_divisor(page_index_divisor)
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        fail(f"beam_width={beam_width!r} must be an int >= 1.")

    device = q.device
    for name, x in names:
        if x.device != device:
            fail(f"{name} is on {x.device} but q is on {device}; put every tensor on one device.")

    # Queries and this step's K/V.
    need_dim("q", q, 3, "[rows, Hq, D]")
    need_dtype("q", q, KV_DTYPES)
    num_rows, num_qo_heads, head_dim = q.shape
    if num_qo_heads < 1 or head_dim < 1:
        fail(f"q is {tuple(q.shape)} with Hq={num_qo_heads}, D={head_dim}; both must be >= 1 (q is [rows, Hq, D]).")
    if step_kv:
        for name, x in (("new_k", new_k), ("new_v", new_v)):
            need_dim(name, x, 3, "[rows, Hkv, D]")
            if x.dtype != q.dtype:
                fail(f"{name} has dtype {x.dtype} but q has {q.dtype}; pass K/V in q's dtype.")
        if new_k.shape != new_v.shape:
            fail(f"new_k {tuple(new_k.shape)} and new_v {tuple(new_v.shape)} must have the same shape [rows, Hkv, D].")
        if new_k.shape[0] != num_rows or new_k.shape[2] != head_dim:
            fail(f"new_k must be [rows={num_rows}, Hkv, D={head_dim}] like q, got {tuple(new_k.shape)}.")
        num_kv_heads = new_k.shape[1]
    else:
        need_dim("kv_cache", kv_cache, 5, "[pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD)")
        num_kv_heads = pool_layout(kv_cache, kv_layout)[0][1]
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        fail(
            f"q's head count Hq={num_qo_heads} is not a multiple of the KV head count Hkv={num_kv_heads}; "
            f"GQA needs Hq % Hkv == 0."
        )

    # The paged pool.
    need_dim("kv_cache", kv_cache, 5, "[pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD)")
    if kv_cache.dtype != q.dtype:
        fail(f"kv_cache has dtype {kv_cache.dtype} but q has {q.dtype}; the pool and q must share a dtype.")
    if kv_cache.shape[1] != 2:
        fail(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(kv_cache.shape)}.")
    (num_pages, pool_heads, page_size, pool_dim), kv_strides = pool_layout(kv_cache, kv_layout)
    if pool_heads != num_kv_heads or pool_dim != head_dim:
        fail(
            f"kv_cache ({kv_layout}) holds Hkv={pool_heads}, D={pool_dim} but "
            f"{'new_k' if step_kv else 'q'} has Hkv={num_kv_heads}, D={head_dim}; check kv_layout (got "
            f"{kv_layout!r}) and the layer's pool view."
        )
    check_pool_extent(kv_cache, kv_layout)
    for name, x in (("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache)):
        if x is not None:
            need_last_dim_contiguous(name, x)
    need_distinct_elements("kv_cache", kv_cache, "Pass the pool's own layer view, whose pages, K and V planes, "
                            "slots and heads lie apart (a copy would take the step's K/V write away from the cache).")

    # Index tensors.
    if num_rows % beam_width:
        fail(f"q has {num_rows} rows, not a multiple of beam_width={beam_width}; rows must be R * W, request-major.")
    num_requests = num_rows // beam_width
    for name, x in (("kv_lens", kv_lens), ("prompt_lens", prompt_lens)):
        need_dim(name, x, 1, f"[rows={num_rows}] int32")
        need_dtype(name, x, (torch.int32,))
        if x.shape[0] != num_rows:
            fail(f"{name} has {x.shape[0]} entries but q has {num_rows} rows; pass one entry per beam row.")
        need_unit_stride(name, x)
    need_dim("beam_page_table", beam_page_table, 2, "[>= rows, max_pages] int32")
    need_dtype("beam_page_table", beam_page_table, (torch.int32,))
    if beam_page_table.shape[0] < num_rows:
        fail(
            f"beam_page_table has {beam_page_table.shape[0]} rows but q has {num_rows}; "
            f"pass one page-table row per beam row (row i = r*W + b)."
        )
    need_dim("cache_indirection", cache_indirection, 3, "[>= R, W_max, max_seq_len] int32")
    need_dtype("cache_indirection", cache_indirection, (torch.int32,))
    ind_requests, max_beam_width, max_seq_len = cache_indirection.shape
    if max_seq_len < 1:
        fail(f"cache_indirection is {tuple(cache_indirection.shape)}: max_seq_len=0 holds no position, so no row's "
             f"kv_len (>= 1) fits and nothing would be attended or written; pass the [R, W_max, max_seq_len] view "
             f"of the cache's whole length.")
    if ind_requests < num_requests:
        fail(
            f"cache_indirection has {ind_requests} request rows but the batch has R={num_requests} "
            f"(rows {num_rows} / beam_width {beam_width}); pass the batch's [R, W_max, max_seq_len] view."
        )
    if beam_width > max_beam_width:
        fail(
            f"beam_width={beam_width} exceeds the width cache_indirection was sized for (W_max={max_beam_width}); "
            f"beams would overwrite each other's slots. Size the KV cache for max_beam_width >= {beam_width}."
        )
    need_table_covers_indirection(beam_page_table, page_size, max_seq_len)

    if step_kv:
        need_dim("out", out, 3, "[rows, Hq, D]")
        if out.dtype != q.dtype:
            fail(f"out has dtype {out.dtype} but q has {q.dtype}; the output is written in q's dtype.")
        if tuple(out.shape) != (num_rows, num_qo_heads, head_dim):
            fail(f"out must be [rows={num_rows}, Hq={num_qo_heads}, D={head_dim}], got {tuple(out.shape)}.")
        need_last_dim_contiguous("out", out)
        need_distinct_elements("out", out, "Pass an output whose elements are distinct (a fresh buffer).")

    sm_scale = resolve_sm_scale(sm_scale, head_dim)

    return StepGeometry(
        num_rows=num_rows,
        beam_width=beam_width,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        group_size=num_qo_heads // num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
        sm_scale=sm_scale,
        kv_strides=kv_strides,
    )


def _refuse_meta(name: str) -> None:
    fail(f"{name} is on the meta device, which holds no data; pass a CUDA tensor (or a CPU one to the torch twin or "
         f"under TRITON_INTERPRET=1).")


def check_written_overlaps(written, tensors) -> None:
    """Each tensor named in ``written`` (``out``, the pool where a launch stores this step's K/V, the error flag, a
    stage's outputs) shares no byte with another of ``tensors`` (``(name, tensor or None)`` pairs: every argument the
    launch touches, the written ones included). Run on every call, since it reads addresses, which the memoized checks
    leave out; each span is computed once. A ``meta`` tensor (shapes without memory, its address its offset into no
    storage; the metadata checks take it) is refused here by name, before its address could be read as an overlap
    or a kernel reach for its data."""
    spans = []
    for name, x in tensors:
        if x is None:
            continue
        # (the metadata checks keep every tensor on one device: asking the first costs the every-call pass one
        # attribute; an overlap that involves another meta tensor still names it below)
        if not spans and x.is_meta:
            _refuse_meta(name)
        spans.append((name, byte_span(x)))
    for name, span in spans:
        if name not in written or span is None:
            continue
        for other, other_span in spans:
            # (spans_overlap, inline: this runs per layer and step in eager mode)
            if other != name and other_span is not None and span[0] < other_span[1] and other_span[0] < span[1]:
                for meta_name, x in tensors:
                    if meta_name in (name, other) and x.is_meta:
                        _refuse_meta(meta_name)
                fail(f"{name} overlaps {other} in memory; the launch writes {name}, so pass it a buffer of its own "
                     f"({name} may alias nothing).")


def step_writes(write_kv: bool) -> Tuple[str, ...]:
    """What a step launch writes: ``out``, the error flag, and the pool where it stores this step's K/V."""
    return ("out", "error_flags", "kv_cache") if write_kv else ("out", "error_flags")


def _step_overlaps(q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
                   out, *, extra_tensors=(), reads_step_kv=True, write_kv=False, error_flags=None, **_) -> None:
    if reads_step_kv:  # (otherwise there is no out: the shared-run stage, which checks its own writes)
        check_written_overlaps(step_writes(write_kv), (
            ("out", out), ("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache))
            + index_tensors(beam_page_table, kv_lens, prompt_lens, cache_indirection) + tuple(extra_tensors)
            + (("error_flags", error_flags),))


def index_tensors(beam_page_table, kv_lens, prompt_lens, cache_indirection) -> tuple:
    """The step's index tensors as ``(name, tensor)`` pairs: an ``out`` stored over one would change the
    lengths, pages or source beams that programs still to run read."""
    return (("beam_page_table", beam_page_table), ("kv_lens", kv_lens), ("prompt_lens", prompt_lens),
            ("cache_indirection", cache_indirection))


check_step_args = memoize_metadata_check(check_step_metadata, every_call=_step_overlaps)


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale as a float: ``1/sqrt(D)`` for None; anything but a finite positive number
    fails (the kernels take the running max on unscaled scores, which needs a positive scale), as does one whose
    ``sm_scale * log2(e)`` is not a normal float32 (outside :data:`SM_SCALE_RANGE`), a bool, and a tensor, whose value
    the memoized checks would not see change."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, (bool, np.bool_)):
        fail(f"sm_scale={sm_scale!r} is a bool; pass a float (default 1/sqrt(D)).")
    if isinstance(sm_scale, torch.Tensor):  # the kept verdicts key a tensor by its metadata, not its value
        fail(f"sm_scale is a tensor ({sm_scale.dtype}, shape {tuple(sm_scale.shape)}); pass a Python float "
             f"(float(sm_scale), once, outside the step loop: on a GPU it syncs).")
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        fail(f"sm_scale={sm_scale!r} must be a finite positive float (default 1/sqrt(D)).")
    if not SM_SCALE_RANGE[0] <= value <= SM_SCALE_RANGE[1]:
        fail(f"sm_scale={sm_scale!r} is outside [{SM_SCALE_RANGE[0]:.3g}, {SM_SCALE_RANGE[1]:.3g}]: the kernels take "
             f"sm_scale * log2(e) as a normal float32 (default 1/sqrt(D)).")
    return value


def check_device(q: torch.Tensor, kernel, what: str) -> None:
    """``q`` is on CUDA, or ``kernel`` (the launch's ``@triton.jit`` function) runs in Triton's interpreter
    (:func:`runs_interpreted`); ``what`` names the launch in the message."""
    if not q.is_cuda and not runs_interpreted(kernel):
        raise KernelInputError(
            f"{what} is a Triton kernel and needs CUDA tensors, got {q.device}; on CPU use the "
            f"reference prefix + beam_tail_attention_merge_torch (or set TRITON_INTERPRET=1 before importing triton)."
        )


def check_tail_index_values(
    geom: StepGeometry,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    cache_indirection: torch.Tensor,
    page_index_divisor: int,
) -> None:
    """Synchronous value checks for check mode: reads the index tensors back from the device.

    Checks ``0 <= prompt_len < kv_len <= max_seq_len`` (but for padding rows, ``kv_len`` 1 with a one-token
    prompt, as :func:`triton_kernels.device_errors.kv_len_bad` has it), that the earlier generated positions'
    ``cache_indirection`` entries are beams in ``[0, W)``, and that every page the launch touches
    (each row's write page and the pages of its gathered tail) is in ``[0, num_pages)``.
    """
    rows, W, pg = geom.num_rows, geom.beam_width, geom.page_size
    if rows == 0:
        return
    plen = prompt_lens.long().cpu()
    klen = kv_lens.long().cpu()
    bad = torch.nonzero(plen < 0).flatten()
    if bad.numel():
        i = int(bad[0])
        fail(f"prompt_lens[{i}]={int(plen[i])} is negative; prompt lengths must be >= 0.")
    # TensorRT-LLM's warm-up and CUDA-graph padding rows (kv_len 1, planned with a one-token prompt) are
    # served without a write, as the kernels' device rule has it (device_errors.kv_len_bad).
    padding = (klen == 1) & (plen == 1)
    bad = torch.nonzero((klen < plen + 1) & ~padding).flatten()
    if bad.numel():
        i = int(bad[0])
        fail(
            f"kv_lens[{i}]={int(klen[i])} must be >= prompt_lens[{i}] + 1 = {int(plen[i]) + 1}: kv_len counts "
            f"this step's token, which follows the prompt. Pass kv_lens after appending the current token."
        )
    bad = torch.nonzero(klen > geom.max_seq_len).flatten()
    if bad.numel():
        i = int(bad[0])
        fail(
            f"kv_lens[{i}]={int(klen[i])} exceeds the cache capacity max_seq_len={geom.max_seq_len} "
            f"(cache_indirection's last dim); size the cache for longer sequences or stop the request earlier."
        )
    table = beam_page_table[:rows].long().cpu()
    ind = cache_indirection.cpu()
    row = torch.arange(rows)
    req, beam = row // W, row % W
    num_pages = geom.num_pages

    def check_pages(pages: torch.Tensor, where: str, rows_of: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor):
        bad_mask = mask & ((pages < 0) | (pages >= num_pages))
        if bad_mask.any():
            k = torch.nonzero(bad_mask)[0]
            idx = tuple(int(v) for v in k)
            tr, tc = int(rows_of[idx]), int(cols[idx])
            fail(
                f"{where}: beam_page_table[{tr}, {tc}]={int(table[tr, tc])} // page_index_divisor={page_index_divisor} "
                f"= page {int(pages[idx])} is outside the pool [0, {num_pages}); the page table is stale or the pool "
                f"too small (check page_index_divisor and that the table belongs to this pool)."
            )

    wcol = (klen - 1) // pg
    wpage = table[row, wcol] // page_index_divisor
    check_pages(wpage, "the write position kv_len - 1", row, wcol, torch.ones(rows, dtype=torch.bool))
    earlier = (klen - 1 - plen).clamp(min=0)
    max_earlier = int(earlier.max())
    if max_earlier == 0:
        return
    t = plen[:, None] + torch.arange(max_earlier)[None, :]
    valid = t < (klen - 1)[:, None]
    tc = torch.where(valid, t, torch.zeros_like(t))
    src = ind[req[:, None], beam[:, None], tc].long()
    bad_mask = valid & ((src < 0) | (src >= W))
    if bad_mask.any():
        i, j = (int(v) for v in torch.nonzero(bad_mask)[0])
        fail(
            f"cache_indirection[{int(req[i])}, {int(beam[i])}, {int(tc[i, j])}]={int(src[i, j])} is not a beam in "
            f"[0, beam_width={W}); pass the batch's cache_indirection (row r = r-th request) for this beam width."
        )
    src = torch.where(valid, src, beam[:, None])
    src_row = req[:, None] * W + src
    col = tc // pg
    pages = table[src_row, col] // page_index_divisor
    check_pages(pages, "a gathered tail position", src_row, col, valid)
