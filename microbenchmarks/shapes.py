"""Benchmark shapes: the reference presets, free arguments and sweeps.

A :class:`BenchShape` is one decode step of one attention layer: ``R`` requests with ``W`` beams
each, every request with a prompt of ``P`` tokens and a generated tail of ``T`` tokens (the tail
counts this step's token, so ``kv_len = P + T``), ``Hq``/``Hkv`` heads of size ``D``, pages of
``Pg`` tokens, bf16 or fp16.

Presets (issue 6; layer level, bf16, head 128, page 32):

| name | R x W x P | tail | Hq/Hkv | model |
| --- | --- | --- | --- | --- |
| ``A`` | 128 x 96 x 3000 | 3 | 16/8 | Qwen3-0.6B |
| ``B-short`` | 64 x 30 x 100 | 4 | 16/8 | |
| ``B-medium`` | 64 x 30 x 500 | 4 | 16/8 | |
| ``B-long`` | 64 x 30 x 2000 | 4 | 16/8 | |
| ``B-4B`` | 64 x 30 x 500 | 4 | 32/8 | Qwen3-4B |
| ``B-beam14`` | 64 x 14 x 500 | 4 | 16/8 | |

A sweep (``--sweep beams=14,30,96,256``) varies one field over a list; several ``--sweep``
arguments form their cartesian product. A sample (``--sample N``, :func:`sample_shapes`) draws shapes at random
over the serving space instead: held-out points for auditing the decline rule and the backend choice.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BenchShape",
    "PRESETS",
    "SWEEP_FIELDS",
    "ShapeError",
    "parse_sweep",
    "expand_sweeps",
    "parse_custom_shapes",
    "tuning_shapes",
    "reduced_cpu_shape",
    "sample_shapes",
    "SAMPLE_HEADS",
    "SAMPLE_RANGES",
    "DTYPES",
    "ANCESTRIES",
]

DTYPES = ("bfloat16", "float16")
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16"}


# Tail ancestries the workload builder simulates (BenchShape.ancestry); the first is the default.
ANCESTRIES = ("beam-search", "uniform", "independent")


class ShapeError(ValueError):
    """A shape, preset or sweep argument the benchmark refuses; the message names the value and the fix."""


def canonical_dtype(name: str) -> str:
    """``'bf16'``/``'bfloat16'`` -> ``'bfloat16'``, ``'fp16'``/``'float16'``/``'half'`` -> ``'float16'``."""
    key = str(name).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ShapeError(f"dtype={name!r} is not supported; use bf16 (bfloat16) or fp16 (float16).")
    return _DTYPE_ALIASES[key]


def canonical_ancestry(name: str) -> str:
    """One of :data:`ANCESTRIES` (``_`` for ``-`` and any case accepted)."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in ANCESTRIES:
        raise ShapeError(f"ancestry={name!r} is not supported; use one of {', '.join(ANCESTRIES)}.")
    return key


