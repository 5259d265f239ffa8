"""The tail's index helpers of :mod:`triton_kernels.beam_index`, through a one-program test kernel.

:func:`shared_ancestry_len` decides how much of a tile's tail the cascade kernel attends once for all
of its beams, so a run one position too long reads another beam's K/V for some row. It is checked
here against a torch scan on ``cache_indirection`` buffers built as beam search leaves them (a
shared run, then a break at one beam) and with arbitrary entries, including beams past ``W`` in a
buffer sized for a wider search, which must not count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_kernels.beam_index import shared_ancestry_len


# pos_begin and pos_end are loaded per request in the cascade and shared-run kernels, never launch scalars that
# Triton specializes: here, both equal to 1 (a specialization those kernels never see) crashed Triton 3.6's
# TritonGPUCoalesce pass for sm_90 ("PassManager::run failed", H100, round 66; Triton 3.9 compiles it).
@triton.jit(do_not_specialize=["pos_begin", "pos_end"])
def _shared_len_kernel(ci_ptr, out_ptr, stride_req, stride_beam, stride_pos, beam_width, pos_begin, pos_end,
                       BEAMS: tl.constexpr, SCAN: tl.constexpr):
    req = tl.program_id(0)
    block = tl.program_id(1)
    run = shared_ancestry_len(ci_ptr, stride_req, stride_beam, stride_pos, req.to(tl.int64), block * BEAMS,
                              beam_width, pos_begin, pos_end, BEAMS, SCAN)
    tl.store(out_ptr + req * tl.num_programs(1) + block, run)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: conftest set TRITON_INTERPRET=1)


def kernel_runs(ci, beam_width, pos_begin, pos_end, beams, scan):
    """``[R, blocks]`` runs from the kernel for tiles of ``beams`` beams."""
    ci = ci.to(DEVICE)
    blocks = triton.cdiv(beam_width, beams)
    out = torch.full((ci.shape[0], blocks), -1, dtype=torch.int32, device=ci.device)
    _shared_len_kernel[(ci.shape[0], blocks)](ci, out, *ci.stride(), beam_width, pos_begin, pos_end, BEAMS=beams,
                                              SCAN=scan)
    return out.cpu()


def leading_shared_run(tile_entries):
    """The leading run of positions (columns of ``[beams, positions]``) at which every beam has the same
    entry, in torch: the reference for :func:`shared_ancestry_len`."""
    return int((tile_entries == tile_entries[:1]).all(0).int().cumprod(0).sum())


def torch_runs(ci, beam_width, pos_begin, pos_end, beams):
    ci = ci.cpu()
    runs = torch.empty(ci.shape[0], triton.cdiv(beam_width, beams), dtype=torch.int32)
    for r in range(ci.shape[0]):
        for blk in range(runs.shape[1]):
            runs[r, blk] = leading_shared_run(ci[r, blk * beams:min(beam_width, (blk + 1) * beams), pos_begin:pos_end])
    return runs


@st.composite
def indirection_cases(draw):
    beams = draw(st.sampled_from([16, 32]))
    beam_width = draw(st.integers(1, 40))
    max_beam_width = beam_width + draw(st.integers(0, 3))
    seq = draw(st.integers(1, 150))
    pos_begin = draw(st.integers(0, seq - 1))
    pos_end = draw(st.integers(pos_begin, seq))
    return dict(beams=beams, beam_width=beam_width, max_beam_width=max_beam_width, seq=seq, pos_begin=pos_begin,
                pos_end=pos_end, scan=draw(st.sampled_from([16, 32, 64])), requests=draw(st.integers(1, 3)),
                seed=draw(st.integers(0, 2**16)), breaks=draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(indirection_cases())
def test_shared_ancestry_len_matches_torch(case):
    """Random buffers: each request one ancestor for a random number of positions from ``pos_begin``,
    then (``breaks``) one beam reading another source, then random entries; beams past ``W`` (and
    entries outside ``[pos_begin, pos_end)``) random, never counted."""
    g = torch.Generator().manual_seed(case["seed"])
    R, Wmax, W, T = case["requests"], case["max_beam_width"], case["beam_width"], case["seq"]
    ci = torch.randint(0, max(W, 2), (R, Wmax, T), generator=g, dtype=torch.int32)
    for r in range(R):
        run = int(torch.randint(0, T + 1, (1,), generator=g))
        ci[r, :W, :run] = torch.randint(0, W, (1, 1, run), generator=g, dtype=torch.int32)
        if case["breaks"] and run < T and W > 1:
            ci[r, :W, run:] = ci[r, 0, run]
            beam = int(torch.randint(1, W, (1,), generator=g))
            ci[r, beam, run] = (ci[r, 0, run] + 1) % W
    args = (W, case["pos_begin"], case["pos_end"], case["beams"])
    got = kernel_runs(ci, *args, case["scan"])
    want = torch_runs(ci, *args)
    assert torch.equal(got, want), (case, got.tolist(), want.tolist())


def test_shared_ancestry_len_on_a_strided_buffer():
    """A ``cache_indirection`` slice of a wider buffer (the full one, rows of requests not in the batch),
    positions not contiguous in memory: the strides are followed."""
    full = torch.randint(0, 4, (5, 6, 40, 2), dtype=torch.int32).to(DEVICE)
    full[1:4, :4, :30, 0] = 2
    full[2, 3, 17, 0] = 1
    ci = full[1:4, :, :, 0]
    assert not ci.is_contiguous()
    got = kernel_runs(ci, 4, 5, 30, 16, 16)
    assert got.tolist() == [[25], [12], [25]]
    assert torch.equal(got, torch_runs(ci, 4, 5, 30, 16))
