"""The shared-run stage (prefix state + the run every beam of a block reads from one ancestor) followed by
the tail kernel with ``tail_skip``, against the float32 oracle.

Steps come from :class:`BeamSearchCacheSimulator` with histories that coalesce (every beam's parent is
beam 0 for the first steps, random afterwards), the prefix state from ``reference_prefix_attention``; the
expected run of each block of beams from a torch scan (``test_beam_index.leading_shared_run``). Outputs are
NaN-poisoned, the pool is compared with its snapshot (only the tail kernel writes, this step's K/V).
"""

from __future__ import annotations

import pytest
import torch

from triton_kernels import (
    KernelInputError,
    TailLaunchConfig,
    beam_shared_run_attention,
    beam_tail_attention_merge,
    device_errors,
)
from triton_kernels.shared_run import (
    STAGE_MAX_KV_HEADS_PER_PROGRAM,
    STAGE_PROGRAMS_PER_SM,
    SHARED_RUN_MIN_CACHED_TAIL,
    shared_run_kv_heads_per_program,
    shared_run_tile,
)

from test_cascade import coalesce_then_branch, shared_runs
from test_tail_merge import (
    assert_matches,
    earlier_tail,
    expected_pool_after_write,
    make_sim,
    oracle,
    prefix_state,
)


