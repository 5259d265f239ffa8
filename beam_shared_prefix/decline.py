"""When the library declines a shape because the default per-beam decode would be faster.

The rule is measured, not guessed, on the H200 (64 requests, head 128, page 32, tail 4, bf16; GQA
16/8 and 32/8; ``docs/benchmarks.md``, "The decline rule"), and it depends on which path serves:

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

**The two-launch paths** (FA4 or FlashInfer prefix + tail kernel; ``decline_g2.json``,
``decline_g4.json``). What the library saves is the prompt KV that ``W - 1`` beams no longer
re-read, so the crossover follows ``(W - 1) * P``:

| (W - 1) * P | measured speedup over FlashInfer per-beam decode |
| --- | --- |
| 32 - 300 (W 2-8, P 32-100) | 0.36x - 0.79x: declined |
| 416 - 500 (W 14 P 32, W 2 P 500) | 1.09x, 0.98x: declined (no margin) |
| >= 700 | 1.12x - 10.3x: served |

So it serves a batch only when ``(W - 1) * mean prompt >= MIN_SHARED_PROMPT_TOKENS = 600``.

**Prompt length unknown** (a CUDA graph serves any prompt): beam widths below ``MIN_BEAM_WIDTH_ANY_PROMPT = 8`` are declined. At 8
beams and more the two-launch paths lost only to 32-token prompts, and the cascade lost nowhere in
either grid.

Extrapolation, stated: request count and head size were not varied. Re-run the grids for a very
different shape (``docs/benchmarks.md`` says how).

The function is pure and cheap (integer arithmetic), independent of TensorRT-LLM and of the
benchmark code. Unknown quantities are passed as ``None`` and judged as described above.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["should_decline", "cascade_min_prompt", "MIN_BEAM_WIDTH", "MIN_BEAM_WIDTH_ANY_PROMPT",
           "MIN_SHARED_PROMPT_TOKENS", "CASCADE_MIN_PROMPT"]

#: Beam search proper: with one beam nothing is shared.
MIN_BEAM_WIDTH = 2
#: With an unknown prompt length, narrower beams are left to the default kernel.
MIN_BEAM_WIDTH_ANY_PROMPT = 8
#: ``(W - 1) * mean prompt`` below this (prompt tokens saved per request) is declined.
MIN_SHARED_PROMPT_TOKENS = 600
#: With the one-launch cascade serving: ``(beam width from, smallest mean prompt served)``, by width.
CASCADE_MIN_PROMPT = ((2, 500), (3, 150), (4, 50), (6, 32))


def cascade_min_prompt(beam_width: int) -> int:
    """The smallest mean prompt (tokens) served at ``beam_width`` (>= 2) when the cascade serves."""
    return [tokens for width, tokens in CASCADE_MIN_PROMPT if width <= beam_width][-1]


def should_decline(
    num_requests: Optional[int],
    beam_width: Optional[int],
    prompt_len: Optional[float],
    num_qo_heads: Optional[int],
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
    *,
    one_launch: bool = False,
) -> Optional[str]:
    """The reason to leave this shape to the default per-beam decode, or ``None`` to serve it.

    Args:
        num_requests: ``R``, generation requests in the batch (``None``: unknown; not judged).
        beam_width: ``W``, beams per request (``None``: unknown; not judged).
        prompt_len: prompt length in tokens; for a batch, its mean (``None``: unknown, e.g. a
            CUDA graph that serves any prompt).
        num_qo_heads, num_kv_heads, head_dim: the layer's attention shape (not judged: the
            crossover scales alike for both arms).
        one_launch: whether the one-launch cascade serves the batch (its own, lower thresholds);
            ``False``: a prefix backend + the tail kernel (two launches).

    Returns:
        A one-line reason naming the measured threshold (logged by the caller), or ``None``.
    """
    if beam_width is None:
        return None
    w = int(beam_width)
    if w < MIN_BEAM_WIDTH:
        return f"beam width {w} < {MIN_BEAM_WIDTH}: no beams share a prompt"
    if prompt_len is None:
        if w < MIN_BEAM_WIDTH_ANY_PROMPT:
            return (
                f"beam width {w} < {MIN_BEAM_WIDTH_ANY_PROMPT} with the prompt length unknown (a CUDA graph): "
                f"narrow beams pay only with long prompts (measured on the H200, docs/benchmarks.md)"
            )
        return None
    saved = (w - 1) * float(prompt_len)
    if one_launch:
        # Served where the cascade measured faster, and wherever the two-launch paths are (auto picks
        # the cascade only where it beat them).
        least = cascade_min_prompt(w)
        if float(prompt_len) < least and saved < MIN_SHARED_PROMPT_TOKENS:
            return (
                f"mean prompt {float(prompt_len):.0f} < {least} tokens at beam width {w} with the one-launch "
                f"cascade: per-beam decode is faster or within 10% here (measured on the H200, docs/benchmarks.md)"
            )
        return None
    if saved < MIN_SHARED_PROMPT_TOKENS:
        return (
            f"(beam width {w} - 1) x prompt {float(prompt_len):.0f} = {saved:.0f} shared prompt tokens < "
            f"{MIN_SHARED_PROMPT_TOKENS}: per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
        )
    return None
