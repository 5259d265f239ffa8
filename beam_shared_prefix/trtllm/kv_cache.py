"""KV cache manager adapters: pool views, page-number encodings and prompt page tables.

TensorRT-LLM hands attention a device page table in its own encoding,
``metadata.kv_cache_block_offsets[pool, seq, 0 (K) | 1 (V), block]`` (trtllm-interfaces.md, 3.6).
The library reads it directly, as ``block_offsets[pool, seq_offset:, 0, :]`` with a
``page_index_divisor`` (no per-step conversion copy); what differs between managers is the divisor
and where the host-side prompt page table comes from. One small adapter per manager:

- **V1** ``KVCacheManager`` (section 4.2): K entry = ``block * layers_in_pool * kv_factor``, so
  page = entry // (layers_in_pool * kv_factor); the host table
  ``host_kv_cache_block_offsets[pool, num_contexts + r * W, 0, :]`` (beam 0 of generation request
  ``r``) is filled by ``prepare()`` and gives the prompt pages.
- **V2** ``KVCacheManagerV2`` (section 4.3): K entry = ``base_page_index * index_scales[pool]``;
  ``get_batch_cache_indices(request_ids, layer_idx=...)`` returns beam 0's pages already in
  ``get_buffers`` units (``base * scale // kv_factor``), so the device divisor is ``kv_factor``.
  That holds when the layer's own page-index scale equals its pool's; a layer where they differ is
  declined.

Adapters, and the pool views they hold, are keyed by the manager *object* (weakly): TensorRT-LLM
replaces its manager after memory estimation (section 4.2), and a view cached from the first one
would point at freed memory. A new manager gets a new adapter; the old one dies with its manager.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..prefix.base import unaligned_16_byte_vectors

__all__ = ["LayerKV", "PageAdapter", "V1PageAdapter", "V2PageAdapter", "manager_kind", "adapter_for", "manager_decline_reason"]

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


def manager_kind(manager) -> Optional[str]:
    """``"v1"``, ``"v2"`` or ``None``, by class name along the MRO.

    Both managers expose the same attribute names (section 4.4), so only the class tells them apart;
    names rather than imports keep this working when one of the classes does not exist.
    """
    names = [c.__name__ for c in type(manager).__mro__]
    if "KVCacheManagerV2" in names:
        return "v2"
    if "KVCacheManager" in names:
        return "v1"
    return None


def manager_decline_reason(manager) -> Optional[str]:
    """Why this KV cache manager cannot host the library, or ``None``. Invariant per engine."""
    if manager is None:
        return "no KV cache manager (the library needs the paged KV cache)"
    kind = manager_kind(manager)
    if kind is None:
        return f"unsupported KV cache manager {type(manager).__name__} (needs KVCacheManager or KVCacheManagerV2)"
    if getattr(manager, "is_linear_attention", False):
        return "KV cache manager holds recurrent (linear-attention) state, not a paged K/V cache"
    kv_factor = getattr(manager, "kv_factor", None)
    if kv_factor != 2:
        return f"KV cache manager kv_factor={kv_factor} (the library needs separate K and V, kv_factor 2)"
    page_size = getattr(manager, "tokens_per_block", None)
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"tokens_per_block={page_size} is not one of {SUPPORTED_PAGE_SIZES}"
    # TrtllmAttentionMetadata sizes dim 0 of kv_cache_block_offsets by
    # getattr(manager, "num_attention_op_pools", manager.num_pools) (trtllm.py at 017aa0ca). The
    # library indexes that dim by the layer's pool (kv_cache_pool_mapping[local, 0]); a manager
    # with per-layer page tables (V2 with SWA scratch reuse, doc 4.3) breaks that.
    op_pools = getattr(manager, "num_attention_op_pools", None)
    num_pools = getattr(manager, "num_pools", None)
    if op_pools is not None and num_pools is not None and int(op_pools) != int(num_pools):
        return (
            f"KV cache manager has {op_pools} attention-op page tables for {num_pools} pools "
            "(per-layer page tables); the library addresses one page table per pool"
        )
    return None


@dataclass(frozen=True)
class LayerKV:
    """One layer's view of the paged KV cache.

    Attributes:
        pool: ``[num_pages, 2, Hkv, page_size, D]`` HND view (``get_buffers(layer, "HND")``); the
            page stride may span other layers.
        pool_index: index of the layer's pool in dim 0 of ``kv_cache_block_offsets``.
        page_index_divisor: device K entry // divisor = page number in ``pool``.
        num_pages: ``pool.shape[0]``, the exclusive bound of a page number.
        page_size: tokens per page.
        decline_reason: set when the layer's pages cannot be addressed this way.
    """

    pool: object
    pool_index: int
    page_index_divisor: int
    num_pages: int
    page_size: int
    decline_reason: Optional[str] = None


class PageAdapter:
    """Pool views and page tables of one KV cache manager (held weakly)."""

    kind = "?"

    def __init__(self, manager):
        self._manager_ref = weakref.ref(manager)
        self._layers: Dict[int, LayerKV] = {}
        self._lock = threading.Lock()
        #: Attention shape families seen on this manager (filled by the Fmha class), so that
        #: ``prepare()`` can plan every family of a fresh metadata before its first forward.
        self.families: Dict[tuple, object] = {}

    @property
    def manager(self):
        """The KV cache manager this adapter reads (held weakly); raises ``RuntimeError`` once it was released."""
        manager = self._manager_ref()
        if manager is None:
            raise RuntimeError("beam_shared_prefix: the KV cache manager of this adapter was released")
        return manager

    @staticmethod
    def _pool_reason(manager, layer_idx: int, pool_index: int, pool) -> Optional[str]:
        """Why the layer's pool cannot index the block-offset tables (dim 0: one per pool), or cannot be read in the
        prefix kernels' 16-byte vectors, or ``None``."""
        num_pools = getattr(manager, "num_pools", None)
        if num_pools is not None and not 0 <= pool_index < int(num_pools):
            return (f"kv_cache_pool_mapping gives layer {layer_idx} pool {pool_index}, outside the manager's "
                    f"{int(num_pools)} pools")
        # (TensorRT-LLM's pools always are; once per layer, so that the wrapper's per-call refusal never fires)
        unaligned = unaligned_16_byte_vectors(f"layer {layer_idx}'s KV pool view", pool)
        if unaligned:
            return f"{unaligned} (FlashInfer's and FA4's prefix kernels move 16-byte vectors)"
        return None

    def _pool_mapping(self, manager):
        mapping = getattr(manager, "kv_cache_pool_mapping", None)
        if mapping is None:
            raise RuntimeError(f"beam_shared_prefix: {type(manager).__name__} has no kv_cache_pool_mapping")
        return np.asarray(mapping.cpu().numpy() if hasattr(mapping, "cpu") else mapping)

    def _local_layer(self, manager, layer_idx: int) -> int:
        offsets = getattr(manager, "layer_offsets", None)
        if offsets is None or layer_idx not in offsets:
            raise RuntimeError(
                f"beam_shared_prefix: layer {layer_idx} is not in the KV cache manager's layer_offsets "
                f"({sorted(offsets) if offsets else offsets}); is this layer's cache on another manager?"
            )
        return int(offsets[layer_idx])

    def layer(self, layer_idx: int) -> LayerKV:
        """The cached :class:`LayerKV` of global layer ``layer_idx``."""
        view = self._layers.get(layer_idx)
        if view is None:
            with self._lock:
                view = self._layers.get(layer_idx)
                if view is None:
                    view = self._build_layer(layer_idx)
                    self._layers[layer_idx] = view
        return view

    def _build_layer(self, layer_idx: int) -> LayerKV:
        raise NotImplementedError

    def prompt_pages(
        self,
        metadata,
        layer: LayerKV,
        layer_idx: int,
        request_ids: Sequence[int],
        pages_per_request: np.ndarray,
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Beam 0's first ``pages_per_request[r]`` page numbers of each generation request.

        Returns ``(indptr [R + 1], indices [indptr[-1]])`` int64 numpy, page numbers in ``layer.pool``.
        """
        raise NotImplementedError


def _indptr(pages_per_request: np.ndarray) -> np.ndarray:
    indptr = np.zeros(pages_per_request.shape[0] + 1, dtype=np.int64)
    np.cumsum(pages_per_request, out=indptr[1:])
    return indptr


class V1PageAdapter(PageAdapter):
    """``KVCacheManager`` (V1): block offsets ``block * layers_in_pool * kv_factor`` (section 4.2)."""

    kind = "v1"

    def _build_layer(self, layer_idx: int) -> LayerKV:
        manager = self.manager
        local = self._local_layer(manager, layer_idx)
        mapping = self._pool_mapping(manager)
        pool_index = int(mapping[local, 0])
        layers_in_pool = int((mapping[:, 0] == pool_index).sum())
        kv_factor = int(manager.kv_factor)
        pool = manager.get_buffers(layer_idx, kv_layout="HND")
        return LayerKV(
            pool=pool,
            pool_index=pool_index,
            page_index_divisor=layers_in_pool * kv_factor,
            num_pages=int(pool.shape[0]),
            page_size=int(manager.tokens_per_block),
            decline_reason=self._pool_reason(manager, layer_idx, pool_index, pool),
        )

    def prompt_pages(self, metadata, layer, layer_idx, request_ids, pages_per_request):
        host = getattr(metadata, "host_kv_cache_block_offsets", None)
        if host is None:
            host = self.manager.host_kv_cache_block_offsets
        beam_width = int(metadata.beam_width)
        num_contexts = int(metadata.num_contexts)
        num_requests = pages_per_request.shape[0]
        width = int(pages_per_request.max()) if num_requests else 0
        rows = num_contexts + np.arange(num_requests, dtype=np.int64) * beam_width
        # One fancy-index copy of [R, width] K entries; `host` is valid for this step after prepare().
        k_entries = host[layer.pool_index, :, 0, :width].numpy()[rows].astype(np.int64, copy=False)
        keep = np.arange(width)[None, :] < pages_per_request[:, None]
        indices = k_entries[keep] // layer.page_index_divisor
        return _indptr(pages_per_request), indices


class V2PageAdapter(PageAdapter):
    """``KVCacheManagerV2``: K entry ``base_page_index * index_scales[pool]`` (section 4.3)."""

    kind = "v2"

    def _build_layer(self, layer_idx: int) -> LayerKV:
        manager = self.manager
        local = self._local_layer(manager, layer_idx)
        mapping = self._pool_mapping(manager)
        pool_index = int(mapping[local, 0])
        kv_factor = int(manager.kv_factor)
        pool = manager.get_buffers(layer_idx, kv_layout="HND")
        reason = self._pool_reason(manager, layer_idx, pool_index, pool)
        layer_scale = getattr(manager, "get_layer_page_index_scale", None)
        pool_scales = getattr(manager, "index_scales", None)
        if reason is None and layer_scale is not None and pool_scales is not None:
            ls, ps = int(layer_scale(layer_idx)), int(pool_scales[pool_index])
            if ls != ps:
                reason = (
                    f"KV cache manager V2: layer {layer_idx} has page-index scale {ls} but its pool {pool_index} "
                    f"encodes block offsets with scale {ps}; its device page table is not in page units"
                )
        return LayerKV(
            pool=pool,
            pool_index=pool_index,
            page_index_divisor=kv_factor,
            num_pages=int(pool.shape[0]),
            page_size=int(manager.tokens_per_block),
            decline_reason=reason,
        )

    def prompt_pages(self, metadata, layer, layer_idx, request_ids, pages_per_request):
        # Positional: the keyword is `layer_idx` in kv_cache/kv_cache_manager_v2.py [00043967] but
        # `layer_id` in the older V2 of resource_manager.py [001541ba]; both take the global index.
        lists = self.manager.get_batch_cache_indices(list(request_ids), layer_idx)
        if len(lists) != len(request_ids):
            raise RuntimeError(
                f"beam_shared_prefix: get_batch_cache_indices returned {len(lists)} page lists for "
                f"{len(request_ids)} requests"
            )
        chunks = []
        for r, pages in enumerate(lists):
            n = int(pages_per_request[r])
            if len(pages) < n:
                raise RuntimeError(
                    f"beam_shared_prefix: request {request_ids[r]} has {len(pages)} KV pages but its prompt needs {n}"
                )
            chunks.append(np.asarray(pages[:n], dtype=np.int64))
        indices = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return _indptr(pages_per_request), indices


_adapters: Dict[int, Tuple[weakref.ref, PageAdapter]] = {}
# Re-entrant: a garbage-collection pass inside the locked region can run `_drop` of a freed manager
# on this thread.
_adapters_lock = threading.RLock()


def adapter_for(manager) -> PageAdapter:
    """The adapter of this manager object (created on first use, dropped with the manager)."""
    key = id(manager)
    entry = _adapters.get(key)
    if entry is not None and entry[0]() is manager:
        return entry[1]
    reason = manager_decline_reason(manager)
    if reason is not None:
        raise RuntimeError(f"beam_shared_prefix: {reason}")
    with _adapters_lock:
        entry = _adapters.get(key)
        if entry is not None and entry[0]() is manager:
            return entry[1]
        adapter = V2PageAdapter(manager) if manager_kind(manager) == "v2" else V1PageAdapter(manager)

        def _drop(ref, key=key):
            with _adapters_lock:
                current = _adapters.get(key)
                if current is not None and current[0] is ref:
                    del _adapters[key]

        _adapters[key] = (weakref.ref(manager, _drop), adapter)
        return adapter
