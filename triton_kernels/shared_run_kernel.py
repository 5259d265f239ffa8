"""The shared-run stage: the generated positions every beam of a tile reads from one ancestor, attended
once per tile and merged into the prefix state, between a prefix backend (FA4, FlashInfer) and the tail
kernel.

Beam search's histories coalesce: a few steps back from the newest token the beams descend from one
ancestor, and from there on every beam reads the same K/V row at each position
(:func:`triton_kernels.beam_index.shared_ancestry_len`). The tail kernel reads each beam's positions
for that beam alone (one program per beam row, CUDA cores), so a long tail costs it every beam's rows;
the one-launch cascade folds such a run once per tile (``docs/rounds.md``, "The twenty-seventh round").
This stage does the same for the two-launch paths.

One program per (request, block of ``BEAMS`` beams, ``KV_HEADS_PER_PROG`` KV heads); its query tile is
``[BEAMS * GROUP_PAD, D]`` as in the cascade kernel (row ``m``: beam ``m // GROUP_PAD`` of the block, query
head ``kv_head * GROUP + m % GROUP_PAD``). Per program:

1. The beams' lengths; the run from ``P`` over the positions every beam of the block has cached
   (before each beam's ``L - 1``) at which their ``cache_indirection`` entries are all equal, looked for
   only where every beam caches at least ``min_cached_tail`` generated positions (else the run is empty). The
   program of the first KV heads stores it as every beam's ``tail_skip`` (the tail kernel then starts at
   ``P + tail_skip``); every program of the block finds the same run. Its chain of dependent loads is
   what a program without a run costs, so wide launches give a program two heads
   (:func:`triton_kernels.shared_run.shared_run_kv_heads_per_program`).
2. With a run, for each of the program's KV heads: its positions as dense ``BLOCK_N``-position key
   blocks seen by every row of the tile, on tensor cores
   (:func:`triton_kernels.cascade_kernel._shared_ancestry_blocks`, the cascade's own fold), then merged
   by log-sum-exp into ``prefix_out`` and ``prefix_lse`` in place (in their own dtype and LSE base).
   Without one nothing else is read or written.

A position of the run whose source beam or page leaves its buffer is masked (it drops out of the
softmax) and, with ``REPORT_ERRORS``, raises its bit, as in the tail kernel.
"""

import triton
import triton.language as tl

from .beam_index import shared_ancestry_len
from .cascade_kernel import SHARED_SCAN, _shared_ancestry_blocks
from .device_errors import flush_errors
from .grid_dependency import wait_for_prior_grids

__all__ = ["beam_shared_run_kernel"]


