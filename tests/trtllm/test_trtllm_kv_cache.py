"""KV cache manager adapters (V1 and V2), pool views, and the manager's replacement.

Against the interface model's managers (``interface_model.py``; models of doc 4.2/4.3 on top of the
simulator, not TensorRT-LLM).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from beam_shared_prefix.trtllm import kv_cache, planning, register, stats
from beam_shared_prefix.trtllm.gates import decline_log
from interface_model import build

LIB = "beam_shared_prefix"


@pytest.fixture
def model(trt, monkeypatch):
    m = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    return m


def beam0_prompt_pages(sim):
    return [req.pages[0][: -(-req.prompt_len // sim.page_size)] for req in sim.requests]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_adapter_pages_and_divisor(model, kind):
    """Doc 4.2: V1 prompt pages come from host block-offset rows num_contexts + r*W (beam 0) divided by
    layers_in_pool * kv_factor; doc 4.3: V2 from get_batch_cache_indices (beam 0), device divisor
    kv_factor. A context request in the batch shifts the generation rows."""
    setup = build(model, prompts=(37, 70, 16), beam_width=3, kind=kind, num_layers=3)
    step = setup.sim.begin_step()
    setup.engine.prepare(step, context_prompt_lens=(20,))
    m = setup.engine.metadata
    info = planning.plan_metadata(m)
    adapter = kv_cache.adapter_for(setup.manager)
    assert adapter.kind == kind
    layer = adapter.layer(setup.manager.served_layer_idx)
    assert layer.page_index_divisor == (3 * 2 if kind == "v1" else 2)
    assert layer.pool.data_ptr() == setup.sim.kv_cache.data_ptr() and layer.pool.shape == setup.sim.kv_cache.shape
    assert layer.pool.stride(0) == 3 * setup.sim.kv_cache[0].numel()  # the page stride spans the pool's layers
    family = planning.Family(4, 2, 64, torch.bfloat16, 0.125, layer.pool_index, setup.manager.served_layer_idx)
    indptr, indices, _ = info.pages_for(m, family, layer)
    expected = beam0_prompt_pages(setup.sim)
    assert list(np.diff(indptr)) == [len(p) for p in expected]
    assert list(indices) == [p for pages in expected for p in pages]
    # The device table the tail kernel reads, K field from this phase's first sequence, is in page units.
    table = m.kv_cache_block_offsets[layer.pool_index, m.num_contexts :, 0, :]
    for i in range(step.num_rows):
        n = int(-(-int(step.kv_lens[i]) // setup.sim.page_size))
        assert torch.equal(table[i, :n] // layer.page_index_divisor, step.beam_page_table[i, :n])


def test_v2_never_reads_the_slot_indexed_host_table(model):
    """Doc 4.3: V2's host table is indexed by slot, not batch row; poisoning it changes nothing."""
    setup = build(model, kind="v2")
    setup.manager.host_kv_cache_block_offsets.fill_(123456)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    torch.testing.assert_close(out.view(-1, 4, 64).float(), setup.oracle(step), atol=2e-2, rtol=2e-2)


def test_v2_layer_with_another_page_scale_declines(model):
    """Doc 4.3: layers of one pool can have different page-index scales; the device table of such a
    layer is not in its pages' units, so the library declines the layer (fallback serves it)."""
    setup = build(model, kind="v2")
    setup.manager._layer_scales[setup.manager.served_layer_idx] = 4
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    assert [type(f).__name__ for f in setup.layer._fmha_manager._cache.values()] == ["FallbackFmha"]
    assert decline_log.seen("has page-index scale 4")


def test_manager_kind_by_class_name(model):
    """Doc 4.4: the two managers share attribute names; only the class tells them apart."""
    setup = build(model)
    assert kv_cache.manager_kind(setup.manager) == "v1"
    assert kv_cache.manager_kind(build(model, kind="v2").manager) == "v2"

    class Other:
        pass

    assert kv_cache.manager_kind(Other()) is None


