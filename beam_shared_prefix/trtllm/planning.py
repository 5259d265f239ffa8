"""Per-step planning, driven from ``TrtllmAttentionMetadata.prepare``.

TensorRT-LLM has no planning hook for FMHA libraries (trtllm-interfaces.md, 1.5 and 9.2), so this
module wraps ``TrtllmAttentionMetadata.prepare``: after the original body (block offsets copied,
runtime views bound, section 3.8) it plans the step on the host. Under CUDA graphs ``prepare()``
runs before capture and before every replay, never inside a capture, so the captured ``run()``
only ever sees device tensors the plan filled beforehand.

State lives per metadata *object* (section 3.1): a CUDA-graph metadata is a shallow copy of the
eager one, so an attribute stored on the eager object would be shared by every graph copy. States
are kept in an ``id()``-keyed map whose entries check ``owner() is metadata`` and are dropped with
their metadata. Each state owns its own :class:`~beam_shared_prefix.BeamSharedPrefixAttention`
wrappers (graph metadata: ``use_cuda_graph=True``, sized for that graph's batch).

A plan is rebuilt only when the batch composition changes: the key is the KV cache manager, the
beam width, the generation requests, their prompt lengths and beam 0's prompt pages. Pages are read
from the host every step (one small copy) and are part of the key, so a request id that comes back
with other pages (warm-up requests, a replaced manager) can never reuse a stale page table.

Per-step decline (``TLLM_BEAM_SHARED_PREFIX_DECLINE=auto``): the selection gate cannot look at
prompt lengths or the exact request count (not in TensorRT-LLM's selection-cache key, section 2.4),
so the library's ``_is_supported`` only applies the parts of the rule that depend on beam width and
head shape. The rest is decided here, per step and per attention shape, with the batch's request
count and mean prompt length; a declined step is handed to the fallback library by the Fmha
subclass. A CUDA-graph metadata serves any prompt with one captured path, so its decision uses its
(fixed) request count and beam width only, and is the same on every step. The tail (generated tokens per
beam) grows every step: eager steps past the rule's tail limit are handed over; a CUDA-graph step cannot
be, and logs a warning once (``slow_step_log``).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

import numpy as np

from ..decline import should_decline, tail_decline_reason
from ..kv_lens import kv_capacity, kv_lens_problem
from ..prefix.select import cascade_tail_bound, long_tail_for_shared_run, step_path
from .gates import batch_decline_reason, decline_log, slow_step_log, step_decline_reason
from .kv_cache import LayerKV, PageAdapter, adapter_for
from .registration import current_settings

__all__ = [
    "Family",
    "StepInfo",
    "plan_metadata",
    "step_for_forward",
    "wrapper_for",
    "install_prepare_hook",
    "try_install_prepare_hook",
    "ensure_prepare_hook",
    "metadata_state",
    "register_instance",
    "retire_family",
    "runtime_view",
    "stats",
]

logger = logging.getLogger("beam_shared_prefix.trtllm")

_WRAPPED_MARK = "_beam_shared_prefix_wrapped"

#: Counters for tests and the end-to-end check (host side only; graph replays are not counted).
stats: Dict[str, int] = {"plans": 0, "prepare_calls": 0, "steps_planned": 0, "wrappers": 0, "device_errors": 0}
#: Families whose kernels failed to build on this machine (family key -> reason, :func:`retire_family`): their eager
#: steps are declined for the rest of the process.
retired_families: Dict[tuple, str] = {}
# Kinds of device error already logged (each once per process; the stats count every report).
_logged_device_errors: set = set()


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class Family:
    """An attention shape the library serves on one KV pool; all layers of a family share a plan.

    ``layer_idx`` is a representative layer (the V2 adapter reads page lists through it).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: object
    sm_scale: float
    pool_index: int
    layer_idx: int = field(compare=False, hash=False)

    @property
    def key(self) -> tuple:
        """``(Hq, Hkv, D, dtype name, sm_scale, pool index)``: what a plan and a decline verdict hold for (the
        layer index is left out, so every layer of one shape and pool shares them)."""
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim, str(self.dtype), self.sm_scale, self.pool_index)


