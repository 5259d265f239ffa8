"""Torch prefix backend: the library's CPU path, usable on any device.

Each request's prompt pages are gathered once from beam 0's dense page table
(:attr:`StepPlan.page_table`), and the request's ``W * G`` query rows of every KV head attend them
in float32 (non-causal, masked to the prompt length). The result is written in the backend
convention the tail kernel reads: output in the planned dtype, LSE float32 base 2 ``[rows, Hq]``.

No host sync happens in :meth:`ReferencePrefixBackend.run` (request chunks come from host-side plan
numbers), so it is even capturable in a CUDA graph, but it materialises the gathered K/V and the
score matrix: it is the reference and the CPU path, not a fast GPU path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..plan import StepPlan
from .base import LOG2E, LseDescriptor, PrefixBackend, PrefixProblem
from .buffers import DeviceBuffer

__all__ = ["ReferencePrefixBackend"]

# Float32 working set per chunk of requests (gathered K and V plus scores).
_CHUNK_BUDGET_BYTES = 1 << 28


class ReferencePrefixBackend(PrefixBackend):
    """Prefix attention in torch float32 math; see :class:`~.base.PrefixBackend` for the arguments."""

    name = "reference"
    lse_layout = "NH"
    lse_base = "log2"
    capturable = True

    def __init__(self, device, kv_layout: str = "HND", use_cuda_graph: bool = False, max_requests=None,
                 max_beam_width=None, max_prompt_pages=None):
        super().__init__(device, kv_layout, use_cuda_graph, max_requests, max_beam_width, max_prompt_pages)
        self._page_table = DeviceBuffer("reference prefix page table", torch.int32, self.device, use_cuda_graph)
        self._prompt_lens = DeviceBuffer("reference prefix prompt lengths", torch.int32, self.device, use_cuda_graph)
        self._page_table_view: Optional[torch.Tensor] = None
        self._prompt_lens_view: Optional[torch.Tensor] = None

    @classmethod
    def is_available(cls, device, dtype, head_dim, num_qo_heads=None, num_kv_heads=None, page_size=None,
                     kv_layout="HND") -> Tuple[bool, str]:
        """Any device; bf16, fp16 or float32; any head size."""
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"dtype {dtype} is not supported (bf16, fp16 or float32)"
        if kv_layout not in ("HND", "NHD"):
            return False, f"kv_layout {kv_layout!r} is not supported"
        return True, ""

    def _plan(self, step_plan: StepPlan, problem: PrefixProblem) -> None:
        self._page_table_view = self.write_prompt_page_table(self._page_table, step_plan)
        self._prompt_lens_view = self._prompt_lens.write(step_plan.prompt_lens, capacity=self.max_requests or 0)

    # No autograd: run() writes into the caller's (often persistent) buffers, which a grad-tracked q would chain into
    # a graph that grows every step; the GPU backends write through pointers and ignore autograd too.
    @torch.no_grad()
    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """See :meth:`PrefixBackend.run`; writes ``out`` (planned dtype) and ``lse`` (float32 base 2 ``[rows, Hq]``)."""
        step_plan, problem = self._require_planned()
        R, W = step_plan.num_requests, step_plan.beam_width
        hq, hkv, d, pg = problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, problem.page_size
        g = hq // hkv
        width = self._page_table_view.shape[1]
        tokens = width * pg
        k_pool = kv_cache.select(1, 0)
        v_pool = kv_cache.select(1, 1)
        per_request = 4 * tokens * hkv * (2 * d + W * g)
        step = max(1, _CHUNK_BUDGET_BYTES // max(per_request, 1))
        positions = torch.arange(tokens, device=q.device)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            n = r1 - r0
            pages = self._page_table_view[r0:r1].long()  # [n, width]
            if self.kv_layout == "HND":
                # [n, width, Hkv, Pg, D] -> [n, Hkv, width * Pg, D]
                k = k_pool[pages].permute(0, 2, 1, 3, 4).reshape(n, hkv, tokens, d).float()
                v = v_pool[pages].permute(0, 2, 1, 3, 4).reshape(n, hkv, tokens, d).float()
            else:
                # [n, width, Pg, Hkv, D] -> [n, Hkv, width * Pg, D]
                k = k_pool[pages].reshape(n, tokens, hkv, d).permute(0, 2, 1, 3).float()
                v = v_pool[pages].reshape(n, tokens, hkv, d).permute(0, 2, 1, 3).float()
            # Rows of a request, grouped by KV head: [n, Hkv, W * G, D].
            qf = q[r0 * W:r1 * W].float().reshape(n, W, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, W * g, d)
            valid = positions[None, :] < self._prompt_lens_view[r0:r1].long()[:, None]  # [n, T]
            # Slots past the prompt (beam 0's generated tokens, or unwritten memory) are zeroed, as
            # the kernels' masked loads do: a weight of 0 times a NaN there would still be NaN.
            k = torch.where(valid[:, None, :, None], k, 0.0)
            v = torch.where(valid[:, None, :, None], v, 0.0)
            scores = torch.einsum("nhqd,nhtd->nhqt", qf, k) * problem.sm_scale
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            lse_nat = torch.logsumexp(scores, dim=-1)  # [n, Hkv, W * G]; finite: every prompt has >= 1 token
            probs = torch.exp(scores - lse_nat[..., None])
            o = torch.einsum("nhqt,nhtd->nhqd", probs, v)
            o = o.reshape(n, hkv, W, g, d).permute(0, 2, 1, 3, 4).reshape(n * W, hq, d)
            out[r0 * W:r1 * W].copy_(o)
            lse[r0 * W:r1 * W].copy_((lse_nat * LOG2E).reshape(n, hkv, W, g).permute(0, 2, 1, 3).reshape(n * W, hq))
        return out, LseDescriptor(lse, self.lse_layout, self.lse_base)
