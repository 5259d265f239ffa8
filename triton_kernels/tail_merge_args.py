"""Argument checks shared by the fused tail kernel's launcher and its unfused torch twin.

Everything here is host-only and needs no device sync (shapes, dtypes, strides, devices, layout
strings and the bounds that follow from shapes alone), except :func:`check_tail_index_values`,
which reads lengths, page indices and ``cache_indirection`` back from the device and is meant for
check mode (``validate_indices=True``).

Every error is a :class:`TailMergeInputError` whose message names the argument, the value found,
the limit and the fix.

The checks run per layer and step in eager mode. All but the overlap checks read metadata only
(shapes, strides, dtypes, devices and the Python scalars passed), so :func:`memoize_metadata_check`
keeps their verdicts on metadata seen before (a failing check is never kept); the overlap checks,
which read addresses, run on every call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, TypeVar

import torch

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

LOG2E = 1.4426950408889634

KV_DTYPES = (torch.bfloat16, torch.float16)
PREFIX_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_LAYOUTS = ("HND", "NHD")
LSE_LAYOUTS = ("NH", "HN")
LSE_BASES = ("log2", "ln")
_INT32_MAX = 2**31 - 1  # page_index_divisor is a compile-time int32 of the kernels


def is_pow2(x) -> bool:
    """Whether ``x`` is a power of two as a launch configuration takes it: an ``int``, not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and (x & (x - 1)) == 0


def runs_interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter, on CPU tensors: decided by
    ``TRITON_INTERPRET`` when ``triton.jit`` decorated it (at import), in Triton's own spelling (1, true, on, yes)."""
    return type(kernel).__name__ == "InterpretedFunction"


class TailMergeInputError(ValueError):
    """An argument of the tail merge the launcher refuses; the message names the value, the limit and the fix."""


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


@dataclass(frozen=True)
class TailMergeGeometry(StepGeometry):
    """:class:`StepGeometry` plus how the prefix state's LSE is read.

    Attributes:
        lse_strides: element strides ``(row, head)`` of ``prefix_lse``, whatever the layout.
        lse_scale: multiplier turning ``prefix_lse`` into base 2 (1 for log2, log2(e) for ln).
    """

    lse_strides: Tuple[int, int] = (0, 0)
    lse_scale: float = 1.0


# The metadata keys of the checks' past verdicts a memoized check keeps (one per layer and argument set
# in a steady eager run); past it the store starts over.
METADATA_CHECKS_KEPT = 1024

_SCALAR_TYPES = (bool, int, float, str)
# Every memoized check's store (tests empty them all to compare against the checks themselves).
_KEPT_STORES = []
_Check = TypeVar("_Check", bound=Callable)


def _metadata_key(values) -> Optional[tuple]:
    """A hashable key of everything an address-free argument check reads from ``values``: each tensor's type,
    shape, strides, dtype and device, each scalar's type and value, recursing into tuples; ``None`` when a
    value is none of these (the check then runs)."""
    key = []
    for v in values:
        if isinstance(v, torch.Tensor):
            key += (type(v), v.shape, v.stride(), v.dtype, v.device)
        elif v is None or type(v) in _SCALAR_TYPES:
            key += (type(v), v)
        elif type(v) is tuple:
            inner = _metadata_key(v)
            if inner is None:
                return None
            key.append(inner)
        else:
            return None
    return tuple(key)


def memoize_metadata_check(check: _Check, every_call: Optional[Callable] = None) -> _Check:
    """``check`` (a function of its arguments' metadata alone, addresses excluded: it must not compare where
    tensors lie; returning an immutable result or raising) with its results kept by :func:`_metadata_key`:
    equal metadata gets the kept result without the check (a key is about a sixth of a full check's Python).
    Exceptions propagate and are not kept, and arguments a key cannot describe are checked every time.
    Leaving addresses out, one verdict serves every layer and step of a shape, wherever its tensors lie.
    ``every_call`` (same arguments) runs after it on every call, kept result or not: the checks that do
    read addresses."""
    kept = {}
    _KEPT_STORES.append(kept)

    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            key = _metadata_key(args + tuple(sorted(kwargs.items())))
        except RuntimeError:  # e.g. a sparse tensor's strides: the check names what is wrong
            key = None
        result = None if key is None else kept.get(key)
        if result is None:
            result = check(*args, **kwargs)
            if key is not None:
                if len(kept) >= METADATA_CHECKS_KEPT:
                    kept.clear()
                kept[key] = result
        if every_call is not None:
            every_call(*args, **kwargs)
        return result

    checked.kept = kept  # for tests
    return checked


