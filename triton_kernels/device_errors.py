"""Device-side error flags: what the kernels mask instead of dereferencing, reported without a sync.

The kernels never follow an index out of its buffer: a page outside the pool, a source beam outside
``[0, W)``, a length past the cache are masked. Without check mode (which reads every index back
on the host, a sync per call) such a value would leave no trace, although the step's output is
then wrong and, for the write slot, this step's K/V is never stored. With an ``error_flags``
tensor (``int32 [1]``) the kernels OR one bit per kind of bad value into it: each program gathers
its bits in registers (integer work only) and ORs them in at its end, with a relaxed atomic on the
lanes that hold any, so valid input issues no atomic. The host reads the word whenever it syncs
anyway and turns it into messages with :func:`decode_error_flags`.
"""

import torch
import triton
import triton.language as tl

from .step_args import KernelInputError

__all__ = ["PROMPT_PAGE", "PROMPT_LEN", "KV_LEN", "SOURCE_BEAM", "TAIL_PAGE", "WRITE_PAGE", "BEAM_KV_LEN",
           "SHARED_WRITE_PAGE", "PLAN_PAGE", "ERROR_BITS", "PAGE_BAD_SOURCE", "PAGE_BAD_ENTRY", "error_bits",
           "kv_len_bad", "kv_len_bad_torch", "page_error_bits", "beam_agreement_bits", "beam_agreement_bad_torch",
           "plan_agreement_bits", "plan_agreement_bad_torch", "HELD_WRITE_PAGE", "held_write_page_bits",
           "held_write_page_bad_torch", "fresh_write_page_bad_torch", "OTHER_REQUEST_PAGE",
           "other_request_page_bad_torch", "or_reduce",
           "flush_errors", "flag_where", "decode_error_flags", "new_error_flags", "check_error_flags"]

#: A prompt token's page (prompt page table) outside ``[0, num_pages)``: its K/V read as zeros.
PROMPT_PAGE = tl.constexpr(1)
#: A prompt longer than the prompt page table holds (or negative): truncated to the table.
PROMPT_LEN = tl.constexpr(2)
#: A row's ``kv_len`` not past its prompt, or past ``max_seq_len``: this step's K/V not written, the
#: tail cut at the cache's end.
KV_LEN = tl.constexpr(4)
#: A ``cache_indirection`` entry that is not a beam of the request: that position left out.
SOURCE_BEAM = tl.constexpr(8)
#: A generated position's page-table entry negative or outside the pool: that position left out.
TAIL_PAGE = tl.constexpr(16)
#: The page-table entry of a row's write slot negative or outside the pool: this step's K/V not written.
WRITE_PAGE = tl.constexpr(32)
#: A beam's ``kv_len`` unlike beam 0's of its request: each row attended (and wrote) at its own length.
BEAM_KV_LEN = tl.constexpr(64)
#: A beam's write slot on beam 0's page of the same page-table column (the prompt's partly filled last
#: page, or a generated page shared between beams), from the second generated token: the two rows write
#: one slot. Reported only.
SHARED_WRITE_PAGE = tl.constexpr(128)
#: Beam 0's page-table entry at its prompt's last token unlike the page the prefix read there (the plan's):
#: the prefix attended one set of pages, the tail and the write another. Reported only.
PLAN_PAGE = tl.constexpr(256)
#: A beam's write page held elsewhere in its request, from the second generated token: the write page of
#: another beam than beam 0 (two rows write one page), or one of beam 0's prompt pages at another column
#: (a page every beam reads), judged once a request by the kernels (:func:`held_write_page_bits`); or, at a
#: page's first token, a page a beam holds at an earlier generated column, judged once a step by the page-table
#: audit (:mod:`triton_kernels.page_table_audit`). Reported only.
HELD_WRITE_PAGE = tl.constexpr(512)
#: A row's write page held by a row of another request, at any column within that row's length, from the row's second
#: generated token: this step's K/V overwrites K/V the other request reads (a block handed out twice, a stale table).
#: Judged once a step by the page-table audit (:mod:`triton_kernels.page_table_audit`). Reported only.
OTHER_REQUEST_PAGE = tl.constexpr(1024)

