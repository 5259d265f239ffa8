"""The one-launch cascade kernel (whole step, and its prefix stage alone) against the float32 oracle.

Steps come from :class:`BeamSearchCacheSimulator` (shuffled pages, random pool, random beam
reselection); the prompt page table from the planner, as the wrapper passes it. Expected outputs
are ``reference_beam_attention`` over each beam's whole gathered history (prefix stage:
``reference_prefix_attention``). Outputs are NaN-poisoned before the call, and the pool is
compared with a snapshot afterwards: exactly the step's K/V changed. Multi-step runs read back the
K/V the kernel wrote (``sim.end_step(write_kv=False)``).

Tolerance as in ``test_tail_merge.py`` (``atol = rtol = 2e-2`` for unit-variance bf16/fp16 data);
the kernel rounds the softmax weights to the KV dtype before ``P V`` (FlashAttention's practice),
which stays within it, while a wrong page, beam or mask moves outputs by O(0.1-1)
(``test_cascade_detects_a_wrong_beam``). On CPU the kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.reference import reference_prefix_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import device_errors
from triton_kernels import (
    CascadeLaunchConfig,
    KernelInputError,
    beam_cascade_attention,
    beam_prefix_attention,
    cascade_launch_config,
    cascade_supported,
    shared_ancestry_reachable,
)
from triton_kernels.cascade import (
    GROUP_2_ROOMY_REGISTERS,
    GROUP_2_TIGHT_REGISTERS,
    MIN_BLOCK_M,
    SHARED_ANCESTRY_MIN_TAIL,
    narrow_tile_beams,
    wide_group_head_64_tile_choice,
    wide_launch_config,
)

from test_beam_index import leading_shared_run
from test_tail_merge import (
    assert_matches, assert_same_pools_but_one_raced_slot, audit_word, earlier_tail, expected_pool_after_write, make_sim,
    oracle, out_over_index, step_after,
)


def prompt_table(sim, step):
    """The planner's dense prompt page table for the step, as int32 on the step's device."""
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           step.beam_width, step.page_size, step.num_pages)
    return torch.from_numpy(plan.page_table.copy()).to(step.q.device)


def run_cascade(sim, step, *, divisor=1, write_kv=True, launch_config=None, strided=False, validate=False):
    table = step.beam_page_table
    if divisor != 1:
        table = sim.block_offsets(table, divisor)[:, 0, :]
    q, new_k, new_v = step.q, step.new_k, step.new_v
    out = torch.full_like(q, float("nan"))
    if strided:  # q/new_k/new_v as views of one fused QKV buffer, out inside a wider buffer
        rows, hq, d = q.shape
        hkv = new_k.shape[1]
        # "misaligned": the buffer starts one element past a 16-byte boundary, so the kernel must
        # not load this step's K/V rows as 16-byte vectors (on CUDA a wrong choice faults).
        skew = 1 if strided == "misaligned" else 0
        flat = torch.empty(rows * (hq + 2 * hkv) * d + skew, dtype=q.dtype, device=q.device)
        qkv = flat[skew:].view(rows, hq + 2 * hkv, d)
        qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:] = q, new_k, new_v
        q, new_k, new_v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        out = torch.full((rows, hq + 3, d), float("nan"), dtype=q.dtype, device=q.device)[:, 2:2 + hq]
    before = sim.kv_cache.clone()
    flags = device_errors.new_error_flags(q.device)
    result = beam_cascade_attention(
        q, new_k, new_v, sim.kv_cache, prompt_table(sim, step), table, step.kv_lens, step.prompt_lens,
        step.cache_indirection, step.beam_width, out, kv_layout=sim.kv_layout, page_index_divisor=divisor,
        write_kv=write_kv, validate_indices=validate, launch_config=launch_config, error_flags=flags,
    )
    assert result is out
    assert int(flags) == 0, f"valid input raised {device_errors.decode_error_flags(int(flags))}"
    audited = audit_word(step, table, divisor=divisor)
    assert audited == 0, f"the audit of a valid step raised {device_errors.decode_error_flags(audited)}"
    want_pool = expected_pool_after_write(sim, step, before) if write_kv else before
    assert torch.equal(sim.kv_cache, want_pool), "the pool differs from its snapshot plus this step's K/V"
    return out


# (name, simulator kwargs, call kwargs, steps, requests joining at step -> prompts)
CASES = [
    # G=1, 16 beams in one tile; prompts filling their last page exactly (16), of one token, and
    # mid-page; tails of 0..9 earlier tokens crossing a page boundary; a late joiner gives one
    # launch rows with different tail lengths; validate_indices on.
    ("g1_d64_hnd", dict(prompts=[16, 1, 7], beams=3, hq=2, hkv=2, d=64), dict(validate=True), 10, {3: [30]}),
    # G=2, head 128, NHD, block-offset page table (divisor 6), prompts spanning several BLOCK_N blocks.
    ("g2_d128_nhd_blockoffsets", dict(prompts=[70, 33], beams=5, hq=4, hkv=2, d=128, layout="NHD", max_seq_len=96),
     dict(divisor=6), 4, {}),
    # G=2, head 128, 20 beams: the default 32-beam tile attends the prompt first (pipelined, 3 blocks).
    ("g2_d128_w20_prompt_first", dict(prompts=[150, 40], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=160),
     dict(), 3, {}),
    # The same tile with every prompt in one 128-token block (a 4-column table of 32-token pages):
    # the one-block tiling, straight-line, the tail's index chain split around the prompt's loads.
    ("g2_d128_w20_one_block", dict(prompts=[100, 40], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=128),
     dict(), 3, {}),
    # G=3 (padded to 4), page size 32, strided q/new_k/new_v/out, fp16 (the interpreter runs its dots as on the GPU).
    ("g3_d64_pg32_strided_fp16", dict(prompts=[33, 2], beams=3, hq=6, hkv=2, d=64, pg=32, dtype=torch.float16),
     dict(strided=True), 4, {}),
    # Views of a fused QKV buffer that starts off a 16-byte boundary: the scalar-load path.
    ("g2_d64_misaligned_qkv", dict(prompts=[20, 5], beams=4, hq=4, hkv=2, d=64), dict(strided="misaligned"), 3, {}),
    # Pages of 64 tokens read in 32-token prompt blocks (a block's slots then move from block to block).
    ("g2_d64_pg64_block32", dict(prompts=[100, 7], beams=4, hq=4, hkv=2, d=64, pg=64, max_seq_len=128),
     dict(launch_config=CascadeLaunchConfig(16, 2, block_n=32, tail_block=2, num_warps=4, num_stages=1,
                                            prompt_stages=2)), 3, {}),
    # G=8 (the widest group tiled at 16 beams), beam width 1: the narrow tile of 4 beams (32 rows, 8-position tail
    # blocks); W = 5 at G = 2 (above), 3 at G = 3 and 4 at G = 2 at head 64 take narrow tiles too.
    ("g8_d64_w1", dict(prompts=[9, 16], beams=1, hq=8, hkv=1, d=64), dict(), 3, {}),
    # Narrow tiles at head 128: 4 beams a program at G = 4 (16 rows, the core tail), 8 at G = 6 (padded to 8: 64 rows,
    # 64-token prompt blocks, the masked tail).
    ("g4_d128_w3_narrow", dict(prompts=[70, 12], beams=3, hq=8, hkv=2, d=128, max_seq_len=96), dict(), 4, {}),
    ("g6_d128_w7_narrow", dict(prompts=[40, 90], beams=7, hq=6, hkv=1, d=128, pg=32, max_seq_len=128), dict(), 3, {}),
]


@pytest.mark.parametrize("name,sim_kw,call_kw,steps,joins", CASES, ids=[c[0] for c in CASES])
def test_cascade_matches_oracle_over_steps(name, sim_kw, call_kw, steps, joins, device):
    sim = make_sim(device, **sim_kw)
    for s in range(steps):
        if s in joins:
            sim.add_requests(joins[s])
        step = sim.begin_step()
        out = run_cascade(sim, step, **call_kw)
        assert_matches(out, oracle(sim, step), f"{name} step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)  # later steps read the K/V the kernel wrote


TILINGS = [
    # beams_per_program 16 < W: several beam blocks per request, the last one partly padding;
    # tail_block 2 and 4 (a key block wider than the tail); block_n 32 > page size 16; one stage.
    ("beam_blocks_tail2", CascadeLaunchConfig(16, 4, block_n=32, tail_block=2, num_warps=4, num_stages=1)),
    ("wide_tail_block", CascadeLaunchConfig(32, 4, block_n=32, tail_block=4, num_warps=4, num_stages=2)),
    # The prompt before the tail, its loop pipelined deeper than the launch's stages.
    ("prompt_first_pipelined", CascadeLaunchConfig(16, 4, block_n=32, tail_block=4, num_warps=4, num_stages=1,
                                                   prompt_first=True, prompt_stages=3, tail_stages=2)),
    # The prompt first with every prompt in one 64-token block (3 pages of 16): the straight-line
    # schedule, the tail's source beams and pages requested on either side of the prompt's loads.
    ("prompt_first_one_block", CascadeLaunchConfig(16, 4, block_n=64, tail_block=2, num_warps=4, num_stages=1,
                                                   prompt_first=True, heads_per_program=2)),
    # Two KV heads per program over Hkv = 3: the second program's spare head repeats head 2.
    ("two_heads_per_program", CascadeLaunchConfig(16, 4, block_n=32, tail_block=4, num_warps=4, num_stages=1,
                                                  heads_per_program=2)),
    # The tail on CUDA cores (group-major rows), its state seeding the prompt loop: 3 positions per
    # step (a 5-token tail takes two steps, the second partly masked), and over two KV heads with a
    # pipelined prompt at 8 warps and a 128-register cap (two 8-warp programs per SM).
    ("tail_on_cores", CascadeLaunchConfig(16, 4, block_n=32, tail_block=4, num_warps=4, num_stages=1,
                                          tail_on_cores=True)),
    ("tail_on_cores_8_warps_capped", CascadeLaunchConfig(32, 4, block_n=32, tail_block=2, num_warps=8, num_stages=1,
                                                         heads_per_program=2, prompt_stages=2, max_registers=128,
                                                         tail_on_cores=True)),
    # GQA 3-4's 32-beam tile at head 64 (the default where many programs run): 18 beams in one 128-row tile.
    ("wide_group_head_64", cascade_launch_config(30, 4, 64, None, 64, 8, 132)),
    # Tiles of fewer beams: 16 query rows of 4 beams with the core tail, and 8 beams on tensor cores (32 tail key
    # columns) with the shared-ancestry path from 2 cached tokens.
    ("four_beam_tile", CascadeLaunchConfig(4, 4, block_n=64, tail_block=4, num_warps=4, num_stages=1, prompt_stages=2,
                                           tail_on_cores=True)),
    ("eight_beam_tile_shared_ancestry", CascadeLaunchConfig(8, 4, block_n=32, tail_block=4, num_warps=4, num_stages=1,
                                                            shared_min_tail=2)),
    # A register cap (maxnreg, CUDA only: the interpreter has no registers) forces spills.
    ("wide_group_pad_capped", CascadeLaunchConfig(16, 8, block_n=64, tail_block=2, num_warps=8, num_stages=3,
                                                  max_registers=128)),
]


@pytest.mark.parametrize("config", [t[1] for t in TILINGS], ids=[t[0] for t in TILINGS])
def test_cascade_tilings_agree_with_oracle(config, device):
    """W = 18 > 16 beams per block, G = 3 padded, Hkv = 3, tails of 0-5 earlier tokens."""
    sim = make_sim(device, prompts=[13, 40], beams=18, hq=9, hkv=3, d=64, seed=13)
    for s in range(6):
        step = sim.begin_step()
        out = run_cascade(sim, step, divisor=6 if s % 2 else 1, launch_config=config)
        assert_matches(out, oracle(sim, step), f"tiling {config}, step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)
    assert max(earlier_tail(step)) == 5


def shared_runs(step, beams_per_program):
    """Per tile (request, block of beams), the leading run of earlier tail positions from ``P`` at which
    every beam of the tile has the same ``cache_indirection`` entry (torch, ``test_beam_index``'s reference)."""
    W = step.beam_width
    ci = step.cache_indirection.cpu()
    runs = []
    for r, p in enumerate(step.prompt_lens_per_request.tolist()):
        end = int(step.kv_lens[r * W]) - 1
        for b0 in range(0, W, beams_per_program):
            runs.append(leading_shared_run(ci[r, b0:min(W, b0 + beams_per_program), p:end]))
    return runs


def coalesce_then_branch(sim, steps, shared_steps):
    """Run ``steps`` steps whose first ``shared_steps`` give every beam beam 0 as its parent (the whole
    history then has one ancestor), the rest random parents, as beam search's histories coalesce."""
    for s in range(steps):
        sim.begin_step()
        sim.end_step(parents=np.zeros((len(sim.requests), sim.beam_width), np.int64) if s < shared_steps else None)


# (name, simulator kwargs, launch config, steps with one parent, steps, crafted break)
SHARED_ANCESTRY_CASES = [
    # The default tiling of 20 beams at G = 2, head 128, prompts past 128 tokens: 32-beam tiles, the
    # prompt first in pipelined 64-token blocks; its own threshold (16 cached positions).
    ("default_prompt_first", dict(prompts=[150, 40], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=192), None,
     14, 18, False),
    # The one-block tiling (prompts within 128 tokens), which leaves the path out by default, with it on.
    ("one_block", dict(prompts=[100, 40], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=160),
     dataclasses.replace(cascade_launch_config(20, 2, 128, 128), shared_ancestry=True), 14, 18, False),
    # Two beam blocks per request (the second two beams and 14 padding), the tail first, 32-position
    # blocks: runs of 34-36 positions take two dense blocks, the second partly masked.
    ("beam_blocks", dict(prompts=[13, 40], beams=18, hq=9, hkv=3, d=64, max_seq_len=96, seed=13),
     CascadeLaunchConfig(16, 4, block_n=32, tail_block=2, num_warps=4, num_stages=1, shared_min_tail=2), 36, 40,
     False),
    # The prompt first and pipelined, two KV heads per program, NHD, TensorRT-LLM block offsets; a run
    # broken at its fourth position while the positions after it are shared again (the per-beam key
    # blocks take them).
    ("broken_run", dict(prompts=[20, 7], beams=5, hq=8, hkv=2, d=64, layout="NHD", max_seq_len=64, seed=4),
     CascadeLaunchConfig(16, 4, block_n=32, tail_block=4, num_warps=4, num_stages=1, prompt_first=True,
                         prompt_stages=3, heads_per_program=2, shared_min_tail=2), 12, 15, True),
]


@pytest.mark.parametrize("name,sim_kw,config,shared_steps,steps,crafted", SHARED_ANCESTRY_CASES,
                         ids=[c[0] for c in SHARED_ANCESTRY_CASES])
def test_cascade_attends_a_shared_ancestry_once(name, sim_kw, config, shared_steps, steps, crafted, device):
    """Tails whose first positions every beam of a tile reads from one ancestor (folded once for the tile
    as dense key blocks) and whose later ones each beam reads from its own: the oracle's output, and
    exactly this step's K/V written."""
    sim = make_sim(device, **sim_kw)
    coalesce_then_branch(sim, steps, shared_steps)
    step = sim.begin_step()
    config_used = config or cascade_launch_config(sim.beam_width, sim_kw["hq"] // sim_kw["hkv"], sim_kw["d"],
                                                  int(prompt_table(sim, step).shape[1]) * sim.page_size)
    assert config_used.folds_shared_ancestry
    beams = config_used.beams_per_program
    if crafted:  # request 0's beams disagree at P + 3 only
        p = int(step.prompt_lens_per_request[0])
        step.cache_indirection[0, : sim.beam_width, p + 3] = torch.arange(sim.beam_width, dtype=torch.int32)
    runs = shared_runs(step, beams)
    tails = earlier_tail(step)
    assert max(runs) >= shared_steps - 1 and any(0 < run < max(tails) for run in runs), (runs, tails)
    out = run_cascade(sim, step, divisor=6 if sim_kw.get("layout") == "NHD" else 1, launch_config=config)
    assert_matches(out, oracle(sim, step), f"{name}: runs {runs}, tails {tails}")


def test_cascade_reports_a_bad_source_in_a_shared_run(device):
    """An out-of-range source beam that every beam of a tile shares (inside a shared run) is masked and
    reported as such, as in the per-beam key blocks."""
    sim = make_sim(device, prompts=[20, 7], beams=5, hq=4, hkv=2, d=64, seed=8)
    coalesce_then_branch(sim, 8, 8)
    step = sim.begin_step()
    p = int(step.prompt_lens_per_request[1])
    step.cache_indirection[1, :, p + 2] = sim.beam_width + 3
    config = dataclasses.replace(cascade_launch_config(5, 2, 64), shared_min_tail=2)
    assert min(shared_runs(step, config.beams_per_program)) >= 7
    flags = device_errors.new_error_flags(device)
    out = torch.full_like(step.q, float("nan"))
    beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, prompt_table(sim, step), step.beam_page_table,
                           step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width, out,
                           kv_layout=sim.kv_layout, launch_config=config, error_flags=flags)
    assert not torch.isnan(out).any()
    assert int(flags) == device_errors.SOURCE_BEAM.value, device_errors.decode_error_flags(int(flags))


