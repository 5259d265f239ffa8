"""Triton kernels of beam-shared-prefix.

- :func:`beam_tail_attention_merge`: the fused per-beam tail (KV write + gather through
  ``cache_indirection`` + attention + LSE merge with a prefix state), one launch per layer per step.
- :func:`beam_tail_attention_merge_torch`: the same contract in unfused torch ops (CPU and GPU).
- :func:`beam_cascade_attention`: the whole step in one launch (the prompt on tensor cores once per
  block of beams, then the tail), for short and medium prompts; :func:`beam_prefix_attention`, its
  prompt part alone.
- :func:`beam_shared_run_attention`: between a prefix backend and the tail, the generated positions every
  beam of a block reads from one ancestor, attended once per block and merged into the prefix state (the
  tail then skips them; the wrapper runs it on eager steps with long tails, ``shared_run="auto"``, measured on the
  H200 in the thirty-first and thirty-second rounds).
- :mod:`triton_kernels.device_errors`: the optional device error flag those kernels take
  (``error_flags=``): one bit per kind of invalid index they mask, and its decoding.
- :func:`audit_page_table`: with that flag, the checks of the page table that judge rows together (beams unlike
  beam 0, a write page held elsewhere, beam 0's prompt pages unlike the plan's), two launches a step;
  :func:`audit_page_table_torch`, the same in torch ops.
"""

from .cascade import (
    CascadeLaunchConfig,
    beam_cascade_attention,
    beam_prefix_attention,
    cascade_launch_config,
    cascade_supported,
    shared_ancestry_reachable,
)
from .page_table_audit import AuditWorkspace, audit_page_table, audit_page_table_torch, new_audit_workspace
from .shared_run import beam_shared_run_attention, shared_run_supported
from .tail_merge import TailLaunchConfig, beam_tail_attention_merge, tail_launch_config
from .step_args import KernelInputError, TailMergeInputError
from .tail_merge_args import TailMergeGeometry, check_tail_merge_args
from .tail_merge_torch import beam_tail_attention_merge_torch

__all__ = [
    "beam_cascade_attention",
    "beam_prefix_attention",
    "CascadeLaunchConfig",
    "cascade_launch_config",
    "cascade_supported",
    "shared_ancestry_reachable",
    "beam_shared_run_attention",
    "shared_run_supported",
    "audit_page_table",
    "audit_page_table_torch",
    "AuditWorkspace",
    "new_audit_workspace",
    "beam_tail_attention_merge",
    "beam_tail_attention_merge_torch",
    "KernelInputError",
    "TailMergeInputError",
    "TailMergeGeometry",
    "check_tail_merge_args",
    "TailLaunchConfig",
    "tail_launch_config",
]
