"""FlashInfer prefix backend: ``BatchPrefillWithPagedKVCacheWrapper`` over beam 0's prompt pages.

Each request is one FlashInfer "sequence" with ``W`` query rows (``qo_indptr = [0, W, ..., R*W]``,
``uniform_q_len = W``) attending its prompt pages non-causally; ``kv_last_page_len`` bounds the
attention to the prompt even when the physical last page holds later tokens. The pool is passed as
the 5-D ``[pages, 2, ...]`` tensor, possibly a strided per-layer view of TensorRT-LLM's multi-layer
pool: K and V then share all strides, so the standard kernel serves it (FlashInfer's separate
"independent stride" variant, and ``prewarm_paged_kv_stride_variant``, are needed only when K and V
strides differ, which a 5-D view never has). Output goes into the caller's buffer and the LSE,
base 2 ``[rows, Hq]``, into the caller's float32 buffer (``out=``/``lse=``: no per-call allocation).

Kernel family. FlashInfer's own ``auto`` picks fa3 on SM90 and demotes it to fa2 whenever the
longest query (here the beam width) is at most 64. This backend picks by measurement instead, in
one function, :func:`choose_flashinfer_kernel`; ``prefix_kernel="fa2"|"fa3"`` overrides it so the
benchmark can time both.

Workspace. The float workspace holds split-KV partial outputs. It is sized from the rows the
wrapper can be planned for (:func:`prefill_float_workspace_bytes`; the fixed 128 MB of the original
overflowed at 128 requests x 96 beams), raised to what ``wrapper.workspace_size(...)`` reports for
the plan when FlashInfer offers it, and, eagerly, grows when a bigger plan needs more (at plan time,
outside capture; a plan that fails in FlashInfer's allocator is retried on a doubled buffer). In
CUDA-graph mode it is sized once for ``max_requests x max_beam_width`` and never moves.

CUDA graphs. ``use_cuda_graph=True`` creates one graph-mode wrapper per batch size (FlashInfer
freezes the batch size of a graph wrapper) with fixed index buffers sized from ``max_prompt_pages``;
a re-plan rewrites them in place, so a captured ``run()`` replays with the new pages. The kernel
family of a batch size is frozen at its first plan, so a captured launch never changes family.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..plan import StepPlan
from .base import LseDescriptor, PrefixBackend, PrefixBackendError, PrefixProblem, logger

__all__ = [
    "FlashInferPrefixBackend",
    "choose_flashinfer_kernel",
    "prefill_float_workspace_bytes",
    "PREFIX_KERNELS",
    "FA3_MIN_BEAM_WIDTH",
    "FA3_MIN_PROMPT_LEN",
]

PREFIX_KERNELS = ("auto", "fa2", "fa3")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
FA3_HEAD_DIMS = (64, 128, 256)
# fa3 does not pack the GQA group into its 128-row query tile, so a request fills W rows of it:
# above 64 beams the tile is more than half used and fa3's wgmma KV loop wins (measured on the H200:
# 128 requests x 96 beams x 3,000 tokens, fa3 ~1.0 ms vs fa2 ~1.3 ms); at 30 beams fa2's packed W*G
# rows win (64 x 30 x 500: fa2 ~52 us vs fa3 ~99 us). FlashInfer's own auto uses the same 64.
FA3_MIN_BEAM_WIDTH = 65
# Below a few hundred prompt tokens there is too little KV loop for fa3's faster inner loop to pay
# for its idle tile rows; provisional, to be refined with the benchmark's prefix_kernel sweep.
FA3_MIN_PROMPT_LEN = 256
# Margin on the workspace estimate: FlashInfer's scheduler aligns every sub-allocation.
_WORKSPACE_MARGIN = 1.25
_WORKSPACE_SLACK_BYTES = 1 << 20

_FLASHINFER_STATE: Dict[str, object] = {}
#: The oldest FlashInfer this backend's tests and measurements ran with (``pyproject.toml``'s ``flashinfer`` extra). An
#: older one, such as the 0.6.x that TensorRT-LLM pins, still serves (its wrapper's signatures are checked at every
#: plan), but its speed and :func:`choose_flashinfer_kernel`'s rule are unmeasured with it, so it is named once.
MEASURED_FLASHINFER_VERSION = (0, 7, 4)
#: The same, as the install floor the messages name.
FLASHINFER_FLOOR = ".".join(map(str, MEASURED_FLASHINFER_VERSION))


def _release(version: str) -> Optional[Tuple[int, int, int]]:
    """``(major, minor, patch)`` of a version string such as ``0.6.14`` or ``0.7.4+cu130``; ``None`` if it has none."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def choose_flashinfer_kernel(
    beam_width: int,
    max_prompt_len: int,
    head_dim: int,
    device_capability: Tuple[int, int],
    prefix_kernel: str = "auto",
) -> str:
    """The FlashInfer kernel family (``"fa2"`` or ``"fa3"``) for a beam-prefix plan.

    Rule (``prefix_kernel="auto"``): fa3 on SM90 when ``beam_width >= FA3_MIN_BEAM_WIDTH`` (65) and
    the longest prompt has at least ``FA3_MIN_PROMPT_LEN`` (256) tokens and the head size has an fa3
    kernel; fa2 otherwise. fa2 packs the ``W * G`` rows of a request and KV head into one query tile
    and can split the KV; fa3 spends a 128-row tile per query head on ``W`` rows, so it pays only for
    wide beams over long prompts (see the module constants for the H200 measurements).

    Args:
        beam_width: ``W``, query rows per request.
        max_prompt_len: the longest prompt of the batch, tokens.
        head_dim: ``D``.
        device_capability: ``torch.cuda.get_device_capability()``.
        prefix_kernel: ``"auto"``, or ``"fa2"``/``"fa3"`` to force a family (fa3 is refused off SM90).
    """
    if prefix_kernel not in PREFIX_KERNELS:
        raise ValueError(f"prefix_kernel={prefix_kernel!r} is not one of {PREFIX_KERNELS}.")
    sm90 = tuple(device_capability)[0] == 9
    if prefix_kernel == "fa3":
        if not sm90 or head_dim not in FA3_HEAD_DIMS:
            raise PrefixBackendError(
                f"prefix_kernel='fa3' needs an SM90 GPU and head_dim in {FA3_HEAD_DIMS}, got compute capability "
                f"{tuple(device_capability)} and head_dim={head_dim}; use prefix_kernel='fa2' or 'auto'."
            )
        return "fa3"
    if prefix_kernel == "fa2":
        return "fa2"
    if sm90 and head_dim in FA3_HEAD_DIMS and beam_width >= FA3_MIN_BEAM_WIDTH and max_prompt_len >= FA3_MIN_PROMPT_LEN:
        return "fa3"
    return "fa2"