def poison_unread_slots(sim, step):
    """NaN in every pool slot that holds no K/V of this step's history (positions ``[0, kv_len - 1)``
    through each row's page table): slots past a prompt or a tail, and unused pages. The kernel
    must never let them reach the output (a masked score times a NaN value is NaN)."""
    table = step.beam_page_table.cpu().long()
    written = torch.zeros(sim.num_pages, sim.page_size, dtype=torch.bool)
    for row, kv_len in enumerate(step.kv_lens.cpu().tolist()):
        pos = torch.arange(kv_len - 1)
        written[table[row, pos // sim.page_size], pos % sim.page_size] = True
    pool = sim.kv_cache
    if sim.kv_layout == "HND":  # [pages, 2, Hkv, page_size, D]
        unread = ~written[:, None, None, :, None].to(pool.device)
    else:  # [pages, 2, page_size, Hkv, D]
        unread = ~written[:, None, :, None, None].to(pool.device)
    pool.masked_fill_(unread.expand_as(pool), float("nan"))
    return int(unread.sum())


@pytest.mark.parametrize("config", [None, TILINGS[0][1], dict(TILINGS)["tail_on_cores"]],
                         ids=["default_one_block", "beam_blocks_tail2", "tail_on_cores"])
def test_cascade_never_reads_an_unwritten_slot(config, device):
    """The pool's slots past each prompt and tail (where beams write later steps, possibly right now)
    and its unused pages hold NaN: the output still matches the oracle, so no such slot reaches
    ``P V`` (a masked score times a NaN value is NaN), on the one-block, multi-block and core-tail paths."""
    sim = make_sim(device, prompts=[100, 40, 7], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=128, seed=21)
    for s in range(4):
        step = sim.begin_step()
        if s == 3:
            assert poison_unread_slots(sim, step) > 0
            table = step.beam_page_table
            out = torch.full_like(step.q, float("nan"))
            beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, prompt_table(sim, step), table,
                                   step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width, out,
                                   kv_layout=sim.kv_layout, launch_config=config)
            assert_matches(out, oracle(sim, step), f"config {config}, tails {earlier_tail(step)}")
        sim.end_step(write_kv=s < 3)


CASCADE_BAD_VALUES = [
    # (name, change to the call's arguments, error bits it must raise)
    ("prompt_page_outside_pool", lambda a: dict(prompt_page_table=a["prompt_page_table"] + 10_000),
     device_errors.PROMPT_PAGE.value),
    # (the prompt then also runs past every kv_len)
    ("prompt_past_its_table", lambda a: dict(prompt_lens=a["prompt_lens"] + 200),
     device_errors.PROMPT_LEN.value | device_errors.KV_LEN.value),
    ("kv_len_not_past_prompt", lambda a: dict(kv_lens=a["prompt_lens"].clone()), device_errors.KV_LEN.value),
    ("write_page_outside_pool", None, device_errors.WRITE_PAGE.value),
    ("indirection_not_a_beam", lambda a: dict(cache_indirection=a["cache_indirection"] + 5),
     device_errors.SOURCE_BEAM.value),
    ("tail_page_outside_pool", lambda a: dict(beam_page_table=a["beam_page_table"] + 10_000),
     device_errors.TAIL_PAGE.value | device_errors.WRITE_PAGE.value),
    # Garbage prompt lengths of request 0: negative, or near 2^31 (also not under any kv_len).
    ("prompt_len_negative", lambda a: dict(prompt_lens=_with_request0_prompt(a, -8)), device_errors.PROMPT_LEN.value),
    ("prompt_len_near_int32_max", lambda a: dict(prompt_lens=_with_request0_prompt(a, 2**31 - 1)),
     device_errors.PROMPT_LEN.value | device_errors.KV_LEN.value),
]


def _with_request0_prompt(args, value):
    """The call's ``prompt_lens`` with request 0's length (each of its rows' entries) set to ``value``."""
    lengths = args["prompt_lens"].clone()
    lengths[:args["beam_width"]] = value
    return lengths


@pytest.mark.parametrize("config", [None, dict(TILINGS)["tail_on_cores"]], ids=["default_one_block", "tail_on_cores"])
@pytest.mark.parametrize("prompt_len", [-8, -2**30, 2**31 - 1])
def test_cascade_reads_nothing_before_its_buffers_for_a_garbage_prompt_length(prompt_len, config, device):
    """The tail counts its positions from the prompt length: a negative one (or one near 2^31, whose positions would
    wrap) must not index ``cache_indirection`` or the beam page table before their start. Both are given as views
    64 elements into larger buffers whose leading elements differ between two calls: the outputs must be equal,
    finite, and request 1 (whose input is valid) must match the oracle."""
    sim = make_sim(device, prompts=[9, 5], beams=3, hq=4, hkv=2, d=64, pg=4, seed=5)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    ref = oracle(sim, step)
    outs = []
    for guard in (0, 1):
        def after_guard(t):
            buf = torch.full((t.numel() + 64,), guard, dtype=t.dtype, device=t.device)
            buf[64:] = t.flatten()
            return buf[64:].view(t.shape)

        prompt_lens = step.prompt_lens.clone()
        prompt_lens[:step.beam_width] = prompt_len
        out = torch.full_like(step.q, float("nan"))
        flags = device_errors.new_error_flags(device)
        beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache.clone(), prompt_table(sim, step),
                               after_guard(step.beam_page_table), step.kv_lens, prompt_lens,
                               after_guard(step.cache_indirection), step.beam_width, out, kv_layout=sim.kv_layout,
                               launch_config=config, error_flags=flags)
        assert int(flags) & device_errors.PROMPT_LEN.value, device_errors.decode_error_flags(int(flags))
        outs.append(out)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    assert_matches(outs[0][step.beam_width:], ref[step.beam_width:], f"prompt_len {prompt_len}, request 1")


