"""Prefix backends: each request's prompt attended once for all of its beams, output + LSE for the merge.

- :mod:`.base`: the :class:`PrefixBackend` interface and the :class:`LseDescriptor` hand-over.
- :mod:`.reference`: torch, any device (the CPU path).
- :mod:`.flashinfer`: FlashInfer's batch prefill wrapper (fa2/fa3), the default GPU path.
- :mod:`.fa4`: flash-attn-4's CuTe-DSL paged forward on Hopper.
- :mod:`.triton`: the library's own Triton cascade kernel, which also runs the whole step in one launch.
- :mod:`.select`: the ``backend="auto"`` rule and the decline/fallback chain.

Nothing here imports ``flashinfer`` or ``flash_attn`` at import time; backends import them lazily.
"""

from .base import LseDescriptor, PrefixBackend, PrefixBackendError, PrefixProblem, ensure_not_capturing
from .fa4 import FA4PrefixBackend
from .flashinfer import FlashInferPrefixBackend, choose_flashinfer_kernel, prefill_float_workspace_bytes
from .reference import ReferencePrefixBackend
from .triton import TritonPrefixBackend
from .select import BACKEND_CLASSES, choose_prefix_backend, resolve_prefix_backend

__all__ = [
    "BACKEND_CLASSES",
    "FA4PrefixBackend",
    "FlashInferPrefixBackend",
    "LseDescriptor",
    "PrefixBackend",
    "PrefixBackendError",
    "PrefixProblem",
    "ReferencePrefixBackend",
    "TritonPrefixBackend",
    "choose_flashinfer_kernel",
    "choose_prefix_backend",
    "ensure_not_capturing",
    "prefill_float_workspace_bytes",
    "resolve_prefix_backend",
]
