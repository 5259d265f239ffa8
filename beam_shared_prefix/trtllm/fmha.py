"""The TensorRT-LLM ``Fmha`` subclass: selection gates, forward, and mixed-batch dispatch.

The class is built per source layout by :func:`fmha_class_for`, on that tree's own ``PhasedFmha``
(or ``Fmha``) base, because the two layouts have distinct base classes (trtllm-interfaces.md, 0.1).
All behaviour lives in :class:`BeamSharedPrefixFmhaMixin`.

Selection (sections 2.1, 2.3, 2.4):

- ``_is_available(attn)``: the layer gates of :func:`gates.layer_decline_reason`.
- ``_is_supported(..., phase)``: ``CONTEXT`` is always declined. Batch and call gates apply to the
  generation rows. Every condition is invariant within the manager's selection-cache key. The
  decline rule is not applied here: its verdict at a beam width depends on the prompt length
  (eager steps) or on whether the step is a CUDA graph (prompt unknown), neither of which the key
  holds, so it is judged per step (``planning.py``) and a declined step goes to ``fallback``.

Mixed batches (context and generation requests in one step). TensorRT-LLM's manager asks each
library in order the phase-less question first, then ``CONTEXT``/``GENERATION``; it builds a
``CombinedFmha`` only when two *different* libraries answer the two phases before any library
answers the phase-less question (section 2.3). ``fallback`` answers the phase-less question for
everything, so a library that only answered ``GENERATION`` would lose every mixed batch to
``fallback`` unless an earlier library had taken ``CONTEXT``. Hence:

- If a library listed *before* this one takes the ``CONTEXT`` phase, this one declines the
  phase-less question and answers ``GENERATION``: the manager combines the two
  (``CombinedFmha.run_generation`` then calls :meth:`run_generation`, which reads the phase's
  ``FmhaParams``; both field-name variants of section 0.2 (a)/(b) are handled, others fail clearly).
- Otherwise it answers the phase-less question itself and acts as its own combined library: the
  context rows are handed to the ``fallback`` library (a ``context_only`` call on the same
  tensors), the generation rows are served here.

A step the per-step decline rule turns down is handed whole to the ``fallback`` library.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from .gates import (CONTEXT_ONLY, GENERATION_ONLY, _enum_value, batch_decline_reason, call_decline_reason,
                    decline_log, device_decline_reason, layer_decline_reason, prefix_shape_decline_reason)
from .kv_cache import adapter_for
from .planning import (Family, ensure_prepare_hook, register_instance, retire_family, runtime_view, step_for_forward,
                       wrapper_for)
from .registration import FALLBACK_NAME, LIB_NAME, OUT_OF_TREE_MARK, current_settings

__all__ = ["BeamSharedPrefixFmhaMixin", "fmha_class_for", "stats"]

#: Host-side counters (tests, end-to-end check). Forwards replayed inside a CUDA graph run no
#: Python and are not counted.
stats: Dict[str, int] = {
    "generation_forwards": 0,
    "delegated_steps": 0,
    "mixed_batches": 0,
    "combined_generation_calls": 0,
    "kernel_build_failures": 0,
}

_BENIGN = ("no generation rows", "beam width 1", "context-only attention call")


def _phase_name(phase) -> Optional[str]:
    return None if phase is None else str(_enum_value(phase)).lower()


def _log_decline(reason: str) -> None:
    decline_log(logging.DEBUG if reason.startswith(_BENIGN) else logging.WARNING, reason)


def _is_kernel_build_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a launch, is Triton failing to build one of the library's kernels on this machine at
    a tiling's first launch: one of Triton's own errors (its front end, ``ptxas``, a tiling past the GPU's resources),
    or its install missing an NVIDIA tool (``Cannot find ptxas-blackwell``, raised from ``triton/knobs.py``). Triton
    is imported here: the adapter imports it only once a step runs."""
    from triton.errors import TritonError

    if isinstance(exc, TritonError):
        return True
    if not (isinstance(exc, RuntimeError) and str(exc).startswith("Cannot find ")):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    path = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return os.path.basename(path) == "knobs.py" and os.path.basename(os.path.dirname(path)) == "triton"


