"""Beam-search KV-cache simulator: page allocation, cache_indirection, batch changes, encodings."""

import numpy as np
import pytest
import torch

from beam_shared_prefix.plan import cdiv
from beam_shared_prefix.testing import PAGE_TABLE_PAD, BeamSearchCacheSimulator


def make_sim(prompts, beam_width=3, page_size=4, max_seq_len=40, **kw):
    kw.setdefault("dtype", torch.float32)
    return BeamSearchCacheSimulator(prompts, beam_width=beam_width, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                                    page_size=page_size, max_seq_len=max_seq_len, **kw)


def row_pages(step, i):
    """The pages held by beam row ``i`` (page table entries up to its current position)."""
    n = cdiv(int(step.kv_lens[i]), step.page_size)
    pages = step.beam_page_table[i, :n].tolist()
    assert PAGE_TABLE_PAD not in pages
    assert (step.beam_page_table[i, n:] == PAGE_TABLE_PAD).all(), "entries past the row's pages must be padding"
    return pages


def check_allocation(sim, step):
    """TensorRT-LLM's beam-search allocation, checked on one step's inputs."""
    W, pg = step.beam_width, step.page_size
    owner = {}
    for r, rid in enumerate(step.request_ids):
        P = int(step.prompt_lens_per_request[r])
        L = int(step.kv_lens[r * W])
        assert (step.kv_lens[r * W:(r + 1) * W] == L).all(), "all beams of a request have the same length"
        assert (step.prompt_lens[r * W:(r + 1) * W] == P).all()
        tables = [row_pages(step, r * W + b) for b in range(W)]
        n_full = P // pg
        for b in range(W):
            assert tables[b][:n_full] == tables[0][:n_full], "full prompt pages are shared by all beams"
        # Partial last prompt page and every generated page: private per beam.
        for col in range(n_full, len(tables[0])):
            column = [tables[b][col] for b in range(W)]
            assert len(set(column)) == W, f"request {rid} column {col} is not private per beam: {column}"
        request_pages = {p for t in tables for p in t}
        assert len(request_pages) == n_full + W * (len(tables[0]) - n_full)
        for p in request_pages:
            assert 0 <= p < sim.num_pages
            assert owner.setdefault(p, rid) == rid, f"page {p} held by requests {owner[p]} and {rid}"
        # Beam 0's whole page list is the planner's input.
        a, z = int(step.prompt_page_indptr[r]), int(step.prompt_page_indptr[r + 1])
        assert step.prompt_page_indices[a:z].tolist() == tables[0]
        # The current token's slot is in the row's own page.
        for b in range(W):
            i = r * W + b
            assert int(step.write_page[i]) == tables[b][(L - 1) // pg] and int(step.write_slot[i]) == (L - 1) % pg
        # Prompt positions map to beam 0.
        assert (step.cache_indirection[r, :, :P] == 0).all()
    assert set(owner).isdisjoint(int(p) for p in sim.free_pages), "a held page is also on the free list"
    assert len(owner) + len(sim.free_pages) == sim.num_pages, "pages leaked"


def gather_k(sim, step, i, t):
    """K of history position ``t`` of beam row ``i``, read through the indirection and the page table."""
    W, pg = step.beam_width, step.page_size
    r, b = divmod(i, W)
    src = 0 if t < int(step.prompt_lens[i]) else int(step.cache_indirection[r, b, t])
    return sim.read_kv(int(step.beam_page_table[r * W + src, t // pg]), t % pg)[0]


class Genealogy:
    """A hand-written beam-search sampler's view: each beam's generated tokens (and the beam that wrote them).

    After a step where beam ``c`` wrote K ``k_c`` at position ``pos``, new beam ``b`` with parent
    ``p`` continues ``p``: its history is ``p``'s history plus ``k_p``, written by beam ``p``.
    """

    def __init__(self):
        self.keys = {}  # rid -> per beam list of K tensors at positions P, P+1, ...
        self.writers = {}  # rid -> per beam list of writer beams

    def check(self, sim, step):
        W = step.beam_width
        for r, rid in enumerate(step.request_ids):
            self.keys.setdefault(rid, [[] for _ in range(W)])
            self.writers.setdefault(rid, [[] for _ in range(W)])
            P = int(step.prompt_lens_per_request[r])
            L = int(step.kv_lens[r * W])
            for b in range(W):
                assert len(self.keys[rid][b]) == L - 1 - P
                assert step.cache_indirection[r, b, P:L - 1].tolist() == self.writers[rid][b]
                for j, k in enumerate(self.keys[rid][b]):
                    torch.testing.assert_close(gather_k(sim, step, r * W + b, P + j), k, rtol=0, atol=0)

    def advance(self, step, parents):
        W = step.beam_width
        for r, rid in enumerate(step.request_ids):
            keys, writers = self.keys[rid], self.writers[rid]
            new_k = [step.new_k[r * W + b].clone() for b in range(W)]
            self.keys[rid] = [keys[p] + [new_k[p]] for p in parents[r]]
            self.writers[rid] = [writers[p] + [int(p)] for p in parents[r]]


def prompt_snapshot(sim, step):
    return {rid: torch.stack([gather_k(sim, step, r * step.beam_width, t)
                              for t in range(int(step.prompt_lens_per_request[r]))])
            for r, rid in enumerate(step.request_ids)}


@pytest.mark.parametrize(
    "prompts,beam_width,max_beam_width,page_size,kv_layout",
    [
        ([5, 8, 1, 13, 4], 3, None, 4, "HND"),  # partial, aligned, one token, several pages
        ([1, 16, 7], 4, 6, 8, "NHD"),  # max_beam_width > beam_width
        ([3, 2], 1, 2, 2, "HND"),  # a single beam
    ],
)
def test_simulated_run_invariants(prompts, beam_width, max_beam_width, page_size, kv_layout):
    sim = make_sim(prompts, beam_width=beam_width, page_size=page_size, max_beam_width=max_beam_width,
                   kv_layout=kv_layout, seed=len(prompts))
    W_max = max_beam_width or beam_width
    rng = np.random.default_rng(0)
    gen = Genealogy()
    prompt_k = {}
    for step_no in range(14):
        if step_no == 4:  # a request joins mid-run: tails of different lengths in one batch
            sim.add_requests([page_size + 1])
        if step_no == 9:  # one leaves
            sim.finish([sim.requests[0].rid])
        step = sim.begin_step()
        assert step.cache_indirection.shape == (len(step.request_ids), W_max, sim.max_seq_len)
        assert step.cache_indirection.dtype == torch.int32
        assert (step.cache_indirection[:, beam_width:] == 0).all(), "beams past W are never touched"
        check_allocation(sim, step)
        gen.check(sim, step)
        for rid, k in prompt_snapshot(sim, step).items():  # generated writes never land on prompt slots
            torch.testing.assert_close(prompt_k.setdefault(rid, k), k, rtol=0, atol=0)
        torch.testing.assert_close(step.tail_lens, step.kv_lens - step.prompt_lens)
        parents = rng.integers(0, beam_width, size=(len(step.request_ids), beam_width)) if step_no % 2 else None
        used = sim.end_step(parents=parents)
        if parents is not None:
            np.testing.assert_array_equal(used, parents)
        gen.advance(step, used)
    tails = step.tail_lens.tolist()
    assert len(set(tails)) > 1, "the batch should mix tail lengths"
    assert max(tails) > page_size, "some tail should cross a page"


def test_partial_prompt_page_holds_prompt_only_in_beam_0():
    sim = make_sim([6, 8], beam_width=3, page_size=4)
    step = sim.begin_step()
    W = 3
    # Request 0: prompt 6 = one full page + 2 tokens in a private page per beam.
    partial = [int(step.beam_page_table[b, 1]) for b in range(W)]
    k0 = sim.read_kv(partial[0], slice(0, 2))[0]
    for b in range(1, W):
        assert not torch.equal(sim.read_kv(partial[b], slice(0, 2))[0], k0), "prompt tokens copied to other beams"
        assert int(step.beam_page_table[b, 0]) == int(step.beam_page_table[0, 0])
    # Request 1: block-aligned prompt: both prompt pages shared, no private prompt page; this
    # step's token (position 8) opens a private page per beam.
    rows = step.beam_page_table[W:2 * W]
    assert (rows[:, :2] == rows[0, :2]).all()
    assert len(set(rows[:, 2].tolist())) == W
    assert (rows[:, 3:] == PAGE_TABLE_PAD).all()


def test_indirection_update_hand_computed():
    # W=3, prompt 2: positions 0-1 are prompt (beam 0); steps write positions 2, 3, 4.
    sim = make_sim([2], beam_width=3, page_size=4, max_seq_len=8)
    expected = []
    for parents in ([2, 0, 0], [1, 1, 2], [2, 0, 1]):
        sim.begin_step()
        sim.end_step(parents=np.array([parents]))
        expected.append(sim.cache_indirection_full[0, :, :5].tolist())
    # After step 1 (pos 2, parents 2,0,0): beam b's pos 2 was written by its parent.
    assert [row[:3] for row in expected[0]] == [[0, 0, 2], [0, 0, 0], [0, 0, 0]]
    # Step 2 (pos 3, parents 1,1,2): histories before it: b0 [.,.,2], b1 [.,.,0], b2 [.,.,0].
    assert [row[:4] for row in expected[1]] == [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 2]]
    # Step 3 (pos 4, parents 2,0,1).
    assert expected[2] == [[0, 0, 0, 2, 2], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_finish_frees_pages_and_compacts_batch():
    sim = make_sim([5, 9, 3], beam_width=2, page_size=4)
    for _ in range(3):
        sim.begin_step()
        sim.end_step()
    before = sim.begin_step()
    sim.end_step()
    rid_mid = before.request_ids[1]
    held_mid = {p for b in range(2) for p in row_pages(before, 2 + b)}
    free_before = len(sim.free_pages)
    sim.finish([rid_mid])
    assert len(sim.free_pages) == free_before + len(held_mid)
    assert held_mid <= {int(p) for p in sim.free_pages}
    step = sim.begin_step()
    assert step.request_ids == [before.request_ids[0], before.request_ids[2]]
    assert step.num_rows == 4 and step.q.shape[0] == 4 and step.cache_indirection.shape[0] == 2
    # The remaining requests keep their pages, now in rows 0-1 and 2-3.
    for new_r, old_r in ((0, 0), (1, 2)):
        for b in range(2):
            old = row_pages(before, old_r * 2 + b)
            assert row_pages(step, new_r * 2 + b)[: len(old)] == old
    check_allocation(sim, step)
    sim.end_step()
    # Freed pages and the slot are reused by a new request.
    sim.add_requests([30])
    step = sim.begin_step()
    assert held_mid & set(row_pages(step, 4))
    check_allocation(sim, step)
    sim.end_step()
    sim.finish(step.request_ids)
    assert len(sim.free_pages) == sim.num_pages
    with pytest.raises(RuntimeError, match="no request left"):
        sim.begin_step()


def test_repeated_begin_step_does_not_leak_pages():
    sim = make_sim([4], beam_width=3, page_size=4)  # position 4 opens a new page per beam
    first = sim.begin_step()
    free = len(sim.free_pages)
    second = sim.begin_step()
    assert len(sim.free_pages) == free
    torch.testing.assert_close(second.beam_page_table, first.beam_page_table, rtol=0, atol=0)
    sim.end_step()
    check_allocation(sim, sim.begin_step())


def test_block_offsets_encoding():
    sim = make_sim([5, 9], beam_width=2, page_size=4)
    step = sim.begin_step()
    div = 3 * 2  # layers_in_pool * kv_factor
    offsets = sim.block_offsets(step.beam_page_table, div)
    assert offsets.shape == (step.num_rows, 2, step.beam_page_table.shape[1]) and offsets.dtype == torch.int32
    table = step.beam_page_table.long()
    pad = table == PAGE_TABLE_PAD
    k, v = offsets[:, 0].long(), offsets[:, 1].long()
    assert (k[~pad] == table[~pad] * div).all()
    assert (v == k + 1).all()
    assert (k[pad] == PAGE_TABLE_PAD).all()
    # The K-field view with the divisor is the page table again (what a kernel reads).
    k_view = offsets[:, 0, :]
    assert k_view.stride(0) == 2 * table.shape[1]
    assert ((k_view.long() // div)[~pad] == table[~pad]).all()


def test_step_tensors_are_random_and_well_formed():
    sim = make_sim([5, 9], beam_width=2, page_size=4, dtype=torch.bfloat16, kv_layout="NHD")
    assert sim.kv_cache.shape == (sim.num_pages, 2, 4, 2, 8) and sim.kv_cache.dtype == torch.bfloat16
    assert sim.kv_cache.float().std() > 0.5, "the pool must start as random data"
    step = sim.begin_step()
    assert step.q.shape == (4, 4, 8) and step.new_k.shape == (4, 2, 8) and step.new_v.shape == (4, 2, 8)
    for t in (step.q, step.new_k, step.new_v):
        assert t.dtype == torch.bfloat16 and t.float().std() > 0.5
    for t in (step.beam_page_table, step.kv_lens, step.prompt_lens, step.prompt_lens_per_request,
              step.cache_indirection, step.prompt_page_indptr, step.prompt_page_indices):
        assert t.dtype == torch.int32
    sim.end_step()
    # end_step stores each row's new K/V at its slot.
    for i in range(step.num_rows):
        k, v = sim.read_kv(int(step.write_page[i]), int(step.write_slot[i]))
        torch.testing.assert_close(k, step.new_k[i], rtol=0, atol=0)
        torch.testing.assert_close(v, step.new_v[i], rtol=0, atol=0)


def test_simulator_refuses_bad_use():
    with pytest.raises(ValueError, match=r"prompt_len=0 must be in \[1, max_seq_len=40\)"):
        make_sim([0])
    with pytest.raises(ValueError, match=r"beam_width=4 > max_beam_width=2"):
        make_sim([3], beam_width=4, max_beam_width=2)
    sim = make_sim([3], beam_width=2)
    with pytest.raises(RuntimeError, match="end_step\\(\\) without begin_step\\(\\)"):
        sim.end_step()
    sim.begin_step()
    with pytest.raises(ValueError, match=r"parents must be \[1, 2\] ints in \[0, 2\)"):
        sim.end_step(parents=np.array([[0, 2]]))
    small = make_sim([8], beam_width=2, page_size=4, num_pages=4)
    small.begin_step()
    small.end_step()
    with pytest.raises(RuntimeError, match="pool of 4 pages is full"):
        for _ in range(4):
            small.begin_step()
            small.end_step()
    short = make_sim([3], beam_width=1, page_size=4, max_seq_len=4)
    short.begin_step()
    short.end_step()
    with pytest.raises(RuntimeError, match="reached max_seq_len=4"):
        short.begin_step()