@dataclass
class StepInfo:
    """What ``prepare()`` learned about one step's generation rows (host only).

    Attributes:
        adapter: the KV cache manager's page adapter.
        beam_width, num_contexts, num_requests, num_rows: batch shape; generation row ``i`` of the
            library is metadata sequence ``num_contexts + i``.
        request_ids: the generation requests, in batch order.
        prompt_lens: ``[R]`` int64, prompt length per request as planned: at most ``kv_len - 1``
            (warm-up and CUDA-graph dummy rows may have nothing generated) and at least 1.
        mean_prompt_len: mean of ``prompt_lens`` (``None`` for CUDA-graph metadata, see module doc).
        observed_lens: ``(mean prompt, longest tail)`` of this step, also under a CUDA graph: the longest
            request's generated tokens per beam, this step's included (``kv_len - prompt_len``).
        base_key: composition key without the pages.
    """

    adapter: PageAdapter
    beam_width: int
    num_contexts: int
    num_requests: int
    num_rows: int
    request_ids: Tuple[int, ...]
    prompt_lens: np.ndarray
    mean_prompt_len: Optional[int]
    base_key: tuple
    observed_lens: Tuple[float, int] = (0.0, 0)
    pages: Dict[int, Tuple[np.ndarray, np.ndarray, tuple]] = field(default_factory=dict)
    declines: Dict[tuple, Optional[str]] = field(default_factory=dict)
    unplannable: set = field(default_factory=set)  # family keys whose planning failed this step

    def pages_for(self, metadata, family: Family, layer: LayerKV) -> Tuple[np.ndarray, np.ndarray, tuple]:
        """Beam 0's prompt pages in ``family``'s pool as ``(indptr, indices, key)`` (read once per step and pool):
        ``indptr`` int64 ``[R + 1]`` and ``indices`` int64 ``[indptr[-1]]`` page numbers, as
        :meth:`~.kv_cache.PageAdapter.prompt_pages` returns them, and the full plan key (the step's key, the pool
        and the pages' bytes)."""
        cached = self.pages.get(family.pool_index)
        if cached is None:
            pages_per_request = -(-self.prompt_lens // layer.page_size)
            indptr, indices = self.adapter.prompt_pages(
                metadata, layer, family.layer_idx, self.request_ids, pages_per_request
            )
            key = self.base_key + (family.pool_index, indices.tobytes())
            cached = (indptr, indices, key)
            self.pages[family.pool_index] = cached
        return cached

    @property
    def judged_tail(self) -> Optional[int]:
        """The longest tail the step's rules judge: ``observed_lens[1]``, or ``None`` for CUDA-graph metadata,
        whose capture serves any tail."""
        return None if self.mean_prompt_len is None else self.observed_lens[1]

    def decline_reason(self, family: Family) -> Optional[str]:
        """The per-step decline rule's verdict for ``family`` (``None``: serve)."""
        if self._retired(family):
            return retired_families[family.key]
        if family.key not in self.declines:
            reason = None
            settings = current_settings()
            if settings.decline == "auto":
                # A CUDA graph (mean_prompt_len None) serves any prompt and tail: neither is judged.
                tail = self.judged_tail
                # The path that serves a long tail depends on whether the shared-run stage may run.
                # A judged tail is an eager step's (CUDA-graph metadata hands none): eager keeps the cascade.
                # A captured launch is bounded by the wrapper's max_tail_len, an eager one by its own tail.
                bound = cascade_tail_bound(settings.max_tail_len) if tail is None else None
                split_kv, one_launch = step_path(settings.backend, num_requests=self.num_requests,
                                                 mean_prompt_len=self.mean_prompt_len,
                                                 num_qo_heads=family.num_qo_heads, num_kv_heads=family.num_kv_heads,
                                                 beam_width=self.beam_width, head_dim=family.head_dim, tail_len=tail,
                                                 shared_run=settings.shared_run != "off", eager=True, tail_bound=bound)
                reason = should_decline(
                    self.num_requests,
                    self.beam_width,
                    self.mean_prompt_len,
                    family.num_qo_heads,
                    family.num_kv_heads,
                    family.head_dim,
                    one_launch=one_launch,
                    split_kv=split_kv,
                    tail_len=tail,
                )
                if reason is None and tail is None:
                    # A CUDA graph replays its captured path whatever the tail: say so once per kind.
                    slow = tail_decline_reason(self.beam_width, *self.observed_lens, family.num_kv_heads,
                                               self.num_requests, family.num_qo_heads)
                    if slow is not None:
                        slow_step_log(logging.WARNING,
                                      f"a CUDA-graph step runs its captured library path although {slow}; a graph "
                                      f"cannot hand steps over: run long outputs without CUDA graphs")
            self.declines[family.key] = reason
        return self.declines[family.key]

    def must_hand_over(self, family: Family) -> bool:
        """Whether the library cannot run ``family`` this step even with no library to hand it to."""
        return family.key in self.unplannable or self._retired(family)

    def _retired(self, family: Family) -> bool:
        # Eager steps only: a CUDA graph replays the kernels it captured (they built), whatever prepare() says.
        return self.mean_prompt_len is not None and family.key in retired_families


def retire_family(family: Family, why: str) -> str:
    """Decline every later eager step of ``family`` in this process, for ``why`` (one of the library's kernels failed
    to build here); returns the reason those steps are declined with (the first one given)."""
    return retired_families.setdefault(family.key, f"{why}; the library steps aside for this attention shape")


@dataclass
class DeclinedStep:
    """A step the library's key selected but whose generation rows go to ``fallback`` as a whole
    (:func:`gates.step_decline_reason`); ``forward`` hands it over instead of planning it."""

    reason: str

    def decline_reason(self, family) -> str:
        """The step's reason, for every family (:meth:`StepInfo.decline_reason`'s twin)."""
        return self.reason

    def must_hand_over(self, family) -> bool:
        """Always: the whole step goes to ``fallback`` (:meth:`StepInfo.must_hand_over`'s twin)."""
        return True


#: Steps between two reads of the device error flags: a read (a pinned copy and an event) costs
#: tens of microseconds of host time, so errors are logged up to this many steps late.
DEVICE_ERROR_POLL_STEPS = 8


class _MetadataState:
    """Planning state of one metadata object."""

    def __init__(self, metadata):
        self.owner = weakref.ref(metadata)
        self.is_cuda_graph = bool(getattr(metadata, "is_cuda_graph", False))
        self.hooked = False  # prepare() ran through the hook at least once
        self.step: Optional[StepInfo] = None
        self.step_reason: Optional[str] = None
        self.wrappers: Dict[tuple, object] = {}
        self.planned_key: Dict[tuple, tuple] = {}
        # Families whose layers ran the library's kernels with this metadata: under a CUDA graph, the ones the
        # captured graph holds (a family planned only in prepare(), whose layers all declined, holds none).
        self.served_families: set = set()
        # ``metadata.request_ids`` as the last planning saw it (the list object and its values): the engine
        # assigns a new list every step before prepare(), so a forward that finds another list knows the step
        # was not planned (prepare() bypassed the hook, or was not called) and must not run the previous plan.
        self.planned_ids: Optional[Tuple[object, tuple]] = None
        self.steps_since_poll = DEVICE_ERROR_POLL_STEPS - 1  # the first step polls


_states: Dict[int, _MetadataState] = {}
# Re-entrant: a garbage-collection pass inside the locked region can run `_drop` of a freed metadata
# object on this thread.
_states_lock = threading.RLock()


def metadata_state(metadata, create: bool = True) -> Optional[_MetadataState]:
    """The planning state of this exact metadata object (never one of its shallow copies)."""
    key = id(metadata)
    state = _states.get(key)
    if state is not None and state.owner() is metadata:
        return state
    if not create:
        return None
    with _states_lock:
        state = _states.get(key)
        if state is not None and state.owner() is metadata:
            return state
        state = _MetadataState(metadata)
        _states[key] = state

        def _drop(_, key=key, state=state):
            with _states_lock:
                if _states.get(key) is state:
                    del _states[key]

        weakref.finalize(metadata, _drop, None)
        return state


def runtime_view(metadata, name: str, fallback: str):
    """``metadata.<name>`` (the per-step view ``_bind_runtime_views`` binds, doc 3.4), or, on trees
    without those views, the first ``num_seqs`` entries of the buffer ``<fallback>``."""
    view = getattr(metadata, name, None)
    if view is None:
        view = getattr(metadata, fallback)[: metadata.num_seqs]
    return view


def plan_metadata(metadata, from_hook: bool = False) -> Optional[Union[StepInfo, DeclinedStep]]:
    """Plan this step of ``metadata`` (host only); returns ``None`` when the batch is not eligible, a
    :class:`DeclinedStep` when its key is but this step goes to ``fallback`` as a whole.

    Called after ``prepare()``. Plans every attention family already known on the KV cache
    manager, so that a fresh (e.g. CUDA-graph) metadata has its wrappers planned before its first
    forward; families met for the first time are planned by their first forward.
    """
    state = metadata_state(metadata)
    if from_hook:
        state.hooked = True
        stats["prepare_calls"] += 1
    state.planned_ids = _request_ids_stamp(metadata)
    poll_device_errors(state)
    reason = batch_decline_reason(metadata)
    if reason is not None:
        state.step, state.step_reason = None, reason
        return None
    reason = step_decline_reason(metadata)
    if reason is not None:
        state.step, state.step_reason = DeclinedStep(reason), None
        return state.step
    beam_width = int(metadata.beam_width)
    num_contexts = int(metadata.num_contexts)
    num_rows = int(metadata.num_generations)
    num_requests = num_rows // beam_width
    adapter = adapter_for(metadata.kv_cache_manager)
    request_ids = tuple(int(r) for r in metadata.request_ids[num_contexts : num_contexts + num_requests])
    if len(request_ids) != num_requests:
        raise RuntimeError(
            f"beam_shared_prefix: metadata.request_ids holds {len(metadata.request_ids)} ids for {num_contexts} "
            f"context and {num_requests} generation requests; expected one id per request"
        )
    beam0 = slice(num_contexts, num_contexts + num_rows, beam_width)
    prompt = np.asarray(runtime_view(metadata, "prompt_lens_cpu_runtime", "prompt_lens_cpu")[beam0].numpy(), dtype=np.int64)
    kv_rows = runtime_view(metadata, "kv_lens_runtime", "kv_lens")[num_contexts : num_contexts + num_rows].numpy()
    reason = _kv_lens_reason(kv_rows, beam_width, metadata, adapter)
    if reason is not None:
        if state.is_cuda_graph:  # a replay runs the captured kernels whatever prepare() decides
            raise RuntimeError(f"beam_shared_prefix: a CUDA-graph step with inconsistent lengths: {reason}. A graph "
                               f"cannot hand the step to the default kernel.")
        decline_log(logging.WARNING, f"step handed to the default kernel: {reason}")
        state.step, state.step_reason = DeclinedStep(reason), None
        return state.step
    kv = np.asarray(kv_rows[::beam_width], dtype=np.int64)
    # Warm-up and CUDA-graph dummy rows can carry no generated token (prompt_len == kv_len); the
    # prefix never extends past the current token, and never below one token.
    prompt = np.maximum(np.minimum(prompt, kv - 1), 1)
    step_prompt = int(-(-int(prompt.sum()) // max(num_requests, 1)))
    # The longest tail, not the mean: each request's tail is walked by its own programs, one block at a time.
    step_tail = int((kv - prompt).max()) if num_requests else 0
    mean_prompt = None if state.is_cuda_graph else step_prompt
    step = StepInfo(
        adapter=adapter,
        beam_width=beam_width,
        num_contexts=num_contexts,
        num_requests=num_requests,
        num_rows=num_rows,
        request_ids=request_ids,
        prompt_lens=prompt,
        mean_prompt_len=mean_prompt,
        base_key=(id(adapter), beam_width, request_ids, prompt.tobytes()),
        observed_lens=(float(step_prompt), step_tail),
    )
    state.step, state.step_reason = step, None
    stats["steps_planned"] += 1
    _learn_families(adapter)
    for family in list(adapter.families.values()):
        if step.decline_reason(family) is None:
            try:
                wrapper = wrapper_for(metadata, state, step, family)
                if state.is_cuda_graph:
                    # A graph replay follows this prepare() and runs no Python: counted here, the audit's stamps
                    # start over before they wrap (report_errors; nothing otherwise).
                    wrapper.note_graph_replay()
            except Exception as exc:
                if not isinstance(exc, _planning_errors()):
                    raise
                # Inside TensorRT-LLM's prepare(): a family the library cannot plan goes to `fallback`
                # for this step (logged), rather than failing the engine's step.
                step.declines[family.key] = f"planning failed: {exc}"
                step.unplannable.add(family.key)
                decline_log(logging.WARNING, f"{step.declines[family.key]} (handed to the default kernel)")
    return step


def _kv_lens_reason(kv_rows: np.ndarray, beam_width: int, metadata, adapter: PageAdapter) -> Optional[str]:
    """Why this step's KV lengths (host copies, one per generation row) are not a beam-search step's, or
    ``None`` (:func:`~beam_shared_prefix.kv_lens.kv_lens_problem`: every row holds this step's token and fits the
    positions its page table and ``cache_indirection`` cover, and the beams of a request advance together)."""
    capacity = kv_capacity(metadata.kv_cache_block_offsets.shape[-1], adapter.manager.tokens_per_block,
                           metadata.cache_indirection.shape[2])
    problem = kv_lens_problem(kv_rows, beam_width, capacity)
    if problem is None:
        return None
    if problem.kind == "beams_differ":
        r = problem.row // beam_width
        lengths = np.asarray(kv_rows).reshape(-1, beam_width)[r].tolist()
        return f"the beams of generation request {r} have KV lengths {lengths}; the beams of a request advance together"
    return (f"generation row {problem.row} has KV length {problem.value}, outside [1, {capacity}] (the positions its "
            f"block table and cache_indirection cover)")


def poll_device_errors(state: _MetadataState) -> None:
    """Log (ERROR, each kind once per process) what this metadata's wrappers' kernels masked in
    earlier steps: their device error flags, read without waiting on the GPU, every
    :data:`DEVICE_ERROR_POLL_STEPS` steps (a kind shows up one poll after the step that raised it).
    The step's output was wrong there, or its K/V not stored or stored over another row's; the message
    names the value and its likely cause. ``TLLM_BEAM_SHARED_PREFIX_CHECK=1`` stops at the call instead."""
    state.steps_since_poll += 1
    if state.steps_since_poll < DEVICE_ERROR_POLL_STEPS:
        return
    state.steps_since_poll = 0
    for wrapper in list(state.wrappers.values()):
        for message in wrapper.poll_device_errors():
            stats["device_errors"] += 1
            if message not in _logged_device_errors:
                _logged_device_errors.add(message)
                logger.error("beam_shared_prefix: the attention kernels met %s. Set TLLM_BEAM_SHARED_PREFIX_CHECK=1 "
                             "to stop at the call that passes it.", message)


def _planning_errors() -> tuple:
    """The library's own refusals (imported here: the adapter imports neither Triton nor the wrapper
    until a step is planned)."""
    from triton_kernels.step_args import KernelInputError

    from ..attention import AttentionInputError
    from ..plan import PlanError
    from ..prefix.base import PrefixBackendError

    return PrefixBackendError, AttentionInputError, KernelInputError, PlanError, ImportError


_instances: "weakref.WeakSet" = weakref.WeakSet()


def register_instance(fmha) -> None:
    """Record a library instance (one per layer), so ``prepare()`` can plan its attention family
    before the layer's first forward (which may be inside a CUDA-graph capture)."""
    _instances.add(fmha)


def _learn_families(adapter: PageAdapter) -> None:
    # Once per manager and per change in the number of layers; the per-step cost is one len().
    count = len(_instances)
    if getattr(adapter, "_instances_seen", -1) == count:
        return
    for fmha in list(_instances):
        fmha.family_on(adapter)
    adapter._instances_seen = count


def _request_ids_stamp(metadata) -> Optional[Tuple[object, tuple]]:
    ids = getattr(metadata, "request_ids", None)
    return None if ids is None else (ids, tuple(ids))


def _planned_for_this_step(state: _MetadataState, metadata) -> bool:
    """Whether ``metadata.request_ids`` is still what the last planning read (one identity test per
    forward; the values are compared only where the object changed)."""
    stamp, ids = state.planned_ids, getattr(metadata, "request_ids", None)
    if stamp is None or ids is None or ids is stamp[0]:
        return True
    if len(ids) == len(stamp[1]) and tuple(ids) == stamp[1]:
        state.planned_ids = (ids, stamp[1])  # a new list with the same requests: the plan stands
        return True
    return False


def step_for_forward(metadata) -> Tuple[_MetadataState, StepInfo]:
    """The state and step plan a forward on ``metadata`` runs with (planned now if ``prepare()`` was not hooked)."""
    state = metadata_state(metadata)
    if state.hooked and not _planned_for_this_step(state, metadata):
        if _capturing():
            raise RuntimeError(
                "beam_shared_prefix: metadata.request_ids changed after the last prepare() (another batch), and "
                "the step cannot be planned during CUDA graph capture. Call prepare() after setting the batch."
            )
        # prepare() ran outside the hook (or not at all) for a new batch: the stored plan is another
        # batch's pages. Plan this one now (once: the later layers find the new stamp) instead.
        decline_log(logging.WARNING, f"{type(metadata).__name__}.request_ids changed since the last hooked "
                                     f"prepare(); planning the step inside the forward")
        plan_metadata(metadata)
    if state.hooked:
        if state.step is None:
            if state.step_reason == _PREPARE_IN_CAPTURE:
                raise RuntimeError(
                    f"beam_shared_prefix: no step plan: {_PREPARE_IN_CAPTURE}. Call prepare() before "
                    "capturing (TensorRT-LLM's runner does)."
                )
            # The batch gates hold within a selection key for a consistent engine; this step's metadata
            # changed under its key (e.g. a cache_indirection sized for fewer beams): hand it over.
            reason = f"selected for a batch that prepare() found ineligible ({state.step_reason})"
            decline_log(logging.WARNING, f"{reason}; handed to the default kernel")
            return state, DeclinedStep(reason)
        return state, state.step
    if _capturing():
        raise RuntimeError(
            "beam_shared_prefix: no step plan for this metadata during CUDA graph capture: the "
            "TrtllmAttentionMetadata.prepare() hook did not run (is prepare() overridden without calling "
            "super().prepare()?). Call beam_shared_prefix.trtllm.register() before building the model."
        )
    decline_log(
        logging.WARNING,
        f"prepare() of {type(metadata).__name__} is not hooked; planning inside every forward (slow, eager only)",
    )
    step = plan_metadata(metadata)
    if step is None:  # eager (checked above): the batch gates failed under a cached selection, as in the hooked path
        reason = f"selected for a batch found ineligible ({state.step_reason})"
        decline_log(logging.WARNING, f"{reason}; handed to the default kernel")
        return state, DeclinedStep(reason)
    return state, step


def _new_wrapper(metadata, state: _MetadataState, step: StepInfo):
    from ..attention import BeamSharedPrefixAttention

    settings = current_settings()
    device = metadata.kv_cache_block_offsets.device
    graph = state.is_cuda_graph
    manager = step.adapter.manager
    stats["wrappers"] += 1
    return BeamSharedPrefixAttention(
        device,
        kv_layout="HND",
        backend=settings.backend,
        use_cuda_graph=graph,
        max_requests=step.num_requests if graph else None,
        max_beam_width=int(metadata.cache_indirection.shape[1]),
        max_prompt_pages=int(manager.max_blocks_per_seq) if graph else None,
        check=settings.check,
        report_errors=settings.report_errors,
        shared_run=settings.shared_run,
        max_tail_len=settings.max_tail_len,
        tail_impl="auto",  # the fused kernel on CUDA (and under TRITON_INTERPRET=1), the torch tail on a plain CPU
    )


def wrapper_for(metadata, state: _MetadataState, step: StepInfo, family: Family):
    """``family``'s wrapper on this metadata, planned for ``step`` (host work only on a new composition)."""
    layer = step.adapter.layer(family.layer_idx)
    indptr, indices, key = step.pages_for(metadata, family, layer)
    # The longest tail, for the wrapper's shared-run rule (None under a CUDA graph). The cascade's tail limit
    # applies to graph-replayed calls only, whose metadata hands no tail, so it never moves an eager plan.
    tail = step.judged_tail
    # A plan also bounds the cascade's launch by the tail (cascade_tail_bound): plan again where that moves.
    planned = (key, long_tail_for_shared_run(tail), cascade_tail_bound(tail))
    wrapper = state.wrappers.get(family.key)
    if wrapper is not None and state.planned_key.get(family.key) == planned:
        return wrapper
    if _capturing():
        raise RuntimeError(
            "beam_shared_prefix: a plan is needed during CUDA graph capture (a new attention shape or "
            "batch composition appeared between prepare() and capture). Planning is host work and "
            "cannot be captured; this indicates TensorRT-LLM captured without a warm-up forward."
        )
    if wrapper is None:
        wrapper = _new_wrapper(metadata, state, step)
        state.wrappers[family.key] = wrapper
    # A plan that fails leaves the wrapper with no active plan: forget the old composition's key too, or
    # the next step of that composition would find the key and run an unplanned wrapper.
    state.planned_key.pop(family.key, None)
    try:
        wrapper.plan(
            indptr,
            indices,
            step.prompt_lens,
            step.beam_width,
            family.num_qo_heads,
            family.num_kv_heads,
            family.head_dim,
            layer.page_size,
            layer.num_pages,
            family.dtype,
            sm_scale=family.sm_scale,
            key=key,
            max_tail_len=tail,
            # (the planner then tells a padded CUDA-graph batch's copies of its dummy request, one id, from two
            # requests given one page list)
            request_ids=step.request_ids,
        )
    except Exception as exc:
        if state.is_cuda_graph and family.key in state.served_families and isinstance(exc, _planning_errors()):
            # The graph was captured with this library's kernels, which a replay runs whatever prepare()
            # decides: handing the step over would replay them on the previous plan's buffers. (A family
            # whose layers never ran them here, e.g. sliding-window layers declined per call, is handed over.)
            raise RuntimeError(
                f"beam_shared_prefix: this CUDA-graph step cannot be planned ({type(exc).__name__}: {exc}), and a "
                f"graph captured with the library's kernels cannot hand a step to the default kernel: it stops "
                f"here instead of replaying the previous batch's plan. Run without CUDA graphs, or without "
                f"beam_shared_prefix in TLLM_FMHA_LIBS, to serve this batch."
            ) from exc
        raise
    state.planned_key[family.key] = planned
    stats["plans"] += 1
    return wrapper


# ------------------------------------------------------------------------------------------------
# The prepare() hook

_depth = threading.local()
_PREPARE_IN_CAPTURE = "prepare() ran during CUDA graph capture, where host planning cannot be captured"


def _wrap_prepare(original):
    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        # A subclass's prepare() calling super().prepare() reaches this wrapper twice; plan once,
        # when the outermost call has finished.
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _depth.value = depth
        if depth == 0:
            if _capturing():
                # Never expected (doc: prepare() precedes capture); planning here could not be
                # captured, and the previous step's plan must not be used for this one.
                state = metadata_state(self)
                state.hooked, state.step = True, None
                state.step_reason = _PREPARE_IN_CAPTURE
                state.planned_ids = _request_ids_stamp(self)
            else:
                plan_metadata(self, from_hook=True)
        return result

    setattr(prepare, _WRAPPED_MARK, True)
    prepare.__wrapped_original__ = original
    return prepare


def _all_subclasses(cls):
    seen, stack = [], [cls]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.append(c)
        stack.extend(c.__subclasses__())
    return seen


def install_prepare_hook(metadata_cls) -> int:
    """Wrap ``prepare`` of ``metadata_cls`` and of its subclasses that define their own; returns how many were wrapped."""
    count = 0
    for cls in _all_subclasses(metadata_cls):
        original = cls.__dict__.get("prepare")
        if original is None or getattr(original, _WRAPPED_MARK, False):
            continue
        setattr(cls, "prepare", _wrap_prepare(original))
        count += 1
    return count


def uninstall_prepare_hook(metadata_cls) -> None:
    """Undo :func:`install_prepare_hook` (tests)."""
    for cls in _all_subclasses(metadata_cls):
        wrapped = cls.__dict__.get("prepare")
        if wrapped is not None and getattr(wrapped, _WRAPPED_MARK, False):
            setattr(cls, "prepare", wrapped.__wrapped_original__)


def _metadata_module_name(fmha_cls) -> str:
    # "<root>.fmha" -> "<root>.trtllm", e.g. tensorrt_llm._torch.attention.backends.trtllm
    package = fmha_cls._bsp_api.fmha_package
    return package.rsplit(".", 1)[0] + ".trtllm"


def try_install_prepare_hook(fmha_cls) -> bool:
    """Install the hook now if TensorRT-LLM's ``trtllm`` module is fully imported (no import here:
    registration can run while that module is itself still importing)."""
    import sys

    name = _metadata_module_name(fmha_cls)
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return False
    metadata_cls = getattr(module, "TrtllmAttentionMetadata", None)
    if metadata_cls is None:
        return False
    install_prepare_hook(metadata_cls)
    return True


def ensure_prepare_hook(fmha_cls) -> None:
    """Install the hook, importing TensorRT-LLM's ``trtllm`` module (layer construction time)."""
    import importlib

    name = _metadata_module_name(fmha_cls)
    module = importlib.import_module(name)
    metadata_cls = getattr(module, "TrtllmAttentionMetadata", None)
    if metadata_cls is None:
        raise RuntimeError(
            f"beam_shared_prefix: {name} has no TrtllmAttentionMetadata; this TensorRT-LLM layout is not "
            "supported. Remove beam_shared_prefix from TLLM_FMHA_LIBS."
        )
    install_prepare_hook(metadata_cls)
