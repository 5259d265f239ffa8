"""Launcher of the fused tail kernel: validate, pick a tiling, launch once.

:func:`beam_tail_attention_merge` is the device half of a beam-search decode step after the prefix
pass: for every beam row it writes this step's K/V into the row's own page, attends the row's
generated tail gathered through ``cache_indirection`` and merges the result with the prefix state by
log-sum-exp, in one Triton launch with no host sync (safe to capture in a CUDA graph; the tail
length is read from ``kv_lens``/``prompt_lens`` on the device at every replay).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from .device_errors import check_error_flags
from .host_ints import cdiv, next_power_of_2
from .launch import launch
from .step_args import (
    LOG2E,
    KernelInputError,
    check_tail_index_values,
    is_pow2,
    need_flag,
    runs_interpreted,
)
from .tail_merge_args import (
    check_tail_merge_args,
    check_tail_skip,
)
from .tail_merge_grouped_kernel import beam_tail_merge_grouped_kernel
from .tail_merge_kernel import beam_tail_merge_kernel

__all__ = ["beam_tail_attention_merge", "TailLaunchConfig", "tail_launch_config", "tail_supported"]

# Registers per thread held on [QH, D] tail launches of one or two warps whose [QH, BLOCK_T, D] tile is at
# most 16 elements a thread (G = 3-4 at one warp, G = 5-8 at two, heads up to 128, one token per step).
# Their uncapped builds take 56-72 registers, so a cap of 64 costs no spills; within it ptxas's schedules
# of the same kernel differed by 3-15% on the H200 (Triton 3.6; docs/rounds.md, "The thirty-first round"
# and "The thirty-second round"), and these caps gave the faster one at each point timed: 64 for the tail
# alone, 63 after the shared-run stage (G = 4 at B-4B; G = 8 at 64/8: 4-12% faster than uncapped).
# G = 4 at head 256 (one warp, 32 elements a thread) spilled 176-184 bytes a thread at 64 and ran 13-37%
# slower; uncapped (123-128 registers, no spills) it was the fastest, and keeps ptxas's own choice.
_SMALL_TILE_MAX_REGISTERS = 64
_SMALL_TILE_MAX_REGISTERS_AFTER_STAGE = 63
_SMALL_TILE_ELEMENTS_PER_THREAD = 16
# MHA's one-warp tiles of two KV heads and 4 tokens (32 elements a thread at head 128). With the error flag
# ptxas's own schedule ran 1.11-1.33x the time of a capped one on the H200 at the same 64 registers (Triton
# 3.6; 64 x 30 x 500, 16/16, tail 64: 226 against 170 us), and without it the caps were within 2% of each
# other. Caps of 64 and 80 gave the same time on Triton 3.6; Triton 3.9 spills 8 bytes a thread at 64 (and
# uncapped with the flag) and none at 80.
_MHA_TILE_MAX_REGISTERS = 80
# The few-rows tiling with the error flag: left to itself ptxas held it to 128 registers and spilled 8-16
# bytes a thread (Triton 3.9, sm_90); uncapped it takes 133-146 and spills nothing. Its programs are few,
# so registers do not limit its occupancy.
_FEW_ROWS_MAX_REGISTERS = 255


def _register_cap(cfg: "TailLaunchConfig", head_dim: int, skip_shared: bool, report_errors: bool) -> Optional[int]:
    """The ``maxnreg`` a CUDA launch of tiling ``cfg`` passes to ptxas (``None``: ptxas's own choice).

    ``[QH, D]`` tiles without index blocks: of one or two warps and at most ``_SMALL_TILE_ELEMENTS_PER_THREAD``
    elements a thread, 64 registers (63 after the shared-run stage); MHA's one-warp tiles of up to twice that,
    80. Other tiles are left uncapped (capped, the grouped kernel's one-warp tiles, G = 16's two-warp tiles and
    G = 4's at head 256 spilled). The few-rows tiling (index blocks) with the error flag is lifted to 255 (see
    ``_FEW_ROWS_MAX_REGISTERS``). (Two flag tiles that spilled on Triton 3.6 while the tail kernels ran the table
    checks, rounds 70-71, had caps of their own; since the checks moved into the audit, round 72, neither spills
    uncapped on Triton 3.6 or 3.9, and round 73 dropped the caps.)"""
    if cfg.grouped or cfg.index_block:
        return _FEW_ROWS_MAX_REGISTERS if report_errors and cfg.index_block else None
    threads = 32 * cfg.num_warps
    tile = cfg.group_pad * cfg.kv_heads_per_prog * cfg.block_t * head_dim
    if cfg.num_warps <= 2 and tile <= _SMALL_TILE_ELEMENTS_PER_THREAD * threads:
        return _SMALL_TILE_MAX_REGISTERS_AFTER_STAGE if skip_shared else _SMALL_TILE_MAX_REGISTERS
    if cfg.num_warps == 1 and cfg.group_pad == 1 and tile <= 2 * _SMALL_TILE_ELEMENTS_PER_THREAD * threads:
        return _MHA_TILE_MAX_REGISTERS
    return None


SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Measured with ptxas for sm_90: Triton 3.6 lays out the [QH, BLOCK_T, D] tile like the [QH, D]
# tiles, Triton 3.9 the [BLOCK_T, QH, D] one (see tail_merge_kernel.py). Versions in between are
# unmeasured and take the newer choice.
_TOKENS_OUTER = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
MAX_GROUP_SIZE = 64
# Tail positions whose page indices are loaded as one vector (TailLaunchConfig.index_block; 0 walks
# the index chain one K/V tile at a time). Measured on the H200 (docs/results/h200/
# tune_tail_index_block.json, same tiling otherwise): index blocks of 16/32 were 1-6% slower at the
# short tails beam-search decode runs (3-4 tokens: 128x96 t3 105.1 vs 101.7 us, 64x30 t4 26.3 vs
# 25.0 us) and 6% faster only at tail 32 (523 vs 555 us). Short tails are the common case, so 0.
DEFAULT_INDEX_BLOCK = 0


@dataclass(frozen=True)
class TailLaunchConfig:
    """Tiling of one launch.

    Attributes:
        group_pad: ``G`` rounded up to a power of two (query slots per KV head).
        kv_heads_per_prog: KV heads one program handles (a power of two).
        block_t: earlier tail tokens per loop iteration.
        num_warps: warps per program.
        tokens_outer: orientation of the K/V tile, ``[BLOCK_T, QH, D]`` (True) or ``[QH, BLOCK_T, D]``
            (False); same results, the faster one depends on the Triton version (see the kernel).
        index_block: ``0`` walks the tail one ``block_t`` tile at a time, each tile a chain of three
            dependent loads (source beams, page entries, K/V). A power of two ``>= block_t`` loads the
            source beams and page entries of ``index_block`` positions at once (two vector loads per
            index block), then streams the K/V tiles with the next tile requested before the current
            one is consumed: about ``3 + ceil(n / index_block) * 2`` dependent latencies instead of
            ``3 n`` for ``n`` earlier tokens.
        grouped: run :mod:`~triton_kernels.tail_merge_grouped_kernel` (the group in each thread's
            registers; ``block_t`` 1 and ``index_block`` 0 only; ``tokens_outer`` is ignored).
    """

    group_pad: int
    kv_heads_per_prog: int
    block_t: int
    num_warps: int
    tokens_outer: bool = False
    index_block: int = 0
    grouped: bool = False


# The grouped kernel's tiling at G = 2 (the only group where it was fastest): 8 KV heads per
# program (a whole row at Hkv = 8) and 32 query elements per thread (its 2 query heads x 8 head-dim
# lanes x 2 KV heads), which sets the warps per program.
_GROUPED_KV_HEADS_PER_PROG = 8
_GROUPED_ELEMENTS_PER_THREAD = 32


# Few rows: below these row-KV-heads (``rows * Hkv``) per padded group and head size the tail kernel has
# too few programs to hide its index chain, so it walks 4 tokens per iteration with the source beams and
# page entries of 32 positions loaded at once. Measured on the H200 (tail stage alone, CUDA graphs, L2
# flushed; docs/results/h200/tune_tail_{long,rows}_round24_*.json, tails 4, 16 and 64 at 32-1,024
# row-KV-heads): 1.04-3.53x faster than the previous default, within 1.00-1.37x of each shape's best tiling.
# Above them it lost: at G = 2 and 4 (from 4,096) to the previous defaults, at G = 8 (from 1,024) to the
# 2-warp tiling below.
# At G = 16 and 32 (head 128; twenty-sixth round, tune_tail_round26_wide_groups.json and _g32_g64.json, 64-256
# row-KV-heads; 8 warps at G = 32) it was within 1.00-1.09x of the best tiling, where the tilings it
# replaced took 1.08-1.87x. G = 1 at head 128 has its own few-rows tiling (below, without index blocks); other
# shapes not listed (G = 1 at other heads, G = 4 at head 64 and 256, G = 16 and 32 at other heads) are unmeasured
# and keep the defaults below.
# G = 8 (5-8) at head 64 up to 1,024 (fifty-second round, tune_tail_round52_g7_d64.json, GQA 14/2, tails 12 and
# 32): 1.5-2.0x faster than the default at 1,024; above it the many-rows tiling below.
_FEW_ROWS_MAX_ROW_KV_HEADS = {(2, 64): 1024, (2, 128): 1024, (2, 256): 1024, (4, 128): 1024,
                              (8, 64): 1024, (8, 128): 512, (8, 256): 512, (16, 128): 256, (32, 128): 128}
_FEW_ROWS_BLOCK_T = 4
_FEW_ROWS_INDEX_BLOCK = 32
# G = 8 at head 128 above the few-rows bound: the [QH, D] kernel with 2 warps, 4 tokens per iteration
# under 1,536 row-KV-heads and 1 from there (the H200, same files, 1,024-12,288 row-KV-heads: 1.07-1.56x
# faster than the previous default of 4 warps and 1 token, within 1.00-1.16x of the best tiling).
_MANY_ROWS_G8_SPLIT = 1536
# G = 8 at head 64 above the few-rows bound: two KV heads and one token per 2-warp program, with index blocks
# of 32 positions. The H200, tail stage alone (fifty-third round, tune_tail_round53_g8_d64_many_rows.json: GQA
# 14/2, 28/4 and 48/8, 1,536-26,112 row-KV-heads, tails 12 and 32, 20 tilings): within 1.00-1.04x of the best
# tiling of each shape, 1.08-1.39x faster than the few-rows tiling (the default up to 8,192 in round 52) and
# 1.13-1.63x faster than the previous default; at 1,024 (round 52) the few-rows tiling stays 1.09x (12 tokens) and
# 1.30x (32) faster. End to end (tail_tiling_round5{2,3}_g7_kv4_d64_round53.json, 28/4) 1.03-1.11x faster from 4,096,
# but 4-5% slower at 3,072 row-KV-heads and 48 tokens.
_MANY_ROWS_G8_D64_KV_HEADS_PER_PROG = 2
# Groups of 9-32 query heads per KV head (padded to 16 and 32) at head 128, above the few-rows bound: the
# [QH, D] kernel with one KV head per program, 4 tokens per iteration and 32 query elements per thread (2
# warps at G = 16, 4 at 32; the grouped kernel's _GROUPED_ELEMENTS_PER_THREAD). The H200, tail stage alone,
# 1,920-15,360 row-KV-heads and tails 4-64 (docs/results/h200/tune_tail_round26_wide_groups.json, GQA 96/8,
# 64/4, 16/1 and 32/1): within 1.00-1.08x of the best of 24 tilings, where the previous default (2 tokens,
# 4-8 warps) took 1.07-1.44x.
# G = 64 at head 128 (padded; 33-64): one token per iteration, 8 warps, index blocks of 32 positions up to
# 128 row-KV-heads (the H200, same file: 1,920 row-KV-heads 1.00x of the best at tails 4-64, where the
# previous default of 2 tokens and 16 warps took 1.52-1.71x; 128 row-KV-heads 1.00-1.06x, against 1.18-1.39x).
_GROUP_64_WARPS = 8
_GROUP_64_FEW_ROW_KV_HEADS = 128
# G = 1 (MHA) at head 128: the [QH, D] kernel with one warp and 4 tokens per iteration, 2 KV heads per
# program, and one at up to 1,024 row-KV-heads (the H200, tail stage alone, 1,024-30,720 row-KV-heads,
# tails 4-64; docs/results/h200/tune_tail_round32_g1*.json).
_G1_KV_HEADS_PER_PROG = 2
_G1_FEW_ROW_KV_HEADS = 1024


@functools.lru_cache(maxsize=None)
def tail_launch_config(group_size: int, num_kv_heads: int, head_dim: int,
                       num_rows: Optional[int] = None) -> TailLaunchConfig:
    """The tiling for a shape, chosen by measurement on the H200 (``python -m microbenchmarks.tune_tail``;
    ``docs/results/h200/tune_tail_round6_grouped*.json``, 24-32 tilings of both kernels per shape, and
    ``tune_tail_{long,rows}_round24_*.json``, 24-32 tilings at 32-15,360 row-KV-heads and tails 4-64).

    ``num_rows`` (beam rows of the launch; ``None``: many) selects a tiling for few rows; it is fixed for
    a captured CUDA graph, so the choice is too.

    - Few rows (``num_rows * Hkv`` up to 1,024 at ``G = 2`` and ``4``, up to 512 at ``G = 8`` (1,024 at head 64),
      up to 256 and 128 at ``G = 16`` and ``32`` (head 128); heads 64-256 where measured): the ``[QH, D]`` kernel
      with ``QH = 4-32`` query slots (2 KV heads per program at ``G = 2``), 4 tokens per iteration and index
      blocks of 32 positions, 2-8 warps by tile size. With so few programs each one's chain of dependent loads is
      the step's time; the index blocks cut it from three latencies per token to about two per 32 tokens: 8 x 8 x
      500 at 16/8, tail 64, 19.8 against 53.1 us; 1 x 32 rows at MQA 8/1, tail 16, 9.8 against 19.9 us; at tail 4
      1.04-1.35x faster.
    - ``G = 2`` (padded): the grouped kernel (:mod:`~triton_kernels.tail_merge_grouped_kernel`), 8
      KV heads per program, 32 query elements per thread (2 warps at D = 128). Against the previous
      default (the ``[QH, D]`` kernel, ``QH * D = 1024``, 4 warps): 128 x 96 tail 3 87.8 against
      96.7 us, tail 32 374.0 against 557.2, B-short 19.8 against 23.2, B-medium 20.1 against 24.1,
      B-beam14 12.8 against 16.1; the best tiling of each of those shapes.
    - ``G = 4`` (padded; 3 and 4): the ``[QH, D]`` kernel with one KV head per 1-warp program (its 4
      query slots, 2 per thread): B-4B 28.9-29.1 against 35.5-35.7 us for the previous default and
      29.9-30.1 for the grouped kernel's best tiling.
    - ``G = 8`` (padded; 5-8) at head 128: one KV head per 2-warp program, 4 tokens per iteration under
      1,536 row-KV-heads, 1 from there (MQA 128 x 96 at 8/1, tail 4, 45.8 against 52.6 us; 64 x 30 at
      32/4, tail 64, 274.8 against 328.5 us).
    - ``G = 8`` at head 64: two KV heads and one token per 2-warp program, index blocks of 32 positions (GQA 14/2
      at 2,048 row-KV-heads, tail 12, 14.4 against 17.6 us for the few-rows tiling; 28/4 at 12,288, 55.9
      against 62.3 for the previous default).
    - ``G = 16`` and ``32`` (padded; 9-32) at head 128: one KV head per program, 4 tokens per iteration, 2
      and 4 warps (32 query elements per thread): 64 x 30 x 500 at 96/8, tail 4, 74.4 against 96.1 us; at
      32/1, tail 64, 212.8 against 275.1 us; within 1.08x of each shape's best tiling from 1,920 row-KV-heads.
    - ``G = 64`` (padded; 33-64) at head 128: one KV head and one token per 8-warp program, with index blocks
      of 32 positions up to 128 row-KV-heads: 64 x 30 x 500 at 64/1, tail 4, 54.0 against 92.3 us.
    - ``G = 1`` (MHA) at head 128: the ``[QH, D]`` kernel with one warp and 4 tokens per iteration, 2 KV heads
      per program, and one at up to 1,024 row-KV-heads: 64 x 30 x 500 at 16/16, tail 64, 155.1 against 175.1
      us for the previous default, 64 x 96 456.7 against 506.7, 8 x 8 21.1 against 47.9; within 0.8% of it
      at tail 4.
    - Otherwise (``G = 1``, ``G = 8`` (head 256), ``16-32`` and ``64`` at heads other than above; unmeasured): the
      previous default, the ``[QH, D]`` kernel with about 1024 query-slot elements per program, 4 warps, ``block_t`` 1
      (2 above 1024); a group wider than that (MQA, G = 32 or 64) stays in one program with 8-16 warps (at G = 64
      and D = 256, 128 registers). The grouped kernel spreads groups above 4 over threads and warps again
      (167-225 registers at G = 16-32 on sm_90).
    """
    group_pad = next_power_of_2(group_size)
    few_rows_bound = _FEW_ROWS_MAX_ROW_KV_HEADS.get((group_pad, head_dim))
    if few_rows_bound is not None and num_rows is not None and num_rows * num_kv_heads <= few_rows_bound:
        kv_heads_per_prog = min(next_power_of_2(num_kv_heads), max(1, 4 // group_pad))
        tile = _FEW_ROWS_BLOCK_T * group_pad * kv_heads_per_prog * head_dim
        # 2-4 warps by tile; the 16K-element tile of G = 32 takes 8 (at 4 it ran 33-39x the best time).
        num_warps = max(2, min(4, tile // 1024), tile // 2048)
        return TailLaunchConfig(group_pad, kv_heads_per_prog, _FEW_ROWS_BLOCK_T, num_warps, _TOKENS_OUTER,
                                _FEW_ROWS_INDEX_BLOCK)
    if group_pad == 2:
        kv_heads_per_prog = min(next_power_of_2(num_kv_heads), _GROUPED_KV_HEADS_PER_PROG)
        elements = group_pad * kv_heads_per_prog * head_dim
        num_warps = max(1, elements // (32 * _GROUPED_ELEMENTS_PER_THREAD))
        return TailLaunchConfig(group_pad, kv_heads_per_prog, 1, num_warps, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK,
                                grouped=True)
    if group_pad == 4:
        return TailLaunchConfig(group_pad, 1, 1, 1, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK)
    if group_pad == 8 and head_dim == 128 and num_rows is not None:
        block_t = 4 if num_rows * num_kv_heads < _MANY_ROWS_G8_SPLIT else 1
        return TailLaunchConfig(group_pad, 1, block_t, 2, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK)
    if group_pad == 8 and head_dim == 64:
        kv_heads_per_prog = min(next_power_of_2(num_kv_heads), _MANY_ROWS_G8_D64_KV_HEADS_PER_PROG)
        return TailLaunchConfig(group_pad, kv_heads_per_prog, 1, 2, _TOKENS_OUTER, _FEW_ROWS_INDEX_BLOCK)
    if group_pad in (16, 32) and head_dim == 128:
        num_warps = group_pad * head_dim // (32 * _GROUPED_ELEMENTS_PER_THREAD)
        return TailLaunchConfig(group_pad, 1, 4, num_warps, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK)
    if group_pad == 64 and head_dim == 128:
        few = num_rows is not None and num_rows * num_kv_heads <= _GROUP_64_FEW_ROW_KV_HEADS
        return TailLaunchConfig(group_pad, 1, 1, _GROUP_64_WARPS, _TOKENS_OUTER,
                                _FEW_ROWS_INDEX_BLOCK if few else DEFAULT_INDEX_BLOCK)
    if group_pad == 1 and head_dim == 128:
        few = num_rows is not None and num_rows * num_kv_heads <= _G1_FEW_ROW_KV_HEADS
        kv_heads_per_prog = 1 if few else min(next_power_of_2(num_kv_heads), _G1_KV_HEADS_PER_PROG)
        return TailLaunchConfig(1, kv_heads_per_prog, 4, 1, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK)
    target_slots = max(group_pad, 1024 // head_dim)
    kv_heads_per_prog = max(1, min(next_power_of_2(num_kv_heads), target_slots // group_pad))
    tile = group_pad * kv_heads_per_prog * head_dim
    block_t = 1 if tile <= 1024 else 2
    num_warps = min(16, max(4, tile // 512))
    return TailLaunchConfig(group_pad, kv_heads_per_prog, block_t, num_warps, _TOKENS_OUTER, DEFAULT_INDEX_BLOCK)


def tail_supported(group_size: int, head_dim: int) -> tuple[bool, str]:
    """Whether the Triton tail kernel tiles this shape: ``(True, "")`` or ``(False, reason)``."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return False, (f"head_dim={head_dim} is not supported by the Triton tail kernel "
                       f"(supported: {SUPPORTED_HEAD_DIMS})")
    if group_size > MAX_GROUP_SIZE:
        return False, f"GQA group size Hq/Hkv={group_size} exceeds {MAX_GROUP_SIZE}, the largest group the kernel tiles"
    return True, ""


