"""A MODEL of TensorRT-LLM's FMHA plugin interfaces for CPU tests. It is NOT TensorRT-LLM.

Nothing here comes from TensorRT-LLM's code. It is a small re-statement, in plain Python, of the
facts in ``../shared/docs/trtllm-interfaces.md`` (the "doc"; section numbers in the comments), so
that the library's TensorRT-LLM adapter can be tested on a machine where TensorRT-LLM cannot be
installed. Where the model simplifies, it says so. Tests that run against a real ``tensorrt_llm``
live in ``test_real_trtllm.py`` and ``test_e2e_qwen3.py``.

What is modelled, under the real module names (installed into ``sys.modules`` through a finder for
the duration of one test, so that importing them goes through the import system exactly like the
real package, and the library's post-import hook sees them):

- both source layouts (doc 0.1): ``tensorrt_llm._torch.attention.backends`` (new) and
  ``tensorrt_llm._torch.attention_backend`` (old), each with ``interface``, ``trtllm`` and an
  ``fmha`` package (``interface``, ``phased``, ``combined``, ``fallback``, ``flashinfer_trtllm_gen``,
  ``triton_custom_mask``, ``prims_ts``, ``manager``, ``registry``);
- the registry (1.1-1.3) with either ``+`` semantics: ``canonical`` (new layout: delta entries
  emitted in ``FMHA_LIBS`` order) or ``append`` (old layout: ``+name`` appended after ``fallback``);
- ``Fmha`` / ``PhasedFmha`` / ``CombinedFmha`` / ``FmhaManager`` (2.1-2.5): the shared
  ``is_available``/``is_supported`` wrappers, ``PhasedFmha.forward`` splitting phases, the manager's
  phase-less-then-phased selection and its selection cache keyed like 2.4 (with
  ``TRTLLM_FMHA_CACHE_SANITY_CHECK=1`` re-running selection on cache hits);
- ``FmhaParams`` in two variants (0.2): ``"interface"`` (b: ``qkv_or_q``, ``output``, ``meta``,
  ``fwd``, ``attn``) and ``"phased"`` (a: ``qkv_input``, ``context_buf``, ``meta``, ``fwd``, ``attn``);
- the selection API with ``_is_available``/``_is_supported`` hooks (``hooks="final"``) or without them
  (``hooks="plain"``), as in the upstream files listed in ``docs/trtllm.md`` ("Verified against");
- ``FallbackFmha`` (2.6) whose kernels are modelled by dense float32 math: the context phase does
  causal attention over each context request and writes its K/V through the block offsets; the
  generation phase writes the token's K/V at ``kv_len - 1`` and attends every beam's whole history
  through ``cache_indirection`` (the per-beam MMHA decode of 7.2, via the project's oracle);
- ``flashinfer_trtllm_gen`` (7.1): available only when the model says "SM100"; it takes the
  CONTEXT phase and declines beam-search generation;
- ``TrtllmAttentionMetadata`` (3): dataclass fields, ``prepare()`` in the documented order (lengths,
  ``copy_batch_block_offsets``, runtime views), ``create_cuda_graph_metadata`` as a shallow copy
  that re-runs ``__post_init__`` (3.1);
- ``TrtllmAttention`` (2.7): layer attributes, ``update_quant_config`` building the manager (or, in
  the older manager-less tree, the layer's own ``fmha_libs``), ``forward`` allocating the output and
  selecting a library;
- KV cache managers V1 (4.2) and V2 (4.3) on top of
  :class:`beam_shared_prefix.testing.BeamSearchCacheSimulator`: block-offset encodings, a multi-layer
  pool whose per-layer ``get_buffers`` view is strided, context-request allocation. Simplification:
  the model's V2 accepts beam search (the doc found V2 asserting beam width 1 in the versions it
  read; the design targets a V2 that serves beam search).
"""

from __future__ import annotations

import bisect
import copy
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

from beam_shared_prefix.reference import reference_beam_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator

NEW_ROOT = "tensorrt_llm._torch.attention.backends"
OLD_ROOT = "tensorrt_llm._torch.attention_backend"
ROOTS = {"new": NEW_ROOT, "old": OLD_ROOT}
REGISTRY = {layout: root + ".fmha.registry" for layout, root in ROOTS.items()}


# ==================================================================================================
# Shared enums (tensorrt_llm.functional, tensorrt_llm.quantization.mode) - model versions


class PositionEmbeddingType(enum.IntEnum):
    learned_absolute = 0
    rope_gptj = 1
    rope_gpt_neox = 2
    long_rope = 3
    alibi = 4
    alibi_with_scale = 5
    relative = 6
    chatglm = 7
    yarn = 8
    mrope = 9
    deferred = 10  # K cached before an external embedder applies it

    def is_rope(self) -> bool:
        # Upstream's is_rope() leaves out yarn, chatglm and deferred, which the backend applies too.
        return self in (PositionEmbeddingType.rope_gptj, PositionEmbeddingType.rope_gpt_neox,
                        PositionEmbeddingType.long_rope, PositionEmbeddingType.mrope)


class AttentionMaskType(enum.IntEnum):
    padding = 0
    causal = 1
    sliding_window_causal = 2
    bidirectional = 3
    custom_mask = 6


class QuantMode(enum.IntFlag):
    NONE = 0
    INT8_KV_CACHE = 1 << 0
    FP8_KV_CACHE = 1 << 1
    FP4_KV_CACHE = 1 << 2

    def has_kv_cache_quant(self) -> bool:
        return bool(self & (QuantMode.INT8_KV_CACHE | QuantMode.FP8_KV_CACHE | QuantMode.FP4_KV_CACHE))

    def has_fp8_kv_cache(self) -> bool:
        return bool(self & QuantMode.FP8_KV_CACHE)

    def has_fp4_kv_cache(self) -> bool:
        return bool(self & QuantMode.FP4_KV_CACHE)


# ==================================================================================================
# Model configuration and the import machinery


@dataclass
class ModelConfig:
    """Which TensorRT-LLM the model imitates.

    Attributes:
        layout: ``"new"`` or ``"old"`` module paths (doc 0.1).
        plus: ``"canonical"`` or ``"append"`` semantics of ``+name`` in ``TLLM_FMHA_LIBS`` (doc 1.2);
            default: canonical on the new layout, append on the old one.
        params: ``"interface"`` (variant b) or ``"phased"`` (variant a) ``FmhaParams`` (doc 0.2);
            default: b on the new layout, a on the old one.
        sm100: whether ``flashinfer_trtllm_gen`` is available (doc 7.1; it is not on Hopper).
        hooks: ``"final"``: ``Fmha.is_available``/``is_supported`` are shared wrappers around the
            ``_is_available``/``_is_supported`` hooks (new layout ``fmha/interface.py`` at 0352547d);
            ``"plain"``: no hooks, the base methods return True and every library overrides
            ``is_available``/``is_supported`` itself (new layout at b0a6e828, old layout at 077c210e).
        manager: ``True``: the layer's libraries live in an ``FmhaManager`` (``attn._fmha_manager``,
            ``backends/trtllm.py`` at 017aa0ca); ``False``: the older tree without a manager (``trtllm.py``
            at a15d8890), where the layer keeps ``fmha_libs`` itself, selects the first library whose
            phase-less ``is_supported`` accepts a call (no selection cache), and stores ``quant_mode``
            and ``position_embedding_type`` as plain ints.
    """

    layout: str = "new"
    plus: Optional[str] = None
    params: Optional[str] = None
    sm100: bool = False
    hooks: str = "final"
    manager: bool = True

    def __post_init__(self):
        assert self.layout in ROOTS
        assert self.hooks in ("final", "plain")
        if self.plus is None:
            self.plus = "canonical" if self.layout == "new" else "append"
        if self.params is None:
            self.params = "interface" if self.layout == "new" else "phased"

    @property
    def root(self) -> str:
        return ROOTS[self.layout]


class _ModelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, model: "TrtModel"):
        self.model = model

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.model.builders:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in self.model.packages)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.model.builders[module.__name__](module)


def _empty(module):
    pass


