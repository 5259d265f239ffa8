"""The one-launch cascade kernel: shared prompt on tensor cores, per-beam tail, KV write, one pass.

One program handles one request, one block of ``BEAMS`` of its beams and one KV head. Its query
tile is ``[BLOCK_M, D]`` with ``BLOCK_M = BEAMS * GROUP_PAD``: row ``m`` is beam
``m // GROUP_PAD`` of the block and query head ``kv_head * GROUP + m % GROUP_PAD`` (padding rows,
past the beam width or the group, load zeros and store nothing).

Why one launch. At short and medium prompts (100-500 tokens) and 4-token tails a decode step moves
16-45 MB, 4-11 us at HBM speed, so two launches (a prefix kernel, then the tail kernel) pay two
ramp-ups and tail-offs, and hand the prefix state (output and LSE, as many bytes as the queries)
through memory. Here the prefix's running state never leaves registers.

Per program, in order:

1. Loads that depend on nothing go out together: the prompt length, the queries and the first
   prompt block's page entries.
2. This step's token (position ``L - 1``): ``new_k``/``new_v`` of the block's beams, ``[BEAMS, D]``,
   attended as a key block in which row ``m`` may only see column ``m // GROUP_PAD`` (its own
   beam), and written to each beam's own page (``WRITE_KV``).
3. The earlier generated positions ``[P, L - 1)``, ``TAIL_BLOCK`` at a time: each beam's K/V rows
   gathered through ``cache_indirection`` into a ``[TAIL_BLOCK * BEAMS, D]`` key block (column
   ``i * BEAMS + j`` is position ``t + i`` of beam ``j``), attended with the same own-beam mask; the
   next block's source beams and pages are requested before this block's K/V are consumed. The
   loop bound is read on the device, so one CUDA-graph capture serves every tail length.
4. The prompt ``[0, P)``, read once per program from the request's prompt page table (never more
   than the table's ``prompt_capacity`` tokens), ``BLOCK_N`` tokens per iteration with the next
   block's page entries requested early: ``S = Q K^T`` and ``O += P V`` on tensor cores with the
   online softmax. Every prompt load is masked to ``pos < P``: the slots past the prompt in beam
   0's last page are where beam 0 writes its generated tokens, so they are never read here (no
   race, and an unwritten slot's garbage cannot reach ``P V`` as ``0 x NaN``).
5. ``out = O / l``; with ``PREFIX_ONLY`` (the prompt pass alone, for check mode and the stage
   benchmarks) steps 2 and 3 are skipped and the prefix LSE is stored as well.

Why the generated positions come first: their index chain (source beam, then page, then K/V) is
three dependent loads; walked first, its latency is paid before the prompt loop's instead of after
it, and a 3-token tail is one key block (``TAIL_BLOCK`` 4). Measured on the H200 against the
prompt-first order with two tail positions per block: 37.9 us against 58.6 us at B-short
(``docs/benchmarks.md``, "The one-launch cascade").

The masked key blocks of steps 2-3 spend ``BEAMS`` times the tail's useful MMA work, which is small
next to the prompt's at decode shapes (a 4-token tail against a 100-token prompt); it keeps the
whole program in the tensor-core accumulator layout, with no register-layout conversions between
the prompt and the tail. ``P`` is rounded to the KV dtype before ``P V``, as in FlashAttention.

Scores are in base 2 (``s * sm_scale * log2(e)``, then ``exp2``). The running max is clamped to a
finite value before it is used as an exponent offset, so a key block with no valid column (a page
index the masks rejected) leaves the state unchanged instead of producing NaN. Page numbers and pool
offsets are int64. Indices that would leave the pool (a page outside ``[0, num_pages)``, a source
beam outside ``[0, W)``, a position past ``max_seq_len``) are masked, never dereferenced; check
mode reports them by name.
"""

import triton
import triton.language as tl