@pytest.mark.parametrize("config", [None, TILINGS[0][1], dict(TILINGS)["tail_on_cores"]],
                         ids=["default_one_block", "beam_blocks_tail2", "tail_on_cores"])
@pytest.mark.parametrize("name,change,bits", CASCADE_BAD_VALUES, ids=[c[0] for c in CASCADE_BAD_VALUES])
def test_cascade_reports_what_it_masks(name, change, bits, config, device):
    """Without check mode a bad page, length or indirection entry is masked, never dereferenced, and
    its kind is ORed into the error flag on the device (exactly its bits: valid input raises none,
    ``run_cascade`` checks that at every step)."""
    sim = make_sim(device, prompts=[20, 7], beams=18, hq=6, hkv=2, d=64, seed=3)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    args = dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache,
                prompt_page_table=prompt_table(sim, step), beam_page_table=step.beam_page_table,
                kv_lens=step.kv_lens, prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection,
                beam_width=step.beam_width, out=torch.full_like(step.q, float("nan")))
    if change is None:  # row 5's page for this step's token: none
        table = step.beam_page_table.clone()
        table[5, int(step.kv_lens[5] - 1) // sim.page_size] = -1
        args["beam_page_table"] = table
    else:
        args.update(change(args))
    flags = device_errors.new_error_flags(device)
    beam_cascade_attention(**args, kv_layout=sim.kv_layout, launch_config=config, error_flags=flags)
    assert not torch.isnan(args["out"]).any()
    assert int(flags) & bits == bits, (name, device_errors.decode_error_flags(int(flags)))
    if name not in ("tail_page_outside_pool", "write_page_outside_pool"):  # (a page shared with other beams)
        assert int(flags) == bits, (name, device_errors.decode_error_flags(int(flags)))


@pytest.mark.parametrize("config", [None, TILINGS[0][1], dict(TILINGS)["tail_on_cores"]],
                         ids=["default_one_block", "beam_blocks_tail2", "tail_on_cores"])
@pytest.mark.parametrize("name,bits", [
    ("len_differs", device_errors.BEAM_KV_LEN.value),
    ("on_beam0_write_page", device_errors.SHARED_WRITE_PAGE.value | device_errors.HELD_WRITE_PAGE.value),
    ("prompt_table_of_another_batch", device_errors.PLAN_PAGE.value),
])
def test_cascade_reports_rows_that_disagree(name, bits, config, device):
    """Request 1's last beam (17 of 18: in the 16-beam tiling, the second beam block) one position behind beam 0, or
    writing into beam 0's copy of the prompt's partly filled page; or a prompt table whose last page of request
    0 is not beam 0's: served as given, raising nothing in the kernel; the step's page-table audit (against the
    prompt table's digest) reports exactly its bits, and the flag changes nothing computed or written (but the slot
    two rows write, whose writes race element by element on a GPU, flag or not)."""
    results = []
    for flags in (None, device_errors.new_error_flags(device)):
        sim = make_sim(device, prompts=[20, 7], beams=18, hq=6, hkv=2, d=64, seed=3)
        for _ in range(3):
            sim.begin_step()
            sim.end_step()
        step = sim.begin_step()
        W, i = step.beam_width, 2 * step.beam_width - 1
        kv_lens, table, prompts = step.kv_lens.clone(), step.beam_page_table.clone(), prompt_table(sim, step)
        if name == "len_differs":
            kv_lens[i] -= 1
        elif name == "prompt_table_of_another_batch":
            last = (int(step.prompt_lens[0]) - 1) // sim.page_size
            prompts[0, last] = prompts[1, 0]  # another request's page, inside the pool
        else:
            col = int(kv_lens[W] - 1) // sim.page_size
            assert col == 0 and int(step.prompt_lens[W]) < sim.page_size  # (7 prompt tokens of 16, 3 generated)
            table[i, col] = table[W, col]
        out = torch.full_like(step.q, float("nan"))
        beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, prompts, table, kv_lens,
                               step.prompt_lens, step.cache_indirection, W, out, kv_layout=sim.kv_layout,
                               launch_config=config, error_flags=flags)
        results.append((out, sim.kv_cache))
    assert not torch.isnan(results[0][0]).any()
    assert int(flags) == 0, (name, device_errors.decode_error_flags(int(flags)))
    n_cols = -(-step.prompt_lens[::W].long().cpu() // sim.page_size)
    digest = device_errors.prompt_pages_digest_torch(prompts.long().cpu(), n_cols)
    audited = audit_word(step, table, kv_lens, plan_digest=digest)
    assert audited == bits, (name, device_errors.decode_error_flags(audited))
    assert torch.equal(results[0][0], results[1][0])
    if name == "on_beam0_write_page":  # rows W and i both write this step's slot of beam 0's page
        page, slot = int(table[W, col]), int(kv_lens[W] - 1) % sim.page_size
        assert_same_pools_but_one_raced_slot(sim, [r[1] for r in results], page, slot, step.new_k, step.new_v,
                                             writers=(W, i))
    else:
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("config", [None, TILINGS[0][1], dict(TILINGS)["tail_on_cores"]],
                         ids=["default_one_block", "beam_blocks_tail2", "tail_on_cores"])
@pytest.mark.parametrize("case", ["two_beams_share", "on_full_prompt_page"])
def test_cascade_reports_write_pages_held_elsewhere_in_the_request(case, config, device):
    """Request 0's beams 1 and 17 (two beam blocks in the 16-beam tiling) given one write page, or beam 5's write
    slot pointed at the full prompt page of column 0: nothing raised by the kernel, exactly ``HELD_WRITE_PAGE`` by
    the step's audit, and the flag changes nothing written but the slot two rows write. (Beam 5 overwrites a
    prompt token that other programs read in the same launch, a race on a GPU: its outputs are not compared.)"""
    results = []
    for flags in (None, device_errors.new_error_flags(device)):
        sim, step = step_after(dict(prompts=[20, 7], beams=18, hq=6, hkv=2, d=64, seed=3), 3)
        table = step.beam_page_table.clone()
        col = int(step.kv_lens[0] - 1) // sim.page_size
        assert col == 1 and int(step.prompt_lens[0]) == 20  # (the partly filled page: 4 prompt tokens of 16)
        if case == "two_beams_share":
            table[17, col] = table[1, col]
        else:
            table[5, col] = table[0, 0]
        out = torch.full_like(step.q, float("nan"))
        beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, prompt_table(sim, step), table,
                               step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width, out,
                               kv_layout=sim.kv_layout, launch_config=config, error_flags=flags)
        results.append((out, sim.kv_cache))
    assert not torch.isnan(results[1][0]).any()
    assert int(flags) == 0, device_errors.decode_error_flags(int(flags))
    audited = audit_word(step, table)
    assert audited == device_errors.HELD_WRITE_PAGE.value, device_errors.decode_error_flags(audited)
    if case == "two_beams_share":  # rows 1 and 17 both write this step's slot of beam 1's page
        assert torch.equal(results[0][0], results[1][0])
        page, slot = int(table[1, col]), int(step.kv_lens[1] - 1) % sim.page_size
        assert_same_pools_but_one_raced_slot(sim, [r[1] for r in results], page, slot, step.new_k, step.new_v,
                                             writers=(1, 17))
    else:
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("config", [None, TILINGS[0][1], dict(TILINGS)["tail_on_cores"]],
                         ids=["default_one_block", "beam_blocks_tail2", "tail_on_cores"])
