"""Selection APIs of the TensorRT-LLM trees read upstream (docs/trtllm.md, "Verified against").

Three shapes of ``Fmha``/``PhasedFmha`` selection exist in the upstream files:

- shared ``@final`` wrappers ``is_available``/``is_supported`` around ``_is_available``/``_is_supported``
  hooks (new layout ``fmha/interface.py`` at 0352547d) - the interface model's default;
- no hooks: the base ``is_available``/``is_supported`` return True and each library overrides them
  (new layout at b0a6e828, old layout at 077c210e) - ``hooks="plain"`` in the interface model;
- per-phase questions ``is_context_supported``/``is_generation_supported`` on ``PhasedFmha`` and no
  ``FmhaPhase`` (old layout ``fmha/phased.py`` at 00e7d103) - a small stand-in package below.

On the last two the library must publish its gates under the public names itself; inheriting the
base's "True" would make it accept context batches, MLA layers and beam width 1.
"""

from __future__ import annotations

import sys
import types
from abc import ABC, abstractmethod

import pytest
import torch

from beam_shared_prefix.trtllm import register, stats
from beam_shared_prefix.trtllm.fmha import fmha_class_for
from interface_model import PositionEmbeddingType, QuantMode, build

LIB = "beam_shared_prefix"
TOL = 2e-2


def library_of(layer):
    found = [f for f in layer._fmha_manager.fmha_libs if type(f).__name__ == "BeamSharedPrefixFmha"]
    return found[0] if found else None


@pytest.mark.parametrize("layout", ["new", "old"])
def test_tree_without_selection_hooks(trt, monkeypatch, layout):
    """hooks="plain": the layer gate and the phase gate still apply, and beam decode is served."""
    model = trt(layout=layout, hooks="plain")
    fmha_libs = f"+{LIB}" if layout == "new" else f"triton_custom_mask,flashinfer_trtllm_gen,{LIB},fallback"
    monkeypatch.setenv("TLLM_FMHA_LIBS", fmha_libs)
    register()
    cls = model.registry.FMHA_LIBS[LIB]
    assert not hasattr(model.module(".fmha.interface").Fmha, "_is_available")
    trtllm = model.module(".trtllm")
    assert not cls.is_available(trtllm.TrtllmAttention(0, 4, 64, 2, mla=True, skip_create_weights_in_init=True))
    assert not cls.is_available(trtllm.TrtllmAttention(0, 4, 96, 2, skip_create_weights_in_init=True))

    setup = build(model, prompts=(37, 70), beam_width=3)
    ours = library_of(setup.layer)
    assert ours is not None
    step = setup.sim.begin_step()
    ref = setup.oracle(step)
    qkv = setup.engine.prepare(step)
    phase_enum = model.module(".fmha.interface").FmhaPhase
    args = model.module(".interface").AttentionForwardArgs(
        output=qkv.new_empty(qkv.shape[0], 4 * 64), is_fused_qkv=True, attention_window_size=setup.sim.max_seq_len
    )
    metadata = setup.engine.metadata
    assert not ours.is_supported(qkv, None, None, metadata, args, phase=phase_enum.CONTEXT)
    assert ours.is_supported(qkv, None, None, metadata, args, phase=phase_enum.GENERATION)
    out = setup.layer.forward(qkv, None, None, metadata)
    got = out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL, rtol=TOL)
    assert stats()["generation_forwards"] == 1


def test_tree_without_a_manager(trt, monkeypatch):
    """manager=False (trtllm.py at a15d8890): the layer keeps ``fmha_libs`` itself and ints for
    ``quant_mode`` and ``position_embedding_type``. The layer gates read the ints through TensorRT-LLM's
    enums, beam decode is served, and a declined step runs on the layer's own ``fallback`` instance
    (not a second one the library would build)."""
    model = trt(layout="new", manager=False)
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    trtllm = model.module(".trtllm")

    def ours_in(layer):
        return [f for f in layer.fmha_libs if type(f).__name__ == "BeamSharedPrefixFmha"]

    int8_kv = trtllm.TrtllmAttention(0, 4, 64, 2, quant_mode=QuantMode.INT8_KV_CACHE)
    yarn = trtllm.TrtllmAttention(0, 4, 64, 2, position_embedding_type=PositionEmbeddingType.yarn)
    assert isinstance(int8_kv.quant_mode, int) and isinstance(yarn.position_embedding_type, int)
    assert not ours_in(int8_kv) and not ours_in(yarn)
    assert not hasattr(int8_kv, "_fmha_manager")

    setup = build(model, prompts=(37, 70), beam_width=3)
    (ours,) = ours_in(setup.layer)
    fallback = [f for f in setup.layer.fmha_libs if type(f).__name__ == "FallbackFmha"]
    assert ours._get_delegate() is fallback[0] and not ours._owns_delegate
    step = setup.sim.begin_step()
    ref = setup.oracle(step)
    qkv = setup.engine.prepare(step)
    out = setup.layer.forward(qkv, None, None, setup.engine.metadata)
    got = out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL, rtol=TOL)
    assert stats()["generation_forwards"] == 1


