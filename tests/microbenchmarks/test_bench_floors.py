"""Floor accounting on a shape small enough to count by hand, and the oracle comparison."""

import itertools
import types

import numpy as np
import pytest
import torch

from microbenchmarks.check import compare, pick_check_requests
from microbenchmarks.floors import count_flops, count_traffic, distinct_tail_entries, floor_times, stage_work
from microbenchmarks.shapes import BenchShape
from microbenchmarks.workload import build_workload

# R=2 requests of W=3 beams, prompts 5 and 9, tail 3 (2 earlier tokens + this step's), Hq=4, Hkv=2,
# D=8, page 4, bf16 (2 bytes). K+V of one position: 2 heads * 8 * 2 (K,V) * 2 B = 64 B.
PROMPTS = np.array([5, 9])
ANCESTRY = np.array([
    [[0, 2], [0, 2], [1, 2]],  # request 0: position P+0 from beams {0, 1} (2), P+1 from {2} (1)
    [[1, 0], [1, 1], [1, 2]],  # request 1: P+0 from {1} (1), P+1 from {0, 1, 2} (3)
])  # [R, W, T-1]


def hand_traffic():
    return count_traffic(PROMPTS, tail=3, beams=3, heads=4, kv_heads=2, head_dim=8, page_size=4, elem_bytes=2,
                         tail_ancestry=ANCESTRY)


def test_traffic_counted_by_hand():
    t = hand_traffic()
    assert t.prompt_kv == (5 + 9) * 64  # 896: each prompt read once, not once per beam
    assert t.tail_kv == 7 * 64  # 448: 2 + 1 + 1 + 3 distinct (request, beam, position) entries
    assert t.tail_kv_per_beam == 6 * 2 * 64  # 768: 6 rows x 2 earlier positions
    assert t.new_kv == 6 * 64 * 2  # 768: read from the input, written to the cache
    assert t.q == 6 * 4 * 8 * 2 == t.out  # 384 each
    # int32: 2 + 3 prompt pages, indptr 3, kv_len + prompt_len per row 12, indirection 6 x 2 = 12,
    # one tail page column per row (positions 5..7 in column 1, 9..11 in column 2): 6.
    assert t.metadata == 4 * (5 + 3 + 12 + 12 + 6)  # 152
    assert t.total == 896 + 448 + 768 + 384 + 384 + 152 == 3032
    assert t.prefix_state_round_trip == 2 * 6 * 4 * (8 * 2 + 4)  # 960: bf16 output + fp32 LSE, written + read
    assert t.assembled == 3032 + 960


def test_flops_and_floors_by_hand():
    flops = count_flops(PROMPTS, tail=3, beams=3, heads=4, head_dim=8)
    assert flops == 4 * 8 * 4 * 3 * ((5 + 3) + (9 + 3)) == 7680
    f = floor_times(hand_traffic(), flops, bandwidth=1e9, matmul_rate=1e9)
    assert f["memory_us"] == pytest.approx(3.032)
    assert f["assembled_memory_us"] == pytest.approx(3.992)
    assert f["compute_us"] == pytest.approx(7.68)
    assert f["floor_us"] == pytest.approx(7.68)  # compute bound here: max of the two
    f = floor_times(hand_traffic(), flops, bandwidth=1e8, matmul_rate=None)
    assert f["floor_us"] == pytest.approx(30.32) and f["compute_us"] is None
    assert floor_times(hand_traffic(), flops, None, None)["floor_us"] is None


def test_stage_work_by_hand():
    t = hand_traffic()
    kw = dict(traffic=t, flops=7680, prompt_lens=PROMPTS, tail=3, beams=3, heads=4, head_dim=8, page_size=4)
    assert stage_work("full", **kw) == {"bytes": 3032, "flops": 7680}
    # prefix: prompt KV 896 + q 384 + output/LSE written 480 + indptr 3 and 5 page indices (32).
    assert stage_work("prefix", **kw) == {"bytes": 896 + 384 + 480 + 32, "flops": 4 * 8 * 4 * 3 * 14}
    # tail: tail KV 448 + new K/V 768 + q 384 + out 384 + prefix state read 480 + the metadata's 152
    # less the prompt page indices and indptr the prefix counts (32).
    assert stage_work("tail", **kw) == {"bytes": 448 + 768 + 384 + 384 + 480 + 152 - 32, "flops": 4 * 8 * 4 * 6 * 3}


