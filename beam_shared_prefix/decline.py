"""When the library declines a shape because the default per-beam decode would be faster.

The rule is measured, not guessed, on the H200 (64 requests, head 128 and for the cascade head 64,
page 32, tail 4, bf16; GQA 16/8 and 32/8; ``docs/benchmarks.md``, "The decline rule"), and it
depends on which path serves:

**The one-launch cascade** (backend ``triton``, or ``auto`` where it picks the cascade:
:func:`beam_shared_prefix.prefix.select.cascade_serves`). Its cost is nearly flat at short
prompts (18-25 us at 32-100 tokens) while per-beam decode grows with ``W x P``, so what decides
is the beam width; the grid (``decline_g2_auto*.json``, ``decline_g4_auto*.json``) gives the
smallest mean prompt at which both head shapes were at least 10% faster (the margin against
run-to-run noise near the crossover):

| beam width W | served from a mean prompt of | measured just below (G = 2 / G = 4) |
| --- | --- | --- |
| 2 | 500 tokens (1.26x / 1.15x) | 300: 1.09x / 1.25x; 200: 0.95x / 1.16x |
| 3 | 150 (1.18x / 1.50x) | 100: 1.08x / 1.22x |
| 4-5 | 50 (1.14x / 1.13x) | 32: 1.02x / 0.93x |
| 6 and more | 32 (W = 6: 1.34x / 1.26x; W = 8: 1.65x / 1.50x) | not measured below 32 |

A batch the two-launch rule below serves is served as well: ``auto`` picks the cascade only where
it measured faster than the two-launch paths.

At head 64 (ninth round, ``decline_g[24]_d64_auto*.json``) per-beam decode moves half the bytes
and the cascade's short-prompt cost barely falls (22 us), so it pays from longer prompts; the
two-launch clause is not applied there (2 beams were 1.09x at 1,000 tokens and 1.03x at 2,000,
under the margin):

| beam width W | served from a mean prompt of (head 64) | measured just below (G = 2 / G = 4) |
| --- | --- | --- |
| 2 | never (G = 2: 0.54x-1.09x from 32 to 2,000 tokens) | |
| 3 | 500 (1.28x / 1.44x) | 250: 1.04x; 150: 0.80x / 1.01x |
| 4-5 | 250 (1.30x; G = 4 1.28x at 150) | 150: 0.98x; 100: 1.00x |
| 6-7 | 100 (1.36x; G = 4 1.21x at 50) | 50: 1.09x; 32: 1.00x |
| 8 and more | 32 (1.24x; G = 4 1.52x at 50) | not measured below 32 |

**More than 8 KV heads, fewer than 8 beams** (twentieth round, ``narrow_beams_auto_check_*.json``:
16 and 64 requests of 2-8 beams at 32-2,000 tokens, GQA 32/16 and MHA 32/32 and 64/64, head 128,
``auto`` on the cascade). The tables above were measured at 8 KV heads; with more, per-beam decode has
more programs to spread narrow beams over, and the cascade's table served shapes that lost (beam width
2 at 500-2,000 tokens: 5 of 18 points at 0.93x-0.98x; 4 at 50 tokens: 5 of 6 at 0.89x-0.96x). There, on
every path
(:data:`NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT`):

| beam width W | served from a mean prompt of (more than 8 KV heads) | measured just below |
| --- | --- | --- |
| 2 | never (0.93x-1.31x from 500 to 2,000 tokens, 9 of 18 points under 1.10x) | |
| 3 | 1,000 (1.24x-1.67x) | 500: 1.09x-1.67x |
| 4-5 | 250 (1.13x-1.89x) | 100: 1.03x-1.37x |
| 6-7 | 50 (1.18x-1.59x) | not measured below 50 |
| 8 and more | as above (32 tokens: 1.21x-1.71x) | |

**The two-launch paths** (FA4 or FlashInfer prefix + tail kernel; ``decline_g2.json``,
``decline_g4.json``). What the library saves is the prompt KV that ``W - 1`` beams no longer
re-read, so the crossover follows ``(W - 1) * P``:

| (W - 1) * P | measured speedup over FlashInfer per-beam decode |
| --- | --- |
| 32 - 300 (W 2-8, P 32-100) | 0.36x - 0.79x: declined |
| 416 - 500 (W 14 P 32, W 2 P 500) | 1.09x, 0.98x: declined (no margin) |
| >= 700 | 1.12x - 10.3x: served |

So it serves a batch only when ``(W - 1) * mean prompt >= MIN_SHARED_PROMPT_TOKENS = 600``.

**Few beam rows** (``decline_requests.json``, ninth round, GQA 16/8, head 128, the cascade): every
path runs one program per request and KV head (or per beam block), so a step with few requests
leaves the GPU underfilled while per-beam decode spreads over every beam. With ``R x W`` beam rows:

| R x W | speedup over per-beam decode |
| --- | --- |
| 8-32 (R = 1: W = 8, 30; R = 4: W = 8; P = 100, 500) | 0.55x - 0.89x: declined |
| >= 120 (R = 4 x 30, R = 16 x 8 and 30) | 1.24x - 7.97x: served |

So it serves a batch only when ``R x W >= MIN_BEAM_ROWS = 120`` (the smallest measured that won;
32 lost), before the rules below. Those grids had 8 KV heads. With 2 (fourteenth round,
``small_batches_backends_g7_d64.json``, ``_g8.json``: GQA 14/2 at head 64, 16/2 at head 128, 1-64
requests of 8 and 30 beams, 500 and 2,000 tokens) the library's programs (one per request and KV
head) are a quarter as many for the same rows, while per-beam decode's work shrinks with the heads:
120-128 rows (4 x 30, 16 x 8) were 0.65x-0.97x of per-beam decode, 480 and more (16 x 30, 64 x 8)
1.69x-5.3x. So with fewer than 8 KV heads the floor is ``120 x 8 / Hkv`` rows (:func:`min_beam_rows`:
480 at 2 KV heads, 960 with one), i.e. ``R x W x Hkv >= 960``.

Half of that serves from a mean prompt of 500 tokens (fifteenth round,
``small_batches_backends_{g5,g8_kv8,g7_kv4,g6_kv2,mqa}.json``: GQA 40/8, 64/8, 28/4, 12/2 and 8/1 at
head 128, with every earlier few-request grid). Every point of ``R x W x Hkv`` = 480-959 at 500 tokens
or more was 1.13x-4.17x faster than per-beam decode on the path ``auto`` takes (4 KV heads: 4 x 30 and
16 x 8 rows, 1.43x-1.92x; 2 KV heads: 8 x 30 and 32 x 8, 1.39x-1.92x; MQA: 16 x 30 and 64 x 8,
1.27x-1.73x), except GQA 1 at head 64 (8 x 8 x 500 and 1,000: 0.99x and 1.02x). Below 500 tokens they
lost (250 tokens at GQA 1: 0.96x-0.98x; 100 tokens at head 64: 0.84x), and at 240-256 they lost at
every point measured without the split prompt (0.50x-1.04x). So ``R x W x Hkv >= 480`` is served from
a mean prompt of :data:`FEW_ROWS_MIN_PROMPT` = 500 tokens (:func:`min_beam_rows` with ``prompt_len``),
at head 128 and at head 64 for GQA 2-4 (where it was measured and won); elsewhere at head 64 the floor
stays at 960.

Those floors were the smallest products measured that won on the kernels of their day. On the current kernels the
fifty-third and fifty-fourth rounds re-timed them at head 128 (``few_rows_round5{3,4}_*.json``, held-out 16-19). With
groups of 3-8 and 2-8 KV heads, ``R x W x Hkv >= 384`` serves from 99 tokens at 10 beams or more, from 160 tokens at
6-9 beams and from 350 at 4-5; at 6-9 beams under 160 tokens the product is 576. GQA 2 with 2-8 KV heads takes 384 from
160 tokens. The fifty-fifth round added head 256 (groups 2-8, 2-8 KV heads, 10 beams or more: 640 from 200 tokens,
GQA 2 from 300, and 384 from 400), 3 beams' long-prompt floor (576 from 500 tokens, where 480 served 80 x 3 at 2 KV
heads at 0.87x-1.03x) and GQA 1's short-prompt one (1,024 under 200 tokens, where 960 ran 1.06x-1.09x)
(:data:`MIN_BEAM_ROWS_HEAD_128_REFIT` and the constants after it hold the data).

More KV heads need fewer rows, down to 16 KV heads' floors (sixteenth round,
``small_batches_backends_{mha32,mha16_d64,g2_kv16}.json``: MHA 32/32 at head 128, MHA 16/16 at head 64
and GQA 32/16, 1-64 requests of 8, 16 and 30 beams at 100, 500 and 2,000 tokens). At 16 KV heads every
point of ``R x W x Hkv`` >= 960 won (from 1.23x at 100 tokens), 480-512 from 500 tokens at head 128
(1.17x-1.50x on every backend) but not at head 64 (GQA 1: 0.90x-1.00x), and 256 lost below 2,000 tokens
(0.73x-0.86x). At 32 KV heads ``R x W x Hkv`` = 960 measured 1.00x at 100 tokens (1 x 30), 1,024 1.17x-1.18x
and 1,920-2,048 1.53x-1.87x, so scaling 16 KV heads' floors further (30 rows at 32) would serve 1.00x.
Above 16 KV heads the floors are therefore products of their own (seventeenth round, with MHA 40/40 at
head 128, ``small_batches_backends_mha40.json``): ``R x W x Hkv`` >= 1,024, and 512 from 500 tokens, up
to 40 KV heads (32 rows and 16 at 32 KV heads, 26 and 13 at 40; never more rows than at 16). Every such
point won: 1,024-1,280 row-heads 1.16x-1.34x at head 128 and 1.30x-2.17x at head 64 (MHA 32/32), 512-640
from 500 tokens 1.14x-2.46x at head 128; GQA 1 at head 64 keeps the short-prompt product at every prompt
(512 there: 0.95x-0.98x below 2,000 tokens).

Head 256 (seventeenth round, ``small_batches_backends_{g2_d256,g2_kv4_d256,mha16_d256}.json``: GQA 16/8
and 8/4, MHA 16/16, 1-64 requests of 4-30 beams at 100, 500 and 2,000 tokens) is served by FlashInfer +
tail alone (neither the cascade nor FA4 tiles it), two launches whose fixed cost (24-28 us for one
request) per-beam decode undercuts at short prompts. There the short-prompt floor is twice head 128's:
:data:`MIN_BEAM_ROWS_HEAD_256` = 240 rows at 8 KV heads, scaled the same way. At 100 tokens
``R x W x Hkv`` = 960-1,024 measured 1.04x-1.14x at 8 KV heads (under the margin), 1.09x at 4 and
0.77x (4 x 16, served before this round) at 16; 1,920-2,048 1.16x-1.78x. From 500 tokens the
long-prompt floor (60 rows at 8 KV heads) and from 60,000 ``R x W x P`` the split-prompt exception
below hold at GQA 1-2 as at head 128: 1.20x-6.16x and 1.76x-2.42x. The long-prompt floor holds at
GQA 4 too (eighteenth round, ``small_batches_backends_{g4_d256,g4_kv4_d256,g4_kv1_d256}.json``, GQA
32/8, 16/4 and 4/1: the 24 points it adds were 1.22x-4.37x, none under the margin). The nineteenth
round measured GQA 3 and 8 (``small_batches_backends_{g3_d256,g8_d256,g8_kv2_d256}.json``: GQA 24/8,
64/8 and 16/2, 1-64 requests of 4-30 beams at 100, 500 and 2,000 tokens) and the split prompt at GQA
3, 4 and 8 (``*_d256_split.json``: 1-8 requests of 8-30 beams at 1,000 and 4,000 tokens). At GQA 3, 4
and 8 the short-prompt floor is head 128's 120 rows: at 100 tokens ``R x W x Hkv`` = 960-1,024
measured 1.35x-1.61x (GQA 2: 1.04x-1.14x), 480-512 0.85x-1.13x (1.09x-1.13x only at one KV head).
The long-prompt floor holds at GQA 3 and 8 (1.16x-4.54x), and the split-prompt exception from 60,000
at GQA 3, 4 and 8 (1.91x-3.30x at 8 KV heads; 1.86x-2.27x from 240,000 at 2). The twentieth round
measured GQA 5-7 (``small_batches_backends_{g5,g6,g7,g6_kv2}_d256.json`` and ``*_d256_split.json``: GQA
40/8, 48/8, 56/8 and 12/2), which behave as GQA 3-4 and 8 do: at 100 tokens 960-1,024 row-heads 1.41x-1.54x,
480-512 0.99x-1.04x; from 500 tokens every point from 60 rows 1.18x-4.07x. So the floors are one rule
over GQA 1-8 at head 256 (groups above 8 are not measured and keep 240 rows at every prompt). Its
split-prompt exception starts at half head 128's row tokens,
:data:`MIN_BEAM_ROW_TOKENS_SPLIT_KV_HEAD_256` = 30,000 at 8 KV heads (per-beam decode reads twice the
bytes per prompt token there): over the 20 head-256 grids 30,000-32,000 measured 1.26x-1.74x at 8 KV
heads and its scaled equivalents 1.20x-1.64x at 1, 2, 4 and 16, against 0.71x-1.17x at 15,000-16,000
(scaled). Over those grids (780 points) the rule serves 486 points, none under 1.14x; 138 more than
the nineteenth round's rule, at 1.18x-3.24x.

One exception (tenth round, ``small_batches_backends*.json``): FlashInfer's prefill splits each
prompt over many CTAs, so where it serves (``backend="flashinfer"``, or ``auto`` where :func:`beam_shared_prefix.prefix.split_kv_rule.split_kv_preferred` picks it) the cost
follows the prompt KV that the ``W`` beams no longer re-read, ``R x W x P``:

| R x W x P (R = 1-8, W = 8-30, P = 500-4,000) | FlashInfer + tail over per-beam decode |
| --- | --- |
| 4,000 - 16,000 | 0.66x - 0.95x: declined |
| 30,000 - 32,000 | 0.96x - 1.14x: declined (no margin) |
| >= 60,000 | 1.35x - 3.99x: served |

so a batch of fewer rows is served there when ``R x W x mean prompt >=
MIN_BEAM_ROW_TOKENS_SPLIT_KV = 60,000`` (measured at 8-30 beams, GQA 2 at head 128 in the tenth round;
GQA 4 at head 128 and GQA 2 at head 64 in the eleventh, ``small_batches_backends_{g4,d64}.json``:
every point served 1.14x-3.35x faster than per-beam decode, the narrowest margin 2 requests x 8 beams
x 4,000 tokens at head 64; only there). GQA 4 at head 64 (thirteenth round,
``small_batches_backends_g4_d64*.json``) is served from 120,000: at 64,000 it measured 1.02x-1.41x
(4 x 8 x 2,000 the narrowest), at 120,000-128,000 1.38x-1.63x. GQA 1 and 3 (fourteenth round,
``small_batches_backends_g[13]*.json``): from 60,000 at GQA 1 (1.13x-4.17x; the narrowest 4 x 8 x
2,000 at head 64) and GQA 3 at head 128 (1.31x-3.44x), from 120,000 at GQA 3, head 64 (1.06x at
4 x 8 x 2,000; 1.43x-1.83x from 120,000).

**Prompt length unknown** (a CUDA graph serves any prompt): beam widths below
``MIN_BEAM_WIDTH_ANY_PROMPT = 8`` are declined. At 8 beams and more the two-launch paths lost
only to 32-token prompts, and the cascade lost nowhere in any grid (head 64: 1.24x at 32 tokens).

**Long tails** (twenty-first to twenty-fifth rounds, ``tail_auto_check_*.json``: 932 points past 4
generated tokens that the other clauses serve, 1-128 requests of 4-256 beams at 100-20,000 tokens with
5-1,024 generated tokens per beam; GQA 16/8, 32/8, 64/8, MHA 16/16 and 32/32, 2-7 KV heads at groups 4-8,
and MQA 8/1, at heads 64-256). Every table above was measured at a 4-token tail. Every path reads each
beam's own generated tokens a short block at a time behind a chain of dependent loads (source beam, page,
K/V), so the library's step grows by a fixed time per generated token per wave of programs, while per-beam
decode's grows only with the bytes. The rule without a tail clause served 68 of the twenty-first round's
points slower than per-beam decode or under the margin (0.22x-1.08x; 8 x 8 x 500 at 256 tokens: 0.22x).
Past :data:`TAIL_MEASURED_LEN` generated tokens a step is served only while its mean prompt holds enough
tokens per generated token. Under 256 row-KV-heads ``R x W x Hkv`` (a program or two per SM) a generated
token costs the step a fixed latency while per-beam decode reads ``R x W x Hkv x P``, and the crossover
ratio times the row-KV-heads was 2,000-19,400 (3,700-11,400 under 128): such a step needs
``20,000 / (R x W x Hkv)`` prompt tokens per tail token, which also covers shapes smaller than any
measured. Everywhere, by beam width and beam rows, three tables: 8 KV heads or more with groups under 8;
2-7 KV heads or groups of 8 and more (GQA 64/8 crossed where the 2-7 KV head grids, nearly all at group
8, did: 2-3x the ratio of groups 1-4); one KV head. The twenty-fifth round fitted both to the crossovers:
for every shape measured at two long tails or more (about 300), the tail where per-beam decode / library
falls to 1.10, from straight lines of both times in the tail. What the rule asks at a shape is at least
1.5x its crossover ratio and twice the ratio of every point under 1.10x, and more rows or beams never
ask more. The binding shape of each entry:

| KV heads, group | beam width | beam rows | served while the tail <= | binding shape (crossover, or loss) |
| --- | --- | --- | --- | --- |
| 8+, under 5 | 2-7 | any | mean prompt / 74 | 30 x 4 x 4,000 crosses at 82 tokens (49) |
| 8+, under 5 | 8-11 | under 256 | mean prompt / 25 | loss: MHA 16/16, 20 x 10 x 600 at 48 tokens, 1.01x (12.5) |
| 8+, under 5 | 8-11 | 256 and more | mean prompt / 17 | MHA 32/32, 64 x 8 x 2,000 crosses at 182 tokens (11.0) |
| 8+, under 5 | 12+ | under 512 | mean prompt / 16 | 32 x 12 x 4,000 crosses at 393 tokens (10.2)* |
| 8+, under 5 | 12+ | 512-1,023 | mean prompt / 10 | loss: MHA 16/16, 20 x 28 x 600 at 150 tokens, 0.91x (4.0) |
| 8+, under 5 | 12+ | 1,024-2,047 | mean prompt / 7 | GQA 32/8, 48 x 24 x 1,800 crosses at 426 tokens (4.2)* |
| 8+, under 5 | 12+ | 2,048 and more | mean prompt / 6 | GQA 32/8, 80 x 40 x 1,800 crosses at 470 tokens (3.8)* |
| 2-7, or group 8+ | 2-7 | under 128 / from 128 | mean prompt / 500 / 200 | not measured (twenty-third round's) |
| 2-7, or group 8+ | 8+ | under 128 | mean prompt / 122 | GQA 48/6, 5 x 8 x 2,500 crosses at 31 tokens (80.7) |
| 2-7, or group 8+ | 8-11 | 128 and more | mean prompt / 50 | 16/2, head 64: 64 x 8 x 1,000 crosses at 31 (32.6) |
| group 8+ (a) | 12+ | 128-511 | mean prompt / 38 | as the narrow-group entry (32/4, 8 x 16 x 15,000: 23.5) |
| group 8+ (a) | 12+ | 512 and more | mean prompt / 30 | GQA 64/4, 64 x 30 x 2,000 crosses at 101 tokens (19.8) |
| narrow group (b) | 2-11 | as for group 8+ | as for group 8+ | not measured apart |
| narrow group (b) | 12+ | 128-511 | mean prompt / 38 | loss: GQA 28/4, 8 x 24 x 1,200 at 64 tokens, 1.03x (18.8)* |
| narrow group (b) | 12+ | 512 and more | mean prompt / 20 | 14/2, head 64: 16 x 32 x 1,400 crosses at 108 (13.0)* |
| 1 (or unknown) | any | under 512 | mean prompt / 141 | 16 x 16 x 2,000 crosses at 21 tokens (93.8) |
| 1 | 2-11 | 512 and more | mean prompt / 55 | 64 x 8 x 1,000 without shared ancestry crosses at 28 tokens (36.2) |
| 1 | 12+ | 512 and more | mean prompt / 22 | 96 x 20 x 6,000 crosses at 420 tokens (14.3) |
| any | any | under 256 row-KV-heads | also 20,000 / (R x W x Hkv) | loss: 32/4, 1 x 10 x 15,000 at 60 tokens, 1.09x |

(a) Or 2-7 KV heads and an unknown group. (b) 2-7 KV heads with a group under 8, or 8 KV heads and more with a group
of 5-7 (the tail kernel pads it to 8). Entries marked * were fitted in the fifty-second round on the kernels of the
day under independent ancestry (no generated token shared between beams: the tail's worst case;
``tail_auto_check_*_independent_round52.json``, the new ``tail_auto_check_round52_*.json`` grids and held-out 12).
Their history is in ``docs/rounds.md``: the twenty-first round's width-only table, the twenty-second's
rows bands, the twenty-third's tables below 8 KV heads, each fitted to twice the ratio of every loss and
broken by the next held-out set (eight of them) in the few-rows corner, where a loss ratio says nothing
about shapes measured only far from their crossover. The twenty-fourth round's few-rows tail tiling made
those steps up to 1.66x faster; the twenty-fifth timed again the 404 long-tail points whose launch it
changed (``*_retimed_round25.json``) and refitted to the crossovers. Its first refit served one point of
held-out 9 (``tail_auto_check_round25_heldout9_*.json``, predictions committed first) under the margin:
1 x 10 x 15,000 at 32/4 and 60 tokens, 1.09x, a single request at 40 row-KV-heads; the hyperbola
replaced the few-rows table values, and held-out 10 (88 points, ``..._heldout10_*``) served 63, none
under the margin (the slowest 1.20x). Two entries then rose to hold held-out 10's crossovers (2-7 beams
at 8 KV heads 62 to 74, few KV heads under 128 rows 60 to 122), which only declines more. Over the 932
long-tail points the clause serves 586, the slowest 1.15x, and declines 218 winners (the twenty-fourth
round's tables: 491 served, 313 declined winners). Where a crossover is extrapolated past the longest
tail measured, the straight line is the model. :func:`tail_decline_reason` is this clause alone; a CUDA
graph, whose tail is unknown at capture, cannot hand a step over and logs it instead. Since the twenty-seventh round the
cascade folds the run of tail positions that every beam of a tile reads from one ancestor once per tile;
the clause is unchanged, since that run is data on the device and the per-beam reads it was fitted on bound
the kernel whatever the ancestry (where histories coalesce, 64 x 30 x 500 at 256 tokens ran 3.97x faster
than per-beam decode and is still declined). Since the twenty-ninth round ``auto`` serves tails from
:data:`~beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL` on a two-launch path with the shared-run stage;
over 48 points at 96 and 256 tokens under both ancestries (``tail_auto_check_round29_shared*.json``) the
clause served 11, the slowest 2.30x, and one table entry rose (MQA, 2-11 beams from 512 rows: 50 to 55).

**Groups of more than 8 query heads per KV head** (twenty-sixth round; head 128, FA4 + tail serving).
Per-beam decode reads each beam's KV once for the whole group, while the library's work on the queries
grows with it. At GQA 12 and 16 (96/8, 64/4, 16/1; 144 points at tail 4) the row floors held (the slowest
served 1.21x). At 32/1 the rule served 64 x 16 and 64 x 30 at 100 tokens at 0.89x and 0.98x (every
100-token point lost there), at 64/1 500 tokens lost (0.77x-0.83x at 480-1,920 rows) and 2,000 won
(1.38x-1.43x): above 16 a step needs a mean prompt of 500 tokens, above 32 of 2,000
(:data:`WIDE_GROUP_MIN_PROMPT`; an unknown prompt is declined there). With one KV head, long tails crossed
earlier at 16/1 than the 8/1 table allows (1.5x the crossovers: 71 prompt tokens per tail token at 512
rows against 50): a group wider than 8 asks ``group / 8`` times that table (:data:`TAIL_ONE_KV_HEAD_GROUP`;
at 32/1 this asks 2-4x what its crossovers need). Held-out 11 (88 points at 48/2, 32/2, 12/1 and 128/8,
predictions committed first) served 29, the slowest 1.36x.

**Mixed tails.** The grids above ran one tail per batch; serving judges a batch's longest, since each
request's tail is walked by its own programs. Measured with tails drawn in ``[1, T]`` (one request at
``T``; ``tail_auto_check_round23_mixed*.json``, 64 pairs): the library's time was 0.95-1.01x its time
with every tail at ``T`` at 8-16 requests and 0.56-0.97x at 64, per-beam decode's 0.84-1.02x; every
mixed-tail point the rule serves ran at least 1.56x faster than per-beam decode.

Extrapolation, stated: the request count was varied at head 128 (the cascade, and FlashInfer for
the split-prompt exception), at head 64 (the cascade, and FlashInfer at GQA 2) and at head 256
(FlashInfer, GQA 1-8); groups above 8 only at head 128 (GQA 12-64; at heads 64 and 256 they take head
128's clauses); the two-launch rule's ``(W - 1) x P`` was measured at head 128; beams narrower
than 8 above 8 KV heads were measured on the cascade at head 128 (16-64 KV heads), and their table is
applied to every path and head size. Re-run the
grids for a very different shape (``docs/benchmarks.md`` says how).

The function is pure and cheap (integer arithmetic), independent of TensorRT-LLM and of the
benchmark code. Unknown quantities are passed as ``None`` and judged as described above.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["should_decline", "cascade_min_prompt", "min_beam_rows", "MIN_BEAM_WIDTH", "MIN_BEAM_WIDTH_ANY_PROMPT",
           "MIN_SHARED_PROMPT_TOKENS", "WIDE_GROUP", "WIDE_GROUP_MIN_PROMPT", "MIN_BEAM_ROWS", "MIN_BEAM_ROWS_HEAD_256",
           "MIN_BEAM_ROWS_LONG_PROMPT",
           "FEW_ROWS_MIN_PROMPT", "MIN_BEAM_ROWS_HEAD_128_REFIT", "FEW_ROWS_REFIT_MIN_PROMPT",
           "MIN_BEAM_ROWS_HEAD_128_REFIT_NARROW", "FEW_ROWS_REFIT_WIDE_FROM", "FEW_ROWS_REFIT_NARROW_MIN_PROMPT",
           "FEW_ROWS_REFIT_NARROWEST", "FEW_ROWS_REFIT_SHORT_PROMPT_FROM", "FEW_ROWS_REFIT_NARROWEST_MIN_PROMPT",
           "MIN_BEAM_ROWS_GQA1_SHORT_PROMPT", "GQA1_SHORT_PROMPT", "MIN_BEAM_ROWS_LONG_PROMPT_THREE_BEAMS",
           "FEW_ROWS_REFIT_GQA2_MIN_PROMPT", "MIN_BEAM_ROWS_NARROW_TILE", "NARROW_TILE_FLOOR_MIN_PROMPT",
           "MIN_BEAM_ROWS_NARROW_TILE_GROUP_8", "NARROW_TILE_GROUP_8_FLOOR_MIN_PROMPT",
           "MIN_BEAM_ROWS_HEAD_256_REFIT", "FEW_ROWS_HEAD_256_REFIT_MIN_PROMPT",
           "FEW_ROWS_HEAD_256_REFIT_GQA2_MIN_PROMPT", "FEW_ROWS_HEAD_256_REFIT_LONG_PROMPT",
           "MIN_BEAM_ROW_TOKENS_SPLIT_KV", "MIN_BEAM_ROW_TOKENS_SPLIT_KV_HEAD_256", "CASCADE_MIN_PROMPT", "CASCADE_MIN_PROMPT_HEAD_64",
           "NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT", "NARROW_BEAMS_MEASURED_KV_HEADS", "narrow_beams_min_prompt",
           "TAIL_MEASURED_LEN", "TAIL_MIN_PROMPT_PER_TOKEN", "TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS",
           "TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS_NARROW_GROUP",
           "TAIL_MIN_PROMPT_PER_TOKEN_ONE_KV_HEAD", "TAIL_ONE_KV_HEAD_GROUP", "TAIL_FEW_ROW_KV_HEADS",
           "TAIL_PROMPT_ROW_KV_HEADS",
           "max_tail_len",
           "tail_decline_reason"]

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
#: Above :data:`NARROW_BEAMS_MEASURED_KV_HEADS` KV heads, beams narrower than 8 need this mean prompt on
#: every path, ``(beam width from, tokens)``; beam width 2 is never served there, 8 and more as with fewer
#: KV heads (twentieth round).
NARROW_BEAMS_MANY_KV_HEADS_MIN_PROMPT = ((3, 1000), (4, 250), (6, 50), (8, 0))
#: The KV heads at which the narrow-beam tables above were measured (and fewer).
NARROW_BEAMS_MEASURED_KV_HEADS = 8
#: The tail (generated tokens per beam, this step's included) at which every clause above was measured;
#: a tail up to this is judged by them alone.
TAIL_MEASURED_LEN = 4
#: Past it, a step is served while its mean prompt holds at least this many tokens per generated token
#: of the tail, ``(beam width from, beam rows R x W from, prompt tokens per tail token)``, with 8 KV heads or
#: more and groups under 8; a shape takes the entry of the widest band it reaches, and in it the most rows
#: (twenty-fifth round: at least 1.5x the crossover of every shape measured in the band at two tails or
#: more, and twice the ratio of every loss, where :data:`TAIL_PROMPT_ROW_KV_HEADS` does not ask more; the
#: module docstring has the data).
TAIL_MIN_PROMPT_PER_TOKEN = (
    (2, 0, 74),
    (8, 0, 25), (8, 256, 17),
    (12, 0, 17), (12, 512, 10), (12, 1024, 7), (12, 2048, 6),
)
#: The same with 2-7 KV heads, or groups of 8 query heads per KV head and more, where the library has the
#: fewest programs per query head and per-beam decode is cheapest for its heads. Two to seven beams were
#: not measured there (the twenty-third round's values).
TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS = (
    (2, 0, 500), (2, 128, 200),
    (8, 0, 122), (8, 128, 50),
    (12, 128, 38), (12, 512, 30),
)
#: The same at 2-7 KV heads with a known group under 8, and at 8 KV heads and more with groups of 5-7 (which the
#: tail kernel pads to 8): as :data:`TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS` but from 512 beam rows at 12 beams and
#: more, where the groups of 8-16 that bind that table (30: GQA 64/4 and 96/8) are not in it (fifty-second round,
#: independent ancestry: GQA 12/2, 14/2 at head 64, 20/4, 28/4 and 40/8; held-out 12's 14/2 at head 64, 16 x 32 x 1,400,
#: crosses at 108 tokens).
TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS_NARROW_GROUP = (
    (2, 0, 500), (2, 128, 200),
    (8, 0, 122), (8, 128, 50),
    (12, 128, 38), (12, 512, 24), (12, 2048, 17),
)
#: The same with one KV head (MQA) or an unknown count: MQA's per-beam decode is the cheapest of all (one
#: KV head read by all of its query heads), so the library needs the most prompt per tail token there.
#: Measured at GQA 8/1; a wider group asks ``group / 8`` times as much (:data:`TAIL_ONE_KV_HEAD_GROUP`).
TAIL_MIN_PROMPT_PER_TOKEN_ONE_KV_HEAD = ((2, 0, 141), (2, 512, 55), (12, 512, 22))
#: The group of the one-KV-head table's grids (8/1). Per-beam decode reads one KV head whatever the group,
#: while the library's tail reads and attends once per query head: at 16/1 (twenty-sixth round,
#: ``tail_auto_check_round26_g16_mqa.json``) 1.5x the crossovers needed up to 71 prompt tokens per tail
#: token at 512 rows (the table: 55) and 34 at 1,920 (22), while at 64/4 and 96/8 the few-KV-heads table held.
TAIL_ONE_KV_HEAD_GROUP = 8
# The widest group the tail kernel tiles (triton_kernels.tail_merge.MAX_GROUP_SIZE; a test keeps the two
# equal): an unknown group at one KV head is judged as it, the strictest.
_WIDEST_GROUP = 64
#: Under :data:`TAIL_FEW_ROW_KV_HEADS` row-KV-heads ``R x W x Hkv`` the tail kernel runs a program or two per SM
#: and each generated token costs the step a fixed latency, while per-beam decode's time is the prompt's
#: bytes, ``R x W x Hkv x P``: the crossover ratio falls as ``1 / (R x W x Hkv)`` (twenty-fifth round: the
#: crossover times the row-KV-heads was 3,700-11,400 under 128, 2,000-19,400 under 256). A step there also needs
#: ``TAIL_PROMPT_ROW_KV_HEADS / (R x W x Hkv)`` prompt tokens per tail token: twice the ratio of held-out 9's
#: loss, 1 x 10 x 15,000 at 32/4 (40 row-KV-heads), 1.09x at 60 tokens.
TAIL_FEW_ROW_KV_HEADS = 256
TAIL_PROMPT_ROW_KV_HEADS = 20_000
# From this many KV heads the tail takes TAIL_MIN_PROMPT_PER_TOKEN, below it the tables above.
_TAIL_MANY_KV_HEADS = 8
# From this many query heads per KV head the tail takes the few-KV-heads table at any KV head count: at 8
# KV heads, GQA 64/8's crossovers (11.1-15.4 prompt tokens per tail token at 384-960 rows) were those of
# the few-KV-heads grids (all but GQA 16/4 at group 8), 2-3x those of groups 1-4 at the same rows.
_TAIL_LARGE_GROUP = 8
# From this many query heads per KV head (up to _TAIL_LARGE_GROUP) the tail kernel pads the group to 8, and at 8 KV
# heads and more the step takes the narrow-group table: in held-out 12 (fifty-second round, independent ancestry)
# GQA 40/8 crossed earlier than the many-KV-heads table, fitted on groups of 1-4, allows (80 x 30 x 2,400 at 264
# tokens: 9.1 prompt tokens per tail token, where the table asks 6 from 2,048 rows).
_TAIL_PADDED_GROUP = 5


def _scaling_kv_heads(num_kv_heads: Optional[int]) -> int:
    """The KV heads the floors are scaled for: ``num_kv_heads`` capped at 16 (``None``: 8)."""
    return min(int(num_kv_heads), _MAX_SCALED_KV_HEADS) if num_kv_heads else _MEASURED_KV_HEADS


def _scaled_by_kv_heads(value: int, num_kv_heads: Optional[int]) -> int:
    """``value`` (measured at 8 KV heads) times ``8 / Hkv`` for :func:`_scaling_kv_heads`' ``Hkv``, rounded
    up: what decides is ``R x W x Hkv`` (the module docstring has the data)."""
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
    to twentieth rounds; the module docstring has the data). At head 128, groups 3-8 and 2-8 KV heads the
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


def cascade_min_prompt(beam_width: int, head_dim: Optional[int] = None) -> Optional[int]:
    """The smallest mean prompt (tokens) served at ``beam_width`` (>= 2) when the cascade serves, at
    ``head_dim`` (``None``: head 128's table); ``None`` where no prompt measured was served."""
    return _table_value(CASCADE_MIN_PROMPT_HEAD_64 if _narrow_head(head_dim) else CASCADE_MIN_PROMPT, beam_width)


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


def _tail_table(num_kv_heads: Optional[int], group: Optional[int]):
    """The tail table for ``num_kv_heads`` and ``group`` query heads per KV head (``None``: judged as
    the strictest, one KV head and a group of 8 or more; the caller scales one KV head's table by the group)."""
    if num_kv_heads is None or int(num_kv_heads) <= 1:
        return TAIL_MIN_PROMPT_PER_TOKEN_ONE_KV_HEAD
    if group is None or int(group) >= _TAIL_LARGE_GROUP:
        return TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS
    if int(num_kv_heads) < _TAIL_MANY_KV_HEADS or int(group) >= _TAIL_PADDED_GROUP:
        return TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS_NARROW_GROUP
    return TAIL_MIN_PROMPT_PER_TOKEN


def _group(num_qo_heads: Optional[int], num_kv_heads: Optional[int]) -> Optional[int]:
    """Query heads per KV head (``None``: either count unknown, or not a whole group)."""
    if num_qo_heads is None or not num_kv_heads or int(num_qo_heads) % int(num_kv_heads):
        return None
    return int(num_qo_heads) // int(num_kv_heads)


def _tail_rows(beam_width: int, num_requests: Optional[int]) -> int:
    """Beam rows ``R x W``, an unknown request count judged as one request."""
    return int(beam_width) * max(int(num_requests or 1), 1)


def _few_rows_prompt_per_token(row_kv_heads: int) -> Optional[int]:
    """:data:`TAIL_PROMPT_ROW_KV_HEADS` ``/ row_kv_heads`` rounded up, under :data:`TAIL_FEW_ROW_KV_HEADS`."""
    return -(-TAIL_PROMPT_ROW_KV_HEADS // row_kv_heads) if row_kv_heads < TAIL_FEW_ROW_KV_HEADS else None


def _tail_prompt_per_token(beam_width: int, num_kv_heads: Optional[int], num_requests: Optional[int],
                           num_qo_heads: Optional[int]) -> Optional[int]:
    group = _group(num_qo_heads, num_kv_heads)
    table = _tail_table(num_kv_heads, group)
    rows = _tail_rows(beam_width, num_requests)
    per_token = _table_value(table, int(beam_width), rows)
    if table is TAIL_MIN_PROMPT_PER_TOKEN_ONE_KV_HEAD and per_token is not None:
        width = _WIDEST_GROUP if group is None else group
        if width > TAIL_ONE_KV_HEAD_GROUP:
            per_token = -(-per_token * width // TAIL_ONE_KV_HEAD_GROUP)
    few_rows = _few_rows_prompt_per_token(rows * max(int(num_kv_heads or 1), 1))
    return per_token if few_rows is None else max(per_token or 0, few_rows)


def max_tail_len(beam_width: int, prompt_len: float, num_kv_heads: Optional[int],
                 num_requests: Optional[int] = None, num_qo_heads: Optional[int] = None) -> float:
    """The longest tail (generated tokens per beam, this step's included) served with this beam width,
    mean prompt, KV head count, request count and query head count: ``max(TAIL_MEASURED_LEN, prompt_len /
    prompt tokens per tail token)`` (:data:`TAIL_MIN_PROMPT_PER_TOKEN` with 8 KV heads or more and groups
    under 8; ``..._FEW_KV_HEADS`` at 2-7 KV heads or groups of 8 and more; ``..._ONE_KV_HEAD`` at one, times
    ``group / 8`` above 8), in tokens; under :data:`TAIL_FEW_ROW_KV_HEADS` row-KV-heads at least
    :data:`TAIL_PROMPT_ROW_KV_HEADS` ``/ (R x W x Hkv)`` prompt tokens per tail token. ``None`` is judged as the
    strictest: one KV head, one request, a group of 8 (of 64 at one KV head)."""
    return _tail_limit(prompt_len, _tail_prompt_per_token(beam_width, num_kv_heads, num_requests, num_qo_heads))


def _tail_limit(prompt_len: float, per_token: Optional[int]) -> float:
    return float(TAIL_MEASURED_LEN) if per_token is None else max(float(TAIL_MEASURED_LEN), float(prompt_len) / per_token)


def tail_decline_reason(beam_width: Optional[int], prompt_len: Optional[float], tail_len: Optional[float],
                        num_kv_heads: Optional[int], num_requests: Optional[int] = None,
                        num_qo_heads: Optional[int] = None) -> Optional[str]:
    """The long-tail clause of :func:`should_decline` alone: the reason to leave a step whose beams have
    generated ``tail_len`` tokens (the longest request's, this step's included) over a mean prompt of ``prompt_len``
    tokens to per-beam decode, or ``None``. ``beam_width``, ``prompt_len`` or ``tail_len`` ``None``
    (unknown): ``None``; ``num_kv_heads`` ``None``: judged as one KV head; ``num_requests`` ``None``: as
    one request; ``num_qo_heads`` ``None``: as a group of 8 (of 64 with one KV head). Fewer than
    :data:`MIN_BEAM_WIDTH` beams: ``None`` (:func:`should_decline` declines them whatever the tail)."""
    if beam_width is None or prompt_len is None or tail_len is None or int(beam_width) < MIN_BEAM_WIDTH:
        return None
    per_token = _tail_prompt_per_token(beam_width, num_kv_heads, num_requests, num_qo_heads)
    limit = _tail_limit(prompt_len, per_token)
    if float(tail_len) <= limit:
        return None
    heads = ("1 KV head (or an unknown count)" if num_kv_heads is None
             else f"{int(num_kv_heads)} KV head{'' if int(num_kv_heads) == 1 else 's'}")
    group = _group(num_qo_heads, num_kv_heads)
    if num_kv_heads is not None and int(num_kv_heads) >= _TAIL_MANY_KV_HEADS:
        if group is None:
            heads += f" and an unknown query head count (judged as a group of {_TAIL_LARGE_GROUP})"
        elif group >= _TAIL_LARGE_GROUP:
            heads += f" and {group} query heads per KV head"
        elif group >= _TAIL_PADDED_GROUP:
            heads += f" and {group} query heads per KV head (the tail kernel pads them to {_TAIL_LARGE_GROUP})"
    elif num_kv_heads is None or int(num_kv_heads) <= 1:  # the one-KV-head table, scaled by the group
        if group is None:
            heads += f" and an unknown query head count (judged as a group of {_WIDEST_GROUP})"
        elif group > TAIL_ONE_KV_HEAD_GROUP:
            heads += f" and {group} query heads ({group} / {TAIL_ONE_KV_HEAD_GROUP} times the ratio of 8/1)"
    rows = "" if num_requests is None else f" and {int(num_requests) * int(beam_width)} beam rows"
    row_kv_heads = _tail_rows(beam_width, num_requests) * max(int(num_kv_heads or 1), 1)
    if per_token == _few_rows_prompt_per_token(row_kv_heads):
        heads += f" ({TAIL_PROMPT_ROW_KV_HEADS:,} / {row_kv_heads} row-KV-heads)"
    return (
        f"tail {float(tail_len):.0f} generated tokens per beam > {int(limit)} (beam width {int(beam_width)}{rows} "
        f"with {heads} needs {per_token} prompt tokens per generated token past {TAIL_MEASURED_LEN}; "
        f"mean prompt {float(prompt_len):.0f}): every beam reads its own generated tokens a short block at a "
        f"time, and per-beam decode is faster or within 10% at such tails (measured on the H200, "
        f"docs/benchmarks.md)"
    )


def should_decline(
    num_requests: Optional[int],
    beam_width: Optional[int],
    prompt_len: Optional[float],
    num_qo_heads: Optional[int],
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
    *,
    one_launch: bool = False,
    split_kv: bool = False,
    tail_len: Optional[float] = None,
) -> Optional[str]:
    """The reason to leave this shape to the default per-beam decode, or ``None`` to serve it.

    Args:
        num_requests: ``R``, generation requests in the batch (``None``: unknown; the row floors are not judged,
            and the tail clause judges the batch as one request).
        beam_width: ``W``, beams per request (``None``: unknown; nothing is judged).
        prompt_len: prompt length in tokens; for a batch, its mean (``None``: unknown, e.g. a
            CUDA graph that serves any prompt).
        num_qo_heads, num_kv_heads, head_dim: the layer's attention shape: the GQA group and the KV head count
            pick and scale the row floors and prompt bands, the head size the cascade's table (head 64 or head 128;
            ``None``: head 128's).
        one_launch: whether the one-launch cascade serves the batch (its own, lower thresholds);
            ``False``: a prefix backend + the tail kernel (two launches).
        split_kv: whether FlashInfer's prefix backend serves it (its prefill splits each prompt over
            the GPU, so fewer beam rows pay from :data:`MIN_BEAM_ROW_TOKENS_SPLIT_KV`); two launches.
        tail_len: generated tokens per beam, this step's included (``kv_len - prompt_len``), of the batch's
            longest-running request: each request's tail is walked by its own programs, so the longest sets
            the step's time (the grids ran one tail per batch). ``None``: unknown (a CUDA graph), not judged
            (:func:`tail_decline_reason`).

    Returns:
        A one-line reason naming the measured threshold (logged by the caller), or ``None``.

    Raises:
        ValueError: a prompt or tail length that is negative or not finite (the rule would judge it
            by accident).
    """
    for name, value in (("prompt_len", prompt_len), ("tail_len", tail_len)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite length >= 0 in tokens, or None where unknown.")
    if beam_width is None:
        return None
    w = int(beam_width)
    if w < MIN_BEAM_WIDTH:
        return f"beam width {w} < {MIN_BEAM_WIDTH}: no beams share a prompt"
    rows = None if num_requests is None else int(num_requests) * w
    group = _group(num_qo_heads, num_kv_heads)
    base = _beam_rows_floor(prompt_len, group, head_dim, num_kv_heads, w)
    least_rows = _row_floor(base, num_kv_heads, head_dim)
    if rows is not None and rows < least_rows:
        # The exception is measured at 8-30 beams and the shapes of _SPLIT_KV_MEASURED_SHAPES;
        # elsewhere few rows stay declined.
        split_measured = (split_kv and not one_launch and prompt_len is not None
                          and w >= _SPLIT_KV_MEASURED_FROM_WIDTH and (group, head_dim) in _SPLIT_KV_MEASURED_SHAPES)
        if not split_measured:
            scaled = _row_floor_note(base, group, head_dim, num_kv_heads, prompt_len, w)
            return (
                f"{int(num_requests)} requests x beam width {w} = {rows} beam rows < {least_rows}{scaled}: too few "
                f"programs to fill the GPU, per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
            )
        row_tokens = rows * float(prompt_len)
        # Measured at 8 KV heads; scaled as the rows are (at 2 KV heads FlashInfer + tail beat
        # per-beam decode only from 240,000: 0.78x-0.91x at 60,000-64,000, 1.17x-1.22x at 240,000-256,000).
        least_row_tokens = _scaled_by_kv_heads(_SPLIT_KV_MIN_ROW_TOKENS[(group, head_dim)], num_kv_heads)
        if row_tokens < least_row_tokens:
            return (
                f"{int(num_requests)} requests x beam width {w} x mean prompt {float(prompt_len):.0f} = "
                f"{row_tokens:.0f} < {least_row_tokens} with FlashInfer's split prompt and "
                f"{rows} beam rows < {least_rows}: per-beam decode is faster or within 10% here (measured on the "
                f"H200, docs/benchmarks.md)"
            )
    least_prompt = _table_value(WIDE_GROUP_MIN_PROMPT, group) if group is not None else None
    if least_prompt is not None and (prompt_len is None or float(prompt_len) < least_prompt):
        prompt = "unknown (a CUDA graph)" if prompt_len is None else f"{float(prompt_len):.0f}"
        return (
            f"{group} query heads per KV head (more than {WIDE_GROUP}) need a mean prompt of {least_prompt} "
            f"tokens, this one is {prompt}: per-beam decode reads each beam's KV once for the whole group and was "
            f"faster or within 10% at shorter prompts (measured on the H200, docs/benchmarks.md)"
        )
    if prompt_len is None:
        if w < MIN_BEAM_WIDTH_ANY_PROMPT:
            return (
                f"beam width {w} < {MIN_BEAM_WIDTH_ANY_PROMPT} with the prompt length unknown (a CUDA graph): "
                f"narrow beams pay only with long prompts (measured on the H200, docs/benchmarks.md)"
            )
        return None
    least_narrow = narrow_beams_min_prompt(w, num_kv_heads)
    if least_narrow is None or float(prompt_len) < least_narrow:
        # The tables below were measured at 8 KV heads; with more, per-beam decode has more programs
        # to spread narrow beams over and wins longer prompts (0.89x-0.98x where they served).
        served = "at every prompt measured (up to 2,000 tokens)" if least_narrow is None else (
            f"below a mean prompt of {least_narrow} tokens (this one is {float(prompt_len):.0f})")
        return (
            f"beam width {w} with {int(num_kv_heads)} KV heads (more than {NARROW_BEAMS_MEASURED_KV_HEADS}): per-beam "
            f"decode was faster or within 10% {served} (measured on the H200, docs/benchmarks.md)"
        )
    long_tail = tail_decline_reason(w, prompt_len, tail_len, num_kv_heads, num_requests, num_qo_heads)
    if long_tail is not None:
        return long_tail
    saved = (w - 1) * float(prompt_len)
    if one_launch:
        least = cascade_min_prompt(w, head_dim)
        if least is None:
            return (
                f"beam width {w} at head {head_dim} with the one-launch cascade: per-beam decode was faster or "
                f"within 10% at every prompt measured (up to 2,000 tokens; H200, docs/benchmarks.md)"
            )
        # Served where the cascade measured faster; at head 128 also wherever the two-launch paths
        # are (auto picks the cascade only where it beat them; not measured at head 64).
        narrow = _narrow_head(head_dim)
        two_launch_serves = saved >= MIN_SHARED_PROMPT_TOKENS and not narrow
        if float(prompt_len) < least and not two_launch_serves:
            return (
                f"mean prompt {float(prompt_len):.0f} < {least} tokens at beam width {w} with the one-launch "
                f"cascade{f' at head {head_dim}' if narrow else ''}: "
                f"per-beam decode is faster or within 10% here (measured on the H200, docs/benchmarks.md)"
            )
        return None
    if saved < MIN_SHARED_PROMPT_TOKENS:
        return (
            f"(beam width {w} - 1) x prompt {float(prompt_len):.0f} = {saved:.0f} shared prompt tokens < "
            f"{MIN_SHARED_PROMPT_TOKENS}: per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
        )
    return None
