"""The fused tail kernel: KV write, gather through ``cache_indirection``, attention and LSE merge.

This is the ``[QH, D]``-tile kernel, the default at G = 4 (one KV head per 1-warp program) and for
groups the grouped kernel does not serve (:mod:`triton_kernels.tail_merge_grouped_kernel`, the
default at G = 2; :func:`triton_kernels.tail_merge.tail_launch_config` picks).

One program handles one beam row and a block of ``KV_HEADS_PER_PROG`` KV heads. Its query heads
are laid out as ``QH = KV_HEADS_PER_PROG * GROUP_PAD`` query slots (slot ``s`` serves KV head
``s // GROUP_PAD``, query head ``kv_head * GROUP + s % GROUP_PAD``), so the whole tile is a plain
``[QH, D]`` block. Non-power-of-two groups (3, 5, 6, 12) are padded to ``GROUP_PAD`` and the
padding slots are masked: they load zeros, and nothing is stored for them.

Why a row and several KV heads per program: the index work of a tail position (its source beam in
``cache_indirection``, then its page in the page table) is the same for every head of the row, and
small tails (1-8 tokens) are the common case, so that chain of dependent loads is paid once for
many heads rather than once per head. The K/V row of a KV head is loaded through the pointers of
each of its ``G`` slots; the duplicates are the same addresses within one program, served by L1,
so DRAM traffic stays one read per K/V row (but the loads, conversions and index work repeat per
slot: what the grouped kernel removes).

Per program, in order (everything that does not depend on the tail is loaded up front, so its
latency overlaps the index chain of step 3):

1. The prefix state ``(o_p, lse_p)`` seeds the online softmax as ``(acc, m, l) = (o_p, lse_p, 1)``,
   which represents the prefix's scores exactly, so merging by LSE is the softmax's own rescaling
   and needs no separate step. ``lse_p`` is read through strides and scaled to base 2 (FlashInfer's
   ``[rows, heads]`` log2 or FA4's ``[heads, rows]`` ln); ``lse_p = -inf`` (empty prefix) gets
   weight 0 and its ``o_p`` is ignored, even if it is NaN.
2. The current token (position ``kv_len - 1``) from ``new_k``/``new_v``, held in registers. Its
   score is finite, so ``m`` is finite from then on and ``l >= 1`` (the term at the running max adds
   2^0). It is also written to the row's own page (``WRITE_KV``). ``cache_indirection`` at
   ``kv_len - 1`` is never read.
3. The earlier generated positions ``[prompt_len, kv_len - 1)``, read from device memory, in blocks
   of ``BLOCK_T`` tokens: one vector load of their source beams, one of their page-table entries,
   then one load each of the ``BLOCK_T x QH x D`` K and V tiles. A loop with device-side bounds,
   so one CUDA-graph capture serves every tail length. With ``INDEX_BLOCK > 0`` the source beams
   and page entries of ``INDEX_BLOCK`` positions are loaded as two vectors per index block (the
   first block's together with q and the prefix state), each tile's page is picked from those
   registers, and the next K/V tile is requested before the current one is consumed: the
   dependent chain is lengths -> beams -> pages -> K/V per index block instead of three loads per
   tile. ``INDEX_BLOCK == 0`` keeps the tile-at-a-time chain (for comparison).
4. ``out = acc / l`` in the output dtype.

Scores are in base 2: ``q`` is pre-multiplied by ``sm_scale * log2(e)`` so ``exp2`` is exact
softmax. Page numbers and every pool offset are int64 (pools can exceed 2^31 elements). Indices
that would leave the pool (a page outside ``[0, num_pages)``, a source beam outside ``[0, W)``,
a position past ``max_seq_len``) are masked rather than dereferenced: the kernel never reads or
writes outside its buffers. Such values are bugs upstream; check mode reports them by name, and
with ``REPORT_ERRORS`` the kernel ORs one bit per kind into ``err_ptr[0]`` without a sync
(:mod:`triton_kernels.device_errors`).
"""

import triton
import triton.language as tl

from .beam_index import source_beam_pages
from .device_errors import KV_LEN, PROMPT_LEN, WRITE_PAGE, error_bits, flush_errors, kv_len_bad, or_reduce, page_error_bits
from .grid_dependency import wait_for_prior_grids