class TrtModel:
    """Installs the model's ``tensorrt_llm`` modules (see the module docstring) for one test."""

    def __init__(self, config: Optional[ModelConfig] = None, **kwargs):
        self.config = config or ModelConfig(**kwargs)
        root = self.config.root
        self.root = root
        self.builders = {
            "tensorrt_llm": _empty,
            "tensorrt_llm._torch": _empty,
            "tensorrt_llm._torch.attention": _empty,
            "tensorrt_llm._torch.pyexecutor": _empty,
            "tensorrt_llm._torch.pyexecutor.kv_cache": _empty,
            "tensorrt_llm.quantization": _empty,
            "tensorrt_llm.functional": _build_functional,
            "tensorrt_llm.quantization.mode": _build_quant_mode,
            "tensorrt_llm._torch.pyexecutor.resource_manager": _build_resource_manager,
            "tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_manager_v2": _build_kv_cache_manager_v2,
            root: _empty,
            root + ".interface": _build_backend_interface,
            root + ".trtllm": lambda m: _build_trtllm(m, self.config),
            root + ".fmha": _build_fmha_package,
            root + ".fmha.interface": lambda m: _build_fmha_interface(m, self.config),
            root + ".fmha.phased": lambda m: _build_phased(m, self.config),
            root + ".fmha.combined": _build_combined,
            root + ".fmha.fallback": _build_fallback,
            root + ".fmha.flashinfer_trtllm_gen": lambda m: _build_trtllm_gen(m, self.config),
            root + ".fmha.triton_custom_mask": _build_triton_custom_mask,
            root + ".fmha.prims_ts": _build_prims_ts,
            root + ".fmha.manager": _build_manager,
            root + ".fmha.registry": lambda m: _build_registry(m, self.config),
        }
        self.packages = {
            "tensorrt_llm",
            "tensorrt_llm._torch",
            "tensorrt_llm._torch.attention",
            "tensorrt_llm._torch.pyexecutor",
            "tensorrt_llm._torch.pyexecutor.kv_cache",
            "tensorrt_llm.quantization",
            root,
            root + ".fmha",
        }
        if self.config.layout == "old":
            self.packages.add("tensorrt_llm._torch.attention_backend")
            del self.builders["tensorrt_llm._torch.attention"]
            self.packages.discard("tensorrt_llm._torch.attention")
        self._finder = _ModelFinder(self)
        self._saved: Dict[str, object] = {}

    # -- lifetime ------------------------------------------------------------------------------
    def install(self) -> "TrtModel":
        for name in list(sys.modules):
            if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
                self._saved[name] = sys.modules.pop(name)
        # Before the path finder, so a real tensorrt_llm (if installed) stays hidden during the test.
        index = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
        sys.meta_path.insert(index, self._finder)
        return self

    def uninstall(self) -> None:
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for name in list(sys.modules):
            if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
                del sys.modules[name]
        sys.modules.update(self._saved)
        self._saved.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    # -- convenience ----------------------------------------------------------------------------
    def module(self, suffix: str):
        """Import ``<root><suffix>``, e.g. ``model.module(".fmha.registry")``."""
        return importlib.import_module(self.root + suffix)

    @property
    def registry(self):
        return self.module(".fmha.registry")


# ==================================================================================================
# tensorrt_llm.functional / tensorrt_llm.quantization.mode


def _build_functional(m):
    m.PositionEmbeddingType = PositionEmbeddingType
    m.AttentionMaskType = AttentionMaskType


def _build_quant_mode(m):
    m.QuantMode = QuantMode


# ==================================================================================================
# <root>.interface (doc 2.7, 3): forward args, KV cache params, AttentionMetadata


def _build_backend_interface(m):
    class AttentionInputType(enum.IntEnum):
        mixed = 0
        context_only = 1
        generation_only = 2

    class PredefinedAttentionMask(str, enum.Enum):
        CAUSAL = "causal"
        FULL = "full"

    class CustomAttentionMask(str, enum.Enum):
        CUSTOM = "custom"

    @dataclass(kw_only=True)
    class SparseRuntimeParams:
        block_sparse_inputs: Optional[torch.Tensor] = None

    @dataclass(kw_only=True, slots=True)
    class AttentionForwardArgs:
        output: Optional[torch.Tensor] = None
        output_sf: Optional[torch.Tensor] = None
        out_scale: Optional[torch.Tensor] = None
        attention_mask: object = PredefinedAttentionMask.CAUSAL
        attention_input_type: AttentionInputType = AttentionInputType.mixed
        attention_window_size: Optional[int] = None
        attention_mask_data: Optional[torch.Tensor] = None
        attention_sinks: Optional[torch.Tensor] = None
        relative_attention_bias: Optional[torch.Tensor] = None
        cross_kv: Optional[torch.Tensor] = None
        mrope_rotary_cos_sin: Optional[torch.Tensor] = None
        is_fused_qkv: bool = False
        update_kv_cache: bool = True
        sparse_runtime_params: SparseRuntimeParams = field(default_factory=SparseRuntimeParams)

        @property
        def mask_type(self) -> int:
            if self.attention_mask == PredefinedAttentionMask.CAUSAL:
                return int(AttentionMaskType.causal)
            if self.attention_mask == PredefinedAttentionMask.FULL:
                return int(AttentionMaskType.padding)
            raise ValueError(f"Unexpected attention mask type: {self.attention_mask!r}")

    @dataclass(kw_only=True)
    class KVCacheParams:
        use_cache: bool = True
        num_cached_tokens_per_seq: List[int] = field(default_factory=list)
        num_extra_kv_tokens: int = 0

    @dataclass(kw_only=True)
    class AttentionMetadata:
        """Doc 3.1-3.7 (model): plain dataclass (unhashable, eq=True)."""

        max_num_requests: int
        max_num_tokens: int = 8192
        max_num_sequences: Optional[int] = None
        kv_cache_manager: object = None
        mapping: object = None
        is_cuda_graph: bool = False
        cuda_graph_buffers: object = None
        seq_lens: Optional[torch.Tensor] = None
        num_contexts: int = 0
        request_ids: List[int] = field(default_factory=list)
        prompt_lens: List[int] = field(default_factory=list)
        kv_cache_params: Optional[KVCacheParams] = None
        cache_indirection: Optional[torch.Tensor] = None
        kv_layout: str = "HND"
        is_cross: bool = False

        def __post_init__(self):
            if self.max_num_sequences is None:
                self.max_num_sequences = self.max_num_requests

        @property
        def num_seqs(self) -> int:
            return 0 if self.seq_lens is None else int(self.seq_lens.shape[0])

        @property
        def num_generations(self) -> int:
            return self.num_seqs - self.num_contexts

        @property
        def num_ctx_tokens(self) -> int:
            return int(self.seq_lens[: self.num_contexts].sum()) if self.num_contexts else 0

        @property
        def num_tokens(self) -> int:
            return int(self.seq_lens.sum())

        def create_cuda_graph_metadata(self, max_batch_size, sub_cross_metadata=False, max_draft_tokens=0, buffers=None):
            """Doc 3.1: a shallow ``copy.copy`` with ``is_cuda_graph=True``; ``__post_init__`` re-allocates."""
            if self.is_cuda_graph:
                return self
            cuda_graph_metadata = copy.copy(self)
            cuda_graph_metadata.is_cuda_graph = True
            cuda_graph_metadata.cuda_graph_buffers = buffers
            cuda_graph_metadata.max_num_requests = max_batch_size
            beam = max(1, getattr(self, "max_beam_width", 1))
            cuda_graph_metadata.max_num_sequences = max_batch_size * beam
            # Decoder graphs are generation-only (backends/interface.py create_cuda_graph_metadata).
            cuda_graph_metadata.num_contexts = 0
            cuda_graph_metadata.__post_init__()
            return cuda_graph_metadata

        def prepare(self):
            pass

    for name, value in list(locals().items()):
        if isinstance(value, type):
            setattr(m, name, value)


# ==================================================================================================
# <root>.trtllm (doc 2.7, 3)


