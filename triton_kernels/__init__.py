"""Triton kernels of beam-shared-prefix: the fused per-beam tail (KV write + gather + attention + LSE merge).

- :func:`beam_tail_attention_merge`: one Triton launch per layer per step.
- :func:`beam_tail_attention_merge_torch`: the same contract in unfused torch ops (CPU and GPU).
"""

from .tail_merge import TailLaunchConfig, beam_tail_attention_merge, tail_launch_config
from .tail_merge_args import TailMergeGeometry, TailMergeInputError, check_tail_merge_args
from .tail_merge_torch import beam_tail_attention_merge_torch

__all__ = [
    "beam_tail_attention_merge",
    "beam_tail_attention_merge_torch",
    "TailMergeInputError",
    "TailMergeGeometry",
    "check_tail_merge_args",
    "TailLaunchConfig",
    "tail_launch_config",
]