__all__ = ["beam_tail_merge_kernel"]


# One block of tail tokens is a K/V tile load (:func:`_load_kv_tile`) and an online-softmax update
# (:func:`_attend_tile`); the index-block path issues the next tile's load before the current update.
# TOKENS_OUTER picks the orientation of the K/V tile. Triton's coalescing pass breaks the tie between
# the two non-contiguous tile dims differently across versions, and the orientation whose thread
# layout matches the [QH, D] tiles (q, acc) avoids shared-memory layout conversions and replicated
# registers: measured with ptxas for sm_90 (16/8 heads, D 128, BLOCK_T 2, 4 warps), heads-outer
# takes 88 registers on Triton 3.6 vs 128 tokens-outer; on Triton 3.9, 128 vs 80.


@triton.jit
def _load_kv_tile(kv_ptr, stride_kv_kv, tok_offs, tok_ok, kv_head_offs, kv_head_ok, d, TOKENS_OUTER: tl.constexpr):
    """Raw K and V tiles, ``[BLOCK_T, QH, D]`` (TOKENS_OUTER) or ``[QH, BLOCK_T, D]``; masked lanes load 0."""
    if TOKENS_OUTER:
        kv_offs = tok_offs[:, None, None] + kv_head_offs[None, :, None] + d[None, None, :]
        kv_mask = tok_ok[:, None, None] & kv_head_ok[None, :, None]
    else:
        kv_offs = tok_offs[None, :, None] + kv_head_offs[:, None, None] + d[None, None, :]
        kv_mask = tok_ok[None, :, None] & kv_head_ok[:, None, None]
    k = tl.load(kv_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(kv_ptr + stride_kv_kv + kv_offs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_raw, v_raw, tok_ok, TOKENS_OUTER: tl.constexpr):
    """Online-softmax update with loaded K/V tiles (layout as in :func:`_load_kv_tile`); returns ``(m, l, acc)``."""
    k = k_raw.to(tl.float32)
    v = v_raw.to(tl.float32)
    if TOKENS_OUTER:
        s = tl.where(tok_ok[:, None], tl.sum(q[None, :, :] * k, axis=2), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_new = l_i * alpha + tl.sum(p, axis=0)
        acc_new = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=0)
    else:
        s = tl.where(tok_ok[None, :], tl.sum(q[:, None, :] * k, axis=2), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_new = l_i * alpha + tl.sum(p, axis=1)
        acc_new = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
    return m_new, l_new, acc_new


@triton.jit
def _pick_lanes(lane_values, lane, first, BLOCK_T: tl.constexpr):
    """``lane_values[first + i]`` for ``i < BLOCK_T`` (``[BLOCK_T]`` int32), ``-1`` where no lane matches.

    ``lane_values`` (``[INDEX_BLOCK]`` int32, ``>= -1``) stays spread over the program's threads, one
    lane per thread; each pick is a masked sum over that 1-D vector to a scalar. (A 2-D
    ``[BLOCK_T, INDEX_BLOCK]`` compare-and-sum let the compiler replicate the whole index vector,
    and its loads' addresses, into every thread: about 5 registers per lane at sm_90.)
    """
    tok = tl.arange(0, BLOCK_T)
    picked = tl.full([BLOCK_T], -1, tl.int32)
    for i in tl.static_range(BLOCK_T):
        value = tl.sum(tl.where(lane == first + i, lane_values + 1, 0), axis=0) - 1
        picked = tl.where(tok == i, value, picked)
    return picked


@triton.jit
def _load_lane_tile(
    kv_ptr, stride_kv_kv, stride_kv_page, stride_kv_slot, lane_page, lane, first, t, page_size, kv_head_offs,
    kv_head_ok, d, BLOCK_T: tl.constexpr, TOKENS_OUTER: tl.constexpr,
):
    """The K/V tile of positions ``t`` (``[BLOCK_T]``) whose pages are lanes ``first + i`` of an index
    block's ``lane_page``: ``(tok_ok, k, v)``, tiles as in :func:`_load_kv_tile`."""
    page = _pick_lanes(lane_page, lane, first, BLOCK_T)
    tok_ok = page >= 0
    tok_offs = page.to(tl.int64) * stride_kv_page + (t % page_size).to(tl.int64) * stride_kv_slot
    k, v = _load_kv_tile(kv_ptr, stride_kv_kv, tok_offs, tok_ok, kv_head_offs, kv_head_ok, d, TOKENS_OUTER)
    return tok_ok, k, v


@triton.jit
def beam_tail_merge_kernel(
    q_ptr,
    new_k_ptr,
    new_v_ptr,
    kv_ptr,
    page_table_ptr,
    kv_lens_ptr,
    prompt_lens_ptr,
    cache_indirection_ptr,
    prefix_out_ptr,
    prefix_lse_ptr,
    out_ptr,
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
    stride_pt_row,
    stride_pt_col,
    stride_ind_req,
    stride_ind_beam,
    stride_ind_pos,
    stride_po_row,
    stride_po_head,
    stride_lse_row,
    stride_lse_head,
    stride_out_row,
    stride_out_head,
    beam_width,
    page_size: tl.constexpr,
    page_index_divisor: tl.constexpr,
    num_pages,
    max_seq_len,
    num_kv_heads,
    qk_scale_log2,
    lse_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    KV_HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WRITE_KV: tl.constexpr,
    TOKENS_OUTER: tl.constexpr,
    INDEX_BLOCK: tl.constexpr = 0,
    err_ptr=None,
    REPORT_ERRORS: tl.constexpr = False,
    tail_skip_ptr=None,
    SKIP_SHARED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid ``(rows, cdiv(Hkv, KV_HEADS_PER_PROG))``; arguments and strides (in elements) as the launcher
    :func:`triton_kernels.beam_tail_attention_merge` passes them; the module docstring gives the steps."""
    if PDL:  # launched as a programmatic dependent (triton_kernels.launch): wait before any load or store
        wait_for_prior_grids()
    QH: tl.constexpr = KV_HEADS_PER_PROG * GROUP_PAD
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    head_block = tl.program_id(1)

    slot = tl.arange(0, QH)
    g = slot % GROUP_PAD
    kv_head = head_block * KV_HEADS_PER_PROG + slot // GROUP_PAD
    q_head = kv_head * GROUP + g
    kv_head_ok = kv_head < num_kv_heads
    q_head_ok = kv_head_ok & (g < GROUP)
    d = tl.arange(0, HEAD_DIM)

    kv_len = tl.load(kv_lens_ptr + row)
    prompt_len = tl.load(prompt_lens_ptr + row)
    cur = kv_len - 1
    req = row // beam_width
    beam = row % beam_width
    ind_row_ptr = cache_indirection_ptr + req.to(tl.int64) * stride_ind_req + beam.to(tl.int64) * stride_ind_beam
    first_src_row = req.to(tl.int64) * beam_width
    tok = tl.arange(0, BLOCK_T)
    end_pos = tl.minimum(cur, max_seq_len)
    # The walk stays inside [0, end_pos]: a negative prompt length would index before the buffers, and a
    # length or skip near 2^31 would wrap start_pos + lane past them. Valid input passes unchanged.
    gen_stop = tl.maximum(end_pos, 0)
    start_pos = tl.minimum(tl.maximum(prompt_len, 0), gen_stop)
    if SKIP_SHARED:  # the shared-run stage attended [P, P + skip) and merged it into the prefix state
        start_pos += tl.minimum(tl.maximum(tl.load(tail_skip_ptr + row), 0), gen_stop - start_pos)
    kv_head_offs = kv_head * stride_kv_head
    # Per-slot copies of the scalar position keep every mask a vector (the interpreter rejects
    # scalar-and-vector boolean masks); only the g == 0 slot of each KV head stores. A position
    # inside the prompt (kv_len <= prompt_len, invalid input) is never written: prompt pages are
    # shared by all beams of the request.
    cur_slots = cur + slot * 0
    w_ok = kv_head_ok & (g == 0) & (cur_slots >= prompt_len) & (cur_slots >= 0) & (cur_slots < max_seq_len)
    if REPORT_ERRORS:  # gathered here, ORed into the flag at the end
        err = (error_bits((slot == 0) & kv_len_bad(cur_slots, prompt_len, max_seq_len), KV_LEN)
               | error_bits((slot == 0) & (prompt_len + slot * 0 < 0), PROMPT_LEN))

    if INDEX_BLOCK > 0:
        # Index-block path: the loads that depend only on the lengths (the write position's page
        # entry, the first index block's source beams) go out in the same wave as q and the prefix
        # state, and the first K/V tile is requested before any of them is consumed, so the
        # dependent chain up to the first tile is lengths -> source beams -> page entries -> K/V.
        if WRITE_KV:
            w_entry = tl.load(
                page_table_ptr + row64 * stride_pt_row + (cur_slots // page_size) * stride_pt_col,
                mask=w_ok,
                other=-1,
            )
        lane = tl.arange(0, INDEX_BLOCK)
        lane_pos = start_pos + lane
        lane_page = source_beam_pages(
            ind_row_ptr + lane_pos.to(tl.int64) * stride_ind_pos, lane_pos, lane_pos < end_pos, page_table_ptr,
            first_src_row, stride_pt_row, stride_pt_col, beam_width, page_size, page_index_divisor, num_pages,
            REPORT_ERRORS,
        )
        if REPORT_ERRORS:
            lane_err = page_error_bits(lane_page)

    q_offs = row64 * stride_q_row + q_head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_head_ok[:, None], other=0.0)
    k_cur_raw = tl.load(
        new_k_ptr + row64 * stride_new_k_row + kv_head[:, None] * stride_new_k_head + d[None, :],
        mask=kv_head_ok[:, None],
        other=0.0,
    )
    v_cur_raw = tl.load(
        new_v_ptr + row64 * stride_new_v_row + kv_head[:, None] * stride_new_v_head + d[None, :],
        mask=kv_head_ok[:, None],
        other=0.0,
    )
    lse_prefix = tl.load(
        prefix_lse_ptr + row64 * stride_lse_row + q_head * stride_lse_head, mask=q_head_ok, other=float("-inf")
    )
    o_prefix = tl.load(
        prefix_out_ptr + row64 * stride_po_row + q_head[:, None] * stride_po_head + d[None, :],
        mask=q_head_ok[:, None],
        other=0.0,
    )

    if INDEX_BLOCK > 0:
        # The first tile of the first index block (masked off for an empty tail).
        tok_ok, k_tile, v_tile = _load_lane_tile(
            kv_ptr, stride_kv_kv, stride_kv_page, stride_kv_slot, lane_page, lane, 0, start_pos + tok, page_size,
            kv_head_offs, kv_head_ok, d, BLOCK_T, TOKENS_OUTER,
        )

    # 1. The prefix state seeds the online softmax: (m, l, acc) = (lse_p, 1, o_p) stands for the
    #    prefix's scores exactly (sum_j 2^(s_j - lse_p) = 1), so the LSE merge is the softmax's
    #    own rescaling. An empty prefix (lse_p = -inf) gets weight 2^(-inf - m) = 0 at the first
    #    rescale; its o_p is replaced by 0 so that even a NaN there cannot leak (NaN * 0 = NaN).
    m_i = lse_prefix * lse_scale
    l_i = tl.full([QH], 1.0, dtype=tl.float32)
    acc = tl.where((m_i > float("-inf"))[:, None], o_prefix.to(tl.float32), 0.0)

    # 2. The current token, from registers. Its score is finite, so m is finite from here on.
    q = q.to(tl.float32) * qk_scale_log2
    s_cur = tl.sum(q * k_cur_raw.to(tl.float32), axis=1)
    m_new = tl.maximum(m_i, s_cur)
    alpha = tl.exp2(m_i - m_new)
    p_cur = tl.exp2(s_cur - m_new)
    l_i = l_i * alpha + p_cur
    acc = acc * alpha[:, None] + p_cur[:, None] * v_cur_raw.to(tl.float32)
    m_i = m_new

    if WRITE_KV:
        if INDEX_BLOCK == 0:
            w_entry = tl.load(
                page_table_ptr + row64 * stride_pt_row + (cur_slots // page_size) * stride_pt_col,
                mask=w_ok,
                other=-1,
            )
        w_page = (w_entry // page_index_divisor).to(tl.int64)  # int32 division: entries are >= 0 when used
        entry_ok = (w_entry >= 0) & (w_page < num_pages)
        if REPORT_ERRORS:
            err |= error_bits(w_ok & ~entry_ok, WRITE_PAGE)
        w_ok = w_ok & entry_ok
        w_offs = (
            w_page[:, None] * stride_kv_page
            + (cur_slots % page_size).to(tl.int64)[:, None] * stride_kv_slot
            + kv_head[:, None] * stride_kv_head
            + d[None, :]
        )
        tl.store(kv_ptr + w_offs, k_cur_raw, mask=w_ok[:, None])
        tl.store(kv_ptr + stride_kv_kv + w_offs, v_cur_raw, mask=w_ok[:, None])

    # 3. Earlier generated positions [prompt_len, kv_len - 1), gathered through cache_indirection.
    if INDEX_BLOCK > 0:
        # Outer loop: INDEX_BLOCK positions whose pages sit in registers (lane_page). Inner loop:
        # BLOCK_T tokens per tile, the next tile's K/V requested before this one is consumed, so
        # the K/V loads of successive tiles overlap instead of forming a chain. Both loops have
        # device-side bounds (no tail-length bound).
        for ib_start in range(start_pos, end_pos, INDEX_BLOCK):
            if ib_start > start_pos:  # the first block's pages and tile were loaded up front
                lane_pos = ib_start + lane
                lane_page = source_beam_pages(
                    ind_row_ptr + lane_pos.to(tl.int64) * stride_ind_pos, lane_pos, lane_pos < end_pos,
                    page_table_ptr, first_src_row, stride_pt_row, stride_pt_col, beam_width, page_size,
                    page_index_divisor, num_pages, REPORT_ERRORS,
                )
                if REPORT_ERRORS:
                    lane_err |= page_error_bits(lane_page)
                tok_ok, k_tile, v_tile = _load_lane_tile(
                    kv_ptr, stride_kv_kv, stride_kv_page, stride_kv_slot, lane_page, lane, 0, ib_start + tok,
                    page_size, kv_head_offs, kv_head_ok, d, BLOCK_T, TOKENS_OUTER,
                )
            ib_end = tl.minimum(ib_start + INDEX_BLOCK, end_pos)
            for block_start in range(ib_start, ib_end, BLOCK_T):
                # Lanes past the index block (or the tail) pick -1: the last prefetch is masked off.
                next_ok, k_next, v_next = _load_lane_tile(
                    kv_ptr, stride_kv_kv, stride_kv_page, stride_kv_slot, lane_page, lane,
                    block_start + BLOCK_T - ib_start, block_start + BLOCK_T + tok, page_size, kv_head_offs,
                    kv_head_ok, d, BLOCK_T, TOKENS_OUTER,
                )
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_tile, v_tile, tok_ok, TOKENS_OUTER)
                k_tile = k_next
                v_tile = v_next
                tok_ok = next_ok
    else:
        # (a scalar: a [BLOCK_T] vector carried through this loop spilled with Triton 3.9)
        tile_err = or_reduce(tl.zeros([BLOCK_T], tl.int32))
        for block_start in range(start_pos, end_pos, BLOCK_T):
            t = block_start + tok
            page = source_beam_pages(
                ind_row_ptr + t.to(tl.int64) * stride_ind_pos, t, t < end_pos, page_table_ptr, first_src_row,
                stride_pt_row, stride_pt_col, beam_width, page_size, page_index_divisor, num_pages,
                REPORT_ERRORS,
            )
            if REPORT_ERRORS:
                tile_err |= or_reduce(page_error_bits(page))
            tok_ok = page >= 0
            tok_offs = page.to(tl.int64) * stride_kv_page + (t % page_size).to(tl.int64) * stride_kv_slot
            k_tile, v_tile = _load_kv_tile(
                kv_ptr, stride_kv_kv, tok_offs, tok_ok, kv_head_offs, kv_head_ok, d, TOKENS_OUTER
            )
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_tile, v_tile, tok_ok, TOKENS_OUTER)

    # 4. Normalise: l >= 1, since the term (prefix or token) that set the running max adds 2^0.
    out_offs = row64 * stride_out_row + q_head[:, None] * stride_out_head + d[None, :]
    inv_l = 1.0 / l_i  # one division per row, a multiply per element
    tl.store(out_ptr + out_offs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=q_head_ok[:, None])
    if REPORT_ERRORS:
        flush_errors(err_ptr, err)
        if INDEX_BLOCK > 0:
            flush_errors(err_ptr, lane_err)
        else:
            tl.atomic_or(err_ptr, tile_err, mask=tile_err != 0, sem="relaxed")
