"""Check mode's index stage (:func:`beam_shared_prefix.check.check_indices`) against an independent model of the K/V
a step reads. The wrapper-level tests (``tests/test_attention.py``) name each refused layout; here random beam-search
steps, with one page-table entry the step uses moved anywhere in the pool, hold the rule to two promises: a table
under which one slot stands for two positions' K/V is refused, and one with the entry moved to an unused page is not."""

from collections import defaultdict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_shared_prefix.check import BeamSharedPrefixCheckError, check_indices
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.testing import PAGE_TABLE_PAD, BeamSearchCacheSimulator

PAGE_SIZE = 4


def _slots_of_two_positions(step, table: torch.Tensor) -> dict:
    """``{slot: keys}`` for every slot (``page * PAGE_SIZE + offset``) the step reads or writes for more than one
    position, a position keyed by the beam row that owns its K/V and its index: the prompt is beam 0's (read
    through the plan's pages), an earlier generated position that of the beam ``cache_indirection`` names (read
    from that beam's page), this step's position the row's own (written into its page). Plain Python, from the
    definitions of the inputs (trtllm-interfaces.md), not from check mode's code."""
    W = step.beam_width
    indptr, indices = step.prompt_page_indptr.tolist(), step.prompt_page_indices.tolist()
    keys = defaultdict(set)
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
            keys[page * PAGE_SIZE + off].add((owner, t))
    return {slot: k for slot, k in keys.items() if len(k) > 1}


@settings(max_examples=80, deadline=None)
@given(prompts=st.lists(st.integers(1, 10), min_size=1, max_size=3), beams=st.integers(1, 4),
       steps=st.integers(0, 9), seed=st.integers(0, 2**16), data=st.data())
def test_a_slot_standing_for_two_positions_is_refused_and_an_unused_page_is_not(prompts, beams, steps, seed, data):
    sim = BeamSearchCacheSimulator(prompts, beam_width=beams, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                   page_size=PAGE_SIZE, max_seq_len=24, dtype=torch.float32, seed=seed)
    for _ in range(steps):
        sim.begin_step()
        sim.end_step()
    step = sim.begin_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request, beams,
                           PAGE_SIZE, sim.num_pages)

    def check(table):
        check_indices(plan, sim.kv_cache, PAGE_SIZE, table, step.kv_lens, step.cache_indirection)

    assert not _slots_of_two_positions(step, step.beam_page_table)
    check(step.beam_page_table)  # the simulator's own table passes
    # One entry a row holds past its prompt's full pages: its write column, or an earlier one.
    row = data.draw(st.integers(0, step.num_rows - 1), label="row")
    plen, cur = int(step.prompt_lens[row]), int(step.kv_lens[row]) - 1
    col = data.draw(st.integers(plen // PAGE_SIZE, cur // PAGE_SIZE), label="col")
    used = set(step.beam_page_table[step.beam_page_table != PAGE_TABLE_PAD].tolist())
    unused = sorted(set(range(sim.num_pages)) - used)
    page = data.draw(st.sampled_from(sorted(used)) | st.sampled_from(unused), label="page")
    table = step.beam_page_table.clone()
    table[row, col] = page
    shared = _slots_of_two_positions(step, table)
    if shared:
        try:
            check(table)
        except BeamSharedPrefixCheckError as e:
            assert e.stage == "indices"
        else:
            slot, keys = next(iter(shared.items()))
            raise AssertionError(f"beam_page_table[{row}, {col}] = {page} puts the K/V of (row, position) {sorted(keys)} "
                                 f"in one slot ({slot}), and check mode let it through")
    # (beam 0's partly filled prompt page moved is a table unlike the plan: refused, rightly)
    elif page in unused and not (row % beams == 0 and col * PAGE_SIZE < plen):
        check(table)
