"""Device-side error flags: what the kernels mask instead of dereferencing, reported without a sync.

The kernels never follow an index out of its buffer: a page outside the pool, a source beam outside
``[0, W)``, a length past the cache are masked. Without check mode (which reads every index back
on the host, a sync per call) such a value would leave no trace, although the step's output is
then wrong and, for the write slot, this step's K/V is never stored. With an ``error_flags``
tensor (``int32 [1]``) the kernels OR one bit per kind of bad value into it: each program gathers
its bits in registers (integer work only) and ORs them in at its end, with a relaxed atomic on the
lanes that hold any, so valid input issues no atomic. The host reads the word whenever it syncs
anyway and turns it into messages with :func:`decode_error_flags`. What no single index shows (beams
that disagree, a write page held twice, a table unlike the plan) the page-table audit judges once a
step into the same word (:mod:`triton_kernels.page_table_audit`).
"""

import torch
import triton
import triton.language as tl

from .step_args import KernelInputError

__all__ = ["PROMPT_PAGE", "PROMPT_LEN", "KV_LEN", "SOURCE_BEAM", "TAIL_PAGE", "WRITE_PAGE", "BEAM_KV_LEN",
           "SHARED_WRITE_PAGE", "PLAN_PAGE", "ERROR_BITS", "PAGE_BAD_SOURCE", "PAGE_BAD_ENTRY", "error_bits",
           "kv_len_bad", "kv_len_bad_torch", "page_error_bits", "beam_agreement_bits", "beam_agreement_bad_torch",
           "prompt_page_digest_terms_torch", "prompt_pages_digest_torch", "plan_digest_bad_torch", "HELD_WRITE_PAGE",
           "held_write_page_bad_torch", "OTHER_REQUEST_PAGE", "other_request_page_bad_torch",
           "write_page_rules_bad_torch", "or_reduce",
           "flush_errors", "flag_where", "decode_error_flags", "new_error_flags", "check_error_flags"]

#: A prompt token's page (prompt page table) outside ``[0, num_pages)``: its K/V read as zeros.
PROMPT_PAGE = tl.constexpr(1)
#: A prompt longer than the prompt page table holds (or negative): truncated to the table (a negative one read as
#: empty; the tail kernels, which have no prompt table, report a negative one).
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
#: A beam's ``kv_len`` unlike beam 0's of its request: each row attended (and wrote) at its own length. This bit
#: and the four below judge rows together, once a step, in the page-table audit (:mod:`triton_kernels.page_table_audit`;
#: the attention kernels judge the indices they follow, in every layer). Reported only.
BEAM_KV_LEN = tl.constexpr(64)
#: A beam's write slot on beam 0's page of the same page-table column (the prompt's partly filled last
#: page, or a generated page shared between beams), from the second generated token: the two rows write
#: one slot. Reported only.
SHARED_WRITE_PAGE = tl.constexpr(128)
#: Beam 0's page-table entries over its prompt's columns unlike the pages the prefix read there (the plan's),
#: compared by digest: the prefix attended one set of pages, the tail and the write another. Reported only.
PLAN_PAGE = tl.constexpr(256)
#: A beam's write page held elsewhere in its request, from the second generated token: by another row (a page
#: another beam writes or reads, one of beam 0's prompt pages), or by the row itself at an earlier column (its
#: prompt's, for beam 0). Reported only.
HELD_WRITE_PAGE = tl.constexpr(512)
#: A row's write page held by a row of another request, at any column within that row's length, from the row's second
#: generated token: this step's K/V overwrites K/V the other request reads (a block handed out twice, a stale table).
#: Reported only.
OTHER_REQUEST_PAGE = tl.constexpr(1024)