def _build_trtllm(m, config: ModelConfig):
    root = m.__name__.rsplit(".", 1)[0]
    interface = importlib.import_module(root + ".interface")
    manager_module = importlib.import_module(root + ".fmha.manager")
    AttentionMetadata = interface.AttentionMetadata
    AttentionForwardArgs = interface.AttentionForwardArgs
    AttentionInputType = interface.AttentionInputType
    PredefinedAttentionMask = interface.PredefinedAttentionMask

    @dataclass(kw_only=True)
    class TrtllmAttentionMetadata(AttentionMetadata):
        workspace: Optional[torch.Tensor] = None
        cuda_graph_workspace: Optional[torch.Tensor] = None
        beam_width: int = 1
        max_beam_width: int = 1  # model-only: what the engine sized its buffers for
        is_spec_decoding_enabled: bool = False
        use_spec_decoding: bool = False
        enable_helix: bool = False
        kv_cache_block_offsets: Optional[torch.Tensor] = None
        host_kv_cache_block_offsets: Optional[torch.Tensor] = None

        def __post_init__(self):
            super().__post_init__()
            device = self._device()
            n = self.max_num_sequences
            # Graph-stable buffers (doc 3.4, 3.6).
            self.prompt_lens_cuda = torch.zeros(n, dtype=torch.int32, device=device)
            self.prompt_lens_cpu = torch.zeros(n, dtype=torch.int32)
            self.kv_lens_cuda = torch.zeros(n, dtype=torch.int32, device=device)
            self.kv_lens = torch.zeros(n, dtype=torch.int32)
            self.host_total_kv_lens = torch.zeros(2, dtype=torch.int32)
            self.host_request_types = torch.zeros(n, dtype=torch.int32)
            self.workspace = torch.empty(0, dtype=torch.int8, device=device)
            self.cuda_graph_workspace = torch.empty(0, dtype=torch.int8, device=device)
            manager = self.kv_cache_manager
            if manager is not None:
                self.kv_cache_block_offsets = torch.zeros(
                    manager.num_pools, n, 2, manager.max_blocks_per_seq, dtype=torch.int32, device=device
                )
                self.host_kv_cache_block_offsets = manager.host_kv_cache_block_offsets

        def _device(self):
            manager = self.kv_cache_manager
            return manager.device if manager is not None else torch.device("cpu")

        @property
        def max_seq_len(self):
            return self.kv_cache_manager.max_seq_len

        @property
        def tokens_per_block(self):
            return self.kv_cache_manager.tokens_per_block if self.kv_cache_manager is not None else None

        @property
        def host_kv_cache_pool_pointers(self):
            return self.kv_cache_manager.kv_cache_pool_pointers if self.kv_cache_manager is not None else None

        @property
        def host_kv_cache_pool_mapping(self):
            return self.kv_cache_manager.kv_cache_pool_mapping if self.kv_cache_manager is not None else None

        @property
        def effective_beam_width(self):
            return 1 if self.is_cross else self.beam_width

        @property
        def effective_workspace(self):
            return self.cuda_graph_workspace if self.is_cuda_graph else self.workspace

        def prepare(self):
            """Doc 3.8 order: lengths, host->device copies, block offsets, runtime views."""
            super().prepare()
            num_seqs = self.num_seqs
            seq_lens = self.seq_lens.to(torch.int32)
            prompt = torch.tensor(self.prompt_lens, dtype=torch.int32)
            self.prompt_lens_cpu[:num_seqs] = prompt
            self.prompt_lens_cuda[:num_seqs].copy_(prompt)
            cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq, dtype=torch.int32)
            kv_lens = cached + seq_lens
            extra = self.kv_cache_params.num_extra_kv_tokens
            self.kv_lens[:num_seqs] = kv_lens + extra
            self.kv_lens_cuda[:num_seqs].copy_(kv_lens)
            nc = self.num_contexts
            self.host_total_kv_lens[0] = int(kv_lens[:nc].sum())
            self.host_total_kv_lens[1] = int(kv_lens[nc:].sum())
            self.host_request_types[:nc] = 0
            self.host_request_types[nc:num_seqs] = 1
            if self.kv_cache_manager is not None:
                self.kv_cache_manager.copy_batch_block_offsets(
                    self.kv_cache_block_offsets, self.request_ids, self.beam_width, nc, num_seqs
                )
            # _bind_runtime_views (doc 3.4)
            self.kv_lens_cuda_runtime = self.kv_lens_cuda[:num_seqs]
            # Upstream binds the freshly computed lengths (without num_extra_kv_tokens), not
            # self.kv_lens (trtllm.py prepare() at 017aa0ca).
            self.kv_lens_runtime = kv_lens[:num_seqs]
            self.prompt_lens_cuda_runtime = self.prompt_lens_cuda[:num_seqs]
            self.prompt_lens_cpu_runtime = self.prompt_lens_cpu[:num_seqs]
            self.host_request_types_runtime = self.host_request_types[:num_seqs]

    class TrtllmAttention:
        """Doc 2.7 (model): the layer attributes the libraries read, and ``forward``."""

        Metadata = TrtllmAttentionMetadata

        def __init__(
            self,
            layer_idx: int,
            num_heads: int,
            head_dim: int,
            num_kv_heads: Optional[int] = None,
            *,
            q_scaling: float = 1.0,
            quant_mode: QuantMode = QuantMode.NONE,
            position_embedding_type=PositionEmbeddingType.learned_absolute,
            mla: bool = False,
            sparse_params=None,
            attention_chunk_size: Optional[int] = None,
            predicted_tokens_per_seq: int = 1,
            skip_correction_threshold: float = 0.0,
            kv_cache_dtype: str = "auto",
            skip_create_weights_in_init: bool = False,
        ):
            self.layer_idx = layer_idx
            self.num_heads = num_heads
            self.head_dim = head_dim
            self.num_kv_heads = num_kv_heads or num_heads
            self.q_scaling = q_scaling
            self.quant_mode = QuantMode(quant_mode)
            self.has_fp8_kv_cache = self.quant_mode.has_fp8_kv_cache()
            self.has_fp4_kv_cache = self.quant_mode.has_fp4_kv_cache()
            self.position_embedding_type = PositionEmbeddingType(position_embedding_type)
            if not config.manager:  # the manager-less tree keeps both as ints
                self.quant_mode = int(self.quant_mode)
                self.position_embedding_type = int(self.position_embedding_type)
            self.is_mla_enable = mla
            self.sparse_params = sparse_params
            self.attention_chunk_size = attention_chunk_size
            self.predicted_tokens_per_seq = predicted_tokens_per_seq
            self.skip_correction_threshold = skip_correction_threshold
            self.kv_cache_dtype = kv_cache_dtype
            self.local_layer_idx = None
            if not skip_create_weights_in_init:
                self.update_quant_config()

        def update_quant_config(self):
            # Doc 1.3: the manager (and the library list) is built here, once.
            if config.manager:
                self._fmha_manager = manager_module.FmhaManager(self)
            else:
                registry = importlib.import_module(root + ".fmha.registry")
                self.fmha_libs = [cls(self) for cls in registry.get_enabled_fmha_lib_classes() if cls.is_available(self)]

        def get_local_layer_idx(self, metadata) -> int:
            if self.local_layer_idx is None and metadata.kv_cache_manager is not None:
                self.local_layer_idx = metadata.kv_cache_manager.layer_offsets[self.layer_idx]
            return self.local_layer_idx if self.local_layer_idx is not None else self.layer_idx

        def out_head_size(self, is_gen_only: bool = False) -> int:
            return self.head_dim

        def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
            """trtllm.py TrtllmAttention.forward at 017aa0ca, reduced: legacy kwargs merged into
            AttentionForwardArgs, output allocated, is_fused_qkv/update_kv_cache derived, window
            defaulted, local_layer_idx primed, then select + forward."""
            if forward_args is None:
                forward_args = AttentionForwardArgs(**kwargs)
            elif kwargs:
                raise ValueError(f"Pass attention forward options either through forward_args or as kwargs: {sorted(kwargs)}")
            num_tokens = q.shape[0]
            if forward_args.output is None:
                # TensorRT-LLM allocates with new_empty; the model poisons it so an unwritten row fails.
                forward_args.output = q.new_full((num_tokens, self.num_heads * self.head_dim), float("nan"))
            output = forward_args.output
            if k is None and v is None and not metadata.is_cross:
                q_hidden = self.num_heads * self.head_dim
                has_q_only = q.shape[-1] == q_hidden
                forward_args.is_fused_qkv = q.shape[-1] == q_hidden + 2 * self.num_kv_heads * self.head_dim
                forward_args.update_kv_cache = not has_q_only
            else:
                forward_args.is_fused_qkv = not metadata.is_cross and k is None
                forward_args.update_kv_cache = not metadata.is_cross or k is not None
            self.local_layer_idx = self.get_local_layer_idx(metadata)
            manager = metadata.kv_cache_manager
            if forward_args.attention_window_size is None and manager is not None:
                forward_args.attention_window_size = manager.max_attention_window_vec[self.local_layer_idx]
            if forward_args.attention_window_size is None:
                forward_args.attention_window_size = metadata.max_seq_len
            if config.manager:
                fmha = self._fmha_manager.select(self, q, k, v, metadata, forward_args)
            else:
                fmha = next((lib for lib in self.fmha_libs if lib.is_supported(q, k, v, metadata, forward_args)), None)
            if fmha is None:
                raise RuntimeError("No TRT-LLM attention FMHA library supports this request.")
            fmha.forward(q, k, v, metadata, forward_args)
            return output

    m.TrtllmAttentionMetadata = TrtllmAttentionMetadata
    m.TrtllmAttention = TrtllmAttention