def prefill_float_workspace_bytes(
    num_requests: int,
    beam_width: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    conservative: bool = False,
) -> int:
    """Float-workspace bytes for a prefix plan of ``num_requests x beam_width`` rows, with margin.

    FlashInfer's split-KV keeps, per query tile of the schedule, fp32 partial outputs ``[tile, D]``
    and LSEs ``[tile]`` for every head of the tile. fa2 packs ``W * G`` rows of a request and KV
    head into tiles of at most 128 rows, so the schedule covers at most ``Hkv * R * (W*G + 127)``
    packed rows; a grid-sized split adds at most ``num_sms * 4`` CTAs of 128 rows. Bytes =
    ``4 * (D + 1) * max(both)`` with a 25 % margin. ``conservative=True`` (CUDA-graph mode, where the
    workspace can never grow after capture) counts every query head instead of every KV head.

    Returns:
        bytes, a multiple of 256.
    """
    g = max(1, num_qo_heads // max(1, num_kv_heads))
    heads = num_qo_heads if conservative else num_kv_heads
    tile_rows = max(heads * num_requests * (beam_width * g + 127), num_sms * 4 * 128 * (g if conservative else 1))
    need = int(_WORKSPACE_MARGIN * 4 * (head_dim + 1) * tile_rows) + _WORKSPACE_SLACK_BYTES
    return -(-need // 256) * 256


def _import_flashinfer():
    """``flashinfer`` (imported once, lazily) or None; the reason is kept for :meth:`is_available`."""
    if "module" in _FLASHINFER_STATE:
        return _FLASHINFER_STATE["module"]
    module = None
    if importlib.util.find_spec("flashinfer") is None:
        _FLASHINFER_STATE["reason"] = f"flashinfer is not installed (pip install 'flashinfer-python>={FLASHINFER_FLOOR}')"
    else:
        try:
            module = importlib.import_module("flashinfer")
            if not hasattr(module, "BatchPrefillWithPagedKVCacheWrapper"):
                _FLASHINFER_STATE["reason"] = "flashinfer has no BatchPrefillWithPagedKVCacheWrapper"
                module = None
        except Exception as exc:  # a broken install must decline, not crash the caller
            _FLASHINFER_STATE["reason"] = f"import flashinfer failed: {type(exc).__name__}: {exc}"
    if module is not None:
        _name_an_unmeasured_version(str(getattr(module, "__version__", "")))
    _FLASHINFER_STATE["module"] = module
    return module


def _name_an_unmeasured_version(version: str) -> None:
    release = _release(version)
    if release is not None and release < MEASURED_FLASHINFER_VERSION:
        logger.warning("beam_shared_prefix: flashinfer %s is older than %s, the oldest this library was tested and "
                       "measured with. It serves (its wrapper's arguments are checked at every plan), but its speed "
                       "here is unmeasured; docs/trtllm.md, 'Inside a TensorRT-LLM environment'.",
                       version, FLASHINFER_FLOOR)


#: ``plan()`` arguments whose loss would change results without an error (a rename in another FlashInfer would
#: run with its defaults: the scale ``1/sqrt(D)``, say): their absence declines the backend instead.
_REQUIRED_PLAN_ARGS = ("causal", "sm_scale", "q_data_type", "kv_data_type")


def _accepted_kwargs(fn, kwargs: dict, required=()) -> dict:
    """The subset of ``kwargs`` that ``fn`` accepts (FlashInfer versions add optional arguments); raises
    :class:`PrefixBackendError` where one of ``required`` is not accepted."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    missing = [k for k in required if k in kwargs and k not in params]
    if missing:
        raise PrefixBackendError(
            f"this FlashInfer's {getattr(fn, '__qualname__', fn)} takes no {missing}: it would run with its own "
            f"defaults for them. Install flashinfer-python>={FLASHINFER_FLOOR} of a version that takes them, or use "
            f"backend='fa4'/'triton'."
        )
    return {k: v for k, v in kwargs.items() if k in params}


def _run_kwargs(run, lse_base: str, lse_layout: str, device: torch.device) -> dict:
    """The ``run()`` keywords the backend passes by name, where ``run`` takes them, rather than rely on FlashInfer's
    defaults: the LSE convention it reports (0.7.4 and later take both), and ``enable_pdl`` as the library's other
    launches have it (:func:`triton_kernels.launch.pdl_enabled`, which follows ``TRTLLM_ENABLE_PDL``; FlashInfer's own
    default is on wherever the device has programmatic dependent launch, whatever that switch says)."""
    try:
        params = inspect.signature(run).parameters
    except (TypeError, ValueError):
        return {}
    kwargs = {k: v for k, v in (("lse_base", lse_base), ("lse_layout", lse_layout)) if k in params}
    if "enable_pdl" in params:
        from triton_kernels.launch import pdl_enabled  # deferred: imports triton

        kwargs["enable_pdl"] = pdl_enabled(device)
    return kwargs


def _is_workspace_error(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return any(word in msg for word in ("workspace", "alignedallocator", "failed to allocate"))


def record_plan_copy(device) -> Optional["torch.cuda.Event"]:
    """A CUDA event recorded on ``device``'s current stream right after a FlashInfer ``plan()``, which ends with an
    asynchronous copy from the wrapper's pinned buffer on that stream; ``None`` off CUDA, where no copy is queued."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _cpu_i32(array: np.ndarray) -> torch.Tensor:
    # CPU metadata: FlashInfer's plan() copies indptrs to the host, which would sync on device tensors.
    return torch.from_numpy(np.array(array, dtype=np.int32, copy=True))


class FlashInferPrefixBackend(PrefixBackend):
    """Prefix attention through FlashInfer's batch prefill wrapper (fa2 or fa3 kernels).

    Args:
        device, kv_layout, use_cuda_graph, max_requests, max_beam_width, max_prompt_pages: see
            :class:`~.base.PrefixBackend`.
        prefix_kernel: ``"auto"`` (:func:`choose_flashinfer_kernel`), ``"fa2"`` or ``"fa3"``.

    Attributes:
        kernel: the family the active plan runs (``"fa2"``/``"fa3"``).
        workspace_bytes: size of the float workspace.
    """

    name = "flashinfer"
    lse_layout = "NH"
    lse_base = "log2"
    capturable = True
    moves_16_byte_vectors = True

    def __init__(self, device, kv_layout: str = "HND", use_cuda_graph: bool = False, max_requests=None,
                 max_beam_width=None, max_prompt_pages=None, prefix_kernel: str = "auto"):
        super().__init__(device, kv_layout, use_cuda_graph, max_requests, max_beam_width, max_prompt_pages)
        if prefix_kernel not in PREFIX_KERNELS:
            raise ValueError(f"prefix_kernel={prefix_kernel!r} is not one of {PREFIX_KERNELS}.")
        self.prefix_kernel = prefix_kernel
        self.kernel: Optional[str] = None
        self._workspace: Optional[torch.Tensor] = None
        self._wrappers: Dict[tuple, object] = {}
        # Per wrapper, an event recorded after its last plan: FlashInfer's plan writes the wrapper's pinned host
        # buffer and copies it to the device asynchronously, so a second plan on a host running ahead of the GPU
        # (an overlap scheduler) could overwrite the buffer before the first copy ran.
        self._plan_copies: Dict[tuple, object] = {}
        self._graph_kernel: Dict[int, str] = {}  # batch size -> family frozen at its first plan
        self._active = None
        self._run_kwargs: dict = {}  # the LSE convention and enable_pdl, where run() takes them by name

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the float workspace this backend holds (uint8 elements); 0 before the first plan."""
        return 0 if self._workspace is None else self._workspace.numel()

    @classmethod
    def is_available(cls, device, dtype, head_dim, num_qo_heads=None, num_kv_heads=None, page_size=None,
                     kv_layout="HND") -> Tuple[bool, str]:
        """CUDA (SM80+), bf16/fp16, head size 64/128/256, HND or NHD, and ``flashinfer`` importable."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False, f"FlashInfer needs a CUDA device, got {device}"
        if dtype not in (torch.bfloat16, torch.float16):
            return False, f"dtype {dtype} is not supported by the FlashInfer prefix (bf16 or fp16)"
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return False, (f"head_dim={head_dim} is not validated for FlashInfer prefill on this path "
                           f"(supported: {SUPPORTED_HEAD_DIMS})")
        if kv_layout not in ("HND", "NHD"):
            return False, f"kv_layout {kv_layout!r} is not supported"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return False, "FlashInfer prefill needs compute capability 8.0 or newer"
        if _import_flashinfer() is None:
            return False, str(_FLASHINFER_STATE.get("reason"))
        return True, ""

    # ------------------------------------------------------------------------------------------
    def _kernel_for(self, step_plan: StepPlan, problem: PrefixProblem) -> str:
        R = step_plan.num_requests
        if self.use_cuda_graph and R in self._graph_kernel:
            return self._graph_kernel[R]
        kernel = choose_flashinfer_kernel(
            step_plan.beam_width, step_plan.max_prompt_len, problem.head_dim,
            torch.cuda.get_device_capability(self.device), self.prefix_kernel,
        )
        if self.use_cuda_graph:
            self._graph_kernel[R] = kernel
        return kernel

    def _workspace_need(self, step_plan: StepPlan, problem: PrefixProblem) -> int:
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.use_cuda_graph:
            return prefill_float_workspace_bytes(
                self.max_requests, self.max_beam_width, problem.num_qo_heads, problem.num_kv_heads,
                problem.head_dim, num_sms, conservative=True,
            )
        return prefill_float_workspace_bytes(
            step_plan.num_requests, step_plan.beam_width, problem.num_qo_heads, problem.num_kv_heads,
            problem.head_dim, num_sms,
        )

    def _ensure_workspace(self, need: int) -> None:
        if self._workspace is not None and self._workspace.numel() >= need:
            return
        if self._workspace is not None and self.use_cuda_graph:
            raise PrefixBackendError(
                f"the FlashInfer float workspace ({self._workspace.numel()} bytes, sized at the first plan for its "
                f"attention shape at max_requests={self.max_requests}, max_beam_width={self.max_beam_width}) is too "
                f"small for this plan's attention shape ({need} bytes) and cannot grow in CUDA-graph mode (captured "
                f"graphs use it in place); use a CUDA-graph wrapper per attention shape (heads and head size)."
            )
        if self._workspace is not None:
            need = max(need, self._workspace.numel() * 2)
            logger.info("beam_shared_prefix: FlashInfer float workspace grows to %.1f MiB", need / 2**20)
        # The wrappers hold the old buffer: drop them; the active family is re-created right away. Their pinned
        # buffers go back to torch's host allocator, which could hand them to the new wrappers: copies first.
        self._wait_for_plan_copies(list(self._plan_copies))
        self._plan_copies.clear()
        self._wrappers.clear()
        self._workspace = None
        # Zeroed once: FlashInfer documents zero-initialised workspaces for some of its schedulers.
        self._workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)

    def _wrapper_key(self, kernel: str, num_requests: int) -> tuple:
        return (kernel, num_requests if self.use_cuda_graph else None)

    def _wait_for_plan_copies(self, keys) -> None:
        """Block the host until the named wrappers' last plans have been copied to the device (usually done)."""
        for key in keys:
            event = self._plan_copies.get(key)
            if event is not None:
                event.synchronize()

    def _wrapper(self, kernel: str, num_requests: int):
        key = self._wrapper_key(kernel, num_requests)
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            return wrapper
        flashinfer = _import_flashinfer()
        cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        kwargs = dict(backend=kernel)
        if self.use_cuda_graph:
            dev, i32 = self.device, torch.int32
            kwargs.update(
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(num_requests + 1, dtype=i32, device=dev),
                paged_kv_indptr_buf=torch.zeros(num_requests + 1, dtype=i32, device=dev),
                paged_kv_indices_buf=torch.zeros(max(1, num_requests * self.max_prompt_pages), dtype=i32, device=dev),
                paged_kv_last_page_len_buf=torch.ones(num_requests, dtype=i32, device=dev),
                max_total_num_rows=num_requests * self.max_beam_width,
            )
        wrapper = cls(self._workspace, self.kv_layout, **_accepted_kwargs(cls.__init__, kwargs))
        self._wrappers[key] = wrapper
        return wrapper

    @staticmethod
    def _exact_workspace_bytes(wrapper, args, kwargs) -> Optional[int]:
        """Float-workspace bytes FlashInfer reports for this plan (``wrapper.workspace_size``), if it can."""
        fn = getattr(wrapper, "workspace_size", None)
        if fn is None:
            return None
        try:
            res = fn(*args, **_accepted_kwargs(fn, kwargs))
            return int(res[0] if isinstance(res, (tuple, list)) else res)
        except Exception as exc:  # an older or newer signature: the formula and the retry cover it
            logger.debug("beam_shared_prefix: FlashInfer workspace_size() unusable (%s); using the estimate", exc)
            return None

    def _plan(self, step_plan: StepPlan, problem: PrefixProblem) -> None:
        if _import_flashinfer() is None:
            raise PrefixBackendError(f"FlashInfer prefix backend unavailable: {_FLASHINFER_STATE.get('reason')}")
        kernel = self._kernel_for(step_plan, problem)
        self._ensure_workspace(self._workspace_need(step_plan, problem))
        args = (
            _cpu_i32(step_plan.qo_indptr),
            _cpu_i32(step_plan.kv_page_indptr),
            _cpu_i32(step_plan.kv_page_indices),
            _cpu_i32(step_plan.kv_last_page_len),
            problem.num_qo_heads,
            problem.num_kv_heads,
            problem.head_dim,
            problem.page_size,
        )
        kwargs = dict(
            causal=False,
            pos_encoding_mode="NONE",
            sm_scale=problem.sm_scale,
            q_data_type=problem.dtype,
            kv_data_type=problem.dtype,
            o_data_type=problem.dtype,
            non_blocking=True,
            uniform_q_len=step_plan.beam_width,
        )
        exact = self._exact_workspace_bytes(self._wrapper(kernel, step_plan.num_requests), args, kwargs)
        if exact:
            self._ensure_workspace(int(exact * _WORKSPACE_MARGIN) + _WORKSPACE_SLACK_BYTES)
        key = self._wrapper_key(kernel, step_plan.num_requests)
        for attempt in range(4):
            wrapper = self._wrapper(kernel, step_plan.num_requests)
            plan_kwargs = _accepted_kwargs(wrapper.plan, kwargs, _REQUIRED_PLAN_ARGS)
            self._wait_for_plan_copies([key])
            try:
                wrapper.plan(*args, **plan_kwargs)
                event = record_plan_copy(self.device)
                if event is not None:
                    self._plan_copies[key] = event
                break
            except (RuntimeError, ValueError) as exc:
                # FlashInfer's scheduler reports an undersized workspace at plan time (its AlignedAllocator
                # fails); eagerly, grow and retry. A ValueError is a refused shape: before 0.7 a graph-mode
                # wrapper takes no max_total_num_rows and refuses more rows than its first plan had.
                if not _is_workspace_error(exc) or self.use_cuda_graph or attempt == 3:
                    raise PrefixBackendError(
                        f"FlashInfer {kernel} plan failed for {step_plan.num_requests} requests x "
                        f"{step_plan.beam_width} beams (Hq={problem.num_qo_heads}, Hkv={problem.num_kv_heads}, "
                        f"D={problem.head_dim}, page {problem.page_size}, float workspace "
                        f"{self.workspace_bytes} bytes): {exc}"
                    ) from exc
                self._ensure_workspace(self.workspace_bytes * 2)
        self._active = wrapper
        self._run_kwargs = _run_kwargs(wrapper.run, self.lse_base, self.lse_layout, self.device)
        self.kernel = kernel

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """See :meth:`PrefixBackend.run`; LSE is float32 base 2 ``[rows, Hq]``."""
        self._active.run(q, kv_cache, out=out, lse=lse, return_lse=True, **self._run_kwargs)
        return out, LseDescriptor(lse, self.lse_layout, self.lse_base)
