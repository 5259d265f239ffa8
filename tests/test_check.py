"""Check mode's index stage (:func:`beam_shared_prefix.check.check_indices`) against an independent model of what
a step's K/V write overwrites. The wrapper-level tests (``tests/test_attention.py``) name each refused layout;
here random beam-search steps, one write page moved anywhere in the pool, hold the rule to two promises: a write
that lands on a slot some row reads at another position is refused, and a write moved to an unused page is not."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_shared_prefix.check import BeamSharedPrefixCheckError, check_indices
from beam_shared_prefix.plan import build_step_plan
from beam_shared_prefix.testing import PAGE_TABLE_PAD, BeamSearchCacheSimulator

PAGE_SIZE = 4


def _read_slots(step, table: torch.Tensor) -> list:
    """``(slot, row, position)`` of every K/V element the step reads (``slot = page * PAGE_SIZE + offset``):
    the prompt through the plan's pages (beam 0's), earlier generated positions through the source beam that
    ``cache_indirection`` names, and this step's position from the row's own page. Plain Python, from the
    definitions of the inputs (trtllm-interfaces.md), not from check mode's code."""
    W = step.beam_width
    indptr, indices = step.prompt_page_indptr.tolist(), step.prompt_page_indices.tolist()
    slots = []
    for row in range(step.num_rows):
        req, beam = divmod(row, W)
        plen, cur = int(step.prompt_lens[row]), int(step.kv_lens[row]) - 1
        for t in range(cur + 1):
            col, off = divmod(t, PAGE_SIZE)
            if t < plen:
                page = indices[indptr[req] + col]
            elif t < cur:
                page = int(table[req * W + int(step.cache_indirection[req, beam, t]), col])
            else:
                page = int(table[row, col])
            slots.append((page * PAGE_SIZE + off, row, t))
    return slots


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 10), min_size=1, max_size=3), beams=st.integers(1, 4),
       steps=st.integers(0, 9), seed=st.integers(0, 2**16), data=st.data())
def test_a_write_onto_k_v_read_elsewhere_is_refused_and_one_onto_an_unused_page_is_not(prompts, beams, steps, seed,
                                                                                          data):
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

    check(step.beam_page_table)  # the simulator's own table passes
    row = data.draw(st.integers(0, step.num_rows - 1), label="row")
    cur = int(step.kv_lens[row]) - 1
    used = set(step.beam_page_table[step.beam_page_table != PAGE_TABLE_PAD].tolist())
    unused = sorted(set(range(sim.num_pages)) - used)
    page = data.draw(st.sampled_from(sorted(used)) | st.sampled_from(unused), label="page")
    table = step.beam_page_table.clone()
    table[row, cur // PAGE_SIZE] = page
    written = page * PAGE_SIZE + cur % PAGE_SIZE
    overwrites = [(r, t) for slot, r, t in _read_slots(step, table) if slot == written and (r, t) != (row, cur)]
    if overwrites:
        try:
            check(table)
        except BeamSharedPrefixCheckError as e:
            assert e.stage == "indices"
        else:
            raise AssertionError(f"row {row} writes position {cur} onto page {page}, over what row/position "
                                 f"{overwrites[0]} reads, and check mode let it through")
    elif page in unused and not (row % beams == 0 and cur < -(-int(step.prompt_lens[row]) // PAGE_SIZE) * PAGE_SIZE):
        check(table)  # (beam 0's partly filled prompt page moved is a table unlike the plan: refused, rightly)
