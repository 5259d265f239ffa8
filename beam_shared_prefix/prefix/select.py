"""Which prefix backend serves a shape: the ``backend="auto"`` rule and the decline/fallback chain.

Rule of ``"auto"`` (:func:`choose_prefix_backend`), in order:

1. not a CUDA device: ``reference`` (the torch path, the library's CPU path);
2. ``triton`` (the one-launch cascade kernel) when the batch's prompts are short enough and its
   GQA group small enough that it measured faster than the two-launch paths on the H200
   (:func:`cascade_preferred`; it also needs :meth:`TritonPrefixBackend.is_available`);
3. ``fa4`` when :meth:`FA4PrefixBackend.is_available` accepts the shape (SM90/SM100, bf16, head size
   64/128, page size other than 128, ``flash_attn.cute`` importable): measured on the H200 at
   128 requests x 96 beams x 3,000-token prompts (GQA 16/8, head 128, page 32), FA4's prefix took
   0.86 ms against FlashInfer's 1.27 ms;
4. ``flashinfer`` when importable and the shape is supported (bf16/fp16, head size 64/128/256);
5. ``reference``, with a warning: correct everywhere, slow on a GPU.

An explicit ``"fa4"`` that declines falls back to ``"flashinfer"`` (the decline is logged with its
reason); an explicit ``"flashinfer"`` or a declined ``"fa4"`` with no FlashInfer raises, since the
caller asked for a fast GPU path.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Type

import torch

from .base import PrefixBackend, PrefixBackendError, logger
from .fa4 import FA4PrefixBackend
from .flashinfer import FlashInferPrefixBackend
from .reference import ReferencePrefixBackend
from .triton import TritonPrefixBackend

__all__ = ["BACKEND_CLASSES", "cascade_preferred", "choose_prefix_backend", "resolve_prefix_backend",
           "CASCADE_MAX_MEAN_PROMPT", "CASCADE_MAX_GROUP"]

# Where the one-launch cascade beat FA4 + the tail kernel on the H200 (64 x 30 beams, GQA 16/8, head
# 128, page 32, tail 4; docs/benchmarks.md, "The one-launch cascade"): 15% faster at 250-token
# prompts, 7% at 500, 6% slower at 1,000 and 15% at 2,000; at G = 4 (B-4B) 38% slower. The
# threshold sits between the measured win and loss, nearer the win.
CASCADE_MAX_MEAN_PROMPT = 640
CASCADE_MAX_GROUP = 2

BACKEND_CLASSES: Dict[str, Type[PrefixBackend]] = {
    "reference": ReferencePrefixBackend,
    "flashinfer": FlashInferPrefixBackend,
    "fa4": FA4PrefixBackend,
    "triton": TritonPrefixBackend,
}


def cascade_preferred(mean_prompt_len: Optional[float], num_qo_heads: int, num_kv_heads: int) -> Tuple[bool, str]:
    """Whether ``auto`` picks the one-launch cascade for a batch: ``(True, "")`` or ``(False, reason)``.

    ``mean_prompt_len`` is the batch's mean prompt length in tokens (``None``: unknown, not preferred).
    """
    group = num_qo_heads // max(num_kv_heads, 1)
    if group > CASCADE_MAX_GROUP:
        return False, f"GQA group {group} > {CASCADE_MAX_GROUP} (measured slower than FA4 + tail there)"
    if mean_prompt_len is None:
        return False, "prompt lengths unknown"
    if mean_prompt_len > CASCADE_MAX_MEAN_PROMPT:
        return False, (f"mean prompt {mean_prompt_len:.0f} tokens > {CASCADE_MAX_MEAN_PROMPT} (measured slower than "
                       f"FA4 + tail there)")
    return True, ""


def choose_prefix_backend(
    device,
    dtype: torch.dtype,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_layout: str = "HND",
    mean_prompt_len: Optional[float] = None,
) -> Tuple[str, List[str]]:
    """The ``backend="auto"`` choice for a shape: ``(name, [reasons the faster backends declined])``.

    ``mean_prompt_len`` (tokens, the batch's mean) lets the rule pick the one-launch cascade.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "reference", [f"device {device} is not CUDA: the torch reference path serves it"]
    declined = []
    preferred, why = cascade_preferred(mean_prompt_len, num_qo_heads, num_kv_heads)
    candidates = ("triton", "fa4", "flashinfer") if preferred else ("fa4", "flashinfer")
    if not preferred:
        declined.append(f"triton: {why}")
    for name in candidates:
        ok, reason = BACKEND_CLASSES[name].is_available(
            device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size, kv_layout
        )
        if ok:
            return name, declined
        declined.append(f"{name}: {reason}")
    return "reference", declined


def resolve_prefix_backend(
    requested: str,
    device,
    dtype: torch.dtype,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_layout: str = "HND",
    mean_prompt_len: Optional[float] = None,
) -> str:
    """The backend that will run for ``requested`` (``auto``/``triton``/``fa4``/``flashinfer``/``reference``).

    ``mean_prompt_len``: the batch's mean prompt length (tokens), for the ``auto`` rule.

    Declines are logged on the ``beam_shared_prefix`` logger with their reason.

    Raises:
        PrefixBackendError: ``flashinfer`` (or ``fa4`` falling back to it) unavailable, or an unknown name.
    """
    if requested == "auto":
        name, declined = choose_prefix_backend(device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size,
                                               kv_layout, mean_prompt_len)
        for reason in declined:
            logger.info("beam_shared_prefix: backend=auto declined %s", reason)
        if name == "reference" and torch.device(device).type == "cuda":
            logger.warning("beam_shared_prefix: no fast prefix backend is available on %s; the torch reference "
                           "backend runs (correct, slow). Install flashinfer-python==0.7.4.", device)
        return name
    if requested not in BACKEND_CLASSES:
        raise PrefixBackendError(f"backend={requested!r} is not one of auto, {', '.join(BACKEND_CLASSES)}.")
    if requested == "reference":
        ok, reason = ReferencePrefixBackend.is_available(device, dtype, head_dim, num_qo_heads, num_kv_heads,
                                                          page_size, kv_layout)
        if not ok:
            raise PrefixBackendError(f"backend='reference' cannot serve this shape: {reason}.")
        return "reference"
    chain = [requested, "flashinfer"] if requested in ("fa4", "triton") else ["flashinfer"]
    reasons = []
    for name in chain:
        ok, reason = BACKEND_CLASSES[name].is_available(device, dtype, head_dim, num_qo_heads, num_kv_heads,
                                                         page_size, kv_layout)
        if ok:
            if name != requested:
                logger.warning("beam_shared_prefix: backend=%r declined (%s); the %s backend runs instead.",
                               requested, reasons[-1], name)
            return name
        reasons.append(reason)
    raise PrefixBackendError(
        f"backend={requested!r} cannot serve this shape on {device}: "
        + "; ".join(f"{n}: {r}" for n, r in zip(chain, reasons, strict=True))
        + ". Install the missing package, or pass backend='auto' (falls back to the torch reference) or "
          "backend='reference'."
    )
