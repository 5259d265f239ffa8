"""Eligibility gates: why the library declines a layer, a batch or a call, as one-line reasons.

Three levels, following TensorRT-LLM's contract (trtllm-interfaces.md, 2.1 and 2.4):

- **Layer** (:func:`layer_decline_reason`, behind ``Fmha._is_available``): evaluated once when a
  layer's FMHA manager is built; only state final by then.
- **Batch** (:func:`batch_decline_reason`): properties of the metadata that are fixed for an
  engine (beam search on, no speculative decoding, a supported KV cache manager...). Shared by the
  selection gate and the per-step planner, so both always agree.
- **Call** (:func:`call_decline_reason`): the forward arguments of one layer call.

Every condition here is invariant within TensorRT-LLM's FMHA selection-cache key (section 2.4):
the key holds the bucketed context/generation batch sizes, the query length per generation row,
the mask type, speculative decoding, block sparsity and the output dtypes; everything else checked
here is fixed per layer or per engine (beam width is ``max_beam_width`` on beam-search steps with
generation rows, section 3.3; the warm-up's width-1 steps are handed over per step,
:func:`step_decline_reason`). Quantities that vary inside a key (prompt and KV lengths, the exact
request count) are never gated on here; the per-step planner handles those (``planning.py``).

:class:`DeclineLog` logs each distinct reason once, not once per call.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import threading
from typing import Dict, Optional

from .kv_cache import manager_decline_reason

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "CONTEXT_ONLY",
    "GENERATION_ONLY",
    "MAX_GROUP_SIZE",
    "MEASURED_MAJOR_CAPABILITIES",
    "device_decline_reason",
    "prefix_shape_decline_reason",
    "layer_decline_reason",
    "batch_decline_reason",
    "step_decline_reason",
    "call_decline_reason",
    "DeclineLog",
    "decline_log",
    "slow_step_log",
]

logger = logging.getLogger("beam_shared_prefix.trtllm")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_HALF_DTYPE_NAMES = ("bfloat16", "float16")
_PLAIN_KV_DTYPES = ("auto", "bfloat16", "float16", "bf16", "fp16", "half")


class DeclineLog:
    """Logs each kind of decline reason once per process.

    Reasons that differ only in their numbers (per-step ones name request counts and mean prompt
    lengths) are one kind: a long-running server logs and keeps one line per kind, not per value.
    """

    def __init__(self, prefix: str = "beam_shared_prefix declines: "):
        self._seen: Dict[str, str] = {}  # kind -> the first message of that kind
        self._lock = threading.Lock()
        self._prefix = prefix

    @staticmethod
    def _kind(message: str) -> str:
        return _NUMBER.sub("#", message)

    def __call__(self, level: int, message: str) -> None:
        """Log ``message`` at ``level`` (a ``logging`` level) unless a message of its kind (digits masked) was
        logged before."""
        kind = self._kind(message)
        with self._lock:
            if kind in self._seen:
                return
            self._seen[kind] = message
        logger.log(level, "%s%s", self._prefix, message)

    def seen(self, message_part: str) -> bool:
        """Whether a logged reason (the first of its kind) contains ``message_part`` (tests)."""
        with self._lock:
            return any(message_part in message for message in self._seen.values())

    def reset(self) -> None:
        """Forget every kind logged so far (tests, or a new serving session), so each is logged once more."""
        with self._lock:
            self._seen.clear()


decline_log = DeclineLog()
#: Steps the library serves although the rule would decline them (a CUDA graph cannot hand a step over).
slow_step_log = DeclineLog("beam_shared_prefix: ")


#: TensorRT-LLM's ``AttentionInputType`` values the adapter tells apart (read as ints: its enum or a plain int).
CONTEXT_ONLY = 1
GENERATION_ONLY = 2


def _enum_value(value):
    return getattr(value, "value", value)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _position_embedding_in_backend(attn) -> Optional[str]:
    """The name of the positional embedding this layer's backend would apply inside attention, or ``None``.

    ``TrtllmAttention.position_embedding_type`` is ``learned_absolute`` (0 in every version of
    ``PositionEmbeddingType``, an ``IntEnum``; a plain int on some trees) when the module applies its
    positional embedding before the backend, as Qwen3's fused QK-norm + RoPE does. Every other type
    is applied by the backend: RoPE variants, but also ``yarn``, ``chatglm``, ALiBi, ``relative`` and
    ``deferred`` (K cached before an external embedder), none of which ``is_rope()`` covers; the
    library reads the cache and Q as they are, so all of them are declined.
    """
    pe = getattr(attn, "position_embedding_type", None)
    if pe is None:
        return None
    try:
        value = int(pe)
    except (TypeError, ValueError):
        # A name (some configs keep the string): learned_absolute, with or without the enum's prefix, is applied
        # before the backend, as the value 0 is.
        if str(pe).strip().lower().rsplit(".", 1)[-1] == "learned_absolute":
            return None
        return f"{pe!r}"
    if value == 0:
        return None
    return getattr(pe, "name", None) or f"position_embedding_type={value}"


def _quant_mode(quant_mode):
    """``QuantMode`` from a layer's ``quant_mode``, which some trees keep as a plain int."""
    if quant_mode is None or hasattr(quant_mode, "has_kv_cache_quant"):
        return quant_mode
    from tensorrt_llm.quantization.mode import QuantMode  # an int: map it through TensorRT-LLM's flags

    return QuantMode(int(quant_mode))


