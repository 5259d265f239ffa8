"""``triton_kernels.launch``: every kernel of the package is launched through it, with its compile options.

A spy on the kernels' ``kernel[grid]`` records each launch of whole wrapper steps (the two-launch path with the
shared-run stage and the device flag's audit, and the one-launch cascade) and of the tail launcher with the grouped
tile: every kernel the package defines must be launched, and every launch must ask for FP fusion. Runs the kernels
on a GPU where there is one, else under the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from beam_shared_prefix import BeamSharedPrefixAttention
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.reference import reference_beam_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import (
    TailLaunchConfig,
    beam_cascade_attention,
    beam_tail_attention_merge,
)
from triton_kernels import cascade as cascade_module
from triton_kernels import page_table_audit as page_table_audit_module
from triton_kernels import shared_run as shared_run_module
from triton_kernels import tail_merge as tail_merge_module
from triton_kernels.cascade_kernel import beam_cascade_kernel
from triton_kernels.launch import PDL_ENV, launch, pdl_enabled
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


# The kernels a step launches as programmatic dependents; the page-table audit's stay plain (they run once a step).
PDL_KERNELS = {_name(k) for k in (beam_cascade_kernel, beam_shared_run_kernel, beam_tail_merge_grouped_kernel,
                                  beam_tail_merge_kernel)}


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


@pytest.fixture
def launcher_pdl(monkeypatch):
    """``{kernel name: the pdl argument}`` of every call of :func:`launch` by the package's launchers while the test
    runs (the launches still run)."""
    asked = {}
    for module in (cascade_module, shared_run_module, tail_merge_module, page_table_audit_module):
        def spying_launch(kernel, grid, args, meta, device, pdl=False, real=module.launch):
            asked.setdefault(_name(kernel), set()).add(pdl)
            return real(kernel, grid, args, meta, device, pdl=pdl)
        monkeypatch.setattr(module, "launch", spying_launch)
    return asked


def test_every_kernel_of_a_step_is_launched_with_fp_fusion(launches, launcher_pdl, monkeypatch):
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
    # The step's kernels ask to be programmatic dependents; the audit's (once a step) do not.
    assert launcher_pdl == {name: {name in PDL_KERNELS} for name in (_name(k) for k in KERNELS)}, launcher_pdl


@pytest.fixture
def pdl_env(monkeypatch):
    """Set ``TRTLLM_ENABLE_PDL`` (``None``: unset) with the per-device cache of :func:`pdl_enabled` forgotten around it."""
    def set_env(value):
        if value is None:
            monkeypatch.delenv(PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(PDL_ENV, value)
        pdl_enabled.cache_clear()
    yield set_env
    pdl_enabled.cache_clear()


@pytest.mark.parametrize("env, capability, want", [
    (None, (9, 0), True),   # TensorRT-LLM's default: on
    ("1", (10, 0), True),
    ("0", (9, 0), False),   # the user turned PDL off in TensorRT-LLM
    (None, (8, 0), False),  # no PDL before Hopper
])
def test_pdl_follows_tensorrt_llm_switch_and_the_device(pdl_env, monkeypatch, env, capability, want):
    """A launcher's ``pdl=True`` becomes ``PDL=True, launch_pdl=True`` on a CUDA device of compute capability 9.0 or
    newer unless ``TRTLLM_ENABLE_PDL=0``; never on the CPU or in the interpreter (no grid dependencies, no PTX);
    never for a launch that does not ask. (A fake CUDA device: ``torch.cuda.device`` and the capability are stubbed.)"""
    pdl_env(env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    assert pdl_enabled(cuda) is want
    kernel = _FakeKernel()
    launch(kernel, (1,), (), {"BLOCK": 8}, cuda, pdl=True)
    launch(kernel, (1,), (), {"BLOCK": 8}, cuda)
    launch(kernel, (1,), (), {"BLOCK": 8}, torch.device("cpu"), pdl=True)
    interpreted = _InterpretedFunction()  # CUDA tensors under TRITON_INTERPRET=1: the interpreter runs no PTX
    launch(interpreted, (1,), (), {"BLOCK": 8}, cuda, pdl=True)
    asked, plain, cpu = (kw for _, _, kw in kernel.calls)
    assert (asked.get("PDL"), asked.get("launch_pdl")) == ((True, True) if want else (None, None))
    for kw in (plain, cpu, interpreted.calls[0][2]):
        assert "PDL" not in kw and "launch_pdl" not in kw, kw
    assert not pdl_enabled(torch.device("cpu"))


class _InterpretedFunction(_FakeKernel):
    """A fake kernel as the interpreter makes them (``triton_kernels.step_args.runs_interpreted`` reads the type's
    name)."""


_InterpretedFunction.__name__ = "InterpretedFunction"


@triton.jit
def _slow_producer_kernel(src_ptr, dst_ptr, chain_ptr, n, BLOCK: tl.constexpr, SPIN: tl.constexpr):
    """``dst = src`` as a PDL-aware producer writes it: its dependents are released first, the store waits on
    ``SPIN`` dependent loads of ``chain_ptr[0]`` (zero, so the store lands where it should)."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)
    j = tl.load(chain_ptr)
    for _ in range(SPIN):
        j = tl.load(chain_ptr + j)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst_ptr + offs + j, tl.load(src_ptr + offs, mask=ok, other=0.0), mask=ok)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0 or newer (programmatic dependent launch)")