def test_cascade_dummy_rows_raise_no_error_bit(config, device):
    """A request of TensorRT-LLM's padding rows (kv_len 1, planned with a one-token prompt) next to
    real ones: no bit (``device_errors.kv_len_bad``)."""
    sim = make_sim(device, prompts=[20, 7], beams=18, hq=6, hkv=2, d=64, seed=3)
    sim.begin_step()
    sim.end_step()
    step = sim.begin_step()
    W = step.beam_width
    kv_lens, prompt_lens = step.kv_lens.clone(), step.prompt_lens.clone()
    kv_lens[W:2 * W], prompt_lens[W:2 * W] = 1, 1
    flags = device_errors.new_error_flags(device)
    beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, prompt_table(sim, step), step.beam_page_table,
                           kv_lens, prompt_lens, step.cache_indirection, W, torch.empty_like(step.q),
                           kv_layout=sim.kv_layout, launch_config=config, error_flags=flags)
    assert int(flags) == 0, device_errors.decode_error_flags(int(flags))


def test_cascade_write_kv_false_leaves_the_pool_untouched(device):
    sim = make_sim(device, prompts=[6, 21], beams=3, hq=4, hkv=2, d=64, seed=5)
    sim.begin_step()
    sim.end_step()
    step = sim.begin_step()
    out = run_cascade(sim, step, write_kv=False)  # run_cascade asserts the pool equals its snapshot
    assert_matches(out, oracle(sim, step), "write_kv=False")


def test_cascade_detects_a_wrong_beam(device):
    """The comparison is tight enough: reading another beam's tail fails it."""
    sim = make_sim(device, prompts=[5, 9], beams=3, hq=4, hkv=2, d=64, seed=7)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    ref = oracle(sim, step)
    snapshot = sim.kv_cache.clone()
    assert_matches(run_cascade(sim, step), ref, "correct indirection")
    sim.kv_cache.copy_(snapshot)
    step.cache_indirection = (step.cache_indirection + 1) % step.beam_width
    wrong = run_cascade(sim, step)
    with pytest.raises(AssertionError):
        assert_matches(wrong, ref, "shifted indirection")


# (layout, simulator kwargs, launch config, softmax scale)
_FIVE_BEAMS, _FIVE_BEAMS_TILE = {"beams": 5, "hq": 6, "hkv": 3}, cascade_launch_config(5, 2, 64)
PREFIX_STAGE_CASES = [
    ("HND", _FIVE_BEAMS, _FIVE_BEAMS_TILE, None),
    ("NHD", _FIVE_BEAMS, dataclasses.replace(_FIVE_BEAMS_TILE, heads_per_program=2), 0.3),
    ("HND", _FIVE_BEAMS, dataclasses.replace(_FIVE_BEAMS_TILE, heads_per_program=4), None),
    # GQA 4's 32-beam tile at head 64 (the default where many programs run): 18 beams, 2 KV heads, 128 rows a tile.
    ("HND", {"beams": 18, "hq": 8, "hkv": 2}, cascade_launch_config(30, 4, 64, None, 64, 8, 132), None),
]


@pytest.mark.parametrize("layout,sim_kw,config,sm_scale", PREFIX_STAGE_CASES,
                         ids=["one_head", "two_heads_nhd_scaled", "four_heads", "wide_group_head_64"])
def test_prefix_stage_matches_reference(layout, sim_kw, config, sm_scale, device):
    """The prefix stage alone: output and base-2 LSE of every row against the prefix oracle, with 1, 2
    and 4 KV heads per program over Hkv = 3 (the last program's spare heads repeat head 2), at the
    default softmax scale and another one (the kernel applies it in the exponent), and on GQA 4's
    32-beam tile at head 64."""
    sim = make_sim(device, prompts=[1, 16, 50], d=64, layout=layout, seed=9, **sim_kw)
    step = sim.begin_step()
    want_o, want_lse = reference_prefix_attention(
        step.q, sim.kv_cache, step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
        step.beam_width, kv_layout=layout, sm_scale=sm_scale,
    )
    out = torch.full_like(step.q, float("nan"))
    lse = torch.full((step.num_rows, step.q.shape[1]), float("nan"), device=step.q.device)
    before = sim.kv_cache.clone()
    beam_prefix_attention(step.q, sim.kv_cache, prompt_table(sim, step), step.prompt_lens_per_request,
                          step.beam_width, out, lse, sm_scale=sm_scale, kv_layout=layout, validate_indices=True,
                          launch_config=config)
    assert torch.equal(sim.kv_cache, before), "the prefix stage must not write the pool"
    assert_matches(out, want_o, "prefix output")
    assert not torch.isnan(lse).any(), "NaN left in lse"
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------------------------
# refusals


