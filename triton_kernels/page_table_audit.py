"""Launcher of the page-table audit (:mod:`triton_kernels.page_table_audit_kernel`): with the device error flag, a
write page that a beam of its request holds at an earlier generated column raises ``HELD_WRITE_PAGE``.

The step's page table, lengths and prompt lengths are the same in every layer of a pool, so the wrapper launches the
audit once a step (:class:`beam_shared_prefix.BeamSharedPrefixAttention`), not once a layer as the attention kernels
judge their own indices.
"""

from __future__ import annotations

import torch

from .device_errors import check_error_flags
from .page_table_audit_kernel import fresh_write_page_audit_kernel
from .step_args import check_device, fail, need_dim, need_page_index_divisor, need_tensor, need_unit_stride

__all__ = ["AUDIT_BLOCK_W", "AUDIT_BLOCK_H", "audit_fresh_write_pages"]

#: Beams whose write pages one block of the audit compares, and held entries they are compared with at a time:
#: a ``[16, 64]`` comparison, 8 int32 a thread in the audit's 4 warps.
AUDIT_BLOCK_W = 16
AUDIT_BLOCK_H = 64


def _need_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
        fail(f"{name}={value!r} must be an int in [1, 2**31).")


def audit_fresh_write_pages(
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    beam_page_table: torch.Tensor,
    beam_width: int,
    error_flags: torch.Tensor,
    *,
    page_size: int,
    num_pages: int,
    max_seq_len: int,
    page_index_divisor: int = 1,
) -> None:
    """OR ``HELD_WRITE_PAGE`` into ``error_flags`` if, at a page's first token, a row's write page is held by a beam
    of its request at an earlier generated column (one launch, no sync; a no-op on an empty batch).

    Args:
        kv_lens: ``int32 [R*W]`` at unit stride, each row's KV length including this step's token.
        prompt_lens: ``int32 [R*W]`` at unit stride, each row's prompt length (beam 0's is its request's).
        beam_page_table: ``int32 [>= R*W, max_pages]``, each row's page entries (``entry // page_index_divisor`` is
            the page).
        beam_width: ``W``, beams a request (rows ``r*W .. r*W + W - 1`` are request ``r``'s).
        error_flags: ``int32 [1]`` on the tensors' device (``device_errors.new_error_flags``).
        page_size: tokens a page; num_pages: pages in the pool; max_seq_len: the cache's length a sequence
            (``cache_indirection.shape[2]``), all ints >= 1.
        page_index_divisor: ``1`` for page numbers, ``layers * kv_factor`` for TensorRT-LLM's block offsets.

    Raises :class:`~triton_kernels.KernelInputError` naming the argument, its limit and the fix.
    """
    for name, x in (("kv_lens", kv_lens), ("prompt_lens", prompt_lens), ("beam_page_table", beam_page_table)):
        need_tensor(name, x)
        if x.dtype != torch.int32:
            fail(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; the audit reads int32. Cast it first.")
        if x.device != kv_lens.device:
            fail(f"{name} is on {x.device} but kv_lens is on {kv_lens.device}; put every tensor on one device.")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        fail(f"beam_width={beam_width!r} must be an int >= 1.")
    for name, value in (("page_size", page_size), ("num_pages", num_pages), ("max_seq_len", max_seq_len)):
        _need_positive_int(name, value)
    need_page_index_divisor(page_index_divisor)
    need_dim("kv_lens", kv_lens, 1, "[R*W]")
    rows = kv_lens.shape[0]
    if rows % beam_width:
        fail(f"kv_lens has {rows} rows, not a multiple of beam_width={beam_width}; pass whole requests.")
    if prompt_lens.dim() != 1 or prompt_lens.shape[0] != rows:
        fail(f"prompt_lens must be int32 [{rows}] (one per row, like kv_lens), got {tuple(prompt_lens.shape)}.")
    need_unit_stride("kv_lens", kv_lens)
    need_unit_stride("prompt_lens", prompt_lens)
    need_dim("beam_page_table", beam_page_table, 2, "[>= R*W, max_pages]")
    if beam_page_table.shape[0] < rows:
        fail(f"beam_page_table has {beam_page_table.shape[0]} rows but kv_lens has {rows}; pass a row per beam.")
    check_error_flags(error_flags, kv_lens.device)
    if error_flags is None:
        fail("error_flags is None; the audit reports into a flag (device_errors.new_error_flags(device)).")
    check_device(kv_lens, fresh_write_page_audit_kernel, "the page-table audit")
    if rows == 0 or beam_page_table.shape[1] == 0:
        return
    args = (kv_lens, prompt_lens, beam_page_table, error_flags, beam_width, *beam_page_table.stride(),
            beam_page_table.shape[1], page_size, page_index_divisor, num_pages, max_seq_len)
    meta = dict(BLOCK_W=AUDIT_BLOCK_W, BLOCK_H=AUDIT_BLOCK_H, num_warps=4)
    grid = (rows // beam_width,)
    if kv_lens.is_cuda:
        with torch.cuda.device(kv_lens.device):
            fresh_write_page_audit_kernel[grid](*args, **meta)
    else:
        fresh_write_page_audit_kernel[grid](*args, **meta)
