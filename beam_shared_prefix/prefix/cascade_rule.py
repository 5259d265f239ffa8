"""Where ``auto`` takes the one-launch Triton cascade over the two-launch paths (FA4 or FlashInfer prefix + tail):
the mean prompt limits by beam blocks, GQA group, head size, program count and waves (:func:`cascade_prompt_limit`,
:func:`cascade_preferred`), the verdicts of the wide groups and tiles, the tail bounds (:data:`SHARED_RUN_MIN_TAIL`,
:data:`CASCADE_SHORT_TAIL`, :data:`CASCADE_MAX_TAIL`), the eager-step rule (:func:`eager_cascade_preferred`) and the
mean prompt a CUDA-graph wrapper is judged at (:func:`graph_rule_prompt`). The comments above the constants record the
measurements each was set from. Split out of :mod:`beam_shared_prefix.prefix.select`, which combines it with
:mod:`.split_kv_rule`; the launch and wave geometry it counts lives in :mod:`.waves`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

# The module, not its function: _waves.multiprocessors() is looked up at each call, so one patch of it reaches every
# rule here.
from . import waves as _waves
from .waves import _cascade_programs, _wave_balance, wave_efficiency

__all__ = ["CASCADE_BY_WAVES_MIN_BALANCE", "CASCADE_BY_WAVES_MIN_FILL", "CASCADE_BY_WAVES_PARTLY_FULL",
           "CASCADE_FEW_PROGRAMS", "CASCADE_FEW_PROGRAMS_SEVERAL_BLOCKS", "CASCADE_GROUP_8_HEAD_64_MIN_BALANCE",
           "CASCADE_MANY_BLOCKS_HEAD_64", "CASCADE_MANY_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128",
           "CASCADE_MAX_BLOCKS_GROUP_8_HEAD_128", "CASCADE_MAX_GROUP",
           "CASCADE_MAX_MEAN_PROMPT", "CASCADE_MAX_MEAN_PROMPT_BY_WAVES", "CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS",
           "CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_GROUP_8_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_NARROW_TILE",
           "CASCADE_MAX_MEAN_PROMPT_GROUP_8", "CASCADE_MAX_MEAN_PROMPT_GROUP_8_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_HALF_WAVE_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_GROUP_8_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_WIDE_GROUP_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_GROUP_8_HEAD_128",
           "CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128",
           "CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_PARTLY_FULL_GROUP_8_HEAD_128",
           "CASCADE_MAX_MEAN_PROMPT_PADDED_GROUP_8_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS",
           "CASCADE_MAX_MEAN_PROMPT_SPLIT", "CASCADE_MAX_MEAN_PROMPT_SPLIT_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_SPLIT_NO_GQA", "CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP",
           "CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_FEW_PROGRAMS",
           "CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_NO_GQA_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULLER_WAVES_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULL_WAVES_HEAD_64", "CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64",
           "CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_PARTLY_FULL_HEAD_64", "CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128",
           "CASCADE_MAX_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128", "CASCADE_MAX_TAIL",
           "CASCADE_MIN_BLOCK_FILL_GROUP_8_HEAD_128", "CASCADE_NARROW_TILE_MIN_BEAMS",
           "CASCADE_NARROW_TILE_MIN_WAVE_FILL_GROUP_8_HEAD_128", "CASCADE_SHORT_TAIL",
           "CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64", "CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_128",
           "CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64", "CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64",
           "CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64", "EAGER_CASCADE_MAX_BYTES", "EAGER_CASCADE_MAX_MEAN_PROMPT",
           "EAGER_CASCADE_OVER_SPLIT_KV", "EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT", "SHARED_RUN_MIN_TAIL",
           "cascade_preferred", "cascade_prompt_limit", "cascade_step_bytes", "cascade_tail_bound",
           "cascade_tail_too_long", "eager_cascade_over_split_kv", "eager_cascade_preferred", "graph_rule_prompt",
           "group_3_head_64_verdict", "group_8_head_128_narrow_tile_limit", "group_8_head_128_verdict",
           "long_tail_for_shared_run", "one_beam_block", "wide_tile_launch"]

# Where the one-launch cascade beat FA4 + the tail kernel on the H200 (64 requests, head 128, page
# 32, tail 4; docs/benchmarks-evidence.md, "Where auto picks the cascade"). What decides it is how often each
# request's prompt is read: once per block of beams a program holds (up to 64 query rows, so 32
# beams at G = 2, 16 at G = 4).
# - One beam block per request, G <= 2 (W = 14 and 30; the round-4 kernel with its pipelined prompt,
#   auto_rule_round4_*.json): W = 30 16% faster at 500 tokens, 7% at 1,000, 2% at 1,500, even at
#   2,000; W = 14 4% faster at 500, even at 1,000 and 1,500. The round-5 kernel (compile-time page
#   size, leaner index and epilogue code) is 13% faster than FA4 + tail at 2,000 tokens and W = 30
#   (B-long: 149.9 against 173.3 us, B-long.json) and gained 12% at W = 14 and 500 tokens while FA4
#   + tail did not move. Round 6 (B-medium prompt sweep at W = 30, sweep_prompt.json): the cascade
#   14-17% faster at 1,000-2,000 tokens and 10% at 4,000 (264.1 against 294.2 us, 1.03x the floor),
#   hence 4,096; W = 14 beyond 1,500 tokens and every prompt beyond 4,000 are extrapolated.
# - One beam block, G = 3-4 (W = 16 at G = 4, 16-beam tiles, tail first): 8% faster at 100 tokens,
#   even at 250, 4-5% slower at 500-1,500.
# - Several beam blocks (W = 64, 128, 256 at G = 2; W = 30 at G = 4; the round-2/3 kernel): 4-12%
#   faster at prompts of 50-100 tokens, 5-44% slower from 200 tokens up (G = 4: 5% faster at 100,
#   15% slower at 250). Round 6 (auto_rule_round6_*.json), against FA4 + the grouped tail kernel:
#   G = 2 still faster (W = 64: 35% at 50 tokens, 23% at 100, 8% at 200; W = 256: 17% at 50, 8% at
#   100), so 128 stays; G = 4 (W = 30) now 12% slower at 100 tokens (72.5 against 64.6 us), so at
#   G = 3-4 several blocks never pick the cascade. One block at G = 4 (W = 16): 27% faster at 100
#   tokens, 17% at 250 (above 256 not re-measured).
# - Long tails (16 and 64 tokens, W = 30) and head 64 favour the cascade further; fp16 too (against
#   FlashInfer + tail, FA4 being bf16-only). Groups above 4: round 8, below.
# - Round 7: at G = 3-4 and head 128 the cascade's 16-beam tiles attend the tail on CUDA cores
#   (triton_kernels.cascade.cascade_launch_config), against FA4 + tail (auto_rule_round7_*.json):
#   one block (W = 16) 30% faster at 250 tokens, 20% at 500, 14% at 1,000, 9% at 2,000, 5% at
#   4,000, hence 4,096 as at G <= 2; several blocks (W = 30) 23% faster at 50 tokens, 14% at 100,
#   4% at 200, even at 300, 11% slower at 500 (96.8 against 87.0 us, B-4B.json), hence 256.
# - Round 8 (auto_rule_round8_*.json, against FA4 + tail): G = 1 with one block faster everywhere
#   measured (W = 14: 32% at 100 tokens, 11% at 2,000; W = 30: 20% and 4%); several blocks at G = 1
#   (W = 64, two 32-beam tiles) 5% faster at 50 tokens, 6-34% slower from 100 up, hence never. G = 8
#   (16-beam tiles of 128 rows): W = 8 13% faster at 100 tokens, 31% slower at 500; W = 16 24%
#   faster at 100, 9% at 150, 7% at 250, 19% slower at 500; W = 30 (several blocks) 13% faster at
#   100, even at 150, 3% slower at 250; hence 128 tokens at G = 5-8 (G = 5-7 pad to the same tile).
# - Round 9, head 64 (auto_rule_round9_*.json, against FA4 + tail; the limits of head 64 had been
#   taken from older kernels or from head 128). G = 4 (the tensor-core tail at head 64): one block
#   (W = 16) 42% faster at 250 tokens, 35% at 500, 29% at 1,000, 25% at 2,000, 22% at 4,000;
#   several blocks (W = 30) 23% faster at 50-100, 14% at 250, even at 500, 16% slower at 1,000: the
#   limits of head 128 (4,096 and 256) hold at head 64 too. G = 8: W = 8 18% faster at 100, 7% at
#   250, 6% slower at 500; W = 16 31%, 22% and 6% faster at 100, 250 and 500, 12% slower at 1,000;
#   W = 30 (two blocks) 18% and 9% faster at 100 and 250, 6% slower at 500; hence 256 at head 64.
#   G = 1 (one block) 25-35% faster at 500-4,000 tokens, as at head 128. G = 2, several blocks: W =
#   64 30%, 22% and 8% faster at 100, 250 and 500, 10% slower at 1,000; W = 128 27%, 19% and 5%
#   faster; W = 256 15% and 5% faster at 100 and 250, 14% slower at 500; hence 256 at head 64.
#   G = 1, several blocks (32-beam tiles of 32 rows): W = 64 (two tiles) 17% faster at 50 and 100
#   tokens, 10% at 250, 3% slower at 500; W = 128 14-36% and W = 256 19-40% slower from 100 up;
#   hence 256 at head 64 for two tiles, never beyond (or with W unknown).
# - Round 35, G = 2 at head 128, several blocks, re-timed on this tree's kernels (auto_rule_round35_g2_*.json;
#   4, 16 and 64 requests of 48-256 beams): the cascade 1-18% faster than FA4 + tail at all 25 points of
#   192-256 tokens (W = 256 at 64 requests 1% at 256), faster at 320-448 with 48-96 beams but W = 96 at 16
#   requests (2% slower at 384; 128 and 256 beams not timed there), from 4% faster to 7% slower at 500, and
#   3-19% slower at 1,000 but W = 96 at 64 requests; hence 256, as at head 64 (the sixth round's 128 was set
#   on older kernels, 8% faster at 200 tokens then).
# - Round 36, the same grids at 36-256 beams and 320-448 tokens (auto_rule_round36_g2_f.json): at 320 tokens
#   the cascade was faster or within 0.4% at all 21 points of both rounds (36 beams at 64 requests 0.4%
#   slower; 96 beams at 64 requests 18% faster), at 384 from 13% faster to 5% slower (256 beams at 64
#   requests); hence 320. With few programs the limit is higher (CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS).
# - Round 36, one beam block past 4,096 tokens, eager calls (eager_one_block_*_round36.json: 64 requests at
#   GQA 1, 2 and 4, head 128 and 64; 16 requests at GQA 2): at 6,000 and 8,000 tokens the cascade took 3-24%
#   less device time than FA4 + tail and 10-55% less time a call (FA4 + tail's host time), but 16 x 30 at
#   head 64 (128 programs, 25% more device time; the few-programs limit of 2,048 declines it); hence 8,192.
#   Graph replays agreed at 6,000 (2-12% less time, one_block_long_round35.json).
# - Round 37, G = 2 at head 64, several blocks (32-beam tiles), graph replays (auto_rule_round37_g2_d64.json,
#   _wide.json: 4, 16 and 64 requests of 40-256 beams at 128-448 tokens; round 9's 256 was set on older
#   kernels): with 2-4 blocks (40 and 128 beams) the cascade was 1-29% faster than FA4 + tail at every point
#   up to 384 tokens, and 2-4% slower at 448 with 512-2,048 programs; with 5-8 blocks (160-256 beams) and
#   640 or more programs 1-10% faster at 128 tokens and 1-25% slower from 192 (64 x 256 at 256: 202.3
#   against 186.9 us, which the old 256 took). With at most 256 programs (4 requests of 40-256 beams, 16 of
#   40) it was faster at every point up to 448 (by 11-29%) whatever the block count
#   (CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS). Hence 384 for 2-4 blocks and 128 from 5 blocks
#   (and for an unknown W). Checked at widths and request counts outside those grids (auto_check_round37_d64.json:
#   8 and 32 requests of 64-256 beams): the faster arm at 26 of 32 points, at most 10% slower; straight lines
#   miss the cascade's waves (8 x 160 runs 320 programs, 1.2 waves, and lost at every length).
CASCADE_MAX_MEAN_PROMPT = 8192
CASCADE_MAX_MEAN_PROMPT_SPLIT = 320
CASCADE_MAX_MEAN_PROMPT_SPLIT_HEAD_64 = 384
CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_HEAD_64 = 128
#: Beam blocks per request from which G = 2 at head 64 takes :data:`CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_HEAD_64`.
CASCADE_MANY_BLOCKS_HEAD_64 = 5
CASCADE_MAX_MEAN_PROMPT_SPLIT_NO_GQA = 0
CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_NO_GQA_HEAD_64 = 256
CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP = 256
# Fifteenth round: at head 64, groups 3-4, several blocks (30 beams), the cascade was 7-10% faster than
# FA4 + tail at 500 tokens at GQA 3 with 1-16 requests (small_batches_backends_g3_d64.json; 3-6% slower
# at 1,000) and even at GQA 4 with 64 requests (74.7 against 74.6 us, auto_rule_round9_g4_d64_w30_b.json;
# 16% slower at 1,000); hence 512 there.
# Forty-fourth round (H200, graph replays, the cascade's 16-beam tile without its shared-ancestry path, which had
# spilled there and cost every step 12-26% since the twenty-seventh round; g4_d64_w{32,48,80}_nosa_round44.json,
# g3_d64_w48_nosa_round44.json, 8-64 requests at 128-640 tokens): with two blocks (17-32 beams) the cascade was
# faster than FA4 + tail at every point to 512 tokens, by 2-27% (64 x 32 at 512: 74.6 against 76.3 us), and within 2%
# either way at 640; with three and five blocks (33-48 and 65-80 beams) and 384 or more programs from 11% faster to
# 1% slower at 128 tokens, from 2% faster to 13% slower at 256 (G = 3, 16 x 48: 27.7 against 24.5 us) and 8-37% slower
# at 384-512. Hence 512 for two blocks and 128 from three (and where the width is unknown). With fewer programs the
# cascade led further (9 x 48, 216 programs: 9% faster at 512; 9 x 80, 360 programs: 2% at 512), not yet a rule.
# Forty-sixth round: the launch now takes a 32-beam tile at these groups where it pads no more beams and more programs
# than multiprocessors run (8-18% faster than the 16-beam tile at 256-1,000 tokens; g4_d64_tile32_round46.json). These
# limits and their block counts stay the 16-beam tile's (cascade_launch_config without a batch): measured there, they
# take the cascade only where it has since got faster.
CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP_HEAD_64 = 512
CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_WIDE_GROUP_HEAD_64 = 128
# Forty-seventh round (H200, graph replays, 4-token tails; g4_d64_wide_w{32,64,96}*_round47.json and
# g4_d64_w64_few_round47.json: GQA 32/8 at head 64, 4-64 requests of 32, 64 and 96 beams, 128-1,024 tokens), where the
# launch takes the 32-beam tile: with one such block a request (W = 17-32) the cascade was 3-8% faster than FA4 + tail
# at 640 tokens and from 4% faster to 0.5% slower at 768; with two (W = 49-64) 1-35% faster at every point to 384
# tokens (17 x 64 at 384: 46.0 against 46.5 us) and from 14% faster to 6% slower at 512; with three (W = 81-96) from
# 13% faster to 0.6% slower at 256 and from 3% faster to 11% slower at 384. GQA 24/8 (the same tile) stays at the
# limits above: 64 beams took from 17% faster to 18% slower at 256 tokens (g3_d64_wide_w64*_round47.json).
#: G = 4 at head 64 where the launch takes 32-beam tiles: ``{32-beam blocks a request: longest mean prompt}``.
CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64 = {1: 640, 2: 384, 3: 256}
# Forty-eighth round (H200, graph replays, 4-token tails; g[34]_d64_w{32,64,96}_waves_round48.json and
# g3_d64_waves_round48.json: GQA 32/8 and 24/8 at head 64 with 11-64 requests on 32-beam tiles, 64-384 tokens). On
# those tiles (two programs a multiprocessor) a launch a little over one wave runs a second wave almost empty, and its
# time jumps by half (GQA 24/8, 64 beams at 128 tokens: 21.4 us with 16 requests, 256 programs; 32.7 with 17, 272),
# while FA4's grows by a fifth (26.0 to 30.8 us). With three blocks at GQA 4 (96 beams) the cascade was 8% slower
# than FA4 + tail at 256 tokens with waves 0.55 full (12 requests) and 0.6% slower at 0.73 (16; round 47), 11-14%
# faster at 0.91-0.97 (20-64 requests), and faster at 128 tokens at every fill; with two blocks it stayed faster at
# 384 tokens however full (1% at 0.52, 17 x 64). At GQA 3, where FA4 fills its 192-row tile with 64 beams, two or
# three blocks were from 1% faster to 7% slower at 64-128 tokens with waves 0.52-0.64 full (17-21 x 64, 12-14 x 96),
# from 3% faster to even at 0.73-0.79 and 3-30% faster from 0.85; one block (32 beams, where FA4's tile is half
# empty) was 13-19% faster even at 0.52. (A first limit of 0.6 took 14 x 96, 0.64 full, which a held-out run then
# found 0.4-3% slower: g3_d64_w96_waves_heldout_round48.json.)
# The same holds with one block a request (g[34]_d64_w{24,32}_*waves*_round48.json, 33-64 requests of 24 and 32
# beams): past one wave with waves 0.52-0.73 full the cascade was 2-11% faster than FA4 + tail at 256 tokens, from 1%
# faster to 7% slower at 384 and 7-17% slower at 512-768 (GQA 4, 48 x 32 at 640: 72.2 against 64.3 us), points that
# round 47's 640 (GQA 4) and round 44's 512 (GQA 3, measured on 16-beam tiles) took; at 0.85 (56 x 32) it was 4-20%
# faster to 640, and with full waves (33 and 64 x 32, GQA 3) 8-17% faster at 384-512.
#: Past one wave of programs, 32-beam launches at head 64 whose waves are under this fill are partly full.
CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64 = 0.8
#: ``{(GQA group, 32-beam blocks a request): longest mean prompt}`` of partly full 32-beam launches at head 64 (in place
#: of :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64` and of the 16-beam tile's limit; pairs not listed: as
#: with one wave).
CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_PARTLY_FULL_HEAD_64 = {(4, 1): 512, (4, 2): 512, (4, 3): 128, (3, 1): 384}
# Two blocks at GQA 4 past one wave at least 0.8 full (28-64 x 64; g4_d64_w64_long_waves_round48.json and round 47's
# g4_d64_wide_w64_round47.json) were 5-14% faster at 512 tokens, and from 9% faster to 1% slower at 640.
#: ``{(GQA group, 32-beam blocks a request): longest mean prompt}`` of 32-beam launches at head 64 past one wave and at
#: least :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64` full (pairs not listed: as with one wave).
CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULL_WAVES_HEAD_64 = {(4, 2): 512}
# Fiftieth round (g4_d64_w64_{full,fuller}_waves_round50.json with round 47-48's 28-64 x 64): two blocks at GQA 4
# past one wave at least 0.84 full were 3-6% faster than FA4 + tail at 768 tokens (28, 32, 33, 48, 64 and 66 x 64:
# 0.936-0.972) and from 4% faster to even at 896 (28 x 64, 0.848 full: 88.1 against 87.9 us); 40 x 64, 0.81 full, was
# 1% slower at 640 and 3.5% at 768, so 0.8-0.84 keeps 512. Held out (g4_d64_w64_fuller_heldout_round50.json): 29, 30
# and 44 x 64 (0.88-0.91) 0.95-0.97 at 768, 0.98-1.00 at 896. One block stays at 640: 56 x 32 (0.85) was 1.3% slower
# at 768 (g4_d64_w32_fuller_heldout_round50.json).
# Fifty-first round (g4_d64_w32_fuller_waves_round51.json, g4_d64_w32_under_092_round51.json): one block at GQA 32/8
# past one wave 0.92-0.97 full (61-64 x 32 over two waves, 92-96 x 32 over three) was 1.5-5% faster at 768 tokens and
# from 2% faster to 1.3% slower at 896; 58-60 x 32 (0.88-0.91) were even at 768 (0.997-1.005), so one block takes
# 768 from 0.92. Held out at GQA 16/4 (g4_d64_w32_kv4_*_round51.json; 122-190 x 32, 0.92-0.99 full): 5-13% faster at
# 704-768 tokens, 2-9% at 896, even to 6% faster at 1,024.
#: Past one wave of programs, ``{(GQA group, 32-beam blocks a request): least wave fill}`` from which 32-beam launches
#: at head 64 are fuller still.
CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64 = {(4, 1): 0.92, (4, 2): 0.84}
#: ``{(GQA group, 32-beam blocks a request): longest mean prompt}`` of 32-beam launches at head 64 past one wave and at
#: least as full as :data:`CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64` gives for the pair (pairs not listed: as at
#: :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64`).
CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULLER_WAVES_HEAD_64 = {(4, 1): 768, (4, 2): 768}
# Forty-ninth round: where the 32-beam launch would run two waves, the second at most half full, the launch takes
# 16-beam tiles (triton_kernels.cascade.wide_group_head_64_tile_choice, "half_wave"; 4-11% faster than the 32-beam tile
# at 272-384 programs). On the 16-beam tile at those shapes
# (g[34]_d64_*_half_wave_round49.json: 34-48 x 32, 17-24 x 64 and 12 x 96 at GQA 32/8, 36-48 x 32, 17-20 x 64 and 12 x 96
# at GQA 24/8, graph replays, 4-token tails) the cascade against FA4 + tail was:
# - one 32-beam block's width (two 16-beam blocks): GQA 4 0.83-0.87 at 256 tokens, 0.90-0.94 at 384, 0.97-0.995 at 512
#   and 1.02-1.03 at 640 (the 32-beam tile had been 1.07-1.08 at 512); GQA 3 0.79-0.82 at 128, 0.94-0.96 at 384 and
#   1.01-1.02 at 512;
# - two (four 16-beam blocks): GQA 4 0.86-0.88 at 256, 0.93-0.94 at 384, 0.99-1.00 at 512, 1.03-1.04 at 640; GQA 3
#   0.98-1.00 at 64-128 tokens and 1.09-1.10 at 256;
# - three (six): 0.95 (GQA 4) and 0.98 (GQA 3) at 128 tokens, 1.04-1.08 at 256.
# Those launches (two waves, the second at most half full) were the ones round 48's limits for partly full 32-beam
# launches had been fitted on. What stays on 32-beam tiles past one wave under 0.8 full is two waves 0.75-0.8 full
# and three 0.67-0.8 full. Held out (g[34]_d64_*_tile_heldout_round49.json), 50-52 x 32 and 26 x 64 (0.76-0.79) were
# faster than FA4 + tail to every limit that would apply without the table: GQA 4, one block 0.97-0.98 at 640 tokens,
# two 0.90 at 512; GQA 3, one block 0.97 at 512, two 0.99 at 128 (1.11 at 256). At three waves 0.71 full, timed on
# 16-beam tiles (70 x 32, 35 x 64; g[34]_d64_*_16beam_three_waves_round49.json; the 32-beam tile was within 1% of
# them there, or 4-5% faster), GQA 4 with one block was 0.86-1.00 to 512 tokens and 1.03 at 640, two blocks 0.88-0.96
# to 384 and 1.02 at 512; GQA 3 with one block 0.82-0.98 to 384 and 1.03 at 512, two blocks 1.04-1.05 at 64-128
# tokens (the 32-beam tile, 4% faster than the 16-beam one at 35 x 64, would put two blocks near 0.98 at 512). Hence
# 512 with one and two blocks at GQA 4, 384 with one at GQA 3 and round 48's 128 with three at GQA 4;
# group_3_head_64_verdict declines GQA 3 with two or more blocks under 0.75 full.
#: G = 3 at head 64 on 32-beam tiles, two or more blocks a request: the least wave fill with which ``auto`` takes the
#: cascade where the launch runs more than one wave (:func:`group_3_head_64_verdict`).
CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64 = 0.75
#: ``{(GQA group, 32-beam blocks the width fills): longest mean prompt}`` at head 64 where the launch keeps 16-beam
#: tiles because the 32-beam launch would run two waves, the second at most half full (pairs not listed: the 16-beam
#: tile's).
CASCADE_MAX_MEAN_PROMPT_HALF_WAVE_HEAD_64 = {(4, 1): 512, (3, 1): 384, (4, 2): 512, (3, 2): 128, (4, 3): 128,
                                             (3, 3): 128}
CASCADE_MAX_MEAN_PROMPT_GROUP_8 = 128
# Forty-fifth round (H200, graph replays; g8_d64_4warps_w{8,16,30,48,96}_round45.json and
# g6_d64_4warps_w30_round45.json: 4, 16 and 64 requests at GQA 64/8, 16 and 64 at GQA 48/8, 128-2,000 tokens). Above
# one program a multiprocessor the 128-row tile runs 4 warps, two programs a multiprocessor where 8 warps held one
# (tune_cascade's g8_d64_warps_round45.json and g8_d64_few_programs_round45.json: 1-48% faster at 192-3,072 programs).
# There the cascade against FA4 + tail went by the waves of the two grids (wave_balance): at a balance of 0.75 (4 x 96
# and 16 x 48: 192 and 384 programs) it was 8-93% slower at every length, 128 tokens included; at 1 with G = 8 (16 x
# 30, 16 x 96, 64 requests of every width) 6-28% faster at 128 tokens, with one or two blocks (8-32 beams) 1-21%
# faster at 256-512 (64 x 16 at 512: 66.2 against 74.3 us) and from 3% faster to 8% slower at 768-1,024, and with
# three or six blocks 2-6% faster at 256 but 16 x 96 (5% slower) and 5-19% slower from 384. GQA 6 pads to the same
# 8-row groups: 2-3% faster at 128 tokens, 11% slower at 256. Hence 512 (two blocks), 256 (three or more, or W
# unknown) and 128 (G = 5-7), each where the balance reaches CASCADE_GROUP_8_HEAD_64_MIN_BALANCE. (The old 256-token
# limit, set on the 8-warp tile at 64 requests, took the slower points of a balance of 0.75.)
CASCADE_MAX_MEAN_PROMPT_GROUP_8_HEAD_64 = 512
CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_GROUP_8_HEAD_64 = 256
CASCADE_MAX_MEAN_PROMPT_PADDED_GROUP_8_HEAD_64 = 128
# With at most one program a multiprocessor the tile keeps 8 warps (triton_kernels.cascade.cascade_launch_config);
# there (g[68]_d64_few_w*_round45.json: 1-16 requests of 8-96 beams, 8-128 programs, 128-1,000 tokens) the cascade
# took 15 us at 128 tokens whatever the batch, while FA4 + tail grew with it: with 48-128 programs the cascade was
# 7-20% faster at 128-256 tokens and within 2% either way at 384; with 8-32 programs from 3% faster to 8% slower at
# 128 and 4-15% slower at 256.
#: G = 5-8 at head 64 with more than :data:`CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64` programs and at most one a
#: multiprocessor.
CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_GROUP_8_HEAD_64 = 256
#: G = 5-8 at head 64 never takes the cascade with at most this many programs.
CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64 = 32
#: The least :func:`wave_balance` at which G = 5-8 at head 64 takes the cascade (requests and width known): the
#: forty-fifth round's grids lost at every point of 0.75 or less and won at 1.
CASCADE_GROUP_8_HEAD_64_MIN_BALANCE = 0.9
# Forty-seventh round (H200, graph replays, 4-token tails; g8_d128_*_round47.json, g6_d128_*_round47.json and
# g5_d128_decl_round47.json: GQA 64/8, 48/8 and 40/8 at head 128, 4-64 requests of 8-96 beams, 32-512 tokens). The
# 128-row tile (16 beams of 8 padded heads, 8 warps) keeps the shared-ancestry path unless its launch is given a
# tail bound of at most CASCADE_SHORT_TAIL, and with the path the cascade was slower than FA4 + tail at all 73
# points, by 7-25% at 32-128 tokens (which the old rule took) and by 17-72% at 256-512. With the bound
# (`--declare-tail`) it was 3-16% faster at 32-128 tokens with one or two beam blocks, 128-512 programs and blocks
# at least 3/4 full (W = 12, 16, 30; W = 8 at 128 programs), 3-8% slower with half-full blocks at 256-512 programs
# (W = 8 at 32 and 64 requests), from 5% faster to 3% slower at 1,024 programs (64 x 30) and from 0.4% faster to 7%
# slower with six blocks (W = 96 at 16 and 64 requests). Forty-eighth round, with the bound
# (g[68]_d128_decl_*_round48.json: 1-8 requests of 8-30 beams, 8-64 programs, 32-128 tokens; 40-48 requests of 16 and
# 30 beams): from 3% faster to 10% slower at 8-48 programs (a program reads one request's prompt for 16 beams while
# FA4 + tail spreads the step over more CTAs), 2-6% faster at 56-64, and from 3% faster to 1% slower at 640-768
# programs with full blocks (past the cap, which stays).
#: G = 5-8 at head 128: the most beam blocks per request with which ``auto`` takes the cascade.
CASCADE_MAX_BLOCKS_GROUP_8_HEAD_128 = 2
#: G = 5-8 at head 128: never the cascade with at most this many programs.
CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_128 = 48
#: G = 5-8 at head 128: never the cascade with more programs than this many per multiprocessor.
CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128 = 4
#: G = 5-8 at head 128: the least fill of the beam blocks (beams over block capacity) with which the cascade runs
#: more programs than the GPU has multiprocessors.
CASCADE_MIN_BLOCK_FILL_GROUP_8_HEAD_128 = 0.75
# Narrow widths at G = 5-8 and head 128 (fifty-seventh round, narrow_g[68]_round57_kv*.json and
# narrow_tile_round56_g8_kv8.json: 8-64 requests of 3-8 beams at GQA 64/8, 48/8 and 32/4, 300-1,500 tokens, tail bound
# 4) run the 8-beam tile (triton_kernels.cascade.NARROW_TILE_BEAMS), two programs a multiprocessor
# (NARROW_TILE_GROUP_8_PROGRAMS_PER_SM), against FA4 + tail:
# - at most one program a multiprocessor (64-128 programs): from 2% faster to 7% slower at 300 tokens, 17-48% slower
#   from 600;
# - one wave (192-256 programs) or waves 0.97 full (512): 1.23-1.39x faster at 300 tokens, 1.06-1.18x at 600-800,
#   1.02-1.10x at 1,000; 3-5% slower at 1,500 (192 programs);
# - waves 0.73 full (384 programs, 1.45 waves): 1.04-1.18x faster at 300 tokens, 9-16% slower at 600, 20-26% at 1,500.
# Held-out 25 (select_heldout25_g[578]_*.json, predicted with 1,024 and 320 at every group): G = 7-8 served as
# predicted, 1.04-1.44x faster at 250-950 tokens (and 200 x 5 at GQA 16/2, waves 0.76 full, 1.12-1.25x where FA4 ran);
# but G = 5, whose 5 query heads a KV head the 8-row tile pads by 3 (FA4 packs them), was 1.05-1.12x faster at 450
# tokens and 1-3% slower at 900 in one wave or full ones, and 1% slower at 280 with waves 0.61 full (4 beams). Hence
# G = 5-6 (G = 6 measured only at 300 tokens) take lower limits. Held-out 26 (select_heldout26_g[57]_*.json): G = 5 at
# 30 and 64 requests of 5 and 8 beams, 1.06-1.23x faster at 350-600 tokens where taken, and 1-7% faster at 750 where
# left to FA4 + tail; G = 7 at 100 x 4 (waves 0.76 full) 1.25x at 300 tokens, 1.07x at 500 (left). Its G = 6 grids ran
# past their time limit in FA4's compile, so G = 6 takes G = 5's full-wave limit, untested at full waves (and 320
# where its waves are partly full, from its 300-token points).
#: G = 5-8 at head 128, narrow widths: ``{group: mean prompt limit}`` of the cascade whose launch runs one wave of the
#: 8-beam tile or waves at least :data:`CASCADE_NARROW_TILE_MIN_WAVE_FILL_GROUP_8_HEAD_128` full.
CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_GROUP_8_HEAD_128 = {5: 640, 6: 640, 7: 1024, 8: 1024}
#: ... and of one whose waves are less full.
CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_PARTLY_FULL_GROUP_8_HEAD_128 = {5: 256, 6: 320, 7: 320, 8: 320}
#: G = 5-8 at head 128, narrow widths: the least fill of the 8-beam tile's waves (programs over waves x wave) with
#: which a launch of more than one wave takes :data:`CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_GROUP_8_HEAD_128`.
CASCADE_NARROW_TILE_MIN_WAVE_FILL_GROUP_8_HEAD_128 = 0.9
# The 8-beam tile's launches past 4 programs a multiprocessor (sixty-first round, H200, graph replays, 4-token tails,
# 8 KV heads: rule_flip_g[58]_kv8_round61.json, 64-128 requests of 3 and 5 beams at 100-200 tokens;
# narrow_cap_g[58]_kv8_round61.json, 96 and 192 requests of 3 and 5 beams at 300-1,000 tokens; GQA 40/8 and 64/8),
# which the wide tile's cap (CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128) had left to FA4 + tail unmeasured: the
# cascade was 1.27-1.73x faster than FA4 + tail at 100-200 tokens (768 and 1,024 programs), and at 768 and 1,536
# programs 1.23-1.44x at 300 tokens, 1.03-1.17x at 600, and at 1,000 1.02-1.06x at G = 8 and 0.96-1.01x at G = 5 (past
# its 640-token limit), as the full-wave limits of the fifty-seventh round predict (2.9-5.8 waves of the tile, 0.97
# full).
# Past that edge (sixty-fifth and sixty-sixth rounds, an H100, whose 132 multiprocessors are the H200's; graph replays,
# 4-token tails, GQA 64/8: cap_edge_g8_kv8_round65.json, 256 x 3 at 100 and 150 tokens; cap_edge_224_round66.json,
# 224 x 3 and 5 at 100 and 300), 1,792 and 2,048 programs (13.6 and 15.5 a multiprocessor): the cascade 1.49-2.53x
# faster than per-beam decode, FA4 + tail 0.90-1.69x (0.90-0.94x at 100 tokens of 3 beams, where (W - 1) x P declined
# it). Longer prompts were not timed past the edge, where the H200's margin over FA4 + tail narrowed (1.02-1.06x at
# 1,000 tokens, G = 8): they keep the edge.
#: G = 5-8 at head 128, narrow widths: never the cascade with more programs than this many per multiprocessor.
CASCADE_MAX_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128 = 16
#: ... and past this many (the H200 grids' edge: 1,536 programs, 11.6 a multiprocessor on its 132), only up to a mean
#: prompt of :data:`CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128` tokens (the H100 grids').
CASCADE_MANY_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128 = 12
CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128 = 300
#: The narrowest beam width the narrow-tile clauses (G = 5-8 at head 128, and
#: :data:`CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_NARROW_TILE`) were measured at; narrower ones keep the wide tile's rules.
CASCADE_NARROW_TILE_MIN_BEAMS = 3
CASCADE_MAX_GROUP = 8

# Few requests, the cascade against FA4 + tail (eleventh round, the same files). With few programs
# (at most 128: under one per SM) each attends its whole prompt in turn, and FA4 overtakes it at
# shorter prompts than with 64 requests:
# - GQA 4, head 128, one block (16 beams): 4 requests 6% and 16 requests 13% faster than FA4 at 250
#   tokens, 7% slower and even at 500, 24% and 15% slower at 1,000, and 1-16 requests 34-60% slower
#   at 4,000. With 32 requests (256 programs) the cascade is 6-46% faster from 250 to 4,000 tokens.
#   Hence 256 tokens up to 128 programs at groups 3-4 (G = 3 shares G = 4's tiles; measured at G = 4).
# - GQA 2, head 64, one block: 3% slower than FA4 at 2,000 tokens with 16 requests, 10-13% at
#   4,000 (faster at 1,000); hence 2,048.
# - GQA 2, head 128, 64-row tiles (17-32 beams): within 7% of FA4 either way at 8 and 16 requests up to
#   4,000 tokens; no limit. 32-row tiles (8-16 beams; sixteenth round, the files above): the cascade
#   within 5% of FA4 or faster at 250 tokens with 8-128 programs (19.7 against 21.1 us at 16 x 8),
#   15-29% slower at 500 and 35-53% at 1,000 (16 x 16 x 1,000: 45.8 against 33.7); with 256 programs
#   (16 requests at 16 KV heads) even at 500 tokens (35.6 against 36.9). Hence 256 tokens there.
# - GQA 4, head 64, one block (thirteenth round, small_batches_backends_g4_d64{,_b}.json: 1-16 requests
#   of 8 and 16 beams): the cascade 16-26% faster than FA4 at 250 tokens and 8-12% at 500, within 5%
#   either way at 1,000, 11-14% slower at 2,000 and 17-29% at 4,000; hence 1,024.
# - GQA 1 (fourteenth round, small_batches_backends_g1{,_b,_d64}.json: 1-16 requests of 8, 16 and 30
#   beams; 16-row tiles up to 16 beams, 32-row tiles above). Head 128, 16-row tiles: the cascade
#   5-25% faster than FA4 at 250-500 tokens, from 10% faster (128 programs) to 11% slower (8
#   programs, where FlashInfer serves) at 1,000, 4-11% slower at 2,000 with 8-64 programs and even
#   with 128; 32-row tiles: within 8% either way at 250 tokens, 2-15% slower at 500, 7-37% at
#   1,000. Head 64: 16-row tiles faster or within 1% everywhere measured (250-4,000 tokens);
#   32-row tiles faster or even up to 1,000 tokens, 6-18% slower at 2,000-4,000. Hence 1,024 and
#   256 tokens at head 128 and 1,024 for 32-row tiles at head 64.
# - GQA 3 shares GQA 4's tiles and limits; its grids (small_batches_backends_g3{,_b,_d64}.json)
#   agree: at head 128 the cascade 9-15% faster than FA4 at 250 tokens with few programs, within 3%
#   at 500 and 8-24% slower at 1,000; at head 64 within 4% at 1,000 where FlashInfer does not
#   serve, 12-19% slower at 2,000.
CASCADE_FEW_PROGRAMS = 128
#: ``{(GQA group, head size): mean prompt limit}`` of the cascade with at most
#: :data:`CASCADE_FEW_PROGRAMS` programs and one beam block (group 3 takes group 4's entry); a
#: ``{tile rows: limit}`` value where the limit depends on the tile (rows not listed: no limit).
CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS = {(4, 128): 256, (2, 64): 2048, (4, 64): 1024, (1, 128): {16: 1024, 32: 256},
                                        (1, 64): {32: 1024}, (2, 128): {32: 256}}
# Fifty-seventh round (few_programs_g4_round57_kv*.json: 4-32 requests of 3-4 beams at GQA 32/8 and 16/4, 32-128
# programs, 300-3,000 tokens): the 4-beam tile (NARROW_TILE_BEAMS) was 1.11-1.14x faster than FA4 + tail at 300 tokens
# and 4-7% slower at 600, where the 16-beam tile had lost from 300 on.
#: :data:`CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS`'s entries where the width runs the narrow tile
#: (``triton_kernels.cascade.narrow_tile_beams``; group 3 takes group 4's entry).
CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_NARROW_TILE = {(4, 128): 384}
_FEW_PROGRAMS_NARROW_TILE_TABLE = {**CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS, **CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_NARROW_TILE}
# Two beam blocks at GQA 2 (33-64 beams) with at most 128 programs (twelfth round, the wide files):
# the cascade was 8-14% faster than FA4 at 500 tokens with 1-8 requests at head 128 and within 2%
# of it at 1,000 (7% faster with 8 requests); 9% slower at 2,000. At head 64, 1-8 requests, 7-12%
# faster at 1,000 tokens and 4-6% slower at 2,000. With 16 requests (256 programs) at head 128 the
# two were within 3% at 500 tokens, so the usual 128-token limit stays there.
#: ``{(GQA group, head size): mean prompt limit}`` of the cascade with two beam blocks and at most
#: :data:`CASCADE_FEW_PROGRAMS` programs (it raises :func:`cascade_prompt_limit`'s several-block limit).
CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_FEW_PROGRAMS = {(2, 128): 1024, (2, 64): 1024}
# Several beam blocks at GQA 2 (33-256 beams) with at most 128 programs (thirty-sixth round,
# few_programs_g2_round36.json and auto_rule_round3[56]_g2_*.json: 1, 2 and 4 requests of 36-256 beams at
# head 128): the cascade 7-12% faster than FA4 + tail at 256-448 tokens with 48-128 programs (and than
# FlashInfer + tail at 448, where it ran), 1-1.5% slower with 24-32 (1 request of 96 or 128 beams at 448),
# from 10% slower to 1% faster at 768 (two blocks keep their own, higher limit).
# Head 64 (thirty-seventh round, auto_rule_round37_g2_d64*.json): with at most 256 programs (4 requests of
# 40-256 beams, 16 requests of 40) the cascade was 11-29% faster than FA4 + tail at every point up to 448
# tokens, with 2 to 8 blocks; with 512 or more, 2-4% slower at 448 even with 2-4 blocks.
# GQA 3-4 at head 64 (forty-eighth round, g4_d64_few{,_blocks}_round48.json and g3_d64_few_round48.json: 1-8
# requests of 32-128 beams at 256-640 tokens, 24-256 programs of the 16-beam tile, which a launch of at most 256 of
# them keeps): the cascade was faster than FA4 + tail at every point, at GQA 4 by 5-21% at 256-512 tokens and by
# 1.4-8% at 640 (6 x 64: 24.3 against 24.7 us), at GQA 3 by 4.5-18% at 256-512 (not measured further). Hence 640 and
# 512 (the 128 of three or more blocks at more programs, and of an unknown batch, stays).
#: ``{(GQA group, head size): mean prompt limit}`` of the cascade with two or more beam blocks and at most
#: :data:`CASCADE_FEW_PROGRAMS_SEVERAL_BLOCKS` programs (it raises :func:`cascade_prompt_limit`'s
#: several-block limit; two blocks take the larger of this and
#: :data:`CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_FEW_PROGRAMS`).
CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS = {(2, 128): 448, (2, 64): 448, (4, 64): 640, (3, 64): 512}
#: ``{(GQA group, head size): programs}``: how many cascade programs count as few for
#: :data:`CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS` (elsewhere :data:`CASCADE_FEW_PROGRAMS`).
CASCADE_FEW_PROGRAMS_SEVERAL_BLOCKS = {(2, 64): 256, (4, 64): 256, (3, 64): 256}
# Several beam blocks at head 128, judged by waves (rounds 38 and 39; graph replays). Past the several-block limit
# the cascade reads the prompt once per beam block (64 rows), FA4 once per 128-row tile (its own tile at head 128 on
# SM90; a request's W x G rows of a KV head, pack_gqa), so the cascade is at its best where FA4's last tile is half
# empty: an odd block count, 3 or 5 blocks against 2 or 3 tiles. Even counts (2 or 4 blocks against 1 or 2 full
# tiles) were from 8% faster to 5% slower (56 x 112 at 384: 133.8 against 127.2 us,
# g2_d128_many_programs_check_round38.json) and keep the several-block limit.
# Round 38 took 3 and 5 blocks at GQA 2 from 768 programs; held out (g2_d128_many_programs_check2_round38.json) it
# left 28 x 88 (672 programs), 12% faster with the cascade, while 24 x 80 (576) was 9% slower: a program count misses
# the waves. What the odd counts gain is a few percent, about what the last, partly filled wave of either kernel
# costs: the cascade runs two programs a multiprocessor (253-255 registers, tune_default_regs_round39.json), FA4 one
# CTA. With each kernel's wave efficiency (wave_efficiency) the ratio of the two times fit as base x (FA4's
# efficiency / the cascade's)^0.44-0.57, a 1.6-2.9% rms residual against 6.8-8.8% without the waves. Round 39
# (graph replays, 384-448 tokens unless named):
# - GQA 2, 3 blocks (77-96 beams; g2_d128_waves_round39.json, 11-44 requests of 96 beams, request counts picked by
#   waves, and the round-37/38 grids): with a wave balance (wave_balance: the cascade's efficiency over FA4's) of at
#   least 0.87 faster everywhere, by 8-29% (11 x 96 at 448: 25.8 against 36.2 us), at 0.75 (8, 16 and 24 requests)
#   even to 10% slower.
# - GQA 2, 5 blocks (129-160 beams; g2_d128_five_blocks_waves_round39.json, 8-33 requests of 144 and 160 beams, and
#   the round-37/38 grids): at a balance of 0.92 or more faster everywhere, by 3-15% (12 x 160 at 448: 46.0 against
#   54.1 us), at 0.83 (8, 16 and 20 requests) 0.5-8% slower, 20 requests (800 programs, which round 38 took) among
#   them.
# - GQA 4, 3 blocks (33-48 beams; g4_d128_waves_round39.json, 11-55 requests of 40-48 beams;
#   g4_d128_odd_blocks*_round39.json, 16-96 requests at 320-512 tokens): the lead is smaller. With 44-48 beams and
#   a balance of at least 0.95 faster everywhere to 448 tokens, by 2-29% (11 x 48 at 448: 25.1 against 35.5 us);
#   below it from 5% faster (39 x 48) to 11% slower (16 x 44 at 416: 43.9 against 39.8 us); 40 beams led by 1-5%
#   at even waves, too little to keep; 5 and 7 blocks 1-7% faster at 320 tokens and slower from 352.
# Held out from the three-block raise (g4_d128_waves_check_round39.json, 13-72 requests of 45 and 47 beams at 352
# and 416; g2_d128_waves_check_round39.json, 9-36 requests of 84 and 92 beams at 384 and 448; auto timed with it):
# every point taken was faster, by 0.5-29%, and at every point left FA4 + tail was faster or within 3%. Held out from
# the five-block threshold (g2_d128_five_blocks_check_round39.json, 6-36 requests of 136 and 152 beams at 384 and 416):
# every point taken faster, by 1-28%, every point left faster with FA4 + tail, by 2-13% (22 requests, 880 programs,
# which round 38's count took, among them).
# GQA 2, seven blocks (193-224 beams; round 43, H200, g2_d128_seven_blocks_waves_round43.json: 8-43 requests of 224
# beams at 320-448 tokens, request counts picked by balance): four 128-row FA4 tiles, the last half full, as with 3
# and 5 blocks. At a balance of 1.09 or more (9, 13 and 17 requests) the cascade was faster at every point, by 4-16%
# (9 x 224 at 448: 46.3 against 53.8 us); at 0.96-1.02 (25, 31, 36 and 43) by 6-7% at 320 and by at most 2% at
# 384-448 (43 x 224 at 384 0.2% slower); at 0.88 (8 and 20) 3-5% slower at 384-448.
# Held out (g2_d128_seven_blocks_held_out_w{196,208,216}_round43.json, 9-50 requests at 384 and 448, auto timed with
# the rule): of the 36 points taken 35 were faster with the cascade, by 1-15%, and 21 x 196 at 384 0.5% slower; of the
# 18 left, from 4% faster (50 x 216 at 448, a balance of 1.03) to 10% slower.
# Head 64, GQA 2, five blocks (129-160 beams; round 41, H200, g2_d64_waves_round41.json: 9-44 requests of 144 and 160
# beams at 192-320 tokens, graph replays). FA4's own tile at head 64 on SM90 is 192 rows, so 160 beams (320 rows of a
# KV head) take two half-full tiles against the cascade's five full blocks. At a balance of 1.25 (9, 10, 13, 18 and 26
# requests) the cascade was faster at every point to 256 tokens, by 4-12% (18 x 144 at 192: 40.3 against 45.6 us),
# and at 320 from 7% faster to 2% slower (26 requests); at 1.04-1.07 (36 and 44) from 2% faster to 2% slower at
# 192-256 and 6-11% slower at 320. The thirty-seventh round's 128 tokens for five blocks stands elsewhere: its 8 x 160
# (a balance of 0.62) lost at every length, 64 x 160 (1.0) by 1-2% at 192-224. Held out
# (g2_d64_waves_check_round41.json, 11-58 requests of 148 and 156 beams at 224 and 256, auto timed with it): the 20
# points taken were faster with the cascade by 4-12%; of the 20 left (balances 0.83-1.11) none was faster with it by
# more than 2.4%.
# Head 64, GQA 2, six to eight blocks (161-256 beams; round 42, H200, g2_d64_w{192,224,256}_waves_round42.json: 7-43
# requests at 192-384 tokens, graph replays, request counts picked by balance). FA4's tiles decide how full its waves
# must be: 192 beams fill two 192-row tiles exactly, 224 and 256 take three tiles 0.78 and 0.89 full.
# - 6 blocks (192 beams): at a balance of 1.5 (9 requests) 9-10% faster to 256 tokens; at 1.2 (26) 1% slower, at
#   1.12 (18, 43) 4-6% slower, at 1.0 (30) 10% slower.
# - 7 blocks (224 beams): at 1.17 (7, 13, 23 and 28 requests) 6-12% faster to 256 tokens (0.97-1.01 at 384); at 1.0
#   (31) 1% faster, at 0.93 (20) even.
# - 8 blocks (256 beams): at 1.33 (7 and 12 requests) 9-12% faster to 256 tokens; at 1.07-1.14 (18, 23, 28) from 1%
#   faster to 3% slower; at 1.0 (14) 6% slower. (Round 37's 8 x 256 at 1.33: 0.84-0.98 from 128 to 384 tokens.)
#: ``{(GQA group, head size): mean prompt limit}`` of the cascade with a beam block count listed in
#: :data:`CASCADE_BY_WAVES_MIN_BALANCE`, the blocks at least :data:`CASCADE_BY_WAVES_MIN_FILL` full on average and
#: the batch's :func:`wave_balance` at least the count's (it raises :func:`cascade_prompt_limit`'s several-block
#: limit).
CASCADE_MAX_MEAN_PROMPT_BY_WAVES = {(2, 128): 448, (4, 128): 448, (2, 64): 256}
#: ``{(GQA group, head size): {beam blocks: least wave balance}}`` (block counts not listed: no raise).
CASCADE_BY_WAVES_MIN_BALANCE = {(2, 128): {3: 0.8, 5: 0.9, 7: 1.05}, (4, 128): {3: 0.95},
                                (2, 64): {5: 1.2, 6: 1.5, 7: 1.15, 8: 1.3}}
#: ``{(GQA group, head size): least mean fill of the beam blocks}`` (the fullest measured: 80-96 beams in three
#: GQA-2 blocks, 144-160 in five, 196-224 in seven, 44-48 in three GQA-4 blocks; 144-160 in five, 180-256 in six to
#: eight at head 64).
CASCADE_BY_WAVES_MIN_FILL = {(2, 128): 0.8, (4, 128): 0.9, (2, 64): 0.9}
#: ``{(GQA group, head size): (least fill, least balance)}``: blocks under :data:`CASCADE_BY_WAVES_MIN_FILL` but at
#: least this full take the raise at this (higher) wave balance, whatever their count's. Round 40: GQA 4 with 40-43
#: beams in three blocks (0.83-0.9 full) was faster with the cascade at every balance of 1.05 or more, by 1-25% (40
#: beams, H200, g4_d128_waves_round39.json) and 5-24% (41-43 beams held out, H100, g4_d128_fill_check_round40.json);
#: at 1.0 by 0.4-5% and 1-3%; at 0.94 and below it was slower, by up to 2.5% and 18%.
CASCADE_BY_WAVES_PARTLY_FULL = {(4, 128): (0.83, 1.05)}

# Long tails and the shared-run stage (twenty-ninth round, shared_run_round29_*.json and
# shared_cross_round29_*.json; GQA 16/8 and 32/8, head 128, page 32, 14-96 beams, 100-3,000 tokens, tails
# 3-256). With the stage between the prefix and the tail (triton_kernels.beam_shared_run_attention), FA4 +
# tail was the fastest arm at every point from 96 generated tokens under the benchmark's beam search
# (coalescing histories): 1-65% faster than the cascade (64 x 14 x 100 at 192 tokens: 132.8 against
# 236.2 us) and 5-64% than FA4 + tail without it (64 x 30 x 500 at 256: 216.2 against 499.6 us). Without
# shared ancestry (every beam its own parent) the stage finds no run and cost 0.8-1.8% at 256 tokens,
# while FA4 + tail beat the cascade from 64 tokens by 8-31% (twenty-eighth round). At 64 tokens the stage
# was within 13% either way (B-4B, 64 x 96: 7% slower), at 3-16 tokens 1-10% slower (3.6-22 us): below
# SHARED_RUN_MIN_TAIL it is not worth its launch.
#: From this many generated tokens per beam (the step's longest tail, its own token included), ``auto`` runs
#: the shared-run stage on the two-launch paths and prefers them to the one-launch cascade.
SHARED_RUN_MIN_TAIL = 96


def long_tail_for_shared_run(tail_len: Optional[float]) -> bool:
    """Whether a step whose longest tail is ``tail_len`` generated tokens per beam (``None``: unknown, e.g.
    a CUDA graph) is long enough for the shared-run stage: ``tail_len >= SHARED_RUN_MIN_TAIL``."""
    return tail_len is not None and float(tail_len) >= SHARED_RUN_MIN_TAIL


#: The longest tail (generated tokens per beam, the step's own included) that never takes the cascade's
#: shared-ancestry path, which looks at :data:`triton_kernels.cascade.SHARED_ANCESTRY_MIN_TAIL` (16) cached positions
#: or more. A launch bounded by it leaves the path out where that measured faster (forty-fifth round).
CASCADE_SHORT_TAIL = 16


def cascade_tail_bound(tail_len: float | None) -> int | None:
    """The tail bound a cascade launch is given for a step whose longest tail is ``tail_len`` (``None``:
    unknown): :data:`CASCADE_SHORT_TAIL` where the tail is within it (so that a plan serves every later step of
    a short tail with one launch configuration), else ``None``."""
    return CASCADE_SHORT_TAIL if tail_len is not None and float(tail_len) <= CASCADE_SHORT_TAIL else None


# MHA's tail (thirty-third round, g1_auto_grid_round33.json: GQA 16/16 at head 128, 64 requests of 14 and 30
# beams, 100-2,000 tokens, tails 4-64). The thirty-second round's MHA tail tiling made FA4 + tail faster
# at long tails, where the cascade's crossovers (fitted at 4 tokens) still picked the cascade: from 16
# generated tokens FA4 + tail was faster at 17 of 18 points (1.03-1.36x; 64 x 14 x 2,000 at 64 tokens
# even, 0.99x), at 8 tokens within 3% either way (0.92-1.03x), at 4 tokens slower (the cascade 0.77-0.96x).
# GQA 2 and 4 (g2_, g4_auto_grid_round33.json) kept the cascade to 64 tokens (at most 6% slower, 64 x 30 x
# 100 at GQA 2), so they have no limit. Head 64 at MHA (g1_d64_grid_round34.json) kept it too: the cascade was
# faster at 15 of 16 points to 64 tokens (0.62-0.96x), 3% slower at 64 x 30 x 100 with 64 tokens.
#
# The limit is a device-time rule, so it applies only where the calls are replayed from a CUDA graph. An eager
# call pays each path's host time every time, and FA4's is the largest: on the H200 host (eager_mha_round34.json)
# one eager call took 105-195 us of host time on the cascade and 205-435 us on FA4 + tail, so where the device
# needs less than that the step is host-bound. Eager FA4 + tail took 1.02-3.0x the eager cascade's time a call at
# four of the six measured points past the limit, and was 6-13% faster only at two whose cascade needed 250-490 us
# of device time (64 x 30 at 64 tokens).
#: ``{(GQA group, head size): the longest tail}`` (generated tokens per beam, the step's longest, its own
#: token included) at which ``auto`` picks the one-launch cascade; longer tails take FA4 + tail under a CUDA graph.
CASCADE_MAX_TAIL = {(1, 128): 8}

# Eager calls and host time (thirty-seventh round, from every eager file so far: eager_mha_round34.json,
# eager_mha_eager_rule_round34.json, eager_prompt_round34.json, eager_one_block_{long,8000}_round36.json and
# eager_d64_16req_round37.json; 41 points with the cascade and FA4 + tail each timed a call). An eager call pays
# its path's host time every call, on the H200 host about 90-210 us for the cascade and 190-520 for FA4 + tail
# (FlashInfer + tail 156 and 186 at the two eager points it ran), so a step whose device time is shorter is
# host-bound. At the 9 points
# where the device-time limits above take FA4 + tail or FlashInfer + tail, the cascade's time a call was 1.13-2.1x
# shorter (64 x 64 x 500: 199 against FA4 + tail's 414 us; 4 x 30 x 6,000: 110 against FlashInfer + tail's 156;
# 16 x 30 x 8,000 at head 64: 152 against 318 and 186). It lost a call only with 64 generated tokens at MHA, where
# its device time (250-490 us) passed FA4 + tail's host time and the step moved 1-2 GB. So an eager step takes
# the cascade past those limits while the bytes it moves (each beam block reads the prompt:
# :func:`cascade_step_bytes`) stay within EAGER_CASCADE_MAX_BYTES (640 MiB; the largest winner, 64 x 64 x 500 at
# MHA, 1.13x, moved 660 and stays with FA4 + tail) and its mean prompt within the longest measured eagerly (a few
# programs walk a longer prompt at a fixed latency per token): 8,192 tokens at groups 1-4, 512 at groups 5-8
# (measured at 500). FlashInfer's split prompt keeps its precedence (the decline rule's few-rows exemption is
# its own). Then, held out (eager_rule_check_round37.json: 6 shapes the rule moves, several blocks, GQA 8 and MHA),
# auto ran the cascade at all 6, 96-191 us a call against FA4 + tail's 187-232.
#: Bytes (:func:`cascade_step_bytes`) up to which an eager step is host-bound enough to take the cascade.
EAGER_CASCADE_MAX_BYTES = 640 << 20
#: ``{largest GQA group: longest mean prompt}`` of the eager rule (:func:`eager_cascade_preferred`).
EAGER_CASCADE_MAX_MEAN_PROMPT = {4: CASCADE_MAX_MEAN_PROMPT, 8: 512}


def cascade_step_bytes(num_requests: int, beam_width: int, mean_prompt_len: float, tail_len: float,
                       num_qo_heads: int, num_kv_heads: int, head_dim: int, element_size: int = 2) -> int:
    """Bytes the one-launch cascade moves for a step (an estimate for the eager rule): each beam block's
    program reads its request's prompt K/V, every beam its ``tail_len`` generated K/V rows, and the queries
    and output once; ``element_size`` bytes a value (2: bf16/fp16)."""
    blocks = _cascade_programs(num_requests, num_kv_heads, beam_width, num_qo_heads // max(num_kv_heads, 1),
                               head_dim).blocks
    kv_row = 2 * num_kv_heads * head_dim  # K and V of one token, values
    values = (num_requests * blocks * mean_prompt_len * kv_row + num_requests * beam_width * tail_len * kv_row
              + 2 * num_requests * beam_width * num_qo_heads * head_dim)
    return int(values * element_size)


def eager_cascade_preferred(mean_prompt_len: Optional[float], num_qo_heads: int, num_kv_heads: int,
                            beam_width: Optional[int], head_dim: int, num_requests: Optional[int],
                            tail_len: Optional[float]) -> Tuple[bool, str]:
    """Whether an eager step (no CUDA graph) is small enough that the cascade's lower host time wins a call
    wherever the device-time limits would pick FA4 + tail or FlashInfer + tail: ``(True, why)`` or ``(False,
    reason)``. Needs the batch's requests, beam width, mean prompt and tail (``None``: unknown, never); the
    caller checks that the cascade tiles the shape and that no long-tail path applies."""
    from triton_kernels.cascade import cascade_supported  # deferred: triton is imported on first use

    if None in (mean_prompt_len, beam_width, num_requests, tail_len):
        return False, "eager: requests, beam width, prompt or tail unknown"
    group = num_qo_heads // max(num_kv_heads, 1)
    longest = next((p for g, p in sorted(EAGER_CASCADE_MAX_MEAN_PROMPT.items()) if group <= g), None)
    if longest is None or not cascade_supported(group, head_dim)[0]:
        return False, f"eager: GQA {group}, head {head_dim} not measured on eager steps"
    if mean_prompt_len > longest:
        return False, f"eager: mean prompt {mean_prompt_len:.0f} > {longest} tokens at G={group} (not measured)"
    nbytes = cascade_step_bytes(num_requests=num_requests, beam_width=beam_width, mean_prompt_len=mean_prompt_len,
                                tail_len=tail_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim)
    if nbytes > EAGER_CASCADE_MAX_BYTES:
        return False, (f"eager: the cascade moves {nbytes >> 20} MiB > {EAGER_CASCADE_MAX_BYTES >> 20} MiB "
                       f"(device-bound)")
    return True, (f"eager: the cascade moves {nbytes >> 20} MiB <= {EAGER_CASCADE_MAX_BYTES >> 20} MiB, host-bound, "
                  f"where its host time measured the shortest")


# Eager steps where FlashInfer's split prompt serves (thirty-eighth round, eager_split_round38.json: 1-16 requests
# of 30 beams at 2,000-8,000 tokens, 4 and 16 of 16 beams, GQA 16/8 and 32/8 at head 128; and 4 x 30 x 6,000 of
# eager_prompt_round34.json). An eager call pays its path's host time; the fastest batch of each measurement took
# 141-252 us a call on FlashInfer + tail and 101-191 on the cascade (medians to 308 us: that host was noisy). At
# GQA 2 with one 64-row block (17-32 beams) the cascade's device time stayed under FlashInfer's host time to 8,000
# tokens (39-46 us at 2,000, 70-77 at 4,000, 132-139 at 8,000, 1-16 requests). Of the 9 points of 2-8 requests
# FlashInfer served, the cascade's time a call was the shorter at 7, by 1-52% (4 x 30 x 4,000: 104.6 against
# 142.4 us; 2 x 30 x 8,000: 171.0 against 173.3), and longer at 2, by 4% (4 x 30 x 2,000) and 16% (8 x 30 x 4,000:
# 184.5 against 159.2), where its own host time ran slow (fastest batches 113 and 180 us; 101-116 at its other
# points). With 32-row tiles (16 beams) the cascade's device time grows twice as fast (57-75 us at 2,000, 238-259 at
# 8,000: 4 x 16 x 8,000 took 239.5 against 153.4 us a call), and at GQA 4 it was even or slower (8 x 16 x 4,000:
# 196.9 against 159.8); those keep FlashInfer. One request of 30 beams (30 rows) is a few-rows step that the decline
# rule serves only through FlashInfer's split prompt, so it keeps FlashInfer too. What an eager step gives up is
# device time (8 x 30 x 8,000: 134 against 92 us), which only a host-bound step hides. Held out
# (eager_split_check_round38.json: 3 x 30 x 3,000, 6 x 30 x 6,000, 4 x 24 x 5,000), auto ran the cascade, 18-45%
# shorter a call than FlashInfer + tail.
#: ``{(GQA group, head size): tile rows}`` at which an eager step takes the cascade ahead of FlashInfer's split
#: prompt (one beam block, mean prompt up to :data:`EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT` tokens).
EAGER_CASCADE_OVER_SPLIT_KV = {(2, 128): 64}
EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT = 8192


def eager_cascade_over_split_kv(num_requests: int, mean_prompt_len: float, num_qo_heads: int, num_kv_heads: int,
                                beam_width: int, head_dim: int) -> Tuple[bool, str]:
    """Whether an eager step that FlashInfer's split prompt would serve takes the one-launch cascade instead, its
    lower host time the shorter call (:data:`EAGER_CASCADE_OVER_SPLIT_KV`): ``(True, why)`` or ``(False,
    reason)``. Never where the decline rule would leave the cascade's step to per-beam decode (few beam rows):
    FlashInfer's split prompt serves those."""
    from ..decline import should_decline  # deferred: the decline rule is the package's, loaded after this

    group = num_qo_heads // max(num_kv_heads, 1)
    tile_rows = EAGER_CASCADE_OVER_SPLIT_KV.get((group, head_dim))
    if tile_rows is None:
        return False, f"eager: GQA {group}, head {head_dim} not measured against FlashInfer's split prompt eagerly"
    _, blocks, rows = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim)
    if blocks != 1 or rows != tile_rows:
        return False, f"eager: {blocks} beam block(s) of {rows} rows (measured: one of {tile_rows})"
    if mean_prompt_len > EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT:
        return False, f"eager: mean prompt {mean_prompt_len:.0f} > {EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT} tokens"
    declined = should_decline(num_requests=num_requests, beam_width=beam_width, prompt_len=mean_prompt_len,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, one_launch=True)
    if declined is not None:
        return False, f"eager: the decline rule would leave the cascade's step to per-beam decode ({declined})"
    return True, (f"eager: one block of {rows} rows, mean prompt {mean_prompt_len:.0f} <= "
                  f"{EAGER_CASCADE_OVER_SPLIT_KV_MAX_PROMPT} tokens: the cascade's host time a call is the shorter")


