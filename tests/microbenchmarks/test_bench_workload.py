"""The benchmark's vectorised workload builder against the simulator's layout rules and the oracle."""

import numpy as np
import pytest
import torch

from beam_shared_prefix.reference import dense_attention, gather_beam_kv, reference_beam_attention
from beam_shared_prefix.testing import BeamSearchCacheSimulator
from microbenchmarks.arms import cascade_levels, per_beam_page_lists
from microbenchmarks.shapes import ANCESTRIES, BenchShape
from microbenchmarks.workload import (
    LayoutError,
    ancestry_from_parents,
    build_workload,
    ragged_ancestry,
    select_requests,
    validate_layout,
)


def small(**kw):
    base = dict(requests=3, beams=4, prompt=37, tail=6, heads=4, kv_heads=2, head_dim=16, page_size=8)
    base.update(kw)
    return BenchShape(**base)


def attend_page_lists(wl, indptr, indices, rows):
    """Float32 dense attention of each row over the pages it lists, in order (what a paged decode computes)."""
    Pg = wl.shape.page_size
    outs = []
    for i in rows.tolist():
        pages = torch.from_numpy(indices[indptr[i]:indptr[i + 1]]).long()
        L = int(wl.kv_lens[i])
        t = torch.arange(L)
        k, v = gather_beam_kv(wl.kv_cache, wl.kv_layout, pages[t // Pg][None], (t % Pg)[None])
        o, _ = dense_attention(wl.q[i:i + 1], k, v, torch.ones(1, L, dtype=torch.bool), 1.0 / wl.shape.head_dim ** 0.5)
        outs.append(o)
    return torch.cat(outs)


@pytest.mark.parametrize(
    "shape,layout",
    [
        (small(), "HND"),
        (small(prompt_jitter=0.5, tail=11), "NHD"),  # ragged prompts, tails crossing pages
        (small(prompt=32, tail=1), "HND"),  # prompt fills its last page; tail = this step's token only
        (small(prompt=5, beams=3, heads=6, kv_heads=2), "HND"),  # prompt shorter than a page, group 3
        (small(requests=6, tail=13, tail_jitter=1.0), "HND"),  # ragged tails (in-flight batching), 1 to 13
        (small(tail=10, ancestry="independent"), "NHD"),  # every beam its own parent: no shared generated row
    ],
)
def test_layout_follows_trtllm_rules_and_baselines_compute_the_oracle(shape, layout):
    wl = build_workload(shape, seed=3, kv_layout=layout)
    W = shape.beams
    counts = validate_layout(wl.beam_page_table, wl.prompt_lens_host, wl.kv_lens_host, W, shape.page_size,
                             wl.num_pages, wl.cache_indirection)
    assert counts["shared_pages"] == int((wl.prompt_lens_host // shape.page_size).sum())
    validate_layout(wl.baseline_page_table, wl.prompt_lens_host, wl.kv_lens_host, W, shape.page_size, wl.num_pages)
    lib_private = set(wl.page_table_host[wl.page_table_host < wl.num_pages].tolist())
    base_private = {int(p) for p in np.unique(wl.baseline_page_table_host[wl.baseline_page_table_host < wl.num_pages])}
    assert len(lib_private & base_private) == counts["shared_pages"]  # only the shared prompt pages overlap
    tails = wl.tail_lens_host
    assert ((tails >= shape.shortest_tail) & (tails <= shape.tail)).all() and tails.max() == shape.tail
    if shape.tail_jitter:
        assert len(np.unique(tails)) > 1, tails  # the case must really be ragged
    assert (wl.kv_lens.cpu().numpy() == np.repeat(wl.prompt_lens_host + tails, W)).all()
    # Prompt positions map to beam 0; a request's earlier tail positions hold its simulated ancestry.
    ind = wl.cache_indirection.cpu().numpy()
    for r in range(shape.requests):
        P, T = wl.prompt_lens_host[r], tails[r]
        assert (ind[r, :, :P] == 0).all()
        assert (ind[r, :, P:P + T - 1] == wl.tail_ancestry[r, :, :T - 1]).all()
        assert (wl.tail_ancestry[r, :, T - 1:] == -1).all()
        if shape.ancestry == "independent":
            assert (wl.tail_ancestry[r, :, :T - 1] == np.arange(W)[:, None]).all()

    rows = torch.arange(wl.num_rows)
    oracle = reference_beam_attention(wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                                      wl.cache_indirection, W, new_k=wl.new_k, new_v=wl.new_v, kv_layout=layout)
    # Per-beam decode page lists read the materialised history: exactly the oracle's function.
    indptr, indices, last = per_beam_page_lists(wl)
    assert ((last >= 1) & (last <= shape.page_size)).all()
    torch.testing.assert_close(attend_page_lists(wl, indptr, indices, rows), oracle, rtol=1e-5, atol=1e-5)
    # The cascade's two levels, concatenated per row, are the same page lists.
    if (wl.prompt_lens_host >= shape.page_size).all():
        (qo0, kv0, idx0, last0), (qo1, kv1, idx1, last1) = cascade_levels(wl)
        assert (last0 == shape.page_size).all() and (last1 == last).all() and (qo0 == np.arange(shape.requests + 1) * W).all()
        for i in range(wl.num_rows):
            r = i // W
            joined = np.concatenate([idx0[kv0[r]:kv0[r + 1]], idx1[kv1[i]:kv1[i + 1]]])
            assert (joined == indices[indptr[i]:indptr[i + 1]]).all()
    else:
        from microbenchmarks.arms import ArmSkipped

        with pytest.raises(ArmSkipped, match="shorter than one page"):
            cascade_levels(wl)


def test_the_library_reads_garbage_if_it_ignores_the_indirection():
    """The layout is discriminating: reading each beam's own pages for the tail gives a wrong answer."""
    wl = build_workload(small(tail=8), seed=5)
    W = wl.beam_width
    oracle = reference_beam_attention(wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                                      wl.cache_indirection, W, new_k=wl.new_k, new_v=wl.new_v)
    own = torch.arange(W, dtype=torch.int32)[None, :, None].expand_as(wl.cache_indirection).contiguous()
    wrong = reference_beam_attention(wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens, own, W,
                                     new_k=wl.new_k, new_v=wl.new_v)
    assert (wrong - oracle).abs().max() > 0.05


def test_simulator_steps_satisfy_the_same_layout_rules():
    sim = BeamSearchCacheSimulator([37, 8, 20], beam_width=3, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                   page_size=8, max_seq_len=64, seed=1)
    for _ in range(5):
        step = sim.begin_step()
        plens = step.prompt_lens_per_request.numpy()
        klens = step.kv_lens.numpy()[::3]
        validate_layout(step.beam_page_table, plens, klens, 3, 8, step.num_pages, step.cache_indirection)
        sim.end_step()


def test_validate_layout_catches_broken_sharing_and_privacy():
    wl = build_workload(small(prompt=37, tail=3), seed=0)
    args = (wl.prompt_lens_host, wl.kv_lens_host, wl.beam_width, wl.shape.page_size, wl.num_pages)
    t = wl.page_table_host.copy()
    t[1, 0] = t[wl.beam_width, 0]  # beam 1 of request 0 reads another request's prompt page
    with pytest.raises(LayoutError, match="must be shared"):
        validate_layout(t, *args)
    t = wl.page_table_host.copy()
    col = 37 // 8
    t[1, col] = t[2, col]  # two beams share a private (partial prompt) page
    with pytest.raises(LayoutError, match="private pages must be unique"):
        validate_layout(t, *args)
    t = wl.page_table_host.copy()
    t[0, 0] = wl.num_pages
    with pytest.raises(LayoutError, match="outside"):
        validate_layout(t, *args)


def test_ancestry_matches_a_forward_beam_search():
    """The backward composition equals the simulator's forward rule (reorder history, then write),
    also when each request has run its own number of steps (ragged tails: ``-1`` past them)."""
    rng = np.random.default_rng(0)
    G, R, W = 6, 4, 5
    parents = rng.integers(0, W, size=(G, R, W))
    tail_lens = np.array([G + 1, 1, 3, G + 1])  # T_r = steps run + this step's token
    full, ragged = ancestry_from_parents(parents), ragged_ancestry(parents, tail_lens)
    for r in range(R):
        steps = int(tail_lens[r]) - 1
        hist = np.zeros((W, 0), dtype=np.int64)
        for g in range(G):
            hist = np.concatenate([hist, np.arange(W)[:, None]], axis=1)  # beam b writes position g
            hist = hist[parents[g, r]]  # new beam b inherits its parent's whole history
            if g + 1 == steps:
                assert (ragged[r, :, :steps] == hist).all()
        assert (full[r] == hist).all()
        assert (ragged[r, :, steps:] == -1).all()


def test_ancestries_change_only_where_the_tail_comes_from():
    """One seed, every ancestry: the same queries, K/V inputs, prompt lengths and page tables; only the
    indirection of the earlier tail positions differs. Beam search shares the most generated rows between
    beams (the floor counts fewer distinct tail rows than per-beam reads), uniform parents fewer (their
    histories coalesce about 2W steps back), independent beams none."""
    from microbenchmarks.floors import count_traffic

    shape = small(requests=8, beams=8, tail=24)
    built = {a: build_workload(BenchShape(**{**shape.to_dict(), "ancestry": a}), seed=7) for a in ANCESTRIES}
    searched = built["beam-search"]
    for other in ("uniform", "independent"):
        for name in ("q", "new_k", "new_v", "kv_lens", "prompt_lens"):
            assert torch.equal(getattr(searched, name), getattr(built[other], name)), (other, name)
        assert (searched.page_table_host == built[other].page_table_host).all()
        assert not (searched.tail_ancestry == built[other].tail_ancestry).all()
    args = (shape.tail, shape.beams, shape.heads, shape.kv_heads, shape.head_dim, shape.page_size, 2)
    traffic = {a: count_traffic(wl.prompt_lens_host, *args, tail_ancestry=wl.tail_ancestry) for a, wl in built.items()}
    per_beam = traffic["independent"].tail_kv_per_beam
    assert all(t.tail_kv_per_beam == per_beam for t in traffic.values())
    assert per_beam == traffic["independent"].tail_kv > traffic["uniform"].tail_kv > traffic["beam-search"].tail_kv


def test_select_requests_is_a_valid_sub_batch():
    wl = build_workload(small(requests=4, prompt_jitter=0.4), seed=2)
    sub = select_requests(wl, [1, 3])
    W = wl.beam_width
    ref_all = reference_beam_attention(wl.q, wl.kv_cache, wl.beam_page_table, wl.kv_lens, wl.prompt_lens,
                                       wl.cache_indirection, W, new_k=wl.new_k, new_v=wl.new_v)
    ref_sub = reference_beam_attention(sub["q"], wl.kv_cache, sub["beam_page_table"], sub["kv_lens"],
                                       sub["prompt_lens"], sub["cache_indirection"], W, new_k=sub["new_k"],
                                       new_v=sub["new_v"])
    torch.testing.assert_close(ref_sub, ref_all[sub["rows"]])
    assert sub["prompt_page_indptr"][-1] == len(sub["prompt_page_indices"])
