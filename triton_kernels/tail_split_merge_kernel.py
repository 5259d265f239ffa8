"""Merge of a split tail: the chunk states of :func:`~triton_kernels.tail_merge_kernel.beam_tail_merge_kernel`
with ``NUM_SPLITS > 1`` into each row's output.

Why split: the tail kernel walks a row's earlier generated positions in order, and each tile waits
on its own index chain (source beam, page entry, K/V), so a long tail costs about one memory latency
per tile per program. With few rows (8 requests x 8 beams) the grid has too few programs to hide
that, and at 256 tokens per-beam decode, which reads contiguous pages, wins by 4x. Splitting the
tail into chunks multiplies the programs and divides each program's chain.

Each split stored its unnormalised online-softmax state ``(acc, m, l)`` in base 2: ``acc`` the
weighted sum of values scaled by ``2^-m``, ``l`` the sum of weights scaled the same way, ``m`` a
running max (``EMPTY_MAX`` with ``l = 0`` for an empty chunk). Split 0 holds the prefix state and
this step's token, so its ``l >= 1`` and the merged ``l >= 1``.
"""

import triton
import triton.language as tl

from .tail_merge_kernel import EMPTY_MAX

__all__ = ["tail_split_merge_kernel"]


@triton.jit
def tail_split_merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_out_row,
    stride_out_head,
    num_rows,
    num_q_heads,
    NUM_SPLITS: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Grid ``(rows, cdiv(Hq, HEADS_PER_PROG))``. ``part_acc_ptr``: float32 ``[NUM_SPLITS, rows, Hq, D]``,
    ``part_ml_ptr``: float32 ``[NUM_SPLITS, rows, Hq, 2]`` (``m``, ``l``), both contiguous;
    ``out``: ``[rows, Hq, D]`` (strides in elements, last dim contiguous), written in its dtype."""
    row = tl.program_id(0)
    h = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    h_ok = h < num_q_heads
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([HEADS_PER_PROG], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([HEADS_PER_PROG], tl.float32)
    acc = tl.zeros([HEADS_PER_PROG, HEAD_DIM], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        part = (s * num_rows + row).to(tl.int64) * num_q_heads + h
        m_s = tl.load(part_ml_ptr + part * 2, mask=h_ok, other=EMPTY_MAX)
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok, other=0.0)
        acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=h_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    out_offs = row.to(tl.int64) * stride_out_row + h[:, None] * stride_out_head + d[None, :]
    # Padding heads have l = 0; the mask keeps their 0/0 out of memory.
    inv_l = 1.0 / tl.where(h_ok, l_i, 1.0)
    tl.store(out_ptr + out_offs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
