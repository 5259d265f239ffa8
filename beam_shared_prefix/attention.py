"""``BeamSharedPrefixAttention``: the engine-agnostic plan/run wrapper of one beam-search decode step.

One step of one attention layer, for ``R`` requests of ``W`` beams (beam row ``i = r*W + b``):

1. **prefix** (a :mod:`~beam_shared_prefix.prefix` backend): each request's prompt, read once from
   beam 0's pages, attended by the request's ``W`` query rows; output and LSE into persistent buffers;
2. **tail** (:func:`triton_kernels.beam_tail_attention_merge`, one launch): each beam's generated
   positions gathered through ``cache_indirection``, this step's K/V written at ``kv_len - 1`` and
   used from registers, and the result merged with the prefix state by log-sum-exp into ``out``.

The ``triton`` backend fuses both into one launch (:func:`triton_kernels.beam_cascade_attention`):
the prompt is attended on tensor cores per block of beams, and the prefix state never leaves
registers. It is what ``backend="auto"`` picks where it measured faster (short and medium prompts).

On the two-launch paths a third launch may sit between the two, the **shared-run stage**
(:func:`triton_kernels.beam_shared_run_attention`): the generated positions that every beam of a block
reads from one ancestor (beam search's histories coalesce a few steps back) are attended once per block and
merged into the prefix state, and the tail skips them. ``shared_run="auto"`` (the default) runs it for
steps whose longest tail, given to :meth:`BeamSharedPrefixAttention.plan` as ``max_tail_len``, is at least
:data:`~beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL` generated tokens, where it measured faster,
and there ``backend="auto"`` prefers the two-launch paths to the cascade. At MHA (head 128) ``auto``
also leaves the cascade for FA4 + tail past
:data:`~beam_shared_prefix.prefix.cascade_rule.CASCADE_MAX_TAIL` generated tokens, but only with
``use_cuda_graph=True``: an eager call pays FA4's host time (about twice the cascade's) every time, which
outweighed its device gain on the H200.

Modelled on FlashInfer's wrappers: :meth:`BeamSharedPrefixAttention.plan` is host work done once
per batch composition (the prompt pages of a request do not change while it decodes), cached by
composition, and :meth:`BeamSharedPrefixAttention.run` is device work only, every layer and step:
no host sync and no allocation when ``out`` is given, so it can be captured in a CUDA graph. The
tail length is read from ``kv_lens`` on the device, so one capture serves any output length.

CUDA graphs: construct with ``use_cuda_graph=True`` and the ``max_*`` capacities, plan, run once
eagerly (compiles the Triton and FA4 kernels), capture ``run()``, then before each replay copy the
step's inputs into the captured tensors and call ``plan()`` (a no-op while the composition is
unchanged; an in-place rewrite of the fixed buffers when it changes). A captured ``run()`` stays
valid while the number of requests, the beam width and the attention shape stay the same. In this
mode ``backend="auto"`` picks the backend once per shape, at its first plan, and keeps it (a captured
launch cannot switch kernels); it judges the shape at the longest prompt the capture can serve
(``max_prompt_pages`` pages), not at the first batch's prompts
(:func:`~beam_shared_prefix.prefix.cascade_rule.graph_rule_prompt`), and at ``max_requests`` requests. The
shared-run stage is decided at the same first plan and kept: with ``shared_run="auto"`` it is captured
only if that plan's ``max_tail_len`` was long enough (an engine capturing at warm-up passes none); the
tail limit of the cascade is judged at that plan's ``max_tail_len`` too (none: not judged), and kept.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .config import BACKENDS, load_settings, shared_run_mode, triton_interpret_env
from .kv_lens import kv_capacity
from .plan import StepPlan, StepPlanner, _as_int
from .prefix.base import (
    ALIGNED_FIX,
    PrefixBackend,
    default_sm_scale,
    ensure_not_capturing,
    kv_planes,
    logger,
    unaligned_16_byte_vectors,
)
from .prefix.buffers import DeviceBuffer
from .prefix.flashinfer import PREFIX_KERNELS
from .prefix.select import (BACKEND_CLASSES, cascade_preferred, cascade_tail_bound, graph_rule_prompt,
                            long_tail_for_shared_run, resolve_prefix_backend, split_kv_preferred)

__all__ = ["BeamSharedPrefixAttention", "AttentionInputError", "TAIL_IMPLS"]

TAIL_IMPLS = ("auto", "triton", "torch")
DTYPES = (torch.bfloat16, torch.float16)
#: The page-table audit's stamp, an int32 the audit advances on the device, would wrap after 2**31 audits (the
#: holders of earlier steps would then outrank this step's). The wrapper starts its workspace over (zeroed holders,
#: stamp 1) once this many plan() calls, audited run() calls and graph replays (:meth:`note_graph_replay`, which a
#: replay needs since it runs no Python) are counted: a step audits at most twice.
AUDIT_RESTART = 2**29


class AttentionInputError(ValueError):
    """An argument of ``plan()``/``run()`` that does not match the plan; the message names value, limit and fix."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class BeamSharedPrefixAttention:
    """Cascade attention for wide beam search: shared prompt once per request, per-beam tail fused.

    Args:
        device: the CUDA device (or ``"cpu"``: the reference prefix and the Triton interpreter/torch tail).
        kv_layout: ``"HND"`` (``[pages, 2, Hkv, Pg, D]``, TensorRT-LLM's ``get_buffers(layer, "HND")``) or
            ``"NHD"`` (``[pages, 2, Pg, Hkv, D]``); dim 1 is K, V; the pool may be a strided view.
        backend: prefix backend, ``"auto"`` | ``"triton"`` | ``"flashinfer"`` | ``"fa4"`` | ``"reference"``; ``None`` reads
            ``TLLM_BEAM_SHARED_PREFIX_BACKEND`` (default ``auto``; rule in :mod:`beam_shared_prefix.prefix.select`).
        use_cuda_graph: keep every buffer ``run()`` touches at a fixed address (see the module docs).
        max_requests: most requests a plan may hold (required with ``use_cuda_graph``).
        max_beam_width: the beam width the KV cache and ``cache_indirection`` were sized for; a plan
            with a wider beam is refused (required with ``use_cuda_graph``).
        max_prompt_pages: most prompt pages of one request (required with ``use_cuda_graph``).
        check: check mode (:mod:`beam_shared_prefix.check`); ``None`` reads ``TLLM_BEAM_SHARED_PREFIX_CHECK``.
        tail_impl: ``"auto"`` (default: the fused Triton kernel on CUDA, or on the CPU under
            ``TRITON_INTERPRET=1``; the unfused torch path on a plain CPU), ``"triton"`` (the fused
            kernel) or ``"torch"`` (the unfused reference; one host sync, not graph-capturable).
        prefix_kernel: FlashInfer kernel family, ``"auto"`` | ``"fa2"`` | ``"fa3"`` (benchmarks force one).
        report_errors: give the kernels a device error flag (:attr:`error_flags`): invalid lengths,
            pages or indirection entries they mask are reported without a sync, read by
            :meth:`poll_device_errors` or :meth:`device_errors`; once a step, in the runs of the first layer
            served, the page-table audit (:mod:`triton_kernels.page_table_audit`) adds what is valid index by
            index and wrong only together: beams unlike beam 0, a write page held elsewhere in its request or
            by another request, beam 0's prompt pages unlike the plan's. Its cost is in ``docs/design.md``
            (the flag's cost); ``None`` reads ``TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS`` (default off).
        page_table_audit: with ``report_errors``, run the page-table audit once a step (default); ``False``
            leaves it out, so every run() pays the kernels' checks alone, as a model's later layers do (the
            benchmark's ``auto-flag-layer`` arm times that), and nothing judges the table as a whole.
        shared_run: on the two-launch paths (a FlashInfer or FA4 prefix, then the Triton tail), attend the
            generated positions that every beam of a block reads from one ancestor once per block between
            the two (:func:`triton_kernels.beam_shared_run_attention`), and let the tail skip them.
            ``"auto"``: for plans whose ``max_tail_len`` is at least
            :data:`~beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL` (there ``backend="auto"`` also
            prefers the two-launch paths to the cascade); ``True``/``"on"``: every step; ``False``/``"off"``:
            never. ``None`` reads ``TLLM_BEAM_SHARED_PREFIX_SHARED_RUN`` (default ``"auto"``).
        max_tail_len: the longest tail any step will have, in generated tokens per beam (this step's
            included); ``None`` (default): unknown. The cascade leaves paths out of its launch that no such
            tail takes (:func:`triton_kernels.cascade.cascade_launch_config`; 1-26% a step at 4-16 tokens in
            some tilings). Eager steps use their plan's ``max_tail_len`` where given; under CUDA graphs a
            capture keeps its launches, so only this bound applies there. A plan past it logs a warning
            once: the steps stay exact (the bound is about speed), but captured ones miss the long-tail path.
            ``None`` reads ``TLLM_BEAM_SHARED_PREFIX_MAX_TAIL`` (default unset).

    Attributes:
        backend_name: the prefix backend serving the active plan (``None`` before the first plan).
        num_backend_plans: backend (re-)plans done: plans that were not a cache hit of the active one.
        num_plan_builds: step plans built by the planner (cache misses).
        error_flags: ``int32 [1]`` on the device, the bits of :mod:`triton_kernels.device_errors` the
            kernels set (``None`` without ``report_errors``); a fixed address, so CUDA graphs keep it.
    """

    def __init__(
        self,
        device,
        kv_layout: str = "HND",
        backend: Optional[str] = None,
        use_cuda_graph: bool = False,
        max_requests: Optional[int] = None,
        max_beam_width: Optional[int] = None,
        max_prompt_pages: Optional[int] = None,
        check: Optional[bool] = None,
        tail_impl: str = "auto",
        prefix_kernel: str = "auto",
        report_errors: Optional[bool] = None,
        shared_run: Union[None, bool, str] = None,
        max_tail_len: int | None = None,
        page_table_audit: bool = True,
    ):
        # Only the settings left to the environment are read (the wrapper has no use for the decline mode).
        given = dict(backend=backend, check=check, report_errors=report_errors, shared_run=shared_run,
                     max_tail_len=max_tail_len)
        settings = load_settings(fields=[name for name, value in given.items() if value is None])
        backend = settings.backend if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not accepted; use one of {', '.join(BACKENDS)}.")
        for name, value in (("use_cuda_graph", use_cuda_graph), ("check", check), ("report_errors", report_errors),
                            ("page_table_audit", page_table_audit)):
            # bool() would read "0" or "off" as on (the environment's variables take strings; these do not).
            if value is not None and not (isinstance(value, (bool, np.bool_)) or (type(value) is int
                                                                                  and value in (0, 1))):
                raise ValueError(f"{name}={value!r} is not accepted; pass True or False.")
        if kv_layout not in ("HND", "NHD"):
            raise ValueError(f"kv_layout={kv_layout!r} is not supported; use 'HND' or 'NHD'.")
        if tail_impl not in TAIL_IMPLS:
            raise ValueError(
                f"tail_impl={tail_impl!r} is not accepted; use 'auto', 'triton' (fused) or 'torch' (unfused)."
            )
        if prefix_kernel not in PREFIX_KERNELS:
            raise ValueError(f"prefix_kernel={prefix_kernel!r} is not accepted; use one of {PREFIX_KERNELS}.")
        for name, value in (("max_requests", max_requests), ("max_beam_width", max_beam_width),
                            ("max_prompt_pages", max_prompt_pages)):
            if value is not None and _as_int(name, value, ValueError) < 1:
                raise ValueError(f"{name}={value} must be >= 1.")
        if use_cuda_graph and None in (max_requests, max_beam_width, max_prompt_pages):
            raise ValueError(
                "use_cuda_graph=True needs max_requests, max_beam_width and max_prompt_pages: the buffers a "
                "captured run() reads are allocated once at those capacities."
            )
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):  # meta holds no data; mps, xpu have no kernel or tail here
            raise ValueError(f"device={device!r}: the wrapper runs on a CUDA device or the CPU, not "
                             f"{self.device.type!r}.")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type == "cpu":
            self.device = torch.device("cpu")  # (torch puts every CPU tensor on "cpu", never "cpu:0")
        if use_cuda_graph and tail_impl == "torch" and self.device.type == "cuda":
            # (a CPU wrapper's graph mode runs the same host logic in tests; nothing is captured there)
            raise ValueError("use_cuda_graph=True cannot take tail_impl='torch' on a GPU: the torch tail reads the tail "
                             "lengths on the host, which a captured graph cannot; use tail_impl='auto' or 'triton'.")
        self.kv_layout = kv_layout
        self.requested_backend = backend
        self.use_cuda_graph = bool(use_cuda_graph)
        self.max_requests = None if max_requests is None else int(max_requests)
        self.max_beam_width = None if max_beam_width is None else int(max_beam_width)
        self.max_prompt_pages = None if max_prompt_pages is None else int(max_prompt_pages)
        self.check = bool(settings.check if check is None else check)
        if tail_impl == "auto":
            # A Triton kernel needs CUDA tensors unless the interpreter is on (CPU tests).
            tail_impl = "triton" if (self.device.type == "cuda" or triton_interpret_env()) else "torch"
        self.tail_impl = tail_impl
        self.prefix_kernel = prefix_kernel
        self.check_tolerance = None  # a CheckTolerance overrides the per-dtype defaults of check mode
        report_errors = bool(settings.report_errors if report_errors is None else report_errors)
        self.error_flags = None
        if report_errors:
            from triton_kernels.device_errors import new_error_flags  # deferred: triton is imported on first use

            self.error_flags = new_error_flags(self.device)
        self._errors_seen = 0
        self._error_poll = None  # (pinned host word, event) of the copy in flight
        self._audit_layer: Optional[int] = None  # the pool view the page-table audit rides with (its address)
        self._audited_since_plan = False
        self._audit_workspace = None  # the audit's page holders and stamp, made at plan() (never inside a capture)
        self._audit_uses = 0  # plan() calls and audited run() calls on the workspace (AUDIT_RESTART)
        self.page_table_audit = bool(page_table_audit) and self.error_flags is not None
        self.shared_run = shared_run_mode(settings.shared_run if shared_run is None else shared_run)
        max_tail_len = settings.max_tail_len if max_tail_len is None else max_tail_len
        if max_tail_len is not None:
            max_tail_len = _as_int("max_tail_len", max_tail_len, ValueError)
            if max_tail_len < 1:
                raise ValueError(f"max_tail_len={max_tail_len} must be >= 1 (generated tokens per beam, this step's "
                                 f"included), or None where the longest tail is unknown.")
        self.max_tail_len = max_tail_len
        self._launch_tail: int | None = None  # the bound the cascade's launch gets, set by every plan()
        self._warned_tail_bound = False
        self._graph_long_tail: Dict[tuple, bool] = {}  # CUDA graphs: the first plan's verdict, per shape

        self._planner: Optional[StepPlanner] = None
        self._builds_before = 0
        self._backends: Dict[str, PrefixBackend] = {}
        self._backend_for_problem: Dict[tuple, str] = {}
        # (plan, problem key, backend, long tail): what run() serves; None before plan() and after a failed one.
        self._active: Optional[Tuple[StepPlan, tuple, PrefixBackend, bool]] = None
        self._views: Dict[str, torch.Tensor] = {}
        frozen = self.use_cuda_graph
        self._out_buffers: Dict[torch.dtype, DeviceBuffer] = {}
        self._lse_buffer = DeviceBuffer("prefix LSE", torch.float32, self.device, frozen)
        self._row_prompt_lens = DeviceBuffer("per-row prompt lengths", torch.int32, self.device, frozen)
        self._plan_digest = DeviceBuffer("prompt pages digest", torch.int64, self.device, frozen)
        self._tail_skip = DeviceBuffer("tail skip", torch.int32, self.device, frozen)
        self.num_backend_plans = 0
        self._warned_capture_check = False

    # ------------------------------------------------------------------------------------------
    @property
    def backend_name(self) -> Optional[str]:
        """The active plan's prefix backend: ``"triton"``, ``"flashinfer"``, ``"fa4"`` or ``"reference"``; ``None`` before plan()."""
        return None if self._active is None else self._active[2].name

    @property
    def backend(self) -> Optional[PrefixBackend]:
        """The prefix backend instance of the active plan."""
        return None if self._active is None else self._active[2]

    @property
    def shared_stage_active(self) -> bool:
        """Whether the active plan's run() launches the shared-run stage between the prefix and the tail."""
        return self._active is not None and "tail_skip" in self._views

    @property
    def num_plan_builds(self) -> int:
        """Step plans built so far (planner cache misses, across pool re-creations); cached re-plans do not count."""
        return self._builds_before + (0 if self._planner is None else self._planner.num_builds)

    @property
    def active_plan(self) -> Optional[StepPlan]:
        """The :class:`StepPlan` the next run() uses; ``None`` before plan()."""
        return None if self._active is None else self._active[0]

    def _planner_for(self, page_size: int, num_cache_pages: int) -> StepPlanner:
        p = self._planner
        if p is None or p.page_size != page_size or p.num_cache_pages != num_cache_pages:
            # A new pool geometry (the KV cache was re-created): plans of the old pool are stale.
            if p is not None:
                self._builds_before += p.num_builds
            self._planner = StepPlanner(page_size, num_cache_pages, max_beam_width=self.max_beam_width)
            self._active = None
        return self._planner

    def _long_tail(self, problem_key: tuple, max_tail_len: Optional[float]) -> bool:
        """Whether this plan is a long-tail step for the shared-run stage (never with ``shared_run="off"``);
        under CUDA graphs the first plan's verdict per shape, since a capture keeps its launches."""
        if self.shared_run == "off":
            return False
        long_tail = long_tail_for_shared_run(max_tail_len)
        if self.use_cuda_graph:
            return self._graph_long_tail.setdefault(problem_key, long_tail)
        return long_tail

    def _backend_for(self, problem_key: tuple, step_plan: StepPlan, tail_len: Optional[float]) -> PrefixBackend:
        # The auto rule depends on the batch (requests, mean prompt, beam width) only through whether
        # it prefers FlashInfer's split prompt and whether it prefers the cascade, so the choice is
        # cached per (shape, those answers) and logged once each. In CUDA-graph mode it is made once
        # per shape, at its first plan, and kept: a captured run() launches the kernels of the
        # backend it was captured with, so it must not change under it.
        hq, hkv, d, pg, dtype, _ = problem_key
        mean_prompt = float(step_plan.prompt_lens.mean()) if step_plan.num_requests else None
        num_requests = step_plan.num_requests
        side = None
        if not self.use_cuda_graph and self.requested_backend == "auto":
            side = (split_kv_preferred(num_requests=num_requests, mean_prompt_len=mean_prompt, num_qo_heads=hq,
                                       num_kv_heads=hkv, beam_width=step_plan.beam_width, head_dim=d, eager=True)[0],
                    cascade_preferred(mean_prompt_len=mean_prompt, num_qo_heads=hq, num_kv_heads=hkv,
                                      beam_width=step_plan.beam_width, head_dim=d, num_requests=num_requests,
                                      tail_len=tail_len, shared_run=self.shared_run != "off", eager=True,
                                      tail_bound=self._launch_tail)[0])
        # One beam can rule FA4 out (whole_page_reason, on SM100): a width-1 plan must not reuse a wider one's choice.
        cache_key = (problem_key, side, step_plan.beam_width == 1)
        name = self._backend_for_problem.get(cache_key)
        if name is None:
            if self.use_cuda_graph:
                # One choice for every batch the capture may serve, not the first batch's (often a
                # warm-up's dummy prompts): judged at the prompt table's width and the wrapper's
                # request capacity (TensorRT-LLM sizes graph metadata for that graph's batch).
                mean_prompt = graph_rule_prompt(self.max_prompt_pages * pg, hq, hkv, step_plan.beam_width, d)
                num_requests = self.max_requests
            name = resolve_prefix_backend(self.requested_backend, self.device, dtype, d, hq, hkv, pg, self.kv_layout,
                                          mean_prompt_len=mean_prompt, beam_width=step_plan.beam_width,
                                          num_requests=num_requests, tail_len=tail_len,
                                          shared_run=self.shared_run != "off", eager=not self.use_cuda_graph,
                                          tail_bound=self._launch_tail)
            self._backend_for_problem[cache_key] = name
            logger.info("beam_shared_prefix: prefix backend %s serves Hq=%d Hkv=%d D=%d page %d %s, %s %s "
                        "(requested %s)", name, hq, hkv, d, pg, _dtype_name(dtype),
                        "CUDA graph, judged at a prompt of" if self.use_cuda_graph else "mean prompt",
                        "unknown" if mean_prompt is None else f"{mean_prompt:.0f}", self.requested_backend)
        backend = self._backends.get(name)
        if backend is None:
            kwargs = dict(kv_layout=self.kv_layout, use_cuda_graph=self.use_cuda_graph, max_requests=self.max_requests,
                          max_beam_width=self.max_beam_width, max_prompt_pages=self.max_prompt_pages)
            if name == "flashinfer":
                kwargs["prefix_kernel"] = self.prefix_kernel
            backend = BACKEND_CLASSES[name](self.device, **kwargs)
            self._backends[name] = backend
        return backend

    # ------------------------------------------------------------------------------------------
    def plan(
        self,
        prompt_page_indptr,
        prompt_page_indices,
        prompt_lens,
        beam_width: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_cache_pages: int,
        dtype: torch.dtype,
        sm_scale: Optional[float] = None,
        key: Hashable = None,
        max_tail_len: Optional[int] = None,
        request_ids: Optional[Sequence[Hashable]] = None,
    ) -> StepPlan:
        """Plan a batch composition (host only; never during CUDA-graph capture).

        Call it on the stream the step's :meth:`run` calls use (TensorRT-LLM's one execution stream): a plan
        rewrites device tables that the previous step's kernels may still be reading, and only stream order
        keeps the rewrite behind them.

        Args:
            prompt_page_indptr: ``[R + 1]`` ints (CPU), offsets of each request's pages in ``prompt_page_indices``.
            prompt_page_indices: flat ints (CPU), beam 0's pages per request (its whole list may be given:
                only the first ``ceil(P_r / page_size)`` are used).
            prompt_lens: ``[R]`` ints, prompt length per request (tokens, ``>= 1``).
            beam_width: ``W`` (``<= max_beam_width``).
            num_qo_heads, num_kv_heads, head_dim: ``Hq``, ``Hkv`` (``Hq % Hkv == 0``), ``D``.
            page_size: tokens per KV page.
            num_cache_pages: pages in the pool (exclusive bound of every page index).
            dtype: ``torch.bfloat16`` or ``torch.float16`` (Q, KV, output).
            sm_scale: softmax scale (default ``1 / sqrt(head_dim)``).
            key: a hashable composition key (e.g. ``(tuple(request_ids), W)``); equal keys promise equal
                inputs and skip all array work (check mode verifies it: stage ``"plan"``). Default: a digest
                of the inputs.
            max_tail_len: the step's longest tail, generated tokens per beam with this step's own
                (``max(kv_len) - prompt_len`` over the batch), as the host knows it; ``None``: unknown. It
                decides whether the shared-run stage runs (reaching
                :data:`~beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL`, ``shared_run="auto"``) and, with
                ``backend="auto"``, whether the cascade is preferred (every eager plan; under ``use_cuda_graph`` the
                first plan's, against :data:`~beam_shared_prefix.prefix.cascade_rule.CASCADE_MAX_TAIL`); an eager step's
                cascade launch is given it as a bound (a captured one, the constructor's ``max_tail_len``, which a
                larger value here warns about once). run() reads the true lengths from ``kv_lens``.
            request_ids: ``R`` hashable request ids, where the caller knows them (a ``key`` must then cover
                them): requests of one prompt length and one page list are copies of one request (a padded
                CUDA-graph batch repeats its dummy) only under one id, so two requests given one partly filled
                prompt page are refused. ``None``: such requests are taken as copies.

        Returns:
            The :class:`StepPlan` (the same object while the composition is unchanged; then the backend
            is not planned again either: :attr:`num_backend_plans` does not move, except once where the
            tail reaches :data:`~beam_shared_prefix.prefix.cascade_rule.SHARED_RUN_MIN_TAIL` and ``auto`` moves
            the batch from the cascade to a two-launch path).
        """
        ensure_not_capturing("BeamSharedPrefixAttention.plan()")
        # A plan that fails anywhere, its argument checks included, leaves no active plan: run() then
        # refuses instead of serving the previous batch's pages with this batch's tensors.
        active, self._active = self._active, None
        self._audited_since_plan = False
        if dtype not in DTYPES:
            raise AttentionInputError(f"dtype={dtype!r} is not supported; use torch.bfloat16 or torch.float16.")
        num_qo_heads, num_kv_heads, head_dim, page_size, num_cache_pages = (
            _as_int(n, v, AttentionInputError) for n, v in (
                ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                ("page_size", page_size), ("num_cache_pages", num_cache_pages)))
        if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise AttentionInputError(
                f"num_qo_heads={num_qo_heads} must be a positive multiple of num_kv_heads={num_kv_heads} (GQA/MHA)."
            )
        if head_dim < 1:
            raise AttentionInputError(f"head_dim={head_dim} must be >= 1.")
        if max_tail_len is not None:
            max_tail_len = _as_int("max_tail_len", max_tail_len, AttentionInputError)
            if max_tail_len < 0:
                raise AttentionInputError(
                    f"max_tail_len={max_tail_len} must be >= 0 (generated tokens per beam, this step's included), "
                    f"or None where the host does not know it."
                )
        try:
            scale = default_sm_scale(head_dim, sm_scale)
        except ValueError as exc:
            raise AttentionInputError(str(exc)) from None
        planner = self._planner_for(page_size, num_cache_pages)
        if self.page_table_audit and self.tail_impl == "triton":
            self._count_audit_use(self._audit_workspace_for(num_cache_pages))
        builds = planner.num_builds
        step_plan = planner.plan(prompt_page_indptr, prompt_page_indices, prompt_lens, beam_width, key=key,
                                 request_ids=request_ids)
        if self.check and key is not None and planner.num_builds == builds:
            from . import check as chk  # a key is taken on trust; check mode holds it to its promise

            chk.check_plan_inputs(step_plan, prompt_page_indptr, prompt_page_indices, prompt_lens, request_ids)
        self._set_launch_tail(max_tail_len)  # every plan, the cache hits too: the tail moves within a composition
        problem_key = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, scale)
        long_tail = self._long_tail(problem_key, max_tail_len)
        same_step = active is not None and active[0] is step_plan and active[1] == problem_key
        if same_step and active[3] == long_tail:
            self._active = active
            return step_plan
        # Checked where a plan is built, not on the cache hits above (every step): a shape passes once.
        if self.tail_impl == "triton":  # refused here, not at the first run() of a planned batch
            from triton_kernels.tail_merge import tail_supported  # deferred: imports triton

            ok, reason = tail_supported(num_qo_heads // num_kv_heads, head_dim)
            if not ok:
                fix = ("no CUDA-graph wrapper serves this shape (the torch tail cannot be captured); run it eagerly"
                       if self.use_cuda_graph and self.device.type == "cuda"
                       else "build the wrapper with tail_impl='torch' for this shape")
                raise AttentionInputError(f"head_dim={head_dim}, GQA group {num_qo_heads // num_kv_heads}: {reason}; "
                                          f"{fix}.")
        backend = self._backend_for(problem_key, step_plan, max_tail_len)
        if not (same_step and active[2] is backend):  # else only the shared-run stage moved: the plan stands
            backend.plan(step_plan, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, problem_key[5])
            self.num_backend_plans += 1
        self._prepare_buffers(step_plan, problem_key, backend, long_tail)
        self._active = (step_plan, problem_key, backend, long_tail)
        return step_plan

    def _set_launch_tail(self, max_tail_len: int | None) -> None:
        """The tail bound the next run()'s cascade launch gets: the plan's on eager steps, else the wrapper's."""
        over = max_tail_len is not None and self.max_tail_len is not None and max_tail_len > self.max_tail_len
        if over and not self._warned_tail_bound:
            self._warned_tail_bound = True
            logger.warning("beam_shared_prefix: a step's tail of %d generated tokens exceeds max_tail_len=%d; "
                           "its results stay exact, but launches captured under that bound leave out the "
                           "long-tail path (slower there); raise max_tail_len (TLLM_BEAM_SHARED_PREFIX_MAX_TAIL).",
                           max_tail_len, self.max_tail_len)
        step_tail = max_tail_len if max_tail_len is not None and not self.use_cuda_graph else self.max_tail_len
        self._launch_tail = cascade_tail_bound(step_tail)

    def _prepare_buffers(self, step_plan: StepPlan, problem_key: tuple, backend: PrefixBackend,
                         long_tail: bool) -> None:
        hq, _, d, _, dtype, _ = problem_key
        rows = step_plan.num_rows
        cap_rows = (self.max_requests or 0) * (self.max_beam_width or 0)
        out_buffer = self._out_buffers.get(dtype)
        if out_buffer is None:
            out_buffer = self._out_buffers[dtype] = DeviceBuffer(
                f"prefix output ({_dtype_name(dtype)})", dtype, self.device, self.use_cuda_graph
            )
        self._views = dict(
            prefix_out=out_buffer.view((rows, hq, d), capacity=cap_rows * hq * d),
            prefix_lse=self._lse_buffer.view(backend.lse_shape(rows, hq), capacity=cap_rows * hq),
            prompt_lens=self._row_prompt_lens.write(step_plan.prompt_lens_per_row, capacity=cap_rows),
        )
        if self.page_table_audit:  # what the audit compares beam 0's page table with (PLAN_PAGE)
            self._views["plan_digest"] = self._plan_digest.write(step_plan.prompt_pages_digest,
                                                                 capacity=self.max_requests or 0)
        if self._runs_shared_stage(backend, problem_key, long_tail):
            self._views["tail_skip"] = self._tail_skip.view((rows,), capacity=cap_rows)

    def _runs_shared_stage(self, backend: PrefixBackend, problem_key: tuple, long_tail: bool) -> bool:
        """Whether ``run()`` puts the shared-run stage between the prefix and the tail: ``shared_run="on"``,
        or ``"auto"`` on a long-tail step; a two-launch path with the Triton tail; and a group and head size
        the stage tiles."""
        wanted = self.shared_run == "on" or (self.shared_run == "auto" and long_tail)
        if not wanted or self.tail_impl != "triton" or getattr(backend, "fuses_tail", False):
            return False
        from triton_kernels.shared_run import shared_run_supported  # deferred: triton is imported on first use

        hq, hkv, d = problem_key[:3]
        ok, reason = shared_run_supported(hq // hkv, d)
        if not ok:
            logger.info("beam_shared_prefix: shared_run is off for this shape: %s", reason)
        return ok

    # ------------------------------------------------------------------------------------------
    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        beam_page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        cache_indirection: torch.Tensor,
        new_k: Optional[torch.Tensor] = None,
        new_v: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        page_index_divisor: int = 1,
    ) -> torch.Tensor:
        """Attention of every beam row over its whole history (device only, capturable).

        Args:
            q: ``[R*W, Hq, D]`` in the planned dtype, last dim contiguous (a slice of a fused QKV is fine).
            kv_cache: the paged pool (``kv_layout``), ``num_cache_pages`` pages of ``page_size`` tokens,
                ``Hkv`` heads of ``D``, planned dtype; may be a strided per-layer view. Where the batch's
                prefix backend is FlashInfer or FA4, ``q``'s and the pool's addresses and strides but the last
                must be multiples of 16 bytes (their kernels move 16-byte vectors; TensorRT-LLM's always are).
            beam_page_table: ``[>= R*W, max_pages]`` int32, page entries of each beam row
                (``entry // page_index_divisor`` is the page); ``max_pages * page_size`` covers
                ``cache_indirection``'s last dim.
            kv_lens: ``[R*W]`` int32 on the device, KV length including this step's token.
            cache_indirection: ``[>= R, W_max, max_seq_len]`` int32, source beam of each position.
            new_k, new_v: ``[R*W, Hkv, D]``, this step's K/V, written at ``kv_len - 1`` of the row's own
                page by the tail kernel. ``None``: the engine already wrote them; they are read back
                from the cache (a small gather).
            out: ``[R*W, Hq, D]`` output in the planned dtype (allocated when ``None``).
            page_index_divisor: ``1`` for page numbers; TensorRT-LLM block offsets use
                ``layers_in_pool * kv_factor`` with the K field view of the offsets as the page table. An
                int or numpy integer in ``[1, 2**31 - 1]``.

        Returns:
            ``out``.
        """
        if self._active is None:
            raise AttentionInputError("run() before plan(): call plan() for this batch first.")
        step_plan, problem_key, backend, _ = self._active
        hq, hkv, d, pg, dtype, sm_scale = problem_key
        rows = step_plan.num_rows
        if isinstance(page_index_divisor, np.integer):
            # (a pool's shape arithmetic in numpy gives one; the kernels take a Python int)
            page_index_divisor = int(page_index_divisor)
        self._validate_run(q, kv_cache, beam_page_table, kv_lens, cache_indirection, new_k, new_v, out,
                           page_index_divisor, step_plan, problem_key)
        if backend.moves_16_byte_vectors:  # (addresses: per call, not in the memoized metadata checks)
            for name, x in (("q", q), ("kv_cache", kv_cache)):
                unaligned = unaligned_16_byte_vectors(name, x)
                if unaligned:
                    raise AttentionInputError(f"{unaligned}, which the {backend.name} prefix kernels need; "
                                              f"{ALIGNED_FIX[name]}")
        if out is None:
            out = torch.empty(rows, hq, d, dtype=dtype, device=q.device)
        # (A graph wrapper without check mode skips the query: eager steps are host-bound.)
        capturing = (self.check or not self.use_cuda_graph) and self._capturing()
        if capturing and not self.use_cuda_graph:
            raise AttentionInputError(
                "run() is being captured into a CUDA graph on a wrapper built with use_cuda_graph=False: its device "
                "tables move to new memory when a later plan() needs more room, and a replay would then read (and "
                "write) freed memory. Build the wrapper with use_cuda_graph=True (and max_requests, max_beam_width, "
                "max_prompt_pages) to capture it."
            )
        check = self.check and not capturing
        if check:
            from . import check as chk

            tol = self.check_tolerance or chk.default_tolerance(dtype)
            # A checked call on a CUDA-graph wrapper is a warm-up (later calls replay the graph).
            warm = chk.check_indices(step_plan, kv_cache, pg, beam_page_table, kv_lens, cache_indirection,
                                     page_index_divisor, warmup_shared_blocks=self.use_cuda_graph)

        write_kv = new_k is not None
        if not write_kv:
            new_k, new_v = self._current_kv(kv_cache, beam_page_table, kv_lens, rows, pg, page_index_divisor)
        # A backend that fuses the tail (the Triton cascade kernel) runs the whole step in one launch;
        # its prefix stage alone still runs in check mode, so the stage checks name the failing stage.
        fused = getattr(backend, "fuses_tail", False) and self.tail_impl == "triton"
        if check or not fused:
            prefix_out, lse = backend.run(q, kv_cache, self._views["prefix_out"], self._views["prefix_lse"], check=False)
        if check:
            chk.check_prefix_stage(step_plan, q, kv_cache, self.kv_layout, prefix_out, lse, sm_scale, tol,
                                   skip_rows=warm.padding)
            expected = chk.expected_output(
                q, kv_cache, beam_page_table, kv_lens, self._views["prompt_lens"], cache_indirection,
                step_plan.beam_width, new_k, new_v, sm_scale, self.kv_layout, page_index_divisor,
            )
        if fused:
            backend.run_step(
                q, kv_cache, beam_page_table, kv_lens, self._views["prompt_lens"], cache_indirection, new_k, new_v,
                out, page_index_divisor=page_index_divisor, write_kv=write_kv, validate_indices=check,
                error_flags=self.error_flags, max_tail_len=self._launch_tail,
            )
        else:
            tail_skip = self._views.get("tail_skip")
            extra = {}
            if tail_skip is not None:
                # The runs all beams of a block share, once per block, merged into the prefix state (the
                # wrapper's own workspace) in place; the tail then starts after each row's run.
                from triton_kernels import beam_shared_run_attention

                beam_shared_run_attention(
                    q, kv_cache, beam_page_table, kv_lens, self._views["prompt_lens"], cache_indirection,
                    step_plan.beam_width, prefix_out, lse.tensor, tail_skip, sm_scale=sm_scale,
                    kv_layout=self.kv_layout, page_index_divisor=page_index_divisor, prefix_lse_layout=lse.layout,
                    prefix_lse_base=lse.base, error_flags=self.error_flags,
                )
                extra = dict(tail_skip=tail_skip)
            self._tail_function()(
                q, new_k, new_v, kv_cache, beam_page_table, kv_lens, self._views["prompt_lens"], cache_indirection,
                step_plan.beam_width, prefix_out, lse.tensor, out,
                sm_scale=sm_scale, kv_layout=self.kv_layout, page_index_divisor=page_index_divisor,
                prefix_lse_layout=lse.layout, prefix_lse_base=lse.base, write_kv=write_kv, validate_indices=check,
                error_flags=self.error_flags, **extra,
            )
        if self.page_table_audit and self._page_table_audit_due(kv_cache):
            self._audit_page_table(beam_page_table, kv_lens, cache_indirection, pg, page_index_divisor,
                                   step_plan.beam_width)
        if check:
            chk.check_output_stage(out, expected, tol, skip_rows=warm.padding)
            if write_kv:
                chk.check_kv_write(kv_cache, self.kv_layout, pg, beam_page_table, kv_lens, new_k, new_v,
                                   page_index_divisor, warm)
        return out

    __call__ = run

    def note_graph_replay(self) -> None:
        """Count one replay of a CUDA graph that holds this wrapper's ``run()``; call it before each replay, outside
        capture. A replay runs no Python, so with ``report_errors`` only this count lets the wrapper start the
        page-table audit's step stamps over (every :data:`AUDIT_RESTART` steps; device ops on the current stream)
        before the int32 stamp wraps after 2**31 replayed steps and valid tables are reported as errors. A ``plan()``
        before the replay counts itself. Does nothing without the audit or inside capture."""
        if self._audit_workspace is None or self._capturing():
            return
        self._count_audit_use(self._audit_workspace)

    # ------------------------------------------------------------------------------------------
    def device_errors(self, reset: bool = True) -> List[str]:
        """The device error flag's messages (:data:`triton_kernels.device_errors.ERROR_BITS`): what the
        kernels masked since the flag was last reset. Synchronises with the device; ``reset`` zeroes
        the flag. ``[]`` with ``report_errors=False``."""
        if self.error_flags is None:
            return []
        if self._capturing():
            raise RuntimeError("device_errors() reads the device (a sync), which CUDA-graph capture forbids; "
                               "call it outside capture, or use poll_device_errors().")
        from triton_kernels.device_errors import decode_error_flags

        value = int(self.error_flags.item())
        if reset and value:
            self.error_flags.zero_()
            self._errors_seen = 0
            self._error_poll = None  # a copy still in flight holds the old bits
        return decode_error_flags(value)

    def poll_device_errors(self) -> List[str]:
        """Kinds of error the device flag has gained since the last poll, without waiting on the device.

        On CUDA each poll copies the flag to pinned host memory behind the work queued so far and
        reads the previous poll's copy if it has landed (so a kind is seen one poll late). Each kind
        is returned once until :meth:`device_errors` resets the flag. Not during CUDA-graph capture.
        """
        if self.error_flags is None or self._capturing():
            return []
        from triton_kernels.device_errors import decode_error_flags

        if self.device.type != "cuda":
            value = int(self.error_flags.item())
        else:
            value = 0
            if self._error_poll is not None:
                host, event = self._error_poll
                if not event.query():
                    return []  # the previous copy is still queued behind the device's work
                value = int(host[0])
            else:
                host, event = torch.zeros(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
            # The copy runs on the current stream of the flag's device; the event follows it there.
            host.copy_(self.error_flags, non_blocking=True)
            event.record(torch.cuda.current_stream(self.device))
            self._error_poll = (host, event)
        new = value & ~self._errors_seen
        self._errors_seen |= value
        return decode_error_flags(new)

    # ------------------------------------------------------------------------------------------
    def _capturing(self) -> bool:
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return False
        if not self._warned_capture_check and self.check:
            logger.warning("beam_shared_prefix: check mode is skipped inside CUDA-graph capture (it synchronises); "
                           "it checks every eager run().")
            self._warned_capture_check = True
        return True

    def _tail_function(self):
        # Imported here: the package imports without Triton kernels until a step runs.
        if self.tail_impl == "triton":
            from triton_kernels import beam_tail_attention_merge

            return beam_tail_attention_merge
        from triton_kernels import beam_tail_attention_merge_torch

        return beam_tail_attention_merge_torch

    def _page_table_audit_due(self, kv_cache: torch.Tensor) -> bool:
        """Whether this run() launches the page-table audit. The page table, lengths and prompt lengths are the same
        in every layer of a pool, so once a step is enough: the audit rides with the layer of the first run() this
        wrapper served (its pool view's address: in TensorRT-LLM the pool's first layer, whose captured launches a
        CUDA graph then replays with it), and with the first run() after each plan() if that layer has not run."""
        layer = kv_cache.data_ptr()
        if self._audit_layer is None:
            self._audit_layer = layer
        due = layer == self._audit_layer or not self._audited_since_plan
        self._audited_since_plan |= due
        return due

    def _count_audit_use(self, workspace) -> None:
        """Count a plan(), an audited run() or a graph replay on the audit's workspace; start it over (zeroed holders,
        stamp 1: device ops on the current stream, outside any capture) every :data:`AUDIT_RESTART`."""
        self._audit_uses += 1
        if self._audit_uses >= AUDIT_RESTART:
            workspace.page_holders.zero_()
            workspace.audit_state.fill_(1)
            self._audit_uses = 0

    def _audit_workspace_for(self, num_pages: int):
        """The page-table audit's workspace for a pool of ``num_pages`` pages: kept while the pool keeps its size (a
        CUDA graph holds its address), a new one for another size (refused on a CUDA-graph wrapper, whose captured
        audits would go on writing the old one after it is freed)."""
        workspace = self._audit_workspace
        if workspace is not None and workspace.page_holders.shape[1] != num_pages and self.use_cuda_graph:
            raise AttentionInputError(
                f"num_cache_pages={num_pages}: this use_cuda_graph=True wrapper's page-table audit was set up for a "
                f"pool of {workspace.page_holders.shape[1]} pages, and graphs captured with it hold that workspace. "
                f"Build a new wrapper (and capture new graphs) for a pool of another size."
            )
        if workspace is None or workspace.page_holders.shape[1] != num_pages:
            from triton_kernels import new_audit_workspace

            workspace = self._audit_workspace = new_audit_workspace(num_pages, self.device)
            self._audit_uses = 0
        return workspace

    def _audit_page_table(self, beam_page_table, kv_lens, cache_indirection, page_size, page_index_divisor,
                          beam_width) -> None:
        """The page-table audit on the flag (:mod:`triton_kernels.page_table_audit`; its torch twin on the torch
        tail), device work only: what no single index shows (beams unlike beam 0, a write page held elsewhere, beam
        0's prompt pages unlike the plan's). The pool's pages are the plan's (``num_cache_pages``; ``run()`` takes a
        pool of at least that many): the audit records no page past them."""
        num_pages = self._active[0].num_cache_pages
        args = (kv_lens, self._views["prompt_lens"], beam_page_table, beam_width, self.error_flags)
        sizes = dict(page_size=page_size, num_pages=num_pages, max_seq_len=cache_indirection.shape[2],
                     page_index_divisor=page_index_divisor, plan_digest=self._views["plan_digest"])
        if self.tail_impl == "triton":
            from triton_kernels import audit_page_table

            workspace = self._audit_workspace_for(num_pages)
            audit_page_table(*args, workspace, **sizes)
            self._count_audit_use(workspace)
        else:
            from triton_kernels import audit_page_table_torch

            audit_page_table_torch(*args, **sizes)

    def _current_kv(self, kv_cache, beam_page_table, kv_lens, rows, page_size, page_index_divisor):
        """This step's K/V ``[rows, Hkv, D]`` read back from ``kv_len - 1`` of each row's own page.

        Indices are clamped into the table and the pool, as the kernels mask theirs: an invalid
        ``kv_len`` or page entry (reported by check mode) reads some slot of the pool, never past it
        (on a GPU an out-of-range gather is a device-side assert that ends the process's CUDA context).
        """
        cur = kv_lens[:rows].long() - 1
        pos = cur.clamp(min=0)
        col = (pos // page_size).clamp(max=beam_page_table.shape[1] - 1)
        entry = beam_page_table[:rows].gather(1, col[:, None]).squeeze(1).long()
        page = (entry // page_index_divisor).clamp(0, kv_cache.shape[0] - 1)
        if self.error_flags is not None:
            # The engine's write slot, as the tail kernels judge their own (device ops, no sync).
            from triton_kernels import device_errors

            len_bad = (cur < 0) | (cur // page_size >= beam_page_table.shape[1])
            entry_bad = ~len_bad & ((entry < 0) | (entry // page_index_divisor >= kv_cache.shape[0]))
            device_errors.flag_where(self.error_flags, len_bad, device_errors.KV_LEN)
            device_errors.flag_where(self.error_flags, entry_bad, device_errors.WRITE_PAGE)
        slot = pos % page_size
        k, v = kv_planes(kv_cache, self.kv_layout)
        return k[page, slot], v[page, slot]

    def _validate_run(self, q, kv_cache, beam_page_table, kv_lens, cache_indirection, new_k, new_v, out,
                      page_index_divisor, step_plan: StepPlan, problem_key: tuple) -> None:
        """Shape/dtype/device checks against the plan: metadata only, no device sync."""
        hq, hkv, d, pg, dtype, _ = problem_key
        rows, W, R = step_plan.num_rows, step_plan.beam_width, step_plan.num_requests

        def fail(msg):
            raise AttentionInputError(msg)

        # The launchers' own checks where the rule is theirs (imported here, as in _tail_function).
        from triton_kernels.step_args import (KernelInputError, need_page_index_divisor, need_table_covers_indirection,
                                              need_tensor, need_unit_stride, pool_layout)

        for name, x in (("q", q), ("kv_cache", kv_cache), ("beam_page_table", beam_page_table),
                        ("kv_lens", kv_lens), ("cache_indirection", cache_indirection)):
            try:  # a tensor, dense (a sparse one's strides would read as 0 below)
                need_tensor(name, x)
            except KernelInputError as exc:
                raise AttentionInputError(str(exc)) from None
            if x.device != self.device:
                fail(f"{name} is on {x.device} but the wrapper runs on {self.device}; move it there.")
        if q.dim() != 3 or tuple(q.shape) != (rows, hq, d):
            fail(f"q has shape {tuple(q.shape)} but the plan needs [R*W={R}*{W}={rows}, Hq={hq}, D={d}]; "
                 f"re-plan when the batch changes.")
        if q.dtype != dtype:
            fail(f"q has dtype {_dtype_name(q.dtype)} but the plan was made for {_dtype_name(dtype)}.")
        if q.stride(-1) != 1:
            fail(f"q's head dim must be contiguous (stride 1), got strides {tuple(q.stride())}.")
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            fail(f"kv_cache must be [pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD), got "
                 f"{tuple(kv_cache.shape)}.")
        (pages, pool_heads, pool_pg, pool_d), _ = pool_layout(kv_cache, self.kv_layout)
        if (pool_heads, pool_pg, pool_d) != (hkv, pg, d):
            fail(f"kv_cache ({self.kv_layout}) has Hkv={pool_heads}, page size {pool_pg}, D={pool_d} but the plan "
                 f"has Hkv={hkv}, page size {pg}, D={d}; check kv_layout={self.kv_layout!r} and the layer's pool view.")
        if pages < step_plan.num_cache_pages:
            fail(f"kv_cache has {pages} pages but the plan was made for a pool of {step_plan.num_cache_pages}; "
                 f"re-plan with the current pool (num_cache_pages={pages}).")
        if kv_cache.dtype != dtype:
            fail(f"kv_cache has dtype {_dtype_name(kv_cache.dtype)} but the plan was made for {_dtype_name(dtype)}.")
        if kv_cache.stride(-1) != 1:
            fail(f"kv_cache's head dim must be contiguous (stride 1), got strides {tuple(kv_cache.stride())}.")
        if beam_page_table.dim() != 2 or beam_page_table.dtype != torch.int32 or beam_page_table.shape[0] < rows:
            fail(f"beam_page_table must be int32 [>= {rows}, max_pages], got {beam_page_table.dtype} "
                 f"{tuple(beam_page_table.shape)}.")
        if kv_lens.dim() != 1 or kv_lens.dtype != torch.int32 or kv_lens.shape[0] != rows:
            fail(f"kv_lens must be int32 [{rows}] (one per beam row), got {kv_lens.dtype} {tuple(kv_lens.shape)}.")
        try:
            need_unit_stride("kv_lens", kv_lens)
        except KernelInputError as exc:
            raise AttentionInputError(str(exc)) from None
        if (cache_indirection.dim() != 3 or cache_indirection.dtype != torch.int32
                or cache_indirection.shape[0] < R or cache_indirection.shape[1] < W):
            fail(f"cache_indirection must be int32 [>= R={R}, >= W={W}, max_seq_len], got {cache_indirection.dtype} "
                 f"{tuple(cache_indirection.shape)}.")
        if (new_k is None) != (new_v is None):
            fail("pass both new_k and new_v, or neither (then they are read from the cache).")
        for name, x in (("new_k", new_k), ("new_v", new_v), ("out", out)):
            if x is not None and not isinstance(x, torch.Tensor):
                fail(f"{name} must be a torch.Tensor or None, got {type(x).__name__}.")
        try:  # before _current_kv gathers the write slot from the table
            need_table_covers_indirection(beam_page_table, pg, cache_indirection.shape[2])
        except KernelInputError as exc:
            raise AttentionInputError(str(exc)) from None
        capacity = kv_capacity(beam_page_table.shape[1], pg, cache_indirection.shape[2])
        # Every row holds its prompt and this step's token (a one-token plan is warm-up or padding: kv_len 1).
        least = 1 if step_plan.max_prompt_len == 1 else step_plan.max_prompt_len + 1
        if capacity < least:
            fail(f"the plan's longest prompt has {step_plan.max_prompt_len} tokens but this cache holds {capacity} "
                 f"positions a row (beam_page_table {beam_page_table.shape[1]} columns of {pg} tokens, "
                 f"cache_indirection max_seq_len {cache_indirection.shape[2]}): no row of that request can hold this "
                 f"step's token, whose K/V would not be written. Pass the cache the plan was made for, or re-plan.")
        if new_k is not None:
            for name, x in (("new_k", new_k), ("new_v", new_v)):
                if tuple(x.shape) != (rows, hkv, d) or x.dtype != dtype or x.device != self.device:
                    fail(f"{name} must be {_dtype_name(dtype)} [{rows}, Hkv={hkv}, D={d}] on {self.device}, got "
                         f"{_dtype_name(x.dtype)} {tuple(x.shape)} on {x.device}.")
        if out is not None:
            if tuple(out.shape) != (rows, hq, d) or out.dtype != dtype or out.device != self.device:
                fail(f"out must be {_dtype_name(dtype)} [{rows}, {hq}, {d}] on {self.device}, got "
                     f"{_dtype_name(out.dtype)} {tuple(out.shape)} on {out.device}.")
        try:
            need_page_index_divisor(page_index_divisor)
        except KernelInputError as exc:
            raise AttentionInputError(str(exc)) from None