def _one_step(device):
    sim = make_sim(device, prompts=[5, 9], beams=2, hq=4, hkv=2, d=64, seed=1)
    return sim, sim.begin_step()


def test_refuses_shapes_it_does_not_tile(device):
    assert cascade_supported(2, 128) == (True, "")
    ok, reason = cascade_supported(16, 128)
    assert not ok and "GQA group 16" in reason
    ok, reason = cascade_supported(2, 96)
    assert not ok and "head_dim=96" in reason
    sim, step = _one_step(device)
    q = step.q[:, :, :32].contiguous()
    with pytest.raises(KernelInputError, match="head_dim=32"):
        beam_cascade_attention(
            q, step.new_k[:, :, :32].contiguous(), step.new_v[:, :, :32].contiguous(),
            sim.kv_cache[..., :32], prompt_table(sim, step), step.beam_page_table, step.kv_lens, step.prompt_lens,
            step.cache_indirection, step.beam_width, torch.empty_like(q), kv_layout=sim.kv_layout,
        )


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(prompt_page_table=a["prompt_page_table"].long()), "prompt_page_table has dtype int64"),
    (lambda a: a.update(prompt_page_table=a["prompt_page_table"][:1]), "R=2 requests"),
    (lambda a: a.update(launch_config=CascadeLaunchConfig(4, 2)), "= 8 query rows and block_n=64; they must be >= 16"),
    (lambda a: a.update(launch_config=CascadeLaunchConfig(16, 1)), "group_pad=1 is smaller"),
    (lambda a: a.update(launch_config=CascadeLaunchConfig(16, 2, tail_block=1)), "16 tail key columns"),
    (lambda a: a.update(launch_config=CascadeLaunchConfig(16, 2, max_registers=32)), r"max_registers=32 .* \[64, 255\]"),
    (lambda a: a.update(launch_config=CascadeLaunchConfig(16, 2, prompt_stages=0)), r"prompt_stages=0 .* \[1, 4\]"),
    (lambda a: a.update(beam_width=3), "not a multiple of beam_width=3"),
    (lambda a: a.update(sm_scale=-1.0), "sm_scale=-1.0 must be a finite positive"),
    (lambda a: a.update(sm_scale=torch.tensor(0.125)), "sm_scale is a tensor"),
    (lambda a: a.update(out_over_index("prompt_lens", a)), "out overlaps prompt_lens"),
    (lambda a: a.update(out_over_index("cache_indirection", a)), "out overlaps cache_indirection"),
    (lambda a: a.update(error_flags=a["out"].view(torch.int32).view(-1)[:1]), "out overlaps error_flags in memory"),
    (lambda a: a.update(kv_lens=a["kv_cache"].view(-1).view(torch.int32)[: a["kv_lens"].numel()]),
     "kv_cache overlaps kv_lens in memory"),
])
def test_refuses_bad_arguments(mutate, match, device):
    sim, step = _one_step(device)
    args = dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache,
                prompt_page_table=prompt_table(sim, step), beam_page_table=step.beam_page_table,
                kv_lens=step.kv_lens, prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection,
                beam_width=step.beam_width, out=torch.empty_like(step.q), kv_layout=sim.kv_layout)
    mutate(args)
    with pytest.raises(KernelInputError, match=match):
        beam_cascade_attention(**args)


def test_prefix_stage_refuses_a_non_positive_scale(device):
    sim, step = _one_step(device)
    lse = torch.empty(step.num_rows, step.q.shape[1], device=step.q.device)
    with pytest.raises(KernelInputError, match=r"sm_scale=0.0 must be a finite positive"):
        beam_prefix_attention(step.q, sim.kv_cache, prompt_table(sim, step), step.prompt_lens_per_request,
                              step.beam_width, torch.empty_like(step.q), lse, sm_scale=0.0, kv_layout=sim.kv_layout)


def test_check_mode_names_a_prompt_page_outside_the_pool(device):
    sim, step = _one_step(device)
    table = prompt_table(sim, step)
    table[1, 0] = step.num_pages + 3
    with pytest.raises(KernelInputError, match=r"prompt_page_table\[1, 0\]=.* outside the pool"):
        beam_cascade_attention(
            step.q, step.new_k, step.new_v, sim.kv_cache, table, step.beam_page_table, step.kv_lens,
            step.prompt_lens, step.cache_indirection, step.beam_width, torch.empty_like(step.q),
            kv_layout=sim.kv_layout, validate_indices=True,
        )


def test_default_config_fits_the_tile_limits():
    for w, g, d in [(30, 2, 128), (30, 4, 128), (14, 2, 128), (96, 2, 128), (256, 8, 128), (4, 1, 64), (3, 2, 128),
                    (4, 4, 128), (8, 8, 128), (1, 8, 64), (7, 3, 64)]:
        for capacity in (None, 128, 4096):
            cfg = cascade_launch_config(w, g, d, capacity)
            assert cfg.block_m >= MIN_BLOCK_M and cfg.group_pad >= g and cfg.block_m <= 128
            assert cfg.beams_per_program >= min(16, w)
            assert cfg.tail_on_cores or cfg.tail_block * cfg.beams_per_program >= 32
            assert not (cfg.tail_on_cores and cfg.prompt_first)
    # The prompt goes first only in 32-beam, 64-row tiles at D = 128 (where it was measured faster),
    # at any prompt table width (one 128-token block when the table holds no more).
    for capacity in (None, 160, 4096):
        cfg = cascade_launch_config(30, 2, 128, capacity)
        assert cfg.prompt_first and cfg.prompt_stages == 3 and cfg.block_n == 64
    one_block = cascade_launch_config(30, 2, 128, 128)
    assert one_block.prompt_first and one_block.block_n == 128 and one_block.num_stages == 1
    # 16-beam tiles at G = 2-4 and D = 128 attend the tail on CUDA cores, capped at 128 registers at 32 rows.
    assert cascade_launch_config(14, 2, 128).tail_on_cores and cascade_launch_config(14, 2, 128).max_registers == 128
    assert cascade_launch_config(30, 4, 128).tail_on_cores and cascade_launch_config(30, 4, 128).max_registers is None
    assert not cascade_launch_config(4, 1, 64).tail_on_cores and not cascade_launch_config(96, 2, 128).tail_on_cores
    assert not cascade_supported(2, 256)[0]
    # At most 32 beams per tile: 64-beam tiles at G = 1 were 57% slower than FA4 + tail (round 8).
    assert cascade_launch_config(64, 1, 128).beams_per_program == 32


def test_every_default_tiling_passes_the_launchers_checks():
    """Over every beam width up to 40 (and 64, 96, 256), group 1-8, head 64 and 128, and batches from unknown to many
    programs, the default tiling (narrow or wide) is one the launcher accepts as an explicit ``launch_config``: at
    least 16 query rows, at most 128, 32 tail key columns where the tail is on tensor cores, one beam block a request
    up to 16 beams."""
    from triton_kernels.cascade import _resolve_config

    for d in (64, 128):
        for g in range(1, 9):
            for w in [*range(1, 41), 64, 96, 256]:
                for requests, kv_heads in ((None, 8), (4, 8), (20, 8), (56, 8), (64, 8), (300, 8), (40, 2)):
                    cfg = cascade_launch_config(w, g, d, None, requests, kv_heads, 132)
                    assert _resolve_config(cfg, w, g, d) is cfg
                    assert MIN_BLOCK_M <= cfg.block_m <= 128, (w, g, d, cfg)
                    assert w > 16 or cfg.beams_per_program >= w, (w, g, d, cfg)