# ==================================================================================================
# <root>.fmha package and its modules (doc 1, 2)


def _build_fmha_package(m):
    # Doc 1.1: the package re-exports the registry's objects by reference.
    registry = importlib.import_module(m.__name__ + ".registry")
    m.FMHA_LIBS = registry.FMHA_LIBS
    m.DEFAULT_FMHA_LIBS = registry.DEFAULT_FMHA_LIBS
    m.FmhaCls = type
    m.get_enabled_fmha_lib_classes = registry.get_enabled_fmha_lib_classes


@dataclass(kw_only=True)
class FmhaParamsInterface:
    """Variant (b) of doc 0.2 / 2.2 (``fmha/interface.py``): phase-local device views."""

    fwd: object = None
    attn: object = None
    meta: object = None
    workspace: Optional[torch.Tensor] = None
    qkv_or_q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    sequence_length: Optional[torch.Tensor] = None
    context_lengths: Optional[torch.Tensor] = None
    seq_offset: int = 0
    token_offset: int = 0
    num_seqs: int = 0
    num_requests: int = 0
    num_tokens: int = 0
    beam_width: int = 1
    tokens_per_block: int = 64
    kv_factor: int = 2


@dataclass(kw_only=True)
class FmhaParamsPhased:
    """Variant (a) of doc 0.2 / 2.2 (``fmha/phased.py``): ``qkv_input``, ``sequence_lengths``..."""

    # Fields as in tensorrt_llm/_torch/attention/backends/fmha/phased.py at 248135d1 (the old
    # layout at 00e7d103 has the same names): the output slice is ``context_buf``, there is no
    # ``output`` field, and ``attention_input`` and ``qkv_input`` name the same phase slice.
    attn: object = None
    meta: object = None
    fwd: object = None
    workspace: Optional[torch.Tensor] = None
    attention_input: Optional[torch.Tensor] = None
    qkv_input: Optional[torch.Tensor] = None
    key_input: Optional[torch.Tensor] = None
    value_input: Optional[torch.Tensor] = None
    context_buf: Optional[torch.Tensor] = None
    sequence_lengths: Optional[torch.Tensor] = None
    context_lengths: Optional[torch.Tensor] = None
    num_tokens: int = 0
    seq_offset: int = 0
    batch_size: int = 0
    num_requests: int = 0
    tokens_per_block: int = 64
    kv_factor: int = 2


def _build_fmha_interface(m, config: ModelConfig):
    class FmhaPhase(str, enum.Enum):
        CONTEXT = "context"
        GENERATION = "generation"

    class Fmha(ABC):
        """Doc 2.1 (model)."""

        supports_skip_correction = False

        def __init__(self, attn):
            self._attn_ref = weakref.ref(attn)

        @property
        def attn(self):
            attn = self._attn_ref()
            if attn is None:
                raise RuntimeError("The owning TrtllmAttention instance has been garbage collected.")
            return attn

        def release(self) -> None:
            pass

        @classmethod
        def is_available(cls, attn) -> bool:
            # fmha/interface.py at 0352547d: @final wrapper, skip-correction check, then the hook.
            if attn.skip_correction_threshold > 0.0 and not cls.supports_skip_correction:
                return False
            return cls._is_available(attn)

        @classmethod
        def _is_available(cls, attn) -> bool:
            return True

        def is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            params = getattr(forward_args, "sparse_runtime_params", None)
            if params is not None and params.block_sparse_inputs is not None and not getattr(
                self, "supports_block_sparse_inputs", False
            ):
                return False
            return self._is_supported(q, k, v, metadata, forward_args, phase=phase)

        def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            return True

        @abstractmethod
        def forward(self, q, k, v, metadata, forward_args) -> None:
            raise NotImplementedError

    if config.hooks == "plain":
        # fmha/interface.py at b0a6e828 (new layout) / 077c210e (old layout): no hooks; the base
        # accepts everything and each library overrides is_available / is_supported.
        del Fmha._is_available, Fmha._is_supported
        Fmha.is_available = classmethod(lambda cls, attn=None: True)
        Fmha.is_supported = lambda self, q, k, v, metadata, forward_args, *, phase=None: True

    m.FmhaPhase = FmhaPhase
    m.Fmha = Fmha
    if config.params == "interface":
        m.FmhaParams = FmhaParamsInterface


def _build_phased(m, config: ModelConfig):
    package = m.__name__.rsplit(".", 1)[0]
    root = package.rsplit(".", 1)[0]
    interface = importlib.import_module(package + ".interface")
    backend_interface = importlib.import_module(root + ".interface")
    AttentionInputType = backend_interface.AttentionInputType
    variant_b = config.params == "interface"
    FmhaParams = FmhaParamsInterface if variant_b else FmhaParamsPhased

    class PhasedFmha(interface.Fmha):
        """Doc 2.2 (model): builds phase-local params and calls ``run_context`` / ``run_generation``."""

        REQUIRES_PAGED_KV = True

        def __init__(self, attn):
            super().__init__(attn)
            self.kv_factor = 1 if attn.is_mla_enable else 2
            self.generation_out_head_size = attn.out_head_size(is_gen_only=True)
            self.context_out_head_size = attn.out_head_size(is_gen_only=False)

        def prepare_workspace(self, *args, **kwargs) -> None:
            pass

        def run_context(self, params) -> None:
            raise NotImplementedError

        def run_generation(self, params) -> None:
            raise NotImplementedError

        def forward(self, q, k, v, metadata, forward_args) -> None:
            """fmha/phased.py forward: variant b at 017aa0ca (one FmhaParams, mutated per phase,
            ``prepare_workspace(params, metadata)``); variant a at 248135d1 (``qkv_input`` /
            ``attention_input`` / ``context_buf``, ``prepare_workspace(q, k, v, metadata,
            forward_args, workspace)``)."""
            attn = self.attn
            output = forward_args.output
            if output is None:
                raise RuntimeError(f"{type(self).__name__} requires output.")
            if self.REQUIRES_PAGED_KV and metadata.kv_cache_block_offsets is None:
                raise RuntimeError(f"{type(self).__name__} requires paged KV cache.")
            workspace = metadata.effective_workspace
            num_tokens = q.size(0)
            input_type = forward_args.attention_input_type
            is_gen_only = input_type == AttentionInputType.generation_only
            num_contexts, num_ctx_tokens, num_generations = metadata.num_contexts, metadata.num_ctx_tokens, metadata.num_generations
            num_gen_tokens = num_tokens if is_gen_only else num_tokens - num_ctx_tokens
            head_size = self.generation_out_head_size if is_gen_only else self.context_out_head_size
            out3 = output.view(num_tokens, attn.num_heads, head_size)
            common = dict(attn=attn, meta=metadata, fwd=forward_args, workspace=workspace,
                          tokens_per_block=metadata.tokens_per_block or 64, kv_factor=self.kv_factor)
            if variant_b:
                params = FmhaParams(qkv_or_q=q, k=k, v=v, output=out3, beam_width=metadata.effective_beam_width,
                                    sequence_length=metadata.kv_lens_cuda_runtime,
                                    context_lengths=metadata.prompt_lens_cuda_runtime, num_tokens=num_tokens, **common)
                self.prepare_workspace(params, metadata)
            else:
                params = FmhaParams(**common)
                self.prepare_workspace(q, k, v, metadata, forward_args, workspace)
            phases = []
            if num_contexts > 0 and input_type != AttentionInputType.generation_only:
                phases.append(("context", 0, 0, num_contexts, num_ctx_tokens))
            if num_generations > 0 and input_type != AttentionInputType.context_only:
                phases.append(("generation", num_contexts, 0 if is_gen_only else num_ctx_tokens, num_generations, num_gen_tokens))
            for phase, seq_offset, token_offset, num_seqs, n_tok in phases:
                rows = slice(token_offset, token_offset + n_tok)
                requests = num_seqs if phase == "context" else num_seqs // max(params_beam(metadata, variant_b), 1)
                if variant_b:
                    params.qkv_or_q, params.output = q[rows], out3[rows]
                    params.k = None if k is None else k[rows]
                    params.v = None if v is None else v[rows]
                    params.sequence_length = metadata.kv_lens_cuda_runtime[seq_offset:]
                    params.context_lengths = metadata.prompt_lens_cuda_runtime[seq_offset:]
                    params.seq_offset, params.token_offset, params.num_seqs = seq_offset, token_offset, num_seqs
                    params.num_requests, params.num_tokens = requests, n_tok
                else:
                    params.attention_input = params.qkv_input = q[rows]
                    params.key_input = None if k is None else k[rows]
                    params.value_input = None if v is None else v[rows]
                    params.context_buf = out3[rows]
                    params.sequence_lengths = metadata.kv_lens_cuda_runtime[seq_offset:]
                    if phase == "context":
                        params.context_lengths = metadata.prompt_lens_cuda_runtime[seq_offset:]
                    params.num_tokens, params.seq_offset, params.batch_size = n_tok, seq_offset, num_seqs
                    params.num_requests = requests
                (self.run_context if phase == "context" else self.run_generation)(params)

    def params_beam(metadata, variant_b):
        # variant b: params.beam_width = effective_beam_width; variant a: metadata.beam_width.
        return metadata.effective_beam_width if variant_b else metadata.beam_width

    m.PhasedFmha = PhasedFmha
    m.FmhaParams = FmhaParams