def test_distinct_tail_entries_against_a_set():
    rng = np.random.default_rng(1)
    anc = rng.integers(0, 5, size=(4, 5, 7))
    brute = len({(r, int(anc[r, b, g]), g) for r, b, g in itertools.product(range(4), range(5), range(7))})
    assert distinct_tail_entries(anc) == brute
    assert distinct_tail_entries(np.zeros((3, 4, 0), dtype=np.int32)) == 0
    ragged = anc.copy()
    ragged[1, :, 2:] = -1  # request 1 has generated 2 earlier tokens, request 3 none
    ragged[3] = -1
    brute = len({(r, int(ragged[r, b, g]), g) for r, b, g in itertools.product(range(4), range(5), range(7))
                 if ragged[r, b, g] >= 0})
    assert distinct_tail_entries(ragged) == brute


def test_ragged_tails_move_what_their_requests_move_alone():
    """A batch of per-request tails (in-flight batching) costs the sum of its requests as batches of one."""
    wl = build_workload(BenchShape(requests=5, beams=4, prompt=30, tail=12, heads=4, kv_heads=2, head_dim=16,
                                   page_size=8, prompt_jitter=0.5, tail_jitter=1.0), seed=4)
    tails = wl.tail_lens_host
    assert len(np.unique(tails)) > 1
    args = (4, 4, 2, 16, 8, 2)
    batch = count_traffic(wl.prompt_lens_host, tails, *args, wl.tail_ancestry)
    alone = [count_traffic(wl.prompt_lens_host[r:r + 1], int(tails[r]), *args,
                           wl.tail_ancestry[r:r + 1, :, :tails[r] - 1]) for r in range(5)]
    for term in ("prompt_kv", "tail_kv", "tail_kv_per_beam", "new_kv", "q", "out"):
        assert getattr(batch, term) == sum(getattr(a, term) for a in alone), term
    # Metadata too, but one indptr of R + 1 entries is shared, not R of 2 entries.
    assert batch.metadata == sum(a.metadata for a in alone) - 4 * (5 - 1)
    assert count_flops(wl.prompt_lens_host, tails, 4, 4, 16) == sum(
        count_flops(wl.prompt_lens_host[r:r + 1], int(tails[r]), 4, 4, 16) for r in range(5))
    flops = count_flops(wl.prompt_lens_host, tails, 4, 4, 16)
    assert stage_work("tail", batch, flops, wl.prompt_lens_host, tails, 4, 4, 16, 8)["flops"] == sum(
        stage_work("tail", a, 0, wl.prompt_lens_host[r:r + 1], int(tails[r]), 4, 4, 16, 8)["flops"]
        for r, a in enumerate(alone))


def test_traffic_of_a_built_workload_is_bounded_by_per_beam_reads():
    wl = build_workload(BenchShape(requests=3, beams=6, prompt=40, tail=9, heads=4, kv_heads=2, head_dim=16,
                                   page_size=8), seed=0)
    t = count_traffic(wl.prompt_lens_host, 9, 6, 4, 2, 16, 8, 2, wl.tail_ancestry)
    per_beam = count_traffic(wl.prompt_lens_host, 9, 6, 4, 2, 16, 8, 2, None)
    assert 0 < t.tail_kv < per_beam.tail_kv == t.tail_kv_per_beam


