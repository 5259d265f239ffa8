"""The decline rule's floors: the fewest beam rows a step needs and the shortest mean prompt it is served from.

Beam rows: :func:`min_beam_rows` (``R x W`` at :data:`MIN_BEAM_ROWS` = 120 rows at 8 KV heads, scaled by ``8 / Hkv`` up
to 16 KV heads and an ``R x W x Hkv`` product above; the floors that replace it by prompt, group, head size and beam
width: ``MIN_BEAM_ROWS_*``, ``FEW_ROWS_*``, ``NARROW_TILE_*``) and FlashInfer's split-prompt exception
(:data:`MIN_BEAM_ROW_TOKENS_SPLIT_KV`). Prompts: the one-launch cascade's table by beam width
(:func:`cascade_min_prompt`), the two-launch paths' :data:`MIN_SHARED_PROMPT_TOKENS`, beams narrower than 8 above 8 KV
heads (:func:`narrow_beams_min_prompt`), groups wider than :data:`WIDE_GROUP` (:data:`WIDE_GROUP_MIN_PROMPT`) and an
unknown prompt (:data:`MIN_BEAM_WIDTH_ANY_PROMPT`). The comments above the constants record the measurements each was
set from; the grids behind them are in ``docs/benchmarks-evidence.md``. Split out of :mod:`beam_shared_prefix.decline`,
whose :func:`~beam_shared_prefix.decline.should_decline` applies them; this module imports nothing of the library.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["CASCADE_MIN_PROMPT", "CASCADE_MIN_PROMPT_HEAD_64", "CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8",
           "CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_4_KV_HEADS", "CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_BY_KV_HEADS",
           "FEW_ROWS_HEAD_256_REFIT_GQA2_MIN_PROMPT",
           "FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT", "FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT", "FEW_ROWS_MIN_PROMPT",
           "FEW_ROWS_REFIT_GQA2_MIN_PROMPT", "FEW_ROWS_REFIT_MIN_PROMPT", "FEW_ROWS_REFIT_NARROWEST",
           "FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT", "FEW_ROWS_REFIT_NARROW_MIN_PROMPT",
           "FEW_ROWS_REFIT_SHORT_PROMPT_FROM", "FEW_ROWS_REFIT_WIDE_FROM", "GQA1_SHORT_PROMPT", "MIN_BEAM_ROWS",
           "MIN_BEAM_ROWS_GQA1_SHORT_PROMPT", "MIN_BEAM_ROWS_HEAD_128_REFIT", "MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW",
           "MIN_BEAM_ROWS_HEAD_256", "MIN_BEAM_ROWS_HEAD_256_REFIT", "MIN_BEAM_ROWS_LONG_PROMPT",
           "MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS", "MIN_BEAM_ROWS_NARROW_TILE", "MIN_BEAM_ROWS_NARROW_TILE_GROUP_8",
           "MIN_BEAM_ROW_TOKENS_SPLIT_KV", "MIN_BEAM_ROW_TOKENS_SPLIT_KV_HEAD_256", "MIN_BEAM_WIDTH",
           "MIN_BEAM_WIDTH_ANY_PROMPT", "MIN_SHARED_PROMPT_TOKENS", "NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT",
           "NARROW_BEAMS_MEASURED_KV_HEADS", "NARROW_TILE_FLOOR_MIN_PROMPT", "NARROW_TILE_GROUP_8_FLOOR_MIN_PROMPT",
           "WIDE_GROUP", "WIDE_GROUP_MIN_PROMPT", "cascade_min_prompt", "min_beam_rows", "narrow_beams_min_prompt"]

#: Beam search proper: with one beam nothing is shared.
MIN_BEAM_WIDTH = 2
#: Fewer beam rows (requests x beam width) than this are left to the default kernel (at 8 KV heads;
#: :func:`min_beam_rows` scales it by the KV heads).
MIN_BEAM_ROWS = 120
#: The same floor above head 128 (head 256: only FlashInfer + tail serves; seventeenth round), except head
#: 256 at the GQA groups of ``_SHORT_ROWS_HEAD_256_GROUPS``, which keep :data:`MIN_BEAM_ROWS` (nineteenth).
MIN_BEAM_ROWS_HEAD_256 = 240
#: From a mean prompt of :data:`FEW_ROWS_MIN_PROMPT` tokens this many rows are served instead (at 8 KV
#: heads; scaled the same way), at head 128 and at head 64 for the groups of
#: ``_FEW_ROWS_HEAD_64_GROUPS``.
MIN_BEAM_ROWS_LONG_PROMPT = 60
FEW_ROWS_MIN_PROMPT = 500
# Head 64's groups where 60-119 rows (at 8 KV heads) won from 500 tokens (1.10x-1.25x at GQA 2-4);
# GQA 1 at head 64 lost there (0.99x-1.02x), and GQA 7-8 (64/8, 28/4; small_batches_backends_g8_d64.json,
# _g7_kv4_d64.json) were under the margin at 500 tokens (1.03x-1.08x; 1.11x-1.23x from 1,000).
_FEW_ROWS_HEAD_64_GROUPS = frozenset((2, 3, 4))
# Head 256's groups where it was measured (seventeenth round: GQA 16/8, 8/4 and MHA 16/16; eighteenth:
# GQA 32/8, 16/4 and 4/1; nineteenth: GQA 24/8, 64/8 and 16/2; twentieth: GQA 40/8, 48/8, 56/8 and 12/2):
# from 500 tokens every point from 60 rows at 8 KV heads (scaled: 30-479 rows) won, 1.20x-6.16x at GQA
# 1-2, 1.22x-4.37x at GQA 4, 1.26x-4.54x at GQA 3, 1.16x-2.59x at GQA 8 and 1.18x-4.07x at GQA 5-7.
# Groups above 8 are not measured.
_FEW_ROWS_HEAD_256_GROUPS = frozenset(range(1, 9))
#: At head 128 with 2-8 KV heads and groups of 3-8, from a mean prompt of :data:`FEW_ROWS_REFIT_MIN_PROMPT` tokens, this
#: many rows at 8 KV heads (scaled the same way: ``R x W x Hkv >= 384``) replace both floors above. Fifty-third round,
#: on the current kernels (``few_rows_round53_{g4_kv8,g7_kv4,g6_kv2}.json``: GQA 32/8, 28/4 and 12/2, 2-10 requests of
#: 10-27 beams at 99-1,506 tokens, beam-search ancestry, tail 4): every point from 304 row-KV-heads ran 1.12x-2.44x
#: faster than per-beam decode (at 99 tokens 28/4 1.12x-1.53x from 340; at 380-456 1.13x-1.61x), every one at 152-264
#: from 0.78x to 1.13x (0.96x at 228 and 1,161 tokens; 1.13x at 204 on FlashInfer's split prompt). The floors of rounds
#: 9-20 (960 and 480) were the smallest measured that won on the kernels of the day, with nothing measured in between; a
#: random audit (rounds 51-52) found them declining 1.23x-1.75x winners at 324-912. Held-out 16 (GQA 40/8, 24/4, 16/4,
#: 14/2) served its 27 points at 1.14x-3.27x. Fifty-fourth round
#: (``few_rows_round54_{g3_kv8,g3_kv2,g8_kv8,g8_kv4}.json``, GQA 24/8, 6/2, 64/8 and 32/4 at 100-1,300 tokens): GQA 3
#: and 8 as 4-7, every point from 384 row-KV-heads 1.18x-2.73x, at 288-378 1.10x-1.68x, at 104-280 0.80x-1.05x but at
#: 1,000-1,300 tokens (FlashInfer's split prompt 1.10x-1.27x, 5 x 14 x 1,000 at 32/4 on FA4 1.43x). GQA 2 takes it
#: from a longer prompt only (:data:`FEW_ROWS_REFIT_GQA2_MIN_PROMPT`).
MIN_BEAM_ROWS_HEAD_128_REFIT = 48
FEW_ROWS_REFIT_MIN_PROMPT = 99
#: Below :data:`FEW_ROWS_REFIT_WIDE_FROM` beams and under :data:`FEW_ROWS_REFIT_NARROW_MIN_PROMPT` tokens the refit
#: floor is this many rows at 8 KV heads (``R x W x Hkv >= 576``), and below :data:`FEW_ROWS_REFIT_NARROWEST` beams
#: it does not apply. Held-out 17 (fifty-fourth round, ``few_rows_heldout17_*.json``; 6-8 beams, where every earlier
#: grid of the refit had 9-50): at 100 tokens GQA 24/8 served 6 x 8, 8 x 6 and 8 x 8 (384-512 row-KV-heads) at
#: 1.06x-1.08x, under the margin (40/8 1.16x-1.17x, 64/8 at 110 tokens 1.21x), while 576-768 won 1.30x-1.54x (12 x 6
#: and 12 x 8 at 24/8 and 40/8, 10 x 8 at 64/8), and from 160-180 tokens every point from 384 won 1.27x-1.48x. Fewer
#: than 6 beams were not measured there.
MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW = 72
FEW_ROWS_REFIT_WIDE_FROM = 10
FEW_ROWS_REFIT_NARROW_MIN_PROMPT = 160
#: 4-5 beams take the refit floor (384) only from :data:`FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT` tokens, and 2-3 beams
#: never. Fifty-fifth round (``few_rows_round55_narrow_g{2,4}.json``, 16-48 requests of 3-5 beams at 200 and 800 tokens,
#: GQA 16/8 and 32/8): every point from 384 row-KV-heads won, 1.15x-2.38x, where the older floors declined them (960
#: under 500 tokens, 480 from it). Held-out 20 (``few_rows_heldout20_narrow_*.json``, predicted from 160 tokens: GQA
#: 24/8, 16/2 and 8/4) served 3 of its 28 points at 160-180 tokens under the margin (96 x 3 at 16/2: 1.04x; 32 x 5
#: and 48 x 4 at 8/4: 1.09x), while at 350-800 tokens every point from 384 won (1.16x-1.95x). Held-out 21
#: (``few_rows_heldout21_narrow_*.json``, from 350 tokens) served 4-5 beams at 1.26x-1.82x, but 3 beams at 80 x 3 with 2
#: KV heads (4/2) at 380 and 550 tokens at 1.11x and 1.02x; ``few_rows_round55_w3_g{2,6}_kv2.json`` then found 80 x 3 at
#: 2 KV heads slower than per-beam decode at 500-2,000 tokens (0.87x-1.03x at 4/2, 0.93x-0.98x at 12/2; 160 programs, a
#: second wave a fifth full) where 64 x 3 and 96 x 3 won (1.12x-1.54x). 3 beams keep the older floors, but for
#: :data:`MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS`.
FEW_ROWS_REFIT_NARROWEST = 4
#: 3 beams from :data:`FEW_ROWS_MIN_PROMPT` tokens need this many rows at 8 KV heads (``R x W x Hkv >= 576``, 192
#: request-KV-head programs) instead of :data:`MIN_BEAM_ROWS_LONG_PROMPT` (480, 160 programs): 80 x 3 at 2 KV heads,
#: which 480 served, ran 0.87x-1.03x at 500-2,000 tokens (above), 96 x 3 (576) 1.12x-1.26x.
MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS = 72
#: Under this many beams (and from :data:`FEW_ROWS_REFIT_NARROWEST`) the refit floor needs
#: :data:`FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT` tokens.
FEW_ROWS_REFIT_SHORT_PROMPT_FROM = 6
FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT = 350
#: GQA 1 at head 128 under :data:`GQA1_SHORT_PROMPT` tokens needs this many rows at 8 KV heads (``R x W x Hkv >=
#: 1,024``; scaled as the others) instead of :data:`MIN_BEAM_ROWS`. Fifty-fifth round
#: (``few_rows_round55_g1_kv{8,4,16}_short.json``, ``few_rows_round55_g1_kv8.json``: GQA 8/8, 4/4 and MHA 16/16 at
#: 100-200 tokens): 960 row-KV-heads ran 1.06x-1.09x at 100-150 tokens at every KV head count (6 x 20 x 150 at 8/8,
#: served by 960: 1.06x) and 1.16x-1.18x at 200; 1,024 1.12x-1.17x at 100-150; 768 0.95x-0.98x.
MIN_BEAM_ROWS_GQA1_SHORT_PROMPT = 128
GQA1_SHORT_PROMPT = 200
_FEW_ROWS_REFIT_GROUPS = frozenset(range(3, 9))
#: 3-5 beams at head 128, GQA 3-4 and 2-8 KV heads, from :data:`NARROW_TILE_FLOOR_MIN_PROMPT` tokens, on the cascade's
#: narrow tiles (fifty-sixth round, ``triton_kernels.cascade.NARROW_TILE_BEAMS``): this many rows at 8 KV heads by beam
#: width (scaled as the others: ``R x W x Hkv >= 288`` at 3-4 beams, ``>= 320`` at 5). ``few_rows_round56_*.json``
#: (GQA 32/8, 16/8, 24/8, 16/4 and 4/2; 4-64 requests of 3-5 beams at 150-600 tokens) with the same round's
#: ``narrow_tile_round56_g4_kv*.json`` (300-3,000 tokens): every point from 288 row-KV-heads won, 1.21x-1.66x (5 beams
#: from 320, 1.23x-1.53x), at 96-256 0.81x-1.26x (under the margin or slower at every point from 300 tokens). Held-out
#: 24 (``few_rows_heldout24_*.json``, 28 points, 1,000-2,500 tokens included): every one served won (1.18x-1.55x), the
#: declined 0.88x-1.08x but 14 x 5 at 12/4 (280, 1.29x-1.41x). 5 beams ask 320 so that a sixth beam (384 from 160
#: tokens, :data:`MIN_BEAM_ROWS_HEAD_128_REFIT`) never declines a batch 5 serve. GQA 2 won alike on the narrow tile
#: (GQA 16/8, 8/4 and 4/2 from 288: 1.18x-1.61x) and takes this floor since the fifty-seventh round, when the six older
#: grids whose GQA 2 shapes of 3-5 beams had run the 16-beam tile at 0.86x-1.09x were timed again on the narrow tile
#: (``few_rows_*_narrow_tile_round57.json``: all 72 points won, 1.12x-2.85x).
MIN_BEAM_ROWS_NARROW_TILE = {3: 36, 4: 36, 5: 40}
NARROW_TILE_FLOOR_MIN_PROMPT = 160
_NARROW_TILE_FLOOR_GROUPS = frozenset((2, 3, 4))
#: 3-5 beams at head 128, GQA 5-8 and 2-8 KV heads, from :data:`NARROW_TILE_GROUP_8_FLOOR_MIN_PROMPT` tokens, on the
#: cascade's 8-beam tile or FA4 + tail (``prefix/cascade_rule.py`` picks): at most this many rows at 8 KV heads by beam
#: width (scaled as the others; the older floors stand where they ask fewer). Fifty-seventh round
#: (``narrow_g[68]_round57_kv*.json``, ``narrow_tile_round56_g8_kv8.json``, ``select_heldout2[56]_g[5-8]_*.json``: GQA
#: 64/8, 56/8, 48/8, 40/8, 32/4, 28/4 and 16/2, 8-200 requests of 3-8 beams at 250-1,500 tokens): every point from 512
#: row-KV-heads won, 1.28x-2.77x against per-beam decode (3 beams from 576, 1.28x-1.69x); at 192 0.89x-0.96x; 17 x 3 at
#: 56/8 (408) 1.19x at 250 tokens and 1.02x at 700. Older floors asked 960 under 350 tokens (3 beams under 500).
MIN_BEAM_ROWS_NARROW_TILE_GROUP_8 = {3: 72, 4: 64, 5: 48}
NARROW_TILE_GROUP_8_FLOOR_MIN_PROMPT = 250
_NARROW_TILE_GROUP_8_FLOOR_GROUPS = frozenset(range(5, 9))
_FEW_ROWS_REFIT_KV_HEADS = range(2, 9)
#: GQA 2 at head 128 takes the same floor (384) with 2-8 KV heads from this mean prompt, at 4 beams or more (4-5 from
#: :data:`FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT`).
#: Fifty-fourth round: at 8 KV heads (16/8) every point from 288 row-KV-heads won from 150 tokens at 10-19 beams (1.18x-2.15x,
#: ``few_rows_round54_g2_kv8.json``) and from 180 at 6-8 (1.18x-1.62x, ``_g2_kv8_narrow``), but at 100 tokens 6-8 beams
#: lost up to 576 (0.80x-0.99x) and 768 ran 1.06x; at 4 KV heads (8/4, ``_g2_kv4``) 320-480 lost at 120 tokens
#: (0.85x-0.97x) and won at 400 (1.24x-1.50x). Fifty-fifth (``few_rows_round55_g2_kv{2,3}.json``, GQA 4/2 and 6/3, 6-24
#: requests of 10 and 20 beams at 170 and 400 tokens): every point from 320 won, 1.10x-1.32x at 170 tokens (from 360:
#: 1.18x-1.32x) and 1.22x-2.55x at 400; 160-180 lost (0.81x-0.91x). 9-16 KV heads (32/16: 576 at 120 tokens 1.06x)
#: keep the older floors.
FEW_ROWS_REFIT_GQA2_MIN_PROMPT = 160
#: Head 256 on the current kernels (fifty-fifth round, ``few_rows_round55_{g4_d256,g8_kv2_d256,g2_d256}.json``: GQA
#: 32/8, 16/2 and 16/8, 3-24 requests of 16 and 20 beams at 120-450 tokens, with the fifty-fourth's
#: ``few_rows_round54_{g4_d256,g8_kv2_d256}.json`` at 120 and 400): from :data:`FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT`
#: tokens ``R x W x Hkv >= 640`` (this many rows at 8 KV heads, scaled as the others), from
#: :data:`FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT` 384 (:data:`MIN_BEAM_ROWS_HEAD_128_REFIT`), at groups 2-8 (GQA 2 from
#: :data:`FEW_ROWS_HEAD_256_REFIT_GQA2_MIN_PROMPT`), 2-8 KV heads and 10 beams or more, where the older floors asked 960
#: (GQA 2: 1,920) under 500 tokens. At 200-300 tokens 640-960 won 1.32x-1.88x at GQA 4 and 8, while 384-512 ran
#: 0.95x-1.11x at 16/2 (1.16x-1.32x at 32/8); at 400-450 every point from 384 won (1.17x-2.07x; GQA 2 from 512 at 300
#: tokens, 1.48x-3.84x). Under 200 tokens 512 lost (0.92x-1.10x at 120) and GQA 2's 640-768 ran 1.03x-1.11x.
MIN_BEAM_ROWS_HEAD_256_REFIT = 80
FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT = 200
FEW_ROWS_HEAD_256_REFIT_GQA2_MIN_PROMPT = 300
FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT = 400
_FEW_ROWS_HEAD_256_REFIT_GROUPS = frozenset(range(2, 9))
# Head 256's groups whose short-prompt floor is head 128's MIN_BEAM_ROWS, not MIN_BEAM_ROWS_HEAD_256: at
# 100 tokens R x W x Hkv = 960-1,024 measured 1.35x-1.58x at GQA 3, 4 and 8 (8, 4 and 2 KV heads; 4/1:
# 1.51x-1.61x; nineteenth round, with the eighteenth's GQA 4 grids) and 1.41x-1.54x at GQA 5-7 (8 and 2
# KV heads; twentieth) against 1.04x-1.14x at GQA 2; 480-512 lost or were under the margin (0.85x-1.04x;
# 1.09x-1.13x at 4/1). Per-beam decode re-reads each beam's KV once per KV head for G query heads, so
# the wider the group, the sooner sharing the prompt pays.
_SHORT_ROWS_HEAD_256_GROUPS = frozenset(range(3, 9))
# The KV heads of the grids that measured MIN_BEAM_ROWS and the split prompt's exception.
_MEASURED_KV_HEADS = 8
# Above 8 KV heads the floors scale down, but no further than 16 KV heads' (sixteenth round,
# small_batches_backends_{mha32,mha16_d64,g2_kv16}.json): at 16 KV heads (32/16, 16/16 at head 64)
# R x W x Hkv >= 960 won at every point (from 1.23x), 480-512 from 500 tokens at head 128 (1.17x-1.50x);
# at 32 (MHA 32/32) R x W x Hkv = 960 measured 1.00x (1 x 30 x 100) and 1,024 1.17x-1.18x, so the
# 8 / Hkv scaling stops at 16 KV heads (the split prompt's too); the row floors go on below.
_MAX_SCALED_KV_HEADS = 16
# Above 16 KV heads the row floors are products R x W x Hkv (seventeenth round, with MHA 40/40 at head
# 128; small_batches_backends_{mha32,mha32_d64,mha40}.json): 1,024 row-heads won at every point
# measured (32 KV heads: 1.17x-1.18x at head 128, 1.30x-2.17x at head 64; 40: 1.16x-1.34x at 1,200-1,280),
# 960 not (1.00x at 32, 1 x 30 x 100); from 500 tokens 512 (1.14x-1.15x at 32, 1.33x-2.46x at 640 and
# 40). Measured up to 40 KV heads, which more keep: at 64 (MHA 64/64, twentieth round, mha64_auto_check.json
# and _d64_auto_check.json) 40's floors served 51 points at 1.28x-10.3x, where the product would also serve
# 1 x 8 x 500 at head 64 (8 rows, 0.95x).
_MANY_KV_HEADS_ROW_HEADS = {MIN_BEAM_ROWS: 1024, MIN_BEAM_ROWS_GQA1_SHORT_PROMPT: 1024, MIN_BEAM_ROWS_LONG_PROMPT: 512}
_MAX_MEASURED_KV_HEADS = 40
#: Fewer beam rows are still served by FlashInfer's split prompt from this many ``R x W x P`` tokens.
MIN_BEAM_ROW_TOKENS_SPLIT_KV = 60_000
#: The same at head 256, where per-beam decode reads twice head 128's bytes per prompt token.
MIN_BEAM_ROW_TOKENS_SPLIT_KV_HEAD_256 = 30_000
# The narrowest beam width at which that exception was measured (8-30 beams).
_SPLIT_KV_MEASURED_FROM_WIDTH = 8
# ``(GQA group, head size)`` where it was measured: those of ``prefix.split_kv_rule.SPLIT_KV_PROMPT``
# (a test keeps the two equal; this module imports nothing of the library), with the ``R x W x P``
# served from there. GQA 4 at head 64 needs more: at 64,000 it measured 1.02x (4 x 8 x 2,000) to
# 1.41x, at 120,000-128,000 1.38x-1.63x (per-beam decode there reads half head 128's bytes).
# GQA 1 and 3 (fourteenth round, small_batches_backends_g[13]*.json): from 60,000 at GQA 1 (head 128
# 1.39x-4.17x, head 64 1.13x-1.94x) and at GQA 3, head 128 (1.31x-3.44x); GQA 3 at head 64 from
# 120,000 (1.06x at 4 x 8 x 2,000; 1.43x-1.83x from 120,000). GQA 5-8 at head 128 (fifteenth round,
# small_batches_backends_{g5,g8_kv8,g7_kv4,g6_kv2,mqa}.json, 1-8 KV heads) from 60,000 scaled by 8 / Hkv:
# at 8 KV heads 1.37x-1.87x from 64,000 (1.13x at 32,000); at 4, 1.13x-1.14x at 64,000 and 1.21x-1.80x
# from 120,000; at 2, 0.95x-1.18x below 240,000 and 1.17x-1.88x from it; at 1 (MQA), 1.02x-1.08x at
# 240,000-256,000 and 1.17x at 512,000.
_SPLIT_KV_MIN_ROW_TOKENS = {(2, 128): MIN_BEAM_ROW_TOKENS_SPLIT_KV, (4, 128): MIN_BEAM_ROW_TOKENS_SPLIT_KV,
                            (2, 64): MIN_BEAM_ROW_TOKENS_SPLIT_KV, (4, 64): 120_000,
                            (1, 128): MIN_BEAM_ROW_TOKENS_SPLIT_KV, (1, 64): MIN_BEAM_ROW_TOKENS_SPLIT_KV,
                            (3, 128): MIN_BEAM_ROW_TOKENS_SPLIT_KV, (3, 64): 120_000,
                            **{(g, 128): MIN_BEAM_ROW_TOKENS_SPLIT_KV for g in (5, 6, 7, 8)},
                            # Head 256, where FlashInfer is the only backend (seventeenth to twentieth
                            # rounds, small_batches_backends_*_d256*.json, GQA 1-8 with 1-16 KV heads): at
                            # 8 KV heads 1.26x-1.74x at 30,000-32,000 and 1.76x-3.30x from 60,000, against
                            # 0.91x-1.15x at 15,000-16,000; scaled by 8 / Hkv: 1.37x-1.64x at 60,000-64,000
                            # and 4 KV heads, 1.26x-1.50x at 120,000-128,000 and 2, 1.49x-1.56x at
                            # 240,000-256,000 and 1, 1.20x-1.45x at 15,000-16,000 and 16 (MHA 16/16).
                            **{(g, 256): MIN_BEAM_ROW_TOKENS_SPLIT_KV_HEAD_256 for g in range(1, 9)}}
_SPLIT_KV_MEASURED_SHAPES = frozenset(_SPLIT_KV_MIN_ROW_TOKENS)
#: With an unknown prompt length, narrower beams are left to the default kernel.
MIN_BEAM_WIDTH_ANY_PROMPT = 8
#: ``(W - 1) * mean prompt`` below this (prompt tokens saved per request) is declined.
MIN_SHARED_PROMPT_TOKENS = 600
#: Groups of more query heads per KV head than :data:`WIDE_GROUP` need a mean prompt, ``(group from,
#: tokens)`` (a CUDA graph's unknown prompt is declined). Per-beam decode reads a beam's KV once for all of
#: its group, while the library's work on the queries (the prefix's rows, the tail) grows with the group.
#: Twenty-sixth round, head 128 (``wide_group_auto_check_g32_mqa.json``, ``_g64_mqa.json``): at GQA 32/1
#: every point at 100 tokens lost or was under the margin (0.60x-0.98x, up to 1,920 beam rows: 64 x 16
#: 0.89x and 64 x 30 0.98x were served before), from 500 tokens 480-1,920 rows won 1.40x-2.86x; at 64/1
#: 500 tokens lost at 480-1,920 rows (0.77x-0.83x), 2,000 won (1.38x-1.43x). At GQA 16 (64/4, 16/1) 100
#: tokens won from 1,024 beam rows at one KV head (1.44x-1.60x), as the row floors say.
WIDE_GROUP = 16
WIDE_GROUP_MIN_PROMPT = ((WIDE_GROUP + 1, 500), (33, 2000))
#: With the one-launch cascade serving: ``(beam width from, smallest mean prompt served)``, by width.
CASCADE_MIN_PROMPT = ((2, 500), (3, 150), (4, 50), (6, 32))
#: The same at head 64 (and below); narrower widths than the first are never served.
CASCADE_MIN_PROMPT_HEAD_64 = ((3, 500), (4, 250), (6, 100), (8, 32))
#: The same at head 128 for GQA 5-8 with 8 KV heads (:data:`CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_BY_KV_HEADS`),
#: where ``auto`` runs 3-5 beams on the cascade's 8-beam tile once the launch has more programs than multiprocessors.
#: Sixty-first round (H200, graph replays, 4-token tails; ``rule_flip_g[58]_kv8_round61.json``: 64-128 requests of 3
#: beams at 100-200 tokens, ``w3_floor_g[58]_kv8_round61.json``: 16, 32 and 128 requests of 3 beams at 50-150; GQA
#: 40/8 and 64/8): at 3 beams and 50-150 tokens the cascade ran 1.49x-1.89x faster than per-beam decode at 32 requests
#: (96 beam rows) and 1.64x-2.16x at 64-128, where :data:`CASCADE_MIN_PROMPT` asked 150 tokens (set from GQA 1-4). The
#: row floor (120 rows under 250 tokens) still declines fewer than 40 requests of 3 beams (16 requests, 128 programs,
#: are FA4 + tail's in ``auto``), so 40-63 requests are between measured points. Under 50 tokens not measured.
CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8 = ((2, 500), (3, 50), (6, 32))
#: The same with 4 KV heads: 3 beams from 80 tokens, wider ones as :data:`CASCADE_MIN_PROMPT`. Sixty-sixth and
#: sixty-seventh rounds, on an H100 (no H200 came; graph replays, 4-token tails, GQA 20/4, 24/4, 28/4 and 32/4, 80-512
#: requests of 3 beams): at 80-140 tokens the cascade ran 1.20x-1.95x faster than per-beam decode at every point
#: (``h100/kv4_w3_g[568]_round66.json``, the held-out ``h100/kv4_g[5678]_round67.json``: 1.33x-1.95x, and after the
#: change ``h100/auto_kv4_g6_round67.json``: 84 x 3 x 80 at GQA 24/4, the fewest rows and tokens served, 1.20x); at 50
#: tokens 1.05x-1.92x, the 1.05x at 84 x 3 at GQA 24/4, so 50 is not served there. The H200's prediction for it is
#: ``h200/kv4_w3_predictions_round66.txt``.
CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_4_KV_HEADS = ((2, 500), (3, 80), (4, 50), (6, 32))
#: The KV heads at which the 8-beam tile's tables were measured, and each one's table; other KV heads take
#: :data:`CASCADE_MIN_PROMPT`.
CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_BY_KV_HEADS = {8: CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8,
                                                      4: CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_4_KV_HEADS}
#: Above :data:`NARROW_BEAMS_MEASURED_KV_HEADS` KV heads, beams narrower than 8 need this mean prompt on
#: every path, ``(beam width from, tokens)``; beam width 2 is never served there, 8 and more as with fewer
#: KV heads (twentieth round).
NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT = ((3, 1000), (4, 250), (6, 50), (8, 0))
#: The KV heads at which the narrow-beam tables above were measured (and fewer).
NARROW_BEAMS_MEASURED_KV_HEADS = 8


def _scaling_kv_heads(num_kv_heads: Optional[int]) -> int:
    """The KV heads the floors are scaled for: ``num_kv_heads`` capped at 16 (``None``: 8)."""
    return min(int(num_kv_heads), _MAX_SCALED_KV_HEADS) if num_kv_heads else _MEASURED_KV_HEADS


def _scaled_by_kv_heads(value: int, num_kv_heads: Optional[int]) -> int:
    """``value`` (measured at 8 KV heads) times ``8 / Hkv`` for :func:`_scaling_kv_heads`' ``Hkv``, rounded
    up: what decides is ``R x W x Hkv`` (docs/benchmarks-evidence.md has the data)."""
    return -(-value * _MEASURED_KV_HEADS // _scaling_kv_heads(num_kv_heads))


def _row_heads_above_16(base: int, num_kv_heads: Optional[int], head_dim: Optional[int]) -> Optional[int]:
    """The ``R x W x Hkv`` product that replaces the row floor ``base`` above 16 KV heads, or ``None``
    where it does not (16 KV heads or fewer; head 256, not measured there)."""
    if not num_kv_heads or int(num_kv_heads) <= _MAX_SCALED_KV_HEADS or (head_dim is not None and head_dim > 128):
        return None
    return _MANY_KV_HEADS_ROW_HEADS.get(base)


def _row_floor(base: int, num_kv_heads: Optional[int], head_dim: Optional[int]) -> int:
    """The fewest beam rows for the floor ``base`` (rows at 8 KV heads) with ``num_kv_heads``: scaled by
    ``8 / Hkv`` up to 16 KV heads (:func:`_scaled_by_kv_heads`); above, ``R x W x Hkv`` products
    (``_MANY_KV_HEADS_ROW_HEADS``, up to 40 KV heads), or 16's value for floors not measured there."""
    at_16 = _scaled_by_kv_heads(base, num_kv_heads)
    row_heads = _row_heads_above_16(base, num_kv_heads, head_dim)
    if row_heads is None:
        return at_16
    # (never above 16 KV heads' floor: 1,024 / 17 would ask one row more)
    return min(at_16, -(-row_heads // min(int(num_kv_heads), _MAX_MEASURED_KV_HEADS)))


def _kv_heads_note(base: int, num_kv_heads: Optional[int], head_dim: Optional[int]) -> str:
    """How the row floor ``base`` (at 8 KV heads) was scaled, for a decline message (``""`` if it was not)."""
    row_heads = _row_heads_above_16(base, num_kv_heads, head_dim)
    if row_heads is not None:
        heads = min(int(num_kv_heads), _MAX_MEASURED_KV_HEADS)
        if heads < int(num_kv_heads):
            return f" ({row_heads:,} / {heads}: measured up to {heads} KV heads)"
        return f" ({row_heads:,} row-heads / {heads} KV heads)"
    heads = _scaling_kv_heads(num_kv_heads)
    if heads == _MEASURED_KV_HEADS:
        return ""
    if heads < int(num_kv_heads):
        return f" ({base} x {_MEASURED_KV_HEADS} / {heads}: the floor stops scaling at {heads} KV heads)"
    return f" ({base} x {_MEASURED_KV_HEADS} / {heads} KV heads)"


def min_beam_rows(num_kv_heads: Optional[int], prompt_len: Optional[float] = None, group: Optional[int] = None,
                  head_dim: Optional[int] = None, beam_width: Optional[int] = None) -> int:
    """The fewest beam rows (``R x W``) served with ``num_kv_heads`` KV heads: :data:`MIN_BEAM_ROWS`
    (:data:`MIN_BEAM_ROWS_HEAD_256` above head 128, but for head 256 at GQA 3-8), measured at 8
    KV heads, scaled by ``8 / num_kv_heads`` up to 16 KV heads (``None``: 8) and above 16 an ``R x W x
    Hkv`` product
    (:func:`_row_floor`). The library runs
    a program per request and KV head, per-beam decode one per beam row and KV head, so with fewer
    KV heads the library needs more rows to fill the GPU (fourteenth round: at 2 KV heads 120-128
    rows were 0.65x-0.97x of per-beam decode, 480-512 rows 1.69x-5.3x).

    From a mean prompt (``prompt_len``, tokens) of :data:`FEW_ROWS_MIN_PROMPT`, half as many:
    :data:`MIN_BEAM_ROWS_LONG_PROMPT`, scaled the same way, at head 128 (``head_dim`` ``None`` counts as
    128), at head 64 for GQA ``group`` 2-4 and at head 256 for GQA 1-8 (fifteenth and seventeenth
    to twentieth rounds; docs/benchmarks-evidence.md has the data). At head 128, groups 3-8 and 2-8 KV heads the
    fifty-third to fifty-fifth rounds' floor (:data:`MIN_BEAM_ROWS_HEAD_128_REFIT`) replaces both from 99 tokens at
    ``beam_width`` 10 or more (``None``: not judged, as wide), from 160 at 6-9 beams, where under 160 tokens
    :data:`MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW` does, and from 350 at 4-5 (GQA 2 from 160 tokens). 3 beams take
    :data:`MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS` from 500 tokens, GQA 1 at head 128
    :data:`MIN_BEAM_ROWS_GQA1_SHORT_PROMPT` under 200, and head 256 at groups 2-8 :data:`MIN_BEAM_ROWS_HEAD_256_REFIT`
    from 200 tokens and :data:`MIN_BEAM_ROWS_HEAD_128_REFIT` from 400 (fifty-fifth round)."""
    return _row_floor(_beam_rows_floor(prompt_len, group, head_dim, num_kv_heads, beam_width), num_kv_heads,
                      head_dim)


def _long_prompt_floor_applies(group: Optional[int], head_dim: Optional[int]) -> bool:
    """Whether :data:`MIN_BEAM_ROWS_LONG_PROMPT` was measured to serve at this shape (head 128, or
    ``None``; head 64 and head 256 at the groups of ``_FEW_ROWS_HEAD_64_GROUPS`` and
    ``_FEW_ROWS_HEAD_256_GROUPS``)."""
    return (head_dim is None or head_dim == 128 or (head_dim == 64 and group in _FEW_ROWS_HEAD_64_GROUPS)
            or (head_dim == 256 and group in _FEW_ROWS_HEAD_256_GROUPS))


def _beam_rows_floor(prompt_len: Optional[float], group: Optional[int], head_dim: Optional[int],
                     num_kv_heads: Optional[int] = None, beam_width: Optional[int] = None) -> int:
    """The row floor at 8 KV heads, before :func:`_scaled_by_kv_heads`."""
    rows = _older_beam_rows_floor(prompt_len, group, head_dim, num_kv_heads, beam_width)
    narrow = _narrow_floor(prompt_len, group, head_dim, num_kv_heads, beam_width)
    return rows if narrow is None else min(rows, narrow[0][int(beam_width)])


def _older_beam_rows_floor(prompt_len: Optional[float], group: Optional[int], head_dim: Optional[int],
                           num_kv_heads: Optional[int] = None, beam_width: Optional[int] = None) -> int:
    """The row floor at 8 KV heads before the narrow widths' floors of rounds 56-57 (:func:`_narrow_floor`)."""
    if _few_rows_refit_applies(prompt_len, group, head_dim, num_kv_heads, beam_width):
        narrow_short = (beam_width is not None and int(beam_width) < FEW_ROWS_REFIT_WIDE_FROM
                        and float(prompt_len) < FEW_ROWS_REFIT_NARROW_MIN_PROMPT)
        return MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW if narrow_short else MIN_BEAM_ROWS_HEAD_128_REFIT
    head_256 = _few_rows_head_256_refit(prompt_len, group, head_dim, num_kv_heads, beam_width)
    if head_256 is not None:
        return head_256
    long_prompt = prompt_len is not None and float(prompt_len) >= FEW_ROWS_MIN_PROMPT
    if long_prompt and _long_prompt_floor_applies(group, head_dim):
        three_beams = beam_width is not None and int(beam_width) == 3
        return MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS if three_beams else MIN_BEAM_ROWS_LONG_PROMPT
    if head_dim is not None and head_dim > 128 and not (head_dim == 256 and group in _SHORT_ROWS_HEAD_256_GROUPS):
        return MIN_BEAM_ROWS_HEAD_256
    if group == 1 and head_dim in (None, 128) and (prompt_len is None or float(prompt_len) < GQA1_SHORT_PROMPT):
        return MIN_BEAM_ROWS_GQA1_SHORT_PROMPT
    return MIN_BEAM_ROWS


def _narrow_floor(prompt_len: Optional[float], group: Optional[int], head_dim: Optional[int],
                  num_kv_heads: Optional[int], beam_width: Optional[int]):
    """``(rows at 8 KV heads by beam width, least mean prompt)`` of the narrow widths' floor that applies, or ``None``:
    head 128, 2-8 KV heads, 3-5 beams from the floor's prompt, GQA 2-4 on the cascade's narrow tiles
    (:data:`MIN_BEAM_ROWS_NARROW_TILE`, rounds 56-57) or GQA 5-8 (:data:`MIN_BEAM_ROWS_NARROW_TILE_GROUP_8`, where it
    asks fewer than the older floors; round 57). Any of them ``None``: not judged."""
    if (head_dim != 128 or num_kv_heads is None or int(num_kv_heads) not in _FEW_ROWS_REFIT_KV_HEADS
            or beam_width is None or prompt_len is None):
        return None
    for groups, rows, least_prompt in ((_NARROW_TILE_FLOOR_GROUPS, MIN_BEAM_ROWS_NARROW_TILE,
                                        NARROW_TILE_FLOOR_MIN_PROMPT),
                                       (_NARROW_TILE_GROUP_8_FLOOR_GROUPS, MIN_BEAM_ROWS_NARROW_TILE_GROUP_8,
                                        NARROW_TILE_GROUP_8_FLOOR_MIN_PROMPT)):
        if group in groups and int(beam_width) in rows and float(prompt_len) >= least_prompt:
            return rows, least_prompt
    return None


def _few_rows_refit_applies(prompt_len: Optional[float], group: Optional[int], head_dim: Optional[int],
                            num_kv_heads: Optional[int], beam_width: Optional[int] = None) -> bool:
    """Whether the fifty-third to fifty-fifth rounds' floors at head 128 (:data:`MIN_BEAM_ROWS_HEAD_128_REFIT`, or
    :data:`MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW` at 6-9 beams and short prompts) apply: head 128, a known group of 3-8
    (GQA 2 from :data:`FEW_ROWS_REFIT_GQA2_MIN_PROMPT` tokens), 2-8 KV heads, a mean prompt of at least
    :data:`FEW_ROWS_REFIT_MIN_PROMPT` and at least :data:`FEW_ROWS_REFIT_NARROWEST` beams (``None``: not judged),
    under :data:`FEW_ROWS_REFIT_SHORT_PROMPT_FROM` beams from :data:`FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT` tokens:
    where they were measured."""
    if beam_width is not None and int(beam_width) < FEW_ROWS_REFIT_NARROWEST:
        return False
    if head_dim != 128 or num_kv_heads is None or prompt_len is None:
        return False
    return ((group == 2 or group in _FEW_ROWS_REFIT_GROUPS) and int(num_kv_heads) in _FEW_ROWS_REFIT_KV_HEADS
            and float(prompt_len) >= _few_rows_refit_min_prompt(group, beam_width))


def _few_rows_refit_min_prompt(group: Optional[int], beam_width: Optional[int] = None) -> int:
    """The shortest mean prompt (tokens) from which head 128's current-kernel few-rows floor applies at ``group`` and
    ``beam_width`` (``None``: as wide)."""
    least = FEW_ROWS_REFIT_GQA2_MIN_PROMPT if group == 2 else FEW_ROWS_REFIT_MIN_PROMPT
    if beam_width is not None and int(beam_width) < FEW_ROWS_REFIT_SHORT_PROMPT_FROM:
        least = max(least, FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT)
    return least


def _few_rows_head_256_refit(prompt_len: Optional[float], group: Optional[int], head_dim: Optional[int],
                             num_kv_heads: Optional[int], beam_width: Optional[int]) -> Optional[int]:
    """Head 256's current-kernel row floor at 8 KV heads (:data:`MIN_BEAM_ROWS_HEAD_256_REFIT` from
    :data:`FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT` tokens, :data:`MIN_BEAM_ROWS_HEAD_128_REFIT` from
    :data:`FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT`) where it was measured: groups 2-8, 2-8 KV heads, 10 beams or more
    (``None``: as wide); ``None`` elsewhere."""
    if (head_dim != 256 or group not in _FEW_ROWS_HEAD_256_REFIT_GROUPS or num_kv_heads is None
            or int(num_kv_heads) not in _FEW_ROWS_REFIT_KV_HEADS or prompt_len is None
            or (beam_width is not None and int(beam_width) < FEW_ROWS_REFIT_WIDE_FROM)):
        return None
    if float(prompt_len) >= FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT:
        return MIN_BEAM_ROWS_HEAD_128_REFIT
    if float(prompt_len) >= _few_rows_head_256_refit_min_prompt(group):
        return MIN_BEAM_ROWS_HEAD_256_REFIT
    return None


def _few_rows_head_256_refit_min_prompt(group: Optional[int]) -> int:
    """The shortest mean prompt (tokens) from which head 256's current-kernel few-rows floor applies at ``group``."""
    return FEW_ROWS_HEAD_256_REFIT_GQA2_MIN_PROMPT if group == 2 else FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT


def _row_floor_note(base: int, group: Optional[int], head_dim: Optional[int], num_kv_heads: Optional[int],
                    prompt_len: Optional[float], beam_width: int) -> str:
    """What a few-rows decline reason adds after the floor: how it scales with the KV heads, which floor it is
    (head 256's, the long-prompt one, the current kernels' at heads 128 and 256) and the one that a longer prompt or
    more beams would meet."""
    scaled = _kv_heads_note(base, num_kv_heads, head_dim)
    refit = _row_floor(MIN_BEAM_ROWS_HEAD_128_REFIT, num_kv_heads, head_dim)
    per_kv_head = "one query head" if group == 1 else f"{group} query heads"
    where = f"at head {head_dim or 128} with {per_kv_head} per KV head"
    if base == MIN_BEAM_ROWS_HEAD_256:
        scaled += f" at head {head_dim}"
    narrow = _narrow_floor(math.inf, group, head_dim, num_kv_heads, beam_width)  # the floor a longer prompt meets
    narrow_short = narrow is not None and prompt_len is not None and float(prompt_len) < narrow[1]
    if narrow is not None and not narrow_short and prompt_len is not None and base == narrow[0][beam_width]:
        scaled += f" {where} and {beam_width} beams from a mean prompt of {narrow[1]} tokens"
    elif narrow_short:
        scaled += (f" ({_row_floor(narrow[0][beam_width], num_kv_heads, head_dim)} from a mean prompt of {narrow[1]} "
                   f"tokens {where} and {beam_width} beams; this one is {float(prompt_len):.0f})")
    elif base == MIN_BEAM_ROWS_HEAD_128_REFIT:
        scaled += f" {where}"
    elif base == MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS and beam_width == 3:
        scaled += f" at 3 beams and a mean prompt of {FEW_ROWS_MIN_PROMPT} tokens or more"
    elif base == MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW:
        scaled += (f" {where} and {beam_width} beams under a mean prompt of {FEW_ROWS_REFIT_NARROW_MIN_PROMPT} tokens "
                   f"({refit} from {FEW_ROWS_REFIT_WIDE_FROM} beams or {FEW_ROWS_REFIT_NARROW_MIN_PROMPT} tokens; "
                   f"this one is {float(prompt_len):.0f})")
    elif base == MIN_BEAM_ROWS_HEAD_256_REFIT:
        scaled += (f" {where} under a mean prompt of {FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT} tokens ({refit} from "
                   f"{FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT}; this one is {float(prompt_len):.0f})")
    elif base == MIN_BEAM_ROWS_LONG_PROMPT:
        scaled += f" at a mean prompt of {FEW_ROWS_MIN_PROMPT} tokens or more"
    elif base == MIN_BEAM_ROWS_GQA1_SHORT_PROMPT:
        usual = _row_floor(MIN_BEAM_ROWS, num_kv_heads, head_dim)
        prompt = "unknown" if prompt_len is None else f"{float(prompt_len):.0f}"
        scaled += (f" {where} under a mean prompt of {GQA1_SHORT_PROMPT} tokens ({usual} from {GQA1_SHORT_PROMPT}; "
                   f"this one is {prompt})")
    elif beam_width < FEW_ROWS_REFIT_NARROWEST and _few_rows_refit_applies(prompt_len, group, head_dim, num_kv_heads):
        scaled += f" ({refit} from {FEW_ROWS_REFIT_NARROWEST} beams {where}; this one is {beam_width} beams)"
    elif prompt_len is not None and _few_rows_refit_applies(math.inf, group, head_dim, num_kv_heads, beam_width):
        least_prompt = _few_rows_refit_min_prompt(group, beam_width)
        if beam_width < FEW_ROWS_REFIT_WIDE_FROM and least_prompt < FEW_ROWS_REFIT_NARROW_MIN_PROMPT:
            narrow = _row_floor(MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW, num_kv_heads, head_dim)
            refit = f"{narrow} from a mean prompt of {least_prompt} tokens and {refit}"
            least_prompt = FEW_ROWS_REFIT_NARROW_MIN_PROMPT
        scaled += f" ({refit} from a mean prompt of {least_prompt} tokens {where}; this one is {float(prompt_len):.0f})"
    elif prompt_len is not None and _few_rows_head_256_refit(math.inf, group, head_dim, num_kv_heads, beam_width):
        first = _row_floor(MIN_BEAM_ROWS_HEAD_256_REFIT, num_kv_heads, head_dim)
        scaled += (f" ({first} from a mean prompt of {_few_rows_head_256_refit_min_prompt(group)} tokens and {refit} "
                   f"from {FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT} {where}; this one is {float(prompt_len):.0f})")
    elif prompt_len is not None and _long_prompt_floor_applies(group, head_dim):
        fewer = _row_floor(MIN_BEAM_ROWS_LONG_PROMPT, num_kv_heads, head_dim)
        scaled += (f" ({fewer} from a mean prompt of {FEW_ROWS_MIN_PROMPT} tokens; "
                   f"this one is {float(prompt_len):.0f})")
    return scaled


def _narrow_head(head_dim: Optional[int]) -> bool:
    """Whether head 64's cascade table applies (head 128's for ``None``)."""
    return head_dim is not None and head_dim <= 64


def cascade_min_prompt(beam_width: int, head_dim: Optional[int] = None, group: Optional[int] = None,
                       num_kv_heads: Optional[int] = None) -> Optional[int]:
    """The smallest mean prompt (tokens) served at ``beam_width`` (>= 2) when the cascade serves, at
    ``head_dim`` (``None``: head 128's table), GQA ``group`` and ``num_kv_heads`` (``None``: unknown, the general
    tables; :data:`CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_BY_KV_HEADS` where they were measured); ``None`` where no
    prompt measured was served."""
    if _narrow_head(head_dim):
        return _table_value(CASCADE_MIN_PROMPT_HEAD_64, beam_width)
    narrow_tile_table = (CASCADE_MIN_PROMPT_NARROW_TILE_GROUP_8_BY_KV_HEADS.get(int(num_kv_heads))
                         if num_kv_heads is not None else None)
    if head_dim in (None, 128) and group in _NARROW_TILE_GROUP_8_FLOOR_GROUPS and narrow_tile_table is not None:
        return _table_value(narrow_tile_table, beam_width)
    return _table_value(CASCADE_MIN_PROMPT, beam_width)


def _table_value(table, *keys) -> Optional[int]:
    """The value of the last row of ``table`` (rows ``(from, ..., value)`` in ascending order, e.g.
    ``(width from, tokens)`` or ``(width from, rows from, tokens)``) whose thresholds are all at or below
    ``keys``; ``None`` below its first row."""
    hits = [row[-1] for row in table if all(least <= key for least, key in zip(row[:-1], keys))]
    return hits[-1] if hits else None


def narrow_beams_min_prompt(beam_width: int, num_kv_heads: Optional[int]) -> Optional[int]:
    """The smallest mean prompt (tokens) served at ``beam_width`` with ``num_kv_heads`` KV heads on any
    path: 0 (no such limit) at 8 beams and more or at most :data:`NARROW_BEAMS_MEASURED_KV_HEADS` KV
    heads (``None``: 8), ``None`` where no prompt measured was served (beam width 2 above 8 KV heads)."""
    if not num_kv_heads or num_kv_heads <= NARROW_BEAMS_MEASURED_KV_HEADS:
        return 0
    return _table_value(NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT, beam_width)


def _group(num_qo_heads: Optional[int], num_kv_heads: Optional[int]) -> Optional[int]:
    """Query heads per KV head (``None``: either count unknown, or not a whole group)."""
    if num_qo_heads is None or not num_kv_heads or int(num_qo_heads) % int(num_kv_heads):
        return None
    return int(num_qo_heads) // int(num_kv_heads)
