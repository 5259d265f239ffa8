"""Check mode's index stage (:func:`beam_shared_prefix.check.check_indices`), called directly.

- Against an independent model of the K/V a step reads and writes: random beam-search steps, with one page-table
  entry the step uses moved anywhere in the pool, hold the rule to its promises. A write onto a slot that holds
  another position's K/V is refused, and so is a table under which one slot stands for two positions of one
  request; an entry moved to an unused page is not.
- One edited input a test, its verdict and message stated from the definitions of the inputs: entries outside the
  pool, the cache's capacity, what the warm-up layouts spare (and no more), ``cache_indirection``, and which fault a
  refusal names first. (A mutation-testing pass over this module found these unpinned.)

The wrapper-level tests (``tests/test_attention.py``) name each refused layout through ``run()``."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beam_shared_prefix.check import BeamSharedPrefixCheckError, check_indices
from beam_shared_prefix.plan import PlanError, build_step_plan
from beam_shared_prefix.testing import PAGE_TABLE_PAD, BeamSearchCacheSimulator
from check_oracle import steps, unsafe

PAGE_SIZE = 4
SEED = 0  # the pages and the simulator's draws; any seed gives the same verdicts


def _positions_by_slot(step, table: torch.Tensor) -> dict:
    """``{slot: {(request, owner row, position, written)}}`` for every slot (``page * PAGE_SIZE + offset``) the step
    reads or writes: the prompt is beam 0's (read through the plan's pages), an earlier generated position that of
    the beam ``cache_indirection`` names (read from that beam's page), this step's position the row's own (written
    into its page). Plain Python, from the definitions of the inputs (trtllm-interfaces.md), not from check mode's
    code."""
    W = step.beam_width
    indptr, indices = step.prompt_page_indptr.tolist(), step.prompt_page_indices.tolist()
    slots = defaultdict(set)
    for row in range(step.num_rows):
        req, beam = divmod(row, W)
        plen, cur = int(step.prompt_lens[row]), int(step.kv_lens[row]) - 1
        for t in range(cur + 1):
            col, off = divmod(t, PAGE_SIZE)
            if t < plen:
                owner, page = req * W, indices[indptr[req] + col]
            else:
                owner = req * W + (int(step.cache_indirection[req, beam, t]) if t < cur else beam)
                page = int(table[owner, col])
            slots[page * PAGE_SIZE + off].add((req, owner, t, t == cur))
    return slots


def _must_refuse(slots: dict):
    """A slot the step writes that holds another position too, or a slot holding two positions of one request
    (another request may read a slot of a full page it shares: block reuse): ``(slot, positions)`` or ``None``."""
    for slot, keys in slots.items():
        if len(keys) > 1 and (any(k[3] for k in keys) or len({k[0] for k in keys}) < len(keys)):
            return slot, sorted(keys)
    return None


@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.integers(1, 10), min_size=1, max_size=3), beams=st.integers(1, 4),
       steps=st.integers(0, 9), seed=st.integers(0, 2**16), data=st.data())
def test_a_slot_written_over_or_shared_in_a_request_is_refused_and_an_unused_page_is_not(prompts, beams, steps,
                                                                                           seed, data):
    sim, step, check = _sim_step(prompts, beams, steps, seed)  # (the simulator's own table passes)
    assert _must_refuse(_positions_by_slot(step, step.beam_page_table)) is None
    # One entry a row holds past its prompt's full pages: its write column, or an earlier one.
    row = data.draw(st.integers(0, step.num_rows - 1), label="row")
    plen, cur = int(step.prompt_lens[row]), int(step.kv_lens[row]) - 1
    col = data.draw(st.integers(plen // PAGE_SIZE, cur // PAGE_SIZE), label="col")
    used = set(step.beam_page_table[step.beam_page_table != PAGE_TABLE_PAD].tolist())
    unused = sorted(set(range(sim.num_pages)) - used)
    page = data.draw(st.sampled_from(sorted(used)) | st.sampled_from(unused), label="page")
    table = step.beam_page_table.clone()
    table[row, col] = page
    bad = _must_refuse(_positions_by_slot(step, table))
    if bad:
        try:
            check(table)
        except BeamSharedPrefixCheckError as e:
            assert e.stage == "indices"
        else:
            raise AssertionError(f"beam_page_table[{row}, {col}] = {page}: slot {bad[0]} holds (request, owner row, "
                                 f"position, written) {bad[1]}, and check mode let it through")
    # (beam 0's partly filled prompt page moved is a table unlike the plan: refused, rightly)
    elif page in unused and not (row % beams == 0 and col * PAGE_SIZE < plen):
        check(table)


def test_a_generated_page_reused_as_another_requests_prompt_passes():
    """Block reuse with beam width 1: TensorRT-LLM's C++ manager stores a running request's newest full block for
    reuse (only at beam width 1), so a later request whose prompt continues the first one's tokens reads that
    generated block as a full prompt page. The first request never writes it again and the second only reads it:
    no slot stands for two positions of one request, and nothing is written over. Moved onto the first request's
    write page instead, it is refused."""
    # page size 4; request 0: a 4-token prompt on page 3, positions 4-7 on page 7, this step's position 8 on page 9;
    # request 1: a 9-token prompt (request 0's first 8 tokens and one more) on pages 3, 7 and 12, at position 9.
    plan = build_step_plan(np.array([0, 1, 4]), np.array([3, 3, 7, 12]), np.array([4, 9]), 1, PAGE_SIZE, 16)
    table = torch.tensor([[3, 7, 9, 0], [3, 7, 12, 0]], dtype=torch.int32)
    kv_lens = torch.tensor([9, 10], dtype=torch.int32)
    pool = torch.randn(16, 2, 1, PAGE_SIZE, 8)
    indirection = torch.zeros(2, 1, 16, dtype=torch.int32)
    check_indices(plan, pool, PAGE_SIZE, table, kv_lens, indirection)
    plan = build_step_plan(np.array([0, 1, 4]), np.array([3, 3, 9, 12]), np.array([4, 9]), 1, PAGE_SIZE, 16)
    table[1, 1] = 9
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=r"row 0 \(request 0, beam 0\) writes .* a prompt page of request 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, indirection)


def test_a_one_beam_requests_filled_prompt_page_reused_by_another_passes_until_it_is_written():
    """One beam: request 0's 6-token prompt ends partly into page 7, which its generated tokens 6-7 then filled, and
    block reuse gave request 1 that page as a full prompt page. The planner cannot see that page 7 is full, so at
    one beam it lets it be (with more beams it refuses: the beams of a request copy that page); check mode, which
    sees the lengths, passes it while request 0 writes past page 7, and refuses a write into it, naming request 1."""
    a, b, c, d = _pages(SEED, 4, 16)
    # request 0: prompt on (a, b), position 9 on page c; request 1: a 9-token prompt on (a, b, d), at position 9.
    with pytest.raises(PlanError, match=rf"request 0: its last prompt page {b} holds 2 of 4 tokens"):
        build_step_plan([0, 2, 5], [a, b, a, b, d], [6, 9], 2, PAGE_SIZE, 16)
    plan = build_step_plan([0, 2, 5], [a, b, a, b, d], [6, 9], 1, PAGE_SIZE, 16)
    table = torch.tensor([[a, b, c], [a, b, d]], dtype=torch.int32)
    pool, indirection = torch.randn(16, 2, 1, PAGE_SIZE, 8), torch.zeros(2, 1, 16, dtype=torch.int32)
    check_indices(plan, pool, PAGE_SIZE, table, torch.tensor([10, 10], dtype=torch.int32), indirection)
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"row 0 \(request 0, beam 0\) writes .* at position 7 .* = page {b}, a prompt page of "
                             rf"request 1"):
        check_indices(plan, pool, PAGE_SIZE, table, torch.tensor([8, 10], dtype=torch.int32), indirection)


def _sim_step(prompts, beams, steps, seed):
    """A simulated beam-search step after ``steps`` decode steps, its plan, and a checker of edited inputs."""
    sim = BeamSearchCacheSimulator(list(prompts), beam_width=beams, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                   page_size=PAGE_SIZE, max_seq_len=40, dtype=torch.float32, seed=seed)
    for _ in range(steps):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, beams,
                           PAGE_SIZE, sim.num_pages)

    def check(table=None, kv_lens=None, indirection=None, **kw):
        return check_indices(plan, sim.kv_cache, PAGE_SIZE,
                             step.beam_page_table if table is None else table,
                             step.kv_lens if kv_lens is None else kv_lens,
                             step.cache_indirection if indirection is None else indirection, **kw)

    check()  # the simulator's own step passes
    return sim, step, check


def _pages(seed, n, pool):
    """``n`` distinct page numbers drawn at random from a pool of ``pool`` pages."""
    return [int(p) for p in np.random.default_rng(seed).permutation(pool)[:n]]


# ------------------------------------------------------------------------------------------
# page-table entries outside the pool


@pytest.mark.parametrize("value", ["pool size", "-1"])
@pytest.mark.parametrize("column", ["copy of the partly filled prompt page", "write column"])
def test_a_used_entry_outside_the_pool_is_named_by_its_row_and_column(value, column):
    """Every entry the step uses lies in ``[0, num_pages)``: the pool size itself (one past the last page) and a
    negative page too, also in a beam's copy of its prompt's partly filled last page (a column other beams read
    through ``cache_indirection``). The message names the entry as ``beam_page_table[row, column]``."""
    W = 3
    sim, step, check = _sim_step((6, 9), W, steps=6, seed=SEED)
    row = W + 1  # request 1 (a 9-token prompt: pages 0-1 full, page 2 holds 1 prompt token), beam 1
    col = 2 if column.startswith("copy") else int(step.kv_lens[row] - 1) // PAGE_SIZE
    assert int(step.prompt_lens[row]) == 9 and col in (2, 3) and col != row
    bad = sim.num_pages if value == "pool size" else -1
    table = step.beam_page_table.clone()
    table[row, col] = bad
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*beam_page_table\[{row}, {col}\]={bad} // page_index_divisor=1 = "
                             rf"page {bad}, outside the pool \[0, {sim.num_pages}\)"):
        check(table)


def test_a_plan_made_for_a_larger_pool_is_named_as_such():
    """A plan whose prompt page is the pool size (made for a pool one page larger) is refused at the plan's page,
    before the table is looked at, with the pool sizes named."""
    pool_pages = 12
    a, _, c = _pages(SEED, 3, pool_pages)
    W = 2
    # one request, a 6-token prompt on pages (a, pool_pages); beam 1's copy of the partly filled page is c
    plan = build_step_plan([0, 2], [a, pool_pages], [6], W, PAGE_SIZE, pool_pages + 1)
    table = torch.tensor([[a, pool_pages], [a, c]], dtype=torch.int32)
    pool = torch.randn(pool_pages, 2, 1, PAGE_SIZE, 8)
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*the plan's prompt page {pool_pages} \(flat index 1\) is outside the "
                             rf"pool of {pool_pages} pages.*num_cache_pages={pool_pages + 1}"):
        check_indices(plan, pool, PAGE_SIZE, table, torch.tensor([7, 7]), torch.zeros(1, W, 16, dtype=torch.int32))


# ------------------------------------------------------------------------------------------
# the capacity a row's kv_len may reach


def test_kv_lens_past_a_table_narrower_than_cache_indirection_are_refused():
    """The capacity is the page table's columns x page size where that is less than ``cache_indirection``'s
    ``max_seq_len``: a kv_len one past the table's positions is refused by name, though ``cache_indirection``
    would hold it."""
    W = 2
    _, step, check = _sim_step((6, 9), W, steps=2, seed=SEED)
    cols = -(-int(step.kv_lens.max()) // PAGE_SIZE)
    table = step.beam_page_table[:, :cols].clone()  # just the columns the step uses
    capacity = cols * PAGE_SIZE
    assert capacity < step.cache_indirection.shape[2]
    check(table)  # the narrow table holds this step
    kv_lens = step.kv_lens.clone()
    kv_lens[:W] = capacity + 1  # request 0, every beam
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*kv_lens\[0\]={capacity + 1} exceeds the cache capacity of "
                             rf"{capacity} positions"):
        check(table, kv_lens)


# ------------------------------------------------------------------------------------------
# warm-up layouts: what is spared, and no more


@pytest.mark.parametrize("layout", ["beams share the dummy page", "beam 1 on another request's prompt page"])
def test_padding_rows_are_not_judged_by_their_write_pages(layout):
    """A padding request (no prompt, ``kv_len`` 1, planned with a one-token prompt) writes nothing, so where its
    beam 1's page points is never judged: on the page its beam 0 writes, or on another request's full prompt page."""
    W = 2
    a, b, c, d, e = _pages(SEED, 5, 16)
    # request 0: a 5-token prompt on (a, b), at position 6; beam 1's copy of the partly filled page is c.
    # request 1: a padding request on d.
    plan = build_step_plan([0, 2, 3], [a, b, d], [5, 1], W, PAGE_SIZE, 16)
    beam1 = d if layout.startswith("beams share") else a
    table = torch.tensor([[a, b], [a, c], [d, e], [beam1, e]], dtype=torch.int32)
    kv_lens = torch.tensor([7, 7, 1, 1], dtype=torch.int32)
    warm = check_indices(plan, torch.randn(16, 2, 1, PAGE_SIZE, 8), PAGE_SIZE, table, kv_lens,
                         torch.zeros(2, W, 16, dtype=torch.int32))
    assert warm.padding.tolist() == [False, False, True, True]


@pytest.mark.parametrize("change", [None, "beam 1 page", "kv_len"])
def test_copies_of_a_request_must_hold_its_pages(change):
    """Two requests with one 5-token prompt on (a, b) are taken as copies of one request (a padded batch's dummy),
    and only the first copy's rows are judged. So the copies must be exact: same pages at every column they hold,
    same length. Two requests given one partly filled prompt page whose beams then part are refused, by row,
    column and value."""
    W = 2
    a, b, c, d = _pages(SEED, 4, 16)
    plan = build_step_plan([0, 2, 4], [a, b, a, b], [5, 5], W, PAGE_SIZE, 16)
    table = torch.tensor([[a, b], [a, c], [a, b], [a, c]], dtype=torch.int32)
    kv_lens = torch.tensor([7, 7, 7, 7], dtype=torch.int32)
    message = None
    if change == "beam 1 page":
        table[3, 1] = d
        message = rf"but beam_page_table\[3, 1\]={d} where row 1 holds {c} \(request 1, beam 1\)"
    elif change == "kv_len":
        kv_lens[2:] = 8
        message = r"but kv_lens\[2\]=8 where row 0 has 7 \(request 1, beam 0\)"
    pool, ind = torch.randn(16, 2, 1, PAGE_SIZE, 8), torch.zeros(2, W, 16, dtype=torch.int32)
    if message is None:
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)
        return
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"requests 0 and 1 list the same prompt pages for 5-token prompts, whose last page {b} "
                             rf"is partly filled.*{message}"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)


@pytest.mark.parametrize("same_write_page", [False, True])
def test_requests_sharing_full_prompt_pages_are_judged_row_by_row(same_write_page):
    """Two requests of one 8-token prompt on full pages (a, b) (block reuse) are no copies once their beams part:
    each row is judged, so the second request's row writing the first's slot is refused (it was taken as a copy,
    and its rows skipped)."""
    W = 2
    a, b, c, d, e, f = _pages(SEED, 6, 32)
    plan = build_step_plan([0, 2, 4], [a, b, a, b], [8, 8], W, PAGE_SIZE, 32)
    table = torch.tensor([[a, b, c], [a, b, d], [a, b, c if same_write_page else e], [a, b, f]], dtype=torch.int32)
    kv_lens = torch.tensor([10, 10, 10, 10], dtype=torch.int32)
    pool, ind = torch.randn(32, 2, 1, PAGE_SIZE, 8), torch.zeros(2, W, 16, dtype=torch.int32)
    if not same_write_page:
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)
        return
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"rows 0 and 2 both write this step's K/V to page {c}, slot 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps())
def test_check_mode_refuses_exactly_what_a_slot_by_slot_oracle_calls_unsafe(step):
    """Random small steps (exact copies of a request, some with junk in a column no row reads; requests sharing full
    or partly filled prompt pages; prompts continuing another request's pages; random page edits): check mode passes
    a step exactly where the oracle of ``check_oracle.py`` (every position read or written, slot by slot) finds no
    slot holding two tokens, over the pages the rows hold (so a fault of a later step is refused now too)."""
    try:
        plan = step.plan()
    except PlanError:
        return  # (the planner's refusals: tests/test_plan.py)
    now, later = unsafe(step, "now"), unsafe(step, "later")
    assert now is None or later is not None  # (the pages held cover this step's)
    refusal = step.check_mode(plan)
    assert (refusal is None) == (later is None), (refusal, later, step)


def _warmup_next_to_a_real_request(seed):
    """On a CUDA-graph wrapper: request 0 the warm-up's dummy (8 tokens, a 7-token prompt on pages (a, b), both
    beams writing position 7, the last slot of b); request 1 a real request (a 2-token prompt on page c, at
    position 9: beam 0 on (c, d, e), beam 1 on (f, g, h)). Returns the plan, a valid table, kv_lens, and pages."""
    W = 2
    a, b, c, d, e, f, g, h = _pages(SEED, 8, 16)
    plan = build_step_plan([0, 2, 3], [a, b, c], [7, 2], W, PAGE_SIZE, 16)
    table = torch.tensor([[a, b, 0], [a, b, 0], [c, d, e], [f, g, h]], dtype=torch.int32)
    kv_lens = torch.tensor([8, 8, 10, 10], dtype=torch.int32)
    return plan, table, kv_lens, {"a": a, "b": b, "c": c, "d": d}


def test_a_warmup_requests_beam0_is_still_judged():
    """The beams of a warm-up request that share their write slot are judged as beam 0's write alone: beam 0 is
    judged. Another request's beam holding that page at an earlier generated column keeps two positions in one
    slot, and is refused."""
    plan, table, kv_lens, p = _warmup_next_to_a_real_request(SEED)
    pool, ind = torch.randn(16, 2, 1, PAGE_SIZE, 8), torch.zeros(2, 2, 16, dtype=torch.int32)
    warm = check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind, warmup_shared_blocks=True)
    assert warm.shared_block.tolist() == [True, True, False, False]
    table[2, 1] = p["b"]  # request 1, beam 0: its positions 4-7 on the page the warm-up writes
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*row 0 \(request 0, beam 0\) writes .* into page {p['b']} .*"
                             rf"row 2 \(request 1, beam 0\) also holds at column 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind, warmup_shared_blocks=True)


def test_only_beams_writing_one_page_are_taken_as_the_warmup():
    """On a CUDA-graph wrapper, a real request at its first generated token in the last slot of a page, whose
    beams write their own copies of the page (not the warm-up's shared block), is judged row by row: beam 1
    moved onto another request's prompt page is refused."""
    W = 2
    a, b, c, d, e, f = _pages(SEED, 6, 16)
    # request 0: a 7-token prompt on (a, b), at position 7 (the last slot of b); beam 1's copy of b is c.
    # request 1: a 4-token prompt on d, at position 4 (beam 0 on e, beam 1 on f).
    plan = build_step_plan([0, 2, 3], [a, b, d], [7, 4], W, PAGE_SIZE, 16)
    table = torch.tensor([[a, b], [a, c], [d, e], [d, f]], dtype=torch.int32)
    kv_lens = torch.tensor([8, 8, 5, 5], dtype=torch.int32)
    pool, ind = torch.randn(16, 2, 1, PAGE_SIZE, 8), torch.zeros(2, W, 16, dtype=torch.int32)
    warm = check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind, warmup_shared_blocks=True)
    assert not warm.shared_block.any()
    table[1, 1] = d  # request 0, beam 1 writes onto request 1's (full) prompt page
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=r"stage 'indices'.*row 1 \(request 0, beam 1\) writes .* a prompt page of request 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind, warmup_shared_blocks=True)


# ------------------------------------------------------------------------------------------
# cache_indirection


@pytest.mark.parametrize("value", ["beam width", "-1"])
def test_an_earlier_positions_indirection_outside_the_beams_is_named(value):
    """At the second generated token every row has one earlier generated position, whose ``cache_indirection``
    entry must be a beam in ``[0, W)``: ``W`` itself and ``-1`` are refused, named as ``[request, beam, position]``."""
    W = 3
    _, step, check = _sim_step((5, 10), W, steps=1, seed=SEED)
    assert (step.kv_lens - step.prompt_lens).tolist() == [2] * step.num_rows
    bad = W if value == "beam width" else -1
    pos = int(step.prompt_lens[W])  # request 1's first generated position
    ind = step.cache_indirection.clone()
    ind[1, 0, pos] = bad
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*cache_indirection\[1, 0, {pos}\]={bad} is not a beam in "
                             rf"\[0, beam_width={W}\)"):
        check(indirection=ind)


