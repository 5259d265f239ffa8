"""Launcher of the shared-run stage (:mod:`triton_kernels.shared_run_kernel`): between a prefix backend and
the tail kernel, the generated positions every beam of a tile reads from one ancestor are attended once per
tile and merged into the prefix state; the tail kernel then skips them (``tail_skip``).

The wrapper launches it on the two-launch paths for steps whose longest tail reaches
``beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL`` (``shared_run="auto"``), where it measured faster on the
H200: up to 2.8x at 256 generated tokens with beam search's coalescing histories, 1-2% slower without shared
ancestry (``docs/rounds.md``, "The twenty-ninth round").
"""

from __future__ import annotations

from typing import Tuple

import torch

from .cascade import (
    cascade_supported,
    cuda_sm_count,  # noqa: F401  (prefix.waves reads the device's count through this module)
    launch_multiprocessors,
    wide_launch_config,
)
from .cascade_kernel import SHARED_BLOCK
from .device_errors import check_error_flags
from .host_ints import cdiv
from .launch import launch
from .shared_run_kernel import beam_shared_run_kernel
from .step_args import LOG2E, KernelInputError, check_device, check_written_overlaps, need_distinct_elements
from .tail_merge_args import check_tail_merge_args, check_tail_skip

__all__ = ["shared_run_supported", "shared_run_tile", "shared_run_kv_heads_per_program", "beam_shared_run_attention"]


def shared_run_supported(group_size: int, head_dim: int) -> Tuple[bool, str]:
    """Whether the stage tiles this shape: ``(True, "")`` or ``(False, reason)``. Its tiles are the cascade
    kernel's (:func:`triton_kernels.cascade_supported`), so are its limits."""
    return cascade_supported(group_size, head_dim)


def shared_run_tile(beam_width: int, group_size: int, head_dim: int) -> Tuple[int, int, int]:
    """``(beams per program, padded group, warps)``: the beam block of the cascade's default tiling for the
    shape's wide tile (a beam block is the set of beams whose common run is looked for, so wider blocks find
    shorter runs; narrow widths' tiles of fewer beams were not measured with this stage), with 4 warps up to 64
    query rows and 8 above."""
    cfg = wide_launch_config(beam_width, group_size, head_dim)
    return cfg.beams_per_program, cfg.group_pad, 4 if cfg.block_m <= 64 else 8


# Stage programs resident per SM of the 4-warp tiles: the [64, D] fp32 tile takes 194-197 registers a thread at
# one KV head and 255 at two on sm_90 (Triton 3.9), so two programs fill an SM's register file either way. The
# 8-warp tiles of G = 8 hold one program at head 128 (196 and 255 registers) and two at head 64 at one head
# (128 registers; 222 at two heads, one program).
STAGE_PROGRAMS_PER_SM = 2
# KV heads one program takes at most. On the H200 two took 0.97x-1.01x of one head's time at every point timed
# (B-medium, B-4B and preset A at 30-96 beams, tails 4-256; median 0.999x, 2-3% faster at B-4B 30 beams);
# four and eight lost up to 3% at long tails at 96 beams (the heads' runs one after another in fewer, longer
# programs), while still gaining at 4 tokens (docs/rounds.md, "The thirtieth round").
STAGE_MAX_KV_HEADS_PER_PROGRAM = 2
# The shortest cached tail (``min over a block's beams of L - 1 - P``) in which the stage looks for a run
# (``min_cached_tail``; the one-launch cascade's ``shared_min_tail`` is 16). A block with a shorter one skips
# the scan's dependent load of ``cache_indirection`` entries and leaves its positions to the tail. On the H200
# (docs/rounds.md, "The thirty-first round"; FA4 + stage + tail against FA4 + tail): 32 held the stage's cost
# at tails of 4-32 tokens to 1-4% at B-medium and B-4B (30 and 96 beams), where scanning every tail cost up to
# 11% (B-medium, 30 beams, 32 tokens) and 16 up to 11% too at 24-32 tokens; at 64-256 tokens 1, 8, 16 and 32
# were within 1% of each other.
SHARED_RUN_MIN_CACHED_TAIL = 32


def _stage_programs_per_sm(num_warps: int, head_dim: int, kv_heads_per_program: int) -> int:
    """Stage programs an SM holds (sm_90 register counts above ``STAGE_PROGRAMS_PER_SM``)."""
    if num_warps <= 4:
        return STAGE_PROGRAMS_PER_SM
    return 1 if head_dim >= 128 or kv_heads_per_program > 1 else 2