def _with_input_type(forward_args, value: int):
    """A copy of ``forward_args`` with ``attention_input_type`` set to ``value`` (same enum type)."""
    current = forward_args.attention_input_type
    enum_cls = type(current)
    new = value if enum_cls is int else enum_cls(value)
    if dataclasses.is_dataclass(forward_args):
        return dataclasses.replace(forward_args, attention_input_type=new)
    clone = copy.copy(forward_args)
    clone.attention_input_type = new
    return clone


def _first_attr(obj, names):
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class _Api:
    """The installed tree's FMHA classes the subclass is built on."""

    fmha_package: str
    Fmha: type
    PhasedFmha: Optional[type]
    FmhaPhase: Optional[type]


class BeamSharedPrefixFmhaMixin:
    """Cascade attention for wide beam-search decode (see the module docstring)."""

    LIB_NAME = LIB_NAME
    # The library keeps its own buffers; it never shrinks or reads metadata.workspace.
    supports_workspace_reclamation = False
    _bsp_api: _Api  # set on each built class

    def __init__(self, attn):
        super().__init__(attn)
        self._delegate = None
        self._delegate_resolved = False
        self._owns_delegate = False
        self._family_cache = None
        self._lock = threading.Lock()
        # Layers are built after every import, so TensorRT-LLM's metadata class exists by now.
        ensure_prepare_hook(type(self))
        register_instance(self)

    # -- selection ----------------------------------------------------------------------------
    @classmethod
    def _is_available(cls, attn) -> bool:
        parent = getattr(super(), "_is_available", None)
        if parent is not None and not parent(attn):
            return False
        reason = layer_decline_reason(attn, current_settings().backend)
        if reason is not None:
            decline_log(logging.WARNING, f"layer not served: {reason}")
            return False
        return True

    def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None, **kwargs) -> bool:
        phase_name = _phase_name(phase)
        if phase_name == "context":
            return False
        attn = self.attn
        reason = batch_decline_reason(metadata) or call_decline_reason(attn, q, k, v, metadata, forward_args)
        if reason is None:
            reason = self._layer_kv_reason(metadata, q)
        if reason is not None:
            _log_decline(reason)
            return False
        input_type = int(_enum_value(forward_args.attention_input_type))
        mixed = input_type != GENERATION_ONLY and int(metadata.num_contexts) > 0
        if not mixed or phase_name == "generation":
            return True
        return self._serves_mixed_batch_itself(q, k, v, metadata, forward_args)

    def _layer_kv_reason(self, metadata, q) -> Optional[str]:
        try:
            layer = adapter_for(metadata.kv_cache_manager).layer(self.attn.layer_idx)
        except RuntimeError as exc:  # e.g. the layer's cache lives on another manager
            return str(exc).replace("beam_shared_prefix: ", "")
        if layer.decline_reason is not None:
            return layer.decline_reason
        pool = layer.pool
        attn = self.attn
        if pool.dtype != q.dtype:
            return f"KV pool dtype {pool.dtype} differs from the query dtype {q.dtype}"
        if not self._pool_fits_layer(layer):
            expected = (2, attn.num_kv_heads, layer.page_size, attn.head_dim)
            return f"KV pool view of shape {tuple(pool.shape)} is not [pages, 2, Hkv, page_size, D] = [*, {expected}]"
        return self._prefix_shape_reason(layer)

    def _pool_fits_layer(self, layer) -> bool:
        """Whether the layer's pool view is ``[pages, 2, Hkv, page_size, D]`` for this layer's heads."""
        attn, pool = self.attn, layer.pool
        return pool.dim() == 5 and tuple(pool.shape[1:]) == (2, attn.num_kv_heads, layer.page_size, attn.head_dim)

    def _prefix_shape_reason(self, layer) -> Optional[str]:
        """:func:`gates.device_decline_reason` and :func:`gates.prefix_shape_decline_reason` for this layer's pool."""
        pool, attn, settings = layer.pool, self.attn, current_settings()
        return device_decline_reason(str(pool.device), settings.decline) or prefix_shape_decline_reason(
            settings.backend, str(pool.device), str(pool.dtype).replace("torch.", ""), attn.head_dim, attn.num_heads,
            attn.num_kv_heads, layer.page_size)

    def _takes_context(self, lib, q, k, v, metadata, forward_args) -> Optional[bool]:
        """Whether ``lib`` takes the CONTEXT phase of this batch (``None``: this tree cannot ask).

        Two APIs exist: ``is_supported(..., phase=FmhaPhase.CONTEXT)`` (new layout, 0352547d) and
        ``is_context_supported(...)`` on trees without ``FmhaPhase`` (old layout, 00e7d103).
        """
        phase_enum = self._bsp_api.FmhaPhase
        if phase_enum is not None:
            return bool(lib.is_supported(q, k, v, metadata, forward_args, phase=phase_enum.CONTEXT))
        ask = getattr(lib, "is_context_supported", None)
        if ask is not None:
            return bool(ask(q, k, v, metadata, _with_input_type(forward_args, CONTEXT_ONLY)))
        return None

    def _serves_mixed_batch_itself(self, q, k, v, metadata, forward_args) -> bool:
        api = self._bsp_api
        if api.PhasedFmha is None:
            decline_log(logging.WARNING, "mixed batch: this TensorRT-LLM has no PhasedFmha to split phases")
            return False
        earlier = self._earlier_context_library(q, k, v, metadata, forward_args)
        if earlier is not None:
            decline_log(
                logging.INFO,
                f"mixed batches: context rows to {type(earlier).__name__}, generation rows to {LIB_NAME} "
                "(through TensorRT-LLM's CombinedFmha)",
            )
            return False
        delegate = self._get_delegate()
        if delegate is None:
            decline_log(logging.WARNING, f"mixed batch: no {FALLBACK_NAME!r} library to serve its context rows")
            return False
        takes = self._takes_context(delegate, q, k, v, metadata, forward_args)
        if takes is None:
            decline_log(logging.WARNING, "mixed batch: this TensorRT-LLM cannot ask a library for the CONTEXT phase")
            return False
        if not takes:
            decline_log(logging.WARNING, f"mixed batch: the {FALLBACK_NAME!r} library declines its context rows")
            return False
        return True

    def _manager_libs(self):
        """The layer's library list: its ``FmhaManager``'s, or, in trees without a manager, the layer's own."""
        manager = getattr(self.attn, "_fmha_manager", None)
        libs = getattr(manager, "fmha_libs", None) if manager is not None else getattr(self.attn, "fmha_libs", None)
        return list(libs or [])

    def _earlier_context_library(self, q, k, v, metadata, forward_args):
        """A PhasedFmha listed before this library that takes the CONTEXT phase, or None."""
        libs = self._manager_libs()
        if not any(lib is self for lib in libs):
            return None
        api = self._bsp_api
        for lib in libs:
            if lib is self:
                return None
            if isinstance(lib, api.PhasedFmha) and self._takes_context(lib, q, k, v, metadata, forward_args):
                return lib
        return None

    def _get_delegate(self):
        """The ``fallback`` library instance of this layer (the manager's own if it has one)."""
        if self._delegate_resolved:
            return self._delegate
        with self._lock:
            if self._delegate_resolved:
                return self._delegate
            registry = importlib.import_module(self._bsp_api.fmha_package + ".registry")
            fallback_cls = registry.FMHA_LIBS.get(FALLBACK_NAME)
            delegate = None
            if fallback_cls is not None:
                for lib in self._manager_libs():
                    if type(lib) is fallback_cls:
                        delegate = lib
                        break
                if delegate is None and fallback_cls.is_available(self.attn):
                    delegate = fallback_cls(self.attn)
                    self._owns_delegate = True
            self._delegate = delegate
            self._delegate_resolved = True
            return delegate

    # -- execution ----------------------------------------------------------------------------
    def _family(self, metadata, dtype) -> Family:
        return self._family_from(adapter_for(metadata.kv_cache_manager), dtype)

    def _family_from(self, adapter, dtype) -> Family:
        cached = self._family_cache
        if cached is not None and cached[0] is adapter and cached[1] == dtype:
            return cached[2]
        attn = self.attn
        layer = adapter.layer(attn.layer_idx)
        sm_scale = 1.0 / (math.sqrt(attn.head_dim) * float(getattr(attn, "q_scaling", 1.0) or 1.0))
        family = Family(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, sm_scale, layer.pool_index, attn.layer_idx)
        family = adapter.families.setdefault(family.key, family)
        self._family_cache = (adapter, dtype, family)
        return family

    def family_on(self, adapter) -> Optional[Family]:
        """This layer's family on ``adapter``'s manager, from the pool's dtype (``None`` if the layer
        has no usable pool there). Lets ``prepare()`` plan it before the layer's first forward."""
        try:
            attn = self.attn
            if attn.layer_idx not in (getattr(adapter.manager, "layer_offsets", None) or {}):
                return None
            layer = adapter.layer(attn.layer_idx)
        except RuntimeError:
            return None
        pool = layer.pool
        if layer.decline_reason is not None or str(pool.dtype) not in ("torch.bfloat16", "torch.float16"):
            return None
        if not self._pool_fits_layer(layer):
            return None
        # A layer whose pool no configured prefix backend serves is never selected: not planned either.
        if self._prefix_shape_reason(layer) is not None:
            return None
        return self._family_from(adapter, pool.dtype)

    def _run_rows(self, qkv_rows, out_rows, metadata, state, step, family) -> None:
        """Attention of the step's generation rows; writes ``out_rows`` and this token's K/V."""
        attn = self.attn
        rows = step.num_rows
        if qkv_rows.shape[0] != rows:
            raise RuntimeError(
                f"beam_shared_prefix: {qkv_rows.shape[0]} generation rows reached the layer but the step was "
                f"planned for {step.num_requests} requests x {step.beam_width} beams = {rows}"
            )
        num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
        # Views of the fused QKV rows (row stride (H + 2 Hkv) * D): no copies.
        q = qkv_rows[:, :q_cols].view(rows, num_heads, head_dim)
        new_k = qkv_rows[:, q_cols : q_cols + kv_cols].view(rows, num_kv_heads, head_dim)
        new_v = qkv_rows[:, q_cols + kv_cols : q_cols + 2 * kv_cols].view(rows, num_kv_heads, head_dim)
        out = out_rows.view(rows, num_heads, head_dim)
        wrapper = wrapper_for(metadata, state, step, family)
        state.served_families.add(family.key)
        layer = step.adapter.layer(attn.layer_idx)
        seq0 = step.num_contexts
        # TensorRT-LLM's own block-offset encoding, K field, rows from this phase's first sequence.
        beam_page_table = metadata.kv_cache_block_offsets[layer.pool_index, seq0:, 0, :]
        kv_lens = runtime_view(metadata, "kv_lens_cuda_runtime", "kv_lens_cuda")[seq0 : seq0 + rows]
        # Some trees size cache_indirection one position past max_seq_len (for the overlap scheduler); no
        # position past the page table can be cached, so the view stops there (no copy).
        cache_indirection = metadata.cache_indirection
        positions = beam_page_table.shape[1] * layer.page_size
        if cache_indirection.shape[2] > positions:
            cache_indirection = cache_indirection[:, :, :positions]
        wrapper.run(
            q,
            layer.pool,
            beam_page_table,
            kv_lens,
            cache_indirection,
            new_k=new_k,
            new_v=new_v,
            out=out,
            page_index_divisor=layer.page_index_divisor,
        )
        stats["generation_forwards"] += 1

    def _declined_step(self, step, family) -> Optional[object]:
        """The delegate to hand this step to when the per-step rule declines it, else None."""
        reason = step.decline_reason(family)
        if reason is None:
            return None
        delegate = self._get_delegate()
        if delegate is None:
            if step.must_hand_over(family):
                raise RuntimeError(f"beam_shared_prefix: {reason}, and no {FALLBACK_NAME!r} library to hand the "
                                   f"step to; remove beam_shared_prefix from TLLM_FMHA_LIBS for this engine")
            decline_log(logging.WARNING, f"{reason}; no {FALLBACK_NAME!r} library to hand the step to, serving it")
            return None
        decline_log(logging.INFO, f"step handed to {FALLBACK_NAME!r}: {reason}")
        stats["delegated_steps"] += 1
        return delegate

    def forward(self, q, k, v, metadata, forward_args) -> None:
        """Serve the call: generation rows here, context rows (mixed batch) by ``fallback``.

        ``q`` is the fused QKV projection, ``[num_tokens, (Hq + 2 * Hkv) * D]`` in the layer's dtype (bf16 or fp16),
        context tokens first, then one row per beam; ``k`` and ``v`` are ``None`` (separate K/V inputs are declined
        before this call, :func:`~.gates.call_decline_reason`). Writes ``forward_args.output`` (``[num_tokens,
        Hq * D]``, the layer's dtype) and the current token's K/V into the layer's pool.
        """
        output = forward_args.output
        if output is None:
            raise RuntimeError("beam_shared_prefix: forward_args.output must be preallocated")
        input_type = int(_enum_value(forward_args.attention_input_type))
        state, step = step_for_forward(metadata)
        family = self._family(metadata, q.dtype)
        delegate = self._declined_step(step, family)
        if delegate is not None:
            delegate.forward(q, k, v, metadata, forward_args)
            return
        token0, context = 0, None
        if input_type != GENERATION_ONLY:
            token0 = int(metadata.num_ctx_tokens)
            if int(metadata.num_contexts) > 0:
                context = self._get_delegate()
                if context is None:
                    raise RuntimeError(f"beam_shared_prefix: mixed batch without a {FALLBACK_NAME!r} library")
        rows = step.num_rows
        if q.shape[0] != token0 + rows:  # (too few rows are refused by _run_rows; more would go unwritten)
            raise RuntimeError(
                f"beam_shared_prefix: the layer got {q.shape[0]} query rows but the step holds {token0} context tokens "
                f"and {step.num_requests} requests x {step.beam_width} beams = {rows} generation rows; every row must "
                f"be written, and this metadata does not say how."
            )
        # The generation rows first: where a kernel fails to build, the whole call (context rows too) is handed over.
        # The two phases touch different sequences' rows and pages, so their order is free.
        served = self._serve_rows(q[token0 : token0 + rows], output[token0 : token0 + rows], metadata, state, step,
                                  family, lambda delegate: delegate.forward(q, k, v, metadata, forward_args))
        if served and context is not None:
            context.forward(q, k, v, metadata, _with_input_type(forward_args, CONTEXT_ONLY))
            stats["mixed_batches"] += 1

    def _serve_rows(self, qkv_rows, out_rows, metadata, state, step, family, hand_over) -> bool:
        """:meth:`_run_rows`, or, where one of the library's kernels does not build, ``hand_over(fallback)`` (from
        :meth:`_build_failure_delegate`); returns whether the library served the rows."""
        try:
            self._run_rows(qkv_rows, out_rows, metadata, state, step, family)
        except Exception as exc:
            if not _is_kernel_build_error(exc):
                raise
            hand_over(self._build_failure_delegate(exc, state, family))
            return False
        return True

    def _build_failure_delegate(self, exc: Exception, state, family: Family):
        """The ``fallback`` library to hand a call to after one of the library's Triton kernels failed to build on this
        machine (``exc``, raised at a tiling's first launch, which therefore ran nothing; the kernels before it wrote
        no K/V but this token's, which the default kernel writes again). Later eager steps of ``family`` are declined
        (:func:`~.planning.retire_family`), with one ERROR in the log. Inside a CUDA graph, or without ``fallback``,
        it raises: neither can hand the step over."""
        import torch

        detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        what = f"a Triton kernel of the library does not build on this machine ({type(exc).__name__}: {detail})"
        if state.is_cuda_graph or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError(f"beam_shared_prefix: {what}, in a CUDA-graph step, which cannot hand the step to the "
                               f"default kernel; run without CUDA graphs, or without beam_shared_prefix in "
                               f"TLLM_FMHA_LIBS") from exc
        delegate = self._get_delegate()
        if delegate is None:
            raise RuntimeError(f"beam_shared_prefix: {what}, and no {FALLBACK_NAME!r} library to hand the step to; "
                               f"remove beam_shared_prefix from TLLM_FMHA_LIBS") from exc
        reason = retire_family(family, what)
        decline_log(logging.ERROR, f"{reason}: this call and every later eager step go to {FALLBACK_NAME!r}")
        stats["kernel_build_failures"] += 1
        return delegate

    # -- the generation half of TensorRT-LLM's CombinedFmha -------------------------------------
    def prepare_workspace(self, *args, **kwargs) -> None:
        """Let ``fallback`` size the shared workspace (it runs declined steps); this library needs none."""
        delegate = self._get_delegate()
        prepare = getattr(delegate, "prepare_workspace", None)
        if prepare is not None:  # (fallback libraries of trees without CombinedFmha have none)
            prepare(*args, **kwargs)

    def run_generation(self, params) -> None:
        """Generation phase from ``FmhaParams`` (``CombinedFmha`` path)."""
        metadata = getattr(params, "meta", None)
        qkv = _first_attr(params, ("qkv_or_q", "qkv_input", "attention_input"))
        out = _first_attr(params, ("output", "context_buf"))
        if metadata is None or qkv is None or out is None:
            fields = sorted(f.name for f in dataclasses.fields(params)) if dataclasses.is_dataclass(params) else sorted(vars(params))
            raise RuntimeError(
                "beam_shared_prefix: this TensorRT-LLM's FmhaParams has none of the fields the library reads "
                "(meta, qkv_or_q/qkv_input/attention_input, output/context_buf); found "
                f"{fields}. The library cannot be the generation half of a CombinedFmha here: remove it from "
                "TLLM_FMHA_LIBS, or list it before the context library so it serves mixed batches itself."
            )
        state, step = step_for_forward(metadata)
        family = self._family(metadata, qkv.dtype)
        delegate = self._declined_step(step, family)
        if delegate is not None:
            delegate.run_generation(params)
            return
        if self._serve_rows(qkv, out, metadata, state, step, family, lambda delegate: delegate.run_generation(params)):
            stats["combined_generation_calls"] += 1

    def release(self) -> None:
        """Release the default-kernel delegate this instance built (not one it was given), then the parent's."""
        if self._owns_delegate and self._delegate is not None:
            release = getattr(self._delegate, "release", None)
            if release is not None:
                release()
        parent = getattr(super(), "release", None)
        if parent is not None:
            parent()


