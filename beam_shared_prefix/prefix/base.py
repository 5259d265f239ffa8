"""The prefix-backend interface: plan on the host, run on the device, LSE handed over without a copy.

A prefix backend attends, for every request ``r`` of a :class:`~beam_shared_prefix.plan.StepPlan`,
its prompt ``[0, P_r)`` (beam 0's pages, non-causal) once for all ``W`` query rows of the request.
It writes the normalised output ``[rows, Hq, D]`` and the log-sum-exp of every row and head into
buffers the caller provides, and returns an :class:`LseDescriptor` saying how the LSE is laid out
(``"NH"`` = ``[rows, heads]``, ``"HN"`` = ``[heads, rows]``) and in which base (``"log2"``,
``"ln"``), so the fused tail kernel reads it through strides and a scale, never through a copy.

Life cycle (FlashInfer's plan/run split):

- ``plan(step_plan, ...)``: host work once per batch composition (never during CUDA-graph capture;
  :func:`ensure_not_capturing` raises a clear error there).
- ``run(q, kv_cache, out, lse)``: device work only, every layer and step; capturable when
  :attr:`PrefixBackend.capturable` is true.
- ``is_available(device, dtype, head_dim, ...)``: ``(True, "")`` or ``(False, reason)``, so the
  wrapper can decline a backend with a logged reason and fall back to the next one.
"""

from __future__ import annotations

import abc
import logging
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..plan import StepPlan
from ..reference import LOG2E  # one definition of the constant in the core package
from .buffers import padded_page_table

__all__ = [
    "ALIGNED_FIX",
    "LOG2E",
    "LSE_LAYOUTS",
    "LSE_BASES",
    "LseDescriptor",
    "PrefixProblem",
    "PrefixBackend",
    "PrefixBackendError",
    "ensure_not_capturing",
    "kv_planes",
    "logger",
    "unaligned_16_byte_vectors",
]

logger = logging.getLogger("beam_shared_prefix")

LSE_LAYOUTS = ("NH", "HN")
LSE_BASES = ("log2", "ln")
KV_LAYOUTS = ("HND", "NHD")


def kv_planes(kv_cache: torch.Tensor, kv_layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes of a ``[pages, 2, ...]`` pool, each a ``[pages, Pg, Hkv, D]`` view (an HND pool's is
    permuted, not copied), so that ``k[page, slot]`` is one slot's ``[Hkv, D]`` in either layout. The library's one
    reading of the layouts; the oracle (:mod:`beam_shared_prefix.reference`), the simulator and the kernels' torch
    twin (``triton_kernels.tail_merge_torch``) keep their own, so that a mistake here cannot hide in their answers."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not supported; use 'HND' or 'NHD'.")
    k, v = kv_cache.select(1, 0), kv_cache.select(1, 1)
    if kv_layout == "HND":  # [pages, Hkv, Pg, D] -> [pages, Pg, Hkv, D]
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    return k, v


def unaligned_16_byte_vectors(name: str, x: torch.Tensor, strides: bool = True) -> Optional[str]:
    """Why ``x`` cannot be moved in 16-byte vectors (its address, or with ``strides`` a stride but the last over a
    dimension longer than 1, not a multiple of 16 bytes), or ``None``. FlashInfer's and FA4's kernels load and
    store such vectors (cp.async, TMA) and assume the alignment without checking it."""
    bits = x.data_ptr()
    if strides:  # (one OR of the byte pitches: the wrapper asks it on every call)
        element = x.element_size()
        for size, stride in zip(x.shape[:-1], x.stride()):
            if size > 1:
                bits |= stride * element
    if bits % 16:
        what = "its address and every stride but the last" if strides else "its address"
        return (f"{name} (address {x.data_ptr():#x}, strides {list(x.stride())}, {x.element_size()}-byte elements) "
                f"is not 16-byte aligned: {what} must be multiples of 16 bytes")
    return None


