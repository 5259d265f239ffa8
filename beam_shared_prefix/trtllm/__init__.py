"""TensorRT-LLM integration: the only part of the package that knows TensorRT-LLM.

Users install the package and set ``TLLM_FMHA_LIBS=+beam_shared_prefix``; the start-up hook
(``beam_shared_prefix_autoload.pth``, see :mod:`beam_shared_prefix._autoload`) registers the library
in every process that imports TensorRT-LLM's FMHA registry. :func:`register` does the same
explicitly. See ``docs/trtllm.md``.

Modules:

- ``registration``: ``FMHA_LIBS`` insertion (before ``fallback``), settings, old-registry warning.
- ``fmha``: the ``Fmha`` subclass (gates, forward, mixed batches, ``CombinedFmha`` half).
- ``gates``: layer / batch / call eligibility, each as a one-line reason.
- ``planning``: the ``TrtllmAttentionMetadata.prepare`` hook and per-metadata plans.
- ``kv_cache``: V1 and V2 KV cache manager adapters (pool views, page-number encodings).

Importing this package does not import torch or TensorRT-LLM.
"""

from .._autoload import LIB_NAME
from .registration import current_settings, register, register_into

__all__ = ["LIB_NAME", "register", "register_into", "current_settings", "stats"]


def stats() -> dict:
    """Host-side counters: generation forwards served, steps handed to ``fallback``, plans built..."""
    from . import fmha, planning

    merged = dict(planning.stats)
    merged.update(fmha.stats)
    return merged