@pytest.mark.parametrize("group, head_dim, beam_width, beams", [
    (2, 128, 3, 8), (2, 128, 8, 8), (2, 128, 9, None),  # 16 rows of 8 beams up to 8 beams
    (3, 128, 3, 4), (4, 128, 4, 4), (4, 128, 5, None),  # 16 rows of 4 beams up to 4 (8 beams were not faster)
    (5, 128, 3, 8), (8, 128, 8, 8), (8, 128, 9, None),  # 64 rows of 8 beams, 4 warps, 64-token blocks
    (1, 128, 3, None), (1, 64, 2, None),                # G = 1: 16 beams are the fewest rows a tile takes
    (2, 64, 5, 8), (4, 64, 4, 4), (8, 64, 3, 4), (6, 64, 7, 8),
    (4, 64, 5, None), (3, 64, 8, None),  # G = 3-4 at head 64: the 16-beam tile's 8-position tail blocks were faster
])
def test_narrow_widths_take_tiles_of_fewer_beams(group, head_dim, beam_width, beams):
    """A width the narrow table lists takes the wide tiling with that many beams a program (one block still holds the
    request's beams), a tail key block of 32 columns or more and 4 warps, and at head 128 and G = 5-8 64-token prompt
    blocks (1.0-2.1x faster than 16 beams on the H200, ``tune_cascade_narrow*_round56.json``); any other width keeps
    the wide tiling."""
    assert narrow_tile_beams(beam_width, group, head_dim) == beams
    wide = wide_launch_config(beam_width, group, head_dim)
    cfg = cascade_launch_config(beam_width, group, head_dim)
    assert wide.beams_per_program >= 16
    if beams is None:
        assert cfg == wide
        return
    assert cfg.beams_per_program == beams >= beam_width and cfg.block_m >= MIN_BLOCK_M and cfg.num_warps == 4
    assert cfg.tail_on_cores or cfg.tail_block * beams >= 32
    block_n = 64 if (head_dim, wide.group_pad) == (128, 8) else wide.block_n
    assert cfg == dataclasses.replace(wide, beams_per_program=beams, tail_block=cfg.tail_block, num_warps=4,
                                      block_n=block_n), (cfg, wide)


@pytest.mark.parametrize("num_requests, num_kv_heads, num_sms, beams", [
    (20, 8, 132, 4),     # 160 programs: one wave of either tile
    (49, 8, 132, 4),     # 392: one wave of 4-beam programs (three a multiprocessor), two of 16-beam ones (two)
    (50, 8, 132, 16),    # 400: two waves of either, the narrow tile's second nearly empty
    (112, 4, 132, 16),   # 448 (measured: 218 against 197-198 us at 3,000 tokens)
    (66, 8, 132, 16),    # 528: two full waves of 16-beam programs
    (67, 8, 132, 4),     # 536: three waves of 16-beam programs
    (56, 8, 264, 4),     # the same batch on a GPU of twice the multiprocessors: one narrow wave
    (None, 8, 132, 4),   # batch unknown
])
def test_group_4_narrow_tile_keeps_16_beams_where_both_run_two_waves(num_requests, num_kv_heads, num_sms, beams):
    """3 beams at G = 4, head 128 take the 4-beam tile save where it would run two waves as the 16-beam tile does (its
    second at most a third full): there it was 10% slower at 3,000 tokens on the H200 (round 56)."""
    cfg = cascade_launch_config(3, 4, 128, None, num_requests, num_kv_heads, num_sms)
    assert cfg.beams_per_program == beams, cfg
    want = cascade_launch_config(3, 4, 128) if beams == 4 else wide_launch_config(3, 4, 128)
    assert cfg == want


@pytest.mark.parametrize("beam_width, num_requests, num_kv_heads, num_sms, registers", [
    (5, 40, 8, 132, GROUP_2_ROOMY_REGISTERS),   # 320 programs of 8 beams: one wave at three a multiprocessor
    (5, 49, 8, 132, GROUP_2_ROOMY_REGISTERS),   # 392
    (5, 50, 8, 132, GROUP_2_TIGHT_REGISTERS),   # 400: a second wave at three; four fit them
    (5, 64, 8, 132, GROUP_2_TIGHT_REGISTERS),
    (12, 96, 8, 132, GROUP_2_ROOMY_REGISTERS),  # 768 of 16 beams: two waves either way (measured 1.14-1.16x faster)
    (16, 64, 8, 132, GROUP_2_TIGHT_REGISTERS),  # 512: two waves at three, one at four (measured 0.80x with 168)
    (14, 128, 8, 132, GROUP_2_TIGHT_REGISTERS),  # 1,024: three waves against two
    (9, 8, 8, 132, GROUP_2_ROOMY_REGISTERS),    # 64: one wave
    (16, 64, 8, 264, GROUP_2_ROOMY_REGISTERS),  # 512 on a GPU of twice the multiprocessors: one wave either way
    (5, None, 8, 132, GROUP_2_TIGHT_REGISTERS),   # batch unknown
    (12, None, 8, 132, GROUP_2_TIGHT_REGISTERS),
])
def test_group_2_tiles_take_registers_by_waves(beam_width, num_requests, num_kv_heads, num_sms, registers):
    """G = 2's 8- and 16-beam tiles at head 128 lift the 128-register cap to 168 (6 bytes of spill instead of 18-34,
    three programs a multiprocessor instead of four) where the launch runs as many waves either way: 3-16% faster
    there, 8-25% slower where it added a wave (rounds 56-57). Nothing else of the tiling moves."""
    cfg = cascade_launch_config(beam_width, 2, 128, None, num_requests, num_kv_heads, num_sms)
    assert cfg.max_registers == registers, cfg
    assert cfg.beams_per_program == (8 if beam_width <= 8 else 16), cfg
    assert dataclasses.replace(cfg, max_registers=GROUP_2_TIGHT_REGISTERS) == cascade_launch_config(beam_width, 2, 128)


@pytest.mark.parametrize("group, beam_width, num_requests, tail_block", [
    (4, 16, 48, 8),      # the 16-beam tile: 8-position tail blocks
    (3, 12, 64, 8),
    (4, 6, 48, 8),       # 5-8 beams take it too (no narrow tile there at head 64)
    (4, 30, 16, 8),      # 30 beams in two 16-beam blocks (128 programs of 32 beams are too few)
    (4, 16, None, 8),    # batch unknown
    (4, 30, 64, 4),      # the 32-beam tile keeps 4 (as fast with 8)
    (4, 3, 48, 8),       # the 4-beam narrow tile: 32 columns of 8 positions
    (8, 16, 48, 4),      # G = 8's 128-row tile keeps 4
    (2, 16, 48, 4),      # and G = 2's 32-row one
])
def test_group_4_head_64_tail_block_by_tile(group, beam_width, num_requests, tail_block):
    """GQA 3-4 at head 64 run the tail in 8-position key blocks on the 16-beam tile (1.02-1.48x faster than 4 at
    4-token tails, 1.3-2.2x at 32 on the H200, round 57); other tiles keep theirs."""
    cfg = cascade_launch_config(beam_width, group, 64, None, num_requests, 8, 132)
    assert cfg.tail_block == tail_block, cfg


@pytest.mark.parametrize("group, beam_width, num_requests, num_kv_heads, num_sms, warps", [
    (8, 30, 4, 8, 132, 8),    # 64 programs: each has a multiprocessor, 8 warps finish its rows sooner
    (8, 12, 16, 8, 132, 8),   # 128 programs
    (8, 12, 17, 8, 132, 4),   # 136 programs: more than the multiprocessors, 4 warps fit two a multiprocessor
    (8, 30, 16, 8, 132, 4),   # 256
    (5, 16, 16, 8, 132, 8),   # G = 5 pads to the same 128-row tile
    (8, 30, 16, 8, 264, 8),   # a GPU with more multiprocessors
    (8, 30, None, 8, 132, 4),  # requests unknown: judged as many
    (4, 30, 4, 8, 132, 4),    # 64-row tiles keep 4 warps at any count
])
def test_group_8_head_64_tile_takes_warps_by_programs(group, beam_width, num_requests, num_kv_heads, num_sms, warps):
    """The 128-row tile at head 64 runs 8 warps while every program has a multiprocessor of its own and 4 above
    (two programs a multiprocessor; ``docs/rounds.md``, "The forty-fifth round"); nothing else of the tiling moves."""
    cfg = cascade_launch_config(beam_width, group, 64, None, num_requests, num_kv_heads, num_sms)
    assert cfg.num_warps == warps, cfg
    assert dataclasses.replace(cfg, num_warps=4) == dataclasses.replace(cascade_launch_config(beam_width, group, 64),
                                                                        num_warps=4)