def cascade_tail_too_long(group_size: int, head_dim: int, tail_len: Optional[float], eager: bool = False) -> bool:
    """Whether a step whose longest tail is ``tail_len`` tokens (``None``: unknown, e.g. a CUDA graph's
    capture, which serves any tail) is past :data:`CASCADE_MAX_TAIL` for this group and head size. Never for
    ``eager`` calls (no CUDA graph): FA4's host time per call outweighs its device gain there."""
    limit = CASCADE_MAX_TAIL.get((group_size, head_dim))
    return limit is not None and not eager and tail_len is not None and float(tail_len) > limit


def _beams_per_block(group_size: int, head_dim: int) -> int:
    """Beams one cascade program holds at the widest beam widths (its tile's cap)."""
    from triton_kernels.cascade import wide_launch_config  # deferred: triton is imported on first use

    return wide_launch_config(1 << 16, group_size, head_dim).beams_per_program


def one_beam_block(beam_width: Optional[int], group_size: int, head_dim: int) -> bool:
    """Whether one cascade program's beam block holds all ``W`` beams of a request (``False`` when ``W``
    is unknown), i.e. whether the cascade reads each prompt once per KV head."""
    from triton_kernels.cascade import wide_launch_config  # deferred: triton is imported on first use

    if beam_width is None:
        return False
    return beam_width <= wide_launch_config(int(beam_width), group_size, head_dim).beams_per_program