def test_the_current_positions_indirection_entry_is_not_judged():
    """This step's position is the row's own (no indirection is read there), nor are positions past it: any
    value there passes, also for a request that joined later (fewer generated tokens than the batch's most)."""
    W = 3
    sim = BeamSearchCacheSimulator([5, 10], beam_width=W, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                   page_size=PAGE_SIZE, max_seq_len=40, dtype=torch.float32, seed=SEED)
    for s in range(5):
        if s == 3:
            sim.add_requests([7])
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    generated = (step.kv_lens - step.prompt_lens).view(-1, W)[:, 0].tolist()
    assert generated == [6, 6, 3]
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, W,
                           PAGE_SIZE, sim.num_pages)
    ind = step.cache_indirection.clone()
    rng = np.random.default_rng(SEED)
    for row in range(step.num_rows):
        r, b = divmod(row, W)
        cur = int(step.kv_lens[row]) - 1
        ind[r, b, cur:] = torch.from_numpy(rng.choice([-5, -1, W, W + 7], size=ind.shape[2] - cur)).int()
    check_indices(plan, sim.kv_cache, PAGE_SIZE, step.beam_page_table, step.kv_lens, ind)


# ------------------------------------------------------------------------------------------
# which fault a refusal names first (the documented order: a write onto a prompt page, then one slot written
# twice, then a page held twice)


