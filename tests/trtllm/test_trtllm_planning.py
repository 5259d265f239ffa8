"""Per-step planning from the ``TrtllmAttentionMetadata.prepare`` hook, per metadata object.

Against the interface model (``interface_model.py``; a model, not TensorRT-LLM): doc 3.1 (CUDA-graph
metadata are shallow copies), 3.8 (prepare() runs every step, before capture and replay), 1.5/9.2
(no upstream planning hook).
"""

from __future__ import annotations

import pytest
import torch

from beam_shared_prefix.trtllm import planning, register, stats
from beam_shared_prefix.trtllm.gates import decline_log
from interface_model import build

LIB = "beam_shared_prefix"
TOL = 2e-2


@pytest.fixture
def setup(trt, monkeypatch):
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    return build(model, prompts=(37, 70), beam_width=3)


def check(setup, step, out):
    ref = setup.oracle(step)
    got = out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref, atol=TOL, rtol=TOL)


def test_plans_per_metadata_identity(setup):
    """Doc 3.1: the graph metadata is a shallow copy of the eager one; each object gets its own state and
    wrapper (the graph one with fixed buffers sized for its batch), and both serve correctly."""
    eager = setup.engine.metadata
    graph = setup.engine.graph_metadata(2)
    assert graph is not eager and graph.is_cuda_graph and not eager.is_cuda_graph
    for s, metadata in enumerate([eager, graph, eager, graph]):
        step = setup.sim.begin_step()
        out, _ = setup.run(step, metadata=metadata)
        check(setup, step, out)
        setup.sim.end_step(write_kv=False)
    eager_state, graph_state = planning.metadata_state(eager), planning.metadata_state(graph)
    assert eager_state is not graph_state and eager_state.hooked and graph_state.hooked
    (eager_wrapper,) = eager_state.wrappers.values()
    (graph_wrapper,) = graph_state.wrappers.values()
    assert not eager_wrapper.use_cuda_graph
    assert graph_wrapper.use_cuda_graph and graph_wrapper.max_requests == 2 and graph_wrapper.max_beam_width == 3
    assert stats()["plans"] == 2  # one per metadata: the composition did not change


def test_replans_only_when_the_composition_changes(setup):
    """Plans are reused while the requests, their prompts and pages stay the same; a finished request
    re-plans once; a layer of the same shape shares the plan (one wrapper per attention family)."""
    trtllm = setup.model.module(".trtllm")
    second_layer = trtllm.TrtllmAttention(11, 4, 64, 2)  # same shape, another layer of the pool
    sim = setup.sim
    builds = []
    for s in range(5):
        if s == 3:
            sim.finish([sim.requests[1].rid])
        step = sim.begin_step()
        qkv = setup.engine.prepare(step)
        out = setup.layer.forward(qkv, None, None, setup.engine.metadata)
        second_layer.forward(qkv.clone(), None, None, setup.engine.metadata)
        check(setup, step, out)
        builds.append(stats()["plans"])
        sim.end_step(write_kv=False)
    assert builds == [1, 1, 1, 2, 2]
    (wrapper,) = planning.metadata_state(setup.engine.metadata).wrappers.values()
    assert wrapper.num_plan_builds == 2


