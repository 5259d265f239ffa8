"""The tail's index chain, shared by the tail and cascade kernels: generated position -> source beam
(``cache_indirection``) -> that beam's page-table entry -> page number.

Every link is masked rather than dereferenced when it would leave its buffer: a position the
caller marks invalid, a source beam outside ``[0, W)``, a negative entry, or a page outside
``[0, num_pages)`` gives page ``-1``, which the kernels use as the K/V load mask.
"""

import triton
import triton.language as tl

from .device_errors import PAGE_BAD_ENTRY, PAGE_BAD_SOURCE

__all__ = ["source_beam_pages", "pages_of_source_beams", "shared_ancestry_len"]


@triton.jit
def source_beam_pages(
    ci_ptrs, pos, pos_ok, page_table_ptr, first_src_row, stride_pt_row, stride_pt_col, beam_width, page_size,
    page_index_divisor, num_pages, REPORT_ERRORS: tl.constexpr = False,
):
    """Pages (int32, ``-1`` where masked) holding positions ``pos`` of the beams ``ci_ptrs`` point at.

    ``ci_ptrs`` are the ``cache_indirection`` entries of ``pos`` (same shape), read where ``pos_ok``;
    ``first_src_row`` is the page-table row of the request's beam 0 (``r * W``, int64), so source
    beam ``s`` reads row ``first_src_row + s`` at column ``pos // page_size``; page-table entries are
    divided by ``page_index_divisor`` (TensorRT-LLM block offsets; 1 for page numbers). With
    ``REPORT_ERRORS`` a masked link of a valid position gives ``PAGE_BAD_SOURCE`` (-2) or
    ``PAGE_BAD_ENTRY`` (-3) instead of -1 (:func:`triton_kernels.device_errors.page_error_bits`).
    """
    src = tl.load(ci_ptrs, mask=pos_ok, other=0)
    return pages_of_source_beams(src, pos, pos_ok, page_table_ptr, first_src_row, stride_pt_row, stride_pt_col,
                                 beam_width, page_size, page_index_divisor, num_pages, REPORT_ERRORS)


@triton.jit
def pages_of_source_beams(
    src, pos, pos_ok, page_table_ptr, first_src_row, stride_pt_row, stride_pt_col, beam_width, page_size,
    page_index_divisor, num_pages, REPORT_ERRORS: tl.constexpr = False,
):
    """The chain's second link on its own: pages of positions ``pos`` of source beams ``src`` (the
    ``cache_indirection`` entries, loaded where ``pos_ok``), so that a kernel can issue other loads
    between the two links; arguments and result as :func:`source_beam_pages`."""
    src_ok = pos_ok & (src >= 0) & (src < beam_width)
    entry = tl.load(
        page_table_ptr + (first_src_row + src) * stride_pt_row + (pos // page_size).to(tl.int64) * stride_pt_col,
        mask=src_ok,
        other=-1,
    )
    page = entry // page_index_divisor  # int32 division: entries are >= 0 when used
    page_ok = src_ok & (entry >= 0) & (page < num_pages)
    if REPORT_ERRORS:
        return tl.where(page_ok, page, tl.where(src_ok, PAGE_BAD_ENTRY, tl.where(pos_ok, PAGE_BAD_SOURCE, -1)))
    return tl.where(page_ok, page, -1)


@triton.jit
def shared_ancestry_len(
    ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, req64, first_beam, beam_width, pos_begin, pos_end,
    BEAMS: tl.constexpr, SCAN: tl.constexpr,
):
    """How many positions from ``pos_begin`` on (before ``pos_end``) every beam of a tile reads from
    the same source beam: the length of the leading run of ``[pos_begin, pos_end)`` over which the
    ``cache_indirection`` entries of beams ``[first_beam, first_beam + BEAMS)`` (those below
    ``beam_width``) are all equal (int32 scalar, ``0..pos_end - pos_begin``).

    Beam search's histories coalesce: going back from the newest token, the beams soon descend from
    one ancestor, and from there on they read the same K/V row at every position. Such a run can be
    attended once for the whole tile, as the prompt is. ``SCAN`` positions per load, stopping at the
    first chunk with a differing entry. The entries are compared, not checked: a run of equal
    out-of-range entries is masked where its pages are looked up.
    """
    slot = tl.arange(0, BEAMS)
    j = tl.arange(0, SCAN)
    beam_ok = first_beam + slot < beam_width
    rows = ci_ptr + req64 * stride_ci_req + (first_beam + slot).to(tl.int64) * stride_ci_beam
    stop = pos_end
    t0 = pos_begin
    while t0 < stop:
        pos = t0 + j
        pos_ok = pos < pos_end
        src = tl.load(rows[:, None] + pos.to(tl.int64)[None, :] * stride_ci_pos,
                      mask=beam_ok[:, None] & pos_ok[None, :], other=0)
        first = tl.sum(tl.where(slot[:, None] == 0, src, 0), axis=0)  # the tile's first beam (always < W)
        differs = tl.max(tl.where(beam_ok[:, None] & (src != first[None, :]), 1, 0), axis=0)
        stop = tl.minimum(stop, tl.min(tl.where(pos_ok & (differs > 0), pos, pos_end), axis=0))
        t0 += SCAN
    return stop - pos_begin
