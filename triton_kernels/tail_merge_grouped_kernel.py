"""The fused tail kernel with the GQA group in each thread's registers (the default at G = 2).

Same contract, arguments and steps as :func:`triton_kernels.tail_merge_kernel.beam_tail_merge_kernel`
(prefix state seeds the online softmax; this step's token from registers, also written to the
row's own page; earlier generated positions gathered through ``cache_indirection``; normalise).
One program handles one beam row and ``KV_HEADS_PER_PROG`` KV heads; the difference is the tile.

Why: in the ``[QH, D]`` kernel each query head has its own threads, so a KV head's K/V row is
loaded, converted to float32 and indexed once per query head of its group (G times), and every warp
walks the tail's index chain. Here the queries are a 3-D ``[GROUP_PAD, KVH, D]`` block and each K/V
row a ``[1, KVH, D]`` block in the same blocked layout, so ``q * k`` broadcasts the row over the
group in registers. The launcher picks ``num_warps`` so that one pass of the threads covers
``[1, KVH, D]`` (16-byte vectors along ``D``): Triton's blocked layout then places the leftover
``GROUP_PAD`` dimension in each thread's registers, and each thread holds all query heads of its KV
head. At G = 2 on sm_90 that is 280 warp-instructions per KV head of a row against 494
(``docs/rounds.md``, "The sixth round"). With more warps than that, the group spreads over
warps again: still correct, no longer deduplicated.

Tail positions are walked one per iteration (a ``[1]`` vector keeps the interpreter's masks
vectors); page numbers and pool offsets are int64; indices that would leave a buffer are masked,
never dereferenced (:func:`triton_kernels.beam_index.source_beam_pages`).
"""

import triton
import triton.language as tl

from .beam_index import source_beam_pages
from .device_errors import KV_LEN, PROMPT_LEN, WRITE_PAGE, error_bits, flush_errors, kv_len_bad, page_error_bits
from .grid_dependency import wait_for_prior_grids

__all__ = ["beam_tail_merge_grouped_kernel", "attend_grouped_row", "online_softmax_row"]


@triton.jit
def online_softmax_row(m_i, l_i, acc, s, v_raw):
    """Online-softmax update of the ``[G, KVH]`` state (``m_i``, ``l_i`` base 2; ``acc`` ``[G, KVH, D]``
    float32) with one key/value row per KV head: its scores ``s`` (``[G, KVH]``, base 2, ``-inf`` where
    masked) and values ``v_raw`` (``[1, KVH, D]``, raw dtype)."""
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_new = l_i * alpha + p
    acc_new = acc * alpha[:, :, None] + p[:, :, None] * v_raw.to(tl.float32)
    return m_new, l_new, acc_new


@triton.jit
def attend_grouped_row(q, m_i, l_i, acc, k_raw, v_raw, ok):
    """Online-softmax update with one key/value row per KV head (``[1, KVH, D]``, raw dtype) for the
    ``[G, KVH, D]`` queries (``q`` float32, pre-scaled to base 2); ``ok`` (``[1, KVH]``) masks the row.
    The cascade kernel's core tail calls it with beams in place of KV heads for this step's token."""
    s = tl.where(ok, tl.sum(q * k_raw.to(tl.float32), axis=2), float("-inf"))
    return online_softmax_row(m_i, l_i, acc, s, v_raw)