@pytest.mark.parametrize("rule", ["shared-run stage", "cascade tail limit", "cascade tail bound"])
def test_the_wrapper_hears_the_steps_tail(setup, monkeypatch, rule):
    """The eager wrapper is handed each planned step's longest tail (``max_tail_len``, for its shared-run
    rule) and planned again, within one composition, once that tail reaches ``SHARED_RUN_MIN_TAIL`` (lowered
    here), or once it passes ``CASCADE_SHORT_TAIL`` (lowered instead: the cascade's launch is bounded by the
    tail); not when it passes ``CASCADE_MAX_TAIL`` (lowered instead), a rule for CUDA-graph replays, whose
    metadata serves any tail and hands none."""
    from beam_shared_prefix.attention import BeamSharedPrefixAttention
    from beam_shared_prefix.prefix import cascade_rule

    if rule == "shared-run stage":
        monkeypatch.setattr(cascade_rule, "SHARED_RUN_MIN_TAIL", 3)
    elif rule == "cascade tail bound":
        monkeypatch.setattr(cascade_rule, "CASCADE_SHORT_TAIL", 2)
    else:
        sim = setup.sim
        monkeypatch.setattr(cascade_rule, "CASCADE_MAX_TAIL", {(sim.num_qo_heads // sim.num_kv_heads, sim.head_dim): 2})
    heard = []
    plan = BeamSharedPrefixAttention.plan

    def recording_plan(self, *args, **kwargs):
        heard.append((self.use_cuda_graph, kwargs.get("max_tail_len")))
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(BeamSharedPrefixAttention, "plan", recording_plan)
    graph = setup.engine.graph_metadata(2)
    for s in range(5):
        step = setup.sim.begin_step()
        for metadata in (setup.engine.metadata, graph):
            out, _ = setup.run(step, metadata=metadata)
            check(setup, step, out)
        setup.sim.end_step(write_kv=False)
    # Tails 1..5: the eager wrapper is planned at the first step (and again at tail 3 for the stage); the
    # graph's once.
    again = [(False, 3)] if rule != "cascade tail limit" else []
    assert heard == [(False, 1), (True, None)] + again, heard


@pytest.mark.parametrize("max_tail", [None, "8"])
def test_the_decline_rule_hears_the_launch_tail_bound(trt, monkeypatch, max_tail):
    """The per-step decline rule judges the path the wrapper will take, so it hands the rule the tail bound the
    cascade's launch will get (GQA 5-8 at head 128 take the cascade only with one): an eager step's own tail, and for
    CUDA-graph metadata, which hands no tail, ``TLLM_BEAM_SHARED_PREFIX_MAX_TAIL`` (at most ``CASCADE_SHORT_TAIL``)."""
    from beam_shared_prefix.prefix.select import CASCADE_SHORT_TAIL

    if max_tail is None:
        monkeypatch.delenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", raising=False)
    else:
        monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", max_tail)
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINE", "auto")
    register()
    built = build(model, prompts=(37, 70), beam_width=3)
    heard = []
    step_path = planning.step_path

    def recording_step_path(*args, tail_len=None, tail_bound=None, **kwargs):
        heard.append((tail_len is None, tail_bound))
        return step_path(*args, tail_len=tail_len, tail_bound=tail_bound, **kwargs)

    monkeypatch.setattr(planning, "step_path", recording_step_path)
    graph = built.engine.graph_metadata(2)
    step = built.sim.begin_step()
    for metadata in (built.engine.metadata, graph):
        out, _ = built.run(step, metadata=metadata)
        check(built, step, out)
    captured = CASCADE_SHORT_TAIL if max_tail is not None else None
    assert heard == [(False, None), (True, captured)], heard


def test_fresh_metadata_is_planned_in_prepare(setup, monkeypatch):
    """prepare() plans the attention family of every layer the library serves, before any forward: a
    CUDA-graph metadata whose very first forward is captured (no eager warm-up) needs no planning."""
    graph = setup.engine.graph_metadata(2)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, metadata=graph)
    state = planning.metadata_state(graph)
    assert len(state.wrappers) == 1 and state.planned_key
    monkeypatch.setattr(planning, "_capturing", lambda: True)
    out = setup.layer.forward(qkv, None, None, graph)
    check(setup, step, out)


def test_no_planning_during_capture(setup, monkeypatch):
    """Doc 3.8: planning is host work and is never captured. With a plan in place a captured forward runs;
    a plan needed during capture is a clear error, not a silent stale plan."""
    step = setup.sim.begin_step()
    setup.run(step)
    setup.sim.end_step(write_kv=False)
    # The runner's order: prepare() (host), then the captured forward, which only runs.
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step)
    monkeypatch.setattr(planning, "_capturing", lambda: True)
    out = setup.layer.forward(qkv, None, None, setup.engine.metadata)
    check(setup, step, out)
    # A new attention family first met during capture cannot be planned there.
    other = setup.model.module(".trtllm").TrtllmAttention(11, 2, 64, 2)  # Hq 2: another family
    other_qkv = torch.cat([qkv[:, : 2 * 64], qkv[:, 4 * 64 :]], dim=1)
    with pytest.raises(RuntimeError, match="a plan is needed during CUDA graph capture"):
        other.forward(other_qkv, None, None, setup.engine.metadata)
    setup.sim.end_step(write_kv=False)
    # prepare() itself inside a capture (never expected): the previous plan must not be reused.
    setup.sim.finish([setup.sim.requests[0].rid])
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step)
    with pytest.raises(RuntimeError, match="prepare\\(\\) ran during CUDA graph capture"):
        setup.layer.forward(qkv, None, None, setup.engine.metadata)


