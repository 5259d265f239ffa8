"""The fused tail merge (Triton kernel and torch path) against the float32 oracle.

Every step comes from :class:`BeamSearchCacheSimulator` (shuffled pages, random pool, random beam
reselection), the prefix state from ``reference_prefix_attention`` and the expected output from
``reference_beam_attention`` over each beam's whole gathered history. Outputs are NaN-poisoned
before the call, and the pool is compared with a snapshot afterwards: exactly the step's K/V at
``(write_page, write_slot)`` changed, nothing else. Multi-step runs call
``sim.end_step(write_kv=False)`` so later steps read the KV the implementation under test wrote.

Tolerance: outputs are bf16/fp16 of unit-variance data, so ``|out| < 4``; bf16 keeps 8 significant
bits, a rounding error of at most 2^-9 relative (< 0.008 absolute at 4) on top of float32
accumulation-order differences (~1e-6). ``atol = rtol = 2e-2`` covers that with margin, while a
wrong page, slot, beam or merge weight moves outputs by O(0.1-1) (see
``test_oracle_comparison_detects_a_wrong_beam``).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import functools

import math
import re

import pytest
import torch

from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.reference import (
    reference_beam_attention,
    reference_prefix_attention,
    reference_tail_attention,
)
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from triton_kernels import device_errors
from triton_kernels.tail_merge import _TOKENS_OUTER, _check_config, _register_cap, tail_launch_config
from triton_kernels import (
    TailLaunchConfig,
    TailMergeInputError,
    audit_page_table,
    audit_page_table_torch,
    beam_tail_attention_merge,
    beam_tail_attention_merge_torch,
    new_audit_workspace,
)

LN2 = math.log(2.0)
ATOL = RTOL = 2e-2

IMPLS = {"triton": beam_tail_attention_merge, "torch": beam_tail_attention_merge_torch}
impl_param = pytest.mark.parametrize("impl", sorted(IMPLS))


# --------------------------------------------------------------------------------------------
# helpers


def make_sim(device, *, prompts, beams, hq, hkv, d, pg=16, layout="HND", dtype=torch.bfloat16, max_seq_len=64, seed=0):
    return BeamSearchCacheSimulator(
        prompts, beam_width=beams, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=pg,
        max_seq_len=max_seq_len, kv_layout=layout, dtype=dtype, device=device, seed=seed,
    )


def prefix_state(sim, step, lse_layout="NH", lse_base="log2", prefix_dtype=torch.float32, empty=False):
    """Prefix (o, lse) in the layout/base a backend returns; ``empty``: lse = -inf, o = NaN."""
    o, lse = reference_prefix_attention(
        step.q, sim.kv_cache, step.prompt_page_indptr, step.prompt_page_indices,
        step.prompt_lens_per_request, step.beam_width, kv_layout=sim.kv_layout,
    )
    if empty:
        lse = torch.full_like(lse, float("-inf"))
        o = torch.full_like(o, float("nan"))
    if lse_base == "ln":
        lse = lse * LN2
    if lse_layout == "HN":
        lse = lse.t().contiguous()  # [heads, rows], FA4's layout
    return o.to(prefix_dtype), lse


def audit_word(step, beam_page_table=None, kv_lens=None, plan_digest=None, divisor=1, impl="triton"):
    """The page-table audit of a step, as the wrapper launches it once a step with the flag (``impl="torch"``: its
    torch twin): the flag word it raises. ``plan_digest``: the plan's (default: the plan of the step's prompt
    pages, ``StepPlan.prompt_pages_digest``); ``divisor``: the table's ``page_index_divisor``."""
    table = step.beam_page_table if beam_page_table is None else beam_page_table
    kv_lens = step.kv_lens if kv_lens is None else kv_lens
    if plan_digest is None:
        plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                               step.beam_width, step.page_size, step.num_pages)
        plan_digest = torch.from_numpy(plan.prompt_pages_digest.copy())
    dev = kv_lens.device
    flags = device_errors.new_error_flags(dev)
    args = (kv_lens, step.prompt_lens, table, step.beam_width, flags)
    sizes = dict(page_size=step.page_size, num_pages=step.num_pages, max_seq_len=step.cache_indirection.shape[2],
                 page_index_divisor=divisor, plan_digest=plan_digest.to(dev))
    if impl == "torch":
        audit_page_table_torch(*args, **sizes)
    else:
        audit_page_table(*args, new_audit_workspace(step.num_pages, dev), **sizes)
    return int(flags)


def expected_pool_after_write(sim, step, before):
    expected = before.clone()
    for i in range(step.num_rows):
        page, slot = int(step.write_page[i]), int(step.write_slot[i])
        if sim.kv_layout == "HND":
            expected[page, 0, :, slot] = step.new_k[i]
            expected[page, 1, :, slot] = step.new_v[i]
        else:
            expected[page, 0, slot] = step.new_k[i]
            expected[page, 1, slot] = step.new_v[i]
    return expected


def assert_same_pools_but_one_raced_slot(sim, pools, page, slot, new_k, new_v, writers):
    """Rows ``writers`` all wrote slot ``(page, slot)`` (a shared write page, served as given): on a GPU the
    writes race (per element: a program per KV head, lanes within one store), so the pools must agree
    everywhere else and each element of the slot must be one writer's."""
    def slot_of(pool):
        return (pool[page, :, :, slot] if sim.kv_layout == "HND" else pool[page, :, slot])  # [2, Hkv, D]
    written = torch.stack([torch.stack([new_k[w], new_v[w]]) for w in writers])  # [writers, 2, Hkv, D]
    masked = []
    for pool in pools:
        held = slot_of(pool)
        assert (written == held[None]).any(0).all(), f"slot {slot} of page {page} holds no writer's K/V (rows {writers})"
        pool = pool.clone()
        slot_of(pool).fill_(0)
        masked.append(pool)
    assert all(torch.equal(masked[0], other) for other in masked[1:])


