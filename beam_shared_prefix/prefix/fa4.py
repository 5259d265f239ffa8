"""FA4 prefix backend: flash-attn-4's CuTe-DSL forward (``flash_attn.cute``), paged, on Hopper.

The batch is FA4's paged varlen problem: ``cu_seqlens_q = qo_indptr`` (``W`` rows per request),
``page_table = StepPlan.page_table`` (``[R, max_pages]`` int32, beam 0's prompt pages),
``seqused_k = P_r``, ``max_seqlen_q = W`` as a host int, non-causal, one split (SM90 has no
split-KV). The output and the LSE go into the caller's buffers through ``_flash_attn_fwd``'s
``out=``/``lse=``. FA4's LSE is natural log and heads-major, ``[Hq, rows]``: the backend returns the
``("HN", "ln")`` descriptor and the tail kernel reads it through strides and a ``log2(e)`` scale,
no copy.

K and V. FA4 takes them as separate ``[pages, Pg, Hkv, D]`` tensors. From TensorRT-LLM's HND pool
``[pages, 2, Hkv, Pg, D]`` they are ``pool[:, 0].permute(0, 2, 1, 3)`` (and likewise V): strided
views, no copy. ``flash_attn/cute/interface.py`` makes K/V contiguous only when their last stride is
not 1 and hands them to the kernel with a dynamic layout (every stride but the head dim's is a
runtime value, not part of the compile key), so the permuted view is consumed in place.

Declines (logged by the wrapper, which then runs FlashInfer): FA4 not importable, not SM90/SM100,
dtype other than bf16, head size other than 64/128, and page size 128: with ``page_size == tile_n``
FA4 takes its TMA path, which loads whole pages, and an unwritten (possibly NaN) slot past the prompt
in beam 0's last page would poison V (0 x NaN); smaller pages use the cp.async path that masks them.

FA4 costs 120-210 us of host time per eager call (compile-key build, DLPack, TVM-FFI): it pays
under CUDA graphs. Each new compile key (dtype, D, group, page-size class...) compiles in 3-4 s on
the first ``run()``: run once eagerly before capturing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Dict, Optional, Tuple

import torch

from ..plan import StepPlan
from .base import LseDescriptor, PrefixBackend, PrefixBackendError, PrefixProblem, kv_planes
from .buffers import DeviceBuffer

__all__ = ["FA4PrefixBackend", "FA4_TMA_PAGE_SIZE", "whole_page_reason"]

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16,)
SUPPORTED_MAJOR_CAPABILITIES = (9, 10)
# tile_n of FA4's forward for head sizes <= 128 on SM90/SM100: the page size of its TMA paged path.
FA4_TMA_PAGE_SIZE = 128

_FA4_STATE: Dict[str, object] = {}
# Arguments the backend cannot do without (others, like max_seqlen_k, are passed when accepted): the scale and
# `causal` among them, which a version without them would replace by its defaults without an error.
_REQUIRED_FA4_ARGS = frozenset({"cu_seqlens_q", "seqused_k", "page_table", "max_seqlen_q", "return_lse", "out", "lse",
                                "softmax_scale", "causal"})
_INSTALL_HINT = "pip install 'flash-attn-4>=4.0.0b36'"


def _import_fa4_forward():
    """``flash_attn.cute.interface._flash_attn_fwd`` (imported once, lazily) or None with a reason."""
    if "fn" in _FA4_STATE:
        return _FA4_STATE["fn"]
    fn = None
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        _FA4_STATE["reason"] = f"flash_attn.cute is not installed ({_INSTALL_HINT})"
    else:
        try:
            interface = importlib.import_module("flash_attn.cute.interface")
            fn = getattr(interface, "_flash_attn_fwd", None)
            if fn is None:
                _FA4_STATE["reason"] = ("flash_attn.cute.interface has no _flash_attn_fwd (out=/lse= preallocation "
                                        f"is needed); {_INSTALL_HINT}")
        except Exception as exc:  # a broken CuTe-DSL install must decline, not crash the caller
            _FA4_STATE["reason"] = f"import flash_attn.cute failed: {type(exc).__name__}: {exc}"
    params = None
    if fn is not None:
        try:
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = None
        missing = sorted(_REQUIRED_FA4_ARGS - params) if params is not None else []
        if missing:
            _FA4_STATE["reason"] = f"this flash_attn.cute's _flash_attn_fwd lacks {missing}; {_INSTALL_HINT}"
            fn = None
    _FA4_STATE["fn"] = fn
    _FA4_STATE["params"] = params
    return fn


def whole_page_reason(device, page_size, beam_width=None) -> Optional[str]:
    """Why FA4 would take a kernel that loads whole pages for this shape (``None``: it does not).

    Such a kernel reads the slots past a request's prompt in its last page, which hold unwritten memory
    (or this step's tokens): NaN bits there poison V even at zero weight. FA4's TMA paged path does so where
    the page size equals its key tile (128 for head sizes up to 128 on SM90/SM100); on SM100, flash-attn-4
    4.0.0b40's decode kernel (one query row per request) loads 128-token page units of any page size that is a
    multiple of 128.
    """
    if page_size is None:
        return None
    page_size = int(page_size)
    if page_size == FA4_TMA_PAGE_SIZE:
        return (f"page_size={page_size} selects FA4's TMA paged path, which reads whole pages: an unwritten slot "
                f"past the prompt could poison V with NaN")
    if (beam_width == 1 and page_size % FA4_TMA_PAGE_SIZE == 0
            and torch.cuda.get_device_capability(torch.device(device))[0] == 10):
        return (f"page_size={page_size} with one beam selects FA4's SM100 decode kernel, which loads whole "
                f"{FA4_TMA_PAGE_SIZE}-token page units: an unwritten slot past the prompt could poison V with NaN")
    return None


class FA4PrefixBackend(PrefixBackend):
    """Prefix attention through FA4's paged varlen forward; see :class:`~.base.PrefixBackend` for the arguments."""

    name = "fa4"
    lse_layout = "HN"
    lse_base = "ln"
    capturable = True
    moves_16_byte_vectors = True

    def __init__(self, device, kv_layout: str = "HND", use_cuda_graph: bool = False, max_requests=None,
                 max_beam_width=None, max_prompt_pages=None, tile_mn: Optional[Tuple[int, int]] = None):
        """``tile_mn``: FA4's ``(tile_m, tile_n)`` (query rows x keys per tile, multiples of 16), or
        None for FA4's own choice (128 x 128 at head 128 on SM90); for tuning
        (``python -m microbenchmarks.tune_fa4``)."""
        super().__init__(device, kv_layout, use_cuda_graph, max_requests, max_beam_width, max_prompt_pages)
        if tile_mn is not None:
            if (not isinstance(tile_mn, (tuple, list)) or len(tile_mn) != 2
                    or not all(isinstance(t, int) and t > 0 and t % 16 == 0 for t in tile_mn)):
                raise ValueError(f"tile_mn={tile_mn!r} must be None or two positive multiples of 16 "
                                 f"(tile_m, tile_n), e.g. (128, 64).")
            tile_mn = (int(tile_mn[0]), int(tile_mn[1]))
        self.tile_mn = tile_mn
        frozen = self.use_cuda_graph
        self._cu_seqlens_q = DeviceBuffer("FA4 cu_seqlens_q", torch.int32, self.device, frozen)
        self._seqused_k = DeviceBuffer("FA4 seqused_k", torch.int32, self.device, frozen)
        self._page_table = DeviceBuffer("FA4 page_table", torch.int32, self.device, frozen)
        self._views: Optional[dict] = None

    @classmethod
    def is_available(cls, device, dtype, head_dim, num_qo_heads=None, num_kv_heads=None, page_size=None,
                     kv_layout="HND") -> Tuple[bool, str]:
        """SM90/SM100, bf16, head size 64/128, page size other than 128, ``flash_attn.cute`` importable."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False, f"FA4 needs a CUDA device, got {device}"
        major = torch.cuda.get_device_capability(device)[0]
        if major not in SUPPORTED_MAJOR_CAPABILITIES:
            return False, f"FA4 paged forward is used on SM90/SM100 only, this GPU is SM{major}x"
        if dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {dtype} is not served by the FA4 prefix (bf16 only)"
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim={head_dim} is not served by the FA4 prefix (supported: {SUPPORTED_HEAD_DIMS})"
        reason = whole_page_reason(device, page_size)
        if reason is not None:
            return False, reason
        if kv_layout not in ("HND", "NHD"):
            return False, f"kv_layout {kv_layout!r} is not supported"
        if _import_fa4_forward() is None:
            return False, str(_FA4_STATE.get("reason"))
        return True, ""

    def _plan(self, step_plan: StepPlan, problem: PrefixProblem) -> None:
        ok, reason = self.is_available(self.device, problem.dtype, problem.head_dim, problem.num_qo_heads,
                                       problem.num_kv_heads, problem.page_size, self.kv_layout)
        if ok:
            reason = whole_page_reason(self.device, problem.page_size, step_plan.beam_width)
        if not ok or reason is not None:
            raise PrefixBackendError(f"FA4 prefix backend cannot serve this plan: {reason}")
        if self.tile_mn is not None and self.tile_mn[1] == problem.page_size:
            # The same hazard as page size 128 with FA4's own tile: tile_n == page size takes the TMA path.
            raise PrefixBackendError(
                f"tile_mn={self.tile_mn} has tile_n equal to page_size={problem.page_size}, which selects FA4's TMA "
                f"paged path (whole pages: an unwritten slot past the prompt could poison V); pick another tile_n.")
        if self.tile_mn is not None and "tile_mn" not in (_FA4_STATE.get("params") or ()):
            raise PrefixBackendError("tile_mn is set but this flash_attn.cute's _flash_attn_fwd takes no tile_mn; "
                                     "leave tile_mn=None.")
        cap_r = self.max_requests or 0
        page_table = self.write_prompt_page_table(self._page_table, step_plan)
        self._views = dict(
            cu_seqlens_q=self._cu_seqlens_q.write(step_plan.qo_indptr, capacity=cap_r + 1),
            seqused_k=self._seqused_k.write(step_plan.prompt_lens, capacity=cap_r),
            page_table=page_table,
            max_seqlen_q=step_plan.beam_width,
            max_seqlen_k=page_table.shape[1] * problem.page_size,
        )

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """See :meth:`PrefixBackend.run`; LSE is float32 natural log ``[Hq, rows]``."""
        _, problem = self._require_planned()
        fwd = _import_fa4_forward()
        if fwd is None:
            raise PrefixBackendError(f"FA4 prefix backend unavailable: {_FA4_STATE.get('reason')}")
        k, v = kv_planes(kv_cache, self.kv_layout)  # FA4's paged K/V: [pages, Pg, Hkv, D], strided views
        views = self._views
        kwargs = dict(
            cu_seqlens_q=views["cu_seqlens_q"],
            seqused_k=views["seqused_k"],
            max_seqlen_q=views["max_seqlen_q"],
            max_seqlen_k=views["max_seqlen_k"],
            page_table=views["page_table"],
            softmax_scale=problem.sm_scale,
            causal=False,
            num_splits=1,
            return_lse=True,
            out=out,
            lse=lse,
        )
        if self.tile_mn is not None:
            kwargs["tile_mn"] = self.tile_mn
        params = _FA4_STATE.get("params")
        if params:
            kwargs = {key: val for key, val in kwargs.items() if key in params}
        fwd(q, k, v, **kwargs)
        return out, LseDescriptor(lse, self.lse_layout, self.lse_base)