def expected_runs(step, beams_per_block, min_cached_tail=1):
    """``[rows]``: each row's block's leading run of earlier positions from ``P`` with one
    ``cache_indirection`` entry across the block (``test_cascade.shared_runs``, one per row); 0 for a block
    whose beams cache fewer than ``min_cached_tail`` earlier positions (``min over the block of L - 1 - P``)."""
    W = step.beam_width
    runs = iter(shared_runs(step, beams_per_block))
    earlier = torch.tensor(earlier_tail(step))
    per_row = torch.zeros(step.num_rows, dtype=torch.int32)
    for r in range(step.num_rows // W):
        for b0 in range(0, W, beams_per_block):
            rows = slice(r * W + b0, r * W + min(W, b0 + beams_per_block))
            run = next(runs)
            per_row[rows] = run if int(earlier[rows].min()) >= min_cached_tail else 0
    return per_row


def run_stage_then_tail(sim, step, *, divisor=1, lse_layout="NH", lse_base="log2", prefix_dtype=torch.float32,
                        empty_prefix=False, launch_config=None, kv_heads_per_program=None, min_cached_tail=None):
    """The stage, then the tail with its ``tail_skip``; returns ``(out, tail_skip)`` and checks the pool and
    the error flag (valid input raises nothing)."""
    table = step.beam_page_table if divisor == 1 else sim.block_offsets(step.beam_page_table, divisor)[:, 0, :]
    prefix_out, prefix_lse = prefix_state(sim, step, lse_layout, lse_base, prefix_dtype, empty_prefix)
    tail_skip = torch.full((step.num_rows,), -7, dtype=torch.int32, device=step.q.device)  # poisoned
    flags = device_errors.new_error_flags(step.q.device)
    before = sim.kv_cache.clone()
    common = dict(kv_layout=sim.kv_layout, page_index_divisor=divisor, prefix_lse_layout=lse_layout,
                  prefix_lse_base=lse_base, error_flags=flags)
    assert beam_shared_run_attention(step.q, sim.kv_cache, table, step.kv_lens, step.prompt_lens,
                                     step.cache_indirection, step.beam_width, prefix_out, prefix_lse, tail_skip,
                                     kv_heads_per_program=kv_heads_per_program, min_cached_tail=min_cached_tail,
                                     **common) is tail_skip
    assert torch.equal(sim.kv_cache, before), "the stage wrote to the pool"
    out = torch.full_like(step.q, float("nan"))
    beam_tail_attention_merge(step.q, step.new_k, step.new_v, sim.kv_cache, table, step.kv_lens, step.prompt_lens,
                              step.cache_indirection, step.beam_width, prefix_out, prefix_lse, out,
                              launch_config=launch_config, tail_skip=tail_skip, **common)
    assert int(flags) == 0, f"valid input raised {device_errors.decode_error_flags(int(flags))}"
    assert torch.equal(sim.kv_cache, expected_pool_after_write(sim, step, before))
    return out, tail_skip.cpu()


# (name, simulator kwargs, steps with one parent, steps, call kwargs). The stage's programs take 1 KV head
# (the default of small launches on a GPU), 2 (the default on the CPU) and 3 (every head of the shape); the
# first and last cases fold every run (``min_cached_tail`` 1: their tails are shorter than the default 32),
# the second takes the default.
CASES = [
    # G = 2, head 128: one 32-beam block of 20 beams; the grouped tail kernel (the many-rows default at
    # G = 2); fp32 prefix, log2 LSE.
    ("g2_d128_one_block", dict(prompts=[150, 40], beams=20, hq=4, hkv=2, d=128, pg=32, max_seq_len=192), 14, 18,
     dict(launch_config=TailLaunchConfig(2, 2, 1, 2, grouped=True), kv_heads_per_program=1,
          min_cached_tail=1)),
    # G = 3 (padded 4), head 64: two 16-beam blocks of 18 beams (the second mostly padding); NHD, TensorRT-LLM
    # block offsets, FA4's prefix state (bf16 output, natural-log LSE, [heads, rows]); the [QH, D] tail with
    # index blocks, which starts its first index block at P + tail_skip.
    ("g3_d64_two_blocks_fa4_state", dict(prompts=[13, 40], beams=18, hq=9, hkv=3, d=64, layout="NHD",
                                         max_seq_len=96, seed=13), 30, 36,
     dict(divisor=6, lse_layout="HN", lse_base="ln", prefix_dtype=torch.bfloat16,
          launch_config=TailLaunchConfig(4, 1, 4, 2, index_block=16), kv_heads_per_program=3)),
    # G = 8 (a 128-row tile, 8 warps), an empty prefix state (-inf): the run alone seeds the merge; the
    # [QH, D] tail walking 2 positions per step without index blocks.
    ("g8_empty_prefix", dict(prompts=[20, 7], beams=5, hq=8, hkv=1, d=64, max_seq_len=64, seed=4), 12, 15,
     dict(empty_prefix=True, launch_config=TailLaunchConfig(8, 1, 2, 2), min_cached_tail=1)),
]


@pytest.mark.parametrize("name,sim_kw,shared_steps,steps,call_kw", CASES, ids=[c[0] for c in CASES])
def test_shared_run_then_tail_matches_oracle(name, sim_kw, shared_steps, steps, call_kw, device):
    sim = make_sim(device, **sim_kw)
    coalesce_then_branch(sim, steps, shared_steps)
    step = sim.begin_step()
    beams, _, _ = shared_run_tile(sim.beam_width, sim_kw["hq"] // sim_kw["hkv"], sim_kw["d"])
    want = expected_runs(step, beams, call_kw.get("min_cached_tail") or SHARED_RUN_MIN_CACHED_TAIL)
    tails = earlier_tail(step)
    # Both parts of the tail are exercised: runs the stage takes, and positions after them the tail walks.
    assert int(want.max()) >= shared_steps - 1 and bool(((want > 0) & (want < torch.tensor(tails))).any()), (want, tails)
    out, tail_skip = run_stage_then_tail(sim, step, **call_kw)
    assert torch.equal(tail_skip, want), (tail_skip, want)
    assert_matches(out, oracle(sim, step, tail_only=call_kw.get("empty_prefix", False)),
                   f"{name}: runs {want.tolist()}, tails {tails}")


def test_without_a_shared_run_the_prefix_state_is_untouched(device):
    """Beams that disagree at ``P`` (and a request whose tail is this step's token alone): every skip is 0,
    the stage leaves the prefix state as it was, and the tail alone gives the oracle's output."""
    sim = make_sim(device, prompts=[30, 9], beams=6, hq=4, hkv=2, d=64, seed=3)
    for _ in range(5):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    p = int(step.prompt_lens_per_request[0])
    step.cache_indirection[0, :6, p] = torch.arange(6, dtype=torch.int32)
    step.cache_indirection[1, :6, int(step.prompt_lens_per_request[1])] = torch.arange(6, dtype=torch.int32)
    prefix_out, prefix_lse = prefix_state(sim, step)
    kept = prefix_out.clone(), prefix_lse.clone()
    tail_skip = torch.full((step.num_rows,), 5, dtype=torch.int32, device=device)
    beam_shared_run_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                              step.cache_indirection, step.beam_width, prefix_out, prefix_lse, tail_skip)
    assert int(tail_skip.abs().max()) == 0
    assert torch.equal(prefix_out, kept[0]) and torch.equal(prefix_lse, kept[1])
    out, _ = run_stage_then_tail(sim, step)
    assert_matches(out, oracle(sim, step), "no shared run")


def test_a_tail_shorter_than_min_cached_tail_is_left_to_the_tail_kernel(device):
    """Beams that share their whole history, but fewer earlier positions than ``min_cached_tail``: the stage scans
    nothing (every skip 0, the prefix state as it was), and the tail alone gives the oracle's output; at a
    minimum equal to the tail's 7 positions the stage takes them all."""
    sim = make_sim(device, prompts=[30, 9], beams=6, hq=4, hkv=2, d=64, seed=5)
    coalesce_then_branch(sim, 7, 7)
    step = sim.begin_step()
    tails = earlier_tail(step)
    assert min(tails) == max(tails) == 7
    prefix_out, prefix_lse = prefix_state(sim, step)
    kept = prefix_out.clone(), prefix_lse.clone()
    tail_skip = torch.full((step.num_rows,), 5, dtype=torch.int32, device=device)
    beam_shared_run_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                              step.cache_indirection, step.beam_width, prefix_out, prefix_lse, tail_skip,
                              min_cached_tail=8)
    assert int(tail_skip.abs().max()) == 0
    assert torch.equal(prefix_out, kept[0]) and torch.equal(prefix_lse, kept[1])
    for min_cached_tail, want in ((8, 0), (7, 7)):
        out, tail_skip = run_stage_then_tail(sim, step, min_cached_tail=min_cached_tail)
        assert tail_skip.tolist() == [want] * step.num_rows
        assert_matches(out, oracle(sim, step), f"min_cached_tail {min_cached_tail}")