def _build_combined(m):
    package = m.__name__.rsplit(".", 1)[0]
    phased = importlib.import_module(package + ".phased")

    class CombinedFmha(phased.PhasedFmha):
        """Doc 2.5 (model)."""

        def __init__(self, attn):
            super().__init__(attn)
            self._context_impl = None
            self._generation_impl = None

        def set_fmha_impls(self, context_impl, generation_impl):
            self._context_impl, self._generation_impl = context_impl, generation_impl

        # fmha/combined.py at 0352547d: accessors that raise when unset; the manager uses them.
        def _get_context_impl(self):
            if self._context_impl is None:
                raise RuntimeError("CombinedFmha context implementation is not configured.")
            return self._context_impl

        def _get_generation_impl(self):
            if self._generation_impl is None:
                raise RuntimeError("CombinedFmha generation implementation is not configured.")
            return self._generation_impl

        def prepare_workspace(self, *args, **kwargs):
            for impl in (self._get_context_impl(), self._get_generation_impl()):
                impl.prepare_workspace(*args, **kwargs)

        def run_context(self, params):
            self._get_context_impl().run_context(params)

        def run_generation(self, params):
            self._get_generation_impl().run_generation(params)

    m.CombinedFmha = CombinedFmha


# -- the model's "native kernels" ----------------------------------------------------------------


def _params_rows(params):
    qkv = getattr(params, "qkv_or_q", None)
    if qkv is None:
        qkv = params.qkv_input
    out = getattr(params, "output", None)
    if out is None:
        out = params.context_buf
    return qkv, out, params.meta, params.attn


def _layer_pool(attn, metadata):
    manager = metadata.kv_cache_manager
    local = manager.layer_offsets[attn.layer_idx]
    pool_index = int(manager.kv_cache_pool_mapping[local, 0])
    return manager.get_buffers(attn.layer_idx, kv_layout="HND"), pool_index, manager._model_divisor


def _split_qkv(attn, qkv):
    n = qkv.shape[0]
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    return (
        qkv[:, : h * d].reshape(n, h, d),
        qkv[:, h * d : (h + hkv) * d].reshape(n, hkv, d),
        qkv[:, (h + hkv) * d : (h + 2 * hkv) * d].reshape(n, hkv, d),
    )