def run_step(impl, sim, step, *, lse_layout="NH", lse_base="log2", divisor=1, empty_prefix=False,
             prefix_dtype=torch.float32, strided=False, write_kv=True, kv_cache=None, launch_config=None):
    """One call of ``impl`` on the step; returns ``out``. Checks the pool afterwards."""
    kv_cache = sim.kv_cache if kv_cache is None else kv_cache
    prefix_out, prefix_lse = prefix_state(sim, step, lse_layout, lse_base, prefix_dtype, empty_prefix)
    table = step.beam_page_table
    if divisor != 1:
        table = sim.block_offsets(table, divisor)[:, 0, :]  # strided K-field view
        assert table.stride(0) != table.shape[1]
    q, new_k, new_v = step.q, step.new_k, step.new_v
    out = torch.full_like(q, float("nan"))
    if strided:
        # q / new_k / new_v as views of one fused QKV buffer, out as a view of a wider buffer,
        # prefix_lse as a transposed view.
        rows, hq, d = q.shape
        hkv = new_k.shape[1]
        qkv = torch.empty(rows, hq + 2 * hkv, d, dtype=q.dtype, device=q.device)
        qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:] = q, new_k, new_v
        q, new_k, new_v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        out = torch.full((rows, hq + 3, d), float("nan"), dtype=q.dtype, device=q.device)[:, 2:2 + hq]
        lse_buf = torch.empty(prefix_lse.shape[1], prefix_lse.shape[0], device=q.device)
        lse_buf.copy_(prefix_lse.t())
        prefix_lse = lse_buf.t()
        assert not prefix_lse.is_contiguous()
    before = kv_cache.clone()
    flags = device_errors.new_error_flags(q.device)
    result = IMPLS[impl](
        q, new_k, new_v, kv_cache, table, step.kv_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width, prefix_out, prefix_lse, out, kv_layout=sim.kv_layout, page_index_divisor=divisor,
        prefix_lse_layout=lse_layout, prefix_lse_base=lse_base, write_kv=write_kv,
        validate_indices=(impl == "torch"), error_flags=flags,
        **({"launch_config": launch_config} if launch_config is not None else {}),
    )
    assert result is out
    assert int(flags) == 0, f"valid input raised {device_errors.decode_error_flags(int(flags))}"
    audited = audit_word(step, table, divisor=divisor, impl=impl)
    assert audited == 0, f"the audit of a valid step raised {device_errors.decode_error_flags(audited)}"
    want_pool = expected_pool_after_write(sim, step, before) if write_kv else before
    assert torch.equal(kv_cache, want_pool), "the pool differs from its snapshot plus this step's K/V"
    return out


def oracle(sim, step, tail_only=False):
    fn = reference_tail_attention if tail_only else reference_beam_attention
    res = fn(
        step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width, new_k=step.new_k, new_v=step.new_v, kv_layout=sim.kv_layout,
    )
    return res[0] if tail_only else res