def _kv_cache_quantized(attn) -> Optional[str]:
    for flag in ("has_fp8_kv_cache", "has_fp4_kv_cache", "has_int8_kv_cache"):
        if getattr(attn, flag, False):
            return flag.replace("has_", "").replace("_", " ")
    quant_mode = _quant_mode(getattr(attn, "quant_mode", None))
    check = getattr(quant_mode, "has_kv_cache_quant", None)
    # A method on the Python QuantMode, a property on the bindings' one.
    if check is not None and (check() if callable(check) else check):
        return "quantized KV cache"
    kv_dtype = getattr(attn, "kv_cache_dtype", "auto")
    # TrtllmAttention.kv_cache_dtype: "auto", "fp8", "fp8_ds_mla", "nvfp4" or a torch dtype string.
    if isinstance(kv_dtype, str) and kv_dtype.lower().replace("torch.", "") not in _PLAIN_KV_DTYPES:
        return f"kv_cache_dtype={kv_dtype!r}"
    return None


def backend_decline_reason(backend: str) -> Optional[str]:
    """Why the configured prefix backend cannot run here (package missing), or ``None``."""
    if importlib.util.find_spec("beam_shared_prefix.attention") is None:
        return "beam_shared_prefix.attention (the plan/run wrapper) is missing from this installation"
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    has_fa4 = importlib.util.find_spec("flash_attn") is not None
    if backend == "flashinfer" and not has_flashinfer:
        return "TLLM_BEAM_SHARED_PREFIX_BACKEND=flashinfer but flashinfer is not installed (pip install 'beam-shared-prefix[flashinfer]')"
    if backend == "fa4" and not has_fa4:
        return "TLLM_BEAM_SHARED_PREFIX_BACKEND=fa4 but flash-attn-4 is not installed (pip install 'beam-shared-prefix[fa4]')"
    if backend == "auto" and not (has_flashinfer or has_fa4) and _cuda_available():
        # Without either, "auto" would run the torch reference prefix on the GPU: correct but slower
        # than the default kernel, which is what the library must never be.
        return (
            "no GPU prefix backend installed (neither flashinfer nor flash-attn-4); "
            "pip install 'beam-shared-prefix[flashinfer]'"
        )
    return None


# The tail kernel's widest GQA group (triton_kernels.tail_merge.MAX_GROUP_SIZE; kept here so that
# the layer gate does not import Triton; tests/trtllm/test_trtllm_gates.py keeps the two equal).
MAX_GROUP_SIZE = 64


