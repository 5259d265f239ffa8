"""Host-side step planner: per-request prompt page tables -> a validated, cached :class:`StepPlan`.

A beam-search batch of ``R`` requests with ``W`` beams each has ``R * W`` query rows, ordered
request-major (row ``i = r * W + b``). Every beam of request ``r`` shares the prompt
``[0, P_r)``, whose K/V live in beam 0's pages. The prefix pass attends that prompt once per
request for all ``W`` rows, so it needs, per request: the query-row range, the prompt's pages and
how many tokens of the last page belong to the prompt. That is what a plan holds.

The prompt page table of a request does not change while it decodes, so a plan is reused across
steps and layers. Plans are cached by batch composition: the same key (by default a digest of the
inputs; callers that know their batch, like the TensorRT-LLM adapter, pass request ids) returns
the same object with no further work.

Every check that guards against silent KV corruption (a page index outside the pool, a beam width
wider than the cache was sized for, lengths that do not fit their pages) runs here, on the host,
before anything reaches a kernel.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence, Tuple, Union

import numpy as np

ArrayLike = Union[np.ndarray, Sequence[int], "torch.Tensor"]  # noqa: F821

__all__ = ["StepPlan", "StepPlanner", "PlanError", "build_step_plan", "cdiv"]


# Lengths, offsets and page numbers go to the kernels as int32.
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)

logger = logging.getLogger("beam_shared_prefix")
# Whether this process has logged the copies read without request ids (once: a caller that pads every step would
# otherwise log at every step).
_warned_copies_without_ids = False


class PlanError(ValueError):
    """An input the planner refuses: the message names the value, the limit and the fix."""


def cdiv(a, b):
    """Ceiling division for ints and numpy arrays of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The prefix plan of one batch composition (all host arrays are int32 numpy, read-only).

    Attributes:
        num_requests: ``R``.
        beam_width: ``W``, query rows per request.
        page_size: tokens per KV page (``Pg``).
        num_cache_pages: pages in the pool; every page index is in ``[0, num_cache_pages)``.
        qo_indptr: ``[R + 1]``, query-row offsets, ``r * W``.
        kv_page_indptr: ``[R + 1]``, offsets into ``kv_page_indices`` of each request's prompt pages.
        kv_page_indices: ``[kv_page_indptr[-1]]``, beam 0's prompt pages, request-major.
        kv_last_page_len: ``[R]``, prompt tokens in each request's last prompt page, in ``[1, Pg]``.
        prompt_lens: ``[R]``, prompt length ``P_r`` in tokens.
        prompt_lens_per_row: ``[R * W]``, ``P_r`` repeated per beam row (the tail kernel's view).
        kv_pages_per_request: ``[R]``, ``ceil(P_r / Pg)``.
        page_table: ``[R, max_prompt_pages]``, the same pages as a dense table (FA4's form); padding
            entries repeat the request's first page so that they are always valid indices.
        max_prompt_len: ``max(P_r)``.
        max_prompt_pages: ``max(ceil(P_r / Pg))``.
        key: the cache key this plan was stored under.
    """

    num_requests: int
    beam_width: int
    page_size: int
    num_cache_pages: int
    qo_indptr: np.ndarray
    kv_page_indptr: np.ndarray
    kv_page_indices: np.ndarray
    kv_last_page_len: np.ndarray
    prompt_lens: np.ndarray
    prompt_lens_per_row: np.ndarray
    kv_pages_per_request: np.ndarray
    page_table: np.ndarray
    max_prompt_len: int
    max_prompt_pages: int
    key: Hashable = None
    # Per-device caches of the arrays as tensors, filled lazily by `device_tensors`.
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # Host arrays derived lazily from the plan's (`prompt_pages_digest`).
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        """``R * W``: query rows of the batch."""
        return self.num_requests * self.beam_width

    @property
    def prompt_pages_digest(self) -> np.ndarray:
        """``[R]`` int64: a digest of each request's prompt pages (the XOR over its columns of a term that is a
        bijection of the column's page), which the device error flag's page-table audit compares with beam 0's page
        table (``triton_kernels.device_errors.PLAN_PAGE``): one page unlike the plan's always changes it. Computed
        once a plan."""
        digest = self._derived.get("prompt_pages_digest")
        if digest is None:
            col = np.arange(self.page_table.shape[1], dtype=np.int64)
            x = self.page_table.astype(np.int64) * 0x5BD1E995 + col[None, :] * 0x1B873593 + 0x68E31DA4
            # (the device's rule, triton_kernels.page_table_audit_kernel.prompt_page_digest_term; int64 products wrap)
            x ^= x >> 29
            x *= 0x7FEB352D
            x ^= x >> 32
            x *= 0x2C1B3C6D
            x ^= x >> 31
            x[col[None, :] >= self.kv_pages_per_request.astype(np.int64)[:, None]] = 0
            digest = np.bitwise_xor.reduce(x, axis=1) if x.shape[1] else np.zeros(self.num_requests, np.int64)
            digest.setflags(write=False)
            self._derived["prompt_pages_digest"] = digest
        return digest

    @property
    def total_prompt_pages(self) -> int:
        """Prompt pages of the whole batch, ``kv_page_indptr[-1]``."""
        return int(self.kv_page_indptr[-1])

    def device_tensors(self, device) -> dict:
        """The plan's arrays as int32 torch tensors on ``device`` (copied once per device)."""
        import torch

        dev = torch.device(device)
        cached = self._device_cache.get(dev)
        if cached is None:
            names = (
                "qo_indptr",
                "kv_page_indptr",
                "kv_page_indices",
                "kv_last_page_len",
                "prompt_lens",
                "prompt_lens_per_row",
                "page_table",
            )
            # A writable copy: from_numpy would alias the read-only plan arrays (on CPU, .to() is
            # a no-op), so a caller writing the tensor would corrupt a cached plan.
            cached = {n: torch.from_numpy(np.array(getattr(self, n), copy=True)).to(dev) for n in names}
            self._device_cache[dev] = cached
        return cached


def _checked_int_array(name: str, value: ArrayLike) -> np.ndarray:
    """``value`` as a 1-D integer numpy array in its own dtype (no conversion copy)."""
    if hasattr(value, "detach"):  # torch tensor, possibly on a device: one explicit host copy
        if value.dtype.is_floating_point or value.dtype.is_complex:
            # (checked here: NumPy has no bfloat16, and its error names no argument)
            raise PlanError(f"{name} must hold integers, got dtype {value.dtype}; pass an int32/int64 tensor.")
        if value.device.type == "meta":
            raise PlanError(f"{name} is a meta tensor (no data); pass a tensor that holds the values.")
        if str(value.layout) != "torch.strided":  # (sparse: no numpy view)
            raise PlanError(f"{name} is a {value.layout} tensor; pass a dense one (.to_dense()).")
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:  # (a ragged nesting, an object numpy cannot read)
        raise PlanError(f"{name} is not a flat int array ({exc}); pass a 1-D int array.") from None
    if arr.ndim != 1:
        raise PlanError(f"{name} must be 1-D, got shape {tuple(arr.shape)}; pass a flat int array.")
    if arr.size and arr.dtype.kind not in "iu":  # signed or unsigned integers
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}; pass an int32/int64 array.")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        # (int64, which the planner computes in, would wrap it into a negative value the messages then name)
        j = int(np.argmax(arr))
        raise PlanError(f"{name}[{j}]={int(arr[j])} exceeds the int32 range the kernels index with ({_INT32_MAX}).")
    return arr


def _as_int_array(name: str, value: ArrayLike) -> np.ndarray:
    return _checked_int_array(name, value).astype(np.int64, copy=False)


def _as_int(name: str, value, error=PlanError) -> int:
    """An integer scalar argument (ints and integer numpy/torch scalars; a float is refused, not
    truncated); ``error`` is the exception class raised otherwise."""
    if isinstance(value, (bool, np.bool_)):  # operator.index accepts them as 0 and 1
        raise error(f"{name}={value!r} must be an integer, not a bool.")
    try:
        return operator.index(value)
    except (TypeError, RuntimeError):  # (RuntimeError: a tensor with no value, on the meta device)
        raise error(f"{name}={value!r} must be an integer.") from None


def first_copies(used: np.ndarray, kv_page_indptr: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``[R]``: for each request, the first request with the same prompt length and prompt pages (itself if
    none before it). TensorRT-LLM pads a CUDA-graph batch by repeating one dummy request, whose copies share
    every page and write the same slots: one request, listed several times."""
    seen: dict = {}
    first = np.arange(lens.shape[0])
    for r in range(lens.shape[0]):
        key = (int(lens[r]), used[kv_page_indptr[r]:kv_page_indptr[r + 1]].tobytes())
        first[r] = seen.setdefault(key, r)
    return first


def _prompt_page_conflict(used: np.ndarray, kv_page_indptr: np.ndarray, last_page_len: np.ndarray,
                          page_size: int, partly_filled_shared: bool = True) -> Optional[Tuple[int, int, int]]:
    """The first prompt page no KV cache produces, as ``(request, page, other request)`` (``other ==
    request`` for a page twice in one prompt), or ``None``. Full prompt pages may be shared between
    requests (block reuse); a request's partly filled last page, which its beam 0 goes on filling with
    generated tokens, may not (``partly_filled_shared``: whether to look for that)."""
    # One sort serves both: keyed by (page, request), equal pages end up adjacent, in request order
    # (a plain sort of int64 keys is several times faster than a stable argsort).
    num_requests = kv_page_indptr.shape[0] - 1
    request_of = np.repeat(np.arange(num_requests, dtype=np.int64), np.diff(kv_page_indptr))
    keys = np.sort(used * num_requests + request_of)
    twice = keys[1:] == keys[:-1]
    if twice.any():
        key = int(keys[int(np.argmax(twice))])
        return key % num_requests, key // num_requests, key % num_requests
    if not partly_filled_shared:
        return None
    partial = np.flatnonzero(last_page_len < page_size)
    if partial.size:
        first_key = used[kv_page_indptr[partial + 1] - 1] * num_requests
        listed = np.searchsorted(keys, first_key + num_requests) - np.searchsorted(keys, first_key)
        shared = listed > 1
        if shared.any():
            r = int(partial[np.argmax(shared)])
            page = int(used[kv_page_indptr[r + 1] - 1])
            others = keys[(keys // num_requests == page) & (keys % num_requests != r)]
            return r, page, int(others[0] % num_requests)
    return None


def _check_copies_share_an_id(first: np.ndarray, request_ids: tuple, used: np.ndarray, kv_page_indptr: np.ndarray,
                              lens: np.ndarray, last_page_len: np.ndarray, page_size: int) -> None:
    """Requests taken as copies of an earlier one (``first``) whose shared last prompt page is partly filled must
    be listed under its id: two requests given one such page would both write generated tokens into it."""
    for r in np.flatnonzero((first != np.arange(first.shape[0])) & (last_page_len < page_size)):
        f = int(first[r])
        if request_ids[f] != request_ids[r]:
            raise PlanError(
                f"requests {f} (id {request_ids[f]!r}) and {r} (id {request_ids[r]!r}) list the same "
                f"{int(kv_page_indptr[r + 1] - kv_page_indptr[r])} prompt pages for {int(lens[r])}-token prompts, and "
                f"the last, page {int(used[kv_page_indptr[r + 1] - 1])}, holds {int(last_page_len[r])} of {page_size} "
                f"tokens: both requests' beam 0 would write generated tokens into it, over each other's. Only copies "
                f"of one request (one id: a padded batch) share a partly filled page; re-derive the page table from "
                f"the KV cache manager."
            )


def _log_copies_without_ids(first: np.ndarray, used: np.ndarray, kv_page_indptr: np.ndarray,
                            last_page_len: np.ndarray, page_size: int) -> None:
    """Log, once a process, requests taken as copies of one request over a partly filled page with no
    ``request_ids`` to tell them apart: two distinct requests given one such page by a faulty page table would both
    write generated tokens into it, and only the ids can tell that from a padded batch's repeated dummy."""
    global _warned_copies_without_ids
    if _warned_copies_without_ids:
        return
    copies = np.flatnonzero((first != np.arange(first.shape[0])) & (last_page_len < page_size))
    if copies.size == 0:
        return
    _warned_copies_without_ids = True
    r = int(copies[0])
    logger.warning(
        "beam_shared_prefix: requests %d and %d list the same prompt pages, the last (page %d) partly filled, and are "
        "taken as copies of one request (a padded batch's repeated dummy) because plan() got no request_ids. If they "
        "are two requests, both would write generated tokens into that page; pass request_ids so that two ids are "
        "refused. (Logged once a process.)", int(first[r]), r, int(used[kv_page_indptr[r + 1] - 1]))


def _check_prompt_pages(used: np.ndarray, kv_page_indptr: np.ndarray, lens: np.ndarray, last_page_len: np.ndarray,
                        page_size: int, request_ids: Optional[tuple], beam_width: int) -> None:
    # One beam: a request's partly filled prompt page may be another's full prompt page. Block reuse stores a
    # one-beam request's generated pages once filled, and the planner cannot see the lengths that tell whether
    # it still writes there (check mode can).
    conflict = _prompt_page_conflict(used, kv_page_indptr, last_page_len, page_size, beam_width > 1)
    if conflict is not None:
        # Only on a conflict (rare): look again with each repeated request once (the copies of a padded
        # CUDA-graph batch's dummy request share all their pages).
        first = first_copies(used, kv_page_indptr, lens)
        if request_ids is not None:
            _check_copies_share_an_id(first, request_ids, used, kv_page_indptr, lens, last_page_len, page_size)
        else:
            _log_copies_without_ids(first, used, kv_page_indptr, last_page_len, page_size)
        kept = np.flatnonzero(first == np.arange(lens.shape[0]))
        if kept.size < lens.shape[0]:
            pages_of = np.diff(kv_page_indptr)[kept]
            sub_indptr = np.concatenate([[0], np.cumsum(pages_of)])
            sub_used = np.concatenate([used[kv_page_indptr[r]:kv_page_indptr[r + 1]] for r in kept])
            conflict = _prompt_page_conflict(sub_used, sub_indptr, last_page_len[kept], page_size, beam_width > 1)
            if conflict is not None:
                conflict = (int(kept[conflict[0]]), conflict[1], int(kept[conflict[2]]))
    if conflict is None:
        return
    r, page, other = conflict
    if other == r:
        where = np.flatnonzero(used[kv_page_indptr[r]:kv_page_indptr[r + 1]] == page)
        raise PlanError(
            f"request {r}: page {page} is listed twice in its prompt pages (positions {int(where[0])} and "
            f"{int(where[1])}): one page cannot hold two stretches of one prompt. Re-derive the page table from "
            f"the KV cache manager."
        )
    raise PlanError(
        f"request {r}: its last prompt page {page} holds {int(last_page_len[r])} of {page_size} tokens, and its "
        f"beam 0 writes generated tokens into the rest, but request {other} lists page {page} among its prompt "
        f"pages too: those writes would overwrite request {other}'s prompt. A partly filled page belongs to one "
        f"request (or to copies of one, with the same prompt and pages); re-derive the page table from the KV "
        f"cache manager."
    )


def build_step_plan(
    prompt_page_indptr: ArrayLike,
    prompt_page_indices: ArrayLike,
    prompt_lens: ArrayLike,
    beam_width: int,
    page_size: int,
    num_cache_pages: int,
    max_beam_width: Optional[int] = None,
    key: Hashable = None,
    request_ids: Optional[Sequence[Hashable]] = None,
) -> StepPlan:
    """Validate the prompt page tables of a batch and build its :class:`StepPlan` (no caching).

    Args:
        prompt_page_indptr: ``[R + 1]`` ints, offsets of each request's pages in
            ``prompt_page_indices``. A request may list more pages than its prompt needs (for
            example beam 0's whole block list, generated pages included): only the first
            ``ceil(P_r / page_size)`` are used.
        prompt_page_indices: flat ints, beam 0's page numbers, request-major.
        prompt_lens: ``[R]`` ints, prompt length of each request in tokens (``>= 1``).
        beam_width: ``W``, beams per request in this step.
        page_size: tokens per page.
        num_cache_pages: pages in the KV pool (the exclusive upper bound of a page index).
        max_beam_width: the beam width the KV cache and ``cache_indirection`` were sized for;
            ``beam_width`` above it is refused. ``None`` skips this check.
        key: stored on the plan (see :class:`StepPlanner`).
        request_ids: ``R`` hashable ids, where the caller knows them: requests with one prompt length and one
            page list are copies of one request (a padded CUDA-graph batch repeats its dummy) only under one
            id. ``None``: they are taken as copies whatever they are (the planner cannot tell; where they share a
            partly filled page, the first such plan of the process logs a warning).

    Raises:
        PlanError: for an empty batch, a beam width above ``max_beam_width``, negative or
            inconsistent lengths, a prompt longer than its pages hold, a page index outside
            ``[0, num_cache_pages)``, a page listed twice in one request's prompt, or (two beams or more) a
            request's partly filled last prompt page among another request's prompt pages (but a copy of the
            request's: same prompt length and pages, and the same id where ``request_ids`` is given).
    """
    beam_width = _as_int("beam_width", beam_width)
    page_size = _as_int("page_size", page_size)
    num_cache_pages = _as_int("num_cache_pages", num_cache_pages)
    if beam_width < 1:
        raise PlanError(f"beam_width={beam_width} must be >= 1.")
    if max_beam_width is not None:
        max_beam_width = _as_int("max_beam_width", max_beam_width)
    if max_beam_width is not None and beam_width > max_beam_width:
        raise PlanError(
            f"beam_width={beam_width} exceeds max_beam_width={max_beam_width}, the width the KV "
            f"cache and cache_indirection were sized for: beams past it would overwrite another "
            f"sequence's slots. Build the engine with max_beam_width >= {beam_width} or lower the beam width."
        )
    if beam_width > _INT32_MAX:
        raise PlanError(f"beam_width={beam_width} exceeds the int32 range the kernels index with ({_INT32_MAX}).")
    if page_size < 1:
        raise PlanError(f"page_size={page_size} must be >= 1 (tokens per KV page).")
    if num_cache_pages < 1:
        raise PlanError(f"num_cache_pages={num_cache_pages} must be >= 1: the KV pool holds no page.")
    for name, value in (("page_size", page_size), ("num_cache_pages", num_cache_pages)):
        if value > _INT32_MAX:
            raise PlanError(f"{name}={value} exceeds the int32 range the kernels index with ({_INT32_MAX}).")

    indptr = _as_int_array("prompt_page_indptr", prompt_page_indptr)
    indices = _as_int_array("prompt_page_indices", prompt_page_indices)
    lens = _as_int_array("prompt_lens", prompt_lens)
    num_requests = lens.shape[0]
    if num_requests and int(lens.max()) > _INT32_MAX:
        r = int(np.argmax(lens))
        raise PlanError(f"prompt_lens[{r}]={int(lens[r])} exceeds the int32 range the kernels index with "
                        f"({_INT32_MAX}).")
    if num_requests == 0:
        raise PlanError("empty batch: prompt_lens has 0 requests; plan only batches with >= 1 generation request.")
    if num_requests * beam_width > _INT32_MAX:
        raise PlanError(
            f"{num_requests} requests x beam_width={beam_width} = {num_requests * beam_width} beam rows exceed the "
            f"int32 range the kernels index rows with ({_INT32_MAX}); plan fewer requests or beams per step."
        )
    if indptr.shape[0] != num_requests + 1:
        raise PlanError(
            f"prompt_page_indptr has {indptr.shape[0]} entries but prompt_lens has {num_requests} requests; "
            f"it must have len(prompt_lens) + 1 = {num_requests + 1}."
        )
    if indptr[0] != 0:
        raise PlanError(f"prompt_page_indptr[0]={int(indptr[0])} must be 0.")
    pages_listed = np.diff(indptr)
    if (pages_listed < 0).any():
        r = int(np.argmax(pages_listed < 0))
        raise PlanError(
            f"prompt_page_indptr decreases at request {r} ({int(indptr[r])} -> {int(indptr[r + 1])}); "
            f"it must be non-decreasing offsets."
        )
    if indptr[-1] != indices.shape[0]:
        raise PlanError(
            f"prompt_page_indptr[-1]={int(indptr[-1])} but prompt_page_indices has {indices.shape[0]} "
            f"entries; they must be equal."
        )
    if (lens < 1).any():
        r = int(np.argmax(lens < 1))
        raise PlanError(
            f"prompt_lens[{r}]={int(lens[r])} must be >= 1: every generation request has a prompt of at "
            f"least one token."
        )

    pages_needed = cdiv(lens, page_size)
    short = pages_needed > pages_listed
    if short.any():
        r = int(np.argmax(short))
        raise PlanError(
            f"request {r}: prompt_lens[{r}]={int(lens[r])} tokens need {int(pages_needed[r])} pages of "
            f"{page_size} but only {int(pages_listed[r])} are listed (they hold at most "
            f"{int(pages_listed[r]) * page_size} tokens); pass the request's full beam-0 page list or fix "
            f"the prompt length."
        )

    kv_page_indptr = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(pages_needed, out=kv_page_indptr[1:])
    total = int(kv_page_indptr[-1])
    # Flat gather of the first pages_needed[r] entries of each request's list, without a Python loop.
    within = np.arange(total, dtype=np.int64) - np.repeat(kv_page_indptr[:-1], pages_needed)
    used = indices[np.repeat(indptr[:-1], pages_needed) + within]

    bad = (used < 0) | (used >= num_cache_pages)
    if bad.any():
        j = int(np.argmax(bad))
        r = int(np.searchsorted(kv_page_indptr, j, side="right") - 1)
        raise PlanError(
            f"request {r}: prompt page {int(within[j])} has page index {int(used[j])}, outside the pool "
            f"[0, {num_cache_pages}); a stale page table or an under-sized cache would read another "
            f"sequence's KV. Re-derive the page table from the current KV cache manager."
        )

    last = lens - (pages_needed - 1) * page_size
    if request_ids is not None:
        request_ids = tuple(request_ids)
        if len(request_ids) != num_requests:
            raise PlanError(f"request_ids holds {len(request_ids)} ids for {num_requests} requests; pass one id per "
                            f"request, in batch order, or None.")
    _check_prompt_pages(used, kv_page_indptr, lens, last, page_size, request_ids, beam_width)
    max_pages = int(pages_needed.max())
    # Dense table: padding repeats each request's first page so every entry is a valid index.
    page_table = np.repeat(used[kv_page_indptr[:-1]][:, None], max_pages, axis=1)
    col = np.arange(max_pages)[None, :]
    fill = col < pages_needed[:, None]
    page_table[fill] = used

    i32 = np.int32

    def ro(a):
        a = np.ascontiguousarray(a, dtype=i32)
        a.setflags(write=False)
        return a

    return StepPlan(
        num_requests=int(num_requests),
        beam_width=beam_width,
        page_size=page_size,
        num_cache_pages=num_cache_pages,
        qo_indptr=ro(np.arange(num_requests + 1, dtype=np.int64) * beam_width),
        kv_page_indptr=ro(kv_page_indptr),
        kv_page_indices=ro(used),
        kv_last_page_len=ro(last),
        prompt_lens=ro(lens),
        prompt_lens_per_row=ro(np.repeat(lens, beam_width)),
        kv_pages_per_request=ro(pages_needed),
        page_table=ro(page_table),
        max_prompt_len=int(lens.max()),
        max_prompt_pages=max_pages,
        key=key,
    )


class StepPlanner:
    """Builds :class:`StepPlan` objects and caches them by batch composition (LRU).

    Args:
        page_size: tokens per KV page.
        num_cache_pages: pages in the KV pool.
        max_beam_width: the beam width the cache was sized for (``None``: unchecked).
        capacity: plans kept; a serving loop alternates between few compositions.
    """

    def __init__(self, page_size: int, num_cache_pages: int, max_beam_width: Optional[int] = None, capacity: int = 8):
        self.page_size = _as_int("page_size", page_size)
        self.num_cache_pages = _as_int("num_cache_pages", num_cache_pages)
        self.max_beam_width = None if max_beam_width is None else _as_int("max_beam_width", max_beam_width)
        self.capacity = _as_int("capacity", capacity)
        if self.capacity < 1:
            raise PlanError(f"capacity={self.capacity} must be >= 1 (plans kept by the planner).")
        self._plans: "OrderedDict[Hashable, StepPlan]" = OrderedDict()
        self.num_builds = 0  # plans built (cache misses), for tests and benchmarks
        # The inputs of the last plan found or built without a caller key: a serving loop repeats
        # one composition step after step, and comparing with it (a memcmp) is far cheaper than
        # hashing (blake2b of 48 KB of page indices costs ~50 us at 128 x 3,000-token prompts).
        self._last_unkeyed: Optional[Tuple[int, Tuple[np.ndarray, ...], Hashable, Optional[tuple]]] = None

    @staticmethod
    def input_key(prompt_page_indptr, prompt_page_indices, prompt_lens, beam_width) -> bytes:
        """A digest of the planner's inputs, used when the caller gives no composition key."""
        h = hashlib.blake2b(digest_size=16)
        names = ("prompt_page_indptr", "prompt_page_indices", "prompt_lens")
        for name, a in zip(names, (prompt_page_indptr, prompt_page_indices, prompt_lens), strict=True):
            # Same dtype/ndim checks as the build: a 2-D or float input must not hit the plan of
            # the int arrays it flattens or truncates to. Values are hashed as int32 whenever they
            # fit (hashing is most of a hit's cost; int32 halves the bytes and is the usual input
            # dtype), so equal values in any int dtype share a key.
            a = _checked_int_array(name, a)
            if a.dtype != np.int32 and (a.size == 0 or (a.min() >= _INT32_MIN and a.max() <= _INT32_MAX)):
                a = a.astype(np.int32)
            a = np.ascontiguousarray(a)
            h.update(a.dtype.str.encode())
            h.update(np.int64(a.size).tobytes())
            h.update(a.data)
        h.update(np.int64(beam_width).tobytes())
        return h.digest()

    def lookup(self, key: Hashable) -> Optional[StepPlan]:
        """The cached plan for ``key``, or ``None``; no work beyond a dict lookup."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def plan(
        self,
        prompt_page_indptr: ArrayLike,
        prompt_page_indices: ArrayLike,
        prompt_lens: ArrayLike,
        beam_width: int,
        key: Hashable = None,
        request_ids: Optional[Sequence[Hashable]] = None,
    ) -> StepPlan:
        """Return the plan of this batch, building and caching it on a miss.

        ``key`` identifies the batch composition (for example ``(tuple(request_ids), beam_width)``).
        The caller promises that equal keys mean equal inputs, ``request_ids`` included: with a key, a hit
        does no array work at all. Without a key, the inputs are compared with those of the last unkeyed plan
        (a memcmp: the steady state of a serving loop), and otherwise a digest of them (and the ids) is the
        key. ``request_ids``: see :func:`build_step_plan`.
        """
        beam_width = _as_int("beam_width", beam_width)
        if beam_width > _INT32_MAX:  # (before the digest packs it into an int64)
            raise PlanError(f"beam_width={beam_width} exceeds the int32 range the kernels index with ({_INT32_MAX}).")
        unkeyed = key is None
        ids = request_ids  # (a caller's key covers them: a hit reads nothing)
        if unkeyed:
            ids = None if request_ids is None else tuple(request_ids)
            arrays = (
                _checked_int_array("prompt_page_indptr", prompt_page_indptr),
                _checked_int_array("prompt_page_indices", prompt_page_indices),
                _checked_int_array("prompt_lens", prompt_lens),
            )
            last = self._last_unkeyed
            # Dtype, shape, then the bytes (a memcmp; array_equal's generic path costs 3x more).
            if last is not None and last[0] == int(beam_width) and last[3] == ids and all(
                a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
                for a, b in zip(arrays, last[1], strict=True)
            ):
                plan = self.lookup(last[2])
                if plan is not None:
                    return plan
            key = ("inputs", self.input_key(*arrays, beam_width)) + (() if ids is None else (ids,))
        try:
            plan = self.lookup(key)
        except TypeError:
            raise PlanError(f"key={key!r} is not hashable; pass a hashable composition key (e.g. a tuple of "
                            f"request ids and the beam width) or None.") from None
        if plan is not None:
            if plan.beam_width != beam_width:  # (an unkeyed digest covers the width; a caller's key may not)
                raise PlanError(
                    f"key={key!r} was planned for beam_width={plan.beam_width}, now asked for {beam_width}: equal "
                    f"keys must mean equal inputs. Put the beam width into the key."
                )
            if unkeyed:
                self._last_unkeyed = (int(beam_width), tuple(a.copy() for a in arrays), key, ids)
            return plan
        plan = build_step_plan(
            prompt_page_indptr,
            prompt_page_indices,
            prompt_lens,
            beam_width,
            self.page_size,
            self.num_cache_pages,
            max_beam_width=self.max_beam_width,
            key=key,
            request_ids=ids,
        )
        self.num_builds += 1
        self._plans[key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        if unkeyed:
            # Copies: the caller may reuse its arrays for the next batch.
            self._last_unkeyed = (int(beam_width), tuple(a.copy() for a in arrays), key, ids)
        return plan

    def clear(self) -> None:
        """Forget every cached plan (call when the KV pool is replaced)."""
        self._plans.clear()
        self._last_unkeyed = None