def shared_run_kv_heads_per_program(tiles: int, num_kv_heads: int, sm_count: int, num_warps: int = 4,
                                    head_dim: int = 128) -> int:
    """KV heads per stage program: ``STAGE_MAX_KV_HEADS_PER_PROGRAM`` (2) where it divides ``num_kv_heads``, an
    SM still holds as many programs as at one head (every 4-warp tile of ``shared_run_tile``; the 8-warp tiles
    of G = 8 at head 128, not at head 64) and they still fill every SM (``tiles * Hkv / 2 >= programs per SM *
    sm_count``), else 1.

    Every program of a tile finds the same run, and a program whose tile has none (short tails, no shared
    ancestry) still costs the scan's chain of dependent loads; with one program per KV head a wide launch
    pays that chain once per wave (B-4B at 96 beams: 12 waves, 22 us at a 4-token tail; 16 us at two heads
    a program, 13 us at eight)."""
    per_prog = 1
    while 2 * per_prog <= STAGE_MAX_KV_HEADS_PER_PROGRAM and num_kv_heads % (2 * per_prog) == 0:
        programs_per_sm = _stage_programs_per_sm(num_warps, head_dim, 2 * per_prog)
        if (programs_per_sm < _stage_programs_per_sm(num_warps, head_dim, per_prog)
                or tiles * num_kv_heads // (2 * per_prog) < programs_per_sm * sm_count):
            break
        per_prog *= 2
    return per_prog


def beam_shared_run_attention(
    q,
    kv_cache,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    prefix_out,
    prefix_lse,
    tail_skip,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    prefix_lse_layout="NH",
    prefix_lse_base="log2",
    error_flags=None,
    kv_heads_per_program=None,
    min_cached_tail=None,
):
    """Attend, once per block of beams, the generated positions all its beams read from one ancestor, and
    merge them into the prefix state in place; the tail kernel then skips them.

    For each request ``r`` and block of beams (``shared_run_tile``), the run is the longest ``[P, P + n)``
    over which every beam of the block has its position cached (``t < L - 1`` for each) and the blocks'
    ``cache_indirection[r, b, t]`` are all equal (empty where the block's beams cache fewer than
    ``min_cached_tail`` generated positions). Every row ``i`` of the block gets ``tail_skip[i] = n``, and
    ``(prefix_out[i, h], prefix_lse[i, h])`` becomes the state of the prefix and those ``n`` positions
    together (positions ``t`` on page ``beam_page_table[r*W + cache_indirection[r, b, t], t // Pg] //
    page_index_divisor``). Passing ``tail_skip`` to :func:`triton_kernels.beam_tail_attention_merge` with
    the same state then gives the step's attention over every position once.

    Args:
        q, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width, sm_scale,
            kv_layout, page_index_divisor, prefix_lse_layout, prefix_lse_base: as for
            :func:`triton_kernels.beam_tail_attention_merge` (``prompt_lens`` equal within a request: the
            stage reads row ``r*W``'s).
        prefix_out: ``[rows, Hq, D]`` bf16/fp16/fp32, the prefix output; updated in place.
        prefix_lse: float32 prefix LSE in ``prefix_lse_layout`` and ``prefix_lse_base`` (``-inf``: an empty
            prefix); updated in place.
        tail_skip: ``[rows]`` int32 on q's device, written: positions after ``P`` each row's tail skips.
        error_flags: ``None``, or an ``int32 [1]`` tensor into which the kernel ORs a bit per kind of
            invalid index it masked inside a run (:mod:`triton_kernels.device_errors`).
        kv_heads_per_program: KV heads each program attends its tile's run for, a divisor of ``Hkv``
            (``None``: :func:`shared_run_kv_heads_per_program`'s choice).
        min_cached_tail: a block looks for its run only where every beam has at least this many generated
            positions cached (``min over its beams of L - 1 - P``); a shorter tail gets ``tail_skip`` 0 and is
            left to the tail kernel (``None``: ``SHARED_RUN_MIN_CACHED_TAIL``, 32; 1: every tail).

    Returns:
        ``tail_skip``.

    Raises:
        KernelInputError: an argument the stage cannot take (names the value, the limit and the fix),
            including shapes :func:`shared_run_supported` refuses.
    """
    geom = check_tail_merge_args(
        q, None, None, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
        prefix_out, prefix_lse, None, sm_scale=sm_scale, kv_layout=kv_layout, page_index_divisor=page_index_divisor,
        prefix_lse_layout=prefix_lse_layout, prefix_lse_base=prefix_lse_base, reads_step_kv=False,
    )
    ok, reason = shared_run_supported(geom.group_size, geom.head_dim)
    if not ok:
        raise KernelInputError(f"{reason}; leave the tail kernel to walk every position (no tail_skip).")
    check_tail_skip(tail_skip, geom.num_rows, q.device)
    check_error_flags(error_flags, q.device)
    check_written_overlaps(("prefix_out", "prefix_lse", "tail_skip", "error_flags"), (
        ("q", q), ("kv_cache", kv_cache), ("beam_page_table", beam_page_table), ("kv_lens", kv_lens),
        ("prompt_lens", prompt_lens), ("cache_indirection", cache_indirection), ("prefix_out", prefix_out),
        ("prefix_lse", prefix_lse), ("tail_skip", tail_skip), ("error_flags", error_flags)))
    # The stage merges each row's run into its prefix state in place: rows that share elements would merge into
    # one another's.
    for name, x in (("prefix_out", prefix_out), ("prefix_lse", prefix_lse)):
        need_distinct_elements(name, x, f"Pass a {name} buffer whose elements are distinct (a fresh tensor).")
    if kv_heads_per_program is not None and (
            not isinstance(kv_heads_per_program, int) or isinstance(kv_heads_per_program, bool)
            or kv_heads_per_program < 1 or geom.num_kv_heads % kv_heads_per_program):
        raise KernelInputError(f"kv_heads_per_program={kv_heads_per_program!r} must be a positive int dividing "
                               f"the {geom.num_kv_heads} KV heads; pass None for the default.")
    if min_cached_tail is None:
        min_cached_tail = SHARED_RUN_MIN_CACHED_TAIL
    if (not isinstance(min_cached_tail, int) or isinstance(min_cached_tail, bool)
            or not 1 <= min_cached_tail < 2**31):
        raise KernelInputError(f"min_cached_tail={min_cached_tail!r} must be an int in [1, 2**31); pass 1 to fold "
                               f"every shared run, or None for SHARED_RUN_MIN_CACHED_TAIL "
                               f"({SHARED_RUN_MIN_CACHED_TAIL}).")
    check_device(q, beam_shared_run_kernel, "the shared-run stage")
    if geom.num_rows == 0:
        return tail_skip
    beams, group_pad, num_warps = shared_run_tile(geom.beam_width, geom.group_size, geom.head_dim)
    num_beam_blocks = cdiv(geom.beam_width, beams)
    tiles = geom.num_requests * num_beam_blocks
    if kv_heads_per_program is None:
        kv_heads_per_program = shared_run_kv_heads_per_program(tiles, geom.num_kv_heads, launch_multiprocessors(q.device),
                                                               num_warps, geom.head_dim)
    grid = (tiles, geom.num_kv_heads // kv_heads_per_program)
    s_page, s_kv, s_head, s_slot = geom.kv_strides
    s_lse_row, s_lse_head = geom.lse_strides
    args = (
        q, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, prefix_out, prefix_lse, tail_skip,
        *q.stride()[:2],
        s_page, s_kv, s_head, s_slot,
        *beam_page_table.stride()[:2],
        *cache_indirection.stride()[:3],
        *prefix_out.stride()[:2],
        s_lse_row, s_lse_head,
        geom.beam_width, num_beam_blocks, geom.page_size, page_index_divisor, geom.num_pages, geom.max_seq_len,
        min_cached_tail, geom.sm_scale * LOG2E, geom.lse_scale,
    )
    meta = dict(GROUP=geom.group_size, GROUP_PAD=group_pad, BEAMS=beams, HEAD_DIM=geom.head_dim,
                BLOCK_N=SHARED_BLOCK.value, KV_HEADS_PER_PROG=kv_heads_per_program,
                DOT_FP32=not q.is_cuda and q.dtype == torch.bfloat16, num_warps=num_warps, num_stages=1)
    if error_flags is not None:
        meta.update(err_ptr=error_flags, REPORT_ERRORS=True)
    launch(beam_shared_run_kernel, grid, args, meta, q.device, pdl=True)
    return tail_skip

