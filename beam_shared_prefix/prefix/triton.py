"""Triton prefix backend: the library's own cascade kernel, which can also run the whole step in one launch.

As a prefix backend (:meth:`TritonPrefixBackend.run`) it runs
:func:`triton_kernels.beam_prefix_attention`: each request's prompt, from the plan's dense page
table (beam 0's pages), attended once per block of beams on tensor cores; output and base-2 LSE
``[rows, Hq]``, FlashInfer's convention. Its point is :meth:`TritonPrefixBackend.run_step`, which
the wrapper calls instead of ``run`` + the tail kernel: :func:`triton_kernels.beam_cascade_attention`
does the prompt, the tail gathered through ``cache_indirection``, the K/V write and the merge in one
launch, with no prefix state through memory. At short and medium prompts that saves a launch and
the state's round trip, the fixed costs that dominate such steps (``docs/benchmarks.md``).

Declines (logged by the wrapper, which then runs the next backend): not a CUDA device (on a CPU the
kernel only runs under ``TRITON_INTERPRET=1``, which tests set), dtype other than bf16/fp16, head
size other than 64/128, or a GQA group too wide for the tile (:func:`triton_kernels.cascade_supported`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..config import triton_interpret_env
from ..plan import StepPlan
from .base import LseDescriptor, PrefixBackend, PrefixBackendError, PrefixProblem
from .buffers import DeviceBuffer

__all__ = ["TritonPrefixBackend"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return triton_interpret_env()


class TritonPrefixBackend(PrefixBackend):
    """The cascade kernel as a prefix backend and as a one-launch step; see :class:`~.base.PrefixBackend`."""

    name = "triton"
    lse_layout = "NH"
    lse_base = "log2"
    capturable = True
    fuses_tail = True  # the wrapper may call run_step() instead of run() + the tail kernel

    def __init__(self, device, kv_layout: str = "HND", use_cuda_graph: bool = False, max_requests=None,
                 max_beam_width=None, max_prompt_pages=None):
        super().__init__(device, kv_layout, use_cuda_graph, max_requests, max_beam_width, max_prompt_pages)
        frozen = self.use_cuda_graph
        self._page_table = DeviceBuffer("Triton prefix page table", torch.int32, self.device, frozen)
        self._prompt_lens = DeviceBuffer("Triton prefix prompt lengths", torch.int32, self.device, frozen)
        self._page_table_view: Optional[torch.Tensor] = None
        self._prompt_lens_view: Optional[torch.Tensor] = None

    @classmethod
    def is_available(cls, device, dtype, head_dim, num_qo_heads=None, num_kv_heads=None, page_size=None,
                     kv_layout="HND") -> Tuple[bool, str]:
        """CUDA (or the Triton interpreter), bf16/fp16, a head size and group the cascade tile holds."""
        device = torch.device(device)
        if device.type != "cuda" and not _interpreting():
            return False, f"the Triton cascade kernel needs a CUDA device, got {device}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return False, "CUDA is not available"
        if dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {dtype} is not served by the Triton cascade kernel (bf16, fp16)"
        if kv_layout not in ("HND", "NHD"):
            return False, f"kv_layout {kv_layout!r} is not supported"
        try:
            from triton_kernels import cascade_supported
        except ImportError as exc:  # Triton missing or broken: decline, never crash the caller
            return False, f"triton_kernels does not import: {exc}"
        group = 1 if not num_qo_heads or not num_kv_heads else int(num_qo_heads) // int(num_kv_heads)
        return cascade_supported(group, int(head_dim))

    def _plan(self, step_plan: StepPlan, problem: PrefixProblem) -> None:
        ok, reason = self.is_available(self.device, problem.dtype, problem.head_dim, problem.num_qo_heads,
                                       problem.num_kv_heads, problem.page_size, self.kv_layout)
        if not ok:
            raise PrefixBackendError(f"Triton prefix backend cannot serve this plan: {reason}")
        # The kernel reads only each prompt's columns, whatever the table's width.
        self._page_table_view = self.write_prompt_page_table(self._page_table, step_plan)
        self._prompt_lens_view = self._prompt_lens.write(step_plan.prompt_lens, capacity=self.max_requests or 0)

    @property
    def prompt_page_table(self) -> torch.Tensor:
        """``[R, width]`` int32 on the device: the planned requests' prompt pages (page numbers)."""
        self._require_planned()
        return self._page_table_view

    def _run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """See :meth:`PrefixBackend.run`; LSE is float32 base 2 ``[rows, Hq]``."""
        step_plan, problem = self._require_planned()
        from triton_kernels import beam_prefix_attention

        beam_prefix_attention(q, kv_cache, self._page_table_view, self._prompt_lens_view, step_plan.beam_width,
                              out, lse, sm_scale=problem.sm_scale, kv_layout=self.kv_layout)
        return out, LseDescriptor(lse, self.lse_layout, self.lse_base)

    def run_step(self, q, kv_cache, beam_page_table, kv_lens, prompt_lens_per_row, cache_indirection, new_k, new_v,
                 out, page_index_divisor: int = 1, write_kv: bool = True, validate_indices: bool = False,
                 error_flags=None, max_tail_len=None):
        """The whole step in one launch (:func:`triton_kernels.beam_cascade_attention`; its arguments).

        ``prompt_lens_per_row`` is ``[rows]`` int32 on the device (the wrapper's per-row view of the plan);
        ``max_tail_len`` bounds every row's tail where the host knows it (``None``: unknown).
        """
        step_plan, problem = self._require_planned()
        from triton_kernels import beam_cascade_attention

        return beam_cascade_attention(
            q, new_k, new_v, kv_cache, self._page_table_view, beam_page_table, kv_lens, prompt_lens_per_row,
            cache_indirection, step_plan.beam_width, out, sm_scale=problem.sm_scale, kv_layout=self.kv_layout,
            page_index_divisor=page_index_divisor, write_kv=write_kv, validate_indices=validate_indices,
            error_flags=error_flags, max_tail_len=max_tail_len,
        )