#: ``{bit: message}``; each message names the value, what the kernel did and the likely cause.
ERROR_BITS = {
    PROMPT_PAGE.value: "a prompt page-table entry outside the pool [0, num_pages): that prompt token's K/V read as "
                       "zeros (a stale plan, or a table of another pool)",
    PROMPT_LEN.value: "a prompt length outside [0, prompt page table width x page size]: the prompt cut to the table "
                      "(plan with the step's prompt lengths)",
    KV_LEN.value: "a kv_len not past its prompt length, or past max_seq_len: this step's K/V not written and the tail "
                  "cut (pass kv_lens that include this step's token, within the cache)",
    SOURCE_BEAM.value: "a cache_indirection entry outside [0, beam_width): that generated position left out (the "
                       "indirection buffer belongs to another beam width or step)",
    TAIL_PAGE.value: "a beam page-table entry of a generated position negative or outside the pool: that position left "
                     "out (block offsets stale, or page_index_divisor wrong)",
    WRITE_PAGE.value: "the page-table entry of a row's write slot negative or outside the pool: this step's K/V not "
                      "written (no page allocated for the new token, or page_index_divisor wrong)",
    BEAM_KV_LEN.value: "a beam's kv_len unlike beam 0's of its request: each row attended and wrote at its own "
                       "length, so a beam that reads another's position past that beam's length reads a slot written "
                       "in this step (pass one kv_len per request, repeated for each of its beams)",
    SHARED_WRITE_PAGE.value: "a beam's write slot (position kv_len - 1) on beam 0's page of the same page-table "
                             "column: both rows write one slot, so K/V that other beams read there is overwritten "
                             "(each beam needs its own copy of the prompt's partly filled last page and its own "
                             "generated pages; a table that shares them among beams is wrong)",
    PLAN_PAGE.value: "beam 0's page-table entry at its prompt's last token (entry // page_index_divisor) is not the "
                     "page the prefix read there: the prefix attended the plan's prompt pages and the tail the "
                     "table's (a plan of another batch: plan() when the batch changes; or a page_index_divisor "
                     "wrong for this table, or a table of another pool)",
    HELD_WRITE_PAGE.value: "a beam's write page (position kv_len - 1) is held elsewhere in its request: another beam "
                           "than beam 0 writes the same page, or it is one of beam 0's prompt pages at another "
                           "page-table column, or a beam holds it at an earlier generated column (a page handed out "
                           "twice), so this step's K/V overwrites K/V that other beams read (each beam "
                           "writes into generated pages of its own; a table that shares them among beams, or points "
                           "a write slot at the prompt, is wrong)",
    OTHER_REQUEST_PAGE.value: "a row's write page (position kv_len - 1) is held by a row of another request (at a "
                              "column within that row's kv_len): this step's K/V overwrites K/V the other request "
                              "reads (a KV cache block handed out to two requests, or a page table of another step "
                              "or batch)",
}


#: Page codes of :func:`triton_kernels.beam_index.pages_of_source_beams` with ``REPORT_ERRORS``: a
#: masked link of a valid position keeps its kind in the page value (``-1``: position not read).
PAGE_BAD_SOURCE = tl.constexpr(-2)
PAGE_BAD_ENTRY = tl.constexpr(-3)


@triton.jit
def error_bits(bad, CODE: tl.constexpr):
    """``CODE`` where ``bad``, else 0 (int32, ``bad``'s shape): integer work only on the kernel's path;
    the bits are ORed into the flag once, at the program's end (:func:`flush_errors`)."""
    return tl.where(bad, CODE, 0)


@triton.jit
def kv_len_bad(cur, prompt_len, max_seq_len):
    """Whether a row's position ``cur = kv_len - 1`` is invalid (``KV_LEN``): negative, past the cache,
    or inside the prompt. ``kv_len == 1`` with a one-token planned prompt is exempt from the last:
    TensorRT-LLM's warm-up and CUDA-graph padding rows have no prompt and one token, and are planned
    with a one-token prompt; no real generation row has ``kv_len < 2``. (Their K/V is not written
    either way.) A row planned with a longer prompt is not a padding row, so ``kv_len == 1`` is bad there."""
    return ((cur < prompt_len) & ((cur >= 1) | (prompt_len > 1))) | (cur < 0) | (cur >= max_seq_len)