def test_beam0_writing_its_partly_filled_prompt_page_at_a_later_column_is_a_write_onto_a_prompt_page():
    """Beam 0 fills its prompt's partly filled last page at that page's column only: the same page at a later
    column is a write onto a prompt page, and named so."""
    _, step, check = _sim_step((6, 9), 2, steps=4, seed=SEED)
    assert int(step.kv_lens[0] - 1) // PAGE_SIZE == 2  # request 0: prompt pages at columns 0-1, writes column 2
    table = step.beam_page_table.clone()
    table[0, 2] = table[0, 1]
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=r"stage 'indices'.*row 0 \(request 0, beam 0\) writes .* beam_page_table\[0, 2\]=.* "
                             r"a prompt page of request 0"):
        check(table)


def test_rows_far_apart_writing_one_slot_are_named_as_one_slot_written_twice():
    """Rows of different requests (not neighbours in row order) writing the same slot are named as one slot
    written twice."""
    W = 3
    _, step, check = _sim_step((6, 10), W, steps=4, seed=SEED)  # positions 10 and 14: the same slot of a page
    a, b = 1, W + 2
    pos_a, pos_b = int(step.kv_lens[a]) - 1, int(step.kv_lens[b]) - 1
    assert pos_a % PAGE_SIZE == pos_b % PAGE_SIZE
    table = step.beam_page_table.clone()
    table[b, pos_b // PAGE_SIZE] = table[a, pos_a // PAGE_SIZE]
    with pytest.raises(BeamSharedPrefixCheckError, match=rf"stage 'indices'.*rows {a} and {b} both write"):
        check(table)


def test_one_write_page_at_two_offsets_is_a_page_held_twice_not_a_slot_written_twice():
    """Two rows writing one page at different slots write no slot twice; the page is held twice (two positions
    in a slot at a later step), and named so."""
    W = 3
    _, step, check = _sim_step((6, 9), W, steps=4, seed=SEED)  # positions 10 and 13: different slots
    a, b = 1, W + 2
    pos_a, pos_b = int(step.kv_lens[a]) - 1, int(step.kv_lens[b]) - 1
    assert pos_a % PAGE_SIZE != pos_b % PAGE_SIZE
    table = step.beam_page_table.clone()
    table[b, pos_b // PAGE_SIZE] = table[a, pos_a // PAGE_SIZE]
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"stage 'indices'.*row {a} \(request 0, beam 1\) writes .* which row {b} "
                             rf"\(request 1, beam 2\) also holds"):
        check(table)


def test_a_held_page_on_its_own_requests_shared_prompt_page_names_its_own_request():
    """A full prompt page two requests list (block reuse), held by the second request's beam at a generated column:
    refused as that request's own prompt page (another request's full page it could read; its own it may not
    hold), and named so, not after the first request that lists it."""
    a, b, c, d, e, f, g, h = _pages(SEED, 8, 32)
    # request 0: an 8-token prompt on (a, b); request 1: a 6-token prompt on (a, c), reusing a; both at position 9.
    plan = build_step_plan([0, 2, 4], [a, b, a, c], [8, 6], 2, PAGE_SIZE, 32)
    table = torch.tensor([[a, b, d], [a, b, e], [a, c, f], [a, g, h]], dtype=torch.int32)
    kv_lens = torch.tensor([10, 10, 10, 10], dtype=torch.int32)
    pool, ind = torch.randn(32, 2, 1, PAGE_SIZE, 8), torch.zeros(2, 2, 16, dtype=torch.int32)
    check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)
    table[3, 1] = a  # request 1, beam 1: its copy of the partly filled page is the shared first prompt page
    with pytest.raises(BeamSharedPrefixCheckError,
                       match=rf"row 3 \(request 1, beam 1\) holds page {a} at column 1, .* it is a prompt page of "
                             rf"request 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, ind)
