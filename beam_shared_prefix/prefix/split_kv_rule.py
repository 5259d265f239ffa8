"""Where ``auto`` takes FlashInfer's split-KV prefill (each prompt split over many CTAs) ahead of the cascade and FA4:
batches of few requests whose prompts are long for their cascade program count (:func:`split_kv_preferred`,
:data:`SPLIT_KV_PROMPT`), and whether FlashInfer serves a batch under a backend setting (:func:`flashinfer_serves`).
The comments above the constants record the measurements each was set from. Split out of
:mod:`beam_shared_prefix.prefix.select`.
"""

from __future__ import annotations

from typing import Optional, Tuple

from .cascade_rule import eager_cascade_over_split_kv
from .waves import _cascade_programs

__all__ = ["SPLIT_KV_FEW_KV_HEADS", "SPLIT_KV_FEW_KV_HEADS_MIN_PROMPT", "SPLIT_KV_MAX_BEAM_BLOCKS",
           "SPLIT_KV_MAX_PROGRAMS", "SPLIT_KV_MAX_PROGRAMS_BY_SHAPE", "SPLIT_KV_MAX_QUERY_TILES",
           "SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS", "SPLIT_KV_PROMPT", "SPLIT_KV_QUERY_TILE_ROWS",
           "flashinfer_serves", "only_flashinfer_tiles", "split_kv_preferred"]

