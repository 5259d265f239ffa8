"""Check mode's index stage (:func:`beam_shared_prefix.check.check_indices`) against an independent model of the K/V
a step reads and writes. The wrapper-level tests (``tests/test_attention.py``) name each refused layout; here random
beam-search steps, with one page-table entry the step uses moved anywhere in the pool, hold the rule to its
promises: a write onto a slot that holds another position's K/V is refused, and so is a table under which one slot
stands for two positions of one request; an entry moved to an unused page is not."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_shared_prefix.check import BeamSharedPrefixCheckError, check_indices
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.testing import PAGE_TABLE_PAD, BeamSearchCacheSimulator

PAGE_SIZE = 4


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

    assert _must_refuse(_positions_by_slot(step, step.beam_page_table)) is None
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
    with pytest.raises(BeamSharedPrefixCheckError, match=r"row 0 \(request 0, beam 0\) writes .* a prompt page of request 1"):
        check_indices(plan, pool, PAGE_SIZE, table, kv_lens, indirection)
