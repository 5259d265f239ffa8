"""Launchers of the one-launch cascade kernel: the whole decode step, or its prefix stage alone.

:func:`beam_cascade_attention` is a beam-search decode step of one attention layer in one Triton
launch: each request's prompt attended once per block of beams on tensor cores, each beam's
generated tail gathered through ``cache_indirection``, this step's K/V written, no prefix state
through memory. It serves short and medium prompts, where a separate prefix kernel's launch and
the prefix-state round trip are a large share of the step (the measured rule that picks it is in
:mod:`beam_shared_prefix.prefix.cascade_rule`). No host sync: safe to capture in a CUDA graph, and the
prompt and tail lengths are read on the device at every replay.

:func:`beam_prefix_attention` runs only the prompt part and writes the prefix state (normalised
output and base-2 LSE, FlashInfer's ``[rows, heads]`` layout), for check mode and the stage
benchmarks, and as a plain prefix backend in front of the separate tail kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .cascade_kernel import beam_cascade_kernel
from .device_errors import check_error_flags
from .host_ints import cdiv, next_power_of_2
from .launch import launch
from .step_args import (
    KV_DTYPES,
    KV_LAYOUTS,
    LOG2E,
    KernelInputError,
    check_device,
    check_step_args,
    check_pool_extent,
    check_tail_index_values,
    check_written_overlaps,
    fail,
    is_pow2,
    need_dim,
    need_distinct_elements,
    need_dtype,
    need_flag,
    need_last_dim_contiguous,
    need_tensor,
    resolve_sm_scale,
)

__all__ = [
    "CascadeLaunchConfig",
    "cascade_launch_config",
    "narrow_tile_beams",
    "group_2_registers",
    "wide_launch_config",
    "cascade_supported",
    "shared_ancestry_reachable",
    "beam_cascade_attention",
    "beam_prefix_attention",
]

# Head sizes compiled and checked on the H200 (tests/triton_kernels/test_cascade.py runs both there).
# 256 would need its own tiling (a 64 x 256 fp32 accumulator is 128 registers per thread at 4 warps)
# and is left to the prefix backend + tail kernel path.
SUPPORTED_HEAD_DIMS = (64, 128)
# The wide tilings hold at least 16 beams a program (padding beams are masked); narrow widths take fewer
# (NARROW_TILE_BEAMS).
MIN_BEAMS_PER_PROGRAM = 16
# Narrow beam widths' tiles, ``{(head_dim, padded group): ((largest beam width, beams a program), ...)}``: a 16-beam
# tile holding 3-8 beams runs 8-13 padding beams' rows through every tensor-core product, and its registers (253-255 at
# G = 4, spills at G = 2 and 8) leave two programs a multiprocessor. On the H200 (CUDA graphs, L2 flushed, 4-token
# tails; tune_cascade_narrow*_round56.json) against the 16-beam tile: D = 128, G = 2, 8 beams at 3-8 beams 1.19-1.38x
# faster; G = 3-4, 4 beams at 3-4 beams 1.03-1.55x (154 registers, three a multiprocessor; 8 beams at 5-8 beams
# 0.95-1.03x, so they keep 16); G = 5-8, 8 beams at 3-8 beams 1.66-2.11x (with cascade_launch_config's 4 warps and
# 64-token blocks); D = 64, 8 beams at G = 2 1.18-1.75x, 4 beams at G = 4 and 8 at 3-4 beams 1.54-2.09x and 8 beams
# at 5-8 beams 1.38-1.66x. One beam block still holds a request's beams, so the prompt is read once a KV head. Since
# the fifty-seventh round G = 3-4 at D = 64 and 5-8 beams keep the 16-beam tile, whose 8-position tail blocks made it
# 4-5% faster than 8 beams a program (tune_cascade_narrow_d64_round56.json).
NARROW_TILE_BEAMS = {
    (128, 2): ((8, 8),),
    (128, 4): ((4, 4),),
    (128, 8): ((8, 8),),
    (64, 2): ((8, 8),),
    (64, 4): ((4, 4),),
    (64, 8): ((4, 4), (8, 8)),
}
# G = 2's 8- and 16-beam tiles at D = 128 (32 rows at most) cap a thread's registers at 128 (spilling 18-34 bytes,
# four programs a multiprocessor) or 168 (6 bytes, three): the lower where it saves the launch a wave (group_2_registers).
GROUP_2_TIGHT_REGISTERS = 128
GROUP_2_TIGHT_PROGRAMS_PER_SM = 4
GROUP_2_ROOMY_REGISTERS = 168
GROUP_2_ROOMY_PROGRAMS_PER_SM = 3
# Resident programs a multiprocessor of G = 3-4's 4-beam tile at D = 128 (154 registers a thread, 38 KB of shared
# memory) and of its 16-beam tile (253 registers).
NARROW_TILE_PROGRAMS_PER_SM = 3
WIDE_GROUP_4_TILE_PROGRAMS_PER_SM = 2
# Resident programs a multiprocessor of G = 5-8's 8-beam tile at D = 128 (255 registers a thread at 4 warps, 48 KB of
# shared memory; tune_cascade_narrow_g8_warps_round56.json): the wave that prefix/cascade_rule.py's rule counts there.
NARROW_TILE_GROUP_8_PROGRAMS_PER_SM = 2
# tl.dot needs 16 rows: a tile of fewer than 16 beams (NARROW_TILE_BEAMS, or an explicit launch_config) has at least
# this many query rows (beams x padded group).
MIN_BLOCK_M = 16
# Prompt tokens per iteration: at least two tensor-core tiles.
MIN_BLOCK_N = 32
# Columns of a tail key block (tail_block x beams per program): 16 failed to compile on Triton 3.6.
MIN_TAIL_COLUMNS = 32
# Prompt tables of at most this many tokens (columns x page size) take the one-block tiling of
# 32-beam tiles: every prompt of the launch then fits one key block (cascade_launch_config).
ONE_BLOCK_PROMPT_TOKENS = 128
# Beams of one tile: the masked tail key block has tail_block x beams columns of which each row sees
# tail_block, so its waste grows with the beams (64-beam tiles at G = 1: 91 against FA4 + tail's 58 us).
MAX_BEAMS_PER_PROGRAM = 32
# Query rows of one tile (beams x padded group): 128 keeps the fp32 accumulator at 64 registers per
# thread with 8 warps at D = 128.
MAX_BLOCK_M = {64: 128, 128: 128}
# Cached tail positions from which a tile looks for the run of positions all its beams share (the
# scan costs a dependent load before the prompt's; a shorter tail is walked per beam as it is).
SHARED_ANCESTRY_MIN_TAIL = 16
# Multiprocessors assumed where the launch's device is not a CUDA GPU (the H100's and H200's).
DEFAULT_MULTIPROCESSORS = 132
# Beams of the 128-row tile of GQA 3-4 at D = 64 (cascade_launch_config: where it pads no more beams than the
# 16-beam tile, the launch has more programs than multiprocessors and does not run a second wave at most half full).
WIDE_GROUP_HEAD_64_TILE_BEAMS = 32
# Resident 128-row programs a multiprocessor at D = 64 (255 registers a thread with 4 warps: two fit 64K registers),
# with 32 beams (GQA 3-4) as with 16 (GQA 5-8).
WIDE_TILE_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class CascadeLaunchConfig:
    """Tiling of one cascade launch.

    Attributes:
        beams_per_program: beams of one request in one program (a power of two: 16 or more in the wide tilings, 4
            or 8 in the narrow ones, :data:`NARROW_TILE_BEAMS`); the tile has ``beams_per_program * group_pad`` query
            rows (at least :data:`MIN_BLOCK_M`), and each program reads the request's prompt.
        group_pad: ``G`` rounded up to a power of two.
        block_n: prompt tokens per loop iteration (a power of two >= 32).
        tail_block: earlier tail positions per key block (a power of two).
        num_warps, num_stages: Triton launch parameters.
        max_registers: cap on registers per thread (``maxnreg``; ``None`` lets the compiler choose,
            up to 255). A lower cap fits more programs on an SM at the cost of spills.
        heads_per_program: KV heads one program runs one after the other (a power of two). They
            share the tail's index chain (source beams, pages), walked once for all of them.
        prompt_first: attend the prompt before the tail (the tail's index chain, requested at the
            program's start, then resolves behind the prompt's loads).
        prompt_stages: software-pipeline stages of the prompt loop (``None``: ``num_stages``); with
            more than one, its K/V go to shared memory by ``cp.async`` instead of through registers.
        tail_stages: software-pipeline stages of the tail loop (``None``: ``num_stages``); 2 was
            7-75% slower than the default on the H200 (more spills), so the defaults leave it off.
        tail_on_cores: attend the tail on CUDA cores, ``tail_block`` positions per step with the
            group in each thread's registers, before the prompt (its state seeds the prompt loop),
            instead of as masked tensor-core key blocks; excludes ``prompt_first``.
        shared_ancestry: in a tail of ``shared_min_tail`` cached positions or more, attend the
            leading run of positions that every beam of the tile reads from one source beam (beam
            search's coalesced history) once for the tile, as dense ``block_n`` key blocks, and only
            the rest per beam. Not with ``tail_on_cores``.
        shared_min_tail: the shortest cached tail (positions before this step's) scanned for such a run.
    """

    beams_per_program: int
    group_pad: int
    block_n: int = 64
    tail_block: int = 2
    num_warps: int = 4
    num_stages: int = 2
    max_registers: Optional[int] = None
    heads_per_program: int = 1
    prompt_first: bool = False
    prompt_stages: Optional[int] = None
    tail_stages: Optional[int] = None
    tail_on_cores: bool = False
    shared_ancestry: bool = True
    shared_min_tail: int = SHARED_ANCESTRY_MIN_TAIL

    @property
    def folds_shared_ancestry(self) -> bool:
        """Whether the launch has the shared-ancestry path (``shared_ancestry``; the core tail has none)."""
        return self.shared_ancestry and not self.tail_on_cores

    @property
    def block_m(self) -> int:
        """Query rows of one program's tile."""
        return self.beams_per_program * self.group_pad


def cascade_supported(group_size: int, head_dim: int) -> Tuple[bool, str]:
    """Whether the cascade kernel tiles this shape: ``(True, "")`` or ``(False, reason)``."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return False, f"head_dim={head_dim} is not tiled by the cascade kernel (supported: {SUPPORTED_HEAD_DIMS})"
    group_pad = next_power_of_2(group_size)
    max_group = MAX_BLOCK_M[head_dim] // MIN_BEAMS_PER_PROGRAM
    if group_pad > max_group:
        return False, (f"GQA group {group_size} (padded {group_pad}) times {MIN_BEAMS_PER_PROGRAM} beams exceeds the "
                       f"cascade tile of {MAX_BLOCK_M[head_dim]} query rows at head_dim={head_dim} (groups up to "
                       f"{max_group})")
    return True, ""


@functools.lru_cache(maxsize=None)
def cascade_launch_config(beam_width: int, group_size: int, head_dim: int,
                          prompt_capacity: Optional[int] = None, num_requests: int | None = None,
                          num_kv_heads: int = 1, num_sms: int = DEFAULT_MULTIPROCESSORS,
                          max_tail_len: int | None = None) -> CascadeLaunchConfig:
    """The default tiling for a shape (requires :func:`cascade_supported`), from H200 sweeps
    (``python -m microbenchmarks.tune_cascade``; ``docs/results/h200/tune_cascade*.json``).

    Narrow beam widths (:func:`narrow_tile_beams`: up to 4 or 8 beams, by group and head size) take the tiling of
    :func:`wide_launch_config` with fewer beams a program (at least :data:`MIN_BLOCK_M` query rows), a tail key
    block of at least :data:`MIN_TAIL_COLUMNS` columns, and 4 warps; at ``D = 128`` and G = 5-8 also 64-token prompt
    blocks. At G = 2 the 8-beam tile keeps the 16-beam tile's register cap (:func:`group_2_registers`). G = 3-4 at ``D = 128`` keeps the 16-beam tile
    where both would run two waves (more programs than :data:`NARROW_TILE_PROGRAMS_PER_SM` a multiprocessor hold, at
    most twice :data:`WIDE_GROUP_4_TILE_PROGRAMS_PER_SM`). Every other shape takes :func:`wide_launch_config`'s
    tiling, and the arguments mean the same there.
    """
    wide = wide_launch_config(beam_width, group_size, head_dim, prompt_capacity, num_requests, num_kv_heads, num_sms,
                              max_tail_len)
    beams = narrow_tile_beams(beam_width, group_size, head_dim)
    if beams is None:
        return wide
    if (head_dim == 128 and wide.group_pad == 4 and num_requests is not None
            and NARROW_TILE_PROGRAMS_PER_SM * num_sms < num_requests * num_kv_heads
            <= 2 * WIDE_GROUP_4_TILE_PROGRAMS_PER_SM * num_sms):
        # Both tiles run two waves here (three 4-beam programs a multiprocessor, two 16-beam ones), the narrow tile's
        # second at most a third full: 448 programs at 3,000 tokens took 218 us against the 16-beam tile's 197-198
        # (56 x 3 at GQA 32/8, 112 x 3 at 16/4; narrow_tile_round56_g4_kv*.json against select_heldout23_*.json).
        return wide
    tail_block = wide.tail_block if wide.tail_on_cores else max(wide.tail_block, MIN_TAIL_COLUMNS // beams)
    cfg = dataclasses.replace(wide, beams_per_program=beams, tail_block=tail_block, num_warps=4)
    if head_dim == 128 and wide.group_pad == 8:
        # The 128-row tile's 8 warps and 128-token blocks were 1.1-1.2x faster than 16 beams; 4 warps and 64-token
        # blocks (49 KB of shared memory) took the same 8 beams 1.5-1.7x further (tune_cascade_narrow_g8_warps_round56).
        cfg = dataclasses.replace(cfg, block_n=64)
    return cfg


def group_2_registers(num_requests: int | None, num_kv_heads: int, num_sms: int) -> int:
    """Register cap a thread of G = 2's 8- and 16-beam tiles at ``D = 128`` for a launch of one beam block a request:
    :data:`GROUP_2_ROOMY_REGISTERS` where its programs run in as many waves at :data:`GROUP_2_ROOMY_PROGRAMS_PER_SM` a
    multiprocessor as at :data:`GROUP_2_TIGHT_PROGRAMS_PER_SM`, else :data:`GROUP_2_TIGHT_REGISTERS` (also with the
    batch unknown, ``num_requests`` ``None``).

    The roomier cap spills 6 bytes instead of 18-34, so each program runs faster, but fits one program fewer a
    multiprocessor. On the H200 (4- and 32-token tails): 16 beams at W = 9-16, 3-16% faster at 64-768 programs in as
    many waves (8 x 16 x 2,000 to 96 x 12 x 800 at GQA 16/8), 8-25% slower where it added a wave (512 programs at GQA
    16/8 and 32/16, 400 at 4/2, 1,024); 8 beams at W = 3-8, 3-9% faster at 160-384 programs, 17% slower at 512
    (``tune_cascade_g2_regs_round57.json``, ``tune_cascade_g2_wide_regs_round57.json``,
    ``tune_cascade_narrow_g2_regs_round56.json``)."""
    if num_requests is None:
        return GROUP_2_TIGHT_REGISTERS
    programs = num_requests * num_kv_heads
    roomy_waves = cdiv(programs, GROUP_2_ROOMY_PROGRAMS_PER_SM * num_sms)
    if roomy_waves <= cdiv(programs, GROUP_2_TIGHT_PROGRAMS_PER_SM * num_sms):
        return GROUP_2_ROOMY_REGISTERS
    return GROUP_2_TIGHT_REGISTERS


def narrow_tile_beams(beam_width: int, group_size: int, head_dim: int) -> int | None:
    """Beams a program of the narrow tile holds for ``beam_width`` beams at GQA ``group_size`` and ``head_dim``
    (:data:`NARROW_TILE_BEAMS`), or ``None`` where the width takes :func:`wide_launch_config`'s tile."""
    for max_width, beams in NARROW_TILE_BEAMS.get((head_dim, next_power_of_2(group_size)), ()):
        if beam_width <= max_width:
            return beams
    return None


@functools.lru_cache(maxsize=None)  # the rule (prefix/cascade_rule.py, waves.py) asks for it at every eager step
def wide_launch_config(beam_width: int, group_size: int, head_dim: int,
                       prompt_capacity: Optional[int] = None, num_requests: int | None = None,
                       num_kv_heads: int = 1, num_sms: int = DEFAULT_MULTIPROCESSORS,
                       max_tail_len: int | None = None) -> CascadeLaunchConfig:
    """The tiling of 16 beams a program or more for a shape (requires :func:`cascade_supported`): the default
    (:func:`cascade_launch_config`) wherever the width is not narrow.

    ``prompt_capacity`` is the prompt page table's width in tokens (``None``: unknown). It bounds
    every prompt of the launch and is a shape, known on the host without a sync; under CUDA graphs
    the table is allocated at its maximum width, so a captured graph keeps the tiling for the
    longest prompts it may see. ``num_requests`` and ``num_kv_heads`` give the launch's program count
    (``None``: unknown, judged as many), against the GPU's ``num_sms`` multiprocessors. ``max_tail_len``
    bounds every row's tail (generated tokens, this step's included; ``None``: unknown): at most
    ``SHARED_ANCESTRY_MIN_TAIL`` leaves the shared-ancestry path out of the tilings below that measured
    faster without it, since such a tail never takes it (:func:`shared_ancestry_reachable`).

    - Beams per program: up to 64 query rows per tile (32 beams at G = 2): the kernel is latency-
      bound at decode shapes and the register file, not the tensor cores, limits how many programs
      are resident; 128-row tiles were 13% slower at B-4B (and 27% at A with the first design).
    - ``tail_block`` 4: a 4-token tail (3 earlier tokens and this step's, beam-search decode's
      common case) is one key block, so its gather chain (source beams, pages, K/V) is walked once
      (2.4x the floor against 3.3x with 1 or 2).
    - The prompt at ``D = 128`` and up to 64 rows: ``block_n`` 64 with a 3-stage pipeline of its own
      (its K/V go to shared memory by ``cp.async``, not through registers; 112 KB, still 2 programs
      per SM), the tail unpipelined. 64-row tiles of 32 beams (G = 2) attend the prompt first, so the
      tail's index chain resolves behind it; 16-beam tiles keep the tail first. Against the previous
      default (``block_n`` 128, one stage, tail first; ``tune_cascade_round4*.json``): B-medium 69.7
      against 77.6 us, B-long 179.2 against 200.9, B-beam14 69.3 against 76.5, B-4B 137.6 against
      140.6, B-short 40.4 against 40.3 (its 100-token prompt is under two blocks).
    - Elsewhere (``D = 64``, 128-row tiles) ``block_n`` 128 prompt tokens per iteration, one stage
      for 64-row tiles (two stages double the shared memory and halve the resident programs), two
      for smaller ones.
    - One KV head per program, no register cap: 2 or 4 heads per program (sharing the tail's index
      chain) were 0-12% slower at B-short, B-medium and B-beam14 (12% at B-medium with the prompt
      first) and a cap of 128 or 168 registers 30-100% slower, both from spills
      (``tune_cascade_heads.json``, ``tune_cascade_fused_current_and_maxnreg.json``).
    - 16-beam tiles at G = 2-4 and ``D = 128`` (beam widths up to 16 at G = 2; every width at G =
      3-4): the tail on CUDA cores before the prompt, the prompt in 64-token blocks with a 2-stage
      pipeline, and at 32 rows a 128-register cap (45 KB of shared memory: 4 programs per SM), or 168 where the
      launch runs as many waves at three programs a multiprocessor (:func:`group_2_registers`, fifty-seventh round).
      Against the masked tensor-core tail (``tune_cascade_round7_tail_on_cores_*.json``): B-beam14
      52.9-53.0 against 56.4-56.9 us, B-4B 104.5 against 116.1 (uncapped; capped at 4 warps it was
      slower than 177 us). In 32-beam tiles the core tail was slower: B-short 37.0 against 33.7 us.
    - 32-beam tiles at G = 2 whose prompt table holds at most 128 tokens (``prompt_capacity``): one
      128-token prompt block, one stage, the prompt first, which the kernel then runs as straight-line
      code with the tail's index chain split around the prompt's loads: 32.5 against 33.1 us (the
      same block, the tail first) and 33.7 us (the long-prompt tiling) at B-short
      (``tune_cascade_round7_tail_kv_order_v0_b_short.json``, ``tune_cascade_round7_defaults.json``).
    - 128-row tiles at ``D = 64`` (16 beams at G = 5-8) take 4 warps where the launch runs more programs than the
      GPU has multiprocessors, else 8. The tile holds 238-255 registers a thread, so 8 warps fit one program a
      multiprocessor and 4 fit two: at 4-token tails 4 warps took 64 x 30 x 256 at GQA 64/8 (1,024 programs) from
      108.2 to 84.5 us, 16 x 30 x 500 (256) from 41.5 to 36.9, 64 x 96 x 128 (3,072) from 249.2 to 183.3, 4 x 96 x
      128 (192) from 24.5 to 24.3, and at 64-token tails 64 x 30 x 256 from 343.1 to 244.1
      (``tune_cascade``'s ``g8_d64_warps_round45.json``, ``g8_d64_few_programs_round45.json``). Where every program
      has a multiprocessor of its own the 8 warps finish a program's rows sooner: 14.4 against 21.0 us at 4 x 8 x
      128 (32 programs), 24.4 against 34.7 at 16 x 16 x 512 (128), 23.9 against 33.0 at GQA 40/8, 16 x 8 x 500.
    - GQA 3-4 at ``D = 64`` takes 32-beam tiles (128 rows, 4 warps, ``block_n`` 128) where the width fills them as
      well as 16-beam ones (``W`` of 17-32, 49-64, 81-96, ...: no more padding beams) and the launch, counted in
      32-beam blocks, still has more programs than the GPU has multiprocessors: each program reads its request's
      prompt for 32 beams instead of 16. On the H200 (Triton 3.6: 255 registers and 36-48 bytes of spill, two programs
      a multiprocessor as with 16 beams) that took 8-18% off every shape measured at 4- and 64-token tails, 192-1,536
      programs (64 x 30 x 500 at GQA 32/8: 74.5 against 67.4 us; 64 x 96 x 256: 145.2 against 118.8; GQA 24/8, 32 x
      96 x 256: 76.0 against 64.5), and was 4-6% slower at 24 x 48 (16 padding beams a request, the 16-beam tile none)
      and 53-69% at 64 x 14 (``tune_cascade``'s ``g4_d64_tile32_round45.json``, ``g4_d64_tile32_round46.json``). With
      the batch unknown (``num_requests`` ``None``) the 16-beam tile stays: fewer programs than multiprocessors were
      not measured, and the ``auto`` rule (``prefix/cascade_rule.py``) counts that tile's beam blocks. Where the 32-beam
      launch would run two waves, the second at most half full (two programs a multiprocessor make a wave), the
      16-beam launch runs three waves of programs that finish in about half the time, and it stays
      (:func:`wide_group_head_64_tile_choice`): 4-11% faster at 272-384 programs (34 x 32 x 384 at GQA 32/8: 44.0
      against 48.6 us; 48 x 32 x 512 at GQA 24/8: 57.8 against 64.3; 12 x 96 x 128: 30.6 against 31.8), while the
      32-beam tile stayed 8-15% faster with full waves (64 x 32 x 512: 68.9 against 74.8) and one wave (GQA 24/8,
      8 x 96 x 256: 24.8 against 28.5; ``tune_cascade``'s ``g34_d64_tile_waves_round49.json``), and even or up to 5%
      faster past two waves (``g34_d64_tile_waves_more_round49.json``).
    - A launch whose tails are all too short for the shared-ancestry path (``max_tail_len``) leaves it out of the
      ``block_n`` 128 tilings (head 64, and groups 5-8 at head 128), whose steps it cost 1-26% at 4 and 16
      generated tokens on the H200; the head-128 tiles of groups 1-2 keep it (within 3% either way, preset A 2%
      slower without it; ``docs/rounds.md``, "The forty-fifth round").
    - ``shared_ancestry`` (the run of tail positions every beam of a tile reads from one ancestor,
      folded once for the tile) is on in every masked-tail tiling but the one-block one. Where the
      histories coalesce it took 64 x 30 x 500 with 255 earlier positions from 600 to 246 us, and
      64 x 30 x 2,000 from 695 to 332-344; the test for it costs a 4-token step 1.0-1.5 us (B-medium
      58.6 against 57.4-57.6 us, B-long 147.3-147.8 against 146.3), and the one-block tiling 1.1-1.3
      us of B-short's 32.0-32.1, which sits on its 2.0x target (``ab_shared_round27_final.json``).
      It is off in the 16-beam tiles of G = 3-4 at ``D = 64`` too: there it spilled (6 bytes, Triton 3.6) and cost
      every step 12-26% on the H200 (64 x 32 x 512 at GQA 32/8: 84.4 against 74.5 us; 24 x 48 x 256: 46.1
      against 36.8; ``tune_cascade_g4_d64_round44.json``), which had made the cascade slower than FA4 + tail
      wherever the rule took it with several beam blocks (``docs/rounds.md``, "The forty-fourth round").
    """
    group_pad = next_power_of_2(group_size)
    beams = _group_pad_beams(beam_width, group_pad, head_dim)
    if wide_group_head_64_tile_choice(beam_width, group_size, head_dim, num_requests, num_kv_heads, num_sms) == "wide":
        beams = WIDE_GROUP_HEAD_64_TILE_BEAMS
    block_m = beams * group_pad
    num_warps = 4 if block_m <= 64 else 8
    if head_dim == 64 and block_m > 64 and (
            num_requests is None or num_requests * num_kv_heads * cdiv(beam_width, beams) > num_sms):
        num_warps = 4
    tail_block = max(4, MIN_TAIL_COLUMNS // beams)
    if head_dim == 64 and group_pad == 4 and beams == 16:
        # 8-position tail blocks: 1.02-1.48x faster than 4 at 4-token tails and 1.3-2.2x at 32, GQA 32/8, 24/8 and 16/4,
        # 9-30 beams, 128-768 programs (tune_cascade_d64_tail_block_round57.json, ..._wide_tail_block_round57.json).
        tail_block = 8
    if head_dim == 128 and beams == 16 and 2 <= group_pad <= 4:
        registers = group_2_registers(num_requests, num_kv_heads, num_sms) if block_m <= 32 else None
        return CascadeLaunchConfig(beams, group_pad, block_n=64, tail_block=4, num_warps=4, num_stages=1,
                                   max_registers=registers, prompt_stages=2, tail_on_cores=True)
    if (head_dim == 128 and beams == 32 and block_m == 64 and prompt_capacity is not None
            and prompt_capacity <= ONE_BLOCK_PROMPT_TOKENS):
        return CascadeLaunchConfig(beams, group_pad, block_n=128, tail_block=tail_block, num_warps=4, num_stages=1,
                                   prompt_first=True, shared_ancestry=False)
    if head_dim == 128 and block_m <= 64:
        return CascadeLaunchConfig(beams, group_pad, block_n=64, tail_block=tail_block, num_warps=num_warps,
                                   num_stages=1, prompt_first=(block_m == 64 and beams == 32), prompt_stages=3)
    num_stages = 1 if block_m >= 64 else 2
    shared = not (head_dim == 64 and group_pad == 4) and shared_ancestry_reachable(max_tail_len)
    return CascadeLaunchConfig(beams, group_pad, block_n=128, tail_block=tail_block,
                               num_warps=num_warps, num_stages=num_stages, shared_ancestry=shared)


def _group_pad_beams(beam_width: int, group_pad: int, head_dim: int) -> int:
    """Beams a program of the default tiles holds (64 rows at most), before GQA 3-4's 32-beam tile."""
    rows_cap = min(64, MAX_BLOCK_M[head_dim])
    cap = max(MIN_BEAMS_PER_PROGRAM, min(MAX_BEAMS_PER_PROGRAM, rows_cap // group_pad))
    return max(MIN_BEAMS_PER_PROGRAM, min(next_power_of_2(beam_width), cap))


def wide_group_head_64_tile_choice(beam_width: int, group_size: int, head_dim: int, num_requests: int | None,
                                   num_kv_heads: int, num_sms: int) -> str | None:
    """How GQA 3-4 at ``D = 64`` tiles a batch's beams: ``"wide"`` (the 32-beam tile, 128 rows), ``"half_wave"``
    (16 beams, where 32-beam blocks would fit the width but their launch would run two waves, the second at most half
    full) or ``None`` (16 beams: another group or head size, the batch unknown, padding beams, or no more 32-beam
    programs than ``num_sms``). ``num_requests`` ``None`` (unknown batch) keeps the 16-beam tile."""
    wide = WIDE_GROUP_HEAD_64_TILE_BEAMS
    if head_dim != 64 or next_power_of_2(group_size) != 4 or num_requests is None:
        return None
    beams = _group_pad_beams(beam_width, 4, head_dim)
    if beam_width <= beams:
        return None
    if cdiv(beam_width, wide) * wide != cdiv(beam_width, beams) * beams:
        return None
    programs = num_requests * num_kv_heads * cdiv(beam_width, wide)
    if programs <= num_sms:
        return None
    # A 16-beam program finishes in about 0.54 of a 32-beam one's time on the H200, so where a two-wave 32-beam launch's
    # second wave is at most half full, the 16-beam launch (three waves of twice the programs) is the shorter: 4-11%
    # faster at 272-384 programs (tune_cascade's g34_d64_tile_waves_round49.json). Past two waves the saved wave is a
    # smaller share: at three the tiles were within 1.4% either way or the 32-beam one 4-5% faster, at four 4% faster
    # (g34_d64_tile_waves_more_round49.json), so it stays.
    slots = WIDE_TILE_PROGRAMS_PER_SM * num_sms
    if slots < programs <= slots + slots // 2:
        return "half_wave"
    return "wide"


def shared_ancestry_reachable(max_tail_len: int | None, shared_min_tail: int = SHARED_ANCESTRY_MIN_TAIL) -> bool:
    """Whether a launch whose tails are at most ``max_tail_len`` generated tokens (this step's included;
    ``None``: unknown) may take the shared-ancestry path, which looks at ``shared_min_tail`` cached
    positions or more."""
    return max_tail_len is None or max_tail_len - 1 >= shared_min_tail


@functools.cache
def cuda_sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (read once per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a launch's device (read once per GPU); :data:`DEFAULT_MULTIPROCESSORS` off CUDA."""
    if device.type != "cuda":
        return DEFAULT_MULTIPROCESSORS
    return cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _resolve_config(cfg, beam_width: int, group_size: int, head_dim: int,
                    prompt_capacity: int | None = None, num_requests: int | None = None,
                    num_kv_heads: int = 1, device: torch.device | None = None,
                    max_tail_len: int | None = None) -> CascadeLaunchConfig:
    ok, reason = cascade_supported(group_size, head_dim)
    if not ok:
        raise KernelInputError(f"{reason}; use the prefix backend + tail kernel path (backend='fa4' or "
                               f"'flashinfer').")
    if cfg is None:
        sms = DEFAULT_MULTIPROCESSORS if device is None else launch_multiprocessors(device)
        return cascade_launch_config(beam_width, group_size, head_dim, prompt_capacity, num_requests, num_kv_heads,
                                     sms, max_tail_len)
    if not isinstance(cfg, CascadeLaunchConfig):
        raise KernelInputError(f"launch_config must be a CascadeLaunchConfig or None, got {type(cfg).__name__}.")
    for name in ("beams_per_program", "group_pad", "block_n", "tail_block", "num_warps", "heads_per_program"):
        if not is_pow2(getattr(cfg, name)):
            raise KernelInputError(f"launch_config.{name}={getattr(cfg, name)!r} must be a power of two >= 1.")
    if cfg.block_m < MIN_BLOCK_M or cfg.block_n < MIN_BLOCK_N:
        raise KernelInputError(
            f"launch_config has beams_per_program={cfg.beams_per_program} x group_pad={cfg.group_pad} = {cfg.block_m} "
            f"query rows and block_n={cfg.block_n}; they must be >= {MIN_BLOCK_M} and >= {MIN_BLOCK_N} (tensor-core "
            f"tiles): use more beams a program.")
    if not cfg.tail_on_cores and cfg.tail_block * cfg.beams_per_program < MIN_TAIL_COLUMNS:
        raise KernelInputError(
            f"launch_config has tail_block={cfg.tail_block} x beams_per_program={cfg.beams_per_program} = "
            f"{cfg.tail_block * cfg.beams_per_program} tail key columns; use at least {MIN_TAIL_COLUMNS}.")
    if cfg.group_pad < group_size:
        raise KernelInputError(f"launch_config.group_pad={cfg.group_pad} is smaller than the GQA group size "
                               f"{group_size}; use a power of two >= {group_size}.")
    if not (isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 4):
        raise KernelInputError(f"launch_config.num_stages={cfg.num_stages!r} must be an int in [1, 4].")
    for name in ("prompt_stages", "tail_stages"):
        stages = getattr(cfg, name)
        if stages is not None and not (isinstance(stages, int) and 1 <= stages <= 4):
            raise KernelInputError(f"launch_config.{name}={stages!r} must be None or an int in [1, 4].")
    if cfg.tail_on_cores and cfg.prompt_first:
        raise KernelInputError("launch_config has tail_on_cores=True and prompt_first=True; the core tail runs "
                               "before the prompt (its state seeds the prompt loop): set prompt_first=False.")
    if not isinstance(cfg.shared_ancestry, bool):
        raise KernelInputError(f"launch_config.shared_ancestry={cfg.shared_ancestry!r} must be a bool.")
    if isinstance(cfg.shared_min_tail, bool) or not (isinstance(cfg.shared_min_tail, int) and cfg.shared_min_tail >= 1):
        raise KernelInputError(f"launch_config.shared_min_tail={cfg.shared_min_tail!r} must be an int >= 1 "
                               f"(cached tail positions).")
    if cfg.max_registers is not None and not (isinstance(cfg.max_registers, int) and 64 <= cfg.max_registers <= 255):
        raise KernelInputError(f"launch_config.max_registers={cfg.max_registers!r} must be None or an int in "
                               f"[64, 255].")
    return cfg


def _check_prompt_table(prompt_page_table, num_requests: int, device) -> None:
    need_dim("prompt_page_table", prompt_page_table, 2, "[>= R, max_prompt_pages] int32")
    need_dtype("prompt_page_table", prompt_page_table, (torch.int32,))
    if prompt_page_table.device != device:
        fail(f"prompt_page_table is on {prompt_page_table.device} but q is on {device}; put every tensor on one "
             f"device.")
    if prompt_page_table.shape[0] < num_requests or prompt_page_table.shape[1] < 1:
        fail(f"prompt_page_table has shape {tuple(prompt_page_table.shape)} but the batch has R={num_requests} "
             f"requests; pass one row of prompt pages (page numbers, beam 0's) per request.")


def _check_prompt_values(prompt_page_table, prompt_lens_per_request, page_size: int, num_pages: int) -> None:
    """Check mode: every prompt page the launch reads is in the pool and every prompt fits its table row."""
    lens = prompt_lens_per_request.long().cpu()
    cols = prompt_page_table.shape[1]
    bad = torch.nonzero((lens < 0) | (lens > cols * page_size)).flatten()
    if bad.numel():
        r = int(bad[0])
        fail(f"prompt length {int(lens[r])} of request {r} is outside [0, {cols * page_size}] (the prompt page table "
             f"has {cols} columns of {page_size} tokens); pass the plan's prompt lengths and page table together.")
    table = prompt_page_table[: lens.numel()].long().cpu()
    used = torch.arange(cols)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    bad = torch.nonzero(used & ((table < 0) | (table >= num_pages)))
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        fail(f"prompt_page_table[{r}, {c}]={int(table[r, c])} is outside the pool [0, {num_pages}); the plan is stale "
             f"or belongs to another pool.")


def _rows_aligned(*views) -> bool:
    """Whether every ``(tensor, element strides)`` pair starts on 16 bytes and steps in multiples of 16
    bytes, so that the kernel may load K/V rows chosen by a pointer select as 16-byte vectors."""
    for x, strides in views:
        size = x.element_size()
        if x.data_ptr() % 16 or any((st * size) % 16 for st in strides):
            return False
    return True


def _launch(grid, args, cfg: CascadeLaunchConfig, group_size: int, head_dim: int, write_kv: bool, prefix_only: bool,
            device: torch.device, dtype: torch.dtype, prompt_capacity: int, aligned_rows: bool = False,
            error_flags=None):
    meta = dict(
        # The prompt table fits one block: a shape, known here; one compile more per tiling.
        PROMPT_ONE_BLOCK=prompt_capacity <= cfg.block_n,
        GROUP=group_size,
        GROUP_PAD=cfg.group_pad,
        BEAMS=cfg.beams_per_program,
        HEADS=cfg.heads_per_program,
        HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n,
        TAIL_BLOCK=cfg.tail_block,
        WRITE_KV=bool(write_kv),
        PREFIX_ONLY=bool(prefix_only),
        ALIGNED_ROWS=bool(aligned_rows),
        DOT_FP32=device.type != "cuda" and dtype == torch.bfloat16,
        PROMPT_FIRST=bool(cfg.prompt_first),
        PROMPT_STAGES=cfg.prompt_stages or cfg.num_stages,
        TAIL_STAGES=cfg.tail_stages or cfg.num_stages,
        TAIL_CORES=bool(cfg.tail_on_cores),
        SHARED_ANCESTRY=cfg.folds_shared_ancestry and not prefix_only,
        SHARED_MIN_TAIL=cfg.shared_min_tail,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.max_registers is not None and device.type == "cuda":
        meta["maxnreg"] = cfg.max_registers
    if error_flags is not None:
        meta.update(err_ptr=error_flags, REPORT_ERRORS=True)
    return launch(beam_cascade_kernel, grid, args, meta, device, pdl=True)


def beam_cascade_attention(
    q,
    new_k,
    new_v,
    kv_cache,
    prompt_page_table,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    out,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    write_kv=True,
    validate_indices=False,
    launch_config=None,
    error_flags=None,
    max_tail_len=None,
):
    """A whole beam-search decode step of one layer in one launch: prompt once per beam block, tail, KV write.

    For beam row ``i = r*W + b`` with prompt length ``P`` and KV length ``L`` (this step's token
    included), ``out[i, h]`` is attention of ``q[i, h]`` over: positions ``[0, P)`` from page
    ``prompt_page_table[r, t // Pg]`` (the request's shared prompt pages, page numbers); positions
    ``[P, L - 1)`` from page ``beam_page_table[r*W + cache_indirection[r, b, t], t // Pg] //
    page_index_divisor``; position ``L - 1`` from ``new_k[i]``/``new_v[i]``, which are also stored there.

    Args:
        q: ``[rows, Hq, D]`` bf16/fp16, last dim contiguous (a strided view of a fused QKV is fine).
        new_k, new_v: ``[rows, Hkv, D]`` in q's dtype, this step's K/V (strided views allowed).
        kv_cache: paged pool in q's dtype, ``[pages, 2, Hkv, Pg, D]`` (HND) or ``[pages, 2, Pg, Hkv, D]``
            (NHD); may be a strided view.
        prompt_page_table: ``[>= R, n]`` int32 page numbers, each request's prompt pages (beam 0's);
            only the first ``ceil(P / Pg)`` columns are read, and never more than ``n * Pg`` tokens.
        beam_page_table: ``[>= rows, max_pages]`` int32, each beam row's page entries (any strides).
        kv_lens: ``[rows]`` int32, KV length per row including this step's token.
        prompt_lens: ``[rows]`` int32, ``P`` per row (equal within a request; the kernel reads row ``r*W``).
        cache_indirection: ``[>= R, W_max, max_seq_len]`` int32, source beam per position.
        beam_width: ``W``; ``rows = R * W`` request-major.
        out: ``[rows, Hq, D]`` in q's dtype, last dim contiguous, overlapping no input.
        sm_scale: softmax scale (default ``1/sqrt(D)``).
        kv_layout: ``"HND"`` or ``"NHD"``.
        page_index_divisor: ``1`` for page numbers in ``beam_page_table``; TensorRT-LLM block offsets use
            ``layers_in_pool * kv_factor`` (``prompt_page_table`` always holds page numbers).
        write_kv: store ``new_k``/``new_v`` at ``L - 1`` of each row's own page in the same launch.
        validate_indices: check mode: read lengths, pages and indirection back and check them (host sync).
        launch_config: a :class:`CascadeLaunchConfig` (tuning and benchmarks).
        max_tail_len: ``None``, or a bound on every row's tail, ``kv_len - prompt_len`` generated tokens (this
            step's included), known on the host: the default tiling then leaves out paths no such tail takes
            (:func:`cascade_launch_config`). A wrong bound costs speed, never correctness: those paths are
            shortcuts. ``validate_indices`` checks it.
        error_flags: ``None``, or an ``int32 [1]`` tensor on q's device into which the kernel ORs one
            bit per kind of invalid index or length it masked (:mod:`triton_kernels.device_errors`;
            no sync).

    Returns:
        ``out``.

    Raises:
        KernelInputError: an argument the kernel cannot take (names the value, the limit and the fix),
            including shapes :func:`cascade_supported` refuses.
    """
    write_kv = need_flag("write_kv", write_kv)
    validate_indices = need_flag("validate_indices", validate_indices)
    geom = check_step_args(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width, out,
        sm_scale=sm_scale, kv_layout=kv_layout, page_index_divisor=page_index_divisor,
        extra_tensors=(("prompt_page_table", prompt_page_table),), write_kv=write_kv, error_flags=error_flags,
    )
    check_device(q, beam_cascade_kernel, "the cascade kernel")
    _check_prompt_table(prompt_page_table, geom.num_requests, q.device)
    check_error_flags(error_flags, q.device)
    if max_tail_len is not None and (isinstance(max_tail_len, bool) or not isinstance(max_tail_len, int)
                                     or max_tail_len < 1):
        fail(f"max_tail_len={max_tail_len!r} must be None or an int >= 1 (generated tokens per beam, this step's "
             f"included).")
    cfg = _resolve_config(launch_config, geom.beam_width, geom.group_size, geom.head_dim,
                          prompt_page_table.shape[1] * geom.page_size, geom.num_requests, geom.num_kv_heads, q.device,
                          max_tail_len)
    if validate_indices:
        check_tail_index_values(geom, beam_page_table, kv_lens, prompt_lens, cache_indirection, page_index_divisor)
        if max_tail_len is not None and geom.num_rows:
            tails = (kv_lens[: geom.num_rows].long() - prompt_lens[: geom.num_rows].long()).cpu()
            row = int(tails.argmax())
            if int(tails[row]) > max_tail_len:
                fail(f"row {row} has a tail of {int(tails[row])} generated tokens (kv_len - prompt_len) but "
                     f"max_tail_len={max_tail_len}; pass the step's longest tail, or None where it is unknown.")
        per_request = prompt_lens[:: geom.beam_width]
        if bool((prompt_lens.reshape(-1, geom.beam_width) != per_request[:, None]).any()):
            fail("prompt_lens differ between the beams of one request; every beam shares its request's prompt.")
        _check_prompt_values(prompt_page_table, per_request, geom.page_size, geom.num_pages)
    if geom.num_rows == 0:
        return out
    num_beam_blocks = cdiv(geom.beam_width, cfg.beams_per_program)
    grid = (geom.num_requests * num_beam_blocks, cdiv(geom.num_kv_heads, cfg.heads_per_program))
    s_page, s_kv, s_head, s_slot = geom.kv_strides
    # Each tensor's strides from one `stride()` call: `stride(i)` costs twice as much, per layer and step.
    k_strides, v_strides = new_k.stride()[:2], new_v.stride()[:2]
    args = (
        q, new_k, new_v, kv_cache, prompt_page_table, beam_page_table, kv_lens, prompt_lens, cache_indirection,
        out, out,  # no LSE output in the fused step: the second `out` is an unused placeholder
        *q.stride()[:2],
        *k_strides,
        *v_strides,
        s_page, s_kv, s_head, s_slot,
        *prompt_page_table.stride()[:2],
        *beam_page_table.stride()[:2],
        prompt_lens.stride(0) * geom.beam_width,
        *cache_indirection.stride()[:3],
        *out.stride()[:2],
        0, 0,
        geom.beam_width, num_beam_blocks, geom.num_kv_heads, prompt_page_table.shape[1] * geom.page_size,
        geom.page_size, page_index_divisor, geom.num_pages, geom.max_seq_len,
        geom.sm_scale * LOG2E,
    )
    aligned = _rows_aligned((new_k, k_strides), (new_v, v_strides), (kv_cache, geom.kv_strides))
    _launch(grid, args, cfg, geom.group_size, geom.head_dim, write_kv, False, q.device, q.dtype,
            prompt_page_table.shape[1] * geom.page_size, aligned, error_flags)
    return out


def beam_prefix_attention(
    q,
    kv_cache,
    prompt_page_table,
    prompt_lens,
    beam_width,
    out,
    lse,
    *,
    sm_scale=None,
    kv_layout="HND",
    validate_indices=False,
    launch_config=None,
):
    """The prefix stage alone: each request's prompt attended by its ``W`` query rows, state to memory.

    Args:
        q: ``[rows, Hq, D]`` bf16/fp16, last dim contiguous, ``rows = R * W`` request-major.
        kv_cache: the paged pool (``kv_layout``), in q's dtype.
        prompt_page_table: ``[>= R, n]`` int32 page numbers, each request's prompt pages.
        prompt_lens: ``[R]`` int32, prompt length per request (``0 <= P <= n * Pg``).
        beam_width: ``W``.
        out: ``[rows, Hq, D]`` in q's dtype, the normalised prefix output (0 for an empty prompt).
        lse: ``[rows, Hq]`` float32, base-2 log-sum-exp (``-inf`` for an empty prompt); may be strided.
        sm_scale, kv_layout, validate_indices, launch_config: as in :func:`beam_cascade_attention`.

    Returns:
        ``(out, lse)``.
    """
    for name, x in (("q", q), ("kv_cache", kv_cache), ("prompt_page_table", prompt_page_table),
                    ("prompt_lens", prompt_lens), ("out", out), ("lse", lse)):
        need_tensor(name, x)
        if x.device != q.device:
            fail(f"{name} is on {x.device} but q is on {q.device}; put every tensor on one device.")
    if kv_layout not in KV_LAYOUTS:
        fail(f"kv_layout={kv_layout!r} is not supported; use 'HND' or 'NHD'.")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        fail(f"beam_width={beam_width!r} must be an int >= 1.")
    need_dim("q", q, 3, "[rows, Hq, D]")
    need_dtype("q", q, KV_DTYPES)
    num_rows, num_qo_heads, head_dim = q.shape
    if num_qo_heads < 1 or head_dim < 1:
        fail(f"q is {tuple(q.shape)} with Hq={num_qo_heads}, D={head_dim}; both must be >= 1 (q is [rows, Hq, D]).")
    if num_rows % beam_width:
        fail(f"q has {num_rows} rows, not a multiple of beam_width={beam_width}; rows must be R * W, request-major.")
    num_requests = num_rows // beam_width
    need_dim("kv_cache", kv_cache, 5, "[pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD)")
    if kv_cache.dtype != q.dtype or kv_cache.shape[1] != 2:
        fail(f"kv_cache must be {q.dtype} [pages, 2, ...] like q, got {kv_cache.dtype} {tuple(kv_cache.shape)}.")
    (num_pages, num_kv_heads, page_size, pool_dim), kv_strides = check_pool_extent(kv_cache, kv_layout)
    if pool_dim != head_dim or num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        fail(f"kv_cache ({kv_layout}) holds Hkv={num_kv_heads}, D={pool_dim}, which does not serve q's Hq="
             f"{num_qo_heads}, D={head_dim}; check kv_layout and the layer's pool view.")
    need_dim("out", out, 3, "[rows, Hq, D]")
    for name, x in (("q", q), ("kv_cache", kv_cache), ("out", out)):
        need_last_dim_contiguous(name, x)
    _check_prompt_table(prompt_page_table, num_requests, q.device)
    need_dim("prompt_lens", prompt_lens, 1, f"[R={num_requests}] int32")
    need_dtype("prompt_lens", prompt_lens, (torch.int32,))
    if prompt_lens.shape[0] != num_requests:
        fail(f"prompt_lens has {prompt_lens.shape[0]} entries but the batch has R={num_requests} requests.")
    if tuple(out.shape) != (num_rows, num_qo_heads, head_dim) or out.dtype != q.dtype:
        fail(f"out must be {q.dtype} [{num_rows}, {num_qo_heads}, {head_dim}], got {out.dtype} {tuple(out.shape)}.")
    if tuple(lse.shape) != (num_rows, num_qo_heads) or lse.dtype != torch.float32:
        fail(f"lse must be float32 [{num_rows}, {num_qo_heads}] (rows, heads), got {lse.dtype} {tuple(lse.shape)}.")
    for name, x in (("out", out), ("lse", lse)):  # rows that share memory would overwrite each other's results
        need_distinct_elements(name, x, f"Pass a {name} buffer whose elements are distinct (a fresh tensor).")
    # The outputs overlap nothing the programs read: a result stored over a length or a page would change what
    # later programs attend.
    check_written_overlaps(("out", "lse"), (("out", out), ("lse", lse), ("q", q), ("kv_cache", kv_cache),
                                            ("prompt_page_table", prompt_page_table), ("prompt_lens", prompt_lens)))
    check_device(q, beam_cascade_kernel, "the cascade kernel")
    group_size = num_qo_heads // num_kv_heads
    cfg = _resolve_config(launch_config, beam_width, group_size, head_dim, prompt_page_table.shape[1] * page_size,
                          num_requests, num_kv_heads, q.device)
    if launch_config is None:  # the register cap is the fused step's (its tail's state); the prompt alone spills under it
        cfg = dataclasses.replace(cfg, max_registers=None)
    sm_scale = resolve_sm_scale(sm_scale, head_dim)
    if need_flag("validate_indices", validate_indices):
        _check_prompt_values(prompt_page_table, prompt_lens, page_size, num_pages)
    if num_rows == 0:
        return out, lse
    num_beam_blocks = cdiv(beam_width, cfg.beams_per_program)
    grid = (num_requests * num_beam_blocks, cdiv(num_kv_heads, cfg.heads_per_program))
    s_page, s_kv, s_head, s_slot = kv_strides
    args = (
        q, q, q, kv_cache, prompt_page_table, prompt_page_table, prompt_lens, prompt_lens, prompt_lens,
        out, lse,  # new_k/new_v/beam table/kv_lens/indirection are unused placeholders in the prefix stage
        *q.stride()[:2],
        0, 0, 0, 0,
        s_page, s_kv, s_head, s_slot,
        *prompt_page_table.stride()[:2],
        0, 0,
        prompt_lens.stride(0),
        0, 0, 0,
        *out.stride()[:2],
        *lse.stride()[:2],
        beam_width, num_beam_blocks, num_kv_heads, prompt_page_table.shape[1] * page_size,
        page_size, 1, num_pages, 1,
        sm_scale * LOG2E,
    )
    _launch(grid, args, cfg, group_size, head_dim, False, True, q.device, q.dtype, prompt_page_table.shape[1] * page_size)
    return out, lse