# Few requests (tenth round, small_batches_backends*.json: GQA 16/8, head 128, page 32, tail 4, 1-16
# requests of 8, 16 and 30 beams, 500-4,000 tokens). The cascade runs one program per request, KV
# head and beam block, each attending the whole prompt in turn, so with few programs its time grows
# with the prompt (1 request x 30 beams: 20, 28, 43 and 72 us at 500, 1,000, 2,000 and 4,000
# tokens; 16-beam tiles 40 and 125 us at 1,000 and 4,000), while FlashInfer's paged prefill splits
# each prompt over the GPU (22-26 us for the whole step). FA4 does not split either (40 us at
# 2,000). FlashInfer + tail was faster than the cascade where the cascade runs at most 128
# programs and the mean prompt reaches the larger of a floor and a length per program:
# - 64-row tiles (W = 17-32): 1,000 tokens and 60 per program. Faster by 22% (1 request, 1,000
#   tokens), 11% (2 requests, 1,000), 29% (4, 2,000) and 18% (8, 4,000), the points at the line;
#   even or slower below it (4 requests at 1,000: 3% slower; 8 at 1,000: 32%; 16 at 4,000: 37%;
#   1 request at 500: 10%).
# - 32-row tiles (W <= 16, tail on CUDA cores): 500 tokens and 8 per program. Faster by 8% (4
#   requests x 8 beams at 500 tokens) to 4.9x from 500 tokens up to 64 programs; at 128 programs
#   even at 1,000 tokens (16 beams 3% slower, 8 beams 12% faster) and 45-63% faster at 4,000.
#
# Eleventh round (small_batches_backends_{g4,d64,c,g4_c,g4_d,d64_b}.json: 1-32 requests of 8, 16 and
# 30 beams, 250-4,000 tokens, GQA 32/8 at head 128 and 16/8 at head 64, with FA4 + tail measured
# too):
# - GQA 4, head 128 (16-beam tiles of 64 rows; 30 beams take two): the same 1,000 tokens and 60 per
#   program, counting both beam blocks' programs. At 4,000 tokens up to 64 programs FlashInfer was
#   1.6-4.0x faster than the cascade and 1.1-2.6x faster than FA4; at 1,000 tokens with 8-16
#   programs 3-26% faster than FA4; from 32 programs at 1,000 tokens within 4% of FA4 or slower, and
#   at 128 programs slower (16 requests x 8-16 beams at 4,000: 97-108 against FA4's 80-81 us).
# - Head 64, GQA 2: 64-row tiles (30 beams) 1,000 and 60, as at head 128; 32-row tiles (8-16 beams)
#   1,000 tokens and 30 per program. At 1,000 tokens FlashInfer was 11-21% faster than the cascade
#   with 8 and 16 programs, within 3% at 32 and 10-25% slower at 64. At 4,000 it was 1.5-3.1x faster
#   up to 64 programs; at 128, faster with 8 beams (61 against FA4's 70 us) and 11% slower with 16.
#
# Twelfth round, wider beams (small_batches_backends_wide*.json: 1-16 requests of 48, 64, 128 and 256
# beams, 500-4,000 tokens, with FA4 + tail and the cascade): the same lengths, counting every beam
# block's programs, hold for two blocks at GQA 2 (48-64 beams; head 128 and head 64) and for three
# and four at GQA 4 (48-64 beams of 16-beam tiles). At 4,000 tokens FlashInfer was 1.2-2.3x faster
# than FA4 up to 64 programs (1 request x 64 beams: 30.4 against 65.1 us at head 128, 29.1 against
# 66.5 at head 64) and slower at 128 (8 x 64: 94.0 against 70.5). Four blocks at GQA 2 (128 beams)
# were 3-5% slower than FA4 at 4,000 tokens even with 1-2 requests, and three (96 beams, 1-8
# requests, 1,000 and 3,000 tokens) 3-7% slower, so GQA 2 stops at two.
#
# Thirteenth round, GQA 4 at head 64 (small_batches_backends_g4_d64.json: 1-16 requests of 8, 16 and
# 30 beams at 1,000 and 4,000 tokens; 16-beam tiles of 64 rows, 30 beams in two): the same 1,000
# tokens and 60 per program. FlashInfer was 1.3-3.9x faster than the cascade and 1.3-3.0x faster than
# FA4 at 4,000 tokens up to 64 programs (1 request x 8 beams: 21.2 against the cascade's 81.5 and
# FA4's 63.3 us), 6-29% faster at 1,000 tokens with 8-16 programs; with 32 programs at 1,000 it was
# 8-10% slower than FA4 at 16 and 30 beams (12% faster at 8), and at 128 programs slower (16 x 8
# at 4,000: 75.1 against FA4's 67.0).
#
# Fourteenth round, GQA 1 and 3 (small_batches_backends_g{1,3}{,_b,_d64}.json: 1-16 requests of 8,
# 16 and 30 beams at 250-4,000 tokens, GQA 8/8 and 24/8 at head 128 and head 64). Before it `auto`
# never took FlashInfer there and was up to 4.2x slower than it (GQA 1, 1 request x 30 beams x
# 4,000 tokens: the cascade's 103.8 against 24.8 us). FlashInfer against the faster of the cascade
# and FA4: with up to 32 programs 2-27% faster at 1,000 tokens and 1.7-3.0x at 4,000, from 1% faster
# to 30% slower at 500; with 33-64 programs 5-23% slower at 1,000, from 2% slower to 25% faster at
# 2,000, 1.15-1.7x faster at 4,000; with 65-128 programs slower at every length up to 4,000 (by
# 4-26% at 4,000), except GQA 1 at head 64 with 8 beams (16-row tiles): 3% faster at 2,000, 23% at
# 4,000. Hence
# 1,000 tokens and 30 per program, up to 64 programs except at GQA 1, head 64
# (SPLIT_KV_MAX_PROGRAMS_BY_SHAPE; there 128 programs take FlashInfer at 3,840 tokens, 9% slower
# than FA4 with 30 beams at 4,000).
#
# Fifteenth round, GQA 5-8 at head 128 (small_batches_backends_{g5,g8_kv8,g7_kv4,g6_kv2,mqa}.json and
# the fourteenth round's _g8.json: GQA 40/8, 64/8, 28/4, 12/2, 8/1 and 16/2; 1-128 requests of 8, 16
# and 30 beams at 500-4,000 tokens). The cascade's tiles there are 16 beams of 128 rows and it stops
# at 128 tokens, so the other backends are FA4 + tail (one CTA per request, KV head and 128 rows,
# reading the whole prompt: 20-21 us at 500 tokens, 38-40 at 2,000, 63-65 at 4,000 up to 32
# programs) and FlashInfer + tail. FlashInfer against FA4: up to 8 cascade programs 4-22% faster at
# 1,000 tokens (1 x 8 at GQA 5 and 8) and 1.4-2.8x at 2,000-4,000; 16 programs within 4-9% either
# way at 1,000 and 1.3-1.9x faster at 2,000-4,000; 32 programs 2-21% slower at 1,000, from 4%
# slower (4 x 30 at 28/4; 16 x 30 at 8/1) to 23% faster at 2,000 and 1.2-1.7x faster at 4,000; 64
# programs from 14% faster (8 x 8 at 4,000) to 31% slower (8 x 30 at 4,000, 87.6 against 66.8 us);
# at 500 tokens FA4 or within 5%. Hence GQA 2's 1,000 tokens and 60 per program, up to 32 programs
# and two beam blocks (30 beams). Head 64 at GQA 7-8 (_g7_d64.json, _g8_d64.json, _g7_kv4_d64.json):
# FlashInfer 1.4-2.8x faster than FA4 at 4,000 tokens up to 32 programs, but at 64 programs 8 x 8
# wanted it (55.8 against FA4's 67.4 us) and 4 x 30 did not (83.0 against 66.5), so no program cap
# keeps every pick within 18%; and most of those points are declined (few rows). Not enabled there.
#
# Sixteenth round, GQA 2 at head 128 with 32-row tiles (8-16 beams) against FA4 + tail, which the
# tenth round had not timed (small_batches_backends_g2_rows32{,_128prog,_250}.json at 16/8 and
# small_batches_backends_g2_kv16{,_b}.json at 32/16: 1-16 requests, 250-4,000 tokens). The tenth
# round's 500 tokens and 8 per program picked FlashInfer where FA4 was faster: 3-17% at 500 tokens
# with 8-32 programs, 4-41% at 1,000 with 64-128, 15-32% at 2,000 and 6-19% at 4,000 with 128
# (16 x 16 x 2,000 at 16/8: 62.9 against 48.7 us). FlashInfer was the faster at 1,000 tokens with up
# to 32 programs (4-17%: 22.2-26.6 against 26.7-27.7 us) and from 2,000 with up to 64 (1-10% at 64).
# Hence 1,000 tokens and 30 per program, up to 64 programs (SPLIT_KV_MAX_PROGRAMS_BY_SHAPE; with
# 64-row tiles 64 programs already need 3,840 tokens).
#
# Fifty-second round, GQA 3 and 5 at head 128 (small_batches_backends_g{3,5}_few_requests_round52.json: 1, 2, 3 and 5
# requests of 18, 24 and 47 beams at 2,500 and 6,000 tokens, GQA 24/8 and 40/8, FlashInfer + tail against FA4 +
# tail; a random audit had found auto on FA4 at 1-5 requests over long prompts where FlashInfer ran 1.13-2.02x
# faster). FA4 takes 45-49 us at 2,500 tokens and 87-92 at 6,000 whatever the batch up to 5 x 47 (one CTA a request,
# KV head and 128 rows), FlashInfer grows with the rows: with three beam blocks (47 beams) at one request it was
# 1.33-2.18x faster, at two (48 programs) 1.03-1.41x; at G = 5 with 48 programs of two blocks 1.13-1.63x faster (3 x
# 18 and 3 x 24), with 72 and more FA4 was faster at 2,500 (1.14-1.87x) and within 5% or faster at 6,000, except 5 x
# 18 and 5 x 24 at G = 3 (80 programs), where FlashInfer was 1.16-1.60x faster at 6,000 and 0.96-1.16x at 2,500.
# Hence three blocks at G = 3 and 5, up to 80 programs at G = 3 and 48 at G = 5 (50 tokens a program there: 48
# programs from 2,400). The cost: 3 x 47 x 2,500 at G = 3 (72 programs) takes FlashInfer at 1.14x FA4's time.
#
# Fifty-third round, the held-out checks of those picks (small_batches_backends_g{3,5}_heldout{,14}_round53.json: 1-6
# requests of 16-40 beams at 3,000-9,000 tokens): every pick of one request held (FlashInfer 1.6x-4.0x faster than FA4),
# but at 4 requests FA4's program caps left FlashInfer out where it was 1.13x-1.46x faster (GQA 3, 4 x 40; GQA 5, 4 x
# 20). Across both rounds FlashInfer's time follows its query tiles, R x ceil(W x G / 64) per KV head (the beams'
# query rows of each request, packed over the group, in tiles of 64), while FA4's hardly grows up to 128 programs:
# with up to 8 tiles FlashInfer was faster from 2,500-3,500 tokens (1.03x-1.55x: GQA 5 2 x 47, 3 x 24, 4 x 16-24,
# 8 x 8; GQA 3 4 x 26-40, 4 x 30, 8 x 16 from 4,000), with 9-10 from 6,000 (1.03x-1.24x: GQA 5 5 x 16-24, 5 x 18;
# GQA 3 3 x 47, 5 x 24; at 2,500-4,000 0.87x-1.05x), with 12 and more FA4 from 0.62x to 1.04x (GQA 5 4 x 30, 3 x 47, 4 x
# 40, 8 x 16; GQA 3 6 x 26-36, 8 x 30, 16 x 8). Hence SPLIT_KV_MAX_QUERY_TILES at G = 3 and 5, with up to 96 and 80
# programs (SPLIT_KV_MAX_PROGRAMS_BY_SHAPE).
SPLIT_KV_MAX_PROGRAMS = 128
#: ``{(GQA group, head size): {tile rows: (smallest mean prompt, tokens per cascade program)}}`` at
#: which ``auto`` picks FlashInfer; shapes not listed never (not measured). Tiles of fewer than 64
#: rows take the 32-row entry.
SPLIT_KV_PROMPT = {
    (2, 128): {64: (1000, 60), 32: (1000, 30)},
    (4, 128): {64: (1000, 60)},
    (2, 64): {64: (1000, 60), 32: (1000, 30)},
    (4, 64): {64: (1000, 60)},
    (1, 128): {32: (1000, 30)},
    (1, 64): {32: (1000, 30)},
    (3, 128): {64: (1000, 30)},
    (3, 64): {64: (1000, 30)},
    (5, 128): {64: (1000, 50)},
    (6, 128): {64: (1000, 60)},
    (7, 128): {64: (1000, 60)},
    (8, 128): {64: (1000, 60)},
}
#: The most beam blocks per request at which each shape of :data:`SPLIT_KV_PROMPT` was measured.
SPLIT_KV_MAX_BEAM_BLOCKS = {(2, 128): 2, (4, 128): 4, (2, 64): 2, (4, 64): 2, (1, 128): 1, (1, 64): 1, (3, 128): 3,
                            (3, 64): 2, (5, 128): 3, (6, 128): 2, (7, 128): 2, (8, 128): 2}
