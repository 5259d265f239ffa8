"""The page-table audit: the checks of the beams' page table that judge rows together, run with the device error
flag only, two launches a step (:func:`triton_kernels.page_table_audit.audit_page_table`).

The attention kernels judge each index they follow (a page outside the pool, a source beam outside ``[0, W)``...)
and mask it. What no single index shows is judged here, once a step rather than once a layer: the page table,
lengths and prompt lengths are one in every layer of a pool (``docs/rounds.md``, "The seventy-second round", moved
the beam-agreement, held-page and plan checks out of the attention kernels, which ran them in every layer):

- **A write page another request holds** (``OTHER_REQUEST_PAGE``), at any column within that row's length: a manager
  that hands out one block twice, a stale table. :func:`page_holders_kernel` records, for every page the step's rows
  hold, the lowest and the highest row that holds it, as ``stamp << 32 | row`` with ``atomic_max`` into
  ``page_holders[2, num_pages]`` (the lowest row as ``0x7FFFFFFF - row``), where ``stamp`` counts the audits
  (``audit_state``): entries of earlier steps have a lower stamp, so a page's entries are this step's once any row
  records it, and nothing is ever cleared. Requests hold contiguous rows, so a row's write page is held by another
  request exactly when the lowest or the highest holder lies outside the row's request.
- **A write page held elsewhere in its own request** (``HELD_WRITE_PAGE``): by another row (the same two holders,
  inside the request but not the row), or by the row itself at an earlier column (one row's columns compared, from
  its first recorded column: 0 for beam 0, whose prompt pages every beam reads, the prompt's last column for the
  others).
- **Beams that disagree with beam 0** (``BEAM_KV_LEN``, ``SHARED_WRITE_PAGE``):
  :func:`triton_kernels.device_errors.beam_agreement_bits`. A beam on beam 0's page of its column raises both
  ``SHARED_WRITE_PAGE`` and ``HELD_WRITE_PAGE`` (the latter for both rows): the first names the usual cause, a
  table that shares the prompt's partly filled page among the beams.
- **A table unlike the plan** (``PLAN_PAGE``): beam 0's pages over the prompt's columns, folded into a digest
  (:func:`prompt_page_digest_term`, XOR over the columns) and compared with the plan's, which the host computes at
  ``plan()`` (:func:`triton_kernels.device_errors.prompt_pages_digest_torch`'s rule): one wrong page always changes
  the digest, since each column's term is a bijection of its page.

The write-page rules judge a row from its second generated token: TensorRT-LLM's warm-up requests are all context
(``kv_len = prompt_len + 1``) and share their last block among the beams, so padding rows (``kv_len`` 1) are never
judged; their pages are recorded like any other. :func:`page_table_audit_kernel` judges, one program per request and
block of beams, and advances the stamp for the next step.
"""

import triton
import triton.language as tl

from .device_errors import (
    HELD_WRITE_PAGE,
    OTHER_REQUEST_PAGE,
    PLAN_PAGE,
    beam_agreement_bits,
    or_reduce,
)

__all__ = ["page_holders_kernel", "page_table_audit_kernel", "prompt_page_digest_term", "HOLDER_ROW_MASK"]

#: The row field of a ``page_holders`` entry (its low 32 bits; the stamp is above).
HOLDER_ROW_MASK = tl.constexpr(0x7FFFFFFF)


