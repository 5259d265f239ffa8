"""When the library declines a shape because the default per-beam decode would be faster.

The rule is measured, not guessed: ``docs/results/h200/decline_g2.json`` holds the H200 sweep
(64 requests, GQA 16/8, head 128, page 32, tail 4, bf16; beam widths 2/4/8/14/30 x prompts of
32/100/500/2000 tokens; ``beam-shared-prefix-bench --preset B-medium --sweep beams=2,4,8,14,30
--sweep prompt=32,100,500,2000 --arms fa4,decode``) and ``docs/benchmarks.md`` its table. What the
library saves is the prompt KV that ``W - 1`` beams no longer re-read, so the measured crossover
follows ``(W - 1) * P``, the prompt tokens saved per request:

| (W - 1) * P | measured speedup over FlashInfer per-beam decode |
| --- | --- |
| 32 - 300 (W 2-8, P 32-100) | 0.36x - 0.79x: declined |
| 416 - 500 (W 14 P 32, W 2 P 500) | 1.09x, 0.98x: declined (no margin) |
| >= 700 | 1.12x - 10.3x: served |

So the rule serves a batch only when ``(W - 1) * mean prompt >= MIN_SHARED_PROMPT_TOKENS = 600``.
When the prompt length is unknown (a CUDA graph serves any prompt; TensorRT-LLM's selection cache
key holds no prompt length), beam widths below ``MIN_BEAM_WIDTH_ANY_PROMPT = 8`` are declined: at
8 beams and more the library lost only to 32-token prompts in the sweep, and at 14 and more never.

The same grid at GQA 32/8 (``docs/results/h200/decline_g4.json``) agrees: every point the rule
serves was at least 12% faster. Extrapolation, stated: request count and head size were not varied.
Re-run the sweep for a very different shape (``docs/benchmarks.md`` says how).

The function is pure and cheap (integer arithmetic), independent of TensorRT-LLM and of the
benchmark code. Unknown quantities are passed as ``None`` and judged as described above.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["should_decline", "MIN_BEAM_WIDTH", "MIN_BEAM_WIDTH_ANY_PROMPT", "MIN_SHARED_PROMPT_TOKENS"]

#: Beam search proper: with one beam nothing is shared.
MIN_BEAM_WIDTH = 2
#: With an unknown prompt length, narrower beams are left to the default kernel.
MIN_BEAM_WIDTH_ANY_PROMPT = 8
#: ``(W - 1) * mean prompt`` below this (prompt tokens saved per request) is declined.
MIN_SHARED_PROMPT_TOKENS = 600


def should_decline(
    num_requests: Optional[int],
    beam_width: Optional[int],
    prompt_len: Optional[float],
    num_qo_heads: Optional[int],
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
) -> Optional[str]:
    """The reason to leave this shape to the default per-beam decode, or ``None`` to serve it.

    Args:
        num_requests: ``R``, generation requests in the batch (``None``: unknown; not judged).
        beam_width: ``W``, beams per request (``None``: unknown; not judged).
        prompt_len: prompt length in tokens; for a batch, its mean (``None``: unknown, e.g. a
            CUDA graph that serves any prompt).
        num_qo_heads, num_kv_heads, head_dim: the layer's attention shape (not judged: the
            crossover scales alike for both arms).

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
                f"beam width {w} < {MIN_BEAM_WIDTH_ANY_PROMPT} with the prompt length unknown (CUDA graph or "
                f"selection): narrow beams pay only with long prompts (measured on the H200, docs/benchmarks.md)"
            )
        return None
    saved = (w - 1) * float(prompt_len)
    if saved < MIN_SHARED_PROMPT_TOKENS:
        return (
            f"(beam width {w} - 1) x prompt {float(prompt_len):.0f} = {saved:.0f} shared prompt tokens < "
            f"{MIN_SHARED_PROMPT_TOKENS}: per-beam decode is faster here (measured on the H200, docs/benchmarks.md)"
        )
    return None