def cascade_prompt_limit(beam_width: Optional[int], group_size: int, head_dim: int) -> int:
    """The largest mean prompt (tokens) at which ``auto`` picks the cascade for this beam width and group.

    | group | one beam block holds all ``W`` beams | several blocks (or ``W`` unknown) |
    | --- | --- | --- |
    | 1 | :data:`CASCADE_MAX_MEAN_PROMPT` | :data:`CASCADE_MAX_MEAN_PROMPT_SPLIT_NO_GQA` (head 64, two blocks: :data:`CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_NO_GQA_HEAD_64`) |
    | 2 | :data:`CASCADE_MAX_MEAN_PROMPT` | :data:`CASCADE_MAX_MEAN_PROMPT_SPLIT` (head 64: :data:`CASCADE_MAX_MEAN_PROMPT_SPLIT_HEAD_64`, from :data:`CASCADE_MANY_BLOCKS_HEAD_64` blocks or ``W`` unknown :data:`CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_HEAD_64`) |
    | 3-4 | :data:`CASCADE_MAX_MEAN_PROMPT` | :data:`CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP` (head 64: :data:`CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP_HEAD_64` with two blocks, from three or ``W`` unknown :data:`CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_WIDE_GROUP_HEAD_64`) |
    | 5-8, head 128 (where :func:`group_8_head_128_verdict` allows it) | :data:`CASCADE_MAX_MEAN_PROMPT_GROUP_8` | :data:`CASCADE_MAX_MEAN_PROMPT_GROUP_8` |
    | 8, head 64 | :data:`CASCADE_MAX_MEAN_PROMPT_GROUP_8_HEAD_64` | two blocks: :data:`CASCADE_MAX_MEAN_PROMPT_GROUP_8_HEAD_64`; from three or ``W`` unknown :data:`CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_GROUP_8_HEAD_64` |
    | 5-7, head 64 | :data:`CASCADE_MAX_MEAN_PROMPT_PADDED_GROUP_8_HEAD_64` | :data:`CASCADE_MAX_MEAN_PROMPT_PADDED_GROUP_8_HEAD_64` |

    At G = 5-8 and head 64 :func:`cascade_preferred` also wants the waves full enough
    (:data:`CASCADE_GROUP_8_HEAD_64_MIN_BALANCE`) where the launch has more programs than the GPU multiprocessors,
    takes :data:`CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_GROUP_8_HEAD_64` where it has at most as many, and none with
    at most :data:`CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64`. At G = 4 and head 64, where the batch's launch takes
    32-beam tiles, :func:`cascade_preferred` raises the several-block limit to
    :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64`; past one wave under
    :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64` full G = 3-4 take
    :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_PARTLY_FULL_HEAD_64` there instead (at least as full as
    :data:`CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64` gives, one and two blocks at G = 4 take
    :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULLER_WAVES_HEAD_64`), G = 3 declines two or more blocks
    whose waves are emptier than :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64`
    (:func:`group_3_head_64_verdict`), and where the launch keeps 16-beam tiles because the 32-beam launch would run
    a second wave at most half full, :data:`CASCADE_MAX_MEAN_PROMPT_HALF_WAVE_HEAD_64` applies.
    """
    one = one_beam_block(beam_width, group_size, head_dim)
    if group_size == 1:
        if one:
            return CASCADE_MAX_MEAN_PROMPT
        if head_dim == 64 and beam_width is not None and beam_width <= 2 * _beams_per_block(group_size, head_dim):
            return CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_NO_GQA_HEAD_64
        return CASCADE_MAX_MEAN_PROMPT_SPLIT_NO_GQA
    if group_size <= 2:
        if one:
            return CASCADE_MAX_MEAN_PROMPT
        if head_dim != 64:
            return CASCADE_MAX_MEAN_PROMPT_SPLIT
        if beam_width is None or beam_width > (CASCADE_MANY_BLOCKS_HEAD_64 - 1) * _beams_per_block(group_size, 64):
            return CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_HEAD_64
        return CASCADE_MAX_MEAN_PROMPT_SPLIT_HEAD_64
    if group_size > 4:
        if head_dim != 64:
            return CASCADE_MAX_MEAN_PROMPT_GROUP_8
        if group_size < 8:  # padded to 8-row groups: the cascade reads as much as at G = 8, FA4 less
            return CASCADE_MAX_MEAN_PROMPT_PADDED_GROUP_8_HEAD_64
        if beam_width is None or beam_width > 2 * _beams_per_block(group_size, 64):
            return CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_GROUP_8_HEAD_64
        return CASCADE_MAX_MEAN_PROMPT_GROUP_8_HEAD_64
    if one:
        return CASCADE_MAX_MEAN_PROMPT
    if head_dim == 64:
        if beam_width is None or beam_width > 2 * _beams_per_block(group_size, 64):
            return CASCADE_MAX_MEAN_PROMPT_MANY_BLOCKS_WIDE_GROUP_HEAD_64
        return CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP_HEAD_64
    return CASCADE_MAX_MEAN_PROMPT_SPLIT_WIDE_GROUP


