"""The page-table audit: a check of the beams' page table that the step's attention kernels leave out, run with the
device error flag only, one launch a step (:func:`triton_kernels.page_table_audit.audit_fresh_write_pages`).

A write page that a beam of its request still holds at an earlier generated column (a stale table, a manager that
hands out one block twice) makes this step's K/V overwrite K/V that every beam reads through ``cache_indirection``.
The tail kernels judge each row's write page against the other beams' write pages and beam 0's prompt pages
(:func:`triton_kernels.device_errors.held_write_page_bits`); the earlier generated columns take a loop over
``W x columns`` entries, which cost registers in every configuration of the tail kernels it was placed in (the
sm_90 compile test; ``docs/rounds.md``, "The seventieth round"). Here it has a launch of its own.

One program per request. A request is judged at a page's first token only (beam 0's ``cur = kv_len - 1`` a
multiple of the page size, past the prompt's first generated token): the step at which the manager hands the page
out, so one step in ``page_size`` compares ``W x W x columns`` entries and the others read two ints. Each beam at
beam 0's length has its write page compared with every page the request's beams hold from the prompt's last
column (``prompt_len // page_size``: each beam's copy of the partly filled page) up to the write column, in
``[BLOCK_W, BLOCK_H]`` blocks. Warm-up and padding rows (``kv_len`` 1) are never judged.
"""

import triton
import triton.language as tl

from .device_errors import HELD_WRITE_PAGE

__all__ = ["fresh_write_page_audit_kernel"]


@triton.jit
def fresh_write_page_audit_kernel(
    kv_lens_ptr,
    prompt_lens_ptr,
    page_table_ptr,
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
    first_row64 = tl.program_id(0).to(tl.int64) * beam_width
    prompt_len = tl.load(prompt_lens_ptr + first_row64)
    first_cur = tl.load(kv_lens_ptr + first_row64) - 1
    write_col = first_cur // page_size
    # (first_cur >= 0 apart: with a negative prompt length a padding row's cur 0 is past it)
    judged_step = ((first_cur > prompt_len) & (first_cur >= 0) & (first_cur < max_seq_len)
                   & (first_cur % page_size == 0) & (write_col < table_cols))
    if judged_step:
        first_col = tl.maximum(prompt_len, 0) // page_size
        n_cols = write_col - first_col
        n_held = beam_width * n_cols
        w_lanes = tl.arange(0, BLOCK_W)
        h_lanes = tl.arange(0, BLOCK_H)
        held = n_held * 0
        for w0 in range(0, beam_width, BLOCK_W):
            beam = w0 + w_lanes
            row64 = first_row64 + beam.to(tl.int64)
            row_ok = beam < beam_width
            cur = tl.load(kv_lens_ptr + row64, mask=row_ok, other=0) - 1
            # A beam at another length is BEAM_KV_LEN's (the kernels report it); its column is not this step's.
            judged = row_ok & (cur == first_cur)
            entry = tl.load(page_table_ptr + row64 * stride_pt_row + write_col.to(tl.int64) * stride_pt_col,
                            mask=judged, other=-1)
            page = entry // page_index_divisor
            # -1 matches no held page (those are >= 0), so the comparisons need no row mask of their own.
            page = tl.where(judged & (entry >= 0) & (page < num_pages), page, -1)
            for h0 in range(0, n_held, BLOCK_H):
                h = h0 + h_lanes
                h_ok = h < n_held
                h_row64 = first_row64 + (h // n_cols).to(tl.int64)
                h_col = first_col + h % n_cols
                h_entry = tl.load(page_table_ptr + h_row64 * stride_pt_row + h_col.to(tl.int64) * stride_pt_col,
                                  mask=h_ok, other=-1)
                # (h_entry < 0 judged apart: Triton's division truncates, so -1 // 2 would be page 0)
                h_page = tl.where(h_ok & (h_entry >= 0), h_entry // page_index_divisor, -2)
                held |= tl.max(tl.where(page[:, None] == h_page[None, :], 1, 0))
        if held != 0:
            tl.atomic_or(err_ptr, HELD_WRITE_PAGE, sem="relaxed")