#: What to pass instead of a tensor :func:`unaligned_16_byte_vectors` refuses (``.contiguous()`` keeps an unaligned
#: address; the pool is read, and the step's K/V written, in place, so a copy of it would not do).
ALIGNED_FIX = {
    "q": "pass a copy in a fresh buffer: q.clone(memory_format=torch.contiguous_format).",
    "out": "pass a fresh buffer, e.g. torch.empty(out.shape, dtype=out.dtype, device=out.device).",
    "lse": "pass a fresh buffer, e.g. torch.empty(lse.shape, dtype=torch.float32, device=lse.device).",
    "kv_cache": ("use a pool whose page, head and token pitches and address are multiples of 16 bytes (head_dim x "
                 "element size a multiple of 16), or the Triton or reference backend, which take any."),
}


class PrefixBackendError(RuntimeError):
    """A prefix backend cannot plan or run what it was given; the message names the value and the fix."""


def ensure_not_capturing(what: str) -> None:
    """Raise if the current CUDA stream is capturing a graph (host planning must happen before capture)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise PrefixBackendError(
            f"{what} was called while a CUDA graph is being captured. Planning is host work (it copies "
            f"metadata and may allocate): call plan() before torch.cuda.graph(...) and capture only run(); "
            f"re-plan between replays, outside the capture."
        )


@dataclass(frozen=True)
class LseDescriptor:
    """Where a backend left the prefix log-sum-exp and how to read it.

    Attributes:
        tensor: float32, ``[rows, heads]`` when ``layout == "NH"``, ``[heads, rows]`` when ``"HN"``.
        layout: ``"NH"`` (FlashInfer, the reference backend) or ``"HN"`` (FA4).
        base: ``"log2"`` (FlashInfer: ``log2 sum 2^(s log2 e)``) or ``"ln"`` (FA4: ``ln sum e^s``).
    """

    tensor: torch.Tensor
    layout: str
    base: str

    def __post_init__(self):
        if self.layout not in LSE_LAYOUTS:
            raise ValueError(f"LSE layout {self.layout!r} is not one of {LSE_LAYOUTS}.")
        if self.base not in LSE_BASES:
            raise ValueError(f"LSE base {self.base!r} is not one of {LSE_BASES}.")

    def base2_rows_heads(self) -> torch.Tensor:
        """A float32 ``[rows, heads]`` base-2 copy (for checks and tests; the hot path never calls it)."""
        lse = self.tensor.float()
        if self.layout == "HN":
            lse = lse.t()
        if self.base == "ln":
            lse = lse * LOG2E
        return lse.contiguous()


@dataclass(frozen=True)
class PrefixProblem:
    """The attention shape a backend is planned for (constant across the steps of one plan).

    Attributes:
        num_qo_heads, num_kv_heads, head_dim: ``Hq``, ``Hkv`` (``Hq % Hkv == 0``), ``D``.
        page_size: tokens per KV page.
        dtype: Q/KV/output dtype (bf16 or fp16).
        sm_scale: softmax scale applied to ``q . k``.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    sm_scale: float


# The kernels take ``sm_scale * LOG2E`` as a normal float32 (a subnormal one flushes to 0 on the GPU, and 0 times a
# masked -inf score is NaN); triton_kernels.step_args.SM_SCALE_RANGE is the same range (that package imports nothing
# of this one, and this one must not import Triton to plan).
SM_SCALE_RANGE = (1.1754943508222875e-38 / LOG2E, 3.4028234663852886e38 / LOG2E)


def default_sm_scale(head_dim: int, sm_scale: Optional[float]) -> float:
    """``1 / sqrt(head_dim)`` unless given; refuses bools, and scales that are not finite and positive or whose
    ``sm_scale * log2(e)`` is no normal float32 (:data:`SM_SCALE_RANGE`)."""
    if isinstance(sm_scale, (bool, np.bool_)):
        raise ValueError(f"sm_scale={sm_scale!r} is a bool; pass a float (default 1/sqrt(head_dim)).")
    try:
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    except (TypeError, ValueError):
        scale = math.nan
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite positive float (default 1/sqrt(head_dim)).")
    if not SM_SCALE_RANGE[0] <= scale <= SM_SCALE_RANGE[1]:
        raise ValueError(f"sm_scale={sm_scale!r} is outside [{SM_SCALE_RANGE[0]:.3g}, {SM_SCALE_RANGE[1]:.3g}]: the "
                         f"kernels take sm_scale * log2(e) as a normal float32 (default 1/sqrt(head_dim)).")
    return scale


