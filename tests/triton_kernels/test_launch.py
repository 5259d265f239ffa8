"""``triton_kernels.launch``: every kernel of the package is launched through it, with its compile options.

A spy on the kernels' ``kernel[grid]`` records each launch of whole wrapper steps (the two-launch path with the
shared-run stage and the device flag's audit, and the one-launch cascade) and of the tail launcher with the grouped
tile: every kernel the package defines must be launched, and every launch must ask for FP fusion. Runs the kernels
on a GPU where there is one, else under the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import TailLaunchConfig, beam_tail_attention_merge
from triton_kernels import shared_run as shared_run_module
from triton_kernels.cascade_kernel import beam_cascade_kernel
from triton_kernels.launch import launch
from triton_kernels.page_table_audit_kernel import (
    page_holders_kernel,
    page_table_audit_kernel,
)
from triton_kernels.shared_run_kernel import beam_shared_run_kernel
from triton_kernels.tail_merge_grouped_kernel import beam_tail_merge_grouped_kernel
from triton_kernels.tail_merge_kernel import beam_tail_merge_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = (beam_cascade_kernel, page_holders_kernel, page_table_audit_kernel, beam_shared_run_kernel,
           beam_tail_merge_grouped_kernel, beam_tail_merge_kernel)


def _name(kernel) -> str:
    return kernel.fn.__name__


class _FakeKernel:
    """Records ``kernel[grid](*args, **kwargs)`` and returns a marker, as a ``@triton.jit`` function's launch does."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return "launched"
        return run


def test_launch_passes_the_grid_arguments_constexprs_and_compile_options():
    kernel = _FakeKernel()
    meta = {"BLOCK": 16, "num_warps": 4}
    assert launch(kernel, (3, 2), (1, "x"), meta, torch.device("cpu")) == "launched"
    assert kernel.calls == [((3, 2), (1, "x"), {"BLOCK": 16, "num_warps": 4, "enable_fp_fusion": True})]
    assert meta == {"BLOCK": 16, "num_warps": 4}  # the caller's dict is not changed


@pytest.fixture
def launches(monkeypatch):
    """``(kernel name, launch keyword arguments)`` of every launch of the package's kernels while the test runs."""
    seen = []
    for cls in {type(k) for k in KERNELS}:
        getitem = cls.__getitem__

        def spying_getitem(self, grid, getitem=getitem):
            run = getitem(self, grid)

            def record(*args, **kwargs):
                seen.append((_name(self), kwargs))
                return run(*args, **kwargs)
            return record
        monkeypatch.setattr(cls, "__getitem__", spying_getitem)
    return seen


def _sim(seed):
    return BeamSearchCacheSimulator([9, 30], beam_width=5, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                                    max_seq_len=48, dtype=torch.bfloat16, device=DEVICE, seed=seed)


def _step(att, sim, step):
    att.plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, step.beam_width,
             sim.num_qo_heads, sim.num_kv_heads, sim.head_dim, sim.page_size, sim.num_pages, sim.dtype,
             key=(tuple(step.request_ids), step.beam_width))
    att.run(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.cache_indirection, new_k=step.new_k,
            new_v=step.new_v)


def test_every_kernel_of_a_step_is_launched_with_fp_fusion(launches, monkeypatch):
    monkeypatch.setattr(shared_run_module, "SHARED_RUN_MIN_CACHED_TAIL", 4)  # (short steps reach the shared run)
    two_launch = BeamSharedPrefixAttention(DEVICE, backend="reference", tail_impl="triton", check=False,
                                           report_errors=True, shared_run=True)
    cascade = BeamSharedPrefixAttention(DEVICE, backend="triton", check=False, report_errors=True)
    for att, seed in ((two_launch, 1), (cascade, 2)):
        sim = _sim(seed)
        for s in range(8):  # beams share their first generated positions, then diverge: a shared run
            step = sim.begin_step()
            _step(att, sim, step)
            sim.end_step(parents=np.zeros((2, 5), np.int64) if s < 5 else None, write_kv=False)
    # The tail's other tile, through its launcher.
    sim = _sim(3)
    step = sim.begin_step()
    rows, hq, d = step.q.shape
    prefix_out = torch.randn(rows, hq, d, device=DEVICE)
    prefix_lse = torch.randn(rows, hq, device=DEVICE)
    other = TailLaunchConfig(2, 1, 1, 1, grouped=not any(name == _name(beam_tail_merge_grouped_kernel)
                                                         for name, _ in launches))
    beam_tail_attention_merge(step.q, step.new_k, step.new_v, sim.kv_cache, step.beam_page_table, step.kv_lens,
                              step.prompt_lens, step.cache_indirection, step.beam_width, prefix_out, prefix_lse,
                              torch.empty_like(step.q), launch_config=other)

    assert {name for name, _ in launches} == {_name(k) for k in KERNELS}
    unfused = [(name, kw.get("enable_fp_fusion")) for name, kw in launches if kw.get("enable_fp_fusion") is not True]
    assert not unfused, f"launches without enable_fp_fusion=True (Triton 3.10 turns it off by default): {unfused}"
