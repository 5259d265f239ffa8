"""The one-launch cascade kernel: shared prompt on tensor cores, per-beam tail, KV write, one pass.

One program handles one request, one block of ``BEAMS`` of its beams and ``HEADS`` KV heads, one
after the other (1 by default). Its query tile is ``[BLOCK_M, D]`` with
``BLOCK_M = BEAMS * GROUP_PAD``: row ``m`` is beam ``m // GROUP_PAD`` of the block and query head
``kv_head * GROUP + m % GROUP_PAD`` (padding rows, past the beam width or the group, load zeros and
store nothing).

Why one launch. At short and medium prompts (100-500 tokens) and 4-token tails a decode step moves
16-45 MB, 4-11 us at HBM speed, so two launches (a prefix kernel, then the tail kernel) pay two
ramp-ups and tail-offs, and hand the prefix state (output and LSE, as many bytes as the queries)
through memory. Here the prefix's running state never leaves registers.

Per program, in order:

1. What all its heads share goes out first: the prompt length and the first prompt block's page
   entries; the beams' lengths; the page each beam writes this step's K/V to; and the index chain
   of the tail's first key block (source beam through ``cache_indirection``, then the page).
2. Per KV head: the queries, and the generated positions ``[P, L)``, ``TAIL_BLOCK`` at a time. Each
   beam's K/V rows are gathered into a ``[TAIL_BLOCK * BEAMS, D]`` key block (column ``i * BEAMS + j``
   is position ``t + i`` of beam ``j``) in which row ``m`` may only see its own beam's columns. This
   step's token (position ``L - 1``) is one of those columns, read from ``new_k``/``new_v`` instead
   of the cache, so a 4-token tail is one key block. The next block's pages are requested before
   this block's K/V are consumed; the loop bound is read on the device, so one CUDA-graph capture
   serves every tail length. Then this step's K/V are stored to each beam's own page (``WRITE_KV``).
   They are loaded for that store only after the tail, when the key block's current-token column
   has brought their rows into cache: held through the tail they cost 64 registers, and spills at
   multi-block prompts (57.7 against 59.9 us at B-medium, 145.5 against 148.5 at B-long, B-short
   unchanged; ``docs/rounds.md``, "The eleventh round").
   With ``SHARED_ANCESTRY``, a tail of ``SHARED_MIN_TAIL`` cached positions or more is first scanned
   for the run of positions from ``P`` at which every beam of the tile has the same
   ``cache_indirection`` entry (:func:`triton_kernels.beam_index.shared_ancestry_len`). Beam search's
   histories coalesce: a few dozen steps back, the beams descend from one ancestor and read one K/V
   row per position, as the prompt is read. The per-beam key blocks then start after that run, and
   the run is folded once for the tile, after the KV write, as dense ``SHARED_BLOCK``-position key
   blocks seen by every row (:func:`_shared_ancestry_blocks`). At 64 requests x 30 beams and 255
   earlier positions, with runs of about 225 positions, the step took 203-344 us against 574-695 us
   per beam (``docs/rounds.md``, "The twenty-seventh round").
3. The prompt ``[0, P)``, read once per program and head from the request's prompt page table (never
   more than the table's ``prompt_capacity`` tokens), ``BLOCK_N`` tokens per iteration with the next
   block's page entries requested early: ``S = Q K^T`` and ``O += P V`` on tensor cores with the
   online softmax. Every prompt load is masked to ``pos < P``: the slots past the prompt in beam
   0's last page are where beam 0 writes its generated tokens, so they are never read here (no
   race, and an unwritten slot's garbage cannot reach ``P V`` as ``0 x NaN``). The loop has its own
   software-pipeline depth (``PROMPT_STAGES``): with two or more, its K/V go to shared memory by
   ``cp.async`` instead of through registers. With ``PROMPT_FIRST`` it runs before step 2, so the
   tail's index chain, requested in step 1, resolves behind the prompt's loads (the default for
   32-beam tiles at head 128: 69.7 against 77.6 us at B-medium; ``docs/rounds.md``, "The cascade's
   fourth round").
4. ``out = O / l``; with ``PREFIX_ONLY`` (the prompt pass alone, for check mode and the stage
   benchmarks) step 2 is skipped and the prefix LSE is stored as well.

Two variants of that order:

- ``PROMPT_ONE_BLOCK`` (the launcher sets it when the prompt table holds at most ``BLOCK_N``
  tokens) with ``PROMPT_FIRST``: the prompt is one block, run as straight-line code, and the tail's
  index chain is split around it. Step 1 requests only the source beams; their pages are requested
  after the prompt block's K/V, so they resolve behind the prompt's math (32.5 against 33.1 us at
  B-short, ``docs/rounds.md``, "The seventh round").
- ``TAIL_CORES``: step 2 runs on CUDA cores before the prompt, one position at a time for
  ``TAIL_BLOCK`` positions whose index chains are requested together, with the queries as a
  ``[GROUP_PAD, BEAMS, D]`` block so that each thread holds every query head of its beams; the tile's
  rows are then group-major (``g * BEAMS + slot``), and the tail's online-softmax state seeds the
  prompt loop. Its state needs far fewer registers than a ``[BLOCK_M, TAIL_BLOCK * BEAMS]`` score
  block, which lets 16-beam tiles run under a 128-register cap, 4 programs per SM (the default
  there: 52.9 against 56.4 us at B-beam14).

Why the generated positions come first in the other tiles: their index chain (source beam, then page, then K/V) is
three dependent loads; walked first, its latency is paid before the prompt loop's instead of after
it. Measured on the H200 against the prompt-first order with two tail positions per block: 37.9 us
against 58.6 us at B-short (``docs/benchmarks-evidence.md``, "The one-launch cascade"). Folding this step's
token into the tail's key block (one key block and one softmax update fewer) and moving the KV
store after the tail gave another 3-5% at B-short and B-medium.

The masked key blocks of step 2 spend ``BEAMS`` times the tail's useful MMA work, which is small
next to the prompt's at decode shapes (a 4-token tail against a 100-token prompt); it keeps the
whole program in the tensor-core accumulator layout, with no register-layout conversions between
the prompt and the tail. ``P`` is rounded to the KV dtype before ``P V``, as in FlashAttention.

Scores are in base 2 (``s * sm_scale * log2(e)``, then ``exp2``; the scale is applied in the
exponent's multiply-add, not as a separate pass over the score block). The running max is clamped to a
finite value before it is used as an exponent offset, so a key block with no valid column (a page
index the masks rejected) leaves the state unchanged instead of producing NaN. Page numbers and pool
offsets are int64. Indices that would leave the pool (a page outside ``[0, num_pages)``, a source
beam outside ``[0, W)``, a position past ``max_seq_len``) are masked, never dereferenced; check
mode reports them by name, and with ``REPORT_ERRORS`` each program ORs one bit per kind it masked
into ``err_ptr[0]`` after its last store (:mod:`triton_kernels.device_errors`). Prompt scores are masked by position only, so a prompt page outside
the pool reads as zero K/V rather than dropping out of the softmax (the output of such a call is
wrong either way; the mask saves a second load of the page entries per block).
"""