@triton.jit
def prompt_page_digest_term(col, page):
    """The digest term of ``page`` at page-table column ``col`` (int vectors, one shape): int64. A bijection of
    ``page`` for each column (an odd multiplier, then xor-shifts and odd multipliers, all invertible mod 2^64), so
    a digest (the XOR of a prompt's terms) changes whenever exactly one page does. The host's twin is
    :func:`triton_kernels.device_errors.prompt_pages_digest_torch` (and ``StepPlan.prompt_pages_digest``, numpy)."""
    x = page.to(tl.int64) * 0x5BD1E995 + col.to(tl.int64) * 0x1B873593 + 0x68E31DA4
    x ^= x >> 29
    x *= 0x7FEB352D
    x ^= x >> 32
    x *= 0x2C1B3C6D
    x ^= x >> 31
    return x


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def page_holders_kernel(
    kv_lens_ptr,
    prompt_lens_ptr,
    page_table_ptr,
    holders_ptr,
    state_ptr,
    beam_width,
    stride_pt_row,
    stride_pt_col,
    table_cols,
    page_size,
    page_index_divisor,
    num_pages,
    max_seq_len,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (request, block of ``BLOCK_W`` beams): the pages each beam holds (columns below
    ``cdiv(kv_len, page_size)``; beams other than beam 0 from their prompt's last column, since the full prompt pages
    are beam 0's too) into ``page_holders``, ``[BLOCK_W, BLOCK_C]`` entries at a time."""
    beam = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = beam < beam_width
    row64 = tl.program_id(0).to(tl.int64) * beam_width + beam.to(tl.int64)
    stamp = tl.load(state_ptr).to(tl.int64)
    kv_len = tl.minimum(tl.load(kv_lens_ptr + row64, mask=row_ok, other=0), max_seq_len)
    n_cols = tl.where(row_ok, tl.minimum((tl.maximum(kv_len, 0) + page_size - 1) // page_size, table_cols), 0)
    plen = tl.load(prompt_lens_ptr + row64, mask=row_ok, other=0)
    first_col = tl.where(beam == 0, 0, tl.maximum(plen, 0) // page_size)
    high = ((stamp << 32) | row64)[:, None]
    low = ((stamp << 32) | (HOLDER_ROW_MASK - row64))[:, None]
    lanes = tl.arange(0, BLOCK_C)
    # From the block's first held column: beam 0's block walks its prompt pages, the others their generated ones.
    for c0 in range(tl.min(tl.where(n_cols > first_col, first_col, table_cols)), tl.max(n_cols), BLOCK_C):
        col = c0 + lanes
        col_ok = (col[None, :] < n_cols[:, None]) & (col[None, :] >= first_col[:, None])
        entry = tl.load(page_table_ptr + row64[:, None] * stride_pt_row + col.to(tl.int64)[None, :] * stride_pt_col,
                        mask=col_ok, other=-1)
        page = (entry // page_index_divisor).to(tl.int64)
        # (entry < 0 apart: Triton's division truncates, so -1 // 2 would be page 0)
        held = col_ok & (entry >= 0) & (page < num_pages)
        tl.atomic_max(holders_ptr + page, high + page * 0, mask=held, sem="relaxed")
        tl.atomic_max(holders_ptr + num_pages + page, low + page * 0, mask=held, sem="relaxed")


@triton.jit
def page_table_audit_kernel(
    kv_lens_ptr,
    prompt_lens_ptr,
    page_table_ptr,
    holders_ptr,
    state_ptr,
    err_ptr,
    plan_digest_ptr,
    beam_width,
    stride_pt_row,
    stride_pt_col,
    table_cols,
    page_size,
    page_index_divisor,
    num_pages,
    max_seq_len,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHECK_PLAN: tl.constexpr,
):
    """One program per (request, block of ``BLOCK_W`` beams), after :func:`page_holders_kernel` of the step: the
    block's ``OTHER_REQUEST_PAGE``, ``HELD_WRITE_PAGE``, ``BEAM_KV_LEN`` and ``SHARED_WRITE_PAGE``, and with
    ``CHECK_PLAN`` the request's ``PLAN_PAGE`` (program ``(r, 0)``, against ``plan_digest_ptr[r]``, int64), into
    ``err_ptr[0]``; program ``(0, 0)`` advances the stamp ``state_ptr[0]``."""
    req = tl.program_id(0)
    first_row64 = req.to(tl.int64) * beam_width
    beam = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row64 = first_row64 + beam.to(tl.int64)
    row_ok = beam < beam_width
    cur = tl.load(kv_lens_ptr + row64, mask=row_ok, other=0) - 1
    plen = tl.load(prompt_lens_ptr + row64, mask=row_ok, other=0)
    col = cur // page_size
    col_ok = row_ok & (cur >= 0) & (cur < max_seq_len) & (col < table_cols)
    entry = tl.load(page_table_ptr + row64 * stride_pt_row + col.to(tl.int64) * stride_pt_col, mask=col_ok, other=-1)
    page = (entry // page_index_divisor).to(tl.int64)
    col_ok = col_ok & (entry >= 0) & (page < num_pages)
    prompt_len = tl.load(prompt_lens_ptr + first_row64)

    # Each beam against beam 0: its length, and a write slot on beam 0's page of the same column.
    agree = beam_agreement_bits(kv_lens_ptr, page_table_ptr, row64, row_ok, first_row64, prompt_len, stride_pt_row,
                                stride_pt_col, page_size, page_index_divisor, num_pages, max_seq_len)
    bits = or_reduce(agree)

    # The write page's holders, from the row's second generated token. The row recorded its write page itself at
    # this stamp, above every earlier one: both entries are this step's.
    judged = col_ok & (cur > plen)
    high_row = tl.load(holders_ptr + page, mask=judged, other=0) & HOLDER_ROW_MASK
    low_row = HOLDER_ROW_MASK - (tl.load(holders_ptr + num_pages + page, mask=judged, other=0) & HOLDER_ROW_MASK)
    request_end = first_row64 + beam_width
    other = judged & ((high_row >= request_end) | (low_row < first_row64))
    bits |= tl.max(tl.where(other, OTHER_REQUEST_PAGE, 0))
    held = judged & (((high_row != row64) & (high_row < request_end)) | ((low_row != row64) & (low_row >= first_row64)))

    # ... and the row's own earlier columns, from its first recorded one (holders name rows, not columns).
    first_col = tl.where(beam == 0, 0, tl.maximum(plen, 0) // page_size)
    lanes = tl.arange(0, BLOCK_C)
    mine = tl.zeros([BLOCK_W], tl.int32)
    for c0 in range(tl.min(tl.where(judged, first_col, table_cols)), tl.max(tl.where(judged, col, 0)), BLOCK_C):
        h_col = c0 + lanes
        h_ok = judged[:, None] & (h_col[None, :] >= first_col[:, None]) & (h_col[None, :] < col[:, None])
        h_entry = tl.load(page_table_ptr + row64[:, None] * stride_pt_row + h_col.to(tl.int64)[None, :] * stride_pt_col,
                          mask=h_ok, other=-1)
        # (h_entry < 0 apart: -1 // 2 would be page 0)
        same = h_ok & (h_entry >= 0) & ((h_entry // page_index_divisor).to(tl.int64) == page[:, None])
        mine |= tl.max(tl.where(same, 1, 0), axis=1)
    bits |= tl.max(tl.where(held | (mine != 0), HELD_WRITE_PAGE, 0))

    if CHECK_PLAN:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # Beam 0's pages over the prompt's columns against the plan's (the pages the prefix read), once a request. A
        # prompt past the table or the cache is PROMPT_LEN's and KV_LEN's; an empty one has no page.
        if tl.program_id(1) == 0:
            judged_plan = (prompt_len >= 1) & (prompt_len <= max_seq_len) & (prompt_len <= table_cols * page_size)
            n_prompt_cols = tl.where(judged_plan, (prompt_len + page_size - 1) // page_size, 0)
            digest = tl.zeros([BLOCK_C], tl.int64)
            for c0 in range(0, n_prompt_cols, BLOCK_C):
                p_col = c0 + lanes
                p_ok = p_col < n_prompt_cols
                p_entry = tl.load(page_table_ptr + first_row64 * stride_pt_row + p_col.to(tl.int64) * stride_pt_col,
                                  mask=p_ok, other=-1)
                p_page = tl.where(p_entry >= 0, p_entry // page_index_divisor, -1)
                digest ^= tl.where(p_ok, prompt_page_digest_term(p_col, p_page), 0)
            bad_plan = judged_plan & (tl.reduce(digest, 0, _xor) != tl.load(plan_digest_ptr + req))
            bits |= tl.where(bad_plan, PLAN_PAGE, 0)

    if bits != 0:
        tl.atomic_or(err_ptr, bits, sem="relaxed")
    # The next step's records go above this one's. (Nothing in this launch reads the stamp; the holders launch that
    # wrote it has finished.)
    if (req == 0) & (tl.program_id(1) == 0):
        tl.atomic_add(state_ptr, 1, sem="relaxed")