__all__ = ["beam_cascade_kernel"]


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``tl.dot(a, b)`` with float32 accumulation; ``DOT_FP32`` upcasts the operands first (the CPU
    interpreter multiplies bf16 operands' raw bits, Triton 3.9; fp16 and GPU runs are unaffected)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _online_softmax_block(s, m_i, l_i, acc, v, DOT_FP32: tl.constexpr):
    """Fold a score block ``s`` ``[BLOCK_M, N]`` (base 2, ``-inf`` where masked) and its values ``v``
    ``[N, D]`` into the running ``(m, l, acc)``; returns the new state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row whose every score so far is -inf keeps m = -inf; exponent offsets use 0 there, so
    # exp2(-inf - 0) = 0 for its terms and no (-inf) - (-inf) = NaN appears.
    m_off = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_off)
    p = tl.exp2(s - m_off[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc_new = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return m_new, l_new, acc_new


@triton.jit
def _tail_block_pages(
    ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
    req64, beam_width, col_beam, col_pos, col_beam_end, page_size, page_index_divisor, num_pages,
):
    """Pages of a tail key block's columns (``[TAIL_BLOCK * BEAMS]`` int64), ``-1`` where masked.

    Column ``c`` is position ``col_pos[c]`` of beam ``col_beam[c]``; it is valid when the position is
    before ``col_beam_end[c]`` (that beam's ``L - 1``), its source beam lies in ``[0, W)`` and the
    page-table entry gives a page in ``[0, num_pages)``.
    """
    ok = col_pos < col_beam_end
    src = tl.load(
        ci_ptr + req64 * stride_ci_req + col_beam.to(tl.int64) * stride_ci_beam + col_pos.to(tl.int64) * stride_ci_pos,
        mask=ok,
        other=0,
    )
    ok = ok & (src >= 0) & (src < beam_width)
    entry = tl.load(
        beam_pt_ptr + (req64 * beam_width + src) * stride_bpt_row + (col_pos // page_size).to(tl.int64) * stride_bpt_col,
        mask=ok,
        other=-1,
    )
    page = entry // page_index_divisor  # int32 division: entries are >= 0 when used
    return tl.where(ok & (entry >= 0) & (page < num_pages), page.to(tl.int64), -1)


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
    prompt_capacity,
    page_size,
    page_index_divisor,
    num_pages,
    max_seq_len,
    qk_scale_log2,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BEAMS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PREFIX_ONLY: tl.constexpr,
    DOT_FP32: tl.constexpr = False,
):
    """Grid ``(R * num_beam_blocks, Hkv)``; arguments and element strides as the launchers in
    :mod:`triton_kernels.cascade` pass them; the module docstring gives the steps."""
    BLOCK_M: tl.constexpr = BEAMS * GROUP_PAD
    TAIL_COLS: tl.constexpr = TAIL_BLOCK * BEAMS
    pid = tl.program_id(0)
    req = pid // num_beam_blocks
    req64 = req.to(tl.int64)
    first_beam = (pid % num_beam_blocks) * BEAMS
    kv_head = tl.program_id(1)
    kv_head_off = kv_head.to(tl.int64) * stride_kv_head
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)

    # 1. Loads that depend on nothing go out first, together: the prompt length, the queries, the
    # first prompt block's page entries (table columns past the prompt hold valid pages, and
    # tokens past the prompt are masked below), and, for the whole step, the beams' lengths and
    # this step's K/V.
    prompt_len = tl.load(prompt_lens_ptr + req64 * stride_plen_req)
    first_pos_ok = n < prompt_capacity
    first_pages = tl.load(prompt_pt_ptr + req64 * stride_ppt_req + (n // page_size) * stride_ppt_col,
                          mask=first_pos_ok, other=-1)
    m = tl.arange(0, BLOCK_M)
    row_beam = first_beam + m // GROUP_PAD
    g = m % GROUP_PAD
    row_ok = (row_beam < beam_width) & (g < GROUP)
    row64 = req64 * beam_width + row_beam.to(tl.int64)
    q_head = kv_head * GROUP + g
    q = tl.load(q_ptr + row64[:, None] * stride_q_row + q_head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if not PREFIX_ONLY:
        beam_slot = tl.arange(0, BEAMS)
        slot_beam = first_beam + beam_slot
        slot_ok = slot_beam < beam_width
        slot_row64 = req64 * beam_width + slot_beam.to(tl.int64)
        cur = tl.load(kv_lens_ptr + slot_row64, mask=slot_ok, other=0) - 1
        k_cur = tl.load(new_k_ptr + slot_row64[:, None] * stride_new_k_row + kv_head * stride_new_k_head + d[None, :],
                        mask=slot_ok[:, None], other=0.0)
        v_cur = tl.load(new_v_ptr + slot_row64[:, None] * stride_new_v_row + kv_head * stride_new_v_head + d[None, :],
                        mask=slot_ok[:, None], other=0.0)
        # Tail key-block columns: column c is position t0 + c // BEAMS of beam slot c % BEAMS.
        tc = tl.arange(0, TAIL_COLS)
        tcol_slot = tc % BEAMS
        tcol_beam = first_beam + tcol_slot
        tcol_step = tc // BEAMS
        tcol_end = tl.load(kv_lens_ptr + req64 * beam_width + tcol_beam.to(tl.int64),
                           mask=tcol_beam < beam_width, other=0) - 1
        tcol_end = tl.minimum(tcol_end, max_seq_len)  # earlier generated positions are [P, tcol_end)
        tail_pages = _tail_block_pages(
            ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
            req64, beam_width, tcol_beam, prompt_len + tcol_step, tcol_end, page_size, page_index_divisor, num_pages,
        )

        # 2. This step's token, from registers (a row sees only its own beam's column), and its
        #    write into each beam's own page. A position inside the prompt (kv_len <= prompt_len,
        #    invalid input) is never written: prompt pages are shared by every beam of the request.
        s_cur = _dot(q, tl.trans(k_cur), DOT_FP32) * qk_scale_log2
        s_cur = tl.where(((m // GROUP_PAD)[:, None] == beam_slot[None, :]) & slot_ok[None, :], s_cur, float("-inf"))
        m_i, l_i, acc = _online_softmax_block(s_cur, m_i, l_i, acc, v_cur, DOT_FP32)
        if WRITE_KV:
            w_ok = slot_ok & (cur >= prompt_len) & (cur >= 0) & (cur < max_seq_len)
            w_entry = tl.load(beam_pt_ptr + slot_row64 * stride_bpt_row + (cur // page_size).to(tl.int64) * stride_bpt_col,
                              mask=w_ok, other=-1)
            w_page = (w_entry // page_index_divisor).to(tl.int64)
            w_ok = w_ok & (w_entry >= 0) & (w_page < num_pages)
            w_offs = w_page * stride_kv_page + kv_head_off + (cur % page_size).to(tl.int64) * stride_kv_slot
            tl.store(kv_ptr + w_offs[:, None] + d[None, :], k_cur, mask=w_ok[:, None])
            tl.store(kv_ptr + stride_kv_kv + w_offs[:, None] + d[None, :], v_cur, mask=w_ok[:, None])

        # 3. Earlier generated positions, TAIL_BLOCK per key block; the next block's pages are
        #    requested before this block's K/V are consumed. Device-side bounds: no tail-length limit.
        block_end = tl.max(tcol_end, axis=0)
        for t0 in range(prompt_len, block_end, TAIL_BLOCK):
            tpos = t0 + tcol_step
            col_ok = tail_pages >= 0
            toffs = (tl.where(col_ok, tail_pages, 0) * stride_kv_page + kv_head_off
                     + (tpos % page_size).to(tl.int64) * stride_kv_slot)
            k_t = tl.load(kv_ptr + toffs[:, None] + d[None, :], mask=col_ok[:, None], other=0.0)
            v_t = tl.load(kv_ptr + stride_kv_kv + toffs[:, None] + d[None, :], mask=col_ok[:, None], other=0.0)
            tail_pages = _tail_block_pages(
                ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, beam_pt_ptr, stride_bpt_row, stride_bpt_col,
                req64, beam_width, tcol_beam, tpos + TAIL_BLOCK, tcol_end, page_size, page_index_divisor, num_pages,
            )
            s_t = _dot(q, tl.trans(k_t), DOT_FP32) * qk_scale_log2
            s_t = tl.where(((m // GROUP_PAD)[:, None] == tcol_slot[None, :]) & col_ok[None, :], s_t, float("-inf"))
            m_i, l_i, acc = _online_softmax_block(s_t, m_i, l_i, acc, v_t, DOT_FP32)

    # 4. The shared prompt, once for every row of the tile. The table's columns bound it (never a
    #    read past the table), whatever prompt_lens says; every load is masked to the prompt.
    prompt_end = tl.minimum(prompt_len, prompt_capacity)
    pages = first_pages
    for start in range(0, prompt_end, BLOCK_N):
        pos = start + n
        tok_ok = (pos < prompt_end) & (pages >= 0) & (pages < num_pages)
        offs = tl.where(tok_ok, pages, 0).to(tl.int64) * stride_kv_page + kv_head_off + (
            (pos % page_size).to(tl.int64) * stride_kv_slot)
        k = tl.load(kv_ptr + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(kv_ptr + stride_kv_kv + offs[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        next_pos = pos + BLOCK_N
        pages = tl.load(prompt_pt_ptr + req64 * stride_ppt_req + (next_pos // page_size) * stride_ppt_col,
                        mask=next_pos < prompt_end, other=-1)
        s_p = _dot(q, tl.trans(k), DOT_FP32) * qk_scale_log2
        s_p = tl.where(tok_ok[None, :], s_p, float("-inf"))
        m_i, l_i, acc = _online_softmax_block(s_p, m_i, l_i, acc, v, DOT_FP32)

    out_offs = row64[:, None] * stride_out_row + q_head[:, None] * stride_out_head + d[None, :]
    if PREFIX_ONLY:
        # Normalised prefix output and its base-2 LSE; an empty prompt gives 0 and -inf (the tail
        # kernel's convention for "no prefix").
        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        tl.store(lse_ptr + row64 * stride_lse_row + q_head * stride_lse_head,
                 tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
        tl.store(out_ptr + out_offs, tl.where(has[:, None], acc / l_safe[:, None], 0.0).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        # l >= 1 for every real row: the running max came from a finite column (its own current token).
        tl.store(out_ptr + out_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