@triton.jit
def beam_tail_merge_grouped_kernel(
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
    WRITE_KV: tl.constexpr,
    err_ptr=None,
    REPORT_ERRORS: tl.constexpr = False,
    tail_skip_ptr=None,
    SKIP_SHARED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid ``(rows, cdiv(Hkv, KV_HEADS_PER_PROG))``; arguments as for ``beam_tail_merge_kernel``."""
    if PDL:  # launched as a programmatic dependent (triton_kernels.launch): wait before any load or store
        wait_for_prior_grids()
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    gq = tl.arange(0, GROUP_PAD)
    kv_head = tl.program_id(1) * KV_HEADS_PER_PROG + tl.arange(0, KV_HEADS_PER_PROG)
    d = tl.arange(0, HEAD_DIM)
    kv_head_ok = kv_head < num_kv_heads  # [KVH]
    q_head = kv_head[None, :] * GROUP + gq[:, None]  # [G, KVH]
    q_ok = kv_head_ok[None, :] & (gq[:, None] < GROUP)

    kv_len = tl.load(kv_lens_ptr + row)
    prompt_len = tl.load(prompt_lens_ptr + row)
    cur = kv_len - 1
    req = row // beam_width
    beam = row % beam_width
    ind_row_ptr = cache_indirection_ptr + req.to(tl.int64) * stride_ind_req + beam.to(tl.int64) * stride_ind_beam
    first_src_row = req.to(tl.int64) * beam_width
    end_pos = tl.minimum(cur, max_seq_len)
    # The walk stays inside [0, end_pos]: a negative prompt length would index before the buffers, and a
    # length or skip near 2^31 would wrap start_pos + lane past them. Valid input passes unchanged.
    gen_stop = tl.maximum(end_pos, 0)
    start_pos = tl.minimum(tl.maximum(prompt_len, 0), gen_stop)
    if SKIP_SHARED:  # the shared-run stage attended [P, P + skip) and merged it into the prefix state
        start_pos += tl.minimum(tl.maximum(tl.load(tail_skip_ptr + row), 0), gen_stop - start_pos)
    # K/V rows are [1, KVH, D] blocks: the same layout as the [G, KVH, D] queries, broadcast over G.
    kv_head_offs = (kv_head * stride_kv_head)[None, :, None] + d[None, None, :]
    kv_row_ok = kv_head_ok[None, :, None]

    q = tl.load(q_ptr + row64 * stride_q_row + q_head[:, :, None] * stride_q_head + d[None, None, :],
                mask=q_ok[:, :, None], other=0.0)
    k_cur = tl.load(new_k_ptr + row64 * stride_new_k_row + (kv_head * stride_new_k_head)[None, :, None]
                    + d[None, None, :], mask=kv_row_ok, other=0.0)
    v_cur = tl.load(new_v_ptr + row64 * stride_new_v_row + (kv_head * stride_new_v_head)[None, :, None]
                    + d[None, None, :], mask=kv_row_ok, other=0.0)
    lse_prefix = tl.load(prefix_lse_ptr + row64 * stride_lse_row + q_head * stride_lse_head, mask=q_ok,
                         other=float("-inf"))
    o_prefix = tl.load(prefix_out_ptr + row64 * stride_po_row + q_head[:, :, None] * stride_po_head
                       + d[None, None, :], mask=q_ok[:, :, None], other=0.0)

    # 1. The prefix state seeds the online softmax (see beam_tail_merge_kernel): (m, l, acc) =
    #    (lse_p, 1, o_p), an empty prefix (lse_p = -inf) weighted 0 and its o_p never read.
    m_i = lse_prefix * lse_scale
    l_i = tl.full([GROUP_PAD, KV_HEADS_PER_PROG], 1.0, dtype=tl.float32)
    acc = tl.where((m_i > float("-inf"))[:, :, None], o_prefix.to(tl.float32), 0.0)

    # 2. This step's token, from registers: its score is finite, so m is finite from here on.
    q = q.to(tl.float32) * qk_scale_log2
    m_i, l_i, acc = attend_grouped_row(q, m_i, l_i, acc, k_cur, v_cur, (kv_head >= 0)[None, :])  # never masked

    if REPORT_ERRORS:  # gathered here, ORed into the flag at the end
        err = error_bits((tl.arange(0, KV_HEADS_PER_PROG) == 0) & kv_len_bad(cur + kv_head * 0, prompt_len, max_seq_len),
                         KV_LEN)
        tail_err = error_bits(prompt_len + tl.zeros([1], tl.int32) < 0, PROMPT_LEN)
    if WRITE_KV:
        # A position inside the prompt (kv_len <= prompt_len, invalid input) is never written.
        cur_h = cur + kv_head * 0
        w_ok = kv_head_ok & (cur_h >= prompt_len) & (cur_h >= 0) & (cur_h < max_seq_len)
        w_entry = tl.load(page_table_ptr + row64 * stride_pt_row + (cur_h // page_size) * stride_pt_col, mask=w_ok,
                          other=-1)
        w_page = (w_entry // page_index_divisor).to(tl.int64)
        entry_ok = (w_entry >= 0) & (w_page < num_pages)
        if REPORT_ERRORS:
            err |= error_bits(w_ok & ~entry_ok, WRITE_PAGE)
        w_ok = w_ok & entry_ok
        w_offs = (w_page * stride_kv_page + (cur_h % page_size).to(tl.int64) * stride_kv_slot)[None, :, None] \
            + kv_head_offs
        tl.store(kv_ptr + w_offs, k_cur, mask=w_ok[None, :, None])
        tl.store(kv_ptr + stride_kv_kv + w_offs, v_cur, mask=w_ok[None, :, None])

    # 3. Earlier generated positions [prompt_len, kv_len - 1), one per iteration, gathered through
    #    cache_indirection (device-side bounds: one CUDA-graph capture serves every tail length).
    one = tl.zeros([1], tl.int32)
    for t in range(start_pos, end_pos):
        tv = t + one  # a 1-vector keeps every mask a vector (the CPU interpreter's rule)
        page = source_beam_pages(ind_row_ptr + tv.to(tl.int64) * stride_ind_pos, tv, tv < end_pos, page_table_ptr,
                                 first_src_row, stride_pt_row, stride_pt_col, beam_width, page_size,
                                 page_index_divisor, num_pages, REPORT_ERRORS)
        if REPORT_ERRORS:
            tail_err |= page_error_bits(page)
        tok_ok = page >= 0
        tok_offs = page.to(tl.int64) * stride_kv_page + (tv % page_size).to(tl.int64) * stride_kv_slot
        offs = tok_offs[:, None, None] + kv_head_offs
        ok = tok_ok[:, None, None] & kv_row_ok
        k_t = tl.load(kv_ptr + offs, mask=ok, other=0.0)
        v_t = tl.load(kv_ptr + stride_kv_kv + offs, mask=ok, other=0.0)
        m_i, l_i, acc = attend_grouped_row(q, m_i, l_i, acc, k_t, v_t, tok_ok[:, None] & kv_head_ok[None, :])

    # 4. Normalise: l >= 1 (the term that set the running max adds 2^0).
    inv_l = 1.0 / l_i
    out_offs = row64 * stride_out_row + q_head[:, :, None] * stride_out_head + d[None, None, :]
    tl.store(out_ptr + out_offs, (acc * inv_l[:, :, None]).to(out_ptr.dtype.element_ty), mask=q_ok[:, :, None])
    if REPORT_ERRORS:
        flush_errors(err_ptr, err)
        flush_errors(err_ptr, tail_err)