def test_subclass_prepare_plans_once(trt, monkeypatch):
    """The hook wraps prepare() of TrtllmAttentionMetadata and of subclasses that override it; a
    subclass calling super().prepare() plans once, after its own body."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    trtllm = model.module(".trtllm")
    seen = []

    class SpecMetadata(trtllm.TrtllmAttentionMetadata):
        def prepare(self):
            super().prepare()
            seen.append(planning.metadata_state(self).step is None)  # not planned yet inside the body

    setup = build(model)  # layer construction installs the hook (and wraps existing subclasses)
    metadata = SpecMetadata(max_num_requests=8, max_num_sequences=8 * 4, max_beam_width=4, kv_cache_manager=setup.manager)
    step = setup.sim.begin_step()
    out, _ = setup.run(step, metadata=metadata)
    check(setup, step, out)
    assert seen == [True] and stats()["prepare_calls"] == 1


def test_forward_without_the_hook(setup, monkeypatch):
    """If prepare() is not hooked (e.g. overridden without super()), eager forwards still plan (with a
    warning); under capture it is an error that names the cause."""
    planning.uninstall_prepare_hook(setup.model.module(".trtllm").TrtllmAttentionMetadata)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    check(setup, step, out)
    from beam_shared_prefix.trtllm.gates import decline_log

    assert decline_log.seen("is not hooked")
    setup.sim.end_step(write_kv=False)
    graph = setup.engine.graph_metadata(2)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, metadata=graph)
    monkeypatch.setattr(planning, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare\\(\\) hook did not run"):
        setup.layer.forward(qkv, None, None, graph)


@pytest.mark.parametrize("engine_call", ["unhooked prepare", "no prepare"])
def test_a_new_batch_planned_outside_the_hook_is_not_served_with_the_old_plan(setup, engine_call):
    """A step whose prepare() bypassed the hook (or was never called) after the batch changed: the forward
    finds other request ids than the last planning read, plans the step itself (with a warning) instead of
    serving the previous batch's pages, and matches the oracle."""
    from beam_shared_prefix.trtllm.gates import decline_log

    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    check(setup, step, out)
    setup.sim.end_step()
    setup.sim.finish([setup.sim.requests[0].rid])  # same row count, another request
    setup.sim.add_requests([20])
    original = setup.model.module(".trtllm").TrtllmAttentionMetadata.prepare.__wrapped_original__

    def bypass(m):
        m.prepare = (lambda: original(m)) if engine_call == "unhooked prepare" else (lambda: None)

    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, before=bypass)
    metadata = setup.engine.metadata
    if engine_call == "no prepare":
        original(metadata)  # the engine's own buffers are filled elsewhere; only the hook is missing
    plans = stats()["steps_planned"]
    out = setup.layer.forward(qkv, None, None, metadata)
    check(setup, step, out)
    assert decline_log.seen("request_ids changed since the last hooked prepare()")
    assert stats()["steps_planned"] == plans + 1
    setup.layer.forward(qkv, None, None, metadata)  # a later layer of the step: planned already
    assert stats()["steps_planned"] == plans + 1
    del metadata.prepare