def assert_matches(out, ref, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN left in out (an element was not written)"
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def earlier_tail(step):
    return (step.kv_lens - 1 - step.prompt_lens).tolist()


def step_after(sim_kw, steps_before):
    """A simulator on the test device (CUDA when present) run ``steps_before`` steps, and its next step."""
    sim = make_sim("cuda" if torch.cuda.is_available() else "cpu", **sim_kw)
    for _ in range(steps_before):
        sim.begin_step()
        sim.end_step()
    return sim, sim.begin_step()


# --------------------------------------------------------------------------------------------
# against the oracle, over simulated steps

# (name, simulator kwargs, call kwargs, steps, requests added at step -> prompts)
CASES = [
    # G=1, prompts that fill their last page exactly (16), of one token, and mid-page; tails of
    # 0..17 earlier tokens crossing page boundaries; one request joins late, so rows of one launch
    # have different tail lengths.
    ("g1_d64_hnd_nh_log2", dict(prompts=[16, 1, 7], beams=2, hq=2, hkv=2, d=64), dict(), 18, {3: [30]}),
    # G=2, head 128, NHD, block-offset page table (divisor 6), FA4 LSE ([heads, rows], ln).
    ("g2_d128_nhd_hn_ln_blockoffsets", dict(prompts=[5, 32], beams=3, hq=4, hkv=2, d=128, layout="NHD"),
     dict(lse_layout="HN", lse_base="ln", divisor=6), 5, {}),
    # G=3 (padded to 4), page size 32, strided q/new_k/new_v/out/prefix_lse views.
    ("g3_d64_hnd_pg32_strided", dict(prompts=[33, 2], beams=3, hq=6, hkv=2, d=64, pg=32),
     dict(strided=True, lse_layout="HN"), 5, {}),
    # G=8, one KV head, beam width 1 (plain greedy rows are legal rows).
    ("g8_d64_nhd_w1", dict(prompts=[9, 16], beams=1, hq=8, hkv=1, d=64, layout="NHD"),
     dict(lse_base="ln"), 4, {}),
]


@impl_param
@pytest.mark.parametrize("name,sim_kw,call_kw,steps,joins", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle_over_steps(impl, name, sim_kw, call_kw, steps, joins, device):
    sim = make_sim(device, **sim_kw)
    seen = set()
    for s in range(steps):
        if s in joins:
            sim.add_requests(joins[s])
        step = sim.begin_step()
        seen.update(earlier_tail(step))
        out = run_step(impl, sim, step, **call_kw)
        assert_matches(out, oracle(sim, step), f"{name} step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)  # the next steps read the K/V written by `impl`
    if steps >= 18:
        assert {0, 1, 3, 17} <= seen


@impl_param
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_empty_prefix_gives_tail_only_attention(impl, layout, device):
    sim = make_sim(device, prompts=[4, 17], beams=2, hq=6, hkv=2, d=64, layout=layout, seed=3)
    for s in range(4):
        step = sim.begin_step()
        out = run_step(impl, sim, step, empty_prefix=True, lse_layout="HN" if s % 2 else "NH")
        assert_matches(out, oracle(sim, step, tail_only=True), f"empty prefix, step {s}")
        sim.end_step(write_kv=False)


@impl_param
def test_write_kv_false_leaves_the_pool_untouched(impl, device):
    sim = make_sim(device, prompts=[6], beams=3, hq=4, hkv=2, d=64, seed=5)
    sim.begin_step()
    sim.end_step()
    step = sim.begin_step()
    out = run_step(impl, sim, step, write_kv=False)  # run_step asserts the pool equals its snapshot
    assert_matches(out, oracle(sim, step), "write_kv=False")


def test_oracle_comparison_detects_a_wrong_beam(device):
    """The tolerance is tight enough: reading another beam's tail fails the comparison."""
    sim = make_sim(device, prompts=[5, 9], beams=3, hq=4, hkv=2, d=64, seed=7)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    ref = oracle(sim, step)
    assert_matches(run_step("triton", sim, step), ref, "correct indirection")
    step.cache_indirection = (step.cache_indirection + 1) % step.beam_width
    wrong = run_step("triton", sim, step)
    with pytest.raises(AssertionError):
        assert_matches(wrong, ref, "shifted indirection")


def test_kernel_and_torch_path_agree(device):
    sim = make_sim(device, prompts=[3, 20, 1], beams=2, hq=8, hkv=2, d=64, seed=11)
    for _ in range(6):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    snapshot = sim.kv_cache.clone()
    a = run_step("triton", sim, step)
    sim.kv_cache.copy_(snapshot)
    b = run_step("torch", sim, step)
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=RTOL)


TILINGS = [
    # (id, config): index_block 0 is the tile-at-a-time index chain; index blocks smaller than the
    # tail make the outer index loop run several times, and block_t == index_block ends every
    # index block on a tile boundary.
    ("default", None),
    ("chain_one_head_block_t1", TailLaunchConfig(4, 1, 1, 1)),
    ("chain_heads_past_hkv_heads_outer", TailLaunchConfig(4, 4, 8, 2, tokens_outer=False)),
    ("chain_heads_past_hkv_tokens_outer", TailLaunchConfig(4, 4, 8, 2, tokens_outer=True)),
    ("chain_wide_group_pad", TailLaunchConfig(8, 2, 2, 4, tokens_outer=True)),
    ("index2_block_t1", TailLaunchConfig(4, 1, 1, 1, index_block=2)),
    ("index2_block_t2_heads_outer", TailLaunchConfig(4, 4, 2, 2, tokens_outer=False, index_block=2)),
    ("index4_block_t2_tokens_outer", TailLaunchConfig(8, 2, 2, 4, tokens_outer=True, index_block=4)),
    ("index16_block_t4", TailLaunchConfig(4, 2, 4, 4, index_block=16)),
    ("few_rows_index32_block_t4", TailLaunchConfig(4, 1, 4, 2, index_block=32)),
    ("index32_block_t1_heads_past_hkv", TailLaunchConfig(8, 2, 1, 2, tokens_outer=True, index_block=32)),
    ("grouped_one_head", TailLaunchConfig(4, 1, 1, 1, grouped=True)),
    ("grouped_heads_past_hkv", TailLaunchConfig(4, 4, 1, 2, grouped=True)),
    ("grouped_wide_group_pad", TailLaunchConfig(8, 2, 1, 4, grouped=True)),
]


@pytest.mark.parametrize("group,hkv,d,rows,expected", [
    # (G, Hkv, D, beam rows, (kv_heads_per_prog, block_t, num_warps, index_block, grouped))
    (2, 8, 128, 128, (2, 4, 2, 32, False)),  # few rows: 1,024 row-KV-heads
    (2, 8, 128, 129, (8, 1, 2, 0, True)),  # many: the grouped kernel
    (2, 8, 128, None, (8, 1, 2, 0, True)),  # rows not given: many
    (2, 8, 256, 64, (2, 4, 4, 32, False)),  # a larger tile takes 4 warps
    (4, 8, 128, 128, (1, 4, 2, 32, False)),
    (4, 8, 128, 1920, (1, 1, 1, 0, False)),  # B-4B
    (4, 8, 64, 16, (1, 1, 1, 0, False)),  # unmeasured (G = 4 at head 64): the default
    (8, 1, 128, 512, (1, 4, 4, 32, False)),  # MQA 8/1, few rows
    (8, 1, 128, 513, (1, 4, 2, 0, False)),  # G = 8 between the bounds
    (8, 4, 128, 384, (1, 1, 2, 0, False)),  # from 1,536 row-KV-heads
    (8, 1, 64, 512, (1, 4, 2, 32, False)),
    (8, 2, 64, 512, (1, 4, 2, 32, False)),  # G = 8 at head 64: few rows up to 1,024 row-KV-heads
    (7, 2, 64, 513, (2, 1, 2, 32, False)),  # and above: two heads and one token a 2-warp program (round 53)
    (8, 1, 64, 1025, (1, 1, 2, 32, False)),  # one KV head in all
    (7, 2, 64, None, (2, 1, 2, 32, False)),  # rows not given: many
    (16, 2, 128, 128, (1, 4, 4, 32, False)),  # G = 16, few rows: 256 row-KV-heads
    (16, 4, 128, 65, (1, 4, 2, 0, False)),  # G = 16 above: 4 tokens, 2 warps
    (12, 8, 128, None, (1, 4, 2, 0, False)),  # G = 12 pads to 16
    (32, 1, 128, 128, (1, 4, 8, 32, False)),  # G = 32, few rows: 8 warps
    (32, 1, 128, 129, (1, 4, 4, 0, False)),  # G = 32 above: 4 tokens, 4 warps
    (64, 1, 128, 128, (1, 1, 8, 32, False)),  # G = 64: 1 token, 8 warps, index blocks at few rows
    (48, 2, 128, 1920, (1, 1, 8, 0, False)),
    (16, 2, 64, 1920, (1, 1, 4, 0, False)),  # unmeasured (G = 16 at head 64): the previous default
    (64, 1, 64, 1920, (1, 2, 8, 0, False)),  # unmeasured (G = 64 at head 64): the previous default
    (1, 16, 128, 64, (1, 4, 1, 0, False)),  # MHA, few rows: 1,024 row-KV-heads, one head a program
    (1, 16, 128, 65, (2, 4, 1, 0, False)),  # MHA above: two heads a program
    (1, 1, 128, None, (1, 4, 1, 0, False)),  # one KV head in all
    (1, 16, 64, 1920, (16, 1, 4, 0, False)),  # unmeasured (G = 1 at head 64): the previous default
])
def test_default_tiling_by_rows(group, hkv, d, rows, expected):
    """The default tiling by beam rows (the H200 measurements in ``tail_launch_config``'s docstring)."""
    cfg = tail_launch_config(group, hkv, d, rows)
    assert (cfg.kv_heads_per_prog, cfg.block_t, cfg.num_warps, cfg.index_block, cfg.grouped) == expected
    _check_config(cfg, group)


@pytest.mark.parametrize("group,hkv,d,rows,caps", [
    # (tail alone, after the shared-run stage) x (error flag off, on); None: ptxas's own choice
    (4, 8, 128, 1920, ((64, 64), (63, 63))),     # B-4B: one warp, 16 elements a thread: capped
    (8, 8, 128, 1920, ((64, 64), (63, 63))),     # G = 8: two warps, 16 elements a thread: capped
    (1, 16, 128, 64, ((64, 64), (63, 63))),      # MHA, few rows: one head, 4 tokens, one warp: capped
    (1, 16, 128, 1920, ((80, 80), (80, 80))),  # MHA: two heads, 32 elements a thread
    (4, 8, 256, 1920, ((None, None), (None, None))),   # G = 4 at head 256: one warp, 32 elements a thread
    (8, 8, 128, 100, ((None, None), (None, None))),    # G = 8 under 1,536 row-KV-heads: 4 tokens
    (2, 4, 128, 1920, ((None, None), (None, None))),  # G = 2, 4 KV heads: the grouped kernel at one warp
    (2, 8, 128, 1, ((None, 255), (None, 255))),  # the few-rows tiling: lifted to 255 with the flag
    (16, 8, 128, 1920, ((None, None), (None, None))),  # G = 16: two warps, 32 elements a thread
    (8, 8, 256, 1920, ((None, None), (None, None))),  # G = 8 at head 256: four warps
])
def test_register_cap_of_the_default_tilings(group, hkv, d, rows, caps):
    """The ``maxnreg`` each default tiling passes to ptxas on CUDA, which the interpreter cannot see (the
    resource script compiles with the same function): ``[QH, D]`` tiles of one or two warps and at most 16
    elements a thread take 64 registers (63 after the stage, the faster of ptxas's schedules on the H200), MHA's
    one-warp tiles of 32 elements 80; other larger tiles and the grouped kernel's one-warp tiles are left to
    ptxas (capped they spill), the flag's two tiles of G = 16 and of G = 8 at head 256 too (uncapped they spill
    nothing on Triton 3.6 or 3.9 since the table checks left the tail kernels)."""
    cfg = tail_launch_config(group, hkv, d, rows)
    got = tuple(tuple(_register_cap(cfg, d, skip_shared, report_errors) for report_errors in (False, True))
                for skip_shared in (False, True))
    assert got == caps, (cfg, got)


def test_few_rows_default_over_several_index_blocks(device):
    """The few-rows default (index blocks of 32 positions, 4 tokens an iteration) over tails past one
    index block and a page boundary: 2 x 2 rows at G = 2, head 64, tails of 0-40 earlier tokens."""
    sim = make_sim(device, prompts=[5, 21], beams=2, hq=2, hkv=1, d=64, seed=21)
    assert tail_launch_config(2, 1, 64, 4).index_block == 32
    for s in range(41):
        step = sim.begin_step()
        if s in (0, 3, 31, 32, 33, 40):
            out = run_step("triton", sim, step)
            assert_matches(out, oracle(sim, step), f"step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=s not in (0, 3, 31, 32, 33, 40))  # the kernel wrote the checked steps' K/V


@pytest.mark.parametrize("hq,hkv,tiling_rows,block_t,index_block", [
    (24, 2, 2, 4, 32),  # G = 12 padded to 16, few rows: index blocks
    (24, 2, 200, 4, 0),  # the wide-group tiling (4 tokens, 2 warps)
    (32, 1, 3, 4, 32),  # G = 32, few rows (8 warps)
    (32, 1, 200, 4, 0),  # G = 32 (4 tokens, 4 warps)
    (40, 1, 3, 1, 32),  # G = 40 padded to 64, few rows
    (64, 1, 200, 1, 0),  # G = 64 (1 token, 8 warps)
])
def test_wide_group_default_tilings_agree_with_oracle(hq, hkv, tiling_rows, block_t, index_block, device):
    """The default tilings of groups of 9-64 query heads per KV head at head 128, chosen by the launch's
    rows: tails of 0-5 earlier tokens, one crossing a page boundary (prompt 14, page 16)."""
    sim = make_sim(device, prompts=[14, 30], beams=3, hq=hq, hkv=hkv, d=128, seed=hq + tiling_rows)
    config = tail_launch_config(hq // hkv, hkv, 128, tiling_rows)
    assert (config.block_t, config.index_block) == (block_t, index_block)
    for s in range(6):
        step = sim.begin_step()
        out = run_step("triton", sim, step, launch_config=config)
        assert_matches(out, oracle(sim, step), f"G = {hq // hkv}, step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)


@pytest.mark.parametrize("config", [t[1] for t in TILINGS], ids=[t[0] for t in TILINGS])
def test_tilings_agree_with_oracle(config, device):
    """Hkv = 3 (not a power of two) and G = 3: head blocks past Hkv and padded group slots are masked.

    Block-offset page table (divisor 6); tails of 0-8 earlier tokens, one crossing a page
    boundary (prompt 13, page 16); outputs NaN-poisoned and the pool checked by ``run_step``.
    """
    sim = make_sim(device, prompts=[13, 16], beams=2, hq=9, hkv=3, d=64, seed=13)
    for s in range(9):
        step = sim.begin_step()
        out = run_step("triton", sim, step, divisor=6, launch_config=config, lse_layout="HN" if s % 2 else "NH")
        assert_matches(out, oracle(sim, step), f"tiling {config}, step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)
    assert max(earlier_tail(step)) == 8


@pytest.mark.parametrize("config", [None, TailLaunchConfig(1, 2, 4, 1)], ids=["default", "two_heads_past_hkv"])
def test_mha_tilings_agree_with_oracle(config, device):
    """MHA at head 128 (Hkv = 3): the default at these few rows (one KV head, 4 tokens, one warp) and the
    many-rows tiling (two KV heads a program, so the second program's second head is past Hkv and masked);
    tails of 0-8 earlier tokens, in blocks of 4 with a partial one, crossing page boundaries (page 16)."""
    assert tail_launch_config(1, 3, 128, 6) == TailLaunchConfig(1, 1, 4, 1, _TOKENS_OUTER)
    sim = make_sim(device, prompts=[13, 30], beams=3, hq=3, hkv=3, d=128, seed=17)
    for s in range(9):
        step = sim.begin_step()
        out = run_step("triton", sim, step, launch_config=config, lse_layout="HN" if s % 2 else "NH")
        assert_matches(out, oracle(sim, step), f"MHA tiling {config}, step {s} tails {earlier_tail(step)}")
        sim.end_step(write_kv=False)
    assert max(earlier_tail(step)) == 8


# --------------------------------------------------------------------------------------------
# property: random shapes, encodings and tilings of both kernels against the oracle

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def tail_cases(draw):
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 6]))
    group_pad = 1 << (group - 1).bit_length()
    grouped = draw(st.booleans())
    block_t = 1 if grouped else draw(st.sampled_from([1, 2, 4]))
    config = TailLaunchConfig(group_pad, draw(st.sampled_from([1, 2, 4])), block_t, draw(st.sampled_from([1, 2])),
                              tokens_outer=draw(st.booleans()), grouped=grouped)
    return dict(
        sim=dict(prompts=draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)), beams=draw(st.integers(1, 4)),
                 hq=hkv * group, hkv=hkv, d=draw(st.sampled_from([32, 64])), pg=draw(st.sampled_from([4, 8, 16])),
                 layout=draw(st.sampled_from(["HND", "NHD"])), max_seq_len=56, seed=draw(st.integers(0, 2**16))),
        steps_before=draw(st.integers(0, 8)),
        divisor=draw(st.sampled_from([1, 6])),
        lse_layout=draw(st.sampled_from(["NH", "HN"])),
        config=config,
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tail_cases())
def test_tail_property_matches_oracle(case):
    """Either tile (grouped or ``[QH, D]``), any KV heads per program (dividing Hkv or not), warps,
    group (padded or not), page size, layout, page-table encoding, LSE layout and tail length: the
    step matches the oracle and writes exactly its K/V (``run_step`` checks the pool)."""
    sim, step = step_after(case["sim"], case["steps_before"])
    out = run_step("triton", sim, step, divisor=case["divisor"], lse_layout=case["lse_layout"],
                   launch_config=case["config"])
    assert_matches(out, oracle(sim, step), f"{case}")


# --------------------------------------------------------------------------------------------
# validation


def _args(device):
    sim = make_sim(device, prompts=[5, 3], beams=2, hq=6, hkv=2, d=64, seed=1)
    step = sim.begin_step()
    po, pl = prefix_state(sim, step)
    return dict(
        q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table,
        kv_lens=step.kv_lens, prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection,
        beam_width=step.beam_width, prefix_out=po, prefix_lse=pl, out=torch.full_like(step.q, 7.0),
    )


def out_over_index(name, args, written="out"):
    """A NaN-free ``written`` buffer (``out`` by default) whose first bytes hold the index tensor ``name`` (same
    values): the two overlap."""
    buffer = torch.full_like(args[written], 7.0)
    index = buffer.view(-1).view(torch.int32)[:args[name].numel()].view(args[name].shape)
    index.copy_(args[name])
    return {written: buffer, name: index}


def _stored_in(host, x):
    """``x``'s values in a view over the first bytes of ``host`` (``host`` changed)."""
    view = host.view(-1).view(x.dtype)[: x.numel()].view(x.shape)
    view.copy_(x)
    return view


BAD_INPUTS = [
    ("hq_not_multiple", lambda a: dict(q=a["q"][:, :5]), "Hq=5 is not a multiple of the KV head count Hkv=2"),
    ("q_last_dim_strided", lambda a: dict(q=a["q"].repeat_interleave(2, dim=2)[:, :, ::2]), "must be contiguous"),
    ("kv_dtype", lambda a: dict(kv_cache=a["kv_cache"].half()), "the pool and q must share a dtype"),
    ("beam_wider_than_cache", lambda a: dict(cache_indirection=a["cache_indirection"][:, :1]),
     "exceeds the width cache_indirection was sized for"),
    ("page_table_too_short", lambda a: dict(beam_page_table=a["beam_page_table"][:, :2]),
     "pass a page table with at least 4 columns"),
    ("lse_layout_shape", lambda a: dict(prefix_lse=a["prefix_lse"].t().contiguous()), "needs (4, 6)"),
    ("kv_lens_dtype", lambda a: dict(kv_lens=a["kv_lens"].long()), "kv_lens has dtype int64"),
    # A strided view of the lengths would be read at unit stride: other rows' values, silently.
    ("kv_lens_strided", lambda a: dict(kv_lens=torch.stack([a["kv_lens"], a["kv_lens"] + 9], 1)[:, 0]),
     "kv_lens has stride 2"),
    ("prompt_lens_strided", lambda a: dict(prompt_lens=torch.stack([a["prompt_lens"], a["prompt_lens"]], 1)[:, 1]),
     "prompt_lens has stride 2"),
    ("rows_not_multiple_of_beam", lambda a: dict(beam_width=3), "not a multiple of beam_width=3"),
    ("layout_string", lambda a: dict(kv_layout="HDN"), "kv_layout='HDN' is not supported"),
    ("lse_base_string", lambda a: dict(prefix_lse_base="e"), "prefix_lse_base='e' is not supported"),
    ("divisor", lambda a: dict(page_index_divisor=0), "page_index_divisor=0 must be an int in [1, 2147483647]"),
    ("divisor_past_int32", lambda a: dict(page_index_divisor=2**31), "page_index_divisor=2147483648 must be an int in"),
    ("out_aliases_q", lambda a: dict(out=a["q"]), "out overlaps q"),
    # Rows of out that share memory: each passes every shape check, and the kernel writes over its own output.
    ("out_rows_overlap", lambda a: dict(out=a["out"][:1].expand_as(a["out"])), "overlap in memory (a stride of 0"),
    ("pool_k_is_v", lambda a: dict(kv_cache=a["kv_cache"][:, :1].expand_as(a["kv_cache"])),
     "overlap in memory (a stride of 0"),
    # An out stored over an index tensor would change lengths, pages or source beams that programs still read.
    *[(f"out_over_{name}", functools.partial(out_over_index, name), f"out overlaps {name}")
      for name in ("beam_page_table", "kv_lens", "prompt_lens", "cache_indirection")],
    # The launch's other writes: the error flag (atomics) and the pool (this step's K/V), over what it reads.
    ("flag_in_out", lambda a: dict(error_flags=a["out"].view(torch.int32).view(-1)[:1]),
     "out overlaps error_flags in memory"),
    ("kv_lens_in_the_pool", lambda a: dict(kv_lens=_stored_in(a["kv_cache"], a["kv_lens"])),
     "kv_cache overlaps kv_lens in memory"),
    # The kept verdicts key a tensor by its metadata: a tensor scale's value would be read once, then reused.
    ("sm_scale_tensor", lambda a: dict(sm_scale=torch.tensor(0.125)), "sm_scale is a tensor"),
    # Degenerate and non-dense tensors: named, not a ZeroDivisionError or a storage error from inside torch.
    ("no_head_dim", lambda a: dict(q=a["q"][:, :, :0]), "with Hq=6, D=0; both must be >= 1"),
    ("no_query_heads", lambda a: dict(q=a["q"][:, :0]), "with Hq=0, D=64; both must be >= 1"),
    ("sparse_indirection", lambda a: dict(cache_indirection=a["cache_indirection"].to_sparse()),
     "cache_indirection has layout torch.sparse_coo"),
    # The plan's last prompt pages: one per request (2), int32.
]


@impl_param
@pytest.mark.parametrize("name,change,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_launcher_rejects_bad_inputs(impl, name, change, message, device):
    args = _args(device)
    args.update(change(args))
    out_before = args["out"].clone()
    with pytest.raises(TailMergeInputError, match=re.escape(message)):
        IMPLS[impl](**args)
    assert torch.equal(args["out"], out_before) or name == "out_aliases_q"


def test_triton_launcher_keeps_out_off_tail_skip(device):
    """The shared-run stage's ``tail_skip`` is read by every program of the tail: an ``out`` stored over it is
    refused before launch."""
    args = _args(device)
    args["tail_skip"] = args["out"].view(torch.int32).view(-1)[: args["q"].shape[0]]
    with pytest.raises(TailMergeInputError, match="out overlaps tail_skip in memory"):
        beam_tail_attention_merge(**args)


def test_triton_launcher_names_its_limits(monkeypatch, device):
    """Shapes and places the Triton kernel does not serve name the torch path as the fix (the tiling
    checks on the test device, so that a CUDA machine's CPU tensors do not stop them earlier)."""
    sim = make_sim("cpu", prompts=[5], beams=2, hq=2, hkv=1, d=48, seed=2)
    step = sim.begin_step()
    po, pl = prefix_state(sim, step)
    args = (step.q, step.new_k, step.new_v, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
            step.cache_indirection, step.beam_width, po, pl, torch.empty_like(step.q))
    with pytest.raises(TailMergeInputError, match="head_dim=48 is not supported by the Triton tail kernel"):
        beam_tail_attention_merge(*args)
    out = run_step("torch", sim, step)  # the fallback serves it
    assert_matches(out, oracle(sim, step), "torch fallback at head_dim 48")
    good = _args(device)
    with pytest.raises(TailMergeInputError, match=r"launch_config.group_pad=2 is smaller than the GQA group size 3"):
        beam_tail_attention_merge(**good, launch_config=TailLaunchConfig(2, 1, 2, 4))
    with pytest.raises(TailMergeInputError, match=r"launch_config.index_block=2 must be 0 \(no index blocks\) or a power"):
        beam_tail_attention_merge(**good, launch_config=TailLaunchConfig(4, 1, 4, 4, index_block=2))
    # A compiled (not interpreted) kernel cannot take CPU tensors: as where TRITON_INTERPRET was off at import.
    import triton_kernels.tail_merge as tail_merge_module

    monkeypatch.setattr(tail_merge_module, "runs_interpreted", lambda kernel: False)
    with pytest.raises(TailMergeInputError, match="needs CUDA tensors, got cpu; use beam_tail_attention_merge_torch"):
        beam_tail_attention_merge(**_args("cpu"))


def _set_first(lengths, value):
    """``lengths`` (int32) with row 0's entry set to ``value``."""
    lengths = lengths.clone()
    lengths[0] = value
    return lengths


BAD_VALUES = [
    ("kv_len_not_past_prompt", lambda a: dict(kv_lens=a["prompt_lens"].clone()), r"kv_lens\[0\]=5 must be >= prompt_lens\[0\] \+ 1"),
    ("kv_len_past_capacity", lambda a: dict(kv_lens=a["kv_lens"] + 64), "exceeds the cache capacity max_seq_len=64"),
    ("page_outside_pool", lambda a: dict(beam_page_table=a["beam_page_table"] + 10_000), "is outside the pool"),
    ("indirection_not_a_beam", lambda a: dict(cache_indirection=a["cache_indirection"] + 5), "is not a beam in"),
    # A garbage length: negative (the walk would start before position 0), or near 2^31 (start + lane would wrap).
    ("prompt_len_negative", lambda a: dict(prompt_lens=_set_first(a["prompt_lens"], -3)),
     r"prompt_lens\[0\]=-3 is negative"),
    ("prompt_len_near_int32_max", lambda a: dict(prompt_lens=_set_first(a["prompt_lens"], 2**31 - 1)),
     r"kv_lens\[0\]=\d+ must be >= prompt_lens\[0\] \+ 1"),
]
# The error-flag bits each case must raise without check mode (triton_kernels.device_errors).
BAD_VALUE_BITS = {
    "kv_len_not_past_prompt": device_errors.KV_LEN.value,
    "prompt_len_negative": device_errors.PROMPT_LEN.value,
    "prompt_len_near_int32_max": device_errors.KV_LEN.value,
    # (the tail then runs to max_seq_len, through page-table columns no page was allocated for: -1)
    "kv_len_past_capacity": device_errors.KV_LEN.value | device_errors.TAIL_PAGE.value,
    "page_outside_pool": device_errors.TAIL_PAGE.value | device_errors.WRITE_PAGE.value,
    "indirection_not_a_beam": device_errors.SOURCE_BEAM.value,
}


def _bad_value_case(device, change, with_digest=False):
    """A step with 3 earlier generated tokens (so indirection entries are read), its call arguments
    with ``change`` applied and a NaN-poisoned ``out``: ``(sim, step, args)``, and with ``with_digest`` the plan's
    prompt digest the audit compares beam 0's table with (which ``change`` may replace as ``plan_digest``)."""
    sim = make_sim(device, prompts=[5, 3], beams=2, hq=4, hkv=2, d=64, seed=1)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    po, pl = prefix_state(sim, step)
    args = dict(
        q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table,
        kv_lens=step.kv_lens, prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection,
        beam_width=step.beam_width, prefix_out=po, prefix_lse=pl, out=torch.full_like(step.q, float("nan")),
    )
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           step.beam_width, step.page_size, step.num_pages)
    digest = torch.from_numpy(plan.prompt_pages_digest.copy())
    changed = change(dict(args, plan_digest=digest))
    digest = changed.pop("plan_digest", digest)
    args.update(changed)
    return (sim, step, args, digest) if with_digest else (sim, step, args)


@impl_param
@pytest.mark.parametrize("name,change,message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_validate_indices_reports_bad_values(impl, name, change, message, device):
    _, _, args = _bad_value_case(device, change)
    with pytest.raises(TailMergeInputError, match=message):
        IMPLS[impl](**args, validate_indices=True)


@pytest.mark.parametrize("config", [None, TailLaunchConfig(2, 2, 1, 4, index_block=0),
                                    TailLaunchConfig(2, 2, 1, 1, grouped=True), "torch"],
                         ids=["default", "chain", "grouped", "torch"])
@pytest.mark.parametrize("name,change", [(b[0], b[1]) for b in BAD_VALUES], ids=[b[0] for b in BAD_VALUES])
def test_kernel_masks_bad_indices_without_validation(name, change, config, device):
    """Without check mode, bad indices are masked in the kernel (and in the torch path, the same
    way): no fault, the pool is not written outside the rows' own pages, and a write position
    inside the (shared) prompt is skipped."""
    sim, step, args = _bad_value_case(device, change)
    before = sim.kv_cache.clone()
    flags = device_errors.new_error_flags(device)
    if config == "torch":
        IMPLS["torch"](**args, error_flags=flags)
    else:
        beam_tail_attention_merge(**args, launch_config=config, error_flags=flags)
    assert not torch.isnan(args["out"]).any()
    # ... and reported on the device: the case's bits, and no other (no sync in the call).
    assert int(flags) == BAD_VALUE_BITS[name], (name, device_errors.decode_error_flags(int(flags)))
    changed = (sim.kv_cache != before).flatten(2).any(dim=2)  # [pages, 2]
    allowed = torch.zeros_like(changed)
    if name in ("indirection_not_a_beam", "prompt_len_negative"):  # these keep every row's write position valid
        allowed[step.write_page] = True
    elif name == "prompt_len_near_int32_max":  # row 0's kv_len is not past its prompt: the other rows still write
        allowed[step.write_page[1:]] = True
    assert not (changed & ~allowed).any(), f"{name}: the kernel wrote outside the rows' write pages"


@pytest.mark.parametrize("config", [None, TailLaunchConfig(2, 2, 1, 4, index_block=0),
                                    TailLaunchConfig(2, 2, 1, 1, grouped=True), "torch"],
                         ids=["default", "chain", "grouped", "torch"])
def test_dummy_rows_raise_no_error_bit(config, device):
    """TensorRT-LLM's warm-up and CUDA-graph padding rows have no prompt and kv_len 1; the adapter
    plans them with a one-token prompt. Not an error (``device_errors.kv_len_bad``): no bit, and check
    mode's value checks (``validate_indices``) pass them too; a one-token kv_len under a longer prompt
    is still refused there."""
    def dummies(a):  # request 1's rows (2 and 3)
        kv_lens, prompt_lens = a["kv_lens"].clone(), a["prompt_lens"].clone()
        kv_lens[2:4], prompt_lens[2:4] = 1, 1
        return dict(kv_lens=kv_lens, prompt_lens=prompt_lens)

    _, _, args = _bad_value_case(device, dummies)
    flags = device_errors.new_error_flags(device)
    call = IMPLS["torch"] if config == "torch" else functools.partial(beam_tail_attention_merge, launch_config=config)
    call(**args, error_flags=flags)
    assert int(flags) == 0, device_errors.decode_error_flags(int(flags))
    call(**args, validate_indices=True)
    args["prompt_lens"] = args["prompt_lens"].clone()
    args["prompt_lens"][2:4] = 2
    with pytest.raises(TailMergeInputError, match=r"kv_lens\[2\]=1 must be >= prompt_lens\[2\] \+ 1 = 3"):
        call(**args, validate_indices=True)


def _beam_len_differs(a):  # request 0's beam 1 one position behind beam 0
    kv_lens = a["kv_lens"].clone()
    kv_lens[1] -= 1
    return dict(kv_lens=kv_lens)


def _beam_on_beam0_write_page(a):  # request 0's beam 1 writes into beam 0's copy of the partly filled prompt page
    table = a["beam_page_table"].clone()
    col = int(a["kv_lens"][0] - 1) // 16
    assert col == 0 and int(a["prompt_lens"][0]) < 16  # (the prompt's one page is partly filled: 5 of 16 tokens)
    table[1, col] = table[0, col]
    return dict(beam_page_table=table)


def _plan_of_another_batch(a):  # the prefix state of a plan whose requests came in the other order
    assert a["plan_digest"].numel() == 2 and int(a["plan_digest"][0]) != int(a["plan_digest"][1])
    return dict(plan_digest=a["plan_digest"].flip(0).contiguous())


REPORTED_ONLY = [
    ("len_differs", _beam_len_differs, device_errors.BEAM_KV_LEN.value),
    # (HELD_WRITE_PAGE too: each of the two rows' write page is held by the other)
    ("on_beam0_write_page", _beam_on_beam0_write_page,
     device_errors.SHARED_WRITE_PAGE.value | device_errors.HELD_WRITE_PAGE.value),
    ("plan_of_another_batch", _plan_of_another_batch, device_errors.PLAN_PAGE.value),
]


@pytest.mark.parametrize("config", [None, TailLaunchConfig(2, 2, 1, 4, index_block=0),
                                    TailLaunchConfig(2, 2, 1, 1, grouped=True), "torch"],
                         ids=["default", "chain", "grouped", "torch"])
@pytest.mark.parametrize("name,change,bits", REPORTED_ONLY, ids=[c[0] for c in REPORTED_ONLY])
@pytest.mark.parametrize("write_kv", [True, False], ids=["write_kv", "engine_wrote_kv"])
def test_rows_that_disagree_are_reported_not_changed(name, change, bits, write_kv, config, device):
    """A beam whose kv_len differs from beam 0's, a beam whose write slot is on beam 0's page (here the prompt's
    partly filled last page), or a beam page table unlike the plan the prefix came from: each index is valid
    alone, so the kernels serve the step as given and raise nothing (whether or not they write the step's K/V);
    the step's page-table audit reports exactly its bits, and the flag changes nothing the kernels compute or write
    (but the slot two rows write, whose writes race element by element on a GPU, flag or not)."""
    results = []
    for flags in (None, device_errors.new_error_flags(device)):
        sim, step, args, digest = _bad_value_case(device, change, with_digest=True)
        if config == "torch":
            IMPLS["torch"](**args, write_kv=write_kv, error_flags=flags)
        else:
            beam_tail_attention_merge(**args, write_kv=write_kv, launch_config=config, error_flags=flags)
        results.append((args["out"], sim.kv_cache))
    assert not torch.isnan(results[0][0]).any()
    assert int(flags) == 0, (name, device_errors.decode_error_flags(int(flags)))
    audited = audit_word(step, args["beam_page_table"], args["kv_lens"], plan_digest=digest,
                         impl="torch" if config == "torch" else "triton")
    assert audited == bits, (name, device_errors.decode_error_flags(audited))
    assert torch.equal(results[0][0], results[1][0])
    if name == "on_beam0_write_page" and write_kv:  # rows 0 and 1 both write this step's slot of beam 0's page
        page, slot = int(args["beam_page_table"][0, 0]), int(args["kv_lens"][0] - 1) % 16
        assert_same_pools_but_one_raced_slot(sim, [r[1] for r in results], page, slot, args["new_k"], args["new_v"],
                                             writers=(0, 1))
    else:
        assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("config", [None, TailLaunchConfig(2, 2, 1, 4, index_block=0),
                                    TailLaunchConfig(2, 2, 1, 1, grouped=True), "torch"],
                         ids=["default", "chain", "grouped", "torch"])
@pytest.mark.parametrize("case", ["two_beams_share", "on_full_prompt_page"])
def test_write_pages_held_elsewhere_in_the_request_are_reported(case, config, device):
    """Beams 1 and 2 of request 0 given one write page (the copy of the prompt's partly filled page that each
    beam owns), or beam 1's write slot pointed at a full prompt page every beam reads (column 0 of 3): every
    index is in the pool and no beam is on beam 0's page of its column, so only the request's beams together
    show it. Served as given, raising nothing in the kernels; the step's audit reports exactly
    ``HELD_WRITE_PAGE``, and the flag changes nothing computed or written (but the slot two rows write, whose
    writes race element by element on a GPU)."""
    results = []
    for flags in (None, device_errors.new_error_flags(device)):
        sim, step = step_after(dict(prompts=[40, 21], beams=3, hq=4, hkv=2, d=64, seed=2), 3)
        po, pl = prefix_state(sim, step)
        table = step.beam_page_table.clone()
        col = int(step.kv_lens[0] - 1) // 16
        assert col == 2 and int(step.prompt_lens[0]) == 40  # (the partly filled page: 8 prompt tokens of 16)
        if case == "two_beams_share":
            table[2, col] = table[1, col]
        else:
            table[1, col] = table[0, 0]
        args = dict(q=step.q, new_k=step.new_k, new_v=step.new_v, kv_cache=sim.kv_cache, beam_page_table=table,
                    kv_lens=step.kv_lens, prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection,
                    beam_width=step.beam_width, prefix_out=po, prefix_lse=pl, out=torch.full_like(step.q, float("nan")))
        if config == "torch":
            IMPLS["torch"](**args, error_flags=flags)
        else:
            beam_tail_attention_merge(**args, launch_config=config, error_flags=flags)
        results.append((args["out"], sim.kv_cache))
    assert not torch.isnan(results[0][0]).any()
    assert int(flags) == 0, device_errors.decode_error_flags(int(flags))
    audited = audit_word(step, table, impl="torch" if config == "torch" else "triton")
    assert audited == device_errors.HELD_WRITE_PAGE.value, device_errors.decode_error_flags(audited)
    assert torch.equal(results[0][0], results[1][0])
    if case == "two_beams_share":  # rows 1 and 2 both write this step's slot of beam 1's page
        page, slot = int(table[1, col]), int(step.kv_lens[1] - 1) % 16
        assert_same_pools_but_one_raced_slot(sim, [r[1] for r in results], page, slot, step.new_k, step.new_v,
                                             writers=(1, 2))
    else:
        assert torch.equal(results[0][1], results[1][1])


# --------------------------------------------------------------------------------------------
# GPU: bigger shapes, bf16/fp16, head 256, page sizes to 128, int64 offsets, CUDA graphs

GPU_CASES = [
    # (prompts, beams, hq, hkv, d, pg, layout, dtype, steps, call kwargs)
    ([100, 64, 1, 37], 8, 16, 8, 128, 16, "HND", torch.bfloat16, 12, dict()),
    ([100, 64, 1, 37], 8, 16, 8, 128, 64, "NHD", torch.float16, 12, dict(lse_layout="HN", lse_base="ln")),
    ([200, 3], 6, 12, 2, 256, 128, "HND", torch.bfloat16, 10, dict(divisor=4, prefix_dtype=torch.bfloat16)),
    ([128, 5], 4, 40, 8, 256, 32, "NHD", torch.float16, 6, dict(strided=True)),  # G=5
    ([50, 17], 16, 32, 4, 64, 16, "HND", torch.bfloat16, 20, dict(prefix_dtype=torch.float16)),  # G=8
    ([31], 96, 16, 8, 128, 32, "HND", torch.bfloat16, 4, dict()),
    ([60, 7], 6, 16, 8, 256, 32, "NHD", torch.bfloat16, 6, dict(divisor=2)),  # G=2, head 256
    ([300, 40], 6, 32, 2, 128, 32, "HND", torch.bfloat16, 6, dict()),  # G=16: few rows, and 4 tokens x 2 warps
    ([90], 12, 32, 1, 128, 16, "NHD", torch.bfloat16, 6, dict()),  # G=32: few rows (8 warps), 4 tokens x 4 warps
    ([70, 20], 4, 64, 1, 128, 32, "HND", torch.bfloat16, 5, dict()),  # G=64: 1 token x 8 warps
]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,tiling", [("triton", "by_rows"), ("triton", "many_rows"), ("torch", None)])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_matches_oracle(impl, tiling, case):
    """Every case on the GPU against the oracle: the default tiling at the case's rows (few: index blocks
    where measured) and the many-rows default of the same heads (the grouped kernel at G = 2)."""
    prompts, beams, hq, hkv, d, pg, layout, dtype, steps, call_kw = GPU_CASES[case]
    sim = make_sim("cuda", prompts=prompts, beams=beams, hq=hq, hkv=hkv, d=d, pg=pg, layout=layout, dtype=dtype,
                   max_seq_len=max(prompts) + steps + 1 + pg, seed=case)
    config = tail_launch_config(hq // hkv, hkv, d) if tiling == "many_rows" else None
    for s in range(steps):
        step = sim.begin_step()
        out = run_step(impl, sim, step, launch_config=config, **call_kw)
        assert_matches(out, oracle(sim, step), f"gpu case {case} step {s}")
        sim.end_step(write_kv=False)


@pytest.mark.gpu
def test_gpu_pool_offsets_beyond_int32():
    """Pages placed past 2^31 pool elements: offsets must be computed in int64."""
    sim = make_sim("cuda", prompts=[20, 9], beams=4, hq=8, hkv=2, d=128, pg=16, seed=21)
    for _ in range(5):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    page_elems = sim.kv_cache[0].numel()
    shift = (1 << 31) // page_elems + 7
    big = torch.empty((shift + sim.num_pages,) + tuple(sim.kv_cache.shape[1:]), dtype=sim.kv_cache.dtype, device="cuda")
    big[shift:] = sim.kv_cache
    assert (shift + sim.num_pages - 1) * page_elems > (1 << 31)
    table = torch.where(step.beam_page_table < sim.num_pages, step.beam_page_table + shift, step.beam_page_table)
    prefix_out, prefix_lse = prefix_state(sim, step)
    out = torch.full_like(step.q, float("nan"))
    beam_tail_attention_merge(
        step.q, step.new_k, step.new_v, big, table, step.kv_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width, prefix_out, prefix_lse, out,
    )
    assert_matches(out, oracle(sim, step), "int64 pool offsets")
    written = torch.equal(big[shift:][step.write_page, 0, :, step.write_slot], step.new_k)
    assert written, "the new K did not land at its page past 2^31 elements"
    del big


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_cuda_graph_serves_growing_tails(layout):
    """One capture, replayed over steps whose earlier tails grow 0 -> 40, every step against the oracle."""
    beams, steps, pg = 4, 41, 16
    sim = make_sim("cuda", prompts=[13, 32, 1], beams=beams, hq=16, hkv=8, d=128, pg=pg, layout=layout,
                   max_seq_len=32 + steps + 1, seed=99)
    rows = 3 * beams
    step = sim.begin_step()
    static = dict(
        q=torch.empty_like(step.q), new_k=torch.empty_like(step.new_k), new_v=torch.empty_like(step.new_v),
        beam_page_table=torch.empty_like(step.beam_page_table), kv_lens=torch.empty_like(step.kv_lens),
        prompt_lens=torch.empty_like(step.prompt_lens), cache_indirection=torch.empty_like(step.cache_indirection),
        prefix_out=torch.empty(rows, 16, 128, device="cuda"), prefix_lse=torch.empty(rows, 16, device="cuda"),
    )
    out = torch.empty_like(step.q)

    def load(step):
        for name in ("q", "new_k", "new_v", "beam_page_table", "kv_lens", "prompt_lens", "cache_indirection"):
            static[name].copy_(getattr(step, name))
        po, pl = prefix_state(sim, step)
        static["prefix_out"].copy_(po)
        static["prefix_lse"].copy_(pl)
        out.fill_(float("nan"))

    def launch():
        beam_tail_attention_merge(
            static["q"], static["new_k"], static["new_v"], sim.kv_cache, static["beam_page_table"],
            static["kv_lens"], static["prompt_lens"], static["cache_indirection"], beams,
            static["prefix_out"], static["prefix_lse"], out, kv_layout=layout,
        )

    load(step)
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    seen = []
    for s in range(steps):
        if s:
            step = sim.begin_step()
            load(step)
        graph.replay()
        torch.cuda.synchronize()
        seen.append(max(earlier_tail(step)))
        assert_matches(out, oracle(sim, step), f"graph replay step {s}")
        for i in range(rows):
            k, v = sim.read_kv(int(step.write_page[i]), int(step.write_slot[i]))
            assert torch.equal(k, step.new_k[i]) and torch.equal(v, step.new_v[i]), f"graph KV write, row {i}"
        sim.end_step(write_kv=False)
    assert seen[0] == 0 and seen[-1] == 40