def _check_launchable(q: torch.Tensor, head_dim: int, group_size: int) -> None:
    ok, reason = tail_supported(group_size, head_dim)
    if not ok:
        raise KernelInputError(f"{reason}; use beam_tail_attention_merge_torch for this shape.")
    if not q.is_cuda and not runs_interpreted(beam_tail_merge_kernel):
        raise KernelInputError(
            f"beam_tail_attention_merge runs a Triton kernel and needs CUDA tensors, got {q.device}; "
            f"use beam_tail_attention_merge_torch on CPU (or set TRITON_INTERPRET=1 before importing triton)."
        )


def _check_config(cfg: TailLaunchConfig, group_size: int) -> None:
    if not isinstance(cfg, TailLaunchConfig):
        raise KernelInputError(f"launch_config must be a TailLaunchConfig or None, got {type(cfg).__name__}.")
    for name in ("group_pad", "kv_heads_per_prog", "block_t", "num_warps"):
        value = getattr(cfg, name)
        if not is_pow2(value):
            raise KernelInputError(f"launch_config.{name}={value!r} must be a power of two >= 1.")
    ib = cfg.index_block
    if not (isinstance(ib, int) and (ib == 0 or (is_pow2(ib) and ib >= cfg.block_t))):
        raise KernelInputError(
            f"launch_config.index_block={ib!r} must be 0 (no index blocks) or a power of two >= "
            f"block_t={cfg.block_t}."
        )
    if cfg.grouped and (cfg.block_t != 1 or cfg.index_block):
        raise KernelInputError(
            f"launch_config.grouped=True takes block_t=1 and index_block=0, got block_t={cfg.block_t}, "
            f"index_block={cfg.index_block}."
        )
    if cfg.group_pad < group_size:
        raise KernelInputError(
            f"launch_config.group_pad={cfg.group_pad} is smaller than the GQA group size {group_size}; "
            f"use a power of two >= {group_size}."
        )


