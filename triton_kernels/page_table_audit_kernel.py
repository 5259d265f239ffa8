"""The page-table audit: checks of the beams' page table that the step's attention kernels leave out, run with the
device error flag only, two launches a step (:func:`triton_kernels.page_table_audit.audit_page_table`).

The tail kernels judge each row's write page against its request's other beams' write pages and beam 0's prompt pages
(:func:`triton_kernels.device_errors.held_write_page_bits`). Two more ways for this step's K/V to overwrite K/V that
rows read need the whole table, which a one-row program cannot afford (a loop there cost registers in every
configuration of the tail kernels it was placed in: the sm_90 compile test, ``docs/rounds.md``, "The seventieth
round"):

- **A page another request holds** (``OTHER_REQUEST_PAGE``), at any column within that row's length: a manager that
  hands out one block twice, a stale table. :func:`page_holders_kernel` records, for every page the step's rows
  hold, the lowest and the highest row that holds it, as ``stamp << 32 | row`` with ``atomic_max`` into
  ``page_holders[2, num_pages]`` (the lowest row as ``0x7FFFFFFF - row``), where ``stamp`` counts the audits
  (``audit_state``): entries of earlier steps have a lower stamp, so a page's entries are this step's once any row
  records it, and nothing is ever cleared. Requests hold contiguous rows, so a row's write page is held by another
  request exactly when the lowest or the highest holder lies outside the row's request. Judged at every step from a
  row's second generated token (TensorRT-LLM's warm-up requests share their last block at the first), so padding
  rows (``kv_len`` 1) are never judged; their pages are recorded like any other.
- **A page a beam of its own request holds at an earlier generated column** (``HELD_WRITE_PAGE``), judged at the
  page's first token (beam 0's ``cur = kv_len - 1`` a multiple of the page size): the step at which the manager hands
  the page out, so one step in ``page_size`` compares ``W x W x columns`` entries in ``[BLOCK_W, BLOCK_H]`` blocks,
  from the prompt's last column (``prompt_len // page_size``: each beam's copy of the partly filled page) up to the
  write column.

:func:`page_table_audit_kernel` judges both, one program per request and block of beams, and advances the stamp for the
next step.
"""

import triton
import triton.language as tl

from .device_errors import HELD_WRITE_PAGE, OTHER_REQUEST_PAGE

__all__ = ["page_holders_kernel", "page_table_audit_kernel", "HOLDER_ROW_MASK"]

#: The row field of a ``page_holders`` entry (its low 32 bits; the stamp is above).
HOLDER_ROW_MASK = tl.constexpr(0x7FFFFFFF)


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
    beam_width,
    stride_pt_row,
    stride_pt_col,
    table_cols,
    page_size,
    page_index_divisor,
    num_pages,
    max_seq_len,
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per (request, block of ``BLOCK_W`` beams), after :func:`page_holders_kernel` of the step: the
    block's write pages, ``OTHER_REQUEST_PAGE`` and ``HELD_WRITE_PAGE`` into ``err_ptr[0]``; program ``(0, 0)``
    advances the stamp ``state_ptr[0]``."""
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

    # A write page another request holds: every row from its second generated token. The row recorded its write page
    # itself at this stamp, above every earlier one: both entries are this step's.
    judged = col_ok & (cur > plen)
    high_row = tl.load(holders_ptr + page, mask=judged, other=0) & HOLDER_ROW_MASK
    low_row = HOLDER_ROW_MASK - (tl.load(holders_ptr + num_pages + page, mask=judged, other=0) & HOLDER_ROW_MASK)
    other = judged & ((high_row >= first_row64 + beam_width) | (low_row < first_row64))
    bits = tl.max(tl.where(other, OTHER_REQUEST_PAGE, 0))

    # A write page its request holds at an earlier generated column, at the page's first token.
    prompt_len = tl.load(prompt_lens_ptr + first_row64)
    first_cur = tl.load(kv_lens_ptr + first_row64) - 1
    write_col = first_cur // page_size
    # (first_cur >= 0 apart: with a negative prompt length a padding row's cur 0 is past it)
    judged_step = ((first_cur > prompt_len) & (first_cur >= 0) & (first_cur < max_seq_len)
                   & (first_cur % page_size == 0) & (write_col < table_cols))
    if judged_step:
        # A beam at another length is BEAM_KV_LEN's (the kernels report it); its column is not this step's. -1
        # matches no held page (those are >= 0), so the comparisons need no row mask of their own.
        page = tl.where(col_ok & (cur == first_cur), page, -1)
        first_col = tl.maximum(prompt_len, 0) // page_size
        n_cols = write_col - first_col
        n_held = beam_width * n_cols
        h_lanes = tl.arange(0, BLOCK_H)
        held = n_held * 0
        for h0 in range(0, n_held, BLOCK_H):
            h = h0 + h_lanes
            h_ok = h < n_held
            h_row64 = first_row64 + (h // n_cols).to(tl.int64)
            h_col = first_col + h % n_cols
            h_entry = tl.load(page_table_ptr + h_row64 * stride_pt_row + h_col.to(tl.int64) * stride_pt_col,
                              mask=h_ok, other=-1)
            h_page = tl.where(h_ok & (h_entry >= 0), h_entry // page_index_divisor, -2)
            held |= tl.max(tl.where(page[:, None] == h_page[None, :], 1, 0))
        bits |= tl.where(held != 0, HELD_WRITE_PAGE, 0)

    if bits != 0:
        tl.atomic_or(err_ptr, bits, sem="relaxed")
    # The next step's records go above this one's. (Nothing in this launch reads the stamp; the holders launch that
    # wrote it has finished.)
    if (req == 0) & (tl.program_id(1) == 0):
        tl.atomic_add(state_ptr, 1, sem="relaxed")