def test_compare_fails_poison_zeros_and_wrong_values():
    ref = torch.randn(6, 4, 8)
    good = ref.to(torch.bfloat16)
    assert compare(good, ref, torch.bfloat16).ok
    poisoned = good.clone()
    poisoned[3, 1, 5] = float("nan")
    r = compare(poisoned, ref, torch.bfloat16)
    assert not r.ok and r.nonfinite == 1 and "non-finite" in r.message
    assert not compare(torch.zeros_like(good), ref, torch.bfloat16).ok
    off = good.clone()
    off[0] += 0.1 * ref.abs().max()
    assert not compare(off, ref, torch.bfloat16).ok
    lse = torch.randn(6, 4)
    assert not compare(good, ref, torch.bfloat16, lse + 0.1, lse).ok
    assert compare(good, ref, torch.bfloat16, lse + 1e-3, lse).ok


def test_pick_check_requests():
    assert pick_check_requests(3, 4) == [0, 1, 2]
    picks = pick_check_requests(128, 4, seed=0)
    assert len(picks) == 4 and picks[0] == 0 and picks[-1] == 127 and picks == sorted(set(picks))


def test_a_point_floor_is_the_mean_of_its_input_sets():
    """The time of a point is a median over its sets, so its floor averages theirs (prompt lengths
    differ with jitter, ancestries always)."""
    from microbenchmarks.arms import PrefixStageArm
    from microbenchmarks.runner import Rates, RunOptions, run_point

    shape = BenchShape(requests=3, beams=4, prompt=40, tail=6, heads=4, kv_heads=2, head_dim=16, page_size=8,
                       prompt_jitter=0.5)
    point = run_point(shape, [PrefixStageArm("reference")], RunOptions(sets=3, iters=1, warmup=0, plan_repeats=0),
                      Rates(copy_bandwidth=1e12), "cpu")
    totals = []
    for i in range(3):
        wl = build_workload(shape, "cpu", seed=i)
        totals.append(count_traffic(wl.prompt_lens_host, 6, 4, 4, 2, 16, 8, 2, wl.tail_ancestry).total)
    assert len(set(totals)) > 1  # the sets differ, so the mean is not set 0's by chance
    assert point["traffic_bytes"]["total"] == round(sum(totals) / 3)


def test_a_prompt_that_ends_on_a_page_boundary_counts_one_tail_column():
    """P = 8, page 4, tail 3: the tail's positions 8..10 lie in column 2 alone (one column per row)."""
    t = count_traffic(np.array([8]), tail=3, beams=2, heads=4, kv_heads=2, head_dim=8, page_size=4, elem_bytes=2)
    # int32: 2 prompt pages, indptr 2, kv_len + prompt_len 2 x 2, indirection 2 x 2, one tail column per row: 2.
    assert t.metadata == 4 * (2 + 2 + 4 + 4 + 2)


def test_copy_bandwidth_counts_read_and_write(monkeypatch):
    from microbenchmarks import floors

    monkeypatch.setattr(floors, "_event_median_ms", lambda fn, iters, warmup: 2.0)
    assert floors.measure_copy_bandwidth("cpu", nbytes=1000, iters=1) == pytest.approx(2 * 1000 / 2e-3)


def test_matmul_rate_counts_2_n_cubed(monkeypatch):
    from microbenchmarks import floors

    monkeypatch.setattr(floors, "_event_median_ms", lambda fn, iters, warmup: 2.0)
    assert floors.measure_matmul_rate(torch.float32, "cpu", n=8, iters=1) == pytest.approx(2 * 8 ** 3 / 2e-3)


def test_rates_take_the_median_call(monkeypatch):
    """Calls of 1, 2 and 100 ms: a rate is timed by the middle one, not their mean."""
    from microbenchmarks import floors

    elapsed_ms = iter([1.0, 2.0, 100.0])
    event = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None,
                                  elapsed_time=lambda end: next(elapsed_ms))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    assert floors._event_median_ms(lambda: None, iters=3, warmup=0) == 2.0


def test_the_json_assembled_bytes_add_the_prefix_state():
    d = count_traffic(np.array([5, 9]), 3, 3, 4, 2, 8, 4, 2).to_dict()
    assert d["assembled"] == d["total"] + d["prefix_state_round_trip"] and d["prefix_state_round_trip"] > 0