def cascade_preferred(
    mean_prompt_len: Optional[float],
    num_qo_heads: int,
    num_kv_heads: int,
    beam_width: Optional[int] = None,
    head_dim: int = 128,
    num_requests: Optional[int] = None,
    tail_len: Optional[float] = None,
    shared_run: bool = True,
    eager: bool = False,
    tail_bound: int | None = None,
) -> Tuple[bool, str]:
    """Whether ``auto`` picks the one-launch cascade for a batch: ``(True, "")`` or ``(False, reason)``.

    ``mean_prompt_len`` is the batch's mean prompt length in tokens (``None``: unknown, not preferred);
    ``beam_width`` the batch's ``W`` (``None``: unknown, the stricter prompt limit applies);
    ``num_requests`` the batch's ``R`` (``None``: unknown, judged as many): with few cascade programs
    some shapes have a lower limit (:data:`CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS`) and several-block ones a higher
    (:data:`CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS`), as have some odd block counts (heads 128 and 64)
    whose waves are as full as FA4's or fuller (:data:`CASCADE_MAX_MEAN_PROMPT_BY_WAVES`). ``tail_len``: the
    step's longest tail (generated tokens per beam, ``None``: unknown, e.g. a CUDA graph's capture):
    past :data:`CASCADE_MAX_TAIL` FA4 + tail is preferred unless ``eager`` (the calls run without a CUDA
    graph, see :func:`cascade_tail_too_long`), and where ``shared_run`` (the shared-run stage may run), from
    :data:`SHARED_RUN_MIN_TAIL` the two-launch paths with the stage are. An ``eager`` step that
    :func:`eager_cascade_preferred` finds host-bound takes the cascade past the prompt limits. ``tail_bound``: the
    bound on every tail the cascade's launch is given (generated tokens per beam, this step's included; the wrapper's
    ``max_tail_len`` under CUDA graphs, :func:`cascade_tail_bound` of the step's tail on eager calls); ``None``: an
    ``eager`` step's ``tail_len``, else unbounded. Groups 5-8 at head 128 take the cascade only where it is at most
    :data:`CASCADE_SHORT_TAIL` (:func:`group_8_head_128_verdict`).
    """
    group = num_qo_heads // max(num_kv_heads, 1)
    if group > CASCADE_MAX_GROUP:
        return False, f"GQA group {group} > {CASCADE_MAX_GROUP} (not measured faster than FA4 + tail there)"
    try:
        from triton_kernels.cascade import cascade_supported  # deferred: triton is imported on first use
    except ImportError as exc:  # pragma: no cover - triton is a dependency
        return False, f"triton_kernels does not import: {exc}"
    ok, reason = cascade_supported(group, head_dim)
    if not ok:
        return False, reason
    if mean_prompt_len is None:
        return False, "prompt lengths unknown"
    if shared_run and long_tail_for_shared_run(tail_len):
        return False, (f"tail {float(tail_len):.0f} >= {SHARED_RUN_MIN_TAIL} generated tokens per beam: a two-launch "
                       f"path with the shared-run stage measured faster there")
    if cascade_tail_too_long(group, head_dim, tail_len, eager):
        return False, (f"tail {float(tail_len):.0f} > {CASCADE_MAX_TAIL[(group, head_dim)]} generated tokens per "
                       f"beam at G={group}, head {head_dim} under a CUDA graph: FA4 + tail measured faster there")
    if eager and eager_cascade_preferred(mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                                         num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim,
                                         num_requests=num_requests, tail_len=tail_len)[0]:
        return True, ""
    limit = cascade_prompt_limit(beam_width, group, head_dim)
    wide_tile = _wide_tile_limit(num_requests, num_kv_heads, beam_width, group, head_dim)
    if wide_tile is not None:
        limit = wide_tile
    if group == 3 and head_dim == 64:
        declined = group_3_head_64_verdict(num_requests, num_kv_heads, beam_width)
        if declined is not None:
            return False, declined
    narrow_limit = None
    if group > 4 and head_dim == 128:
        if tail_bound is None and eager:
            tail_bound = cascade_tail_bound(tail_len)
        declined = group_8_head_128_verdict(num_requests, num_kv_heads, beam_width, group, tail_bound)
        if declined is not None:
            return False, declined
        narrow_limit = group_8_head_128_narrow_tile_limit(num_requests, num_kv_heads, beam_width, group)
        if narrow_limit is not None:
            limit = narrow_limit
    if group > 4 and head_dim == 64 and num_requests is not None and beam_width is not None and num_requests >= 1:
        sms = _waves.multiprocessors()
        programs = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim).programs
        if programs <= CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64:
            return False, (f"{programs} cascade programs (<= {CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_64}) at G={group}, "
                           f"head 64: from 3% faster to 8% slower than FA4 + tail at 128 tokens, slower beyond")
        if programs <= sms:
            limit = CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS_GROUP_8_HEAD_64  # the 8-warp tile, a program a multiprocessor
        else:
            balance = _wave_balance(programs, num_requests, num_kv_heads, beam_width, group, head_dim, sms)
            if balance < CASCADE_GROUP_8_HEAD_64_MIN_BALANCE:
                return False, (f"the cascade's waves are {balance:.2f} as full as FA4's at {num_requests} x "
                               f"{beam_width} beams, G={group}, head 64 (< {CASCADE_GROUP_8_HEAD_64_MIN_BALANCE}: "
                               f"measured slower than FA4 + tail there at every prompt length)")
    several_few = CASCADE_FEW_PROGRAMS_SEVERAL_BLOCKS.get((group, head_dim), CASCADE_FEW_PROGRAMS)
    for table, blocks, few_programs in ((CASCADE_MAX_MEAN_PROMPT_TWO_BLOCKS_FEW_PROGRAMS, (2, 2), CASCADE_FEW_PROGRAMS),
                                        (CASCADE_MAX_MEAN_PROMPT_SEVERAL_BLOCKS_FEW_PROGRAMS, (2, None), several_few)):
        few_blocks = _few_programs_limit(table, blocks, num_requests, num_kv_heads, beam_width, group, head_dim,
                                         few_programs)
        if few_blocks is not None:
            limit = max(limit, few_blocks.limit)
    by_waves = _waves_limit(num_requests, num_kv_heads, beam_width, group, head_dim)
    if by_waves is not None and by_waves.balance >= by_waves.least:
        limit = max(limit, by_waves.limit)
    if mean_prompt_len > limit:
        blocks = _beam_blocks_phrase(num_requests, num_kv_heads, beam_width, group, head_dim)
        waves = ""
        if by_waves is not None and mean_prompt_len <= by_waves.limit:
            waves = (f"; {by_waves.limit} where the cascade's waves are at least {by_waves.least:g} as full as FA4's, "
                     f"here {by_waves.balance:.2f}")
        measured = "measured slower than FA4 + tail there"
        if limit == narrow_limit == CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128:
            measured = (f"the longest timed past {CASCADE_MANY_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128} programs "
                        f"a multiprocessor of the 8-beam tile")
        return False, (f"mean prompt {mean_prompt_len:.0f} tokens > {limit} at W={beam_width}, G={group} ({blocks}; "
                       f"{measured}{waves})")
    narrow = beam_width is not None and _narrow_tile(beam_width, group, head_dim)
    few_table = _FEW_PROGRAMS_NARROW_TILE_TABLE if narrow else CASCADE_MAX_MEAN_PROMPT_FEW_PROGRAMS
    few = _few_programs_limit(few_table, (1, 1), num_requests, num_kv_heads, beam_width, group, head_dim)
    if few is not None and mean_prompt_len > few.limit:
        return False, (f"mean prompt {mean_prompt_len:.0f} tokens > {few.limit} with {few.programs} cascade programs "
                       f"(<= {CASCADE_FEW_PROGRAMS}) at G={group}, head {head_dim}: measured slower than FA4 + tail there")
    return True, ""