@pytest.mark.parametrize("group, beam_width, num_requests, choice", [
    (4, 30, 64, "wide"),       # 512 programs of 32 beams: the prompt read once a request and KV head, not twice
    (3, 30, 64, "wide"),       # G = 3 pads to the same rows
    (4, 64, 16, "wide"),       # two 32-beam blocks, 256 programs
    (4, 96, 8, "wide"),        # 192 programs, the fewest measured
    (4, 32, 50, "wide"),       # 400 programs: the second of two waves 0.52 full
    (4, 32, 70, "wide"),       # 560: a third wave 0.12 full (the tiles within 1% there; past two waves 32 beams)
    (4, 32, 66, "wide"),       # 528: two full waves
    (4, 32, 34, "half_wave"),  # 272: the second wave 0.03 full
    (3, 64, 24, "half_wave"),  # 384: 0.45 full
    (4, 48, 64, None),         # 32-beam blocks pad 16 beams a request, 16-beam ones none
    (4, 14, 64, None),         # one 16-beam block holds the request
    (4, 30, 16, None),         # 128 programs of 32 beams, not more than the multiprocessors
    (4, 30, None, None),       # batch unknown: the tile the auto rule counts
])
def test_group_4_head_64_widens_its_tile_where_it_pads_no_more(group, beam_width, num_requests, choice):
    """GQA 3-4 at head 64 takes 32-beam tiles (128 rows, 4 warps, no shared-ancestry path) where the width fills them
    as well as 16-beam ones, more programs than multiprocessors remain (8-18% faster on the H200; ``docs/rounds.md``,
    "The forty-sixth round") and the launch does not run two waves, the second at most half full ("half_wave":
    16-beam launches were 4-11% faster there, "The forty-ninth round"); elsewhere, and at other groups and heads, the tiling does not move."""
    assert wide_group_head_64_tile_choice(beam_width, group, 64, num_requests, 8, 132) == choice
    cfg = cascade_launch_config(beam_width, group, 64, None, num_requests, 8, 132)
    unknown = cascade_launch_config(beam_width, group, 64)
    if choice == "wide":
        assert (cfg.beams_per_program, cfg.block_m, cfg.num_warps, cfg.block_n, cfg.num_stages) == (32, 128, 4, 128, 1)
        assert not cfg.shared_ancestry and cfg.tail_block == 4, cfg
        # ... and the 16-beam tile's 8-position tail blocks (round 57) go back to 4, measured as fast on 32 beams
        assert dataclasses.replace(cfg, beams_per_program=16, tail_block=8) == unknown, (cfg, unknown)
    else:
        assert cfg == unknown, cfg
    for g, d in ((2, 64), (8, 64), (4, 128)):  # other groups and heads keep their beams a tile
        assert wide_group_head_64_tile_choice(beam_width, g, d, num_requests, 8, 132) is None
        assert (cascade_launch_config(beam_width, g, d, None, num_requests, 8, 132).beams_per_program
                == cascade_launch_config(beam_width, g, d).beams_per_program)


def test_launches_pass_their_program_count_to_the_tiling(monkeypatch, device):
    """The whole step and the prompt pass hand the default tiling their requests, KV heads and the device's
    multiprocessors (the count that picks the warps of the head-64 128-row tile), read from the shapes."""
    from triton_kernels import cascade

    seen, real = [], cascade.cascade_launch_config
    monkeypatch.setattr(cascade, "cascade_launch_config", lambda *args: seen.append(args) or real(*args))
    sim, step = _one_step(device)  # 2 requests of 2 beams, 2 KV heads
    table = prompt_table(sim, step)
    beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, table, step.beam_page_table, step.kv_lens,
                           step.prompt_lens, step.cache_indirection, step.beam_width, torch.empty_like(step.q),
                           kv_layout=sim.kv_layout)
    lse = torch.empty(step.q.shape[:2], dtype=torch.float32, device=step.q.device)
    beam_prefix_attention(step.q, sim.kv_cache, table, step.prompt_lens[:: step.beam_width].contiguous(),
                          step.beam_width, torch.empty_like(step.q), lse, kv_layout=sim.kv_layout)
    sms = cascade.launch_multiprocessors(step.q.device)
    assert [args[4:] for args in seen] == [(2, 2, sms, None)] * 2, seen  # and no tail bound


@pytest.mark.parametrize("group, head_dim, beam_width, kept", [
    (2, 64, 30, False),   # head 64: 1-10% a short-tail step with the path (forty-fifth round)
    (1, 64, 48, False),
    (8, 64, 30, False),   # 20-26% on the 4-warp tile
    (8, 128, 30, False),  # groups 5-8 at head 128: 3-17%
    (2, 128, 30, True),   # head 128 below G = 8: within 3% either way, preset A 2% slower without it
    (1, 128, 96, True),
])
def test_short_tails_leave_the_shared_ancestry_path_out(group, head_dim, beam_width, kept):
    """A launch whose tails are at most 16 generated tokens (15 cached positions; the path looks at 16 or more)
    never takes the shared-ancestry path, so the tilings that measured faster without it leave it out; one more
    token, or an unknown tail, keeps it. Nothing else of the tiling moves."""
    bound = SHARED_ANCESTRY_MIN_TAIL
    assert not shared_ancestry_reachable(bound) and shared_ancestry_reachable(bound + 1) and shared_ancestry_reachable(None)
    default = cascade_launch_config(beam_width, group, head_dim)
    short = cascade_launch_config(beam_width, group, head_dim, max_tail_len=bound)
    assert default.shared_ancestry and short.shared_ancestry == kept
    assert dataclasses.replace(short, shared_ancestry=True) == default
    assert cascade_launch_config(beam_width, group, head_dim, max_tail_len=bound + 1) == default


def test_a_tail_bound_is_used_and_checked(monkeypatch, device):
    """A step bounded by its tail runs the tiling without the shared-ancestry path and matches the oracle; check
    mode names a row whose tail exceeds the bound; a bound that is not an int >= 1 is refused."""
    from triton_kernels import cascade

    sim, step = step_after({"prompts": [5, 9], "beams": 3, "hq": 4, "hkv": 2, "d": 64, "seed": 4}, 3)  # tails of 4
    configs, launch = [], cascade._launch
    monkeypatch.setattr(cascade, "_launch", lambda grid, args, cfg, *rest, **kw: configs.append(cfg)
                        or launch(grid, args, cfg, *rest, **kw))
    expected = oracle(sim, step)
    out = run_cascade(sim, step, write_kv=False)  # the default tiling: tail unknown, the path in
    assert_matches(out, expected, "no bound")
    table = prompt_table(sim, step)

    def call(max_tail_len, validate=False):
        out = torch.full_like(step.q, float("nan"))
        beam_cascade_attention(step.q, step.new_k, step.new_v, sim.kv_cache, table, step.beam_page_table,
                               step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width, out,
                               kv_layout=sim.kv_layout, write_kv=False, validate_indices=validate,
                               max_tail_len=max_tail_len)
        return out

    assert_matches(call(4, validate=True), expected, "bound 4")
    assert [cfg.shared_ancestry for cfg in configs] == [True, False], configs
    with pytest.raises(KernelInputError, match=r"row \d+ has a tail of 4 generated tokens .* max_tail_len=3"):
        call(3, validate=True)
    for bad in (0, True, 2.5):
        with pytest.raises(KernelInputError, match=r"max_tail_len=.* must be None or an int >= 1"):
            call(bad)


# --------------------------------------------------------------------------------------------
# property: random shapes, layouts, encodings and tilings against the oracle

from hypothesis import HealthCheck, event, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402


@st.composite
def cascade_cases(draw):
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    group_pad = 1 << (group - 1).bit_length()
    beams_per_program = draw(st.sampled_from([b for b in (4, 8, 16, 32) if 16 <= b * group_pad <= 128]))
    tail_on_cores = draw(st.booleans())
    tail_block = draw(st.sampled_from([t for t in (1, 2, 4, 8) if tail_on_cores or t * beams_per_program >= 32]))
    config = CascadeLaunchConfig(beams_per_program, group_pad, block_n=draw(st.sampled_from([32, 64])),
                                 tail_block=tail_block, num_warps=4, num_stages=draw(st.integers(1, 2)),
                                 heads_per_program=draw(st.sampled_from([1, 2, 4])),
                                 prompt_first=not tail_on_cores and draw(st.booleans()),
                                 prompt_stages=draw(st.sampled_from([None, 2])), tail_on_cores=tail_on_cores)
    prompts = draw(st.lists(st.integers(1, 60), min_size=1, max_size=3))
    return dict(
        sim=dict(prompts=prompts, beams=draw(st.integers(1, 20)), hq=hkv * group, hkv=hkv,
                 d=draw(st.sampled_from([64, 128])),
                 pg=draw(st.sampled_from([4, 8, 16, 32, 64])), layout=draw(st.sampled_from(["HND", "NHD"])),
                 max_seq_len=72, seed=draw(st.integers(0, 2**16))),
        steps_before=draw(st.integers(0, 6)),
        divisor=draw(st.sampled_from([1, 4])),
        config=config,
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cascade_cases())
def test_cascade_property_matches_oracle(case):
    """Any beam width (including ones not a multiple of the tile), group, head size (64 or 128), page
    size, layout, page-table encoding, tail length and tiling (KV heads per program included, dividing Hkv or not): the step
    matches the oracle and writes exactly its K/V."""
    sim, step = step_after(case["sim"], case["steps_before"])
    pool = sim.kv_cache.clone()
    try:
        out = run_cascade(sim, step, divisor=case["divisor"], launch_config=case["config"])
    except OutOfResources:
        # A drawn tiling may need more shared memory than a GPU block may take (the interpreter has no such limit):
        # on the H100 a 64-row tile at head 128 with 8-position tail blocks needed 276 KB (round 77). Triton refuses
        # the launch before anything runs; no tiling the launcher picks is refused
        # (test_tail_merge_compile.py::test_every_cascade_tiling_the_launcher_picks_fits_sm90).
        assert torch.equal(sim.kv_cache, pool), "a refused launch changed the pool"
        event("tiling refused by Triton (OutOfResources)")  # counted by --hypothesis-show-statistics
        reject()
    assert_matches(out, oracle(sim, step), f"{case}")