def test_a_new_batch_unplanned_under_capture_stops(setup, monkeypatch):
    """Under CUDA-graph capture the forward cannot plan: request ids changed since prepare() stop the
    capture with the cause rather than capturing the previous batch's plan."""
    graph = setup.engine.graph_metadata(2)
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step, metadata=graph)
    graph.request_ids = list(graph.request_ids[:-1]) + [graph.request_ids[-1] + 1000]
    monkeypatch.setattr(planning, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="request_ids changed after the last prepare"):
        setup.layer.forward(qkv, None, None, graph)


def test_graph_replays_start_the_audit_over_before_its_stamp_wraps(trt, monkeypatch):
    """With report_errors, a CUDA-graph step plans nothing while its batch stays (prepare() finds the plan) and its
    replay runs no Python, yet each replay advances the audit's int32 stamp on the device. prepare() counts the
    replays, so the wrapper starts the audit over before the stamp wraps; else valid tables are reported as errors
    once it has. Scaled down: a restart every 8 uses, the stamp started 30 below 2**31 (the real 4x margin);
    a replay is prepare() and the captured audit launch."""
    import triton_kernels
    from beam_shared_prefix import attention as attention_module

    restart = 8
    monkeypatch.setattr(attention_module, "AUDIT_RESTART", restart)
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS", "1")
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    # (the audit's workspace is the Triton audit's: on a GPU machine that runs on the GPU, on the CPU interpreted)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    built = build(model, prompts=(20, 20), beam_width=3, max_batch_size=2, device=device)
    sim, graph = built.sim, built.engine.graph_metadata(2)
    audits = []
    audit = triton_kernels.audit_page_table
    monkeypatch.setattr(triton_kernels, "audit_page_table", lambda *a, **k: (audits.append((a, k)), audit(*a, **k)))

    step = sim.begin_step()
    built.run(step, metadata=graph)  # the warm-up forward
    sim.end_step()
    (wrapper,) = planning.metadata_state(graph).wrappers.values()
    workspace = wrapper._audit_workspace
    assert wrapper.tail_impl == "triton" and workspace is not None
    workspace.audit_state.fill_(2**31 - (4 * restart - 2))
    step = sim.begin_step()
    built.run(step, metadata=graph)  # the forward a graph captures
    sim.end_step()
    captured_args, captured_kwargs = audits[-1]
    for _ in range(4 * restart):
        step = sim.begin_step()
        built.engine.prepare(step, metadata=graph)
        audit(*captured_args, **captured_kwargs)
        sim.end_step()
    assert 0 < int(workspace.audit_state.item()) <= restart + 1  # started over, not wrapped
    assert wrapper.device_errors() == []
    sim.finish([sim.requests[0].rid])  # a new composition: a valid table the audit still judges as one
    sim.add_requests([20])
    for _ in range(2):
        step = sim.begin_step()
        out, _ = built.run(step, metadata=graph)
        check(built, step, out)
        sim.end_step()
    assert wrapper.device_errors() == []


def test_warmup_rows_without_generated_tokens(setup):
    """Doc 3.4: warm-up / CUDA-graph dummy rows have prompt_len = kv_len - 1 (nothing generated yet)
    and a zero-length prompt may appear (kv_len 1); planning clamps the prefix to [1, kv_len - 1]
    instead of failing, and real rows stay exact."""
    sim = setup.sim
    step = sim.begin_step()
    setup.engine.prepare(step)
    m = setup.engine.metadata
    m.prompt_lens_cpu_runtime[:3] = m.kv_lens_runtime[:3]  # request 0 claims its whole KV is prompt
    m.prompt_lens_cpu_runtime[3:6] = 0  # request 1: a zero-length prompt
    step_info = planning.plan_metadata(m)
    assert list(step_info.prompt_lens) == [int(m.kv_lens_runtime[0]) - 1, 1]