def test_manager_replacement_never_uses_old_views(model):
    """Doc 4.2: the executor replaces its manager after memory estimation, while the layers (and the
    library instances on them) survive. Views are keyed by the manager object: the new manager gets new
    views and a new plan even for the same request ids, and the old adapter dies with the old manager."""
    first = build(model, prompts=(37, 70), seed=1)
    step = first.sim.begin_step()
    first.run(step)
    old_adapter = kv_cache.adapter_for(first.manager)
    old_pool_ptr = old_adapter.layer(first.manager.served_layer_idx).pool.data_ptr()
    # The replacement: a new manager (other pages, other memory), the same layer object, new metadata.
    second = build(model, prompts=(37, 70), seed=2)
    second.layer = first.layer
    step = second.sim.begin_step()
    assert step.request_ids == [0, 1]  # the same request ids as on the first manager, other pages
    out, _ = second.run(step)
    torch.testing.assert_close(out.view(-1, 4, 64).float(), second.oracle(step), atol=2e-2, rtol=2e-2)
    new_adapter = kv_cache.adapter_for(second.manager)
    assert new_adapter is not old_adapter
    assert new_adapter.layer(second.manager.served_layer_idx).pool.data_ptr() != old_pool_ptr
    assert stats()["plans"] == 2
    old_id = id(first.manager)
    del first, old_adapter
    gc.collect()
    assert old_id not in kv_cache._adapters


def test_v2_page_lists_from_the_older_layer_id_signature(model):
    """The older V2 (``resource_manager.py`` at NVIDIA/TensorRT-LLM 001541ba) spells the argument
    ``get_batch_cache_indices(request_ids, layer_id=0)``; the current one (``kv_cache/kv_cache_manager_v2.py``
    at 00043967) ``layer_idx=None``. Both take the global layer index second, so the adapter passes it
    positionally and reads the served layer's pages on either tree."""
    setup = build(model, prompts=(37, 70), kind="v2")
    manager = setup.manager
    current = type(manager).get_batch_cache_indices
    calls = []

    def older_signature(self, request_ids, layer_id=0):
        calls.append(layer_id)
        return current(self, request_ids, layer_id)

    type(manager).get_batch_cache_indices = older_signature
    try:
        step = setup.sim.begin_step()
        out, _ = setup.run(step)
    finally:
        type(manager).get_batch_cache_indices = current
    assert calls and set(calls) == {manager.served_layer_idx}
    torch.testing.assert_close(out.view(-1, 4, 64).float(), setup.oracle(step), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("pool", ["past", "negative"])
def test_a_layer_mapped_outside_the_pools_declines(model, kind, pool):
    """A ``kv_cache_pool_mapping`` that names a pool the block-offset tables do not have (past them, or below 0,
    which would index the tables from their end: another pool's, silently) is declined at the layer (logged,
    fallback serves it) instead of indexing outside the tables inside prepare()."""
    setup = build(model, kind=kind)
    manager = setup.manager
    mapping = manager.kv_cache_pool_mapping.clone()
    bad = int(manager.num_pools) if pool == "past" else -1
    mapping[:, 0] = bad
    manager.kv_cache_pool_mapping = mapping
    layer = kv_cache.adapter_for(manager).layer(manager.served_layer_idx)
    assert layer.decline_reason == (f"kv_cache_pool_mapping gives layer {manager.served_layer_idx} pool "
                                    f"{bad}, outside the manager's {int(manager.num_pools)} pools")


def _edit_page_lists(monkeypatch, manager, edit):
    """Pass the V2 manager's ``get_batch_cache_indices`` page lists through ``edit``."""
    original = manager.get_batch_cache_indices

    def get_batch_cache_indices(request_ids, *args, **kwargs):
        return edit(original(request_ids, *args, **kwargs))

    monkeypatch.setattr(manager, "get_batch_cache_indices", get_batch_cache_indices)


@pytest.mark.parametrize("edit", ["fewer_lists", "short_list"])
def test_v2_page_lists_that_break_the_contract_fail_clearly(model, monkeypatch, edit):
    """A V2 manager that returns fewer page lists than requests, or a list with fewer pages than its prompt covers,
    stops planning with the counts (and the request), rather than planning prompts on other requests' pages or on
    too few."""
    setup = build(model, prompts=(37, 70), beam_width=3, kind="v2", seed=int(torch.randint(0, 2**31 - 1, ())))
    if edit == "fewer_lists":
        _edit_page_lists(monkeypatch, setup.manager, lambda lists: lists[:-1])
        message = "get_batch_cache_indices returned 1 page lists for 2 requests"
    else:
        needed = -(-70 // setup.sim.page_size)
        _edit_page_lists(monkeypatch, setup.manager, lambda lists: [lists[0], lists[1][:needed - 1]])
        message = f"request {setup.sim.requests[1].rid} has {needed - 1} KV pages but its prompt needs {needed}"
    with pytest.raises(RuntimeError, match=message):
        setup.engine.prepare(setup.sim.begin_step())