def kv_len_bad_torch(cur: torch.Tensor, prompt_len: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """:func:`kv_len_bad` on torch tensors (int, broadcast together; returns bool), for the kernels' torch
    twins: the same rule, written twice because a ``@triton.jit`` function runs only inside a kernel
    (``tests/triton_kernels/test_device_errors.py`` holds the two equal)."""
    return ((cur < prompt_len) & ((cur >= 1) | (prompt_len > 1))) | (cur < 0) | (cur >= max_seq_len)


@triton.jit
def beam_agreement_bits(kv_lens_ptr, page_table_ptr, row64, row_ok, first_row64, prompt_len, stride_pt_row,
                        stride_pt_col, page_size, page_index_divisor, num_pages, max_seq_len):
    """``BEAM_KV_LEN`` and ``SHARED_WRITE_PAGE`` of the rows ``row64`` (int64 vector, lanes ``row_ok``) of
    one request whose beam 0 is row ``first_row64``: int32 bits, ``row64``'s shape.

    Whether the beams of a request agree with beam 0, which the kernels cannot see one row at a time:
    the same ``kv_len``, and a write slot on a page of the row's own (beam 0 writes the prompt's partly
    filled last page, which is why comparing with beam 0's column catches a write onto a prompt page).
    Only a slot the kernels would write is judged (not a padding row's, a position inside the prompt or
    past the cache), so ``kv_len_bad`` rows add nothing here; and only a row with an earlier generated
    token (``kv_len >= prompt_len + 2``): TensorRT-LLM's warm-up requests are all context to its KV cache
    (``kv_len = prompt_len + 1``), whose last block the beams share when it is full, so a write page shared
    at the first generated token is valid there. A table that shares the prompt's partly filled page is
    seen from the second generated token on, while that token still falls in the page. It reloads what it
    needs, L1/L2 hits by then: call it after the program's last store, under ``REPORT_ERRORS``, so that
    the kernels without the flag keep their code. Beams other than beam 0 that share a page with each
    other, and a write page that is one of beam 0's prompt pages at another column, are
    :func:`held_write_page_bits`'s."""
    zero = row64 * 0
    cur = tl.load(kv_lens_ptr + row64, mask=row_ok, other=0) - 1
    first_cur = tl.load(kv_lens_ptr + first_row64 + zero, mask=row_ok, other=0) - 1
    other_beam = row_ok & (row64 != first_row64 + zero)
    w_ok = other_beam & (cur == first_cur) & (cur > prompt_len) & (cur >= 0) & (cur < max_seq_len)
    col = (cur // page_size).to(tl.int64) * stride_pt_col
    own = tl.load(page_table_ptr + row64 * stride_pt_row + col, mask=w_ok, other=-1)
    first = tl.load(page_table_ptr + (first_row64 + zero) * stride_pt_row + col, mask=w_ok, other=-1)
    own_page = own // page_index_divisor
    shared = w_ok & (own >= 0) & (own_page < num_pages) & (first >= 0) & (first // page_index_divisor == own_page)
    return error_bits(other_beam & (cur != first_cur), BEAM_KV_LEN) | error_bits(shared, SHARED_WRITE_PAGE)


def beam_agreement_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                             beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                             max_seq_len: int):
    """:func:`beam_agreement_bits` on torch tensors for ``rows = kv_lens.numel()`` rows (``prompt_lens``
    per row): ``(len_differs, shares_write_page)``, bool ``[rows]`` each, device ops (no sync).
    (``tests/triton_kernels/test_device_errors.py`` holds the two equal.)"""
    rows = kv_lens.shape[0]
    row = torch.arange(rows, device=kv_lens.device)
    first = row - row % beam_width
    cur = kv_lens.long() - 1
    first_cur = cur[first]
    other_beam = row != first
    w_ok = other_beam & (cur == first_cur) & (cur > prompt_lens.long()) & (cur >= 0) & (cur < max_seq_len)
    col = torch.where(w_ok, cur // page_size, torch.zeros_like(cur))
    own = beam_page_table[row, col].long()
    first_entry = beam_page_table[first, col].long()
    own_page = own // page_index_divisor
    shared = (w_ok & (own >= 0) & (own_page < num_pages) & (first_entry >= 0)
              & (first_entry // page_index_divisor == own_page))
    return other_beam & (cur != first_cur), shared


@triton.jit
def plan_agreement_bits(page_table_ptr, row64, row_ok, prompt_len, plan_page, stride_pt_row, stride_pt_col, page_size,
                        page_index_divisor, table_tokens):
    """``PLAN_PAGE`` of beam-0 rows ``row64`` (int64 vector, lanes ``row_ok``) whose prompt of ``prompt_len``
    tokens ends on page ``plan_page`` in the plan (the prompt pages the prefix reads): int32 bits.

    The plan's pages come from the host at ``plan()``, the beam page table from the device at every step;
    comparing the page of the prompt's last token catches a plan of another batch, a wrong
    ``page_index_divisor`` and another pool's table, which keep every index inside the pool. Prompts
    longer than the table (``table_tokens``) are the length checks' (not judged here). Call it after the
    program's last store, under ``REPORT_ERRORS``."""
    plen = row64 * 0 + prompt_len  # (a vector: the interpreter cannot `&` a scalar into a mask)
    judged = row_ok & (plen >= 1) & (plen <= table_tokens)
    col = (plen - 1) // page_size
    entry = tl.load(page_table_ptr + row64 * stride_pt_row + col * stride_pt_col, mask=judged, other=-1)
    # (entry < 0 judged by itself: a negative entry divided can round to page 0)
    return error_bits(judged & ((entry < 0) | (entry // page_index_divisor != plan_page)), PLAN_PAGE)


def plan_agreement_bad_torch(beam_page_table: torch.Tensor, prompt_lens: torch.Tensor,
                             prompt_last_pages: torch.Tensor, beam_width: int, page_size: int,
                             page_index_divisor: int, table_tokens: int) -> torch.Tensor:
    """:func:`plan_agreement_bits` on torch tensors: bool ``[rows]`` (``rows = prompt_lens.numel()``, ``prompt_lens``
    per row, ``prompt_last_pages`` per request), device ops (no sync)."""
    rows = prompt_lens.shape[0]
    row = torch.arange(rows, device=prompt_lens.device)
    plen = prompt_lens.long()
    judged = (row % beam_width == 0) & (plen >= 1) & (plen <= table_tokens)
    col = torch.where(judged, (plen - 1) // page_size, torch.zeros_like(plen))
    entry = beam_page_table[row, col].long()
    plan_page = prompt_last_pages[row // beam_width].long()
    return judged & ((entry < 0) | (entry // page_index_divisor != plan_page))


#: Beams (and beam 0's prompt columns) compared a block at a time by :func:`held_write_page_bits`. At 32 its
#: ``[32, 32]`` comparisons spilled registers in the tail kernel's one-warp programs (sm_90, the compile test).
HELD_CHUNK = tl.constexpr(16)


@triton.jit
def _judged_write_pages(kv_lens_ptr, page_table_ptr, first_row64, beam, n_beams, prompt_len, stride_pt_row,
                        stride_pt_col, page_size, page_index_divisor, num_pages, max_seq_len):
    """The write pages of beams ``beam`` (int vector) of the request whose beam 0 is row ``first_row64``:
    ``(page, column, judged)``; judged are the beams under ``n_beams`` whose slot the kernels write, from the
    second generated token (as :func:`beam_agreement_bits`), with an entry inside the pool."""
    ok = beam < n_beams
    row64 = first_row64 + beam.to(tl.int64)
    cur = tl.load(kv_lens_ptr + row64, mask=ok, other=0) - 1
    # (cur >= 0 apart: a negative prompt length, invalid input, must not let a negative column through)
    judged = ok & (cur > prompt_len) & (cur >= 0) & (cur < max_seq_len)
    col = cur // page_size
    entry = tl.load(page_table_ptr + row64 * stride_pt_row + col.to(tl.int64) * stride_pt_col, mask=judged, other=-1)
    page = entry // page_index_divisor
    return page, col, judged & (entry >= 0) & (page < num_pages)


@triton.jit
def held_write_page_bits(kv_lens_ptr, page_table_ptr, first_row64, judge, beam_width, prompt_len, stride_pt_row,
                         stride_pt_col, page_size, page_index_divisor, num_pages, max_seq_len):
    """``HELD_WRITE_PAGE`` of the request whose beam 0 is row ``first_row64``, judged by the one program whose
    ``judge`` (scalar) holds: int32 scalar.

    Each beam's write page against every other beam's but beam 0's (a pair with beam 0 at one column is
    ``SHARED_WRITE_PAGE``'s) and against beam 0's prompt pages at the other columns (its own column is beam 0's
    partly filled page, which beam 0 itself writes): ``W^2 / 2 + W x prompt pages`` comparisons, blocks of
    :data:`HELD_CHUNK`, in one program a request. Judged as :func:`beam_agreement_bits` judges (from the
    second generated token: TensorRT-LLM's warm-up requests share their blocks at the first), so a batch
    padded with copies of one request (copies share their pages) raises nothing: only beams of one request are
    compared. Call it after the program's last store, under ``REPORT_ERRORS``."""
    n_beams = tl.where(judge, beam_width, 0)
    n_cols = tl.where(judge, tl.minimum(tl.cdiv(prompt_len, page_size), tl.cdiv(max_seq_len, page_size)), 0)
    lanes = tl.arange(0, HELD_CHUNK)
    held = n_beams * 0
    for b0 in range(0, n_beams, HELD_CHUNK):
        beam_i = b0 + lanes
        page_i, col_i, judged_i = _judged_write_pages(kv_lens_ptr, page_table_ptr, first_row64, beam_i, n_beams,
                                                      prompt_len, stride_pt_row, stride_pt_col, page_size,
                                                      page_index_divisor, num_pages, max_seq_len)
        other_i = judged_i & (beam_i > 0)
        for b1 in range(b0, n_beams, HELD_CHUNK):
            beam_j = b1 + lanes
            page_j, _, judged_j = _judged_write_pages(kv_lens_ptr, page_table_ptr, first_row64, beam_j, n_beams,
                                                      prompt_len, stride_pt_row, stride_pt_col, page_size,
                                                      page_index_divisor, num_pages, max_seq_len)
            same = (other_i[:, None] & judged_j[None, :] & (beam_i[:, None] < beam_j[None, :])
                    & (page_i[:, None] == page_j[None, :]))
            held |= tl.max(tl.where(same, 1, 0))
        for c0 in range(0, n_cols, HELD_CHUNK):
            col = c0 + lanes
            col_ok = col < n_cols
            entry = tl.load(page_table_ptr + first_row64 * stride_pt_row + col.to(tl.int64) * stride_pt_col,
                            mask=col_ok, other=-1)
            # (entry < 0 judged apart: a negative entry divided can round to page 0)
            on_prompt = (judged_i[:, None] & (col_ok & (entry >= 0))[None, :] & (col_i[:, None] != col[None, :])
                         & (page_i[:, None] == (entry // page_index_divisor)[None, :]))
            held |= tl.max(tl.where(on_prompt, 1, 0))
    return tl.where(held != 0, HELD_WRITE_PAGE, 0)


def fresh_write_page_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                               beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                               max_seq_len: int) -> torch.Tensor:
    """The page-table audit's rule (:mod:`triton_kernels.page_table_audit_kernel`) on torch tensors: bool ``[rows]``,
    the rows whose write page, at a page's first token, a beam of their request holds at an earlier generated column
    (``rows = kv_lens.numel()``, ``prompt_lens`` per row); device ops, no sync. The audit ORs one bit a launch; this
    names the rows, which its tests compare."""
    rows = kv_lens.shape[0]
    W = beam_width
    row = torch.arange(rows, device=kv_lens.device)
    first = row - row % W
    cur = kv_lens.long() - 1
    plen = prompt_lens.long()
    cols = beam_page_table.shape[1]
    first_cur, first_plen = cur[first], plen[first]
    judged = ((cur == first_cur) & (first_cur > first_plen) & (first_cur >= 0) & (first_cur < max_seq_len)
              & (first_cur.remainder(page_size) == 0) & (first_cur // page_size < cols))
    col = torch.where(judged, cur // page_size, torch.zeros_like(cur))
    entry = beam_page_table[row, col].long()
    page = entry // page_index_divisor
    judged = judged & (entry >= 0) & (page < num_pages)
    # Membership by request-tagged keys (request x num_pages + page): no [rows, W x cols] comparison.
    table = beam_page_table[:rows].long()
    held_col = torch.arange(cols, device=kv_lens.device)
    first_col = first_plen.clamp(min=0) // page_size
    write_col = torch.div(first_cur, page_size, rounding_mode="floor")  # beam 0's: every judged row's column
    held_ok = ((held_col[None, :] >= first_col[:, None]) & (held_col[None, :] < write_col[:, None]) & (table >= 0))
    # (-1 where not held rather than a boolean index, which would sync; a judged row's key is >= 0)
    held_keys = torch.where(held_ok, (row // W)[:, None] * num_pages + table // page_index_divisor, -1)
    return judged & torch.isin(row // W * num_pages + page, held_keys)


def other_request_page_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                                 beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                                 max_seq_len: int) -> torch.Tensor:
    """The page-table audit's ``OTHER_REQUEST_PAGE`` rule on torch tensors: bool ``[rows]``, the rows whose write page,
    from their second generated token, a row of another request holds (at a column below ``cdiv(kv_len, page_size)``;
    beams other than beam 0 from their prompt's last column). Device ops, no sync: the lowest and highest row holding
    each page, by ``scatter_reduce``."""
    rows, cols = kv_lens.shape[0], beam_page_table.shape[1]
    W = beam_width
    dev = kv_lens.device
    row = torch.arange(rows, device=dev)
    kv = kv_lens.long().clamp(max=max_seq_len)
    plen = prompt_lens.long()
    table = beam_page_table[:rows].long()
    col = torch.arange(cols, device=dev)
    n_cols = torch.div(kv.clamp(min=0) + page_size - 1, page_size, rounding_mode="floor")
    first_col = torch.where(row % W == 0, torch.zeros_like(plen), plen.clamp(min=0) // page_size)
    held = (col[None, :] >= first_col[:, None]) & (col[None, :] < n_cols[:, None]) & (table >= 0)
    page = torch.where(held, table // page_index_divisor, num_pages)
    held = held & (page < num_pages)
    page = torch.where(held, page, num_pages).flatten()  # (slot num_pages: nobody's)
    holder = row[:, None].expand(rows, cols).flatten()
    high = torch.full((num_pages + 1,), -1, dtype=torch.long, device=dev).scatter_reduce(0, page, holder, "amax")
    low = torch.full((num_pages + 1,), rows, dtype=torch.long, device=dev).scatter_reduce(0, page, holder, "amin")
    cur = kv_lens.long() - 1
    w_col = torch.div(cur, page_size, rounding_mode="floor")
    judged = (cur > plen) & (cur >= 0) & (cur < max_seq_len) & (w_col < cols)
    entry = table[row, torch.where(judged, w_col, torch.zeros_like(w_col))]
    w_page = entry // page_index_divisor
    judged = judged & (entry >= 0) & (w_page < num_pages)
    w_page = torch.where(judged, w_page, num_pages)
    request = row // W
    return judged & ((high[w_page] // W != request) | (low[w_page] // W != request))


def held_write_page_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                              beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                              max_seq_len: int) -> torch.Tensor:
    """:func:`held_write_page_bits` on torch tensors: bool ``[requests]`` (``rows = kv_lens.numel()``, ``prompt_lens``
    per row), device ops (no sync)."""
    rows = kv_lens.shape[0]
    W = beam_width
    row = torch.arange(rows, device=kv_lens.device)
    cur = kv_lens.long() - 1
    plen = prompt_lens.long()
    judged = (cur > plen) & (cur >= 0) & (cur < max_seq_len)
    col = torch.where(judged, cur // page_size, torch.zeros_like(cur))
    entry = beam_page_table[row, col].long()
    page = entry // page_index_divisor
    judged = judged & (entry >= 0) & (page < num_pages)
    page, col, judged = page.view(-1, W), col.view(-1, W), judged.view(-1, W)  # [requests, W]
    beam = torch.arange(W, device=kv_lens.device)
    pairs = ((judged & (beam > 0))[:, :, None] & judged[:, None, :] & (beam[:, None] < beam[None, :])
             & (page[:, :, None] == page[:, None, :]))
    cols = beam_page_table.shape[1]
    n_cols = torch.clamp(-(-plen.view(-1, W)[:, 0] // page_size), max=-(-max_seq_len // page_size))  # [requests]
    prompt_col = torch.arange(cols, device=kv_lens.device)
    first_entry = beam_page_table[row.view(-1, W)[:, 0]].long()  # [requests, cols]
    prompt_ok = (prompt_col[None, :] < n_cols[:, None]) & (first_entry >= 0)
    on_prompt = (judged[:, :, None] & prompt_ok[:, None, :] & (col[:, :, None] != prompt_col[None, None, :])
                 & (page[:, :, None] == (first_entry // page_index_divisor)[:, None, :]))
    return pairs.flatten(1).any(1) | on_prompt.flatten(1).any(1)


@triton.jit
def page_error_bits(page):
    """The error bits a page vector from ``pages_of_source_beams(REPORT_ERRORS=True)`` carries."""
    return tl.where(page == PAGE_BAD_SOURCE, SOURCE_BEAM, 0) | tl.where(page == PAGE_BAD_ENTRY, TAIL_PAGE, 0)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def or_reduce(bits):
    """The OR of a 1-D bit vector, a scalar (to carry one register through a loop, not a vector)."""
    return tl.reduce(bits, 0, _bit_or)


@triton.jit
def flush_errors(err_ptr, bits):
    """OR each lane's ``bits`` into ``err_ptr[0]``: a relaxed atomic on the lanes that hold any, issued
    after the program's last load and store. (Atomics at each check, acquire-release by default,
    cost 4-11% on the H200 presets: fences, cache invalidations and a schedule that cannot move
    loads across them.)"""
    zero = tl.zeros(bits.shape, tl.int32)
    tl.atomic_or(err_ptr + zero, bits, mask=bits != 0, sem="relaxed")


def flag_where(error_flags: torch.Tensor, bad: torch.Tensor, bit) -> None:
    """Host-side twin of the kernels' bits, for torch paths: OR ``bit`` into ``error_flags`` if any
    element of ``bad`` is true, as device ops (no sync)."""
    error_flags.bitwise_or_(bad.any().to(torch.int32) * int(getattr(bit, "value", bit)))


def decode_error_flags(value: int) -> list:
    """The messages of the bits set in ``value`` (an error-flag word), in bit order; ``[]`` for 0."""
    value = int(value)
    known = [ERROR_BITS[bit] for bit in sorted(ERROR_BITS) if value & bit]
    unknown = value & ~sum(ERROR_BITS)
    if unknown:
        known.append(f"unknown error bits {unknown:#x}")
    return known


def new_error_flags(device) -> torch.Tensor:
    """A zeroed error-flag word (``int32 [1]``) on ``device``."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_error_flags(error_flags, device) -> None:
    """Raise :class:`KernelInputError` unless ``error_flags`` is ``None`` or an ``int32 [1]`` tensor on
    ``device``."""
    if error_flags is None:
        return
    if (not isinstance(error_flags, torch.Tensor) or error_flags.dtype != torch.int32
            or error_flags.numel() != 1 or error_flags.device != torch.device(device)):
        got = (f"{error_flags.dtype} {tuple(error_flags.shape)} on {error_flags.device}"
               if isinstance(error_flags, torch.Tensor) else type(error_flags).__name__)
        raise KernelInputError(f"error_flags must be an int32 tensor of one element on {device}, got {got}; "
                               f"make one with triton_kernels.device_errors.new_error_flags(device).")