def _beam_blocks_phrase(num_requests: int | None, num_kv_heads: int, beam_width: int | None, group: int,
                        head_dim: int) -> str:
    """How a decline names the batch's beam tiling: the launch's own, so a batch that takes the 32-beam tile of
    G = 3-4 at head 64 (:func:`wide_tile_launch`) is not described by the batch-blind 16-beam tile."""
    wide = wide_tile_launch(num_requests, num_kv_heads, beam_width, group, head_dim)
    if wide is not None and wide.choice == "wide":
        return "one 32-beam block" if wide.blocks == 1 else f"{wide.blocks} 32-beam blocks per request"
    return "one beam block" if one_beam_block(beam_width, group, head_dim) else "several beam blocks per request"


class WideTileLaunch(NamedTuple):
    """A G = 3-4, head-64 batch's launch on 32-beam tiles (:func:`wide_tile_launch`): ``choice`` (``"wide"`` or
    ``"half_wave"``), ``blocks`` (32-beam blocks a request), ``programs`` (the launch's), ``waves`` (of
    ``WIDE_TILE_PROGRAMS_PER_SM`` programs a multiprocessor) and ``fill`` (their mean fill, in (0, 1])."""

    choice: str
    blocks: int
    programs: int
    waves: int
    fill: float


def wide_tile_launch(num_requests: int | None, num_kv_heads: int, beam_width: int | None, group: int, head_dim: int,
                     num_sms: int | None = None) -> WideTileLaunch | None:
    """:class:`WideTileLaunch` (tile choice, 32-beam blocks a request, programs, waves, wave fill) of a G = 3-4,
    head-64 batch whose width fills 32-beam blocks as well as 16-beam ones and whose 32-beam launch has more programs
    than multiprocessors (``num_sms``; ``None``: :func:`multiprocessors`), else ``None``. The choice is
    :func:`triton_kernels.cascade.wide_group_head_64_tile_choice`'s: ``"wide"`` where the launch takes the 32-beam
    tile, ``"half_wave"`` where it keeps 16 beams because the 32-beam launch would run a second wave at most half full.
    The programs, waves and fill are the 32-beam launch's, ``WIDE_TILE_PROGRAMS_PER_SM`` programs a multiprocessor
    making a wave (the fill is their :func:`wave_efficiency`)."""
    if group not in (3, 4) or head_dim != 64 or num_requests is None or beam_width is None or num_requests < 1:
        return None
    sms = _waves.multiprocessors() if num_sms is None else int(num_sms)
    return _wide_tile_launch(int(num_requests), int(num_kv_heads), int(beam_width), group, sms)