@pytest.mark.gpu
def test_gpu_cuda_graph_finds_shared_runs_as_tails_grow():
    """One capture of the default tiling (32-beam tiles, prompts past 128 tokens), replayed over steps
    whose earlier tails grow 0 -> 44 while the beams' histories coalesce for the first 30 steps: the
    device-side test for a shared run flips on at 16 cached positions within the one graph, and every
    replay matches the oracle and writes exactly this step's K/V."""
    sim = make_sim("cuda", prompts=[150, 40, 260], beams=24, hq=4, hkv=2, d=128, pg=32, max_seq_len=320, seed=31)
    step = sim.begin_step()
    table = prompt_table(sim, step)
    assert cascade_launch_config(24, 2, 128, table.shape[1] * sim.page_size).shared_ancestry
    names = ("q", "new_k", "new_v", "beam_page_table", "kv_lens", "prompt_lens", "cache_indirection")
    static = {name: torch.empty_like(getattr(step, name)) for name in names}
    out = torch.empty_like(step.q)

    def load(step):
        for name in names:
            static[name].copy_(getattr(step, name))
        out.fill_(float("nan"))

    def launch():
        beam_cascade_attention(static["q"], static["new_k"], static["new_v"], sim.kv_cache, table,
                               static["beam_page_table"], static["kv_lens"], static["prompt_lens"],
                               static["cache_indirection"], 24, out)

    load(step)
    launch()  # compiles outside the capture (its K/V store is what the first replay stores again)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    runs = []
    for s in range(45):
        if s:
            step = sim.begin_step()
            load(step)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, oracle(sim, step), f"graph replay step {s}, tails {earlier_tail(step)}")
        assert torch.equal(sim.kv_cache[step.write_page, 0, :, step.write_slot], step.new_k), f"KV write, step {s}"
        runs.append(max(shared_runs(step, 32)))
        sim.end_step(write_kv=False, parents=np.zeros((3, 24), np.int64) if s < 30 else None)
    assert runs[20] >= 16 and runs[-1] >= 29, runs


# Argument checks a mutation-testing pass found unpinned (sixty-ninth round).


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(seed):
    """2 requests (prompts 5, 9) of 2 beams, Hq=4, Hkv=2, D=64, pages of 16 tokens, after 2 generated steps."""
    sim = BeamSearchCacheSimulator([5, 9], beam_width=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                   max_seq_len=64, kv_layout="HND", dtype=torch.bfloat16, device=DEVICE, seed=seed)
    for _ in range(2):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           step.beam_width, step.page_size, step.num_pages)
    return sim, step, torch.from_numpy(plan.page_table.copy()).to(DEVICE)


def _cascade_args(seed):
    sim, step, table = _step(seed)
    return dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache, prompt_page_table=table,
                beam_page_table=step.beam_page_table, kv_lens=step.kv_lens, prompt_lens=step.prompt_lens,
                cache_indirection=step.cache_indirection, beam_width=step.beam_width,
                out=torch.full_like(step.q, 7.0), kv_layout=sim.kv_layout)


def _refused(call, args, message, written=("out",)):
    before = {name: args[name].clone() for name in ("kv_cache",) + tuple(written)}
    with pytest.raises(KernelInputError, match=re.escape(message)):
        call(**args)
    for name, value in before.items():
        assert torch.equal(args[name], value), f"{name} changed"


def test_cascade_refuses_a_prompt_table_of_no_columns():
    """A prompt page table with a row per request but no column (every prompt would be read as empty, silently)
    is refused, naming its shape."""
    args = _cascade_args(seed=1)
    args["prompt_page_table"] = args["prompt_page_table"][:, :0]
    _refused(beam_cascade_attention, args, "prompt_page_table has shape (2, 0) but the batch has R=2 requests")


def test_check_mode_refuses_prompt_lengths_that_differ_within_a_request():
    """In check mode, beams of one request whose prompt lengths differ (the kernel reads beam 0's for all) are
    refused."""
    args = _cascade_args(seed=2)
    prompt_lens = args["prompt_lens"].clone()
    prompt_lens[1] -= 1  # request 0, beam 1; kv_len still past it
    args["prompt_lens"] = prompt_lens
    _refused(beam_cascade_attention, dict(args, validate_indices=True),
             "prompt_lens differ between the beams of one request")


def _prefix_args(seed):
    sim, step, table = _step(seed)
    rows, hq, _ = step.q.shape
    return dict(q=step.q, kv_cache=sim.kv_cache, prompt_page_table=table, prompt_lens=step.prompt_lens_per_request,
                beam_width=step.beam_width, out=torch.full_like(step.q, 7.0),
                lse=torch.full((rows, hq), 7.0, device=DEVICE), kv_layout=sim.kv_layout)


def test_prefix_stage_refuses_an_lse_of_another_dtype():
    """The prefix stage's LSE buffer must be float32: a bfloat16 one is refused, naming what it got."""
    args = _prefix_args(seed=3)
    args["lse"] = args["lse"].to(torch.bfloat16)
    _refused(beam_prefix_attention, args, "lse must be float32 [4, 4] (rows, heads), got torch.bfloat16",
             written=("out", "lse"))


@pytest.mark.parametrize("where", ["q", "kv_cache"])
def test_prefix_stage_refuses_an_lse_inside_an_input(where):
    """An LSE buffer whose bytes lie in q or in the pool (the stage would overwrite what it reads) is refused."""
    args = _prefix_args(seed=4)
    rows, hq, _ = args["q"].shape
    host = args[where]
    args["lse"] = host.reshape(-1)[: 2 * rows * hq].view(torch.float32).view(rows, hq)
    _refused(beam_prefix_attention, args, f"lse overlaps {where} in memory", written=("out", "q"))


def _expanded(x):
    """``x``'s first row repeated by a stride-0 view: every row is one memory."""
    return x[:1].expand_as(x)


@pytest.mark.parametrize("change,message", [
    (lambda a: {"out": _expanded(a["out"])}, "out of shape (4, 4, 64) with strides (0, 64, 1) has elements that overlap"),
    (lambda a: {"lse": _expanded(a["lse"])}, "lse of shape (4, 4) with strides (0, 1) has elements that overlap"),
    (lambda a: out_over_index("prompt_lens", a), "out overlaps prompt_lens in memory"),
    (lambda a: out_over_index("prompt_lens", a, written="lse"), "lse overlaps prompt_lens in memory"),
    (lambda a: {"kv_cache": a["kv_cache"][:0]}, "kv_cache has 0 pages of 16 tokens; both must be >= 1"),
    (lambda a: {"q": a["q"][:, :0], "out": a["out"][:, :0], "lse": a["lse"][:, :0]},
     "with Hq=0, D=64; both must be >= 1"),
], ids=["out_rows_one_memory", "lse_rows_one_memory", "out_over_prompt_lens", "lse_over_prompt_lens", "no_pages",
        "no_query_heads"])
def test_prefix_stage_refuses_outputs_that_overwrite_themselves_or_its_lengths(change, message):
    """The prefix stage's outputs are written row by row: rows that share memory (a stride-0 view) would all hold one
    row's result, and an output stored over the prompt lengths would change what later programs attend. Both are
    refused before launch, as the fused launchers refuse them."""
    args = _prefix_args(seed=6)
    args.update(change(args))
    _refused(beam_prefix_attention, args, message, written=("q",))


def test_launch_configuration_refuses_five_pipeline_stages():
    """num_stages past 4 is refused, naming the range."""
    args = _cascade_args(seed=5)
    args["launch_config"] = CascadeLaunchConfig(16, 2, num_stages=5)
    _refused(beam_cascade_attention, args, "launch_config.num_stages=5 must be an int in [1, 4]")