def pool_layout(kv_cache: torch.Tensor, kv_layout: str) -> Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]]:
    """``((pages, Hkv, Pg, D), (page, k_or_v, head, slot) element strides)`` of a 5-D ``[pages, 2, ...]`` pool."""
    s = kv_cache.stride()
    if kv_layout == "HND":  # [pages, 2, Hkv, Pg, D]
        num_pages, _, heads, page_size, dim = kv_cache.shape
        return (num_pages, heads, page_size, dim), (s[0], s[1], s[2], s[3])
    num_pages, _, page_size, heads, dim = kv_cache.shape  # NHD: [pages, 2, Pg, Hkv, D]
    return (num_pages, heads, page_size, dim), (s[0], s[1], s[3], s[2])


def _fail(msg: str) -> None:
    raise TailMergeInputError(msg)


def _need_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}.")


def _need_dim(name: str, x: torch.Tensor, ndim: int, what: str) -> None:
    if x.dim() != ndim:
        _fail(f"{name} must be {what} ({ndim}-D), got shape {tuple(x.shape)}.")


def _need_dtype(name: str, x: torch.Tensor, allowed) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        _fail(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; supported: {names}. Cast it before the call.")


def _need_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        _fail(
            f"{name} has last-dim stride {x.stride(-1)}; the head dim must be contiguous (stride 1). "
            f"Pass {name}.contiguous() or a view whose last dim is contiguous."
        )
    if any(s < 0 for s in x.stride()):
        _fail(f"{name} has a negative stride {tuple(x.stride())}; pass a view with non-negative strides.")


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


def _need_distinct_elements(name: str, x: torch.Tensor, fix: str) -> None:
    why = overlapping_elements(x)
    if why is not None:
        _fail(f"{name} of {why}; its writes would overwrite each other. {fix}")


def _need_unit_stride(name: str, x: torch.Tensor) -> None:
    """A 1-D per-row tensor the kernels index as ``ptr + row`` (no stride argument)."""
    if x.shape[0] > 1 and x.stride(0) != 1:
        _fail(f"{name} has stride {x.stride(0)}; the kernels read one int32 per row at unit stride. "
              f"Pass {name}.contiguous().")


def _byte_span(x: torch.Tensor) -> Optional[Tuple[int, int]]:
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


def _spans_overlap(sa, sb) -> bool:
    """Whether two :func:`_byte_span` results share a byte (an empty tensor's ``None`` shares none)."""
    if sa is None or sb is None:
        return False
    return sa[0] < sb[1] and sb[0] < sa[1]


def _step_metadata(
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
) -> StepGeometry:
    """Validate the per-beam arguments of one decode step's launch, without a device sync.

    Shared by the tail kernel's launcher (which adds the prefix state) and the one-launch cascade
    kernel's (which adds the prompt page table). ``extra_tensors`` are ``(name, tensor)`` pairs that
    must be on q's device and must not overlap ``out``. A launch that neither reads this step's K/V
    nor writes an output (the shared-run stage) passes ``reads_step_kv=False`` and ``new_k``, ``new_v``
    and ``out`` as ``None``; the KV head count then comes from the pool.

    Returns the :class:`StepGeometry`; raises :class:`TailMergeInputError` naming the offending
    value, its limit and the fix.
    """
    step_kv = bool(reads_step_kv)
    names = (("q", q),) + ((("new_k", new_k), ("new_v", new_v)) if step_kv else ()) + (
        ("kv_cache", kv_cache), ("beam_page_table", beam_page_table), ("kv_lens", kv_lens),
        ("prompt_lens", prompt_lens), ("cache_indirection", cache_indirection),
    ) + ((("out", out),) if step_kv else ()) + tuple(extra_tensors)
    for name, x in names:
        _need_tensor(name, x)
    if kv_layout not in KV_LAYOUTS:
        _fail(f"kv_layout={kv_layout!r} is not supported; use 'HND' ([pages, 2, Hkv, Pg, D]) or "
              f"'NHD' ([pages, 2, Pg, Hkv, D]).")
    if (isinstance(page_index_divisor, bool) or not isinstance(page_index_divisor, int) or page_index_divisor < 1
            or page_index_divisor > _INT32_MAX):
        _fail(f"page_index_divisor={page_index_divisor!r} must be an int in [1, {_INT32_MAX}] (1 for page numbers, "
              f"layers*kv_factor for block offsets, which are int32).")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        _fail(f"beam_width={beam_width!r} must be an int >= 1.")

    device = q.device
    for name, x in names:
        if x.device != device:
            _fail(f"{name} is on {x.device} but q is on {device}; put every tensor on one device.")

    # Queries and this step's K/V.
    _need_dim("q", q, 3, "[rows, Hq, D]")
    _need_dtype("q", q, KV_DTYPES)
    num_rows, num_qo_heads, head_dim = q.shape
    if step_kv:
        for name, x in (("new_k", new_k), ("new_v", new_v)):
            _need_dim(name, x, 3, "[rows, Hkv, D]")
            if x.dtype != q.dtype:
                _fail(f"{name} has dtype {x.dtype} but q has {q.dtype}; pass K/V in q's dtype.")
        if new_k.shape != new_v.shape:
            _fail(f"new_k {tuple(new_k.shape)} and new_v {tuple(new_v.shape)} must have the same shape [rows, Hkv, D].")
        if new_k.shape[0] != num_rows or new_k.shape[2] != head_dim:
            _fail(f"new_k must be [rows={num_rows}, Hkv, D={head_dim}] like q, got {tuple(new_k.shape)}.")
        num_kv_heads = new_k.shape[1]
    else:
        _need_dim("kv_cache", kv_cache, 5, "[pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD)")
        num_kv_heads = pool_layout(kv_cache, kv_layout)[0][1]
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        _fail(
            f"q's head count Hq={num_qo_heads} is not a multiple of the KV head count Hkv={num_kv_heads}; "
            f"GQA needs Hq % Hkv == 0."
        )

    # The paged pool.
    _need_dim("kv_cache", kv_cache, 5, "[pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD)")
    if kv_cache.dtype != q.dtype:
        _fail(f"kv_cache has dtype {kv_cache.dtype} but q has {q.dtype}; the pool and q must share a dtype.")
    if kv_cache.shape[1] != 2:
        _fail(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(kv_cache.shape)}.")
    (num_pages, pool_heads, page_size, pool_dim), kv_strides = pool_layout(kv_cache, kv_layout)
    if pool_heads != num_kv_heads or pool_dim != head_dim:
        _fail(
            f"kv_cache ({kv_layout}) holds Hkv={pool_heads}, D={pool_dim} but "
            f"{'new_k' if step_kv else 'q'} has Hkv={num_kv_heads}, D={head_dim}; check kv_layout (got "
            f"{kv_layout!r}) and the layer's pool view."
        )
    if num_pages < 1 or page_size < 1:
        _fail(f"kv_cache has {num_pages} pages of {page_size} tokens; both must be >= 1.")
    # The tail kernels add a KV head's offset in int32 (the page term is int64); a view with the
    # heads outside the pages could overflow it.
    head_span = (pool_heads - 1) * kv_strides[2] + (page_size - 1) * kv_strides[3] + pool_dim
    if head_span >= 2**31:
        _fail(f"kv_cache's heads and slots span {head_span} elements within a page (strides "
              f"{tuple(kv_cache.stride())}), past int32; pass a pool view whose pages hold their heads "
              f"([pages, 2, Hkv, Pg, D] or [pages, 2, Pg, Hkv, D]).")
    for name, x in (("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache)):
        if x is not None:
            _need_last_dim_contiguous(name, x)
    _need_distinct_elements("kv_cache", kv_cache, "Pass the pool's own layer view, whose pages, K and V planes, "
                            "slots and heads lie apart (a copy would take the step's K/V write away from the cache).")

    # Index tensors.
    if num_rows % beam_width:
        _fail(f"q has {num_rows} rows, not a multiple of beam_width={beam_width}; rows must be R * W, request-major.")
    num_requests = num_rows // beam_width
    for name, x in (("kv_lens", kv_lens), ("prompt_lens", prompt_lens)):
        _need_dim(name, x, 1, f"[rows={num_rows}] int32")
        _need_dtype(name, x, (torch.int32,))
        if x.shape[0] != num_rows:
            _fail(f"{name} has {x.shape[0]} entries but q has {num_rows} rows; pass one entry per beam row.")
        _need_unit_stride(name, x)
    _need_dim("beam_page_table", beam_page_table, 2, "[>= rows, max_pages] int32")
    _need_dtype("beam_page_table", beam_page_table, (torch.int32,))
    if beam_page_table.shape[0] < num_rows:
        _fail(
            f"beam_page_table has {beam_page_table.shape[0]} rows but q has {num_rows}; "
            f"pass one page-table row per beam row (row i = r*W + b)."
        )
    _need_dim("cache_indirection", cache_indirection, 3, "[>= R, W_max, max_seq_len] int32")
    _need_dtype("cache_indirection", cache_indirection, (torch.int32,))
    ind_requests, max_beam_width, max_seq_len = cache_indirection.shape
    if ind_requests < num_requests:
        _fail(
            f"cache_indirection has {ind_requests} request rows but the batch has R={num_requests} "
            f"(rows {num_rows} / beam_width {beam_width}); pass the batch's [R, W_max, max_seq_len] view."
        )
    if beam_width > max_beam_width:
        _fail(
            f"beam_width={beam_width} exceeds the width cache_indirection was sized for (W_max={max_beam_width}); "
            f"beams would overwrite each other's slots. Size the KV cache for max_beam_width >= {beam_width}."
        )
    max_pages = beam_page_table.shape[1]
    if max_pages * page_size < max_seq_len:
        need = -(-max_seq_len // page_size)
        _fail(
            f"beam_page_table has {max_pages} columns of {page_size} tokens ({max_pages * page_size} positions) "
            f"but cache_indirection covers max_seq_len={max_seq_len}; pass a page table with at least "
            f"{need} columns, or a cache_indirection view limited to {max_pages * page_size} positions."
        )

    if step_kv:
        _need_dim("out", out, 3, "[rows, Hq, D]")
        if out.dtype != q.dtype:
            _fail(f"out has dtype {out.dtype} but q has {q.dtype}; the output is written in q's dtype.")
        if tuple(out.shape) != (num_rows, num_qo_heads, head_dim):
            _fail(f"out must be [rows={num_rows}, Hq={num_qo_heads}, D={head_dim}], got {tuple(out.shape)}.")
        _need_last_dim_contiguous("out", out)
        _need_distinct_elements("out", out, "Pass an output whose elements are distinct (a fresh buffer).")

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


def _check_out_overlaps(out, others) -> None:
    """``out`` shares no byte with any of ``others`` (``(name, tensor or None)`` pairs): run on every call,
    since it reads addresses, which the memoized checks leave out."""
    out_span = _byte_span(out)
    for name, x in others:
        if x is not None and _spans_overlap(out_span, _byte_span(x)):
            _fail(f"out overlaps {name} in memory; pass a separate output buffer (out may alias nothing).")


def _step_overlaps(q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
                   out, *, extra_tensors=(), reads_step_kv=True, **_) -> None:
    if reads_step_kv:
        _check_out_overlaps(out, (("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache))
                            + tuple(extra_tensors))


check_step_args = memoize_metadata_check(_step_metadata, every_call=_step_overlaps)


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale as a float: ``1/sqrt(D)`` for None; anything but a finite positive number
    fails (the kernels take the running max on unscaled scores, which needs a positive scale)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        _fail(f"sm_scale={sm_scale!r} must be a finite positive float (default 1/sqrt(D)).")
    return value


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
) -> TailMergeGeometry:
    """Validate the arguments of ``beam_tail_attention_merge`` without a device sync (with
    ``reads_step_kv=False``, those of ``beam_shared_run_attention``: ``new_k``, ``new_v`` and ``out`` ``None``).

    Returns the :class:`TailMergeGeometry` the kernel is launched with; raises
    :class:`TailMergeInputError` naming the offending value, its limit and the fix.
    """
    _need_tensor("prefix_out", prefix_out)
    _need_tensor("prefix_lse", prefix_lse)
    if prefix_lse_layout not in LSE_LAYOUTS:
        _fail(f"prefix_lse_layout={prefix_lse_layout!r} is not supported; use 'NH' ([rows, heads], FlashInfer) or "
              f"'HN' ([heads, rows], FA4).")
    if prefix_lse_base not in LSE_BASES:
        _fail(f"prefix_lse_base={prefix_lse_base!r} is not supported; use 'log2' (FlashInfer) or 'ln' (FA4).")
    geom = _step_metadata(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width, out,
        sm_scale=sm_scale, kv_layout=kv_layout, page_index_divisor=page_index_divisor,
        extra_tensors=(("prefix_out", prefix_out), ("prefix_lse", prefix_lse)), reads_step_kv=reads_step_kv,
    )
    num_rows, num_qo_heads, head_dim = geom.num_rows, geom.num_qo_heads, geom.head_dim
    _need_dim("prefix_out", prefix_out, 3, "[rows, Hq, D]")
    _need_dtype("prefix_out", prefix_out, PREFIX_OUT_DTYPES)
    if tuple(prefix_out.shape) != (num_rows, num_qo_heads, head_dim):
        _fail(f"prefix_out must be [rows={num_rows}, Hq={num_qo_heads}, D={head_dim}], got {tuple(prefix_out.shape)}.")
    _need_last_dim_contiguous("prefix_out", prefix_out)
    _need_dim("prefix_lse", prefix_lse, 2, "[rows, Hq] (NH) or [Hq, rows] (HN) float32")
    _need_dtype("prefix_lse", prefix_lse, (torch.float32,))
    want = (num_rows, num_qo_heads) if prefix_lse_layout == "NH" else (num_qo_heads, num_rows)
    if tuple(prefix_lse.shape) != want:
        _fail(
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
                         beam_width, prefix_out, prefix_lse, out, *, reads_step_kv=True, **_) -> None:
    if reads_step_kv:
        _check_out_overlaps(out, (("q", q), ("new_k", new_k), ("new_v", new_v), ("kv_cache", kv_cache),
                                  ("prefix_out", prefix_out), ("prefix_lse", prefix_lse)))


check_tail_merge_args = memoize_metadata_check(_tail_merge_metadata, every_call=_tail_merge_overlaps)


def check_tail_index_values(
    geom: StepGeometry,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    cache_indirection: torch.Tensor,
    page_index_divisor: int,
) -> None:
    """Synchronous value checks for check mode: reads the index tensors back from the device.

    Checks ``0 <= prompt_len < kv_len <= max_seq_len``, that the earlier generated positions'
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
        _fail(f"prompt_lens[{i}]={int(plen[i])} is negative; prompt lengths must be >= 0.")
    bad = torch.nonzero(klen < plen + 1).flatten()
    if bad.numel():
        i = int(bad[0])
        _fail(
            f"kv_lens[{i}]={int(klen[i])} must be >= prompt_lens[{i}] + 1 = {int(plen[i]) + 1}: kv_len counts "
            f"this step's token, which follows the prompt. Pass kv_lens after appending the current token."
        )
    bad = torch.nonzero(klen > geom.max_seq_len).flatten()
    if bad.numel():
        i = int(bad[0])
        _fail(
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
            _fail(
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
        _fail(
            f"cache_indirection[{int(req[i])}, {int(beam[i])}, {int(tc[i, j])}]={int(src[i, j])} is not a beam in "
            f"[0, beam_width={W}); pass the batch's cache_indirection (row r = r-th request) for this beam width."
        )
    src = torch.where(valid, src, beam[:, None])
    src_row = req[:, None] * W + src
    col = tc // pg
    pages = table[src_row, col] // page_index_divisor
    check_pages(pages, "a gathered tail position", src_row, col, valid)


def check_tail_skip(tail_skip, num_rows: int, device) -> None:
    """``tail_skip`` (the shared-run stage's output, the tail kernel's input) is a contiguous int32
    ``[rows]`` tensor on ``device``; raises :class:`TailMergeInputError` naming what it got."""
    if (not isinstance(tail_skip, torch.Tensor) or tail_skip.dtype != torch.int32 or tail_skip.dim() != 1
            or tail_skip.shape[0] != num_rows or (num_rows and tail_skip.stride(0) != 1)
            or tail_skip.device != torch.device(device)):
        got = (f"{tail_skip.dtype} {tuple(tail_skip.shape)} strides {tuple(tail_skip.stride())} on {tail_skip.device}"
               if isinstance(tail_skip, torch.Tensor) else type(tail_skip).__name__)
        _fail(f"tail_skip must be a contiguous int32 [rows={num_rows}] tensor on {device}, got {got}; allocate "
              f"torch.empty(rows, dtype=torch.int32, device=q.device) and fill it with beam_shared_run_attention.")