def test_trees_without_runtime_views(setup):
    """Doc 3.4: older trees have no *_runtime views; planning reads the first num_seqs entries of the
    length buffers instead, and gets the same plan."""
    step = setup.sim.begin_step()
    setup.engine.prepare(step)
    m = setup.engine.metadata
    with_views = planning.plan_metadata(m)
    del m.prompt_lens_cpu_runtime, m.kv_lens_runtime
    without = planning.plan_metadata(m)
    assert list(without.prompt_lens) == list(with_views.prompt_lens) and without.base_key == with_views.base_key


@pytest.mark.parametrize("registry", ["adapters", "metadata states"])
def test_a_collection_inside_the_registry_lock_does_not_deadlock(registry, monkeypatch):
    """The weakref callbacks that drop a freed manager's adapter (or a freed metadata's state) take the
    registry's lock; a garbage-collection pass can run them on the thread that holds it (here forced at
    an allocation inside the locked region), which must not block on its own lock."""
    import gc
    import threading

    from beam_shared_prefix.trtllm import kv_cache, planning

    class KVCacheManager:  # a V1 manager (by its class name) in a reference cycle: only gc frees it
        kv_factor = 2
        tokens_per_block = 32

        def __init__(self):
            self.me = self

    class Metadata:
        def __init__(self):
            self.me = self

    if registry == "adapters":
        cls, attr, register_one = kv_cache.V1PageAdapter, "__init__", lambda: kv_cache.adapter_for(KVCacheManager())
    else:
        cls, attr, register_one = planning._MetadataState, "__init__", lambda: planning.metadata_state(Metadata())
    done, errors = [], []

    def run():
        gc.disable()
        try:
            register_one()  # becomes garbage at once (a cycle, collected only by gc.collect)
            original = getattr(cls, attr)

            def collecting_init(self, *args):
                gc.collect()
                original(self, *args)

            monkeypatch.setattr(cls, attr, collecting_init)
            register_one()
            done.append(True)
        except Exception as exc:  # surfaced below, not lost in the thread
            errors.append(exc)
        finally:
            gc.enable()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not errors, errors
    assert done, f"registering a new entry deadlocked while the {registry} registry's lock was held"


# ------------------------------------------------------------------------------------------------
# Engine states the simulator does not produce: each is served exactly, handed over with a reason, or
# stopped with an error that names it (found by an adversarial audit, fifty-eighth round).


def _padded_with_one_dummy(copies):
    """CUDA-graph padding (TensorRT-LLM's runner extends the batch with ``[padding_dummy_request] *
    padding_size``): the last ``copies`` requests become one dummy id, with a one-token KV and no prompt."""

    def before(m):
        W = m.beam_width
        real = len(m.request_ids) - copies
        m.request_ids = list(m.request_ids[:real]) + [m.request_ids[real]] * copies
        cached = list(m.kv_cache_params.num_cached_tokens_per_seq)
        m.kv_cache_params.num_cached_tokens_per_seq = cached[: real * W] + [0] * (W * copies)
        m.prompt_lens = list(m.prompt_lens[: real * W]) + [0] * (W * copies)

    return before


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_a_batch_padded_with_one_repeated_dummy_request_is_served(trt, monkeypatch, graph):
    """The dummy's copies share every page, so their one-token "prompt page" is listed by several requests:
    the planner takes them as copies of one request (same prompt, same pages), and the real rows stay exact."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, prompts=(37, 1, 1), beam_width=3)
    metadata = setup.engine.graph_metadata(3) if graph else None
    for _ in range(3):
        step = setup.sim.begin_step()
        out, _ = setup.run(step, metadata=metadata, before=_padded_with_one_dummy(2))
        got = out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)[:3]  # request 0's beams
        torch.testing.assert_close(got.float(), setup.oracle(step)[:3].float(), atol=TOL, rtol=TOL)
        setup.sim.end_step(write_kv=False)
    assert stats()["generation_forwards"] == 3 and stats()["delegated_steps"] == 0


def test_two_requests_given_one_partly_filled_prompt_page_are_handed_over(trt, monkeypatch):
    """Two requests of one prompt length whose KV manager lists the same pages (a block handed out twice): the
    planner alone would take them as copies of one request, as it must a padded batch's dummy; their ids tell them
    apart, and the step goes to the default kernel, logged, before their beams write into one partly filled page."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    setup = build(model, prompts=(37, 37), beam_width=3, kind="v2")
    manager = setup.manager
    real = manager.get_batch_cache_indices
    monkeypatch.setattr(manager, "get_batch_cache_indices",
                        lambda ids, *args, **kwargs: [real(ids, *args, **kwargs)[0]] * len(ids))
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    ids = setup.engine.metadata.request_ids
    check(setup, step, out)  # the default kernel, on the simulator's own pages
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0
    assert decline_log.seen(f"requests 0 (id {ids[0]}) and 1 (id {ids[1]}) list the same 3 prompt pages for "
                            f"37-token prompts")