def test_shared_run_reports_a_bad_source_in_a_run(device):
    """An out-of-range source beam that every beam of a block shares inside its run is masked (that
    position drops out) and raises ``SOURCE_BEAM``; nothing non-finite reaches the prefix state."""
    sim = make_sim(device, prompts=[20, 7], beams=5, hq=4, hkv=2, d=64, seed=8)
    coalesce_then_branch(sim, 8, 8)
    step = sim.begin_step()
    p = int(step.prompt_lens_per_request[1])
    step.cache_indirection[1, :, p + 2] = sim.beam_width + 3
    assert int(expected_runs(step, 16)[sim.beam_width:].min()) >= 7
    prefix_out, prefix_lse = prefix_state(sim, step)
    tail_skip = torch.empty(step.num_rows, dtype=torch.int32, device=device)
    flags = device_errors.new_error_flags(device)
    beam_shared_run_attention(step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                              step.cache_indirection, step.beam_width, prefix_out, prefix_lse, tail_skip,
                              error_flags=flags, min_cached_tail=1)  # (an 8-position tail: the default leaves it)
    assert torch.isfinite(prefix_out).all() and torch.isfinite(prefix_lse).all()
    assert int(flags) == device_errors.SOURCE_BEAM.value, device_errors.decode_error_flags(int(flags))