def beam_tail_attention_merge(
    q,
    new_k,
    new_v,
    kv_cache,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    prefix_out,
    prefix_lse,
    out,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    prefix_lse_layout="NH",
    prefix_lse_base="log2",
    write_kv=True,
    validate_indices=False,
    launch_config=None,
    error_flags=None,
    tail_skip=None,
):
    """Fused per-beam tail attention, KV write and LSE merge with the prefix state (one launch).

    For beam row ``i = r*W + b`` with prompt length ``P`` and KV length ``L`` (this step's token
    included), computes ``out[i, h] = merge((prefix_out[i, h], prefix_lse[i, h]), tail)`` where
    ``tail`` is attention of ``q[i, h]`` over positions ``[P, L)``: position ``L - 1`` is
    ``new_k[i]``/``new_v[i]``; position ``t < L - 1`` is slot ``t % Pg`` of page
    ``beam_page_table[r*W + cache_indirection[r, b, t], t // Pg] // page_index_divisor``.

    Args:
        q: ``[rows, Hq, D]`` bf16/fp16, last dim contiguous (a strided view of a fused QKV buffer is fine).
        new_k, new_v: ``[rows, Hkv, D]`` in q's dtype, this step's K/V (strided views allowed).
        kv_cache: paged pool in q's dtype, ``[pages, 2, Hkv, Pg, D]`` (HND) or ``[pages, 2, Pg, Hkv, D]``
            (NHD); dim 1 is K, V; may be a strided view (e.g. one layer of a multi-layer pool).
        beam_page_table: ``[>= rows, max_pages]`` int32, any strides; ``entry // page_index_divisor`` is a
            page number. ``max_pages * Pg`` must cover ``cache_indirection``'s ``max_seq_len``.
        kv_lens: ``[rows]`` int32 on the device, KV length including this step's token (``L >= P + 1``).
        prompt_lens: ``[rows]`` int32 on the device, prompt length ``P`` per row.
        cache_indirection: ``[>= R, W_max, max_seq_len]`` int32, any strides, source beam per position.
        beam_width: ``W``; ``rows = R * W`` request-major, ``W <= W_max``.
        prefix_out: ``[rows, Hq, D]`` bf16/fp16/fp32, prefix partial output (last dim contiguous). Pass the
            query's dtype, as the library's wrapper does: float32 doubles these bytes and takes the grouped tile
            past 128 registers (137 against 125 at ``G = 2``, Triton 3.6), which cost the stage 14-38% on an H100
            (A-t3 133.5 against 109.1 us, B-short 28.9 against 21.9, B-4B 37.6 against 32.8) and 6-32% at head 256
            (``docs/rounds.md``, "The seventy-ninth round").
        prefix_lse: float32 prefix LSE, ``[rows, Hq]`` (``"NH"``) or ``[Hq, rows]`` (``"HN"``), any strides,
            base 2 (``"log2"``) or natural log (``"ln"``); ``-inf`` marks an empty prefix.
        out: ``[rows, Hq, D]`` in q's dtype, last dim contiguous, overlapping no other argument.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        kv_layout: ``"HND"`` or ``"NHD"``.
        page_index_divisor: ``1`` for page numbers; ``layers_in_pool * kv_factor`` for TensorRT-LLM block
            offsets (pass the K field ``block_offsets[..., 0, :]`` as ``beam_page_table``).
        prefix_lse_layout: ``"NH"`` (FlashInfer) or ``"HN"`` (FA4).
        prefix_lse_base: ``"log2"`` (FlashInfer) or ``"ln"`` (FA4).
        write_kv: store ``new_k``/``new_v`` at slot ``(L-1) % Pg`` of page
            ``beam_page_table[i, (L-1) // Pg] // page_index_divisor`` in the same launch.
        validate_indices: read lengths, page indices and indirection values back and check them
            (host sync; check mode only). Without it, out-of-range indices are masked in the kernel
            (never dereferenced) and give wrong results rather than faults, and a write position
            inside the prompt (``kv_len <= prompt_len``) is skipped.
        launch_config: a :class:`TailLaunchConfig` overriding :func:`tail_launch_config` (tuning and
            benchmarks only; the tiling never changes results beyond float32 summation order).
        error_flags: ``None``, or an ``int32 [1]`` tensor on q's device into which the kernel ORs one
            bit per kind of invalid index it masked (:mod:`triton_kernels.device_errors`; no sync). What no
            single index shows (beams unlike beam 0, a write page held twice, a table unlike the plan) is the
            page-table audit's (:func:`triton_kernels.audit_page_table`, once a step).
        tail_skip: ``None``, or ``[rows]`` int32 from :func:`triton_kernels.beam_shared_run_attention`, which
            attended each row's positions ``[P, P + tail_skip)`` and merged them into ``prefix_out`` and
            ``prefix_lse``: the tail then walks ``[P + tail_skip, L)``.

    Returns:
        ``out``.
    """
    write_kv = need_flag("write_kv", write_kv)
    validate_indices = need_flag("validate_indices", validate_indices)
    geom = check_tail_merge_args(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
        prefix_out, prefix_lse, out, sm_scale=sm_scale, kv_layout=kv_layout,
        page_index_divisor=page_index_divisor, prefix_lse_layout=prefix_lse_layout,
        prefix_lse_base=prefix_lse_base, write_kv=write_kv, error_flags=error_flags, tail_skip=tail_skip,
    )
    _check_launchable(q, geom.head_dim, geom.group_size)
    check_error_flags(error_flags, q.device)
    if tail_skip is not None:
        check_tail_skip(tail_skip, geom.num_rows, q.device)
    if validate_indices:
        check_tail_index_values(geom, beam_page_table, kv_lens, prompt_lens, cache_indirection, page_index_divisor)
    if geom.num_rows == 0:
        return out
    cfg = launch_config or tail_launch_config(geom.group_size, geom.num_kv_heads, geom.head_dim, geom.num_rows)
    _check_config(cfg, geom.group_size)
    grid = (geom.num_rows, cdiv(geom.num_kv_heads, cfg.kv_heads_per_prog))
    s_page, s_kv, s_head, s_slot = geom.kv_strides
    s_lse_row, s_lse_head = geom.lse_strides
    args = (
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection,
        prefix_out, prefix_lse, out,
        *q.stride()[:2],
        *new_k.stride()[:2],
        *new_v.stride()[:2],
        s_page, s_kv, s_head, s_slot,
        *beam_page_table.stride()[:2],
        *cache_indirection.stride()[:3],
        *prefix_out.stride()[:2],
        s_lse_row, s_lse_head,
        *out.stride()[:2],
        geom.beam_width, geom.page_size, page_index_divisor, geom.num_pages, geom.max_seq_len,
        geom.num_kv_heads,
        geom.sm_scale * LOG2E, geom.lse_scale,
    )
    # Both kernels take the same arguments; the [QH, D] kernel has three more constexprs.
    kernel = beam_tail_merge_grouped_kernel if cfg.grouped else beam_tail_merge_kernel
    meta = dict(GROUP=geom.group_size, GROUP_PAD=cfg.group_pad, KV_HEADS_PER_PROG=cfg.kv_heads_per_prog,
                HEAD_DIM=geom.head_dim, WRITE_KV=write_kv, num_warps=cfg.num_warps, num_stages=1)
    if not cfg.grouped:
        meta.update(BLOCK_T=cfg.block_t, TOKENS_OUTER=bool(cfg.tokens_outer), INDEX_BLOCK=cfg.index_block)
    if tail_skip is not None:
        meta.update(tail_skip_ptr=tail_skip, SKIP_SHARED=True)
    if error_flags is not None:
        meta.update(err_ptr=error_flags, REPORT_ERRORS=True)
    register_cap = _register_cap(cfg, geom.head_dim, tail_skip is not None, error_flags is not None)
    if register_cap is not None and q.is_cuda:  # (the interpreter has no registers)
        meta.update(maxnreg=register_cap)
    launch(kernel, grid, args, meta, q.device, pdl=True)
    return out