def _failing_plans(monkeypatch):
    """``BeamSharedPrefixAttention.plan`` refusing its arguments (a bad ``sm_scale``) while ``fail[0]`` is set,
    as a real refusal does: after dropping the wrapper's active plan."""
    from beam_shared_prefix.attention import BeamSharedPrefixAttention

    fail = [False]
    original = BeamSharedPrefixAttention.plan

    def plan(self, *args, **kwargs):
        if fail[0]:
            kwargs["sm_scale"] = "refused by the test"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BeamSharedPrefixAttention, "plan", plan)
    return fail


def _longer_prompts(m):
    m.prompt_lens = [p + 1 for p in m.prompt_lens]  # a new composition key: the step is planned again


def test_a_composition_is_planned_again_after_another_failed(setup, monkeypatch, caplog):
    """A -> B (its plan refused: handed to the default kernel, logged) -> A: A is planned again, not run on the
    wrapper the failed plan left without a plan."""
    fail = _failing_plans(monkeypatch)
    for s, (failing, before) in enumerate([(False, None), (True, _longer_prompts), (False, None)]):
        fail[0] = failing
        step = setup.sim.begin_step()
        out, _ = setup.run(step, before=before)
        if not failing:
            check(setup, step, out)
        setup.sim.end_step(write_kv=False)
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 2
    assert "planning failed: sm_scale='refused by the test' must be" in caplog.text


def test_a_cuda_graph_step_that_cannot_be_planned_stops(setup, monkeypatch):
    """A graph captured with the library's kernels replays them whatever prepare() decides: a step it cannot
    plan stops with an error instead of replaying the previous batch's plan."""
    fail = _failing_plans(monkeypatch)
    graph = setup.engine.graph_metadata(2)
    step = setup.sim.begin_step()
    check(setup, step, setup.run(step, metadata=graph)[0])
    setup.sim.end_step(write_kv=False)
    fail[0] = True
    with pytest.raises(RuntimeError, match="this CUDA-graph step cannot be planned \\(AttentionInputError: sm_scale='refused by the test'"):
        setup.engine.prepare(setup.sim.begin_step(), metadata=graph, before=_longer_prompts)


def test_a_cuda_graph_family_whose_layers_never_ran_the_library_is_handed_over(setup, monkeypatch):
    """prepare() plans every family it learned, including one whose layers all decline per call (a sliding-window
    layer): such a family has a plan but no kernel in the captured graph. A refusal while planning it hands the step
    to the default kernel (logged), rather than stopping the engine as for a family the graph holds."""
    fail = _failing_plans(monkeypatch)
    graph = setup.engine.graph_metadata(2)
    setup.engine.prepare(setup.sim.begin_step(), metadata=graph)  # planned; no layer forward ran the library
    setup.sim.end_step(write_kv=True)
    fail[0] = True
    setup.run(setup.sim.begin_step(), metadata=graph, before=_longer_prompts)  # (prompts unlike the simulator's)
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0
    assert decline_log.seen("planning failed: sm_scale='refused by the test'")