def _plain_is_available(cls, attn=None) -> bool:
    return attn is not None and cls._is_available(attn)


def _plain_is_supported(self, q, k, v, metadata, forward_args, *, phase=None, **kwargs) -> bool:
    return self._is_supported(q, k, v, metadata, forward_args, phase=phase)


def _never_context(self, q, k, v, metadata, forward_args) -> bool:
    return False


def _generation_supported(self, q, k, v, metadata, forward_args) -> bool:
    return self._is_supported(q, k, v, metadata, forward_args, phase="generation")


_classes: Dict[str, type] = {}
_classes_lock = threading.Lock()


def _maybe_import(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise


def fmha_class_for(fmha_package: str) -> type:
    """The library's ``Fmha`` subclass for the FMHA package ``fmha_package`` (built once)."""
    with _classes_lock:
        cls = _classes.get(fmha_package)
        if cls is not None:
            return cls
        interface = _maybe_import(fmha_package + ".interface")
        if interface is None or not hasattr(interface, "Fmha"):
            raise RuntimeError(
                f"beam_shared_prefix: {fmha_package}.interface has no Fmha base class; this TensorRT-LLM's FMHA "
                f"API is not supported. Remove {LIB_NAME} from TLLM_FMHA_LIBS."
            )
        phased = _maybe_import(fmha_package + ".phased")
        phased_cls = getattr(phased, "PhasedFmha", None) if phased is not None else None
        phase_enum = getattr(interface, "FmhaPhase", None) or getattr(phased, "FmhaPhase", None)
        api = _Api(fmha_package, interface.Fmha, phased_cls, phase_enum)
        base = phased_cls or interface.Fmha
        namespace = {
            "__module__": __name__,
            "__qualname__": "BeamSharedPrefixFmha",
            "__doc__": BeamSharedPrefixFmhaMixin.__doc__,
            "_bsp_api": api,
            OUT_OF_TREE_MARK: True,
        }
        # Trees whose Fmha has no ``_is_available``/``_is_supported`` hooks (new layout at
        # b0a6e828, old layout at 077c210e: ``is_available``/``is_supported`` return True and each
        # library overrides them) would otherwise accept every request through the base.
        if not hasattr(base, "_is_available"):
            namespace["is_available"] = classmethod(_plain_is_available)
        if not hasattr(base, "_is_supported"):
            namespace["is_supported"] = _plain_is_supported
        # Trees that ask phased libraries per phase (old layout at 00e7d103:
        # ``is_context_supported`` / ``is_generation_supported``, no FmhaPhase).
        if hasattr(base, "is_generation_supported"):
            namespace["is_context_supported"] = _never_context
            namespace["is_generation_supported"] = _generation_supported
        cls = type(base)("BeamSharedPrefixFmha", (BeamSharedPrefixFmhaMixin, base), namespace)
        _classes[fmha_package] = cls
        return cls