def _stage_args(device):
    sim = make_sim(device, prompts=[20, 7], beams=4, hq=4, hkv=2, d=64)
    step = sim.begin_step()
    prefix_out, prefix_lse = prefix_state(sim, step)
    return dict(q=step.q, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table, kv_lens=step.kv_lens,
                prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection, beam_width=4,
                prefix_out=prefix_out, prefix_lse=prefix_lse,
                tail_skip=torch.empty(step.num_rows, dtype=torch.int32, device=device))


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(tail_skip=a["tail_skip"].long()), r"tail_skip must be a contiguous int32 \[rows=8\]"),
    (lambda a: a.update(tail_skip=a["tail_skip"][:5]), r"\[rows=8\].*\(5,\)"),
    (lambda a: a.update(q=a["q"].repeat(1, 8, 1), prefix_out=a["prefix_out"].repeat(1, 8, 1),
                        prefix_lse=a["prefix_lse"].repeat(1, 8)), r"GQA group 16 .*groups up to 8"),
    (lambda a: a.update(tail_skip=a["prefix_lse"].view(torch.int32)[:, 0]), r"tail_skip must be a contiguous"),
    (lambda a: a.update(prefix_lse=a["prefix_lse"].t()), r"prefix_lse has shape"),
    (lambda a: a.update(kv_heads_per_program=4), r"kv_heads_per_program=4 must be a positive int dividing the 2 KV"),
    (lambda a: a.update(kv_heads_per_program=0), r"kv_heads_per_program=0 must be a positive int"),
    (lambda a: a.update(min_cached_tail=0), r"min_cached_tail=0 must be an int in \[1, 2\*\*31\); pass 1 to fold"),
    (lambda a: a.update(min_cached_tail=16.0), r"min_cached_tail=16.0 must be an int"),
    # The stage merges in place: rows of the prefix state that share memory would merge into one another.
    (lambda a: a.update(prefix_out=a["prefix_out"][:1].expand_as(a["prefix_out"])),
     r"prefix_out of shape \(8, 4, 64\) with strides \(0, 64, 1\) has elements that overlap"),
    (lambda a: a.update(prefix_lse=a["prefix_lse"][:1].expand_as(a["prefix_lse"])),
     r"prefix_lse of shape \(8, 4\) with strides \(0, 1\) has elements that overlap"),
    (lambda a: a.update(error_flags=a["tail_skip"][:1]), r"tail_skip overlaps error_flags in memory"),
    # No position: every row would be masked, the stage silently a no-op.
    (lambda a: a.update(cache_indirection=a["cache_indirection"][:, :, :0]), r"max_seq_len=0 holds no position"),
])
def test_stage_refuses_bad_arguments(change, match, device):
    args = _stage_args(device)
    change(args)
    with pytest.raises(KernelInputError, match=match):
        beam_shared_run_attention(**args)


@pytest.mark.parametrize("tiles,hkv,sms,warps,d,want", [
    (64, 8, 132, 4, 128, 1),     # B-medium, 30 beams: 512 programs, two heads each would not fill the SMs
    (192, 8, 132, 4, 128, 2),    # B-medium, 96 beams (3 tiles a request): 1,536 programs -> 768
    (384, 6, 132, 4, 64, 2),     # 6 KV heads, head 64
    (384, 3, 132, 4, 128, 1),    # an odd number of KV heads
    (1000, 1, 132, 4, 128, 1),   # MQA: nothing to share
    (384, 8, 132, 8, 128, 2),    # G = 8's 8-warp tiles at head 128: one program per SM at one head or two
    (32, 8, 132, 8, 128, 1),     # ... but 128 programs of two heads would leave SMs idle
    (384, 8, 132, 8, 64, 1),     # at head 64 two heads would halve the programs an SM holds
    (2, 2, 1, 4, 128, 2),        # a CPU launch counts one SM
])
def test_kv_heads_per_program_keeps_a_full_wave(tiles, hkv, sms, warps, d, want):
    got = shared_run_kv_heads_per_program(tiles, hkv, sms, warps, d)
    assert got == want
    assert hkv % got == 0 and got <= STAGE_MAX_KV_HEADS_PER_PROGRAM
    assert got == 1 or tiles * hkv // got >= STAGE_PROGRAMS_PER_SM * sms