@pytest.mark.parametrize("path", ["cascade", "tail"])
def test_pdl_launches_in_a_graph_give_the_plain_launches_output(launches, pdl_env, path):
    """In a CUDA graph whose kernel before the step writes the queries (as a model's QKV projection does), the step
    launched as a programmatic dependent gives bit for bit what the plain launch gives, every element written over a
    NaN-poisoned output, and within tolerance of the float32 oracle. The producer releases its dependents as it
    starts and writes the queries only after a chain of dependent loads (microseconds), over queries zeroed before
    the replay: a step that read them before its ``griddepcontrol.wait`` would read zeros. Launched with
    ``launch_pdl`` only when on."""
    sim = _sim(4)
    step = sim.begin_step()
    for _ in range(4):  # earlier generated tokens: a tail behind the prompt
        sim.end_step()
        step = sim.begin_step()
    rows, hq, d = step.q.shape
    q_src = step.q.clone()
    q = torch.empty_like(q_src)
    out = torch.empty_like(q_src)
    gen = torch.Generator(device=q.device).manual_seed(7)
    prefix_out = torch.randn(rows, hq, d, device=q.device, generator=gen).to(q.dtype)
    prefix_lse = torch.randn(rows, hq, device=q.device, generator=gen)
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           step.beam_width, step.page_size, step.num_pages)
    prompt_table = torch.from_numpy(plan.page_table.copy()).to(q.device)
    chain = torch.zeros(1, dtype=torch.int32, device=q.device)

    def layer():
        _slow_producer_kernel[(triton.cdiv(q.numel(), 1024),)](q_src, q, chain, q.numel(), BLOCK=1024, SPIN=4096)
        if path == "cascade":
            beam_cascade_attention(q, step.new_k, step.new_v, sim.kv_cache, prompt_table, step.beam_page_table,
                                   step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width, out,
                                   kv_layout=sim.kv_layout, write_kv=False)
        else:
            beam_tail_attention_merge(q, step.new_k, step.new_v, sim.kv_cache, step.beam_page_table, step.kv_lens,
                                      step.prompt_lens, step.cache_indirection, step.beam_width, prefix_out,
                                      prefix_lse, out, kv_layout=sim.kv_layout, write_kv=False)

    results = {}
    for env in ("1", "0"):
        pdl_env(env)
        launches.clear()
        layer()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer()
        out.fill_(float("nan"))
        q.zero_()
        graph.replay()
        torch.cuda.synchronize()
        results[env] = out.clone()
        used = {kw.get("launch_pdl") for name, kw in launches if name in PDL_KERNELS}
        assert used == ({True} if env == "1" else {None}), (env, launches)
    assert not torch.isnan(results["1"]).any(), "an output element was not written"
    assert torch.equal(results["1"], results["0"])
    if path == "cascade":
        want = reference_beam_attention(q_src, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                        step.cache_indirection, step.beam_width, new_k=step.new_k, new_v=step.new_v,
                                        kv_layout=sim.kv_layout)
        torch.testing.assert_close(results["1"].float(), want.float(), atol=2e-2, rtol=2e-2)