@functools.lru_cache(maxsize=4096)  # eager steps ask the rule at every step; a serving batch repeats its shape
def _wide_tile_launch(num_requests: int, num_kv_heads: int, beam_width: int, group: int,
                      sms: int) -> WideTileLaunch | None:
    from triton_kernels.cascade import (  # deferred: triton is imported on first use
        WIDE_GROUP_HEAD_64_TILE_BEAMS,
        WIDE_TILE_PROGRAMS_PER_SM,
        wide_group_head_64_tile_choice,
    )

    choice = wide_group_head_64_tile_choice(beam_width, group, 64, num_requests, num_kv_heads, sms)
    if choice is None:
        return None
    blocks = -(-beam_width // WIDE_GROUP_HEAD_64_TILE_BEAMS)
    programs = num_requests * num_kv_heads * blocks
    slots = WIDE_TILE_PROGRAMS_PER_SM * sms  # the wave the tile choice counts, so the two cannot disagree
    return WideTileLaunch(choice, blocks, programs, -(-programs // slots), wave_efficiency(programs, slots))


def _wide_tile_limit(num_requests: int | None, num_kv_heads: int, beam_width: int | None, group: int,
                     head_dim: int) -> int | None:
    """The prompt limit of a G = 3-4, head-64 batch whose width fills 32-beam tiles (:func:`wide_tile_launch`), in
    place of the 16-beam tile's. On 32-beam tiles: :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_PARTLY_FULL_HEAD_64`
    where the launch runs more than one wave, under :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64` full, and
    :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULL_WAVES_HEAD_64` where they are fuller
    (:data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULLER_WAVES_HEAD_64` from the pair's
    :data:`CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64`), else (G = 4)
    :data:`CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64`. Kept on 16-beam tiles by the half-full second wave:
    :data:`CASCADE_MAX_MEAN_PROMPT_HALF_WAVE_HEAD_64`. ``None`` where no table lists the block count (or the width
    does not fill 32-beam tiles): the 16-beam tile's limit stays."""
    launch = wide_tile_launch(num_requests, num_kv_heads, beam_width, group, head_dim)
    if launch is None:
        return None
    key = (group, launch.blocks)
    if launch.choice == "half_wave":
        return CASCADE_MAX_MEAN_PROMPT_HALF_WAVE_HEAD_64.get(key)
    if launch.waves > 1:
        fuller = CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULLER_WAVES_HEAD_64.get(key)
        if fuller is not None and launch.fill >= CASCADE_WIDE_TILE_FULLER_WAVE_FILL_HEAD_64[key]:
            return fuller
        partly_full = launch.fill < CASCADE_WIDE_TILE_MIN_WAVE_FILL_HEAD_64
        by_fill = (CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_PARTLY_FULL_HEAD_64 if partly_full
                   else CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_FULL_WAVES_HEAD_64).get(key)
        if by_fill is not None:
            return by_fill
    return CASCADE_MAX_MEAN_PROMPT_WIDE_TILE_GROUP_4_HEAD_64.get(launch.blocks) if group == 4 else None


def group_3_head_64_verdict(num_requests: int | None, num_kv_heads: int, beam_width: int | None,
                            num_sms: int | None = None) -> str | None:
    """Why ``auto`` leaves the cascade at G = 3 and head 64 for a batch, or ``None`` where the prompt limits decide:
    a launch on 32-beam tiles (:func:`wide_tile_launch`) with two or more blocks a request and more than one wave of
    programs (``WIDE_TILE_PROGRAMS_PER_SM`` a multiprocessor, ``num_sms``; ``None``: :func:`multiprocessors`) must
    fill its waves at least :data:`CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64`."""
    sms = _waves.multiprocessors() if num_sms is None else int(num_sms)
    launch = wide_tile_launch(num_requests, num_kv_heads, beam_width, 3, 64, sms)
    if launch is None or launch.choice != "wide":
        return None
    if launch.blocks < 2 or launch.waves == 1 or launch.fill >= CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64:
        return None
    from triton_kernels.cascade import WIDE_TILE_PROGRAMS_PER_SM  # deferred: triton is imported on first use

    slots = WIDE_TILE_PROGRAMS_PER_SM * sms
    return (f"{launch.programs} cascade programs on 32-beam tiles ({launch.blocks} a request) fill their "
            f"{launch.waves} waves {launch.fill:.2f} full (< {CASCADE_WIDE_TILE_MIN_WAVE_FILL_GROUP_3_HEAD_64}; "
            f"{slots} a wave on {sms} multiprocessors) at G=3, head 64: from 1% faster to 7% slower than FA4 + tail "
            f"with two waves 0.52-0.64 full at 64-128 tokens; with three 0.69-0.71 full 2% faster at 64 tokens, even to "
            f"1% slower at 128 and 15-18% slower at 256")


def group_8_head_128_verdict(num_requests: int | None, num_kv_heads: int, beam_width: int | None, group: int,
                             tail_bound: int | None, num_sms: int | None = None) -> str | None:
    """Why ``auto`` leaves the cascade at G = 5-8 and head 128 for a batch, or ``None`` where the prompt limit
    (:data:`CASCADE_MAX_MEAN_PROMPT_GROUP_8`) decides: the launch must leave out the shared-ancestry path
    (``tail_bound``, generated tokens, at most :data:`CASCADE_SHORT_TAIL`), the batch be known (``num_requests``,
    ``beam_width``), with at most :data:`CASCADE_MAX_BLOCKS_GROUP_8_HEAD_128` beam blocks a request, more than
    :data:`CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_128` programs and at most
    :data:`CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128` per multiprocessor (``num_sms``; ``None``:
    :func:`multiprocessors`), and blocks :data:`CASCADE_MIN_BLOCK_FILL_GROUP_8_HEAD_128` full where the programs
    outnumber the multiprocessors. A known batch of a narrow width (the 8-beam tile) needs no tail bound, but more
    programs than multiprocessors and at most :data:`CASCADE_MAX_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128` a
    multiprocessor; it takes :func:`group_8_head_128_narrow_tile_limit`'s prompt limit."""
    from triton_kernels.cascade import shared_ancestry_reachable  # deferred: triton is imported on first use

    where = f"at G={group}, head 128"
    known = num_requests is not None and beam_width is not None and num_requests >= 1
    if known and _narrow_tile(beam_width, group, 128):
        # Measured without a tail bound (the 8-beam tile with its shared-ancestry path), so none is asked for.
        programs, _, sms = _group_8_launch(num_requests, num_kv_heads, beam_width, group, num_sms)
        tile = "cascade programs of the 8-beam tile"
        if programs <= sms:
            return (f"{programs} {tile} (<= {sms} multiprocessors) at {beam_width} beams {where}: from 2% faster to 7% "
                    f"slower than FA4 + tail at 300 tokens, 17-48% slower from 600")
        cap = CASCADE_MAX_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128
        if programs > cap * sms:
            return (f"{programs} {tile} (> {cap} a multiprocessor, {sms} multiprocessors) at {beam_width} beams "
                    f"{where}: not measured there")
        return None
    if shared_ancestry_reachable(tail_bound):
        bound = "no tail bound" if tail_bound is None else f"a tail bound of {tail_bound} (> {CASCADE_SHORT_TAIL})"
        return (f"the cascade's launch has {bound}, so it keeps the shared-ancestry path: 7-25% slower than FA4 + "
                f"tail {where} at every length measured; a CUDA-graph wrapper with max_tail_len <= "
                f"{CASCADE_SHORT_TAIL} (TLLM_BEAM_SHARED_PREFIX_MAX_TAIL) leaves it out")
    if not known:
        return f"requests or beam width unknown {where}: the cascade's program count decides there"
    programs, blocks, sms = _group_8_launch(num_requests, num_kv_heads, beam_width, group, num_sms)
    if blocks > CASCADE_MAX_BLOCKS_GROUP_8_HEAD_128:
        return (f"{blocks} beam blocks a request (> {CASCADE_MAX_BLOCKS_GROUP_8_HEAD_128}) {where}: from 0.4% faster "
                f"to 7% slower than FA4 + tail with six")
    if programs <= CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_128:
        return (f"{programs} cascade programs (<= {CASCADE_TOO_FEW_PROGRAMS_GROUP_8_HEAD_128}) {where}: from 3% faster "
                f"to 10% slower than FA4 + tail there with a tail bound")
    if programs > CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128 * sms:
        return (f"{programs} cascade programs (> {CASCADE_MAX_PROGRAMS_PER_SM_GROUP_8_HEAD_128} a multiprocessor, "
                f"{sms} multiprocessors) {where}: from 5% faster to 7% slower than FA4 + tail at 768-3,072")
    fill = int(beam_width) / (blocks * _beams_per_block(group, 128))
    if programs > sms and fill < CASCADE_MIN_BLOCK_FILL_GROUP_8_HEAD_128:
        return (f"beam blocks {fill:.2f} full (< {CASCADE_MIN_BLOCK_FILL_GROUP_8_HEAD_128}) with {programs} programs "
                f"(> {sms} multiprocessors) {where}: 3-8% slower than FA4 + tail there")
    return None


class Group8Launch(NamedTuple):
    """A G = 5-8, head-128 cascade launch (:func:`_group_8_launch`), counts: ``programs``, ``blocks`` (beam blocks a
    request) and ``sms`` (the GPU's multiprocessors it is judged on)."""

    programs: int
    blocks: int
    sms: int


def _group_8_launch(num_requests: int, num_kv_heads: int, beam_width: int, group: int,
                    num_sms: int | None) -> Group8Launch:
    """:class:`Group8Launch` of a G = 5-8, head-128 cascade launch (``num_sms`` ``None``: :func:`multiprocessors`)."""
    programs, blocks, _ = _cascade_programs(num_requests, num_kv_heads, beam_width, group, 128)
    return Group8Launch(programs, blocks, _waves.multiprocessors() if num_sms is None else int(num_sms))


def group_8_head_128_narrow_tile_limit(num_requests: int | None, num_kv_heads: int, beam_width: int | None,
                                       group: int, num_sms: int | None = None) -> int | None:
    """The cascade's mean prompt limit (tokens) at G = 5-8 and head 128 for a known batch of a narrow width (the 8-beam
    tile, ``triton_kernels.cascade.narrow_tile_beams``), or ``None`` where the width is wider or the batch unknown:
    :data:`CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_GROUP_8_HEAD_128` of ``group`` where the launch is one wave of the tile
    (``NARROW_TILE_GROUP_8_PROGRAMS_PER_SM`` programs a multiprocessor, ``num_sms``; ``None``: :func:`multiprocessors`)
    or its waves are at least :data:`CASCADE_NARROW_TILE_MIN_WAVE_FILL_GROUP_8_HEAD_128` full, else
    :data:`CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_PARTLY_FULL_GROUP_8_HEAD_128`; at most
    :data:`CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128` past
    :data:`CASCADE_MANY_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128` programs a multiprocessor.
    (:func:`group_8_head_128_verdict` declines the launches of at most one program a multiprocessor, and of more than
    :data:`CASCADE_MAX_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128`.)"""
    if num_requests is None or beam_width is None or num_requests < 1 or not _narrow_tile(beam_width, group, 128):
        return None
    from triton_kernels.cascade import NARROW_TILE_GROUP_8_PROGRAMS_PER_SM  # deferred: triton is imported on first use

    programs, _, sms = _group_8_launch(num_requests, num_kv_heads, beam_width, group, num_sms)
    wave = NARROW_TILE_GROUP_8_PROGRAMS_PER_SM * sms
    waves = -(-programs // wave)
    if waves == 1 or programs / (waves * wave) >= CASCADE_NARROW_TILE_MIN_WAVE_FILL_GROUP_8_HEAD_128:
        limit = CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_GROUP_8_HEAD_128[group]
    else:
        limit = CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_PARTLY_FULL_GROUP_8_HEAD_128[group]
    if programs > CASCADE_MANY_PROGRAMS_PER_SM_NARROW_TILE_GROUP_8_HEAD_128 * sms:
        limit = min(limit, CASCADE_MAX_MEAN_PROMPT_NARROW_TILE_MANY_PROGRAMS_GROUP_8_HEAD_128)
    return limit


def _narrow_tile(beam_width: int, group: int, head_dim: int) -> bool:
    """Whether ``beam_width`` beams run the cascade's narrow tile at GQA ``group`` and ``head_dim`` and the narrow
    clauses' grids measured the width (at least :data:`CASCADE_NARROW_TILE_MIN_BEAMS`)."""
    from triton_kernels.cascade import narrow_tile_beams  # deferred: triton is imported on first use

    return int(beam_width) >= CASCADE_NARROW_TILE_MIN_BEAMS and narrow_tile_beams(int(beam_width), group,
                                                                                   head_dim) is not None


class FewProgramsLimit(NamedTuple):
    """A few-programs prompt limit that applies to a batch (:func:`_few_programs_limit`): ``programs`` (the cascade
    launch's) and ``limit`` (mean prompt, tokens)."""

    programs: int
    limit: int


def _few_programs_limit(table, beam_blocks, num_requests, num_kv_heads, beam_width, group, head_dim,
                        few_programs=CASCADE_FEW_PROGRAMS):
    """``(programs, limit)`` of ``table`` (``{(group, head size): limit or {tile rows: limit}}``; group 3
    takes group 4's entry where it has none of its own) for a batch of at most ``few_programs`` cascade
    programs whose beam blocks per request are within ``beam_blocks`` (``(least, most)``, ``None``: no
    most), else ``None``."""
    limit = table.get((group, head_dim), table.get((4, head_dim)) if group == 3 else None)
    if limit is None or num_requests is None or beam_width is None:
        return None
    programs, blocks, rows = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim)
    least, most = beam_blocks
    if blocks < least or (most is not None and blocks > most) or programs > few_programs:
        return None
    if isinstance(limit, dict):
        limit = limit.get(rows)
        if limit is None:
            return None
    return FewProgramsLimit(programs, limit)


class WavesLimit(NamedTuple):
    """The by-waves prompt limit of a batch (:func:`_waves_limit`): ``balance`` (its :func:`wave_balance`, a ratio),
    ``least`` (the balance the limit needs) and ``limit`` (mean prompt, tokens)."""

    balance: float
    least: float
    limit: int


def _waves_limit(num_requests, num_kv_heads, beam_width, group, head_dim):
    """``(wave balance, least balance, limit)`` of :data:`CASCADE_MAX_MEAN_PROMPT_BY_WAVES` for a batch whose beam
    blocks per request are a count listed in :data:`CASCADE_BY_WAVES_MIN_BALANCE` (``least balance``: that count's)
    and at least :data:`CASCADE_BY_WAVES_MIN_FILL` full, or :data:`CASCADE_BY_WAVES_PARTLY_FULL`'s fill (``least
    balance``: the higher of the two); else ``None``. The limit applies where the :func:`wave_balance` is at least the
    least."""
    key = (group, head_dim)
    limit = CASCADE_MAX_MEAN_PROMPT_BY_WAVES.get(key)
    if limit is None or num_requests is None or beam_width is None or num_requests < 1:
        return None
    programs, blocks, rows = _cascade_programs(num_requests, num_kv_heads, beam_width, group, head_dim)
    least = CASCADE_BY_WAVES_MIN_BALANCE[key].get(blocks)
    if least is None:
        return None
    # Each block of `rows` query rows reads the whole prompt, however full: emptier blocks need fuller waves.
    fill = int(beam_width) * group / (blocks * rows)
    if fill < CASCADE_BY_WAVES_MIN_FILL[key]:
        partly = CASCADE_BY_WAVES_PARTLY_FULL.get(key)
        if partly is None or fill < partly[0]:
            return None
        least = max(least, partly[1])
    balance = _wave_balance(programs, num_requests, num_kv_heads, beam_width, group, head_dim,
                            _waves.multiprocessors())
    return WavesLimit(balance, least, limit)


def graph_rule_prompt(prompt_capacity: int, num_qo_heads: int, num_kv_heads: int, beam_width: Optional[int],
                      head_dim: int) -> int:
    """The mean prompt (tokens) at which ``auto`` judges a CUDA-graph wrapper's shape, once: a captured
    launch serves every prompt up to ``prompt_capacity`` (its prompt table's width in tokens), so the
    cascade is taken only if it measured faster than FA4 + tail at that length. One exception: where
    one beam block holds all of a request's beams (limit :data:`CASCADE_MAX_MEAN_PROMPT`), the
    cascade was faster at every prompt measured, by a margin that shrinks slowly (16% at 1,000-2,000
    tokens, 10% at 4,000, 2-12% at 6,000 at G = 2), so a wider capacity is judged at that limit and keeps it."""
    from triton_kernels.cascade import cascade_supported  # deferred: triton is imported on first use

    group = num_qo_heads // max(num_kv_heads, 1)
    if group > CASCADE_MAX_GROUP or not cascade_supported(group, head_dim)[0]:
        return int(prompt_capacity)  # not the cascade's shape: cascade_preferred names the reason
    one = one_beam_block(beam_width, group, head_dim)
    limit = cascade_prompt_limit(beam_width, group, head_dim)
    if one and limit == CASCADE_MAX_MEAN_PROMPT:
        return int(min(prompt_capacity, limit))
    return int(prompt_capacity)