def _per_phase_tree(monkeypatch, root: str):
    """A stand-in for the old layout at 00e7d103 (interface.py at 077c210e): plain ``Fmha`` and a
    ``PhasedFmha`` asked per phase; no FmhaPhase anywhere."""

    class Fmha(ABC):
        def __init__(self, attn=None):
            self.attn = attn

        @classmethod
        def is_available(cls, attn=None) -> bool:
            return True

        def is_supported(self, q, k, v, metadata, forward_args) -> bool:
            return True

        @abstractmethod
        def forward(self, q, k, v, metadata, forward_args) -> None: ...

    class PhasedFmha(Fmha):
        def is_context_supported(self, q, k, v, metadata, forward_args) -> bool:
            return False

        def is_generation_supported(self, q, k, v, metadata, forward_args) -> bool:
            return False

        def forward(self, q, k, v, metadata, forward_args) -> None:
            raise NotImplementedError

    for name, attrs in (
        (root, {}),
        (root + ".fmha", {}),
        (root + ".fmha.interface", {"Fmha": Fmha}),
        (root + ".fmha.phased", {"PhasedFmha": PhasedFmha}),
    ):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return root + ".fmha"


def test_tree_with_per_phase_questions(monkeypatch):
    """The library answers CONTEXT with no and GENERATION through its own gates, on that tree's API."""
    package = _per_phase_tree(monkeypatch, "bsp_test_per_phase_tree")
    cls = fmha_class_for(package)
    calls = []

    def fake_is_supported(self, q, k, v, metadata, forward_args, *, phase=None, **kwargs):
        calls.append(phase)
        return phase != "context"

    monkeypatch.setattr(cls, "_is_supported", fake_is_supported)
    lib = cls.__new__(cls)  # the gates only; no layer needed
    assert lib.is_context_supported(None, None, None, None, None) is False
    assert lib.is_generation_supported(None, None, None, None, None) is True
    assert lib.is_supported(None, None, None, None, None) is True
    assert calls == ["generation", None]
    assert cls.is_available(None) is False  # no layer: never available
    assert cls._bsp_api.FmhaPhase is None


def test_empty_sparse_index_tensors_are_dense():
    """TrtllmAttention.forward always builds SparseRuntimeParams (trtllm.py at 017aa0ca); an empty
    index tensor means dense attention to the native op, so it must not decline the call."""
    from types import SimpleNamespace

    from beam_shared_prefix.trtllm.gates import _sparse_inputs_present

    def args(**fields):
        return SimpleNamespace(sparse_runtime_params=SimpleNamespace(**fields))

    assert not _sparse_inputs_present(args(sparse_attn_indices=torch.empty(0, dtype=torch.int32)))
    assert not _sparse_inputs_present(args(block_sparse_inputs=None))
    assert _sparse_inputs_present(args(sparse_kv_indices=torch.zeros(3, dtype=torch.int32)))


def test_per_layer_page_tables_are_declined():
    """kv_cache_block_offsets has num_attention_op_pools rows in dim 0 (trtllm.py at 017aa0ca); the
    library indexes it by pool, so a manager with per-layer tables is declined with the reason."""
    from beam_shared_prefix.trtllm.kv_cache import manager_decline_reason

    class KVCacheManagerV2:
        kv_factor, tokens_per_block, num_pools = 2, 32, 1

    manager = KVCacheManagerV2()
    assert manager_decline_reason(manager) is None
    manager.num_attention_op_pools = 28
    assert "28 attention-op page tables for 1 pools" in manager_decline_reason(manager)