import triton
import triton.language as tl

from .beam_index import pages_of_source_beams, shared_ancestry_len, source_beam_pages
from .device_errors import (KV_LEN, PROMPT_LEN, PROMPT_PAGE, WRITE_PAGE, error_bits, flush_errors, kv_len_bad, or_reduce,
                            page_error_bits)
from .grid_dependency import wait_for_prior_grids
from .tail_merge_grouped_kernel import attend_grouped_row, online_softmax_row

__all__ = ["beam_cascade_kernel"]

# Positions per load of the shared-ancestry scan, and per dense key block of the shared run. Small:
# both paths are compiled into every tiling, whose programs already hold 235-255 registers. In the
# round's first placement, 128-position scans took B-short's kernel from 16 to 104 bytes of stack and
# 64-position dense blocks B-medium's from 32 to 136; with these sizes where the path now sits, B-medium
# has 32 bytes against 8 without it and no spill inside a loop (Triton 3.6, sm_90).
SHARED_SCAN = tl.constexpr(16)
SHARED_BLOCK = tl.constexpr(32)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``tl.dot(a, b)`` with float32 accumulation; ``DOT_FP32`` upcasts the operands first (the CPU
    interpreter multiplies bf16 operands' raw bits, Triton 3.9; fp16 and GPU runs are unaffected)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _online_softmax_block(s, scale_log2, m_i, l_i, acc, v, DOT_FP32: tl.constexpr):
    """Fold a block of raw scores ``s = q . k`` ``[BLOCK_M, N]`` (``-inf`` where masked) and its
    values ``v`` ``[N, D]`` into the running ``(m, l, acc)`` (``m`` in base-2 units, ``s *
    scale_log2``; ``scale_log2 > 0``, checked by the launchers); returns the new state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    # A row whose every score so far is -inf keeps m = -inf; exponent offsets use 0 there, so
    # exp2(-inf - 0) = 0 for its terms and no (-inf) - (-inf) = NaN appears.
    m_off = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_off)
    # The scale rides in the exponent's multiply-add (one FFMA per score, no separate scaling pass).
    p = tl.exp2(s * scale_log2 - m_off[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc_new = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return m_new, l_new, acc_new


@triton.jit
def _tail_block_pages(
    ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
    req64, beam_width, col_beam, col_pos, col_beam_end, page_size, page_index_divisor, num_pages,
    REPORT_ERRORS: tl.constexpr = False,
):
    """Pages of a tail key block's columns (``[TAIL_BLOCK * BEAMS]`` int64), ``-1`` where masked.

    Column ``c`` is position ``col_pos[c]`` of beam ``col_beam[c]``; it is valid when the position is
    before ``col_beam_end[c]`` (that beam's ``L - 1``) and its index chain stays in its buffers.
    """
    ci_ptrs = ci_ptr + req64 * stride_ci_req + col_beam.to(tl.int64) * stride_ci_beam + col_pos.to(tl.int64) * stride_ci_pos
    page = source_beam_pages(ci_ptrs, col_pos, col_pos < col_beam_end, beam_pt_ptr, req64 * beam_width,
                             stride_bpt_row, stride_bpt_col, beam_width, page_size, page_index_divisor, num_pages,
                             REPORT_ERRORS)
    return page.to(tl.int64)


@triton.jit
def _own_slot_entry(beam_pt_ptr, row64, cur, ok, prompt_len, stride_bpt_row, stride_bpt_col, max_seq_len, page_size):
    """Where each row writes this step's K/V, first link: ``(w_ok, entry)``, the row's page-table entry
    for its position ``cur`` (``-1`` where not written). A position inside the prompt (``kv_len <=
    prompt_len``, invalid input) is never written: prompt pages are shared by every beam of a request."""
    w_ok = ok & (cur >= prompt_len) & (cur >= 0) & (cur < max_seq_len)
    entry = tl.load(beam_pt_ptr + row64 * stride_bpt_row + (cur // page_size).to(tl.int64) * stride_bpt_col,
                    mask=w_ok, other=-1)
    return w_ok, entry


@triton.jit
def _own_slot_offsets(w_ok, entry, cur, page_index_divisor, num_pages, page_size, stride_kv_page, stride_kv_slot):
    """Second link of :func:`_own_slot_entry`: the store mask with the entry's validity folded in, the
    slot's pool offset (int64, page and slot terms; 0 where masked), and the error bits of rows
    whose entry was masked (``WRITE_PAGE``)."""
    page = (entry // page_index_divisor).to(tl.int64)
    entry_ok = (entry >= 0) & (page < num_pages)
    w_err = error_bits(w_ok & ~entry_ok, WRITE_PAGE)
    w_ok = w_ok & entry_ok
    return w_ok, tl.where(w_ok, page, 0) * stride_kv_page + (cur % page_size).to(tl.int64) * stride_kv_slot, w_err


@triton.jit
def _tail_on_cores(
    q_ptr, new_k_ptr, new_v_ptr, kv_ptr, beam_pt_ptr, kv_lens_ptr, ci_ptr, stride_q_row, stride_q_head,
    stride_new_k_row, stride_new_k_head, stride_new_v_row, stride_new_v_head, stride_kv_page, stride_kv_kv,
    stride_kv_slot, stride_bpt_row, stride_bpt_col, stride_ci_req, stride_ci_beam, stride_ci_pos, req64, first_beam,
    beam_width, kv_head, kv_head_off, head_ok, prompt_len, page_size, page_index_divisor, num_pages, max_seq_len,
    qk_scale_log2, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BEAMS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TAIL_BLOCK: tl.constexpr, WRITE_KV: tl.constexpr, REPORT_ERRORS: tl.constexpr = False,
):
    """The tail ``[P, L)`` of one KV head on CUDA cores: ``(m, l, acc)`` of its online softmax for the
    tile's rows in group-major order (row ``g * BEAMS + slot``), ``[BLOCK_M]`` and ``[BLOCK_M, D]``
    float32, base-2 ``m``, and error bits (``[BEAMS]`` lengths and write slots, ``[TAIL_BLOCK,
    BEAMS]`` pages; zero unless ``REPORT_ERRORS``). This step's token comes from ``new_k``/``new_v``
    (and is stored to each beam's own page with ``WRITE_KV``); earlier positions ``TAIL_BLOCK`` at a
    time, their index chains (source beam, page) requested together before any of their K/V."""
    BLOCK_M: tl.constexpr = BEAMS * GROUP_PAD
    d = tl.arange(0, HEAD_DIM)
    gq = tl.arange(0, GROUP_PAD)
    slot = tl.arange(0, BEAMS)
    beam = first_beam + slot
    b_ok = beam < beam_width
    b_row64 = req64 * beam_width + beam.to(tl.int64)
    b_cur = tl.load(kv_lens_ptr + b_row64, mask=b_ok, other=0) - 1  # this step's position, per beam
    b_gen_end = tl.minimum(b_cur, max_seq_len)
    gen_stop = tl.max(tl.where(b_ok, b_gen_end, 0), axis=0)
    beam_err = error_bits(b_ok & kv_len_bad(b_cur, prompt_len, max_seq_len), KV_LEN)
    q_ok = (gq < GROUP)[:, None, None] & b_ok[None, :, None]
    q3 = tl.load(q_ptr + b_row64[None, :, None] * stride_q_row + (kv_head * GROUP + gq)[:, None, None] * stride_q_head
                 + d[None, None, :], mask=q_ok, other=0.0).to(tl.float32) * qk_scale_log2
    kd = d[None, None, :]
    k_cur = tl.load(new_k_ptr + b_row64[None, :, None] * stride_new_k_row + kv_head * stride_new_k_head + kd,
                    mask=b_ok[None, :, None], other=0.0)
    v_cur = tl.load(new_v_ptr + b_row64[None, :, None] * stride_new_v_row + kv_head * stride_new_v_head + kd,
                    mask=b_ok[None, :, None], other=0.0)
    # This step's token first, never masked (a padding beam's zero row scores 0): m is finite from
    # here on, so a masked position later is exp2(-inf) = 0, never (-inf) - (-inf).
    m_i = tl.full([GROUP_PAD, BEAMS], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD, BEAMS], tl.float32)
    acc = tl.zeros([GROUP_PAD, BEAMS, HEAD_DIM], tl.float32)
    m_i, l_i, acc = attend_grouped_row(q3, m_i, l_i, acc, k_cur, v_cur, (slot >= 0)[None, :])
    if WRITE_KV:
        w_ok, w_entry = _own_slot_entry(beam_pt_ptr, b_row64, b_cur, b_ok, prompt_len, stride_bpt_row, stride_bpt_col,
                                        max_seq_len, page_size)
        w_ok, w_offs, w_err = _own_slot_offsets(w_ok, w_entry, b_cur, page_index_divisor, num_pages, page_size,
                                                stride_kv_page, stride_kv_slot)
        beam_err |= tl.where(head_ok, w_err, 0)
        w_ok = tl.where(head_ok, w_ok, False)  # (a scalar cannot `&` a mask)
        w_ptrs = kv_ptr + kv_head_off + w_offs[None, :, None] + kd
        tl.store(w_ptrs, k_cur, mask=w_ok[None, :, None])
        tl.store(w_ptrs + stride_kv_kv, v_cur, mask=w_ok[None, :, None])
    ci_beam_ptr = ci_ptr + req64 * stride_ci_req + beam.to(tl.int64) * stride_ci_beam
    tb = tl.arange(0, TAIL_BLOCK)
    pos_err = tl.zeros([TAIL_BLOCK, BEAMS], tl.int32)
    for t0 in range(prompt_len, gen_stop, TAIL_BLOCK):
        pos = t0 + tb[:, None] + slot[None, :] * 0  # [TAIL_BLOCK, BEAMS]
        pages = source_beam_pages(ci_beam_ptr[None, :] + pos.to(tl.int64) * stride_ci_pos, pos,
                                  (pos < b_gen_end[None, :]) & b_ok[None, :], beam_pt_ptr, req64 * beam_width,
                                  stride_bpt_row, stride_bpt_col, beam_width, page_size, page_index_divisor, num_pages,
                                  REPORT_ERRORS)
        if REPORT_ERRORS:
            pos_err |= page_error_bits(pages)
        for i in tl.static_range(TAIL_BLOCK):
            page = tl.sum(tl.where(tb[:, None] == i, pages, 0), axis=0)  # position t0 + i, [BEAMS]
            ok = page >= 0
            slot_in_page = (t0 + i + slot * 0) % page_size  # (a tensor: the interpreter's loop index is an int)
            offs = (tl.where(ok, page, 0).to(tl.int64) * stride_kv_page
                    + slot_in_page.to(tl.int64) * stride_kv_slot)[None, :, None] + kv_head_off + kd
            k_t = tl.load(kv_ptr + offs, mask=ok[None, :, None], other=0.0)
            v_t = tl.load(kv_ptr + stride_kv_kv + offs, mask=ok[None, :, None], other=0.0)
            m_i, l_i, acc = _attend_tail_row(q3, m_i, l_i, acc, k_t, v_t, ok[None, :, None])
    return (tl.reshape(m_i, [BLOCK_M]), tl.reshape(l_i, [BLOCK_M]), tl.reshape(acc, [BLOCK_M, HEAD_DIM]), beam_err,
            pos_err)


@triton.jit
def _attend_tail_row(q3, m_i, l_i, acc, k_raw, v_raw, ok3):
    """Online-softmax update of the core tail's ``[G, BEAMS]`` state with one gathered K/V row per beam
    (``[1, BEAMS, D]``, raw dtype); ``ok3`` (``[1, BEAMS, 1]``, the loads' mask) masks the row.

    The mask is applied to the products before their sum (a masked beam's score sums ``-inf``), in the
    layout the K/V loads already hold it in. Masking the summed scores, as ``attend_grouped_row`` does,
    needs the mask in the scores' layout: Triton 3.6 derived it there, Triton 3.9 moves it through shared
    memory at every tail position (B-beam14's step: 52 barriers against 35, ``docs/rounds.md``, "The
    seventy-fifth round")."""
    s = tl.sum(tl.where(ok3, q3 * k_raw.to(tl.float32), float("-inf")), axis=2)
    return online_softmax_row(m_i, l_i, acc, s, v_raw)


@triton.jit
def _prompt_block_kv(k_head_ptr, v_head_ptr, pages, pos, prompt_end, slot_offs, num_pages, stride_kv_page, d):
    """K and V (``[BLOCK_N, D]``) of prompt positions ``pos`` on their ``pages`` (``slot_offs``: the
    slots' offsets in a page): zeros past the prompt and for a page outside the pool."""
    tok_ok = (pos < prompt_end) & (pages >= 0) & (pages < num_pages)
    offs = tl.where(tok_ok, pages, 0).to(tl.int64) * stride_kv_page + slot_offs
    k = tl.load(k_head_ptr + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
    v = tl.load(v_head_ptr + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _fold_prompt_block(q, k, v, pos, prompt_end, qk_scale_log2, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """Fold one prompt block into ``(m_i, l_i, acc)``. Scores are masked by position only: a page
    outside the pool reads as zero K/V (its load is masked; check mode names it), so the mask needs
    no second copy of the page entries."""
    s_p = tl.where((pos < prompt_end)[None, :], _dot(q, tl.trans(k), DOT_FP32), float("-inf"))
    return _online_softmax_block(s_p, qk_scale_log2, m_i, l_i, acc, v, DOT_FP32)


@triton.jit
def _prompt_blocks(
    q, m_i, l_i, acc, kv_ptr, kv_head_off, prompt_pt_ptr, req64, stride_ppt_req, stride_ppt_col, stride_kv_page,
    stride_kv_kv, stride_kv_slot, first_pages, prompt_end, page_size, num_pages, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PROMPT_STAGES: tl.constexpr, DOT_FP32: tl.constexpr,
    REPORT_ERRORS: tl.constexpr = False,
):
    """Fold the shared prompt ``[0, prompt_end)`` of one KV head into ``(m_i, l_i, acc)``, ``BLOCK_N``
    tokens per iteration with the next block's page entries requested early (``first_pages``: the
    first block's). The table's columns bound it (never a read past the table), whatever
    ``prompt_lens`` says; every load is masked to the prompt. Also returns the ``PROMPT_PAGE`` bits of
    the blocks after the first (``[BLOCK_N]``; the caller checks the first block's pages)."""
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    # Scalar bases (the int64 part once), then per-token offsets: only the page term needs 64 bits;
    # a slot within a page fits 32. When a block spans whole pages, the slots repeat every block.
    k_head_ptr = kv_ptr + kv_head_off
    v_head_ptr = k_head_ptr + stride_kv_kv
    table_row_ptr = prompt_pt_ptr + req64 * stride_ppt_req
    block_slot_offs = (n % page_size) * stride_kv_slot
    pages = first_pages
    blocks_err = tl.zeros([BLOCK_N], tl.int32)
    for start in tl.range(0, prompt_end, BLOCK_N, num_stages=PROMPT_STAGES):
        pos = start + n
        if BLOCK_N % page_size == 0:
            slot_offs = block_slot_offs
        else:
            slot_offs = (pos % page_size) * stride_kv_slot
        k, v = _prompt_block_kv(k_head_ptr, v_head_ptr, pages, pos, prompt_end, slot_offs, num_pages, stride_kv_page, d)
        next_pos = pos + BLOCK_N
        pages = tl.load(table_row_ptr + (next_pos // page_size) * stride_ppt_col, mask=next_pos < prompt_end,
                        other=-1)
        if REPORT_ERRORS:
            blocks_err |= error_bits((next_pos < prompt_end) & ((pages < 0) | (pages >= num_pages)), PROMPT_PAGE)
        m_i, l_i, acc = _fold_prompt_block(q, k, v, pos, prompt_end, qk_scale_log2, m_i, l_i, acc, DOT_FP32)
    return m_i, l_i, acc, blocks_err


@triton.jit
def _shared_ancestry_blocks(
    q, m_i, l_i, acc, kv_ptr, kv_head_off, ci_row_ptr, stride_ci_pos, beam_pt_ptr, first_src_row, stride_bpt_row,
    stride_bpt_col, beam_width, pos_begin, pos_end, page_size, page_index_divisor, num_pages, stride_kv_page,
    stride_kv_kv, stride_kv_slot, qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, REPORT_ERRORS: tl.constexpr = False,
):
    """Fold generated positions ``[pos_begin, pos_end)`` that every beam of the tile reads from the
    same source beam (:func:`triton_kernels.beam_index.shared_ancestry_len`) into ``(m_i, l_i, acc)``
    as the prompt is folded: ``BLOCK_N`` positions per key block seen by every row, each K/V row read
    once for the tile instead of once per beam. ``ci_row_ptr`` is the ``cache_indirection`` row of the
    tile's first beam. The next block's index chain (source beam, page) is requested before this
    block's K/V are consumed. A position whose chain leaves its buffers drops out of the softmax, as
    in the per-beam key blocks. Also returns the blocks' page error bits (an int32 scalar, zero unless
    ``REPORT_ERRORS``)."""
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    k_head_ptr = kv_ptr + kv_head_off
    v_head_ptr = k_head_ptr + stride_kv_kv
    pos = pos_begin + n
    pages = source_beam_pages(ci_row_ptr + pos.to(tl.int64) * stride_ci_pos, pos, pos < pos_end, beam_pt_ptr,
                              first_src_row, stride_bpt_row, stride_bpt_col, beam_width, page_size, page_index_divisor,
                              num_pages, REPORT_ERRORS)
    blocks_err = or_reduce(tl.zeros([BLOCK_N], tl.int32))
    for start in range(pos_begin, pos_end, BLOCK_N):
        pos = start + n
        tok_ok = pages >= 0
        offs = (tl.maximum(pages, 0).to(tl.int64) * stride_kv_page
                + (pos % page_size).to(tl.int64) * stride_kv_slot)
        k = tl.load(k_head_ptr + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_head_ptr + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        if REPORT_ERRORS:
            blocks_err |= or_reduce(page_error_bits(pages))
        next_pos = pos + BLOCK_N
        pages = source_beam_pages(ci_row_ptr + next_pos.to(tl.int64) * stride_ci_pos, next_pos, next_pos < pos_end,
                                  beam_pt_ptr, first_src_row, stride_bpt_row, stride_bpt_col, beam_width, page_size,
                                  page_index_divisor, num_pages, REPORT_ERRORS)
        s = tl.where(tok_ok[None, :], _dot(q, tl.trans(k), DOT_FP32), float("-inf"))
        m_i, l_i, acc = _online_softmax_block(s, qk_scale_log2, m_i, l_i, acc, v, DOT_FP32)
    return m_i, l_i, acc, blocks_err


@triton.jit
def _tail_block_rows(t_pages, tpos, tcol_cur, tcol_ok, tcol_new_k, tcol_new_v, kv_ptr, kv_head_off, page_size,
                     stride_kv_page, stride_kv_kv, stride_kv_slot, ALIGNED_ROWS: tl.constexpr):
    """Row pointers of a tail key block's K and V columns and their validity ``(k_row, v_row, col_ok)``:
    position ``tpos[c]`` on page ``t_pages[c]``, or this step's ``new_k``/``new_v`` row at ``L - 1``."""
    gen_ok = t_pages >= 0
    is_cur = (tpos == tcol_cur) & tcol_ok
    col_ok = gen_ok | is_cur
    toffs = (tl.where(gen_ok, t_pages, 0) * stride_kv_page + kv_head_off
             + (tpos % page_size).to(tl.int64) * stride_kv_slot)
    k_row = tl.where(is_cur, tcol_new_k, kv_ptr + toffs)
    v_row = tl.where(is_cur, tcol_new_v, kv_ptr + stride_kv_kv + toffs)
    if ALIGNED_ROWS:
        # The select hides the rows' alignment from the compiler; restated (the launcher
        # checked the base pointers and strides), the rows load as 16-byte vectors.
        k_row = tl.multiple_of(k_row, 16)
        v_row = tl.multiple_of(v_row, 16)
    return k_row, v_row, col_ok


@triton.jit
def _fold_tail_block(q, k_t, v_t, col_ok, tcol_slot, row_slot, qk_scale_log2, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """Fold one tail key block: row ``m`` sees the valid columns of its own beam slot only."""
    # Folding validity into the column's beam slot (-1: no row) leaves one compare per score.
    col_seen_by = tl.where(col_ok, tcol_slot, -1)
    s_t = tl.where(row_slot[:, None] == col_seen_by[None, :], _dot(q, tl.trans(k_t), DOT_FP32), float("-inf"))
    return _online_softmax_block(s_t, qk_scale_log2, m_i, l_i, acc, v_t, DOT_FP32)


@triton.jit
def _tail_key_blocks(
    q, m_i, l_i, acc, t_start, t_pages, kv_ptr, kv_head_off, tcol_new_k, tcol_new_v, tcol_step, tcol_cur, tcol_ok,
    tcol_slot, tcol_beam, tcol_gen_end, row_slot, tail_stop, ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos,
    beam_pt_ptr, stride_bpt_row, stride_bpt_col, req64, beam_width, page_size, page_index_divisor, num_pages,
    stride_kv_page, stride_kv_kv, stride_kv_slot, qk_scale_log2, HEAD_DIM: tl.constexpr, TAIL_BLOCK: tl.constexpr,
    TAIL_STAGES: tl.constexpr, ALIGNED_ROWS: tl.constexpr, DOT_FP32: tl.constexpr,
    REPORT_ERRORS: tl.constexpr = False,
):
    """Fold the generated positions ``[t_start, tail_stop)`` of one KV head into ``(m_i, l_i, acc)`` as
    masked tensor-core key blocks of ``TAIL_BLOCK x BEAMS`` columns (column ``c``: position ``t0 +
    tcol_step[c]`` of beam slot ``tcol_slot[c]``; ``t_pages``: the first block's pages, ``-1`` where
    masked). The next block's pages are requested before this block's K/V are consumed. Also returns
    the error bits of the later blocks' pages (``[TAIL_COLS]``, zero unless ``REPORT_ERRORS``)."""
    d = tl.arange(0, HEAD_DIM)
    blocks_err = tl.zeros(tcol_step.shape, tl.int32)
    for t0 in tl.range(t_start, tail_stop, TAIL_BLOCK, num_stages=TAIL_STAGES):
        tpos = t0 + tcol_step
        k_row, v_row, col_ok = _tail_block_rows(t_pages, tpos, tcol_cur, tcol_ok, tcol_new_k, tcol_new_v, kv_ptr,
                                                kv_head_off, page_size, stride_kv_page, stride_kv_kv, stride_kv_slot,
                                                ALIGNED_ROWS)
        k_t = tl.load(k_row[:, None] + d[None, :], mask=col_ok[:, None], other=0.0)
        v_t = tl.load(v_row[:, None] + d[None, :], mask=col_ok[:, None], other=0.0)
        t_pages = _tail_block_pages(
            ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row,
            stride_bpt_col, req64, beam_width, tcol_beam, tpos + TAIL_BLOCK, tcol_gen_end, page_size,
            page_index_divisor, num_pages, REPORT_ERRORS,
        )
        if REPORT_ERRORS:
            blocks_err |= page_error_bits(t_pages.to(tl.int32))
        m_i, l_i, acc = _fold_tail_block(q, k_t, v_t, col_ok, tcol_slot, row_slot, qk_scale_log2, m_i, l_i, acc,
                                         DOT_FP32)
    return m_i, l_i, acc, blocks_err


@triton.jit
def beam_cascade_kernel(
    q_ptr,
    new_k_ptr,
    new_v_ptr,
    kv_ptr,
    prompt_pt_ptr,
    beam_pt_ptr,
    kv_lens_ptr,
    prompt_lens_ptr,
    ci_ptr,
    out_ptr,
    lse_ptr,
    stride_q_row,
    stride_q_head,
    stride_new_k_row,
    stride_new_k_head,
    stride_new_v_row,
    stride_new_v_head,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_head,
    stride_kv_slot,
    stride_ppt_req,
    stride_ppt_col,
    stride_bpt_row,
    stride_bpt_col,
    stride_plen_req,
    stride_ci_req,
    stride_ci_beam,
    stride_ci_pos,
    stride_out_row,
    stride_out_head,
    stride_lse_row,
    stride_lse_head,
    beam_width,
    num_beam_blocks,
    num_kv_heads,
    prompt_capacity,
    page_size: tl.constexpr,
    page_index_divisor: tl.constexpr,
    num_pages,
    max_seq_len,
    qk_scale_log2,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BEAMS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PREFIX_ONLY: tl.constexpr,
    ALIGNED_ROWS: tl.constexpr = False,
    DOT_FP32: tl.constexpr = False,
    PROMPT_FIRST: tl.constexpr = False,
    PROMPT_STAGES: tl.constexpr = 1,
    TAIL_STAGES: tl.constexpr = 1,
    TAIL_CORES: tl.constexpr = False,
    PROMPT_ONE_BLOCK: tl.constexpr = False,
    SHARED_ANCESTRY: tl.constexpr = False,
    SHARED_MIN_TAIL: tl.constexpr = 16,
    err_ptr=None,
    REPORT_ERRORS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid ``(R * num_beam_blocks, cdiv(Hkv, HEADS))``; arguments and element strides as the launchers
    in :mod:`triton_kernels.cascade` pass them; the module docstring gives the steps."""
    if PDL:  # launched as a programmatic dependent (triton_kernels.launch): wait before any load or store
        wait_for_prior_grids()
    BLOCK_M: tl.constexpr = BEAMS * GROUP_PAD
    TAIL_COLS: tl.constexpr = TAIL_BLOCK * BEAMS
    # The prompt first, and all of it one block (the launcher's PROMPT_ONE_BLOCK: the table fits
    # BLOCK_N): straight-line code with the tail's chain split around the prompt's loads.
    ONE_BLOCK_FIRST: tl.constexpr = PROMPT_ONE_BLOCK and PROMPT_FIRST and not PREFIX_ONLY and not TAIL_CORES
    pid = tl.program_id(0)
    req = pid // num_beam_blocks
    req64 = req.to(tl.int64)
    first_beam = (pid % num_beam_blocks) * BEAMS
    head0 = tl.program_id(1) * HEADS
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)

    # 1. What every head of the program shares: the prompt length and first prompt pages (table
    #    columns past the prompt hold valid pages; tokens past it are masked below), the rows, and
    #    the tail's first key block of pages, whose index chain is walked once for all heads.
    prompt_len_read = tl.load(prompt_lens_ptr + req64 * stride_plen_req)
    # Every position below counts from the prompt length: a negative one would index before the
    # buffers, one near 2^31 would wrap past them. Valid lengths (0 < P <= both bounds) pass unchanged;
    # the bound is the larger because the prefix stage alone passes max_seq_len 1.
    prompt_len = tl.minimum(tl.maximum(prompt_len_read, 0), tl.maximum(max_seq_len, prompt_capacity))
    prompt_end = tl.minimum(prompt_len, prompt_capacity)
    first_pages = tl.load(prompt_pt_ptr + req64 * stride_ppt_req + (n // page_size) * stride_ppt_col,
                          mask=n < prompt_capacity, other=-1)
    # Error bits (REPORT_ERRORS) are gathered in registers per program and ORed into the flag at its
    # end (flush_errors): integer work only on the path.
    plen_n = prompt_len_read + n * 0  # (a vector: the interpreter cannot `&` a scalar into a mask)
    prompt_err = (error_bits((n == 0) & ((plen_n < 0) | (plen_n > prompt_capacity)), PROMPT_LEN)
                  | error_bits((n < prompt_end) & ((first_pages < 0) | (first_pages >= num_pages)), PROMPT_PAGE))
    m = tl.arange(0, BLOCK_M)
    if TAIL_CORES:  # group-major rows (g * BEAMS + slot): the core tail's [G, BEAMS, D] state reshapes to them
        row_slot = m % BEAMS
        g = m // BEAMS
    else:
        row_slot = m // GROUP_PAD
        g = m % GROUP_PAD
    row_beam = first_beam + row_slot
    row_ok = (row_beam < beam_width) & (g < GROUP)
    row64 = req64 * beam_width + row_beam.to(tl.int64)

    if not PREFIX_ONLY and not TAIL_CORES:
        # Tail key-block columns: column c is position t0 + c // BEAMS of beam slot c % BEAMS.
        tc = tl.arange(0, TAIL_COLS)
        tcol_slot = tc % BEAMS
        tcol_beam = first_beam + tcol_slot
        tcol_ok = tcol_beam < beam_width
        tcol_row64 = req64 * beam_width + tcol_beam.to(tl.int64)
        tcol_step = tc // BEAMS
        tcol_cur = tl.load(kv_lens_ptr + tcol_row64, mask=tcol_ok, other=0) - 1  # this step's position
        # Earlier generated positions [P, tcol_gen_end) come from the cache, this step's from new_k/v.
        tcol_gen_end = tl.minimum(tcol_cur, max_seq_len)
        tail_stop = tl.max(tl.where(tcol_ok, tl.minimum(tcol_cur + 1, max_seq_len), 0), axis=0)
        # (one column per beam)
        tail_err = error_bits(tcol_ok & (tcol_step == 0) & kv_len_bad(tcol_cur, prompt_len, max_seq_len), KV_LEN)
        if WRITE_KV:
            # Where each beam writes this step's K/V: its own page at L - 1, requested next to the
            # tail's source beams.
            slot = tl.arange(0, BEAMS)
            slot_ok = first_beam + slot < beam_width
            slot_row64 = req64 * beam_width + (first_beam + slot).to(tl.int64)
            slot_cur = tl.load(kv_lens_ptr + slot_row64, mask=slot_ok, other=0) - 1
            w_ok, w_entry = _own_slot_entry(beam_pt_ptr, slot_row64, slot_cur, slot_ok, prompt_len, stride_bpt_row,
                                            stride_bpt_col, max_seq_len, page_size)
        if ONE_BLOCK_FIRST:
            # Only the chain's first link here (source beams); its second (pages) is requested after
            # the prompt block's K/V, so that it resolves behind them and the prompt's math.
            first_pos = prompt_len + tcol_step
            first_pos_ok = first_pos < tcol_gen_end
            first_src = tl.load(ci_ptr + req64 * stride_ci_req + tcol_beam.to(tl.int64) * stride_ci_beam
                                + first_pos.to(tl.int64) * stride_ci_pos, mask=first_pos_ok, other=0)
        else:
            first_tail_pages = _tail_block_pages(
                ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
                req64, beam_width, tcol_beam, prompt_len + tcol_step, tcol_gen_end, page_size, page_index_divisor,
                num_pages, REPORT_ERRORS,
            )
            if REPORT_ERRORS:
                tail_err |= page_error_bits(first_tail_pages.to(tl.int32))
        if WRITE_KV:
            w_ok, w_offs, write_err = _own_slot_offsets(w_ok, w_entry, slot_cur, page_index_divisor, num_pages,
                                                        page_size, stride_kv_page, stride_kv_slot)

    if TAIL_CORES and not PREFIX_ONLY:
        core_beam_err = tl.zeros([BEAMS], tl.int32)
        core_pos_err = tl.zeros([TAIL_BLOCK, BEAMS], tl.int32)
    for hh in range(HEADS):
        # A program past the last KV head (Hkv not a multiple of HEADS) repeats it and stores nothing
        # (masks through tl.where: the CPU interpreter cannot `&` a scalar into a mask).
        head_ok = head0 + hh < num_kv_heads
        kv_head = tl.minimum(head0 + hh, num_kv_heads - 1)
        kv_head_off = kv_head.to(tl.int64) * stride_kv_head
        q_head = kv_head * GROUP + g
        q = tl.load(q_ptr + row64[:, None] * stride_q_row + q_head[:, None] * stride_q_head + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if ONE_BLOCK_FIRST:
            # The prompt is one block: its K/V, then the tail's pages (source beams requested in
            # step 1), then the prompt's math while those pages arrive.
            # Written out, not through _prompt_block_kv: this order of the address arithmetic is the
            # sm_90 code timed on the H200; the helper's order compiles differently (8 fewer spilled
            # bytes) and has not been timed.
            tok_ok = (n < prompt_end) & (first_pages >= 0) & (first_pages < num_pages)
            p_offs = tl.where(tok_ok, first_pages, 0).to(tl.int64) * stride_kv_page + (n % page_size) * stride_kv_slot
            k_p = tl.load(kv_ptr + kv_head_off + p_offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
            v_p = tl.load(kv_ptr + kv_head_off + stride_kv_kv + p_offs[:, None] + d[None, :], mask=tok_ok[:, None],
                          other=0.0)
            first_tail_pages = pages_of_source_beams(
                first_src, first_pos, first_pos_ok, beam_pt_ptr, req64 * beam_width, stride_bpt_row, stride_bpt_col,
                beam_width, page_size, page_index_divisor, num_pages, REPORT_ERRORS).to(tl.int64)
            if REPORT_ERRORS:
                tail_err |= page_error_bits(first_tail_pages.to(tl.int32))
            m_i, l_i, acc = _fold_prompt_block(q, k_p, v_p, n, prompt_end, qk_scale_log2, m_i, l_i, acc, DOT_FP32)
        elif PROMPT_FIRST:  # the tail's index chain, requested at the start, resolves behind the prompt
            m_i, l_i, acc, blocks_err = _prompt_blocks(
                q, m_i, l_i, acc, kv_ptr, kv_head_off, prompt_pt_ptr, req64, stride_ppt_req, stride_ppt_col,
                stride_kv_page, stride_kv_kv, stride_kv_slot, first_pages, prompt_end, page_size, num_pages,
                qk_scale_log2, HEAD_DIM, BLOCK_N, PROMPT_STAGES, DOT_FP32, REPORT_ERRORS)
            prompt_err |= blocks_err

        if TAIL_CORES and not PREFIX_ONLY:
            m_i, l_i, acc, beam_err, pos_err = _tail_on_cores(
                q_ptr, new_k_ptr, new_v_ptr, kv_ptr, beam_pt_ptr, kv_lens_ptr, ci_ptr, stride_q_row, stride_q_head,
                stride_new_k_row, stride_new_k_head, stride_new_v_row, stride_new_v_head, stride_kv_page,
                stride_kv_kv, stride_kv_slot, stride_bpt_row, stride_bpt_col, stride_ci_req, stride_ci_beam,
                stride_ci_pos, req64, first_beam, beam_width, kv_head, kv_head_off, head_ok, prompt_len, page_size,
                page_index_divisor, num_pages, max_seq_len, qk_scale_log2, GROUP, GROUP_PAD, BEAMS, HEAD_DIM,
                TAIL_BLOCK, WRITE_KV, REPORT_ERRORS)
            core_beam_err |= beam_err
            core_pos_err |= pos_err
        elif not PREFIX_ONLY:
            # 2. The generated positions [P, L), TAIL_BLOCK per key block, this step's token
            #    included: its column reads new_k/new_v instead of the cache (a 4-token tail is one
            #    key block). The next block's pages are requested before this block's K/V are
            #    consumed. Device-side bounds: no tail-length limit, one CUDA-graph capture for
            #    every tail length. Then this step's K/V go to each beam's own page.
            # The run of positions from P that every beam of the tile reads from one ancestor is attended
            # once for the tile after the KV write; the per-beam key blocks start after it. Looked for
            # only in a tail of SHARED_MIN_TAIL cached positions or more, and here, where the prompt's
            # loads are out and the lengths in hand: a branch on them in step 1 delayed every later load
            # (B-short 33.4-33.7 against 31.7 us, docs/rounds.md, "The twenty-seventh round").
            shared_len = prompt_len * 0
            if SHARED_ANCESTRY:
                if (prompt_len >= 0) & (tail_stop - 1 - prompt_len >= SHARED_MIN_TAIL):
                    shared_stop = tl.min(tl.where(tcol_ok, tcol_gen_end, max_seq_len), axis=0)
                    # (a beam's kv_len below its prompt, which the flag reports, must not start the walk before P)
                    shared_stop = tl.maximum(shared_stop, prompt_len)
                    shared_len = shared_ancestry_len(ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, req64,
                                                     first_beam, beam_width, prompt_len, shared_stop, BEAMS,
                                                     SHARED_SCAN)
                    if shared_len > 0:
                        first_tail_pages = _tail_block_pages(
                            ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row,
                            stride_bpt_col, req64, beam_width, tcol_beam, prompt_len + shared_len + tcol_step,
                            tcol_gen_end, page_size, page_index_divisor, num_pages, REPORT_ERRORS)
                        if REPORT_ERRORS:
                            tail_err |= page_error_bits(first_tail_pages.to(tl.int32))
            tcol_new_k = new_k_ptr + tcol_row64 * stride_new_k_row + kv_head * stride_new_k_head
            tcol_new_v = new_v_ptr + tcol_row64 * stride_new_v_row + kv_head * stride_new_v_head
            m_i, l_i, acc, blocks_err = _tail_key_blocks(
                q, m_i, l_i, acc, prompt_len + shared_len, first_tail_pages, kv_ptr, kv_head_off, tcol_new_k,
                tcol_new_v, tcol_step, tcol_cur, tcol_ok, tcol_slot, tcol_beam, tcol_gen_end, row_slot, tail_stop,
                ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
                req64, beam_width, page_size, page_index_divisor, num_pages, stride_kv_page, stride_kv_kv,
                stride_kv_slot, qk_scale_log2, HEAD_DIM, TAIL_BLOCK, TAIL_STAGES, ALIGNED_ROWS, DOT_FP32, REPORT_ERRORS)
            tail_err |= blocks_err

            if WRITE_KV:  # loaded here, not before the tail: the tail's current-token column cached these rows
                k_new = tl.load(new_k_ptr + slot_row64[:, None] * stride_new_k_row + kv_head * stride_new_k_head
                                + d[None, :], mask=slot_ok[:, None], other=0.0)
                v_new = tl.load(new_v_ptr + slot_row64[:, None] * stride_new_v_row + kv_head * stride_new_v_head
                                + d[None, :], mask=slot_ok[:, None], other=0.0)
                w_mask = tl.where(head_ok, w_ok, False)[:, None]
                w_ptrs = kv_ptr + (w_offs + kv_head_off)[:, None] + d[None, :]
                tl.store(w_ptrs, k_new, mask=w_mask)
                tl.store(w_ptrs + stride_kv_kv, v_new, mask=w_mask)

            if SHARED_ANCESTRY:
                # The shared run [P, P + shared_len) as dense key blocks. Last, where the tail's column
                # state is dead: held through it, that state spilled.
                if shared_len > 0:
                    m_i, l_i, acc, shared_err = _shared_ancestry_blocks(
                        q, m_i, l_i, acc, kv_ptr, kv_head_off,
                        ci_ptr + req64 * stride_ci_req + first_beam.to(tl.int64) * stride_ci_beam, stride_ci_pos,
                        beam_pt_ptr, req64 * beam_width, stride_bpt_row, stride_bpt_col, beam_width, prompt_len,
                        prompt_len + shared_len, page_size, page_index_divisor, num_pages, stride_kv_page,
                        stride_kv_kv, stride_kv_slot, qk_scale_log2, HEAD_DIM, SHARED_BLOCK, DOT_FP32, REPORT_ERRORS)
                    tail_err |= shared_err

        # 3. The shared prompt, once for every row of the tile (before the tail with PROMPT_FIRST).
        if not PROMPT_FIRST:
            m_i, l_i, acc, blocks_err = _prompt_blocks(
                q, m_i, l_i, acc, kv_ptr, kv_head_off, prompt_pt_ptr, req64, stride_ppt_req, stride_ppt_col,
                stride_kv_page, stride_kv_kv, stride_kv_slot, first_pages, prompt_end, page_size, num_pages,
                qk_scale_log2, HEAD_DIM, BLOCK_N, PROMPT_STAGES, DOT_FP32, REPORT_ERRORS)
            prompt_err |= blocks_err

        # 4. out = O / l. l >= 1 for every valid row of the whole step (its own current token is a
        #    finite column); the guard keeps invalid input (kv_len <= prompt_len, empty prompt) and
        #    an empty prompt in the prompt pass finite. The prompt pass also stores its base-2 LSE
        #    (-inf for an empty prompt: the tail kernel's "no prefix").
        out_offs = row64[:, None] * stride_out_row + q_head[:, None] * stride_out_head + d[None, :]
        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        store_ok = tl.where(head_ok, row_ok, False)
        if PREFIX_ONLY:
            tl.store(lse_ptr + row64 * stride_lse_row + q_head * stride_lse_head,
                     tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=store_ok)
        # One division per row and a multiply per element (a division per element costs ~10x).
        inv_l = 1.0 / l_safe
        tl.store(out_ptr + out_offs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=store_ok[:, None])

    # 5. The error bits gathered on the way, after every load and store (REPORT_ERRORS).
    if REPORT_ERRORS:
        flush_errors(err_ptr, prompt_err)
        if TAIL_CORES and not PREFIX_ONLY:
            flush_errors(err_ptr, core_beam_err)
            flush_errors(err_ptr, core_pos_err)
        elif not PREFIX_ONLY:
            flush_errors(err_ptr, tail_err)
            if WRITE_KV:
                flush_errors(err_ptr, write_err)