def test_stage_refuses_an_output_that_overlaps_its_inputs(device):
    args = _stage_args(device)
    args["tail_skip"] = args["kv_lens"].view(torch.int32)
    with pytest.raises(KernelInputError, match="tail_skip overlaps kv_lens"):
        beam_shared_run_attention(**args)


def test_tail_refuses_a_bad_tail_skip(device):
    args = _stage_args(device)
    sim_q = args["q"]
    new_kv = torch.zeros(sim_q.shape[0], 2, sim_q.shape[2], dtype=sim_q.dtype, device=device)
    with pytest.raises(KernelInputError, match=r"tail_skip must be a contiguous int32 \[rows=8\]"):
        beam_tail_attention_merge(sim_q, new_kv, new_kv.clone(), args["kv_cache"], args["beam_page_table"],
                                  args["kv_lens"], args["prompt_lens"], args["cache_indirection"], 4,
                                  args["prefix_out"], args["prefix_lse"], torch.empty_like(sim_q),
                                  tail_skip=torch.zeros(8, 2, dtype=torch.int32, device=device))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def shared_run_cases(draw):
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    steps = draw(st.integers(0, 12))
    state = draw(st.sampled_from([("NH", "log2", torch.float32), ("HN", "ln", torch.bfloat16)]))
    return dict(
        sim=dict(prompts=draw(st.lists(st.integers(1, 60), min_size=1, max_size=3)), beams=draw(st.integers(1, 40)),
                 hq=hkv * group, hkv=hkv, d=draw(st.sampled_from([64, 128])), pg=draw(st.sampled_from([4, 8, 16, 32])),
                 layout=draw(st.sampled_from(["HND", "NHD"])), max_seq_len=80, seed=draw(st.integers(0, 2**16))),
        steps=steps,
        shared_steps=draw(st.integers(0, steps)),
        # A break at this offset from P in request 0 (the beams disagree there), or none.
        break_at=draw(st.one_of(st.none(), st.integers(0, 12))),
        call=dict(divisor=draw(st.sampled_from([1, 4])), lse_layout=state[0], lse_base=state[1], prefix_dtype=state[2],
                  empty_prefix=draw(st.sampled_from([False, False, False, True])),
                  kv_heads_per_program=draw(st.sampled_from([None, 1, hkv])),
                  min_cached_tail=draw(st.one_of(st.none(), st.integers(1, 14)))),
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_run_cases())
def test_shared_run_property_matches_oracle(case):
    """Any beam width (one to three beam blocks), group, head size, page size, layout, page-table encoding,
    prefix-state format, history (coalesced for any number of steps, then random) and break: the stage finds
    the torch scan's runs, and with the tail it gives the oracle's output and writes exactly this step's K/V."""
    sim = make_sim("cuda" if torch.cuda.is_available() else "cpu", **case["sim"])
    coalesce_then_branch(sim, case["steps"], case["shared_steps"])
    step = sim.begin_step()
    p = int(step.prompt_lens_per_request[0])
    if case["break_at"] is not None and p + case["break_at"] < int(step.kv_lens[0]) - 1 and sim.beam_width > 1:
        step.cache_indirection[0, : sim.beam_width, p + case["break_at"]] = torch.arange(
            sim.beam_width, dtype=torch.int32)
    beams, _, _ = shared_run_tile(sim.beam_width, case["sim"]["hq"] // case["sim"]["hkv"], case["sim"]["d"])
    out, tail_skip = run_stage_then_tail(sim, step, **case["call"])
    want = expected_runs(step, beams, case["call"]["min_cached_tail"] or SHARED_RUN_MIN_CACHED_TAIL)
    assert torch.equal(tail_skip, want), (tail_skip, want)
    assert_matches(out, oracle(sim, step, tail_only=case["call"]["empty_prefix"]), f"{case}")
