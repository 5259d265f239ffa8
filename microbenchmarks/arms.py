"""The arms a benchmark run measures, each prepared per input set and checked before it is timed.

| arm | kind | what it runs | checked against |
| --- | --- | --- | --- |
| ``library/<backend>[-<kernel>]`` | library | ``BeamSharedPrefixAttention.plan`` once, ``run`` timed | full oracle |
| ``prefix/<backend>[-<kernel>]`` | stage | the library's prefix backend alone (its ``run``) | prefix oracle (output and LSE) |
| ``tail/<impl>`` | stage | the fused tail + KV write + merge alone, on a precomputed prefix state | full oracle |
| ``fi-decode-tc`` / ``fi-decode-cc`` | baseline | FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core / CUDA-core): every beam reads the whole prompt plus its own pages | full oracle |
| ``fi-cascade`` | baseline | FlashInfer ``MultiLevelCascadeAttentionWrapper``, 2 levels: full prompt pages shared per request, then each beam's own pages | full oracle |

Baselines read the workload's materialised per-beam pages (see :mod:`.workload`), so they compute
exactly the library's function. Every FlashInfer, FA4 and library import is lazy, inside
``prepare``: an arm whose package is missing is reported as skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .workload import BenchWorkload

__all__ = [
    "ArmSkipped",
    "Prepared",
    "Arm",
    "LibraryArm",
    "PrefixStageArm",
    "TailStageArm",
    "FlashInferDecodeArm",
    "FlashInferCascadeArm",
    "RunContext",
    "default_gpu_arms",
    "default_cpu_arms",
    "parse_arm_list",
]


class ArmSkipped(Exception):
    """This arm cannot run here (a missing package, an unsupported shape); the message says why."""


@dataclass
class RunContext:
    """Per-run settings and resources shared by arms.

    ``use_graphs`` captures the library and stage arms in CUDA graphs; ``graph_baselines`` also
    builds the FlashInfer baselines in their CUDA-graph mode. Baselines are eager by default:
    timing with a queued backlog already removes their host time, and FlashInfer's graph mode can
    only make their kernels slower (fa2 then sizes its query tile for the worst case), so eager is
    the peers' best device time. One float workspace serves every FlashInfer baseline wrapper.
    """

    device: torch.device
    use_graphs: bool = True
    graph_baselines: bool = False
    fi_workspace_bytes: int = 512 << 20
    report_errors: bool = False  # the library arms' device error flag (off, as in serving, unless asked)
    declare_tail: bool = False  # the library arms' wrappers get max_tail_len = the workload's longest tail
    _fi_workspace: Optional[torch.Tensor] = None

    def fi_workspace(self) -> torch.Tensor:
        """The FlashInfer float workspace of the baseline wrappers, uint8 ``[fi_workspace_bytes]``, made once."""
        # Baseline wrappers run one after another on one stream, so they can share it.
        if self._fi_workspace is None:
            self._fi_workspace = torch.zeros(self.fi_workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._fi_workspace


@dataclass
class Prepared:
    """One arm on one input set, ready to run.

    Attributes:
        call: one step, device work only; returns the arm's result.
        outputs: ``result -> (out [rows, Hq, D], lse_base2 [rows, Hq] or None)``.
        poison: tensors to fill with NaN before the check run (the arm's output buffers).
        capturable: whether ``call`` may be captured in a CUDA graph.
        info: facts to report (resolved kernel, plan times...).
        keep: objects that must outlive the timing (wrappers, buffers).
        device_errors: the wrapper's device error flag, read and reset (``None``: the arm has none);
            the check fails an arm whose kernels flag valid input.
    """

    call: Callable[[], object]
    outputs: Callable[[object], Tuple[torch.Tensor, Optional[torch.Tensor]]]
    poison: List[torch.Tensor] = field(default_factory=list)
    capturable: bool = True
    info: Dict = field(default_factory=dict)
    keep: List = field(default_factory=list)
    device_errors: Optional[Callable[[], List[str]]] = None


def _identity_out(result):
    return result, None


class Arm:
    """Base class: ``name``, ``kind`` (library, stage, baseline), ``expect`` (``full`` or ``prefix``)
    and ``work`` (``full``, ``prefix`` or ``tail``: which floor applies)."""

    name: str = "arm"
    kind: str = "baseline"
    expect: str = "full"
    # Whether the arm stores this step's K/V at kv_len - 1 (the library and its tail stage do; the
    # FlashInfer baselines read a cache already holding it).
    writes_kv: bool = False
    work: str = "full"
    description: str = ""

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:  # pragma: no cover - interface
        """Host work for one input set (plans, buffers); returns the step as a :class:`Prepared`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


# ----------------------------------------------------------------------------------------------
# The library
# ----------------------------------------------------------------------------------------------
def _import_attention():
    try:
        from beam_shared_prefix.attention import BeamSharedPrefixAttention
    except ImportError as exc:
        raise ArmSkipped(f"beam_shared_prefix.attention does not import ({exc})") from None
    return BeamSharedPrefixAttention


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class LibraryArm(Arm):
    """This library through its public wrapper: ``plan`` once, ``run`` per step.

    Args:
        backend: ``"flashinfer"``, ``"fa4"``, ``"triton"``, ``"reference"`` or ``"auto"``.
        prefix_kernel: FlashInfer prefix kernel family (``"fa2"``, ``"fa3"``, ``"auto"``) or ``None``
            (the wrapper's default).
        tail_impl: ``"triton"`` or ``"torch"``.
        shared_run: the shared-run stage between the prefix and the tail (the wrapper's ``shared_run``:
            ``"auto"``, ``"on"``/``True``, ``"off"``/``False``); ``None``: ``"auto"`` for ``backend="auto"``
            (what serving runs), ``"off"`` for a named backend (its plain two launches).
        report_errors: the wrapper's device error flag on for this arm (``--report-errors`` turns it on for every
            library arm): ``auto-flag`` times the flag's cost against ``auto`` in the same run. Each timed call is
            one layer's step, so it pays the page-table audit too, as a model's first layer does (the other layers
            skip it: :mod:`triton_kernels.page_table_audit`).
        page_table_audit: with the flag, the wrapper's page-table audit; ``False`` (``auto-flag-layer``) times what a
            model's later layers pay, the kernels' checks alone.
    """

    kind = "library"
    writes_kv = True

    def __init__(self, backend: str, prefix_kernel: Optional[str] = None, tail_impl: str = "triton",
                 shared_run=None, report_errors: bool = False, page_table_audit: bool = True):
        from beam_shared_prefix.config import shared_run_mode

        self.backend = backend
        self.prefix_kernel = prefix_kernel
        self.tail_impl = tail_impl
        self.report_errors = bool(report_errors)
        self.page_table_audit = bool(page_table_audit)
        self.shared_run = shared_run_mode(("auto" if backend == "auto" else "off") if shared_run is None
                                          else shared_run)
        suffix = f"-{prefix_kernel}" if prefix_kernel else ""
        tail = "" if tail_impl == "triton" else f"+{tail_impl}-tail"
        stage = "+shared-run" if self.shared_run == "on" else ""
        flag = ("+flag" if self.page_table_audit else "+flag-layer") if self.report_errors else ""
        self.name = f"library/{backend}{suffix}{stage}{tail}{flag}"
        self.description = "BeamSharedPrefixAttention: prefix once per request + fused tail/merge" + (
            " (shared runs once per beam block)" if self.shared_run == "on" else "")

    def make_wrapper(self, wl: BenchWorkload, ctx: RunContext, use_cuda_graph: bool):
        """A :class:`BeamSharedPrefixAttention` sized for ``wl`` (requests, beams, prompt pages), not yet planned."""
        cls = _import_attention()
        kwargs = dict(
            kv_layout=wl.kv_layout,
            backend=self.backend,
            use_cuda_graph=use_cuda_graph,
            max_requests=wl.num_requests,
            max_beam_width=wl.beam_width,
            max_prompt_pages=int(-(-wl.prompt_lens_host.max() // wl.shape.page_size)),
        )
        if _accepts(cls, "report_errors"):
            # explicit: the environment does not change a timing
            kwargs["report_errors"] = ctx.report_errors or self.report_errors
        elif self.report_errors:
            raise ArmSkipped("the wrapper takes no report_errors argument")
        if not self.page_table_audit:
            if not _accepts(cls, "page_table_audit"):
                raise ArmSkipped("the wrapper takes no page_table_audit argument")
            kwargs["page_table_audit"] = False
        if _accepts(cls, "check"):
            kwargs["check"] = False  # explicit: check mode syncs and runs the oracle, which would be timed
        if _accepts(cls, "shared_run"):
            kwargs["shared_run"] = self.shared_run  # explicit, as report_errors
        elif self.shared_run == "on":
            raise ArmSkipped("the wrapper takes no shared_run argument")
        if ctx.declare_tail:
            if not _accepts(cls, "max_tail_len"):
                raise ArmSkipped("the wrapper takes no max_tail_len argument")
            kwargs["max_tail_len"] = int(wl.tail_lens_host.max())
        if _accepts(cls, "tail_impl"):
            kwargs["tail_impl"] = self.tail_impl
        elif self.tail_impl != "triton":
            raise ArmSkipped(f"the wrapper takes no tail_impl argument, cannot select tail {self.tail_impl!r}")
        if self.prefix_kernel is not None:
            if not _accepts(cls, "prefix_kernel"):
                raise ArmSkipped("the wrapper takes no prefix_kernel argument")
            kwargs["prefix_kernel"] = self.prefix_kernel
        try:
            return cls(wl.device, **kwargs)
        except (ImportError, RuntimeError, ValueError) as exc:
            self._skip_or_fail(exc, "")

    def _skip_or_fail(self, exc: Exception, what: str):
        """A named backend that cannot build or plan here (not installed, declines the shape) is an arm that does not
        apply: skipped. What ``auto`` serves failing, or running out of memory anywhere, is a failure (the run then
        exits 1): raised as it is."""
        if self.backend == "auto" or isinstance(exc, torch.OutOfMemoryError):
            raise exc
        raise ArmSkipped(f"{self.name}: {what}{type(exc).__name__}: {exc}") from None

    def plan_args(self, wl: BenchWorkload):
        """``plan()``'s positional arguments; host arrays (int32 numpy), as an engine adapter passes them."""
        sh = wl.shape
        return (
            wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(), wl.prompt_lens_host.astype(np.int32),
            sh.beams, sh.heads, sh.kv_heads, sh.head_dim, sh.page_size, wl.num_pages, wl.dtype,
        )

    @staticmethod
    def plan_kwargs(attn, wl: BenchWorkload) -> Dict[str, int]:
        """``plan()``'s keywords: the step's longest tail, as an engine adapter passes it (where the
        wrapper takes it)."""
        if not _accepts(type(attn).plan, "max_tail_len"):
            return {}
        return dict(max_tail_len=int(wl.tail_lens_host.max()))

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:
        use_graph = ctx.use_graphs and wl.device.type == "cuda"
        attn = self.make_wrapper(wl, ctx, use_cuda_graph=use_graph)
        t0 = time.perf_counter()
        try:
            attn.plan(*self.plan_args(wl), **self.plan_kwargs(attn, wl))
        except (ImportError, RuntimeError, ValueError) as exc:
            self._skip_or_fail(exc, "plan failed: ")
        first_plan_us = (time.perf_counter() - t0) * 1e6
        served = getattr(attn, "backend_name", None)
        if self.backend != "auto" and served is not None and served != self.backend:
            # The wrapper fell back (e.g. FA4 declined the shape): that arm would time another backend.
            why = ""
            try:
                sh = wl.shape
                ok, why = prefix_backend_class(self.backend).is_available(
                    wl.device, wl.dtype, sh.head_dim, sh.heads, sh.kv_heads, sh.page_size, wl.kv_layout)
            except ArmSkipped:
                pass
            raise ArmSkipped(f"{self.backend} declined this shape ({why or 'see the beam_shared_prefix log'}); "
                             f"the wrapper would serve it with {served}")
        out = torch.empty_like(wl.q)

        def call():
            return attn.run(
                wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.cache_indirection,
                new_k=wl.new_k, new_v=wl.new_v, out=out,
            )

        info = {"first_plan_us": first_plan_us, "backend": getattr(attn, "backend_name", None)}
        if hasattr(attn, "shared_stage_active"):
            info["shared_run"] = bool(attn.shared_stage_active)
        backend = getattr(attn, "backend", None)
        kernel = getattr(backend, "kernel", None)
        if isinstance(kernel, str):
            info["prefix_kernel"] = kernel
        if getattr(attn, "tail_impl", None) == "triton" and not getattr(backend, "fuses_tail", False):
            # The tail kernel's tiling depends on the shape and changes between versions: recorded so a
            # result can be told from one measured with another tiling.
            from triton_kernels.tail_merge import tail_launch_config

            sh = wl.shape
            tiling = tail_launch_config(sh.heads // sh.kv_heads, sh.kv_heads, sh.head_dim, wl.num_rows)
            info["tail_tiling"] = dataclasses.asdict(tiling)
        return Prepared(call=call, outputs=lambda r: (out, None), poison=[out], capturable=use_graph,
                        info=info, keep=[attn], device_errors=getattr(attn, "device_errors", None))

    def time_plans(self, wl: BenchWorkload, ctx: RunContext, repeats: int = 200) -> Dict[str, float]:
        """Host microseconds: ``first_plan_us`` on a fresh wrapper, ``replan_us`` (same inputs, the
        wrapper's digest key), ``replan_keyed_us`` (an explicit composition key), medians, and
        ``build_step_plan_us``; ``backend_plans_in_cached_replans`` counts prefix-backend plans the
        cached calls did (0 expected)."""
        attn = self.make_wrapper(wl, ctx, use_cuda_graph=ctx.use_graphs and wl.device.type == "cuda")
        args = self.plan_args(wl)
        kwargs = self.plan_kwargs(attn, wl)
        t0 = time.perf_counter()
        attn.plan(*args, **kwargs)
        first = (time.perf_counter() - t0) * 1e6
        res = {"first_plan_us": first}

        def med(fn):
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e6)
            return float(np.median(ts))

        def count():
            return getattr(attn, "num_backend_plans", 0)

        b0 = count()
        res["replan_us"] = med(lambda: attn.plan(*args, **kwargs))
        b1 = count()
        key = ("bench", wl.seed, wl.num_requests, wl.beam_width)
        attn.plan(*args, key=key, **kwargs)  # a new key: may plan once
        b2 = count()
        res["replan_keyed_us"] = med(lambda: attn.plan(*args, key=key, **kwargs))
        # Cached re-plans must not plan the prefix backend again: this counts the times they did.
        res["backend_plans_in_cached_replans"] = (b1 - b0) + (count() - b2)
        from beam_shared_prefix.plan import build_step_plan

        res["build_step_plan_us"] = med(lambda: build_step_plan(args[0], args[1], args[2], wl.beam_width,
                                                                 wl.shape.page_size, wl.num_pages))
        if wl.device.type == "cuda":
            torch.cuda.synchronize()
        return res


# ----------------------------------------------------------------------------------------------
# Library stages
# ----------------------------------------------------------------------------------------------
def prefix_backend_class(name: str):
    """The library's :class:`PrefixBackend` subclass registered as ``name``."""
    try:
        from beam_shared_prefix.prefix.select import BACKEND_CLASSES
    except ImportError as exc:
        raise ArmSkipped(f"beam_shared_prefix.prefix does not import ({exc})") from None
    if name not in BACKEND_CLASSES:
        raise ArmSkipped(f"the library has no prefix backend {name!r} (it has {', '.join(BACKEND_CLASSES)})")
    return BACKEND_CLASSES[name]


def _step_plan(wl: BenchWorkload):
    from beam_shared_prefix.plan import build_step_plan

    return build_step_plan(
        wl.prompt_page_indptr.numpy(), wl.prompt_page_indices.numpy(), wl.prompt_lens_host.astype(np.int32),
        wl.beam_width, wl.shape.page_size, wl.num_pages, max_beam_width=wl.beam_width,
    )


class PrefixStageArm(Arm):
    """The library's prefix backend alone: each request's prompt attended once for its ``W`` rows."""

    kind = "stage"
    expect = "prefix"
    work = "prefix"

    def __init__(self, backend: str, prefix_kernel: Optional[str] = None):
        self.backend = backend
        self.prefix_kernel = prefix_kernel
        self.name = f"prefix/{backend}" + (f"-{prefix_kernel}" if prefix_kernel else "")
        self.description = "library prefix stage alone (output + LSE)"

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:
        cls = prefix_backend_class(self.backend)
        sh = wl.shape
        ok, why = cls.is_available(wl.device, wl.dtype, sh.head_dim, sh.heads, sh.kv_heads, sh.page_size, wl.kv_layout)
        if not ok:
            raise ArmSkipped(f"{self.name}: {why}")
        use_graph = ctx.use_graphs and wl.device.type == "cuda" and getattr(cls, "capturable", True)
        kwargs = dict(kv_layout=wl.kv_layout, use_cuda_graph=use_graph, max_requests=wl.num_requests,
                      max_beam_width=wl.beam_width,
                      max_prompt_pages=int(-(-wl.prompt_lens_host.max() // sh.page_size)))
        if self.prefix_kernel is not None:
            if not _accepts(cls, "prefix_kernel"):
                raise ArmSkipped(f"{cls.__name__} takes no prefix_kernel argument")
            kwargs["prefix_kernel"] = self.prefix_kernel
        try:
            backend = cls(wl.device, **kwargs)
            backend.plan(_step_plan(wl), sh.heads, sh.kv_heads, sh.head_dim, sh.page_size, wl.dtype)
        except (ImportError, RuntimeError, ValueError) as exc:
            raise ArmSkipped(f"{self.name}: {type(exc).__name__}: {exc}") from None
        out = torch.empty_like(wl.q)
        lse = torch.empty(backend.lse_shape(wl.num_rows, sh.heads), dtype=torch.float32, device=wl.device)

        # Unchecked, as the wrapper calls it: the arm times the kernel (its output is checked against the oracle).
        def call():
            return backend.run(wl.q, wl.kv_cache, out, lse, check=False)

        def outputs(result):
            o, desc = result
            return o, desc.base2_rows_heads()

        info = {"backend": backend.name}
        if isinstance(getattr(backend, "kernel", None), str):
            info["prefix_kernel"] = backend.kernel
        return Prepared(call=call, outputs=outputs, poison=[out, lse], capturable=use_graph, info=info,
                        keep=[backend])


class TailStageArm(Arm):
    """The fused tail + KV write + LSE merge alone, on a prefix state computed once beforehand.

    The prefix state (output in the dtype, base-2 LSE ``[rows, Hq]``) comes from the library's torch
    reference prefix backend, so this arm's result is the full step and is checked as such.
    """

    kind = "stage"
    expect = "full"
    writes_kv = True
    work = "tail"

    def __init__(self, impl: str = "triton"):
        self.impl = impl
        self.name = f"tail/{impl}"
        self.description = "tail gather + KV write + merge alone (prefix state precomputed)"

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:
        try:
            import triton_kernels
        except ImportError as exc:
            raise ArmSkipped(f"triton_kernels does not import ({exc})") from None
        fn = triton_kernels.beam_tail_attention_merge if self.impl == "triton" else triton_kernels.beam_tail_attention_merge_torch
        sh = wl.shape
        ref_cls = prefix_backend_class("reference")
        prefix = ref_cls(wl.device, kv_layout=wl.kv_layout)
        prefix.plan(_step_plan(wl), sh.heads, sh.kv_heads, sh.head_dim, sh.page_size, wl.dtype)
        prefix_out = torch.empty_like(wl.q)
        prefix_lse = torch.empty(prefix.lse_shape(wl.num_rows, sh.heads), dtype=torch.float32, device=wl.device)
        _, desc = prefix.run(wl.q, wl.kv_cache, prefix_out, prefix_lse)
        out = torch.empty_like(wl.q)

        def call():
            return fn(
                wl.q, wl.new_k, wl.new_v, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                wl.cache_indirection, wl.beam_width, prefix_out, desc.tensor, out,
                kv_layout=wl.kv_layout, prefix_lse_layout=desc.layout, prefix_lse_base=desc.base,
            )

        return Prepared(call=call, outputs=lambda r: (out, None), poison=[out],
                        capturable=self.impl == "triton" and wl.device.type == "cuda", keep=[prefix, prefix_lse])


# ----------------------------------------------------------------------------------------------
# FlashInfer baselines
# ----------------------------------------------------------------------------------------------
def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise ArmSkipped(f"flashinfer does not import ({exc})") from None
    return flashinfer


def per_beam_page_lists(wl: BenchWorkload) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-beam decode page lists: ``(indptr [rows+1], indices, last_page_len [rows])`` int32.

    Beam row ``i`` reads its request's full prompt pages and then its own materialised pages (the
    partial prompt page onward), ``ceil(kv_len / Pg)`` pages in all.
    """
    if wl.baseline_page_table_host is None:
        raise ArmSkipped("the workload was built without baseline pages")
    Pg = wl.shape.page_size
    seq_pages = np.repeat(wl.seq_pages, wl.beam_width)
    table = wl.baseline_page_table_host
    keep = np.arange(table.shape[1])[None, :] < seq_pages[:, None]
    indptr = np.concatenate([[0], np.cumsum(seq_pages)]).astype(np.int32)
    last = ((np.repeat(wl.kv_lens_host, wl.beam_width) - 1) % Pg + 1).astype(np.int32)
    return indptr, table[keep].astype(np.int32), last


def cascade_levels(wl: BenchWorkload):
    """Two-level cascade inputs: per level ``(qo_indptr, kv_indptr, kv_indices, last_page_len)`` int32.

    Level 0: request ``r``'s ``P_r // Pg`` full prompt pages, shared by its ``W`` query rows.
    Level 1: each beam row's own materialised pages from the partial prompt page on.
    """
    if wl.baseline_page_table_host is None:
        raise ArmSkipped("the workload was built without baseline pages")
    R, W, Pg = wl.num_requests, wl.beam_width, wl.shape.page_size
    n_full = wl.full_prompt_pages
    if (n_full < 1).any():
        raise ArmSkipped(f"a prompt is shorter than one page ({int(wl.prompt_lens_host.min())} < {Pg}): the cascade's shared level would be empty")
    beam0 = wl.page_table_host[::W]
    col = np.arange(beam0.shape[1])[None, :]
    lvl0 = (
        (np.arange(R + 1) * W).astype(np.int32),
        np.concatenate([[0], np.cumsum(n_full)]).astype(np.int32),
        beam0[col < n_full[:, None]].astype(np.int32),
        np.full(R, Pg, dtype=np.int32),
    )
    nf_rows = np.repeat(n_full, W)
    ns_rows = np.repeat(wl.seq_pages, W)
    table = wl.baseline_page_table_host
    keep = (col >= nf_rows[:, None]) & (col < ns_rows[:, None])
    lvl1 = (
        np.arange(R * W + 1).astype(np.int32),
        np.concatenate([[0], np.cumsum(ns_rows - nf_rows)]).astype(np.int32),
        table[keep].astype(np.int32),
        ((np.repeat(wl.kv_lens_host, W) - 1) % Pg + 1).astype(np.int32),
    )
    return lvl0, lvl1


def _t(a: np.ndarray, device=None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device is None else t.to(device)


class FlashInferDecodeArm(Arm):
    """FlashInfer per-beam paged decode of the same cache (``use_tensor_cores`` selects the variant)."""

    kind = "baseline"

    def __init__(self, tensor_cores: bool):
        self.tensor_cores = tensor_cores
        self.name = "fi-decode-tc" if tensor_cores else "fi-decode-cc"
        self.description = (
            "FlashInfer BatchDecodeWithPagedKVCacheWrapper, "
            + ("tensor-core (fa2 prefill kernel)" if tensor_cores else "CUDA-core")
            + ": every beam reads the whole prompt + its own pages"
        )

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:
        flashinfer = _import_flashinfer()
        sh = wl.shape
        if not self.tensor_cores and sh.group not in (1, 2, 3, 4, 6, 8, 16):
            raise ArmSkipped(f"CUDA-core decode supports GQA groups 1,2,3,4,6,8,16, not {sh.group}")
        indptr, indices, last = per_beam_page_lists(wl)
        dev = wl.device
        use_graph = ctx.use_graphs and ctx.graph_baselines and dev.type == "cuda"
        kwargs = {}
        if use_graph:
            kwargs = dict(
                paged_kv_indptr_buffer=torch.empty(indptr.shape[0], dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(indices.shape[0], dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(last.shape[0], dtype=torch.int32, device=dev),
            )
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ctx.fi_workspace(), wl.kv_layout, use_cuda_graph=use_graph, use_tensor_cores=self.tensor_cores, **kwargs
        )
        wrapper.plan(
            _t(indptr), _t(indices, dev), _t(last), sh.heads, sh.kv_heads, sh.head_dim, sh.page_size,
            q_data_type=wl.dtype, kv_data_type=wl.dtype,
        )
        out = torch.empty_like(wl.q)

        def call():
            return wrapper.run(wl.q, wl.kv_cache, out=out)

        return Prepared(call=call, outputs=lambda r: (out, None), poison=[out], capturable=use_graph,
                        keep=[wrapper, kwargs])


class FlashInferCascadeArm(Arm):
    """FlashInfer ``MultiLevelCascadeAttentionWrapper`` with two levels (shared prompt, per-beam rest)."""

    kind = "baseline"
    name = "fi-cascade"
    description = "FlashInfer MultiLevelCascadeAttentionWrapper, 2 levels (prompt pages shared per request)"

    def prepare(self, wl: BenchWorkload, ctx: RunContext) -> Prepared:
        flashinfer = _import_flashinfer()
        sh = wl.shape
        levels = cascade_levels(wl)
        dev = wl.device
        use_graph = ctx.use_graphs and ctx.graph_baselines and dev.type == "cuda"
        kwargs = {}
        if use_graph:
            bufs = [[torch.empty(a.shape[0], dtype=torch.int32, device=dev) for a in lvl] for lvl in levels]
            kwargs = dict(
                qo_indptr_buf_arr=[b[0] for b in bufs],
                paged_kv_indptr_buf_arr=[b[1] for b in bufs],
                paged_kv_indices_buf_arr=[b[2] for b in bufs],
                paged_kv_last_page_len_buf_arr=[b[3] for b in bufs],
            )
        wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, ctx.fi_workspace(), wl.kv_layout,
                                                               use_cuda_graph=use_graph, **kwargs)
        wrapper.plan(
            [_t(lvl[0]) for lvl in levels], [_t(lvl[1]) for lvl in levels], [_t(lvl[2], dev) for lvl in levels],
            [_t(lvl[3]) for lvl in levels], sh.heads, sh.kv_heads, sh.head_dim, sh.page_size,
            causal=False, q_data_type=wl.dtype, kv_data_type=wl.dtype,
        )

        def call():
            return wrapper.run(wl.q, wl.kv_cache)

        return Prepared(call=call, outputs=_identity_out, capturable=use_graph, keep=[wrapper, kwargs])


# ----------------------------------------------------------------------------------------------
# Arm sets
# ----------------------------------------------------------------------------------------------
def default_gpu_arms(prefix_kernels=("auto",), include_stages: bool = True, include_baselines: bool = True) -> List[Arm]:
    """Library arms (``auto``, what users get; then FlashInfer per prefix kernel, FA4 and the one-launch
    Triton cascade), stages, and the FlashInfer baselines."""
    arms: List[Arm] = [LibraryArm("auto")]
    for k in prefix_kernels:
        arms.append(LibraryArm("flashinfer", prefix_kernel=None if k in (None, "default") else k))
    arms.append(LibraryArm("fa4"))
    arms.append(LibraryArm("triton"))
    if include_stages:
        for k in prefix_kernels:
            arms.append(PrefixStageArm("flashinfer", prefix_kernel=None if k in (None, "default") else k))
        arms.append(PrefixStageArm("fa4"))
        arms.append(PrefixStageArm("triton"))
        arms.append(TailStageArm("triton"))
    if include_baselines:
        arms += [FlashInferDecodeArm(True), FlashInferDecodeArm(False), FlashInferCascadeArm()]
    return arms


def default_cpu_arms() -> List[Arm]:
    """The CPU reference path: the library with the torch reference prefix and the torch tail."""
    return [LibraryArm("reference", tail_impl="torch"), PrefixStageArm("reference"), TailStageArm("torch")]


def parse_arm_list(text: str, prefix_kernels=("auto",), cpu: bool = False) -> List[Arm]:
    """Arms from a comma list of names: ``auto`` (the library's default choice), ``auto-flag`` (the same with the
    device error flag on, as a model's first layer runs it, the page-table audit included), ``auto-flag-layer`` (the
    flag as its later layers run it: the kernels' checks alone), ``library`` (FlashInfer,
    each prefix kernel), ``fa4``, ``triton`` (the one-launch cascade), ``prefix`` (FlashInfer, FA4
    and Triton prefix stages), ``tail`` (the Triton kernel), ``tail-torch`` (the
    unfused torch path, eager), ``decode`` (both variants),
    ``decode-tc``, ``decode-cc``, ``cascade``, ``reference`` (CPU path arms), ``fa4-shared`` and
    ``flashinfer-shared`` (those two-launch paths with the shared-run stage). On the CPU (``cpu``) ``auto`` runs
    the torch tail, as the library's own default does there. Raises ``ValueError`` for an unknown, repeated or
    missing name."""
    arms: List[Arm] = []
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--arms {text!r} names no arm; give a comma list such as auto,decode.")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--arms names {repeated} more than once; name each arm once.")
    for name in names:
        if name in ("auto", "auto-flag", "auto-flag-layer"):
            arms.append(LibraryArm("auto", tail_impl="torch" if cpu else "triton", report_errors=name != "auto",
                                   page_table_audit=name != "auto-flag-layer"))
        elif name == "library":
            arms += [LibraryArm("flashinfer", prefix_kernel=k) for k in prefix_kernels]
        elif name in ("fa4", "triton"):
            arms.append(LibraryArm(name))
        elif name in ("fa4-shared", "flashinfer-shared"):
            arms.append(LibraryArm(name.split("-")[0], shared_run=True))
        elif name == "prefix":
            arms += [PrefixStageArm("flashinfer", prefix_kernel=k) for k in prefix_kernels]
            arms += [PrefixStageArm("fa4"), PrefixStageArm("triton")]
        elif name == "tail":
            arms.append(TailStageArm("triton"))
        elif name == "tail-torch":
            arms.append(TailStageArm("torch"))
        elif name == "decode":
            arms += [FlashInferDecodeArm(True), FlashInferDecodeArm(False)]
        elif name == "decode-tc":
            arms.append(FlashInferDecodeArm(True))
        elif name == "decode-cc":
            arms.append(FlashInferDecodeArm(False))
        elif name == "cascade":
            arms.append(FlashInferCascadeArm())
        elif name == "reference":
            arms += default_cpu_arms()
        else:
            raise ValueError(
                f"--arms: unknown arm {name!r}; use a comma list of auto, auto-flag, auto-flag-layer, library, fa4, "
                f"triton, fa4-shared, "
                f"flashinfer-shared, prefix, tail, tail-torch, decode, decode-tc, decode-cc, cascade, reference."
            )
    return arms