def test_a_fresh_cuda_graph_metadata_whose_first_plan_fails_is_handed_over(setup, monkeypatch):
    """A graph metadata that never had a plan has captured none of the library's kernels: a refusal while planning
    its first step hands the step to the default kernel (logged), as an eager one does; only a graph that ran a plan
    before must stop (test_a_cuda_graph_step_that_cannot_be_planned_stops)."""
    fail = _failing_plans(monkeypatch)
    fail[0] = True
    graph = setup.engine.graph_metadata(2)
    step = setup.sim.begin_step()
    out, _ = setup.run(step, metadata=graph)
    check(setup, step, out)
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0
    assert decline_log.seen("planning failed: sm_scale='refused by the test'")


def test_an_unexpected_error_while_planning_in_prepare_propagates(setup, monkeypatch):
    """Only the library's own refusals hand a step over from inside ``prepare()``; any other exception (a bug)
    propagates instead of being logged as 'planning failed' and hidden behind the default kernel."""
    def broken(*args, **kwargs):
        raise TypeError("a bug in the planner (simulated)")

    monkeypatch.setattr(planning, "_new_wrapper", broken)
    with pytest.raises(TypeError, match="a bug in the planner"):
        setup.engine.prepare(setup.sim.begin_step())


def test_a_new_request_ids_list_with_the_same_requests_keeps_the_plan(setup):
    """The engine builds a new ``request_ids`` list every step; one with the same requests is the planned step:
    no warning, no planning inside the forward."""
    step = setup.sim.begin_step()
    qkv = setup.engine.prepare(step)
    m = setup.engine.metadata
    m.request_ids = list(m.request_ids)  # another list object, the same ids
    planned = stats()["steps_planned"]
    check(setup, step, setup.layer.forward(qkv, None, None, m))
    assert stats()["steps_planned"] == planned
    assert not decline_log.seen("request_ids changed since the last hooked prepare()")


def test_prepare_plans_no_step_the_decline_rule_hands_over(with_decline):
    """A step the decline rule hands to the default kernel (16 beam rows) is not planned: no wrapper, no plan."""
    setup = build(with_decline(backend="auto", any_rows=False), prompts=(90, 120), beam_width=8, head_dim=128,
                  seed=int(torch.randint(0, 2**31 - 1, ())))
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    check(setup, step, out)
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0
    assert stats()["plans"] == 0 and stats()["wrappers"] == 0


@pytest.mark.parametrize("prompts,served", [((49, 50), True), ((48, 50), False)])
def test_the_decline_rule_judges_the_mean_prompt_rounded_up(with_decline, prompts, served):
    """4 beams at head 128 on ``auto``'s one-launch cascade are served from a mean prompt of 50 tokens: prompts of 49
    and 50 (a mean of 49.5) are served, 48 and 50 (49) are not."""
    setup = build(with_decline(backend="auto"), prompts=prompts, beam_width=4, head_dim=128,
                  seed=int(torch.randint(0, 2**31 - 1, ())))  # (any rows: 2 requests, the prompt part judged)
    step = setup.sim.begin_step()
    out, _ = setup.run(step)
    check(setup, step, out)
    assert stats()["generation_forwards"] == (1 if served else 0)
    assert stats()["delegated_steps"] == (0 if served else 1)


def _kv_lens(edit):
    def before(m):
        cached = list(m.kv_cache_params.num_cached_tokens_per_seq)
        edit(cached)
        m.kv_cache_params.num_cached_tokens_per_seq = cached

    return before


