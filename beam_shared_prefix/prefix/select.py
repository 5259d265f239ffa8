"""Which prefix backend serves a shape: the ``backend="auto"`` rule and the decline/fallback chain.

Rule of ``"auto"`` (:func:`choose_prefix_backend`), in order:

1. not a CUDA device: ``reference`` (the torch path, the library's CPU path);
2. ``flashinfer`` when the batch has so few requests that the cascade would run few programs for
   its prompt length, where FlashInfer's prefill, which splits each prompt over many CTAs, measured
   faster than the cascade and FA4 (:func:`~.split_kv_rule.split_kv_preferred`; GQA 1-4 at head 128
   and head 64, GQA 5-8 at head 128);
3. ``triton`` (the one-launch cascade kernel) when the batch's prompts are short enough for its
   beam width, GQA group and (with few requests) program count that it measured faster than the
   two-launch paths on the H200, and its tail is shorter than
   :data:`~.cascade_rule.SHARED_RUN_MIN_TAIL` where the shared-run stage may run
   (:func:`~.cascade_rule.cascade_preferred`; it also needs :meth:`TritonPrefixBackend.is_available`);
4. ``fa4`` when :meth:`FA4PrefixBackend.is_available` accepts the shape (SM90/SM100, bf16, head size
   64/128, page size other than 128, ``flash_attn.cute`` importable): measured on the H200 at
   128 requests x 96 beams x 3,000-token prompts (GQA 16/8, head 128, page 32), FA4's prefix took
   0.86 ms against FlashInfer's 1.27 ms;
5. ``flashinfer`` when importable and the shape is supported (bf16/fp16, head size 64/128/256);
6. ``reference``, with a warning: correct everywhere, slow on a GPU.

An explicit ``"fa4"`` that declines falls back to ``"flashinfer"`` (the decline is logged with its
reason); an explicit ``"flashinfer"`` or a declined ``"fa4"`` with no FlashInfer raises, since the
caller asked for a fast GPU path.

The rules live in their own modules: :mod:`.cascade_rule` (where the one-launch cascade beats the two-launch paths),
:mod:`.split_kv_rule` (where FlashInfer's split prompt wins at few requests) and :mod:`.waves` (the launch and wave
geometry they count). This module keeps the backend registry (:data:`BACKEND_CLASSES`), what serves a batch under each
setting (:func:`cascade_serves`, :func:`step_path`) and the choice (:func:`choose_prefix_backend`,
:func:`resolve_prefix_backend`), and re-exports the rules' public names; the rules read their own modules' names, so
a test patches a name where it is defined.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Type

import torch

from . import cascade_rule, split_kv_rule, waves
from .base import PrefixBackend, PrefixBackendError, logger
from .cascade_rule import *
from .cascade_rule import cascade_preferred
from .fa4 import FA4PrefixBackend, whole_page_reason
from .flashinfer import FLASHINFER_FLOOR, FlashInferPrefixBackend
from .reference import ReferencePrefixBackend
from .split_kv_rule import *
from .split_kv_rule import flashinfer_serves, split_kv_preferred
from .triton import TritonPrefixBackend
from .waves import *

__all__ = ["BACKEND_CLASSES", "cascade_serves", "choose_prefix_backend", "resolve_prefix_backend", "step_path"]
__all__ += cascade_rule.__all__
__all__ += split_kv_rule.__all__
__all__ += waves.__all__

BACKEND_CLASSES: Dict[str, Type[PrefixBackend]] = {
    "reference": ReferencePrefixBackend,
    "flashinfer": FlashInferPrefixBackend,
    "fa4": FA4PrefixBackend,
    "triton": TritonPrefixBackend,
}


def cascade_serves(
    requested: str,
    mean_prompt_len: Optional[float],
    num_qo_heads: int,
    num_kv_heads: int,
    beam_width: Optional[int],
    head_dim: int,
    num_requests: Optional[int] = None,
    tail_len: Optional[float] = None,
    shared_run: bool = True,
    eager: bool = False,
    tail_bound: int | None = None,
) -> bool:
    """Whether the one-launch cascade would serve a CUDA batch under the ``requested`` backend setting:
    ``"triton"`` where the kernel tiles the shape, ``"auto"`` where :func:`cascade_preferred` picks it
    (``tail_len``, ``shared_run``, ``eager`` and ``tail_bound`` as there) and :func:`split_kv_preferred` (``num_requests``: the
    batch's, ``None`` unknown) does not.
    (The decline rule's thresholds differ for it and for the two-launch paths.)"""
    if requested == "triton":
        try:
            from triton_kernels.cascade import cascade_supported  # deferred: triton is imported on first use
        except ImportError:  # pragma: no cover - triton is a dependency
            return False
        return cascade_supported(num_qo_heads // max(num_kv_heads, 1), head_dim)[0]
    if requested == "auto":
        if split_kv_preferred(num_requests=num_requests, mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim, eager=eager)[0]:
            return False
        return cascade_preferred(mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                 beam_width=beam_width, head_dim=head_dim, num_requests=num_requests,
                                 tail_len=tail_len, shared_run=shared_run, eager=eager, tail_bound=tail_bound)[0]
    return False


def _installed(name: str) -> bool:
    """Whether a prefix backend's package imports here (FlashInfer, FA4; the others always do)."""
    if name == "flashinfer":
        from .flashinfer import _import_flashinfer

        return _import_flashinfer() is not None
    if name == "fa4":
        from .fa4 import _import_fa4_forward

        return _import_fa4_forward() is not None
    return True


def step_path(
    requested: str,
    num_requests: Optional[int],
    mean_prompt_len: Optional[float],
    num_qo_heads: int,
    num_kv_heads: int,
    beam_width: Optional[int],
    head_dim: int,
    tail_len: Optional[float] = None,
    shared_run: bool = True,
    eager: bool = False,
    tail_bound: int | None = None,
) -> Tuple[bool, bool]:
    """``(split_kv, one_launch)``: whether FlashInfer's split prompt, or the one-launch cascade, serves a
    CUDA batch under ``requested``, with the packages installed here (what the per-step decline rule
    must judge); ``tail_len``, ``shared_run``, ``eager`` and ``tail_bound`` as for :func:`cascade_preferred`. Unlike
    :func:`flashinfer_serves` and :func:`cascade_serves`, which model a machine with every backend installed, a
    missing FlashInfer sends ``auto``'s few-request batches to the cascade or FA4, and a missing FA4 sends
    ``fa4`` to FlashInfer."""
    if requested == "fa4" and not _installed("fa4"):
        requested = "flashinfer"
    if requested == "auto" and not _installed("flashinfer"):
        preferred = cascade_preferred(mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                                      num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim,
                                      num_requests=num_requests, tail_len=tail_len, shared_run=shared_run,
                                      eager=eager, tail_bound=tail_bound)[0]
        return False, preferred
    split_kv = flashinfer_serves(requested, num_requests=num_requests, mean_prompt_len=mean_prompt_len,
                                 num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, beam_width=beam_width,
                                 head_dim=head_dim, eager=eager)
    one_launch = not split_kv and cascade_serves(requested, mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                                                 num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim,
                                                 num_requests=num_requests, tail_len=tail_len, shared_run=shared_run,
                                                 eager=eager, tail_bound=tail_bound)
    return split_kv, one_launch


def _backend_serves(name: str, device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size, kv_layout,
                    beam_width: Optional[int]) -> Tuple[bool, str]:
    """``BACKEND_CLASSES[name].is_available``, and for FA4 also the beam width's part (one beam picks a decode
    kernel that loads whole pages on SM100: :func:`~.fa4.whole_page_reason`)."""
    ok, reason = BACKEND_CLASSES[name].is_available(device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size,
                                                    kv_layout)
    if ok and name == "fa4":
        reason = whole_page_reason(device, page_size, beam_width) or ""
        ok = not reason
    return ok, reason


def choose_prefix_backend(
    device,
    dtype: torch.dtype,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_layout: str = "HND",
    mean_prompt_len: Optional[float] = None,
    beam_width: Optional[int] = None,
    num_requests: Optional[int] = None,
    tail_len: Optional[float] = None,
    shared_run: bool = True,
    eager: bool = False,
    tail_bound: int | None = None,
) -> Tuple[str, List[str]]:
    """The ``backend="auto"`` choice for a shape: ``(name, [reasons the faster backends declined])``.

    ``mean_prompt_len`` (tokens, the batch's mean), ``beam_width`` and ``num_requests`` let the rule
    pick FlashInfer's split prompt for few requests (:func:`split_kv_preferred`) or the one-launch
    cascade (:func:`cascade_preferred`, with ``tail_len``: the step's longest tail, ``None`` where unknown,
    ``shared_run``: whether the shared-run stage may run, ``eager``: whether the calls run without a
    CUDA graph, and ``tail_bound``: the bound on every tail the cascade's launch is given, ``None`` as there).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "reference", [f"device {device} is not CUDA: the torch reference path serves it"]
    declined = []
    split, split_why = split_kv_preferred(num_requests=num_requests, mean_prompt_len=mean_prompt_len,
                                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, beam_width=beam_width,
                                          head_dim=head_dim, eager=eager)
    preferred, why = cascade_preferred(mean_prompt_len=mean_prompt_len, num_qo_heads=num_qo_heads,
                                       num_kv_heads=num_kv_heads, beam_width=beam_width, head_dim=head_dim,
                                       num_requests=num_requests, tail_len=tail_len, shared_run=shared_run,
                                       eager=eager, tail_bound=tail_bound)
    candidates = ("triton", "fa4", "flashinfer") if preferred else ("fa4", "flashinfer")
    if split:
        candidates = ("flashinfer",) + candidates[:-1]
        declined.append(f"triton and fa4: {split_why}")
    elif not preferred:
        declined.append(f"triton: {why}")
    for name in candidates:
        ok, reason = _backend_serves(name, device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size, kv_layout,
                                     beam_width)
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
    beam_width: Optional[int] = None,
    num_requests: Optional[int] = None,
    tail_len: Optional[float] = None,
    shared_run: bool = True,
    eager: bool = False,
    tail_bound: int | None = None,
) -> str:
    """The backend that will run for ``requested`` (``auto``/``triton``/``fa4``/``flashinfer``/``reference``).

    ``mean_prompt_len``: the batch's mean prompt length (tokens), ``beam_width``, ``num_requests`` and
    ``tail_len`` (the step's longest tail, ``None`` where unknown), ``shared_run`` (whether the
    shared-run stage may run), ``eager`` (whether the calls run without a CUDA graph) and ``tail_bound`` (the
    bound on every tail the cascade's launch is given; see :func:`cascade_preferred`), for the ``auto`` rule.

    Declines are logged on the ``beam_shared_prefix`` logger with their reason.

    Raises:
        PrefixBackendError: ``flashinfer`` (or ``fa4`` falling back to it) unavailable, or an unknown name.
    """
    if requested == "auto":
        name, declined = choose_prefix_backend(device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size,
                                               kv_layout, mean_prompt_len=mean_prompt_len, beam_width=beam_width,
                                               num_requests=num_requests, tail_len=tail_len, shared_run=shared_run,
                                               eager=eager, tail_bound=tail_bound)
        for reason in declined:
            logger.info("beam_shared_prefix: backend=auto declined %s", reason)
        if name == "reference" and torch.device(device).type == "cuda":
            logger.warning("beam_shared_prefix: no fast prefix backend is available on %s; the torch reference "
                           "backend runs (correct, slow). Install flashinfer-python>=%s.", device, FLASHINFER_FLOOR)
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
        ok, reason = _backend_serves(name, device, dtype, head_dim, num_qo_heads, num_kv_heads, page_size, kv_layout,
                                     beam_width)
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