@triton.jit
def beam_shared_run_kernel(
    q_ptr,
    kv_ptr,
    beam_pt_ptr,
    kv_lens_ptr,
    prompt_lens_ptr,
    ci_ptr,
    prefix_out_ptr,
    prefix_lse_ptr,
    tail_skip_ptr,
    stride_q_row,
    stride_q_head,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_head,
    stride_kv_slot,
    stride_bpt_row,
    stride_bpt_col,
    stride_ci_req,
    stride_ci_beam,
    stride_ci_pos,
    stride_po_row,
    stride_po_head,
    stride_lse_row,
    stride_lse_head,
    beam_width,
    num_beam_blocks,
    page_size: tl.constexpr,
    page_index_divisor: tl.constexpr,
    num_pages,
    max_seq_len,
    min_cached_tail,
    qk_scale_log2,
    lse_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BEAMS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr = False,
    KV_HEADS_PER_PROG: tl.constexpr = 1,
    err_ptr=None,
    REPORT_ERRORS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid ``(R * num_beam_blocks, Hkv // KV_HEADS_PER_PROG)``; arguments and element strides as
    :func:`triton_kernels.beam_shared_run_attention` passes them; the module docstring gives the steps."""
    if PDL:  # launched as a programmatic dependent (triton_kernels.launch): wait before any load or store
        wait_for_prior_grids()
    BLOCK_M: tl.constexpr = BEAMS * GROUP_PAD
    pid = tl.program_id(0)
    req = pid // num_beam_blocks
    req64 = req.to(tl.int64)
    first_beam = (pid % num_beam_blocks) * BEAMS
    head_block = tl.program_id(1)

    # 1. The run every beam of the block has cached: [P, min over the beams of L - 1).
    slot = tl.arange(0, BEAMS)
    slot_ok = first_beam + slot < beam_width
    slot_row64 = req64 * beam_width + (first_beam + slot).to(tl.int64)
    prompt_len = tl.load(prompt_lens_ptr + req64 * beam_width)
    gen_end = tl.minimum(tl.load(kv_lens_ptr + slot_row64, mask=slot_ok, other=0) - 1, max_seq_len)
    run_begin = tl.maximum(prompt_len, 0)
    # (clamped: a beam's kv_len far below its prompt, which the tail kernel's flag reports, would wrap the int32
    # difference below into a run of 2**31 positions that every beam of the block would skip)
    shared_stop = tl.maximum(tl.min(tl.where(slot_ok, gen_end, max_seq_len), axis=0), run_begin)
    if shared_stop - run_begin >= min_cached_tail:
        run_len = shared_ancestry_len(ci_ptr, stride_ci_req, stride_ci_beam, stride_ci_pos, req64, first_beam,
                                      beam_width, run_begin, shared_stop, BEAMS, SHARED_SCAN)
    else:  # a tail this short is left to the tail kernel, without the scan's dependent load (see the launcher)
        run_len = shared_stop * 0
    run_len = tl.maximum(run_len, 0)  # (a block whose beams have nothing cached scans an empty range)
    # (the mask through tl.where: the CPU interpreter cannot `&` a scalar into a mask)
    tl.store(tail_skip_ptr + slot_row64, run_len + slot * 0, mask=tl.where(head_block == 0, slot_ok, False))

    # 2. The run, once for the tile and KV head, merged into the prefix state.
    if run_len > 0:
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        row_beam = first_beam + m // GROUP_PAD
        g = m % GROUP_PAD
        row_ok = (row_beam < beam_width) & (g < GROUP)
        row64 = req64 * beam_width + row_beam.to(tl.int64)
        for h in range(KV_HEADS_PER_PROG):
            _merge_run(
                q_ptr, kv_ptr, beam_pt_ptr, ci_ptr, prefix_out_ptr, prefix_lse_ptr, head_block * KV_HEADS_PER_PROG + h,
                stride_q_row, stride_q_head, stride_kv_page, stride_kv_kv, stride_kv_head, stride_kv_slot,
                stride_bpt_row, stride_bpt_col, stride_ci_req, stride_ci_beam, stride_ci_pos, stride_po_row,
                stride_po_head, stride_lse_row, stride_lse_head, beam_width, page_size, page_index_divisor, num_pages,
                qk_scale_log2, lse_scale, req64, first_beam, run_begin, run_len, m, d, g, row_ok, row64, GROUP,
                BLOCK_M, HEAD_DIM, BLOCK_N, DOT_FP32, err_ptr, REPORT_ERRORS)


@triton.jit
def _merge_run(
    q_ptr, kv_ptr, beam_pt_ptr, ci_ptr, prefix_out_ptr, prefix_lse_ptr, kv_head, stride_q_row, stride_q_head,
    stride_kv_page, stride_kv_kv, stride_kv_head, stride_kv_slot, stride_bpt_row, stride_bpt_col, stride_ci_req,
    stride_ci_beam, stride_ci_pos, stride_po_row, stride_po_head, stride_lse_row, stride_lse_head, beam_width,
    page_size, page_index_divisor, num_pages, qk_scale_log2, lse_scale, req64, first_beam, run_begin, run_len, m, d,
    g, row_ok, row64, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, err_ptr, REPORT_ERRORS: tl.constexpr,
):
    """One KV head's part of step 2: the tile's run ``[run_begin, run_begin + run_len)`` attended and merged
    into ``prefix_out`` / ``prefix_lse`` in place."""
    q_head = kv_head * GROUP + g
    q = tl.load(q_ptr + row64[:, None] * stride_q_row + q_head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i, l_i, acc, run_err = _shared_ancestry_blocks(
        q, m_i, l_i, acc, kv_ptr, kv_head.to(tl.int64) * stride_kv_head,
        ci_ptr + req64 * stride_ci_req + first_beam.to(tl.int64) * stride_ci_beam, stride_ci_pos,
        beam_pt_ptr, req64 * beam_width, stride_bpt_row, stride_bpt_col, beam_width, run_begin,
        run_begin + run_len, page_size, page_index_divisor, num_pages, stride_kv_page, stride_kv_kv,
        stride_kv_slot, qk_scale_log2, HEAD_DIM, BLOCK_N, DOT_FP32, REPORT_ERRORS)
    # Merge in base 2: lse = max + log2(2^(a - max) + 2^(b - max)), each side weighted by 2^(its lse -
    # lse). An empty prefix (-inf) or a run whose every position was masked (l = 0) weighs 0.
    lse_ptrs = prefix_lse_ptr + row64 * stride_lse_row + q_head * stride_lse_head
    lse_prefix = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")) * lse_scale
    has_run = l_i > 0.0
    lse_run = tl.where(has_run, m_i + tl.log2(tl.where(has_run, l_i, 1.0)), float("-inf"))
    top = tl.maximum(lse_prefix, lse_run)
    top_safe = tl.where(top > float("-inf"), top, 0.0)
    w_prefix = tl.exp2(lse_prefix - top_safe)
    w_run = tl.exp2(lse_run - top_safe)
    total = w_prefix + w_run
    total_safe = tl.where(total > 0.0, total, 1.0)
    lse_new = tl.where(total > 0.0, top_safe + tl.log2(total_safe), float("-inf"))
    po_ptrs = prefix_out_ptr + row64[:, None] * stride_po_row + q_head[:, None] * stride_po_head + d[None, :]
    o_prefix = tl.load(po_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    o_prefix = tl.where((w_prefix > 0.0)[:, None], o_prefix, 0.0)  # an empty prefix's output is never read
    run_scale = tl.where(has_run, w_run / (total_safe * tl.where(has_run, l_i, 1.0)), 0.0)
    o_new = o_prefix * (w_prefix / total_safe)[:, None] + acc * run_scale[:, None]
    store_ok = row_ok & (total > 0.0)
    tl.store(po_ptrs, o_new.to(prefix_out_ptr.dtype.element_ty), mask=store_ok[:, None])
    tl.store(lse_ptrs, lse_new / lse_scale, mask=store_ok)
    if REPORT_ERRORS:
        flush_errors(err_ptr, run_err + tl.zeros([1], tl.int32))
