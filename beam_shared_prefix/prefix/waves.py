"""The launch and wave geometry the ``auto`` rule counts: the cascade's programs for a batch (its wide tiling), the
GPU's multiprocessors (:func:`multiprocessors`) and how full each kernel's waves run (:func:`wave_efficiency`;
:func:`wave_balance`, the cascade's against FA4's). Split out of :mod:`beam_shared_prefix.prefix.select`; the rules in
:mod:`.cascade_rule` call :func:`multiprocessors` through this module (``_waves.multiprocessors()``), so that one patch
of it here reaches them all.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["CASCADE_PROGRAMS_PER_SM", "DEFAULT_MULTIPROCESSORS", "FA4_CTAS_PER_SM", "FA4_TILE_ROWS", "multiprocessors",
           "wave_balance", "wave_efficiency"]

#: ``{head size: query rows}`` of FA4's own tile on SM90 (``_tile_size_fwd_sm90``: 192 x 128 up to head 64,
#: 128 x 128 at 128).
FA4_TILE_ROWS = {64: 192, 128: 128}
#: Resident cascade programs a multiprocessor at heads 128 and 64 (registers: 64K a multiprocessor over 128 threads
#: of 230-255). Checked against the tilings compiled for sm_90 (tests/triton_kernels/test_tail_merge_compile.py).
CASCADE_PROGRAMS_PER_SM = 2
#: Resident FA4 CTAs a multiprocessor on SM90 (one tile, three warpgroups: 128 rows at head 128, 192 at head 64).
#: Read from FA4's waves on the H200 (fa4_waves_d{128,64}_round41.json: the prompt pass's time steps by 26-76% at
#: 133 and 265 CTAs, by at most 12% between).
FA4_CTAS_PER_SM = 1
#: Multiprocessors assumed where no CUDA device is visible: the H200's (and H100 SXM's), where the rule was measured.
DEFAULT_MULTIPROCESSORS = 132


class CascadePrograms(NamedTuple):
    """The cascade's launch for a batch (:func:`_cascade_programs`), counts: ``programs`` (the grid: one program a
    request, set of KV heads and beam block), ``blocks`` (beam blocks a request) and ``rows`` (query rows a tile,
    its ``block_m``)."""

    programs: int
    blocks: int
    rows: int


def _cascade_programs(num_requests: int, num_kv_heads: int, beam_width: int, group: int,
                      head_dim: int) -> CascadePrograms:
    """:class:`CascadePrograms` of the cascade's wide tiling for a batch: the geometry the rule's tables
    were measured and keyed on. Narrow widths' tiles (:func:`triton_kernels.cascade.narrow_tile_beams`, fifty-sixth
    round) hold a request's beams in one block as the wide tile does, so the programs and blocks are theirs too; their
    rows are fewer, and the tables keep the wide tile's (the narrow tile was 1.0-2.1x faster wherever it runs)."""
    from triton_kernels.cascade import wide_launch_config  # deferred: triton is imported on first use

    cfg = wide_launch_config(int(beam_width), group, head_dim)
    return CascadePrograms(*_launch_programs(cfg, num_requests, num_kv_heads, beam_width), cfg.block_m)


def _launch_programs(cfg, num_requests: int, num_kv_heads: int, beam_width: int) -> tuple[int, int]:
    """``(programs, beam blocks a request)`` of a cascade launch with tiling ``cfg`` for a batch."""
    blocks = -(-int(beam_width) // cfg.beams_per_program)
    return int(num_requests) * -(-int(num_kv_heads) // cfg.heads_per_program) * blocks, blocks


def multiprocessors() -> int:
    """Multiprocessors of the current CUDA device, or :data:`DEFAULT_MULTIPROCESSORS` without one."""
    if not torch.cuda.is_available():
        return DEFAULT_MULTIPROCESSORS
    from triton_kernels.shared_run import cuda_sm_count  # deferred: triton is imported on first use

    return int(cuda_sm_count(torch.cuda.current_device()))


def wave_efficiency(units: int, slots: int) -> float:
    """The mean fill of a grid's waves: ``units`` (CTAs) over ``slots`` (resident CTAs on the whole GPU) times
    its waves, in (0, 1]; 1 where the grid is a whole number of waves."""
    if units <= 0 or slots <= 0:
        raise ValueError(f"units={units} and slots={slots} must be positive")
    return units / (slots * -(-units // slots))


def wave_balance(num_requests: int, num_kv_heads: int, beam_width: int, group: int, head_dim: int,
                 num_sms: Optional[int] = None) -> float:
    """The cascade's wave efficiency over FA4's for a batch (above 1: FA4's last wave is the emptier).

    The cascade runs :data:`CASCADE_PROGRAMS_PER_SM` programs a multiprocessor, one per request, KV head and beam
    block; FA4 :data:`FA4_CTAS_PER_SM` CTA, one per request, KV head and tile of :data:`FA4_TILE_ROWS` query rows
    (head sizes 64 and 128). ``num_sms``: the GPU's multiprocessors (``None``: :func:`multiprocessors`).

    Raises:
        ValueError: a head size whose FA4 tile :data:`FA4_TILE_ROWS` does not list."""
    if head_dim not in FA4_TILE_ROWS:
        raise ValueError(f"head_dim={head_dim}: FA4's tile is known at head sizes {sorted(FA4_TILE_ROWS)} only")
    programs = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim).programs
    return _wave_balance(programs, num_requests, num_kv_heads, beam_width, group, head_dim,
                         multiprocessors() if num_sms is None else int(num_sms))


def _wave_balance(programs: int, num_requests: int, num_kv_heads: int, beam_width: int, group: int, head_dim: int,
                  sms: int) -> float:
    ctas = int(num_requests) * int(num_kv_heads) * -(-int(beam_width) * group // FA4_TILE_ROWS[head_dim])
    balance = wave_efficiency(programs, CASCADE_PROGRAMS_PER_SM * sms) / wave_efficiency(ctas, FA4_CTAS_PER_SM * sms)
    # Rounded: ratios of whole waves land on the thresholds (1.05 = (1248/1320) / (832/924)), in floats just under.
    return round(balance, 9)
