"""The decline rule's long-tail clause: how many generated tokens per beam a step is served with.

Past :data:`TAIL_MEASURED_LEN` generated tokens a step is served only while its mean prompt holds enough tokens per
generated token, by beam width and beam rows: :data:`TAIL_MIN_PROMPT_PER_TOKEN` (8 KV heads or more, groups under 5),
``..._FEW_KV_HEADS`` (groups of 8 or more, or unknown), ``..._FEW_KV_HEADS_NARROW_GROUP`` (2-7 KV heads with a
smaller group, or groups of 5-7) and ``..._ONE_KV_HEAD`` (one KV head or an unknown count, times ``group / 8`` above
:data:`TAIL_ONE_KV_HEAD_GROUP`), and under :data:`TAIL_FEW_ROW_KV_HEADS` row-KV-heads at least
:data:`TAIL_PROMPT_ROW_KV_HEADS` ``/ (R x W x Hkv)``. Every path reads each beam's own generated tokens a short block
at a time, so the library's step grows by a fixed time per generated token while per-beam decode's grows only with the
bytes. :func:`max_tail_len` is the longest tail served, :func:`tail_decline_reason` the clause alone. The comments
above the constants record the measurements; the fits and held-out checks are in ``docs/benchmarks-evidence.md``.
Split out of :mod:`beam_shared_prefix.decline`; it takes :data:`~.rows.MIN_BEAM_WIDTH` and two helpers from
:mod:`.rows`.
"""

from __future__ import annotations

from typing import Optional

from .rows import MIN_BEAM_WIDTH, _group, _table_value

__all__ = ["TAIL_FEW_ROW_KV_HEADS", "TAIL_MEASURED_LEN", "TAIL_MIN_PROMPT_PER_TOKEN",
           "TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS", "TAIL_MIN_PROMPT_PER_TOKEN_FEW_KV_HEADS_NARROW_GROUP",
           "TAIL_MIN_PROMPT_PER_TOKEN_ONE_KV_HEAD", "TAIL_ONE_KV_HEAD_GROUP", "TAIL_PROMPT_ROW_KV_HEADS",
           "max_tail_len", "tail_decline_reason"]

#: The tail (generated tokens per beam, this step's included) at which every clause above was measured;
#: a tail up to this is judged by them alone.
TAIL_MEASURED_LEN = 4
#: Past it, a step is served while its mean prompt holds at least this many tokens per generated token
#: of the tail, ``(beam width from, beam rows R x W from, prompt tokens per tail token)``, with 8 KV heads or
#: more and groups under 8; a shape takes the entry of the widest band it reaches, and in it the most rows
#: (twenty-fifth round: at least 1.5x the crossover of every shape measured in the band at two tails or
#: more, and twice the ratio of every loss, where :data:`TAIL_PROMPT_ROW_KV_HEADS` does not ask more;
#: docs/benchmarks-evidence.md has the data).
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