class PrefixBackend(abc.ABC):
    """Base class of the prefix backends (one module each: reference, flashinfer, fa4).

    Args:
        device: the device ``run()`` executes on.
        kv_layout: ``"HND"`` (``[pages, 2, Hkv, Pg, D]``, TensorRT-LLM's layout) or ``"NHD"``
            (``[pages, 2, Pg, Hkv, D]``); the pool may be a strided view.
        use_cuda_graph: keep every device buffer ``run()`` reads at a fixed address, sized from the
            ``max_*`` arguments, so a captured ``run()`` replays correctly after a re-plan of a batch
            with the same number of requests and beam width.
        max_requests, max_beam_width, max_prompt_pages: capacities (required with ``use_cuda_graph``).

    Subclasses set :attr:`name`, :attr:`lse_layout`, :attr:`lse_base`, :attr:`capturable`,
    :attr:`moves_16_byte_vectors` and implement :meth:`is_available`, :meth:`_plan` and :meth:`_run`.
    """

    name: str = "abstract"
    lse_layout: str = "NH"
    lse_base: str = "log2"
    capturable: bool = True
    #: The backend's kernels load and store 16-byte vectors (cp.async, TMA): every tensor's address, and q's, the
    #: pool's and out's strides but the last, must be multiples of 16 bytes, or the GPU faults or misreads.
    moves_16_byte_vectors: bool = False

    def __init__(
        self,
        device,
        kv_layout: str = "HND",
        use_cuda_graph: bool = False,
        max_requests: Optional[int] = None,
        max_beam_width: Optional[int] = None,
        max_prompt_pages: Optional[int] = None,
    ):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r} is not supported; use 'HND' or 'NHD'.")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # (plan() puts the tables on the current GPU, so run() refuses tensors on any other)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kv_layout = kv_layout
        self.use_cuda_graph = bool(use_cuda_graph)
        self.max_requests = None if max_requests is None else int(max_requests)
        self.max_beam_width = None if max_beam_width is None else int(max_beam_width)
        self.max_prompt_pages = None if max_prompt_pages is None else int(max_prompt_pages)
        if self.use_cuda_graph and None in (self.max_requests, self.max_beam_width, self.max_prompt_pages):
            raise ValueError(
                f"use_cuda_graph=True needs max_requests, max_beam_width and max_prompt_pages (got "
                f"{self.max_requests}, {self.max_beam_width}, {self.max_prompt_pages}): the buffers a captured "
                f"run() reads are allocated once at those sizes."
            )
        self.step_plan: Optional[StepPlan] = None
        self.problem: Optional[PrefixProblem] = None

    # ------------------------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def is_available(
        cls,
        device,
        dtype: torch.dtype,
        head_dim: int,
        num_qo_heads: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        page_size: Optional[int] = None,
        kv_layout: str = "HND",
    ) -> Tuple[bool, str]:
        """``(True, "")`` if this backend can serve the shape on ``device``, else ``(False, reason)``."""

    def lse_shape(self, num_rows: int, num_qo_heads: int) -> Tuple[int, int]:
        """Shape of the float32 LSE buffer :meth:`run` writes: ``[rows, Hq]`` (NH) or ``[Hq, rows]`` (HN)."""
        return (num_rows, num_qo_heads) if self.lse_layout == "NH" else (num_qo_heads, num_rows)

    def write_prompt_page_table(self, buffer, step_plan: StepPlan) -> torch.Tensor:
        """``step_plan.page_table`` copied into ``buffer`` (a :class:`~.buffers.DeviceBuffer`), as the device view:
        int32 ``[R, width]`` page numbers (the buffer's dtype).

        In CUDA-graph mode the table is padded to ``max_prompt_pages`` columns, so its shape (and a
        captured launch reading it) stays valid across re-plans; eagerly it has the plan's width.
        """
        width = self.max_prompt_pages if self.use_cuda_graph else step_plan.max_prompt_pages
        return buffer.write(padded_page_table(step_plan.page_table, width),
                            capacity=(self.max_requests or 0) * width)

    def check_capacity(self, step_plan: StepPlan) -> None:
        """In CUDA-graph mode, refuse a plan beyond the capacities the fixed buffers were sized for."""
        if not self.use_cuda_graph:
            return
        for what, value, cap, arg in (
            ("requests", step_plan.num_requests, self.max_requests, "max_requests"),
            ("beam width", step_plan.beam_width, self.max_beam_width, "max_beam_width"),
            ("prompt pages of one request", step_plan.max_prompt_pages, self.max_prompt_pages, "max_prompt_pages"),
        ):
            if value > cap:
                raise PrefixBackendError(
                    f"the plan has {value} {what} but the CUDA-graph buffers were sized for {arg}={cap}; "
                    f"construct the wrapper with {arg} >= {value}."
                )

    def plan(
        self,
        step_plan: StepPlan,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        sm_scale: Optional[float] = None,
    ) -> None:
        """Host-side planning for ``step_plan`` (never under CUDA-graph capture).

        Args:
            step_plan: the batch's :class:`StepPlan` (its ``page_size`` must equal ``page_size``).
            num_qo_heads, num_kv_heads, head_dim: attention shape.
            page_size: tokens per KV page.
            dtype: bf16 or fp16 (Q, KV and output).
            sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
        """
        ensure_not_capturing(f"{type(self).__name__}.plan()")
        if step_plan.page_size != int(page_size):
            raise ValueError(f"step_plan was built for page_size={step_plan.page_size} but page_size={page_size}.")
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a positive multiple of num_kv_heads={num_kv_heads}.")
        self.check_capacity(step_plan)
        problem = PrefixProblem(
            int(num_qo_heads), int(num_kv_heads), int(head_dim), int(page_size), dtype,
            default_sm_scale(int(head_dim), sm_scale),
        )
        self._plan(step_plan, problem)
        self.step_plan = step_plan
        self.problem = problem

    @abc.abstractmethod
    def _plan(self, step_plan: StepPlan, problem: PrefixProblem) -> None:
        """Backend-specific host planning."""

    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, check: bool = True
    ) -> Tuple[torch.Tensor, LseDescriptor]:
        """Prefix attention of the planned batch into ``out`` and ``lse`` (device only).

        Args:
            q: ``[rows, Hq, D]`` in the planned dtype, last dim contiguous, ``rows = R * W``.
            kv_cache: the paged pool in :attr:`kv_layout` (may be a strided view, last dim contiguous).
            out: ``[rows, Hq, D]`` in the planned dtype, contiguous; receives the normalised prefix output.
            lse: float32 of shape :meth:`lse_shape`, contiguous; receives the prefix LSE.
            check: compare the arguments with the plan first (:meth:`check_run_args`: metadata and addresses, no
                sync; 13-17 us of host time on a CI CPU core). Only ``False`` skips it: the wrapper passes ``False``,
                having checked the same before it calls a backend.

        Returns:
            ``(out, LseDescriptor(lse, self.lse_layout, self.lse_base))``.
        """
        if check is not False:
            self.check_run_args(q, kv_cache, out, lse)
        else:
            self._require_planned()
        return self._run(q, kv_cache, out, lse)

    @abc.abstractmethod
    def _run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> Tuple[torch.Tensor, LseDescriptor]:
        """Backend-specific launch of :meth:`run`, on arguments already checked against the plan."""

    def check_run_args(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Refuse :meth:`run` arguments that do not match the plan (shapes, dtypes, devices, the pool's layout and
        size, the strides the kernels assume, an output sharing memory with an input or with the other output),
        naming the value and the fix; metadata and addresses only, no sync. :meth:`run` calls it unless told not to
        (the wrapper, which checks the same before it calls a backend)."""
        step_plan, problem = self._require_planned()
        rows, hq, hkv, d = step_plan.num_rows, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim

        def fail(msg):
            raise PrefixBackendError(f"{type(self).__name__}.run(): {msg}")

        for name, x in (("q", q), ("kv_cache", kv_cache), ("out", out), ("lse", lse)):
            if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
                fail(f"{name} must be a dense torch.Tensor, got {type(x).__name__}.")
            # (this also keeps every tensor on q's device: the constructor gives a GPU backend its device's index,
            # and a CPU or meta device has none)
            if x.device.type != self.device.type or self.device.index not in (None, x.device.index):
                fail(f"{name} is on {x.device} but the backend runs on {self.device}; move it to {self.device}.")
        for name, x, shape, dtype in (("q", q, (rows, hq, d), problem.dtype), ("out", out, (rows, hq, d), problem.dtype),
                                      ("lse", lse, self.lse_shape(rows, hq), torch.float32)):
            if tuple(x.shape) != shape or x.dtype != dtype:
                fail(f"{name} must be {dtype} {list(shape)} for the planned batch (R*W={rows} rows, Hq={hq}, D={d}), "
                     f"got {x.dtype} {list(x.shape)}; pass the planned dtype, and re-plan when the batch changes.")
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.dtype != problem.dtype:
            fail(f"kv_cache must be {problem.dtype} [pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD), got "
                 f"{kv_cache.dtype} {list(kv_cache.shape)}.")
        pages = kv_cache.shape[0]
        heads, page_size = (kv_cache.shape[2], kv_cache.shape[3]) if self.kv_layout == "HND" else (
            kv_cache.shape[3], kv_cache.shape[2])
        if (heads, page_size, kv_cache.shape[4]) != (hkv, problem.page_size, d):
            fail(f"kv_cache ({self.kv_layout}) has Hkv={heads}, page size {page_size}, D={kv_cache.shape[4]} but the "
                 f"plan has Hkv={hkv}, page size {problem.page_size}, D={d}; check kv_layout={self.kv_layout!r}.")
        if pages < step_plan.num_cache_pages:
            fail(f"kv_cache has {pages} pages but the plan was made for a pool of {step_plan.num_cache_pages}; "
                 f"re-plan with the current pool.")
        # The GPU kernels take a row pitch for q and the pool but assume dense outputs; a transposed view would be
        # written as if it were contiguous.
        for name, x in (("q", q), ("kv_cache", kv_cache)):
            if x.numel() and x.stride(-1) != 1:
                fail(f"{name}'s last dim has stride {x.stride(-1)}, the kernels need 1; pass {name}.contiguous() or a "
                     f"view whose head dim is contiguous.")
        for name, x in (("out", out), ("lse", lse)):
            if not x.is_contiguous():
                fail(f"{name} (strides {list(x.stride())}) must be contiguous; pass a contiguous buffer of its own, "
                     f"e.g. torch.empty({list(x.shape)}, dtype={x.dtype}, device='{x.device}').")
        if self.moves_16_byte_vectors:
            for name, x in (("q", q), ("kv_cache", kv_cache), ("out", out), ("lse", lse)):
                # (the LSE is stored a float at a time; only its address is taken as aligned)
                unaligned = unaligned_16_byte_vectors(name, x, strides=name != "lse")
                if unaligned:
                    fail(f"{unaligned}, which {type(self).__name__}'s kernels need; {ALIGNED_FIX[name]}")
        # The launchers' overlap check (deferred: importing triton_kernels imports Triton, which planning never needs).
        from triton_kernels.step_args import KernelInputError, check_written_overlaps

        try:
            check_written_overlaps(("out", "lse"), (("out", out), ("lse", lse), ("q", q), ("kv_cache", kv_cache)))
        except KernelInputError as exc:
            fail(str(exc))

    def _require_planned(self) -> Tuple[StepPlan, PrefixProblem]:
        if self.step_plan is None or self.problem is None:
            raise PrefixBackendError(f"{type(self).__name__}.run() before plan(); call plan() first.")
        return self.step_plan, self.problem