#
# Thirty-seventh round, GQA 2 at head 64, 64-row tiles with 128 programs (16 requests x 30 beams at 8,000 tokens,
# which 60 per program admits from 7,680; graphed_one_block_8000_d64_round37.json, eager_d64_16req_round37.json):
# FlashInfer + tail 134.5 against FA4 + tail's 123.9 us (graph replays), 132.7 against 121.1 us of device time
# eagerly. As at head 128 (65-128 programs slower at every length), 64-row tiles there stop at 64 programs.
#: Shapes where FlashInfer's split prompt stops below :data:`SPLIT_KV_MAX_PROGRAMS` cascade programs: a number,
#: or ``{tile rows: programs}`` (rows not listed: :data:`SPLIT_KV_MAX_PROGRAMS`).
SPLIT_KV_MAX_PROGRAMS_BY_SHAPE = {(2, 128): 64, (1, 128): 64, (3, 128): 96, (3, 64): 64, (5, 128): 80, (6, 128): 32,
                                  (7, 128): 32, (8, 128): 32, (2, 64): {64: 64}}
#: Shapes where FlashInfer's split prompt also stops above a number of query tiles per KV head, ``R x ceil(W x G /
#: SPLIT_KV_QUERY_TILE_ROWS)``: ``((from mean prompt, most tiles), ...)``, the entry of the longest prompt reached.
SPLIT_KV_MAX_QUERY_TILES = {(group, 128): ((0, 8), (6000, 10)) for group in (3, 5)}
SPLIT_KV_QUERY_TILE_ROWS = 64
#
# Sixty-seventh round (H100; no H200 came: split_g{3,5}_kv{2,4}_round67.json, 12-32 requests of 8 and 12 beams at
# 2,500-4,000 tokens, GQA 6/2, 12/4, 10/2 and 20/4). The tile caps above were measured at 8 KV heads; with fewer, FA4
# runs fewer programs (R x Hkv a 128-row tile) while FlashInfer's work follows its query tiles times the KV heads.
# Up to 48 tiles x KV heads FlashInfer + tail ran 1.02x-1.69x faster than the faster of FA4 + tail and the cascade
# (1.22x-1.69x at 24-32, 1.02x-1.14x at 48) and 1.27x-3.04x faster than per-beam decode; at 64 from 0.91x to 1.04x
# (GQA 3 at 32 x 8-12 with 2 KV heads, 16 x 8-12 with 4; GQA 5 at 16 x 8 with 4). A second grid at 1,300 and 2,000
# tokens (split_short_g{3,5}_kv{2,4}_round67.json: 7-16 requests of 8-27 beams at GQA 6/2, 10/2 and 12/4): wherever this
# cap moved a point onto FlashInfer it ran 0.99x-1.37x the faster other's speed and 1.33x-2.90x per-beam decode's.
# Hence, at 2-4 KV heads (where measured) and from 1,300 tokens (the shortest timed), up to
# SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS // Hkv tiles where that is more than the cap above.
#: ``R x ceil(W x G / 64) x Hkv`` at which FlashInfer's split prompt still leads at GQA 3 and 5 with
#: :data:`SPLIT_KV_FEW_KV_HEADS` KV heads.
SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS = 48
#: The KV heads (fewest, most) at which :data:`SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS` was measured.
SPLIT_KV_FEW_KV_HEADS = (2, 4)
#: The shortest mean prompt (tokens) at which it was measured.
SPLIT_KV_FEW_KV_HEADS_MIN_PROMPT = 1300