#: ``{bit: message}``; each message names the value, what the kernel did and the likely cause.
ERROR_BITS = {
    PROMPT_PAGE.value: "a prompt page-table entry outside the pool [0, num_pages): that prompt token's K/V read as "
                       "zeros (a stale plan, or a table of another pool)",
    PROMPT_LEN.value: "a prompt length outside [0, prompt page table width x page size] (negative, for the tail "
                      "kernels): the prompt cut to the table (plan with the step's prompt lengths)",
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
    PLAN_PAGE.value: "beam 0's page-table entries over its prompt's columns (entry // page_index_divisor) are not the "
                     "pages the prefix read there: the prefix attended the plan's prompt pages and the tail the "
                     "table's (a plan of another batch: plan() when the batch changes; or a page_index_divisor "
                     "wrong for this table, or a table of another pool)",
    HELD_WRITE_PAGE.value: "a beam's write page (position kv_len - 1) is held elsewhere in its request: another beam "
                           "writes or reads the same page, or it is one of beam 0's prompt pages, or the beam holds it "
                           "itself at an earlier page-table column (a page handed out twice), so this step's K/V "
                           "overwrites K/V that beams read (each beam writes into generated pages of its own; a "
                           "table that shares them among beams, or points a write slot at the prompt, is wrong)",
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
    seen from the second generated token on, while that token still falls in the page. The page-table audit
    calls it (:func:`triton_kernels.page_table_audit_kernel.page_table_audit_kernel`), once a step; a write page
    held elsewhere in the request otherwise is ``HELD_WRITE_PAGE``'s."""
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


def prompt_page_digest_terms_torch(col: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """The digest term of ``page`` at page-table column ``col`` (int tensors, broadcast together): int64, as the
    page-table audit's :func:`triton_kernels.page_table_audit_kernel.prompt_page_digest_term` computes it on the
    device (``tests/triton_kernels/test_page_table_audit.py`` holds the two equal). int64 products wrap, on the
    device and in torch alike."""
    x = page.long() * 0x5BD1E995 + col.long() * 0x1B873593 + 0x68E31DA4
    x ^= x >> 29
    x *= 0x7FEB352D
    x ^= x >> 32
    x *= 0x2C1B3C6D
    x ^= x >> 31
    return x


def prompt_pages_digest_torch(page_rows: torch.Tensor, n_cols: torch.Tensor) -> torch.Tensor:
    """The digest of each row's first ``n_cols`` pages: ``page_rows`` ``[N, cols]`` (pages; ``-1`` for an entry
    that is none), ``n_cols`` ``[N]``; returns int64 ``[N]``, the XOR of the columns' terms
    (:func:`prompt_page_digest_terms_torch`). Device ops, no sync."""
    col = torch.arange(page_rows.shape[1], device=page_rows.device)
    terms = prompt_page_digest_terms_torch(col[None, :], page_rows)
    terms = torch.where(col[None, :] < n_cols[:, None], terms, torch.zeros_like(terms))
    digest = torch.zeros(page_rows.shape[0], dtype=torch.long, device=page_rows.device)
    for c in range(page_rows.shape[1]):  # (torch has no XOR reduction)
        digest ^= terms[:, c]
    return digest


def plan_digest_bad_torch(beam_page_table: torch.Tensor, prompt_lens: torch.Tensor, plan_digest: torch.Tensor,
                          beam_width: int, page_size: int, page_index_divisor: int, max_seq_len: int) -> torch.Tensor:
    """The page-table audit's ``PLAN_PAGE`` rule on torch tensors: bool ``[requests]``, the requests whose beam 0 holds,
    over its prompt's columns, pages whose digest is not the plan's (``plan_digest`` int64 ``[requests]``:
    ``StepPlan.prompt_pages_digest``). Prompts that are empty or past the table or the cache are not judged (the
    length checks'). Device ops, no sync."""
    cols = beam_page_table.shape[1]
    first = beam_page_table[:prompt_lens.shape[0]:beam_width].long()  # [requests, cols]
    plen = prompt_lens[::beam_width].long()
    judged = (plen >= 1) & (plen <= max_seq_len) & (plen <= cols * page_size)
    pages = torch.where(first >= 0, torch.div(first, page_index_divisor, rounding_mode="trunc"), -1)
    n_cols = torch.where(judged, -(-plen // page_size), torch.zeros_like(plen))
    return judged & (prompt_pages_digest_torch(pages, n_cols) != plan_digest.long())


def write_page_rules_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                               beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                               max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-table audit's two write-page rules on torch tensors, from one pass over the holders: bool ``[rows]``
    each, ``(other_request, held)`` (:func:`other_request_page_bad_torch`, :func:`held_write_page_bad_torch`).

    As the audit, it records the highest and lowest row holding each page (every row's columns below
    ``cdiv(kv_len, page_size)``, beams other than beam 0 from their prompt's last column) and judges the rows from
    their second generated token whose write entry is in the pool."""
    rows, cols = kv_lens.shape[0], beam_page_table.shape[1]
    dev = kv_lens.device
    row = torch.arange(rows, device=dev)
    first, end = row - row % beam_width, row - row % beam_width + beam_width
    kv = kv_lens.long().clamp(max=max_seq_len)
    plen = prompt_lens.long()
    table = beam_page_table[:rows].long()
    col = torch.arange(cols, device=dev)
    n_cols = torch.div(kv.clamp(min=0) + page_size - 1, page_size, rounding_mode="floor")
    first_col = torch.where(row % beam_width == 0, torch.zeros_like(plen), plen.clamp(min=0) // page_size)
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
    high, low = high[w_page], low[w_page]
    # A judged row holds its own write page, so low <= row <= high: another request's row lies past one of them.
    other_request = judged & ((high >= end) | (low < first))
    in_request = judged & (((high != row) & (high < end)) | ((low != row) & (low >= first)))
    earlier = (col[None, :] >= first_col[:, None]) & (col[None, :] < w_col[:, None]) & (table >= 0)
    mine = judged & (earlier & (table // page_index_divisor == w_page[:, None])).any(1)
    return other_request, in_request | mine


def other_request_page_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                                 beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                                 max_seq_len: int) -> torch.Tensor:
    """The page-table audit's ``OTHER_REQUEST_PAGE`` rule on torch tensors: bool ``[rows]``, the rows whose write page,
    from their second generated token, a row of another request holds (at a column below ``cdiv(kv_len, page_size)``;
    beams other than beam 0 from their prompt's last column). Device ops, no sync: the lowest and highest row holding
    each page, by ``scatter_reduce``."""
    return write_page_rules_bad_torch(kv_lens, prompt_lens, beam_page_table, beam_width, page_size,
                                      page_index_divisor, num_pages, max_seq_len)[0]


def held_write_page_bad_torch(kv_lens: torch.Tensor, prompt_lens: torch.Tensor, beam_page_table: torch.Tensor,
                              beam_width: int, page_size: int, page_index_divisor: int, num_pages: int,
                              max_seq_len: int) -> torch.Tensor:
    """The page-table audit's ``HELD_WRITE_PAGE`` rule on torch tensors: bool ``[rows]``, the rows whose write page,
    from their second generated token, another row of their request holds, or the row itself at an earlier column
    from its first recorded one (0 for beam 0, the prompt's last column for the others). Device ops, no sync."""
    return write_page_rules_bad_torch(kv_lens, prompt_lens, beam_page_table, beam_width, page_size,
                                      page_index_divisor, num_pages, max_seq_len)[1]


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
    """Host-side twin of the kernels' bits, for torch paths: OR ``bit`` (an int, or a constexpr of this module)
    into ``error_flags`` (int32 ``[1]``) if any element of ``bad`` (bool, any shape) is true, as device ops (no
    sync)."""
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