@functools.lru_cache(maxsize=None)
def prefix_shape_decline_reason(backend: str, device: str, dtype_name: str, head_dim: int, num_heads: int,
                                num_kv_heads: int, page_size: int, kv_layout: str = "HND") -> Optional[str]:
    """Why no GPU prefix backend the configured ``backend`` may run serves this layer's pool, or ``None``.

    Known once the layer's KV pool exists (dtype, page size). ``auto``, ``fa4`` and ``flashinfer``
    need FA4 or FlashInfer for the shape (``fa4`` falls back to FlashInfer; ``auto`` takes one of
    them whenever the cascade is not picked, and otherwise would run the torch reference prefix on
    the GPU, slower than the default kernel); ``triton`` needs the cascade to tile the shape or
    FlashInfer (its fallback). Without this, the plan raises inside TensorRT-LLM's ``prepare()``.
    """
    if backend == "reference" or not device.startswith("cuda"):  # off the GPU the reference prefix is the path
        return None
    import torch

    from ..prefix.select import BACKEND_CLASSES

    dtype = getattr(torch, dtype_name)
    candidates = {"auto": ("fa4", "flashinfer"), "fa4": ("fa4", "flashinfer"), "flashinfer": ("flashinfer",),
                  "triton": ("flashinfer",)}.get(backend, ("flashinfer",))
    if backend == "triton":
        from triton_kernels import cascade_supported

        if cascade_supported(num_heads // num_kv_heads, head_dim)[0] and dtype in (torch.bfloat16, torch.float16):
            return None
    why = []
    for name in candidates:
        ok, reason = BACKEND_CLASSES[name].is_available(device, dtype, head_dim, num_heads, num_kv_heads, page_size,
                                                        kv_layout)
        if ok:
            return None
        why.append(f"{name}: {reason}")
    return (f"TLLM_BEAM_SHARED_PREFIX_BACKEND={backend}: no prefix backend serves {dtype_name} K/V, head_dim="
            f"{head_dim}, {num_heads}/{num_kv_heads} heads, page size {page_size} ({'; '.join(why)}); install "
            f"flashinfer-python ('beam-shared-prefix[flashinfer]') for this shape")


#: Compute-capability majors the decline rule, ``auto``'s backend rule and the kernels' tiles were measured on:
#: Hopper (SM90: the H200, and the H100 in the fortieth round).
MEASURED_MAJOR_CAPABILITIES = (9,)


@functools.lru_cache(maxsize=None)
def device_decline_reason(device: str, decline: str) -> Optional[str]:
    """Why, under ``TLLM_BEAM_SHARED_PREFIX_DECLINE=decline``, the library declines every layer whose KV pool
    lives on ``device`` (``"cuda:0"``), or ``None``.

    With ``auto`` a GPU outside :data:`MEASURED_MAJOR_CAPABILITIES` is declined: the library cannot say it is
    faster there (its rules are H200 measurements, and its tiles were sized for Hopper's 228 KB of shared
    memory per multiprocessor). ``never`` serves it.
    """
    if decline != "auto" or not device.startswith("cuda"):
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major in MEASURED_MAJOR_CAPABILITIES:
        return None
    return (f"this GPU is SM{major}{minor}, and the library's speed rules and kernel tiles were measured on Hopper "
            f"(SM90) only; TLLM_BEAM_SHARED_PREFIX_DECLINE=never serves it anyway (measure it first: "
            f"beam-shared-prefix-bench --preset B-medium --sweep beams=14,30,96)")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def layer_decline_reason(attn, backend: str = "auto") -> Optional[str]:
    """Why the library cannot serve this attention layer at all, or ``None`` (``_is_available``)."""
    reason = backend_decline_reason(backend)
    if reason:
        return reason
    if getattr(attn, "is_mla_enable", False):
        return "MLA attention (the library serves dense GQA/MHA)"
    if getattr(attn, "sparse_params", None) is not None or getattr(attn, "sparse_attention_config", None) is not None:
        return "sparse attention"
    if getattr(attn, "predicted_tokens_per_seq", 1) not in (1, None):
        return f"predicted_tokens_per_seq={attn.predicted_tokens_per_seq} (speculative decoding)"
    if getattr(attn, "attention_chunk_size", None):
        return f"chunked (local) attention, attention_chunk_size={attn.attention_chunk_size}"
    head_dim = getattr(attn, "head_dim", None)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
    num_heads = getattr(attn, "num_heads", 0) or 0
    num_kv_heads = getattr(attn, "num_kv_heads", 0) or 0
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a positive multiple of num_kv_heads={num_kv_heads}"
    if num_heads // num_kv_heads > MAX_GROUP_SIZE:
        return (f"GQA group {num_heads // num_kv_heads} ({num_heads}/{num_kv_heads} heads) exceeds {MAX_GROUP_SIZE}, "
                f"the widest group the tail kernel tiles")
    if backend == "triton":
        # A shape the cascade kernel does not tile falls back to FlashInfer at plan time; without
        # FlashInfer that would fail mid-serving, so the layer is declined up front instead.
        from triton_kernels import cascade_supported

        ok, why = cascade_supported(num_heads // num_kv_heads, head_dim)
        if not ok and importlib.util.find_spec("flashinfer") is None:
            return (f"TLLM_BEAM_SHARED_PREFIX_BACKEND=triton: {why}, and flashinfer (its fallback) is not installed "
                    f"(pip install 'beam-shared-prefix[flashinfer]', or use backend auto)")
    quant = _kv_cache_quantized(attn)
    if quant:
        return f"KV cache quantization ({quant}); the library reads bf16/fp16 K/V"
    embedding = _position_embedding_in_backend(attn)
    if embedding is not None:
        return (
            f"positional embedding {embedding} is applied inside the attention backend for this layer; the library "
            f"needs Q/K already embedded by the module (position_embedding_type learned_absolute, e.g. Qwen3's "
            f"fused QK-norm + RoPE)"
        )
    return None


def batch_decline_reason(metadata) -> Optional[str]:
    """Why the library cannot serve this batch's generation rows, or ``None``.

    Only engine-level properties of the metadata (plus "are there generation rows at all", which
    the selection key distinguishes): the answer is the same for every step of a cache key.
    """
    num_generations = int(getattr(metadata, "num_generations", 0) or 0)
    if num_generations <= 0:
        return "no generation rows in the batch"
    beam_width = int(getattr(metadata, "beam_width", 1) or 1)
    if getattr(metadata, "is_cross", False):
        return "cross attention"
    if getattr(metadata, "enable_helix", False):
        return "helix (context) parallelism"
    if getattr(metadata, "is_spec_decoding_enabled", False) or getattr(metadata, "use_spec_decoding", False):
        return "speculative decoding"
    indirection = getattr(metadata, "cache_indirection", None)
    if indirection is None:
        return "no cache_indirection on the metadata"
    if indirection.dim() != 3 or indirection.shape[1] < max(beam_width, 2):
        if indirection.dim() == 3 and indirection.shape[1] <= 1:
            return "an engine without beam search (cache_indirection holds one beam; the library serves beam search)"
        return (
            f"cache_indirection of shape {tuple(indirection.shape)} was sized for fewer beams than "
            f"beam_width={beam_width}"
        )
    if _dtype_name(indirection.dtype) != "int32":
        return f"cache_indirection of dtype {_dtype_name(indirection.dtype)} (the kernels read int32)"
    # (not at one beam: a width-1 warm-up step's rows, one per id, may outnumber the request slots, and this verdict
    # is cached for a key that holds no width; step_decline_reason hands such a step over, step by step)
    if beam_width > 1 and indirection.shape[0] < num_generations // beam_width:
        return (f"cache_indirection holds {indirection.shape[0]} requests but the batch has "
                f"{num_generations // max(beam_width, 1)}")
    if getattr(metadata, "kv_cache_block_offsets", None) is None:
        return "no kv_cache_block_offsets (paged KV cache required)"
    params = getattr(metadata, "kv_cache_params", None)
    if params is None or not getattr(params, "use_cache", False):
        return "KV cache not in use for this batch"
    extra = getattr(params, "num_extra_kv_tokens", 0) or 0
    if extra:
        return f"num_extra_kv_tokens={extra}"
    reason = manager_decline_reason(getattr(metadata, "kv_cache_manager", None))
    if reason:
        return reason
    return None


def step_decline_reason(metadata) -> Optional[str]:
    """Why this step's generation rows go to ``fallback`` though the batch's key selected the library.

    Per step, not at selection: TensorRT-LLM's eager warm-up can run generation rows with
    ``beam_width`` left at 1 on an engine sized for beams (it sets ``max_beam_width`` only with a
    ``cache_indirection`` buffer or in graph warm-up), and the selection key holds no beam width. A
    decline at selection would cache ``fallback`` for the real beam steps of that key.
    """
    num_generations = int(getattr(metadata, "num_generations", 0) or 0)
    beam_width = int(getattr(metadata, "beam_width", 1) or 1)
    if beam_width <= 1:
        return f"beam width {beam_width} on this step ({num_generations} generation rows; a warm-up or dummy step)"
    if num_generations % beam_width:
        return f"{num_generations} generation rows are not a multiple of beam_width={beam_width}"
    # One id per generation request, beam_width rows each: rows of single-beam requests on a beam
    # engine would otherwise be planned as beams of one request (one prompt, one page table).
    ids = getattr(metadata, "request_ids", None)
    if ids is not None:
        num_contexts = int(getattr(metadata, "num_contexts", 0) or 0)
        if len(ids) - num_contexts != num_generations // beam_width:
            return (f"{len(ids) - num_contexts} generation request ids for {num_generations} rows of beam width "
                    f"{beam_width} (expected {num_generations // beam_width}, one per request)")
    return None


def _sparse_inputs_present(forward_args) -> bool:
    for holder_name in ("sparse_runtime_params", "sparse_prediction"):
        holder = getattr(forward_args, holder_name, None)
        if holder is None:
            continue
        for field_name in (
            "block_sparse_inputs",
            "sparse_kv_indices",
            "sparse_attn_indices",
        ):
            value = getattr(holder, field_name, None)
            # TrtllmAttention.forward always builds a SparseRuntimeParams (trtllm.py at 017aa0ca);
            # the native op treats an empty index tensor as "no sparse attention" (fmha/interface.py
            # StaticAttentionConfig.from_params at 0352547d), so only a non-empty one counts.
            if value is not None and (not hasattr(value, "numel") or value.numel() > 0):
                return True
    return False


def call_decline_reason(attn, q, k, v, metadata, forward_args) -> Optional[str]:
    """Why the library cannot serve this call's generation rows, or ``None``: ``q`` is the layer's query (the
    fused ``[num_tokens, (Hq + 2 * Hkv) * D]`` QKV projection when ``forward_args.is_fused_qkv``), ``k`` and ``v``
    the separate K/V inputs (``None`` when fused; the library serves only that), ``attn`` the TensorRT-LLM
    attention layer, ``metadata`` and ``forward_args`` its call's."""
    input_type = int(_enum_value(getattr(forward_args, "attention_input_type", 0)))
    if input_type == CONTEXT_ONLY:
        return "context-only attention call"
    if not getattr(forward_args, "is_fused_qkv", False) or k is not None or v is not None:
        return "separate K/V inputs (the library reads the fused QKV projection)"
    if not getattr(forward_args, "update_kv_cache", True):
        return "update_kv_cache=False"
    if str(_enum_value(getattr(forward_args, "attention_mask", "causal"))) != "causal":
        return f"attention mask {getattr(forward_args, 'attention_mask', None)!r} (only causal decode is served)"
    for name, what in (
        ("attention_mask_data", "custom attention mask data"),
        ("attention_sinks", "attention sinks"),
        ("relative_attention_bias", "relative attention bias"),
        ("cross_kv", "cross-attention K/V"),
        ("mrope_rotary_cos_sin", "M-RoPE applied by the backend"),
        ("out_scale", "quantized (FP8) attention output"),
        ("output_sf", "quantized (NVFP4) attention output"),
    ):
        if getattr(forward_args, name, None) is not None:
            return what
    if _sparse_inputs_present(forward_args):
        return "sparse attention inputs"
    if _dtype_name(q.dtype) not in _HALF_DTYPE_NAMES:
        return f"query dtype {_dtype_name(q.dtype)} (needs bfloat16 or float16)"
    output = getattr(forward_args, "output", None)
    if output is None:
        return "no preallocated output"
    if output.dtype != q.dtype:
        return f"output dtype {_dtype_name(output.dtype)} differs from the query dtype {_dtype_name(q.dtype)}"
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if q.dim() != 2 or q.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        return f"fused QKV of shape {tuple(q.shape)} does not hold (num_heads + 2 * num_kv_heads) * head_dim columns"
    # (the generation rows' q is a view of it from a row on: aligned wherever the buffer and its row pitch are)
    if q.data_ptr() % 16 or q.stride(0) * q.element_size() % 16:
        return (f"fused QKV at address {q.data_ptr():#x} with a row pitch of {q.stride(0) * q.element_size()} bytes is "
                f"not 16-byte aligned (FlashInfer's and FA4's prefix kernels move 16-byte vectors)")
    window = getattr(forward_args, "attention_window_size", None)
    max_seq_len = getattr(metadata, "max_seq_len", None)
    if window is not None and max_seq_len is not None and int(window) < int(max_seq_len):
        return f"sliding-window attention (window {window} < max_seq_len {max_seq_len})"
    num_ctx_tokens = int(getattr(metadata, "num_ctx_tokens", 0) or 0) if input_type != GENERATION_ONLY else 0
    if q.shape[0] - num_ctx_tokens != int(metadata.num_generations):
        return "more than one query token per generation row"
    return None
