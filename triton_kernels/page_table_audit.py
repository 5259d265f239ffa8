"""Launcher of the page-table audit (:mod:`triton_kernels.page_table_audit_kernel`): with the device error flag, the
checks of the page table that judge rows together. A write page that a row of another request holds raises
``OTHER_REQUEST_PAGE``; one held elsewhere in its own request (another row, or the row at an earlier column),
``HELD_WRITE_PAGE``; a beam whose length or write page is unlike beam 0's, ``BEAM_KV_LEN`` or ``SHARED_WRITE_PAGE``;
and beam 0's prompt pages unlike the plan's, ``PLAN_PAGE``.

The step's page table, lengths and prompt lengths are the same in every layer of a pool, so the wrapper launches the
audit once a step (:class:`beam_shared_prefix.BeamSharedPrefixAttention`), while the attention kernels judge the
indices they follow in every layer. Its workspace (:func:`new_audit_workspace`) is kept across steps at a fixed
address, so a CUDA graph replays the audit as captured. :func:`audit_page_table_torch` is the same audit in torch
ops (the torch tail's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import device_errors
from .device_errors import check_error_flags
from .host_ints import cdiv
from .launch import launch
from .page_table_audit_kernel import page_holders_kernel, page_table_audit_kernel
from .step_args import (check_device, check_written_overlaps, fail, need_dim, need_dtype, need_page_index_divisor, need_tensor,
                        need_unit_stride, need_vector)

__all__ = ["AUDIT_BLOCK_W", "AUDIT_BLOCK_C", "AuditWorkspace", "new_audit_workspace", "audit_page_table",
           "audit_page_table_torch"]

#: Beams one program of the audit judges.
AUDIT_BLOCK_W = 16
#: Page-table columns a program reads at a time for each of its ``AUDIT_BLOCK_W`` beams: ``[16, 32]`` entries, 4
#: int32 a thread in the audit's 4 warps.
AUDIT_BLOCK_C = 32


class AuditWorkspace(NamedTuple):
    """What the audit keeps between steps.

    Attributes:
        page_holders: ``int64 [2, num_pages]``, the highest and lowest row holding each page, with the stamp of the
            step that recorded it (``stamp << 32 | row``, the lowest as ``0x7FFFFFFF - row``); zeros at first.
        audit_state: ``int32 [1]``, the stamp of the next step's records (from 1).
    """

    page_holders: torch.Tensor
    audit_state: torch.Tensor


def _need_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
        fail(f"{name}={value!r} must be an int in [1, 2**31).")


def new_audit_workspace(num_pages: int, device) -> AuditWorkspace:
    """A workspace for a pool of ``num_pages`` pages on ``device`` (``16 x num_pages`` bytes)."""
    _need_positive_int("num_pages", num_pages)
    # (stamp 0 would let the zeroed entries stand beside row 0's records)
    state = torch.ones(1, dtype=torch.int32, device=device)
    return AuditWorkspace(torch.zeros(2, num_pages, dtype=torch.int64, device=device), state)


def _check_audit_args(kv_lens, prompt_lens, beam_page_table, beam_width, error_flags, page_size, num_pages,
                      max_seq_len, page_index_divisor, plan_digest) -> None:
    """The arguments both audits share (see :func:`audit_page_table`); raises naming the argument, limit and fix."""
    for name, x in (("kv_lens", kv_lens), ("prompt_lens", prompt_lens), ("beam_page_table", beam_page_table)):
        need_tensor(name, x)
        need_dtype(name, x, (torch.int32,))
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
    if beam_page_table.shape[1] * page_size < max_seq_len:
        fail(f"beam_page_table has {beam_page_table.shape[1]} columns of {page_size} tokens, fewer than "
             f"max_seq_len={max_seq_len}; pass the table that covers the cache (cache_indirection.shape[2] tokens).")
    check_error_flags(error_flags, kv_lens.device)
    if error_flags is None:
        fail("error_flags is None; the audit reports into a flag (device_errors.new_error_flags(device)).")
    if plan_digest is not None:
        need_vector("plan_digest", plan_digest, torch.int64, "R", rows // beam_width, kv_lens.device,
                    "pass torch.from_numpy(step_plan.prompt_pages_digest) on the tensors' device, or None.")


def _check_audit_writes(kv_lens, prompt_lens, beam_page_table, plan_digest, error_flags, workspace=()) -> None:
    """What an audit writes (``error_flags``, and the Triton audit's ``workspace``, ``(name, tensor)`` pairs) shares no
    byte with what it reads: a flag ORed into ``kv_lens`` would change a length the step's layers then attend."""
    check_written_overlaps(("error_flags",) + tuple(name for name, _ in workspace), (
        ("error_flags", error_flags), ("kv_lens", kv_lens), ("prompt_lens", prompt_lens),
        ("beam_page_table", beam_page_table), ("plan_digest", plan_digest)) + tuple(workspace))


def audit_page_table(
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    beam_page_table: torch.Tensor,
    beam_width: int,
    error_flags: torch.Tensor,
    workspace: AuditWorkspace,
    *,
    page_size: int,
    num_pages: int,
    max_seq_len: int,
    page_index_divisor: int = 1,
    plan_digest: torch.Tensor | None = None,
) -> None:
    """OR ``OTHER_REQUEST_PAGE``, ``HELD_WRITE_PAGE``, ``BEAM_KV_LEN``, ``SHARED_WRITE_PAGE`` and (with
    ``plan_digest``) ``PLAN_PAGE`` into ``error_flags`` where this step's page table breaks their rules (two
    launches, no sync; a no-op on an empty batch). Launch it once a step.

    Args:
        kv_lens: ``int32 [R*W]`` at unit stride, each row's KV length including this step's token.
        prompt_lens: ``int32 [R*W]`` at unit stride, each row's prompt length (beam 0's is its request's).
        beam_page_table: ``int32 [>= R*W, max_pages]``, each row's page entries (``entry // page_index_divisor`` is
            the page).
        beam_width: ``W``, beams a request (rows ``r*W .. r*W + W - 1`` are request ``r``'s).
        error_flags: ``int32 [1]`` on the tensors' device (``device_errors.new_error_flags``).
        workspace: :func:`new_audit_workspace` of the pool, kept from step to step.
        page_size: tokens a page; num_pages: pages in the pool; max_seq_len: the cache's length a sequence
            (``cache_indirection.shape[2]``), all ints >= 1.
        page_index_divisor: ``1`` for page numbers, ``layers * kv_factor`` for TensorRT-LLM's block offsets.
        plan_digest: ``None`` (``PLAN_PAGE`` not judged), or ``int64 [R]`` contiguous, the digest of each request's
            prompt pages in the plan the prefix read (:attr:`beam_shared_prefix.plan.StepPlan.prompt_pages_digest`).

    Raises :class:`~triton_kernels.KernelInputError` naming the argument, its limit and the fix.
    """
    _check_audit_args(kv_lens, prompt_lens, beam_page_table, beam_width, error_flags, page_size, num_pages,
                      max_seq_len, page_index_divisor, plan_digest)
    rows = kv_lens.shape[0]
    holders, state = workspace if isinstance(workspace, tuple) and len(workspace) == 2 else (None, None)
    if (not isinstance(holders, torch.Tensor) or holders.dtype != torch.int64 or tuple(holders.shape) != (2, num_pages)
            or not holders.is_contiguous() or holders.device != kv_lens.device
            or not isinstance(state, torch.Tensor) or state.dtype != torch.int32 or tuple(state.shape) != (1,)
            or state.device != kv_lens.device):
        fail(f"workspace must be new_audit_workspace(num_pages={num_pages}, {kv_lens.device}) (page_holders int64 "
             f"[2, {num_pages}] contiguous and audit_state int32 [1] on the tensors' device); make one per pool and "
             f"keep it between steps.")
    _check_audit_writes(kv_lens, prompt_lens, beam_page_table, plan_digest, error_flags,
                        (("page_holders", holders), ("audit_state", state)))
    check_device(kv_lens, page_table_audit_kernel, "the page-table audit")
    if rows == 0 or beam_page_table.shape[1] == 0:
        return
    table_geometry = (*beam_page_table.stride(), beam_page_table.shape[1])  # (stride_pt_row, stride_pt_col, cols)
    sizes = (page_size, page_index_divisor, num_pages, max_seq_len)
    # One program per request and block of beams: each holds a few dependent loads, so many short programs.
    grid = (rows // beam_width, cdiv(beam_width, AUDIT_BLOCK_W))
    launches = (
        (page_holders_kernel, grid,
         (kv_lens, prompt_lens, beam_page_table, holders, state, beam_width, *table_geometry, *sizes),
         dict(BLOCK_W=AUDIT_BLOCK_W, BLOCK_C=AUDIT_BLOCK_C, num_warps=4)),
        (page_table_audit_kernel, grid,
         (kv_lens, prompt_lens, beam_page_table, holders, state, error_flags,
          kv_lens if plan_digest is None else plan_digest, beam_width, *table_geometry, *sizes),
         dict(BLOCK_W=AUDIT_BLOCK_W, BLOCK_C=AUDIT_BLOCK_C, CHECK_PLAN=plan_digest is not None, num_warps=4)),
    )
    for kernel, grid, args, meta in launches:
        launch(kernel, grid, args, meta, kv_lens.device)


def audit_page_table_torch(
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
    plan_digest: torch.Tensor | None = None,
) -> None:
    """:func:`audit_page_table` in torch ops (the rules' twins in :mod:`triton_kernels.device_errors`), on any device,
    without a workspace: the same arguments but that, the same bits ORed into ``error_flags``, no sync."""
    _check_audit_args(kv_lens, prompt_lens, beam_page_table, beam_width, error_flags, page_size, num_pages,
                      max_seq_len, page_index_divisor, plan_digest)
    _check_audit_writes(kv_lens, prompt_lens, beam_page_table, plan_digest, error_flags)
    rows = kv_lens.shape[0]
    if rows == 0 or beam_page_table.shape[1] == 0:
        return
    table = beam_page_table[:rows]
    geometry = (beam_width, page_size, page_index_divisor, num_pages, max_seq_len)
    differs, shared = device_errors.beam_agreement_bad_torch(
        kv_lens, prompt_lens[torch.arange(rows, device=kv_lens.device) // beam_width * beam_width], table, *geometry)
    other, held = device_errors.write_page_rules_bad_torch(kv_lens, prompt_lens, table, *geometry)
    found = [(differs, device_errors.BEAM_KV_LEN), (shared, device_errors.SHARED_WRITE_PAGE),
             (other, device_errors.OTHER_REQUEST_PAGE), (held, device_errors.HELD_WRITE_PAGE)]
    if plan_digest is not None:
        found.append((device_errors.plan_digest_bad_torch(table, prompt_lens, plan_digest, beam_width, page_size,
                                                          page_index_divisor, max_seq_len), device_errors.PLAN_PAGE))
    for bad, bit in found:
        device_errors.flag_where(error_flags, bad, bit)