def split_kv_preferred(
    num_requests: Optional[int],
    mean_prompt_len: Optional[float],
    num_qo_heads: int,
    num_kv_heads: int,
    beam_width: Optional[int],
    head_dim: int = 128,
    eager: bool = False,
) -> Tuple[bool, str]:
    """Whether ``auto`` picks FlashInfer (its prefill splits a prompt over many CTAs) ahead of the
    cascade and FA4: ``(True, why)`` or ``(False, reason)``. Measured at GQA 1-4 at head 128 and head
    64 and at GQA 5-8 at head 128 (:data:`SPLIT_KV_PROMPT`, up to :data:`SPLIT_KV_MAX_BEAM_BLOCKS` beam blocks,
    :data:`SPLIT_KV_MAX_PROGRAMS_BY_SHAPE` programs and :data:`SPLIT_KV_MAX_QUERY_TILES` query tiles, more with 2-4 KV
    heads: :data:`SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS`); elsewhere never. ``num_requests`` and
    ``mean_prompt_len`` (tokens) are the batch's; ``None`` (unknown) never prefers it. An ``eager`` step (no CUDA
    graph) where :func:`eager_cascade_over_split_kv` holds takes the cascade instead."""
    if num_requests is None or mean_prompt_len is None or beam_width is None:
        return False, "request count, beam width or prompt length unknown"
    group = num_qo_heads // max(num_kv_heads, 1)
    by_rows = SPLIT_KV_PROMPT.get((group, head_dim))
    if by_rows is None:
        measured = ", ".join(f"GQA {g} at head {d}" for g, d in SPLIT_KV_PROMPT)
        return False, f"GQA {group}, head {head_dim}: FlashInfer's split prompt measured only at {measured}"
    if num_requests > SPLIT_KV_MAX_PROGRAMS:  # every request runs a program per KV head group at least
        return False, f"{num_requests} requests > {SPLIT_KV_MAX_PROGRAMS}: the cascade fills the GPU"
    programs, blocks, rows = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim)
    if blocks > SPLIT_KV_MAX_BEAM_BLOCKS[(group, head_dim)]:
        return False, (f"W={beam_width} takes {blocks} beam blocks: not measured against FlashInfer's split prompt "
                       f"at GQA {group}, head {head_dim}")
    most = SPLIT_KV_MAX_PROGRAMS_BY_SHAPE.get((group, head_dim), SPLIT_KV_MAX_PROGRAMS)
    if isinstance(most, dict):
        most = most.get(64 if rows >= 64 else 32, SPLIT_KV_MAX_PROGRAMS)
    if programs > most:
        return False, (f"{programs} cascade programs > {most} at GQA {group}, head {head_dim}: the cascade or FA4 "
                       f"measured faster there")
    tile_limits = SPLIT_KV_MAX_QUERY_TILES.get((group, head_dim))
    if tile_limits is not None:
        tiles = num_requests * -(-beam_width * group // SPLIT_KV_QUERY_TILE_ROWS)
        most_tiles = max(t for p, t in tile_limits if mean_prompt_len >= p)
        kv_heads_note = ""
        if (SPLIT_KV_FEW_KV_HEADS[0] <= num_kv_heads <= SPLIT_KV_FEW_KV_HEADS[1]
                and mean_prompt_len >= SPLIT_KV_FEW_KV_HEADS_MIN_PROMPT):
            most_tiles = max(most_tiles, SPLIT_KV_MAX_QUERY_TILE_HEADS_FEW_KV_HEADS // num_kv_heads)
            kv_heads_note = f" with {num_kv_heads} KV heads"
        if tiles > most_tiles:
            return False, (f"{num_requests} x {beam_width} beams take {tiles} query tiles of "
                           f"{SPLIT_KV_QUERY_TILE_ROWS} rows > {most_tiles} at GQA {group}, head {head_dim}"
                           f"{kv_heads_note} and a mean prompt of {mean_prompt_len:.0f}: FA4 measured faster there")
    floor, per_program = by_rows[64 if rows >= 64 else 32]
    least = max(floor, per_program * programs)
    if mean_prompt_len < least:
        return False, (f"mean prompt {mean_prompt_len:.0f} < {least} tokens for {programs} cascade programs "
                       f"of {rows} rows: the cascade or FA4 measured as fast there")
    if eager:
        over, why = eager_cascade_over_split_kv(num_requests=num_requests, mean_prompt_len=mean_prompt_len,
                                                num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                                beam_width=beam_width, head_dim=head_dim)
        if over:
            return False, why
    return True, (f"{num_requests} request(s) run {programs} cascade programs of {rows} rows for a mean prompt of "
                  f"{mean_prompt_len:.0f} >= {least} tokens: FlashInfer's split prompt measured faster")


def only_flashinfer_tiles(head_dim: int) -> bool:
    """Whether FlashInfer is the only prefix backend for ``head_dim`` (head 256: neither the cascade nor
    FA4 tiles it), so that ``auto`` always runs it, whatever the batch."""
    from triton_kernels.cascade import SUPPORTED_HEAD_DIMS as CASCADE_HEAD_DIMS  # deferred: imports triton

    from .fa4 import SUPPORTED_HEAD_DIMS as FA4_HEAD_DIMS
    from .flashinfer import SUPPORTED_HEAD_DIMS as FLASHINFER_HEAD_DIMS

    return head_dim in FLASHINFER_HEAD_DIMS and head_dim not in CASCADE_HEAD_DIMS + FA4_HEAD_DIMS


def flashinfer_serves(
    requested: str,
    num_requests: Optional[int],
    mean_prompt_len: Optional[float],
    num_qo_heads: int,
    num_kv_heads: int,
    beam_width: Optional[int],
    head_dim: int,
    eager: bool = False,
) -> bool:
    """Whether FlashInfer's prefix backend (split prompt) serves a CUDA batch under the ``requested``
    setting: ``"flashinfer"`` always; every setting where no other backend tiles the head size
    (:func:`only_flashinfer_tiles`: ``"fa4"`` and ``"triton"`` fall back to FlashInfer there, as
    :func:`resolve_prefix_backend` does); else ``"auto"`` where :func:`split_kv_preferred` picks it (``eager``
    as there)."""
    if requested == "flashinfer" or (requested in ("auto", "fa4", "triton") and only_flashinfer_tiles(head_dim)):
        return True
    if requested == "auto":
        return split_kv_preferred(num_requests=num_requests, mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                                  num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim, eager=eager)[0]
    return False