@dataclass(frozen=True)
class BenchShape:
    """One decode step of one attention layer.

    Attributes:
        requests: ``R``, generation requests in the batch.
        beams: ``W``, beam width.
        prompt: ``P``, prompt tokens per request (the mean when ``prompt_jitter > 0``).
        tail: ``T``, generated tokens per beam including this step's token (``>= 1``);
            ``kv_len = P + T``.
        heads: ``Hq``, query heads.
        kv_heads: ``Hkv``, KV heads (``Hq % Hkv == 0``).
        head_dim: ``D``.
        page_size: ``Pg``, tokens per KV page.
        dtype: ``"bfloat16"`` or ``"float16"``.
        prompt_jitter: prompts are drawn uniformly from ``[P(1-j), P(1+j)]`` per request (0: all ``P``).
        tail_jitter: tails are drawn uniformly from ``[max(1, round(T(1-j))), T]`` per request (0: all
            ``T``), as in-flight batching mixes requests at different decode steps; one request keeps
            ``T``, so ``T`` is the step's longest tail, the one the decline rule judges.
        ancestry: where each beam's earlier generated tokens come from. ``"beam-search"`` (the default):
            every step each beam takes a parent skewed towards the leading beams, as a sorted beam search
            does, so histories coalesce a few steps back and beams read shared K/V rows; ``"uniform"``: every
            parent drawn uniformly over the beams, so histories coalesce slowly (all ``W`` beams' common
            ancestor lies about ``2 W`` steps back), between the two others;
            ``"independent"``: every beam is its own parent, so no two beams share a generated row
            (the worst case for the kernels' reuse of shared rows, as diverse beam search can make it).
        name: preset name, or ``"custom"``.
    """

    requests: int
    beams: int
    prompt: int
    tail: int
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 32
    dtype: str = "bfloat16"
    prompt_jitter: float = 0.0
    tail_jitter: float = 0.0
    ancestry: str = "beam-search"
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "ancestry", canonical_ancestry(self.ancestry))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ShapeError` naming the field, its value and the limit."""
        for field_name in ("requests", "beams", "prompt", "tail", "heads", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShapeError(f"{field_name}={value!r} must be an int >= 1.")
        if self.heads % self.kv_heads:
            raise ShapeError(
                f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; GQA needs heads % kv_heads == 0."
            )
        if self.head_dim % 8:
            raise ShapeError(f"head_dim={self.head_dim} must be a multiple of 8 (16-byte rows of bf16/fp16).")
        if not (0.0 <= float(self.prompt_jitter) < 1.0):
            raise ShapeError(f"prompt_jitter={self.prompt_jitter} must be in [0, 1).")
        if not (0.0 <= float(self.tail_jitter) <= 1.0):
            raise ShapeError(f"tail_jitter={self.tail_jitter} must be in [0, 1] (1: tails from 1 to T).")
        canonical_ancestry(self.ancestry)

    @property
    def group(self) -> int:
        """GQA group ``Hq // Hkv``."""
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:
        """``R * W`` beam rows (query tokens of the step)."""
        return self.requests * self.beams

    @property
    def longest_prompt(self) -> int:
        """The longest prompt a request may draw: ``max(lo, round(P(1+j)))`` with ``j = prompt_jitter`` and ``lo =
        max(1, round(P(1-j)))`` (``P`` without jitter)."""
        if self.prompt_jitter <= 0:
            return int(self.prompt)
        lo = max(1, int(round(self.prompt * (1 - self.prompt_jitter))))
        return max(lo, int(round(self.prompt * (1 + self.prompt_jitter))))

    @property
    def shortest_tail(self) -> int:
        """The shortest tail a request may draw: ``max(1, round(T(1-j)))`` with ``j = tail_jitter``."""
        return max(1, int(round(self.tail * (1.0 - float(self.tail_jitter)))))

    def label(self) -> str:
        """Short human-readable description, e.g. ``A: 128x96 P3000 T3 16/8 D128 Pg32 bf16``."""
        dt = {"bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        jit = f"±{int(self.prompt_jitter * 100)}%" if self.prompt_jitter else ""
        tail = f"T{self.shortest_tail}-{self.tail}" if self.shortest_tail < self.tail else f"T{self.tail}"
        ancestry = "" if self.ancestry == ANCESTRIES[0] else f" {self.ancestry} ancestry"
        return (
            f"{self.name}: {self.requests}x{self.beams} P{self.prompt}{jit} {tail} "
            f"{self.heads}/{self.kv_heads} D{self.head_dim} Pg{self.page_size} {dt}{ancestry}"
        )

    def to_dict(self) -> Dict:
        """JSON-ready dict of the fields (used in the results document)."""
        return asdict(self)


def _b(name: str, prompt: int, tail: int = 4, beams: int = 30, heads: int = 16) -> BenchShape:
    return BenchShape(requests=64, beams=beams, prompt=prompt, tail=tail, heads=heads, kv_heads=8, name=name)


PRESETS: Dict[str, BenchShape] = {
    "A": BenchShape(requests=128, beams=96, prompt=3000, tail=3, heads=16, kv_heads=8, name="A"),
    "B-short": _b("B-short", 100),
    "B-medium": _b("B-medium", 500),
    "B-long": _b("B-long", 2000),
    "B-4B": _b("B-4B", 500, heads=32),
    "B-beam14": _b("B-beam14", 500, beams=14),
}

# CLI option name -> BenchShape field and its parser.
SWEEP_FIELDS: Dict[str, Tuple[str, type]] = {
    "requests": ("requests", int),
    "beams": ("beams", int),
    "prompt": ("prompt", int),
    "tail": ("tail", int),
    "heads": ("heads", int),
    "kv-heads": ("kv_heads", int),
    "head-dim": ("head_dim", int),
    "page-size": ("page_size", int),
    "dtype": ("dtype", canonical_dtype),
    "tail-jitter": ("tail_jitter", float),
    "ancestry": ("ancestry", canonical_ancestry),
}
_FIELD_ALIASES = {k.replace("-", "_"): k for k in SWEEP_FIELDS}


def parse_sweep(text: str) -> Tuple[str, List]:
    """Parse ``"beams=14,30,96"`` into ``("beams", [14, 30, 96])`` (field name as a BenchShape field).

    Accepted keys: requests, beams, prompt, tail, heads, kv-heads, head-dim, page-size, dtype,
    tail-jitter, ancestry (``_`` and ``-`` are interchangeable in keys).
    """
    if "=" not in text:
        raise ShapeError(f"--sweep {text!r} must look like KEY=V1,V2,... (e.g. beams=14,30,96,256).")
    key, _, values = text.partition("=")
    key = key.strip().lower()
    key = _FIELD_ALIASES.get(key, key)
    if key not in SWEEP_FIELDS:
        raise ShapeError(f"--sweep key {key!r} is unknown; use one of: {', '.join(SWEEP_FIELDS)}.")
    field_name, parse = SWEEP_FIELDS[key]
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ShapeError(f"--sweep {text!r} lists no values; give at least one, e.g. {key}=14,30.")
    parsed = []
    for item in items:
        try:
            parsed.append(parse(item))
        except (ValueError, ShapeError) as exc:
            raise ShapeError(f"--sweep {key}: value {item!r} is not valid ({exc}).") from None
    if len(set(parsed)) != len(parsed):
        raise ShapeError(f"--sweep {key} lists a value twice: {items}; list each value once.")
    return field_name, parsed


def expand_sweeps(base: BenchShape, sweeps: Sequence[Tuple[str, List]]) -> List[BenchShape]:
    """The cartesian product of the sweeps applied to ``base`` (``[base]`` without sweeps).

    Each point's name is the base name plus its swept values, e.g. ``A[beams=14]``.
    """
    if not sweeps:
        return [base]
    names = [f for f, _ in sweeps]
    if len(set(names)) != len(names):
        raise ShapeError(f"--sweep names a field twice ({names}); combine the values in one --sweep.")
    points = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        changes = dict(zip(names, combo, strict=True))
        tag = ",".join(f"{k}={v}" for k, v in changes.items())
        points.append(replace(base, name=f"{base.name}[{tag}]", **changes))
    return points


def parse_custom_shapes(spec: str) -> List[BenchShape]:
    """The tuning tools' ``--custom``: ``"8x8x500,2x12x6000:32/4,8x8x500:16/8/64"`` -> shapes ``R x W x P``
    (requests x beams x prompt tokens) at B-medium's tail, page and dtype, and its heads (16/8, head 128)
    unless an item names its own ``:Hq/Hkv`` or ``:Hq/Hkv/D``; each named by its item.

    Raises:
        ShapeError: an item that is not ``RxWxP[:Hq/Hkv[/D]]`` of positive integers with ``Hq % Hkv == 0``.
    """
    shapes = []
    for item in (x for x in spec.split(",") if x):
        dims, _, heads = item.lower().partition(":")
        parts = dims.split("x")
        head_parts = heads.split("/") if heads else ["16", "8"]
        if (len(parts) != 3 or len(head_parts) not in (2, 3)
                or not all(x.isdigit() and int(x) > 0 for x in parts + head_parts)
                or int(head_parts[0]) % int(head_parts[1])):
            raise ShapeError(f"--custom item {item!r} is not RxWxP[:Hq/Hkv[/D]] with positive integers and Hq a "
                             f"multiple of Hkv (e.g. 8x8x500 or 2x12x6000:32/4 or 8x8x500:16/8/64)")
        r, w, prompt = (int(x) for x in parts)
        hq, hkv = int(head_parts[0]), int(head_parts[1])
        d = int(head_parts[2]) if len(head_parts) == 3 else PRESETS["B-medium"].head_dim
        shapes.append(replace(PRESETS["B-medium"], requests=r, beams=w, prompt=prompt, heads=hq, kv_heads=hkv,
                              head_dim=d, name=item))
    return shapes


def tuning_shapes(known: Sequence[BenchShape], names: str, custom: Optional[str] = None,
                  tails: Optional[str] = None) -> List[BenchShape]:
    """The shapes a tuning tool runs: those of ``known`` named in ``names`` (comma-separated), then the
    ``custom`` items (:func:`parse_custom_shapes`), each at every tail of ``tails`` (``"4,64"``; names gain
    ``-tN``) if given.

    Raises:
        ShapeError: an unknown name, a malformed item or tail, or no shape at all.
    """
    by_name = {s.name: s for s in known}
    picked = [n for n in names.split(",") if n]
    unknown = sorted(set(picked) - set(by_name))
    if unknown:
        raise ShapeError(f"unknown shapes {unknown}; choose from {list(by_name)}")
    shapes = [by_name[n] for n in picked] + parse_custom_shapes(custom or "")
    if tails:
        items = [t for t in tails.split(",") if t]
        if not all(t.isdigit() and int(t) > 0 for t in items):
            raise ShapeError(f"--tails {tails!r} must list positive integers (generated tokens per beam), e.g. 4,64")
        shapes = [replace(s, tail=int(t), name=f"{s.name}-t{t}") for s in shapes for t in items]
    if not shapes:
        raise ShapeError("no shapes: name presets with --shapes or add --custom shapes")
    return shapes


#: The CPU path's largest page (tokens): a larger page would make its 2.5-page prompts long.
CPU_MAX_PAGE_SIZE = 32


def reduced_cpu_shape(shape: BenchShape) -> BenchShape:
    """A shape small enough for the float32 CPU reference path, keeping heads, head size and dtype.

    At most 2 requests, 8 beams, pages of 32 tokens, prompts of 2.5 pages (so shared full pages and a partial
    private page both appear; at most 81 tokens) and tails of 5 tokens.
    """
    page_size = min(shape.page_size, CPU_MAX_PAGE_SIZE)
    prompt = min(shape.prompt, 2 * page_size + page_size // 2 + 1)
    reduced = replace(
        shape,
        requests=min(shape.requests, 2),
        beams=min(shape.beams, 8),
        prompt=max(1, prompt),
        tail=min(shape.tail, 5),
        page_size=page_size,
    )
    # A sweep point's tag (``B-medium[beams=96]``) keeps only the values the reduction left as swept.
    name, bracket, tag = shape.name.partition("[")
    if bracket and tag.endswith("]"):
        kept = [item for item in tag[:-1].split(",")
                if str(getattr(reduced, item.partition("=")[0], None)) == item.partition("=")[2]]
        name += f"[{','.join(kept)}]" if kept else ""
    else:
        name = shape.name
    return replace(reduced, name=f"{name}-cpu")


#: ``(Hq, Hkv, D)`` of decoder models that beam-search serving runs, one of which each sampled shape takes:
#: Qwen3-0.6B/1.7B, Qwen3-4B/8B and Llama-3.1-8B, Qwen3-14B, Llama-3.2-3B, Llama-3.2-1B, Qwen2.5-7B, Qwen2.5-1.5B,
#: Qwen2.5-0.5B, and a GPT-2-small-like MHA model (GQA groups 1-7, heads 64 and 128).
SAMPLE_HEADS: Tuple[Tuple[int, int, int], ...] = (
    (16, 8, 128), (32, 8, 128), (40, 8, 128), (24, 8, 128), (32, 8, 64), (28, 4, 128), (12, 2, 128), (14, 2, 64),
    (12, 12, 64),
)
#: Inclusive ``(low, high)`` of each sampled field, drawn log-uniformly: the issue's 14-256 beams over prompts of
#: user history, tails of a few generated tokens (semantic IDs) to a few dozen.
SAMPLE_RANGES: Dict[str, Tuple[int, int]] = {
    "requests": (1, 128),
    "beams": (14, 256),
    "prompt": (64, 8192),
    "tail": (2, 32),
}


def _decode_bytes(requests: int, beams: int, prompt: int, tail: int, kv_heads: int, head_dim: int) -> int:
    """K/V bytes one per-beam decode step reads: every beam its whole ``P + T`` tokens (2-byte elements)."""
    return requests * beams * (prompt + tail) * kv_heads * head_dim * 2 * 2


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high + 1) - 1e-9)))))


#: The most shapes ``--sample`` draws: every one is measured (and a count past this is a typo).
MAX_SAMPLE = 10_000


def sample_shapes(count: int, seed: int = 0, max_decode_bytes: float = 16e9, head_dim: Optional[int] = None,
                  **fixed) -> List[BenchShape]:
    """``count`` shapes drawn at random (``random.Random(seed)``: the same list for the same arguments).

    Requests, beams, prompt and tail are log-uniform over :data:`SAMPLE_RANGES`; the heads one of
    :data:`SAMPLE_HEADS` (those of head size ``head_dim`` where it is given: a FlashInfer JIT cache usually holds
    one head size, and each other costs minutes of compiles). A draw whose per-beam decode would read more than
    ``max_decode_bytes`` of K/V (``R * W * (P + T) * Hkv * D * 2`` elements of 2 bytes; 16e9 is about 4 ms a call
    on an H200) is drawn again, so that a sample runs in minutes. ``fixed``: other :class:`BenchShape` fields every
    shape takes (page size, dtype, ancestry, jitters). Names are ``sample<seed>.<i>``.

    Raises:
        ShapeError: ``count < 1``, ``max_decode_bytes`` too small for the smallest shape of the ranges, a
            ``head_dim`` no model of :data:`SAMPLE_HEADS` has, or a drawn field in ``fixed``.
    """
    if count < 1 or count > MAX_SAMPLE:
        raise ShapeError(f"--sample {count} must be in [1, {MAX_SAMPLE}] (each shape is a measured point).")
    models = [m for m in SAMPLE_HEADS if head_dim is None or m[2] == head_dim]
    if not models:
        raise ShapeError(f"--sample with --head-dim {head_dim}: no sampled model has it; use one of "
                         f"{sorted({m[2] for m in SAMPLE_HEADS})}.")
    drawn = set(SAMPLE_RANGES) | {"heads", "kv_heads", "head_dim", "name"}
    if drawn & set(fixed):
        raise ShapeError(f"--sample draws {', '.join(sorted(drawn & set(fixed)))}; they cannot be fixed.")
    lows = {field: low for field, (low, _) in SAMPLE_RANGES.items()}
    least = min(_decode_bytes(**lows, kv_heads=kv_heads, head_dim=size) for _, kv_heads, size in models)
    if max_decode_bytes < least:
        raise ShapeError(f"max_decode_bytes={max_decode_bytes:.3g} is below the smallest sampled shape's "
                         f"{least} bytes; raise it.")
    rng = random.Random(seed)
    shapes: List[BenchShape] = []
    while len(shapes) < count:
        draw = {k: _log_uniform_int(rng, a, b) for k, (a, b) in SAMPLE_RANGES.items()}
        heads, kv_heads, size = models[rng.randrange(len(models))]
        if _decode_bytes(**draw, kv_heads=kv_heads, head_dim=size) > max_decode_bytes:
            continue
        shapes.append(BenchShape(heads=heads, kv_heads=kv_heads, head_dim=size, name=f"sample{seed}.{len(shapes)}",
                                 **draw, **fixed))
    return shapes
