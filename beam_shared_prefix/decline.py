"""When the library should decline a shape because the default per-beam decode is faster.

PROVISIONAL RULE. The thresholds below are placeholders chosen to be conservative (decline
whenever in doubt); the benchmark CLI (``microbenchmarks``) measures the real crossover on the
H200 and replaces them. Until then the rule is:

- decline beam widths below :data:`MIN_BEAM_WIDTH` (the original in-tree library measured 0.88x
  of the default kernel at beam 14, so few beams rarely pay for the extra prefix launch);
- decline prompts shorter than :data:`MIN_PROMPT_LEN` tokens (the shared prefix is what the
  library saves; a short one saves little).

The function is pure and cheap (a few integer comparisons) and independent of TensorRT-LLM and of
the benchmark code, so both the engine adapter and the benchmarks can call it.

Unknown quantities are passed as ``None`` and are not judged. The TensorRT-LLM adapter relies on
this: its selection gate (cached per layer by a key that contains neither the prompt length nor
the exact request count) calls the rule with only the quantities that key keeps fixed, and the
per-step planning calls it again with the batch's real numbers (see ``docs/trtllm.md``).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["should_decline", "MIN_BEAM_WIDTH", "MIN_PROMPT_LEN"]

#: Provisional: beams below this width are served by the default decode kernel.
MIN_BEAM_WIDTH = 8
#: Provisional: batches whose (mean) prompt is shorter than this, in tokens, are declined.
MIN_PROMPT_LEN = 64


def should_decline(
    num_requests: Optional[int],
    beam_width: Optional[int],
    prompt_len: Optional[int],
    num_qo_heads: Optional[int],
    num_kv_heads: Optional[int],
    head_dim: Optional[int],
) -> Optional[str]:
    """The reason to leave this shape to the default per-beam decode, or ``None`` to serve it.

    Args:
        num_requests: ``R``, generation requests in the batch (``None``: unknown).
        beam_width: ``W``, beams per request (``None``: unknown).
        prompt_len: prompt length in tokens; for a batch, its mean prompt length
            (``None``: unknown, e.g. a CUDA graph that serves any prompt).
        num_qo_heads, num_kv_heads, head_dim: the layer's attention shape (``None``: unknown).

    Returns:
        A one-line human-readable reason (logged by the caller), or ``None``.
    """
    if beam_width is not None and int(beam_width) < MIN_BEAM_WIDTH:
        return (
            f"beam width {int(beam_width)} < {MIN_BEAM_WIDTH}: too few beams share the prompt for the "
            f"prefix pass to pay off (provisional threshold)"
        )
    if prompt_len is not None and int(prompt_len) < MIN_PROMPT_LEN:
        return (
            f"prompt length {int(prompt_len)} < {MIN_PROMPT_LEN} tokens: the shared prefix is too short "
            f"to pay for the extra launch (provisional threshold)"
        )
    return None