def model_context_kernel(attn, qkv, out, metadata) -> None:
    """Model of the native context phase: causal attention per context request, K/V written to the
    request's pages through its block-offset row (doc 4.2: context requests use beam 0's table)."""
    pool, pool_index, divisor = _layer_pool(attn, metadata)
    page_size = metadata.tokens_per_block
    q, k, v = _split_qkv(attn, qkv)
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    scale = 1.0 / (math.sqrt(d) * attn.q_scaling)
    out3 = out.view(qkv.shape[0], h, d)
    token = 0
    for c in range(metadata.num_contexts):
        n = int(metadata.seq_lens[c])
        offsets = metadata.kv_cache_block_offsets[pool_index, c, 0]
        for t in range(n):
            page = int(offsets[t // page_size]) // divisor
            pool[page, 0, :, t % page_size, :] = k[token + t]
            pool[page, 1, :, t % page_size, :] = v[token + t]
        qc = q[token : token + n].float().view(n, hkv, h // hkv, d)
        kc, vc = k[token : token + n].float(), v[token : token + n].float()
        scores = torch.einsum("ikgd,jkd->kgij", qc, kc) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.einsum("kgij,jkd->ikgd", scores.softmax(-1), vc).reshape(n, h, d)
        out3[token : token + n] = o.to(out.dtype)
        token += n


def model_generation_kernel(attn, qkv, out, metadata) -> None:
    """Model of the default per-beam decode (doc 5.1, 7.2): write this token's K/V at ``kv_len - 1``
    of the row's own page, then every beam attends its whole history through ``cache_indirection``."""
    pool, pool_index, divisor = _layer_pool(attn, metadata)
    page_size = metadata.tokens_per_block
    seq0, rows = metadata.num_contexts, metadata.num_generations
    q, k, v = _split_qkv(attn, qkv)
    table = metadata.kv_cache_block_offsets[pool_index, seq0:, 0, :]
    kv_lens = metadata.kv_lens_cuda_runtime[seq0 : seq0 + rows]
    for i in range(rows):
        pos = int(kv_lens[i]) - 1
        page = int(table[i, pos // page_size]) // divisor
        pool[page, 0, :, pos % page_size, :] = k[i]
        pool[page, 1, :, pos % page_size, :] = v[i]
    # At beam width 1 every row reads its own history: the indirection is a beams' table, and a width-1 step on an
    # engine sized for beams (a warm-up) finds it holding the last beam step's sources, which would name other rows.
    indirection = metadata.cache_indirection
    if metadata.beam_width == 1:
        indirection = torch.zeros_like(indirection)
    result = reference_beam_attention(
        q, pool, table, kv_lens, metadata.prompt_lens_cuda_runtime[seq0 : seq0 + rows], indirection,
        metadata.beam_width, new_k=k, new_v=v, sm_scale=1.0 / (math.sqrt(attn.head_dim) * attn.q_scaling),
        kv_layout="HND", page_index_divisor=divisor,
    )
    out.view(rows, attn.num_heads, attn.head_dim).copy_(result.to(out.dtype))


def _build_fallback(m):
    package = m.__name__.rsplit(".", 1)[0]
    root = package.rsplit(".", 1)[0]
    phased = importlib.import_module(package + ".phased")
    backend_interface = importlib.import_module(root + ".interface")

    class FallbackFmha(phased.PhasedFmha):
        """Doc 2.6 (model): accepts everything but FP8 queries and custom masks."""

        REQUIRES_PAGED_KV = False
        supports_skip_correction = True
        calls: List[str] = []

        def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            if q.dtype == getattr(torch, "float8_e4m3fn", None):
                return False
            if forward_args.attention_mask == backend_interface.CustomAttentionMask.CUSTOM:
                return False
            return bool(forward_args.update_kv_cache or metadata.is_cross)

        def prepare_workspace(self, *args, **kwargs) -> None:
            FallbackFmha.calls.append("prepare_workspace")

        def run_context(self, params) -> None:
            FallbackFmha.calls.append("run_context")
            qkv, out, metadata, attn = _params_rows(params)
            model_context_kernel(attn, qkv, out, metadata)

        def run_generation(self, params) -> None:
            FallbackFmha.calls.append("run_generation")
            qkv, out, metadata, attn = _params_rows(params)
            model_generation_kernel(attn, qkv, out, metadata)

    m.FallbackFmha = FallbackFmha


def _build_trtllm_gen(m, config: ModelConfig):
    package = m.__name__.rsplit(".", 1)[0]
    phased = importlib.import_module(package + ".phased")

    class FlashInferTrtllmGenFmha(phased.PhasedFmha):
        """Doc 7.1 (model): SM100 only; context phase yes, beam-search generation no."""

        calls: List[str] = []

        @classmethod
        def _is_available(cls, attn) -> bool:
            return config.sm100

        def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            phase_name = None if phase is None else phase.value
            if phase_name == "context":
                return True
            generation_ok = metadata.beam_width == 1
            if phase_name == "generation":
                return generation_ok
            return generation_ok and metadata.num_generations > 0

        def run_context(self, params) -> None:
            FlashInferTrtllmGenFmha.calls.append("run_context")
            qkv, out, metadata, attn = _params_rows(params)
            model_context_kernel(attn, qkv, out, metadata)

    m.FlashInferTrtllmGenFmha = FlashInferTrtllmGenFmha


def _build_triton_custom_mask(m):
    package = m.__name__.rsplit(".", 1)[0]
    root = package.rsplit(".", 1)[0]
    interface = importlib.import_module(package + ".interface")
    backend_interface = importlib.import_module(root + ".interface")

    class TritonCustomMaskFmha(interface.Fmha):
        """Takes custom masks only (model)."""

        def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            return forward_args.attention_mask == backend_interface.CustomAttentionMask.CUSTOM

        def forward(self, q, k, v, metadata, forward_args) -> None:
            raise NotImplementedError("model: custom masks are not modelled")

    m.TritonCustomMaskFmha = TritonCustomMaskFmha


def _build_prims_ts(m):
    package = m.__name__.rsplit(".", 1)[0]
    interface = importlib.import_module(package + ".interface")

    class PrimsTSFmha(interface.Fmha):
        """Opt-in library of the new layout (doc 1.1); declines everything in the model."""

        def _is_supported(self, *args, **kwargs) -> bool:
            return False

        def forward(self, q, k, v, metadata, forward_args) -> None:
            raise NotImplementedError

    m.PrimsTSFmha = PrimsTSFmha


# -- the manager (doc 2.3, 2.4) ------------------------------------------------------------------

_BATCH_CANDIDATES = tuple(range(1, 25)) + (26, 28, 30, 32, 36, 40, 48, 56, 64, 80, 96, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048)
_SEQ_Q_CANDIDATES = (1, 2, 4, 8, 32, 64, 128)


def _grid(candidates):
    return tuple(sorted({b for c in candidates for b in (c - 1, c) if b > 0}))


BATCH_GRID = _grid(_BATCH_CANDIDATES)
SEQ_Q_GRID = _grid(_SEQ_Q_CANDIDATES)


def bucket(value: int, grid) -> int:
    """Doc 2.4: <= 0 -> 0, else the smallest grid point >= value (values above share the largest)."""
    if value <= 0:
        return 0
    return grid[min(bisect.bisect_left(grid, value), len(grid) - 1)]


def _build_manager(m):
    package = m.__name__.rsplit(".", 1)[0]
    root = package.rsplit(".", 1)[0]
    backend_interface = importlib.import_module(root + ".interface")
    interface = importlib.import_module(package + ".interface")
    phased = importlib.import_module(package + ".phased")
    combined = importlib.import_module(package + ".combined")
    registry = importlib.import_module(package + ".registry")
    AttentionInputType = backend_interface.AttentionInputType
    FmhaPhase = interface.FmhaPhase

    class FmhaManager:
        """Doc 2.3 (model): library list, selection, selection cache (2.4)."""

        def __init__(self, attn):
            self._cache = {}
            self._sanity = os.environ.get("TRTLLM_FMHA_CACHE_SANITY_CHECK", "0") == "1"
            self.fmha_libs = [cls(attn) for cls in registry.get_enabled_fmha_lib_classes() if cls.is_available(attn)]
            self.selections = 0  # uncached selections (model-only counter)

        def _make_cache_key(self, q, metadata, forward_args):
            input_type = forward_args.attention_input_type
            custom = (
                forward_args.attention_mask == backend_interface.CustomAttentionMask.CUSTOM
                or forward_args.attention_mask_data is not None
            )
            mask_type = AttentionMaskType.custom_mask if custom else AttentionMaskType(forward_args.mask_type)
            gen_q = 0
            if input_type != AttentionInputType.context_only and metadata.num_generations > 0:
                tokens = q.shape[0]
                if input_type == AttentionInputType.mixed:
                    tokens -= metadata.num_ctx_tokens
                gen_q = bucket(tokens // metadata.num_generations, SEQ_Q_GRID)
            return (
                bucket(metadata.num_contexts, BATCH_GRID),
                bucket(metadata.num_generations, BATCH_GRID),
                gen_q,
                mask_type,
                metadata.use_spec_decoding,
                forward_args.sparse_runtime_params.block_sparse_inputs is not None,
                forward_args.output.dtype if forward_args.output is not None else None,
                forward_args.output_sf.dtype if forward_args.output_sf is not None else None,
            )

        def select(self, attn, q, k, v, metadata, forward_args):
            key = self._make_cache_key(q, metadata, forward_args)
            fmha = self._cache.get(key)
            if fmha is not None:
                if self._sanity:
                    uncached = self._select_non_mla(attn, q, k, v, metadata, forward_args)
                    if not _same_choice(fmha, uncached):
                        raise RuntimeError(
                            f"FMHA cache sanity check failed for key={key}: cached={_describe(fmha)}, "
                            f"uncached={_describe(uncached)}."
                        )
                return fmha
            fmha = self._select_non_mla(attn, q, k, v, metadata, forward_args)
            if fmha is None:
                return None
            self._cache[key] = fmha
            return fmha

        def _select_non_mla(self, attn, q, k, v, metadata, forward_args):
            self.selections += 1
            has_context = metadata.num_contexts > 0
            has_generation = metadata.num_generations > 0
            if not has_context and not has_generation:
                return None
            context_fmha = generation_fmha = None
            for fmha in self.fmha_libs:
                if fmha.is_supported(q, k, v, metadata, forward_args):
                    return fmha
                if not isinstance(fmha, phased.PhasedFmha):
                    continue
                if has_context and context_fmha is None:
                    if fmha.is_supported(q, k, v, metadata, forward_args, phase=FmhaPhase.CONTEXT):
                        context_fmha = fmha
                if has_generation and generation_fmha is None:
                    if fmha.is_supported(q, k, v, metadata, forward_args, phase=FmhaPhase.GENERATION):
                        generation_fmha = fmha
                if has_context and context_fmha is None:
                    continue
                if has_generation and generation_fmha is None:
                    continue
                if context_fmha is None:
                    return generation_fmha
                if generation_fmha is None:
                    return context_fmha
                if context_fmha is generation_fmha:
                    continue
                combined_fmha = combined.CombinedFmha(attn)
                combined_fmha.set_fmha_impls(context_fmha, generation_fmha)
                return combined_fmha
            return None

    def _same_choice(a, b):
        if a is b:
            return True
        if isinstance(a, combined.CombinedFmha) and isinstance(b, combined.CombinedFmha):
            return (_same_choice(a._get_context_impl(), b._get_context_impl())
                    and _same_choice(a._get_generation_impl(), b._get_generation_impl()))
        return False

    def _describe(fmha):
        if isinstance(fmha, combined.CombinedFmha):
            return f"CombinedFmha(context={_describe(fmha._get_context_impl())}, generation={_describe(fmha._get_generation_impl())})"
        return type(fmha).__name__ if fmha is not None else "None"

    m.FmhaManager = FmhaManager


# -- the registry (doc 1.1, 1.2) -----------------------------------------------------------------


def _expose_plain(cls) -> None:
    """On a ``hooks="plain"`` tree a library overrides ``is_available``/``is_supported`` itself
    (e.g. ``fmha/flashinfer_trtllm_gen.py`` of that era): the model's libraries keep their checks
    in ``_is_*`` methods and publish them under the public names here."""
    if "_is_supported" in cls.__dict__:
        cls.is_supported = cls.__dict__["_is_supported"]
    if "_is_available" in cls.__dict__:
        cls.is_available = cls.__dict__["_is_available"]


def _build_registry(m, config: ModelConfig):
    package = m.__name__.rsplit(".", 1)[0]
    fallback = importlib.import_module(package + ".fallback")
    trtllm_gen = importlib.import_module(package + ".flashinfer_trtllm_gen")
    custom_mask = importlib.import_module(package + ".triton_custom_mask")
    if config.layout == "new":
        prims_ts = importlib.import_module(package + ".prims_ts")

        def init_fmha_libs():
            return {
                "triton_custom_mask": custom_mask.TritonCustomMaskFmha,
                "prims_ts": prims_ts.PrimsTSFmha,
                "flashinfer_trtllm_gen": trtllm_gen.FlashInferTrtllmGenFmha,
                "fallback": fallback.FallbackFmha,
            }

        m.init_fmha_libs = init_fmha_libs
        m.FMHA_LIBS = init_fmha_libs()
        m.DEFAULT_FMHA_LIBS = tuple(name for name in m.FMHA_LIBS if name != "prims_ts")
    else:
        m.FMHA_LIBS = {
            "triton_custom_mask": custom_mask.TritonCustomMaskFmha,
            "flashinfer_trtllm_gen": trtllm_gen.FlashInferTrtllmGenFmha,
            "fallback": fallback.FallbackFmha,
        }
        m.DEFAULT_FMHA_LIBS = tuple(m.FMHA_LIBS)

    if config.hooks == "plain":
        for cls in m.FMHA_LIBS.values():
            _expose_plain(cls)

    def _parse_fmha_libs_env():
        value = os.environ.get("TLLM_FMHA_LIBS")
        if value is None or not value.strip():
            return m.DEFAULT_FMHA_LIBS
        tokens = [t.strip() for t in value.split(",") if t.strip()]
        if not tokens:
            return m.DEFAULT_FMHA_LIBS
        has_delta = any(t[0] in "+-" for t in tokens)
        if has_delta and not all(t[0] in "+-" for t in tokens):
            raise ValueError(
                "TLLM_FMHA_LIBS must use either an exact comma-separated list or only +/- delta entries."
            )
        if has_delta:
            if config.plus == "canonical":
                enabled = set(m.DEFAULT_FMHA_LIBS)
            else:
                enabled = list(m.DEFAULT_FMHA_LIBS)
            for token in tokens:
                sign, name = token[0], token[1:].strip()
                if not name:
                    raise ValueError(f"Invalid empty FMHA library entry in {value!r}.")
                if name not in m.FMHA_LIBS:
                    raise ValueError(f"Unknown FMHA library {name!r} in TLLM_FMHA_LIBS.")
                if config.plus == "canonical":
                    enabled.add(name) if sign == "+" else enabled.discard(name)
                elif sign == "+":
                    if name not in enabled:
                        enabled.append(name)
                elif name in enabled:
                    enabled.remove(name)
            if config.plus == "canonical":
                return tuple(name for name in m.FMHA_LIBS if name in enabled)
            return tuple(enabled)
        names = []
        for name in tokens:
            if name not in m.FMHA_LIBS:
                raise ValueError(f"Unknown FMHA library {name!r} in TLLM_FMHA_LIBS.")
            if name not in names:
                names.append(name)
        return tuple(names)

    def get_enabled_fmha_lib_classes():
        return [m.FMHA_LIBS[name] for name in _parse_fmha_libs_env()]

    m._parse_fmha_libs_env = _parse_fmha_libs_env
    m.get_enabled_fmha_lib_classes = get_enabled_fmha_lib_classes
    m.FmhaCls = type


# ==================================================================================================
# KV cache managers (doc 4.2, 4.3) on top of the simulator

# Block-offset columns past a sequence's blocks. Real V1 leaves older, in-range page numbers there (another
# sequence's blocks, docs/trtllm.md), so the model writes one: page 0, whose K/V are random (the simulator fills its
# pool so, and may hand the page to any request). A kernel that read past a row's kv_len would then attend foreign
# K/V and fail the oracle, where an out-of-pool page would have been masked.
STALE_PAGE = 0


class _ModelKVCacheManagerBase:
    """Shared part of the V1/V2 models: a multi-layer pool around one simulated layer.

    The pool is ``[num_pages, num_layers, 2, Hkv, page_size, D]``; ``get_buffers(layer, "HND")`` is
    the strided per-layer view (doc 4.2). The simulator's own ``kv_cache`` is re-pointed at layer
    ``served_layer``'s view, so its writes and the library's land in the same memory.
    """

    kv_factor = 2

    def __init__(self, sim: BeamSearchCacheSimulator, num_layers: int = 2, served_layer: int = 0,
                 first_layer_idx: int = 0, max_batch_size: int = 8):
        if sim.kv_layout != "HND":
            raise ValueError("the model managers hold HND pools (TensorRT-LLM's layout)")
        self.sim = sim
        self.device = sim.device
        self.num_layers = num_layers
        self.tokens_per_block = sim.page_size
        self.head_dim = sim.head_dim
        self.num_kv_heads_per_layer = [sim.num_kv_heads] * num_layers
        self.max_seq_len = sim.max_seq_len
        self.dtype = sim.dtype
        self.max_blocks_per_seq = sim.max_pages_per_seq
        self.max_batch_size = max_batch_size
        self.max_beam_width = sim.max_beam_width
        self.num_pools = 1
        self.is_vswa = False
        self.layer_offsets = {first_layer_idx + i: i for i in range(num_layers)}
        self.kv_cache_pool_mapping = torch.tensor([[0, i] for i in range(num_layers)], dtype=torch.int32)
        self.kv_cache_pool_pointers = torch.zeros(1, 2, dtype=torch.int64)
        self.max_attention_window_vec = [sim.max_seq_len] * num_layers
        gen = torch.Generator().manual_seed(1234)
        shape = (sim.num_pages, num_layers, 2, sim.num_kv_heads, sim.page_size, sim.head_dim)
        self._pool_data = torch.randn(shape, generator=gen).to(sim.dtype).to(sim.device)
        self._pool_data[:, served_layer].copy_(sim.kv_cache)
        sim.kv_cache = self._pool_data[:, served_layer]
        self.served_layer_idx = first_layer_idx + served_layer
        self.impl = SimpleNamespace(get_primary_pool_data=lambda local_layer_idx: self._pool_data)
        self._context_pages: Dict[int, List[int]] = {}
        self._next_context_id = 100000

    # -- requests -------------------------------------------------------------------------------
    def add_context_request(self, prompt_len: int) -> int:
        """A request in its context phase: pages for its prompt, written by the context kernel."""
        rid = self._next_context_id
        self._next_context_id += 1
        self._context_pages[rid] = [self.sim._alloc() for _ in range(-(-prompt_len // self.tokens_per_block))]
        return rid

    def _beam_pages(self, rid: int, beam_width: int) -> List[List[int]]:
        if rid in self._context_pages:
            return [self._context_pages[rid]]
        for req in self.sim.requests:
            if req.rid == rid:
                return [req.pages[b] for b in range(beam_width)]
        raise KeyError(f"model manager: unknown request id {rid}")

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor:
        view = self._pool_data[:, self.layer_offsets[layer_idx]]
        return view if kv_layout == "HND" else view.permute(0, 1, 3, 2, 4)

    def _k_entry(self, page: int) -> int:
        raise NotImplementedError

    def _write_rows(self, host, request_ids, beam_width, num_contexts):
        row = 0
        for c, rid in enumerate(request_ids):
            width = 1 if c < num_contexts else beam_width
            for beam_pages in self._beam_pages(rid, width)[:width]:
                entries = [self._k_entry(p) for p in beam_pages]
                host[0, row, :, :] = self._k_entry(STALE_PAGE)
                host[0, row, 0, : len(entries)] = torch.tensor(entries, dtype=torch.int32)
                host[0, row, 1, : len(entries)] = torch.tensor(entries, dtype=torch.int32) + 1
                row += 1
        return row


class ModelKVCacheManagerV1(_ModelKVCacheManagerBase):
    """Doc 4.2 (model): K entry = ``(block * numLayers + 0) * kv_factor``, V = K + 1; host table in batch-row order."""

    def __init__(self, sim, **kwargs):
        super().__init__(sim, **kwargs)
        self._model_divisor = self.num_layers * self.kv_factor
        rows = self.max_batch_size * self.max_beam_width
        self.host_kv_cache_block_offsets = torch.zeros(1, rows, 2, self.max_blocks_per_seq, dtype=torch.int32)

    def _k_entry(self, page: int) -> int:
        return page * self.num_layers * self.kv_factor

    def copy_batch_block_offsets(self, dst, request_ids, beam_width, num_contexts, num_seqs, max_blocks=None):
        rows = self._write_rows(self.host_kv_cache_block_offsets, request_ids, beam_width, num_contexts)
        assert rows == num_seqs, (rows, num_seqs)
        dst[:, :num_seqs].copy_(self.host_kv_cache_block_offsets[:, :num_seqs])


class ModelKVCacheManagerV2(_ModelKVCacheManagerBase):
    """Doc 4.3 (model): K entry = ``base_page_index * index_scales[pool]`` (scale = kv_factor, so
    base = page); ``get_batch_cache_indices`` returns beam 0's ``base * scale // kv_factor``; the host
    table is indexed by slot, not by batch row."""

    def __init__(self, sim, **kwargs):
        super().__init__(sim, **kwargs)
        self.index_scales = [self.kv_factor]
        self.kv_offset = [1]
        self._layer_scales: Dict[int, int] = {}
        self._model_divisor = self.kv_factor
        rows = self.max_batch_size * self.max_beam_width
        # Slot-indexed (doc 4.3): deliberately never filled in batch order.
        self.host_kv_cache_block_offsets = torch.full((1, rows, 2, self.max_blocks_per_seq), -1, dtype=torch.int32)

    def get_layer_page_index_scale(self, layer_idx: int) -> int:
        return self._layer_scales.get(layer_idx, self.index_scales[0])

    def _k_entry(self, page: int) -> int:
        return page * self.index_scales[0]

    def copy_batch_block_offsets(self, dst, request_ids, beam_width, num_contexts, num_seqs, max_blocks=None):
        staging = torch.zeros_like(dst[:, : max(num_seqs, 1)].cpu())
        rows = self._write_rows(staging, request_ids, beam_width, num_contexts)
        assert rows == num_seqs, (rows, num_seqs)
        dst[:, :num_seqs].copy_(staging[:, :num_seqs])

    def get_batch_cache_indices(self, request_ids, layer_idx=None, num_blocks_per_seq=None):
        scale = self.get_layer_page_index_scale(layer_idx) if layer_idx is not None else self.index_scales[0]
        return [[p * scale // self.kv_factor for p in self._beam_pages(rid, 1)[0]] for rid in request_ids]


def _build_resource_manager(m):
    class KVCacheManager(ModelKVCacheManagerV1):
        pass

    m.KVCacheManager = KVCacheManager


def _build_kv_cache_manager_v2(m):
    class KVCacheManagerV2(ModelKVCacheManagerV2):
        pass

    m.KVCacheManagerV2 = KVCacheManagerV2


def make_manager(model: TrtModel, sim: BeamSearchCacheSimulator, kind: str = "v1", **kwargs):
    """A model KV cache manager of ``kind`` (``"v1"``/``"v2"``) around ``sim``, under its real class name."""
    if kind == "v1":
        cls = importlib.import_module("tensorrt_llm._torch.pyexecutor.resource_manager").KVCacheManager
    else:
        cls = importlib.import_module("tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_manager_v2").KVCacheManagerV2
    return cls(sim, **kwargs)


# ==================================================================================================
# The engine's per-step input preparation (doc 3.2-3.5, 3.8), reduced to what attention sees


class Engine:
    """Drives one eager metadata (and optional CUDA-graph copies) from simulator steps."""

    def __init__(self, model: TrtModel, manager, max_batch_size: int = 8):
        self.model = model
        self.manager = manager
        self.sim = manager.sim
        trtllm = model.module(".trtllm")
        self.max_batch_size = max_batch_size
        self.max_beam_width = self.sim.max_beam_width
        self.metadata = trtllm.TrtllmAttentionMetadata(
            max_num_requests=max_batch_size,
            max_num_sequences=max_batch_size * self.max_beam_width,
            max_beam_width=self.max_beam_width,
            kv_cache_manager=manager,
        )
        # Doc 3.5: the engine's indirection buffer, [max_batch_size, max_beam_width, max_seq_len].
        self.cache_indirection = torch.zeros(
            max_batch_size, self.max_beam_width, self.sim.max_seq_len, dtype=torch.int32, device=self.sim.device
        )

    def graph_metadata(self, batch_size: int):
        return self.metadata.create_cuda_graph_metadata(batch_size)

    def prepare(self, step, context_prompt_lens: Sequence[int] = (), metadata=None, seed: int = 0,
                beam_width: Optional[int] = None, before=None):
        """Fill ``metadata`` for ``step`` (+ context requests) and call ``prepare()``; returns the fused QKV.

        Row order (doc 3.2): context requests' tokens, then generation rows request-major.
        ``beam_width`` overrides ``metadata.beam_width`` (the eager warm-up's width 1 on beam rows).
        ``before(metadata)``, if given, edits the filled fields just before ``prepare()`` (engine states
        the simulator does not produce).
        """
        m = metadata if metadata is not None else self.metadata
        m.kv_cache_manager = self.manager
        sim = self.sim
        context_ids = [self.manager.add_context_request(p) for p in context_prompt_lens]
        rows = step.num_rows
        num_requests = len(step.request_ids)
        m.beam_width = beam_width if beam_width is not None else step.beam_width if num_requests else 1
        m.num_contexts = len(context_ids)
        m.seq_lens = torch.tensor(list(context_prompt_lens) + [1] * rows, dtype=torch.int32)
        gen_ids = list(step.request_ids)
        if beam_width == 1 and step.beam_width > 1:  # width-1 metadata on beam rows: one id per row
            gen_ids = [rid for rid in gen_ids for _ in range(step.beam_width)]
        m.request_ids = context_ids + gen_ids
        m.prompt_lens = list(context_prompt_lens) + step.prompt_lens.cpu().tolist()
        interface = self.model.module(".interface")
        m.kv_cache_params = interface.KVCacheParams(
            use_cache=True,
            num_cached_tokens_per_seq=[0] * len(context_ids) + (step.kv_lens.cpu() - 1).tolist(),
        )
        self.cache_indirection[:num_requests] = step.cache_indirection[:num_requests]
        m.cache_indirection = self.cache_indirection
        if before is not None:
            before(m)
        m.prepare()
        hq, hkv, d = sim.num_qo_heads, sim.num_kv_heads, sim.head_dim
        gen = torch.Generator().manual_seed(seed)
        ctx_tokens = sum(context_prompt_lens)
        ctx_qkv = torch.randn(ctx_tokens, (hq + 2 * hkv) * d, generator=gen).to(sim.dtype).to(sim.device)
        gen_qkv = torch.cat(
            [step.q.reshape(rows, hq * d), step.new_k.reshape(rows, hkv * d), step.new_v.reshape(rows, hkv * d)], dim=1
        )
        return torch.cat([ctx_qkv, gen_qkv], dim=0)


def make_layer(model: TrtModel, sim: BeamSearchCacheSimulator, layer_idx: int = 0, **kwargs):
    """A model ``TrtllmAttention`` for the simulator's attention shape (its manager built now)."""
    trtllm = model.module(".trtllm")
    return trtllm.TrtllmAttention(layer_idx, sim.num_qo_heads, sim.head_dim, sim.num_kv_heads, **kwargs)


@dataclass
class Setup:
    """One simulated layer served through the model: simulator, manager, layer, engine."""

    model: TrtModel
    sim: BeamSearchCacheSimulator
    manager: object
    layer: object
    engine: Engine

    def oracle(self, step):
        """Float32 dense attention of every beam over its own history (independent of block offsets)."""
        return reference_beam_attention(
            step.q, self.sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
            step.beam_width, new_k=step.new_k, new_v=step.new_v,
        )

    def run(self, step, context_prompt_lens=(), metadata=None, before=None, **forward_kwargs):
        """Prepare ``step`` (``before``: see :meth:`Engine.prepare`) and run the layer; returns ``(out [tokens, H*D], qkv)``."""
        qkv = self.engine.prepare(step, context_prompt_lens, metadata=metadata, before=before)
        m = metadata if metadata is not None else self.engine.metadata
        return self.layer.forward(qkv, None, None, m, **forward_kwargs), qkv


def build(model: TrtModel, prompts=(37, 70), beam_width=4, kind="v1", num_qo_heads=4, num_kv_heads=2,
          head_dim=64, page_size=16, max_seq_len=128, dtype=torch.bfloat16, seed=0, num_layers=3,
          served_layer=1, max_batch_size=8, layer_kwargs=None, device="cpu") -> Setup:
    """A :class:`Setup`; call after the library is registered (layers pick libraries at construction)."""
    sim = BeamSearchCacheSimulator(
        list(prompts), beam_width=beam_width, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype, seed=seed,
        max_requests=max_batch_size, device=device,
    )
    manager = make_manager(model, sim, kind, num_layers=num_layers, served_layer=served_layer,
                           first_layer_idx=10, max_batch_size=max_batch_size)
    layer = make_layer(model, sim, layer_idx=manager.served_layer_idx, **(layer_kwargs or {}))
    return Setup(model, sim, manager, layer, Engine(model, manager, max_batch_size=max_batch_size))