@pytest.mark.parametrize("edit,reason", [
    (lambda c: c.__setitem__(4, c[4] - 1), r"the beams of generation request 1 have KV lengths \[\d+, \d+, \d+\]"),
    (lambda c: c.__setitem__(slice(0, 3), [500] * 3), r"generation row 0 has KV length 501, outside \[1, 128\]"),
], ids=["beams-differ", "past-the-cache"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_inconsistent_kv_lengths_are_not_served(setup, caplog, edit, reason, graph):
    """KV lengths no beam search produces (beams of one request apart, a row past its cache) would have the
    kernels read slots being written or mask this step's K/V write: an eager step goes to the default kernel
    with the reason logged; a CUDA-graph step, which cannot be handed over, stops."""
    step = setup.sim.begin_step()
    if graph:
        with pytest.raises(RuntimeError, match=f"a CUDA-graph step with inconsistent lengths: {reason}"):
            setup.engine.prepare(step, metadata=setup.engine.graph_metadata(2), before=_kv_lens(edit))
        return
    planning.plan_metadata(setup.engine.metadata)  # (a first, valid selection of the key)
    qkv = setup.engine.prepare(step, before=_kv_lens(edit))
    assert isinstance(planning.metadata_state(setup.engine.metadata).step, planning.DeclinedStep)
    assert "step handed to the default kernel" in caplog.text and caplog.text.count("KV length") >= 1
    assert caplog.records[-1].levelname == "WARNING"
    if "beams" in reason:  # (the model's default kernel indexes past its table on the other state, as a real one would)
        setup.layer.forward(qkv, None, None, setup.engine.metadata)
        assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 0


def test_an_overlap_scheduler_cache_indirection_is_served(setup):
    """Trees that run the overlap scheduler size cache_indirection one position past max_seq_len; no
    position past the page table is ever cached, so the library reads a view up to the table's end."""
    def one_more_position(m):
        ci = m.cache_indirection
        m.cache_indirection = torch.cat([ci, torch.zeros_like(ci[:, :, :1])], dim=2)

    step = setup.sim.begin_step()
    out, _ = setup.run(step, before=one_more_position)
    check(setup, step, out)
    assert stats()["generation_forwards"] == 1


def test_a_row_one_past_the_page_table_under_an_overlap_scheduler_indirection_is_not_served(setup):
    """The overlap scheduler's cache_indirection is one position longer than the page table (129 over 8 pages of
    16): the KV capacity is the table's 128, so a row of KV length 129, whose write slot has no page, is not served
    (the step is handed over, with the reason)."""
    def before(m):
        ci = m.cache_indirection
        m.cache_indirection = torch.cat([ci, torch.zeros_like(ci[:, :, :1])], dim=2)
        cached = list(m.kv_cache_params.num_cached_tokens_per_seq)
        cached[0:3] = [128] * 3  # request 0's beams: KV length 129
        m.kv_cache_params.num_cached_tokens_per_seq = cached

    planning.plan_metadata(setup.engine.metadata)  # (a first, valid selection of the key)
    setup.engine.prepare(setup.sim.begin_step(), before=before)
    assert isinstance(planning.metadata_state(setup.engine.metadata).step, planning.DeclinedStep)
    assert decline_log.seen("generation row 0 has KV length 129, outside [1, 128]")


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_a_step_its_key_selected_but_the_batch_gates_refuse_is_handed_over(setup, caplog, hooked):
    """The batch gates hold within a selection key for a consistent engine; where a step's metadata changes
    under its key (here cache_indirection turns int64, which the kernels do not read), the cached selection
    still picks the library, and the step goes to the default kernel with the reason logged. So too where
    ``prepare()`` is not hooked and the step is planned inside the forward (it raised there until round 86)."""
    if not hooked:
        planning.uninstall_prepare_hook(setup.model.module(".trtllm").TrtllmAttentionMetadata)
    step = setup.sim.begin_step()
    check(setup, step, setup.run(step)[0])
    setup.sim.end_step(write_kv=False)

    def int64_indirection(m):
        m.cache_indirection = m.cache_indirection.long()

    step = setup.sim.begin_step()
    check(setup, step, setup.run(step, before=int64_indirection)[0])
    assert stats()["delegated_steps"] == 1 and stats()["generation_forwards"] == 1
    assert "found ineligible (cache_indirection of dtype int64" in caplog.text
