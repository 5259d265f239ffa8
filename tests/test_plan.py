"""Step planner: every StepPlan field against a per-request Python loop, plan caching, validation."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beam_shared_prefix.plan import PlanError, StepPlan, StepPlanner, build_step_plan, cdiv
from beam_shared_prefix.testing import BeamSearchCacheSimulator

PLAN_ARRAYS = (
    "qo_indptr",
    "kv_page_indptr",
    "kv_page_indices",
    "kv_last_page_len",
    "prompt_lens",
    "prompt_lens_per_row",
    "kv_pages_per_request",
    "page_table",
)


def loop_plan(indptr, indices, prompt_lens, beam_width, page_size):
    """The plan written the obvious way: one request at a time, one page at a time."""
    indptr = [int(x) for x in indptr]
    indices = [int(x) for x in indices]
    qo_indptr, kv_page_indptr, kv_page_indices = [0], [0], []
    last, per_row, pages_per_request, rows = [], [], [], []
    for r, p in enumerate(int(x) for x in prompt_lens):
        qo_indptr.append(qo_indptr[-1] + beam_width)
        n = (p + page_size - 1) // page_size
        pages = [indices[indptr[r] + j] for j in range(n)]
        kv_page_indices.extend(pages)
        kv_page_indptr.append(kv_page_indptr[-1] + n)
        last.append(p - (n - 1) * page_size)
        per_row.extend([p] * beam_width)
        pages_per_request.append(n)
        rows.append(pages)
    width = max(pages_per_request)
    # Padding repeats the request's first page (the documented rule): always a valid index.
    page_table = [pages + [pages[0]] * (width - len(pages)) for pages in rows]
    return {
        "qo_indptr": qo_indptr,
        "kv_page_indptr": kv_page_indptr,
        "kv_page_indices": kv_page_indices,
        "kv_last_page_len": last,
        "prompt_lens": [int(x) for x in prompt_lens],
        "prompt_lens_per_row": per_row,
        "kv_pages_per_request": pages_per_request,
        "page_table": page_table,
        "max_prompt_len": max(int(x) for x in prompt_lens),
        "max_prompt_pages": width,
    }


def check_plan(plan: StepPlan, expected: dict, num_requests, beam_width, page_size, num_cache_pages):
    assert plan.num_requests == num_requests
    assert plan.beam_width == beam_width
    assert plan.page_size == page_size
    assert plan.num_cache_pages == num_cache_pages
    assert plan.num_rows == num_requests * beam_width
    for name in PLAN_ARRAYS:
        arr = getattr(plan, name)
        assert isinstance(arr, np.ndarray) and arr.dtype == np.int32, name
        assert not arr.flags.writeable, f"{name} must be read-only (plans are shared across steps)"
        np.testing.assert_array_equal(arr, np.asarray(expected[name], dtype=np.int64), err_msg=name)
    assert plan.max_prompt_len == expected["max_prompt_len"]
    assert plan.max_prompt_pages == expected["max_prompt_pages"]
    assert plan.total_prompt_pages == len(expected["kv_page_indices"])
    assert plan.page_table.shape == (num_requests, expected["max_prompt_pages"])
    # Every entry of the dense table, padding included, is a page of the pool.
    assert ((plan.page_table >= 0) & (plan.page_table < num_cache_pages)).all()
    assert ((plan.kv_last_page_len >= 1) & (plan.kv_last_page_len <= page_size)).all()


CONVERTERS = {
    "np_int32": lambda a: np.asarray(a, dtype=np.int32),
    "np_int64": lambda a: np.asarray(a, dtype=np.int64),
    "list": lambda a: [int(x) for x in a],
    "torch_int32": lambda a: torch.tensor(np.asarray(a, dtype=np.int64), dtype=torch.int32),
}


@st.composite
def batches(draw):
    """A random batch: prompt page lists (with extra pages), prompt lengths, geometry."""
    page_size = draw(st.sampled_from([1, 2, 3, 8, 16, 32, 64]))
    num_requests = draw(st.integers(1, 9))
    max_beam_width = draw(st.integers(1, 12))
    beam_width = draw(st.integers(1, max_beam_width))
    lens = []
    for _ in range(num_requests):
        kind = draw(st.sampled_from(["one", "aligned", "any"]))
        if kind == "one":
            lens.append(1)
        elif kind == "aligned":
            lens.append(page_size * draw(st.integers(1, 6)))
        else:
            lens.append(draw(st.integers(1, 6 * page_size + 5)))
    listed = [cdiv(p, page_size) + draw(st.integers(0, 3)) for p in lens]
    total = sum(listed)
    num_cache_pages = total + draw(st.integers(0, 50))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = rng.permutation(num_cache_pages)[:total]  # distinct pages, as a cache manager gives
    indptr = np.concatenate([[0], np.cumsum(listed)])
    if draw(st.booleans()):
        # Block reuse: requests share request 0's leading full prompt pages (a common prefix).
        shared = lens[0] // page_size
        for r in range(1, num_requests):
            n = min(shared, lens[r] // page_size)
            indices[indptr[r]:indptr[r] + n] = indices[:n]
    conv = CONVERTERS[draw(st.sampled_from(sorted(CONVERTERS)))]
    return dict(
        indptr=indptr,
        indices=indices,
        lens=np.asarray(lens),
        beam_width=beam_width,
        max_beam_width=max_beam_width,
        page_size=page_size,
        num_cache_pages=num_cache_pages,
        conv=conv,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_plan_matches_per_request_loop(b):
    conv = b["conv"]
    plan = build_step_plan(
        conv(b["indptr"]),
        conv(b["indices"]),
        conv(b["lens"]),
        b["beam_width"],
        b["page_size"],
        b["num_cache_pages"],
        max_beam_width=b["max_beam_width"],
        key="k",
    )
    expected = loop_plan(b["indptr"], b["indices"], b["lens"], b["beam_width"], b["page_size"])
    check_plan(plan, expected, len(b["lens"]), b["beam_width"], b["page_size"], b["num_cache_pages"])
    assert plan.key == "k"
    # The digest of each prompt's pages (what the device flag's audit compares beam 0's table with), from the caller's
    # lists by the audit's torch twin: the plan's padding counts for nothing.
    assert plan.prompt_pages_digest.dtype == np.int64
    assert plan.prompt_pages_digest.tolist() == _digest_of_lists(b["indptr"], b["indices"], b["lens"], b["page_size"])


def _digest_of_lists(indptr, indices, lens, page_size):
    """Each prompt's pages digest (``StepPlan.prompt_pages_digest``'s rule) from the caller's lists, by the
    page-table audit's torch twin (``triton_kernels.device_errors.prompt_pages_digest_torch``)."""
    # (deferred: imports triton)
    from triton_kernels.device_errors import prompt_pages_digest_torch

    indptr, indices = [int(v) for v in indptr], [int(v) for v in indices]
    n = [-(-int(length) // page_size) for length in lens]
    width = max(n)
    rows = [indices[indptr[r]:indptr[r] + n[r]] + [-1] * (width - n[r]) for r in range(len(n))]
    return prompt_pages_digest_torch(torch.tensor(rows, dtype=torch.long), torch.tensor(n)).tolist()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_planner_digest_cache_matches_loop(b):
    # Through StepPlanner without a key: equal inputs in fresh arrays hit, the plan is still right.
    planner = StepPlanner(b["page_size"], b["num_cache_pages"], max_beam_width=b["max_beam_width"])
    args = (b["indptr"], b["indices"], b["lens"], b["beam_width"])
    first = planner.plan(*args)
    again = planner.plan(*(b["conv"](a) for a in args[:3]), b["beam_width"])
    assert again is first and planner.num_builds == 1
    expected = loop_plan(*args, b["page_size"])
    check_plan(first, expected, len(b["lens"]), b["beam_width"], b["page_size"], b["num_cache_pages"])


@pytest.mark.parametrize(
    "indptr,indices,lens,message",
    [
        # a page twice in one request's prompt
        ([0, 3], [4, 9, 4], [80], "request 0: page 4 is listed twice in its prompt pages"),
        # request 0's partly filled last page (20 of 32 tokens) among request 1's prompt pages
        ([0, 1, 2], [6, 6], [20, 32], "request 0: its last prompt page 6 holds 20 of 32 tokens"),
        ([0, 2, 3], [1, 2, 2], [64, 10], "request 1: its last prompt page 2 holds 10 of 32 tokens"),
    ],
    ids=["twice-in-request", "partial-page-shared", "partial-page-is-anothers-full-page"],
)
def test_prompt_pages_no_cache_produces(indptr, indices, lens, message):
    """Pages a KV cache never hands out are refused; full prompt pages shared between requests (block
    reuse) and pages listed past the prompt are not."""
    with pytest.raises(PlanError, match=message):
        build_step_plan(indptr, indices, lens, 2, 32, 16)
    build_step_plan([0, 2, 4], [3, 5, 3, 7], [64, 40], 2, 32, 16)  # request 1 reuses request 0's first page
    build_step_plan([0, 2, 3], [3, 3, 9], [20, 5], 2, 32, 16)  # the repeat is past request 0's prompt


def _naive_conflict(indptr, indices, lens, page_size) -> bool:
    """Whether a batch holds prompt pages no KV cache produces, request by request in Python: a page twice in one
    prompt, or a partly filled last prompt page that another request lists, copies of a request counting once."""
    used = [tuple(indices[indptr[r]:indptr[r] + cdiv(lens[r], page_size)]) for r in range(len(lens))]
    kept, seen = [], set()
    for r in range(len(lens)):
        if (lens[r], used[r]) not in seen:
            seen.add((lens[r], used[r]))
            kept.append(r)
    if any(len(set(used[r])) < len(used[r]) for r in kept):
        return True
    return any(lens[r] % page_size and any(used[r][-1] in used[o] for o in kept if o != r) for r in kept)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_prompt_page_refusals_match_a_request_by_request_check(data):
    """The planner's vectorised page checks (one sort) refuse exactly the batches a plain per-request check
    refuses, on small pools where pages collide often and with padding copies of a request."""
    page_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_pages = data.draw(st.integers(2, 16))
    lens, lists = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        if lens and data.draw(st.booleans()):  # a copy of an earlier request (a padded CUDA-graph batch's dummy)
            r = data.draw(st.integers(0, len(lens) - 1))
            lens.append(lens[r])
            lists.append(list(lists[r]))
            continue
        n = data.draw(st.integers(1, 4 * page_size))
        lens.append(n)
        lists.append(data.draw(st.lists(st.integers(0, num_pages - 1), min_size=cdiv(n, page_size),
                                        max_size=cdiv(n, page_size) + 2)))
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])])
    indices = np.array([p for x in lists for p in x], dtype=np.int64)
    refused = _naive_conflict(indptr, indices, lens, page_size)
    if refused:
        with pytest.raises(PlanError, match="listed twice in its prompt pages|its last prompt page"):
            build_step_plan(indptr, indices, lens, 2, page_size, num_pages)
    else:
        build_step_plan(indptr, indices, lens, 2, page_size, num_pages)


def test_extra_listed_pages_are_not_used_or_checked():
    # Beam 0's whole block list may be passed: pages past the prompt (generated pages, stale
    # columns of a block-offset table) are neither copied into the plan nor range-checked.
    plan = build_step_plan([0, 4, 6], [7, 3, 10**6, -1, 5, 9], [20, 3], 2, 16, 12)
    np.testing.assert_array_equal(plan.kv_page_indices, [7, 3, 5])
    np.testing.assert_array_equal(plan.kv_page_indptr, [0, 2, 3])
    np.testing.assert_array_equal(plan.page_table, [[7, 3], [5, 5]])
    np.testing.assert_array_equal(plan.kv_last_page_len, [4, 3])
    assert plan.prompt_pages_digest.tolist() == _digest_of_lists([0, 2, 3], [7, 3, 5], [20, 3], 16)


def test_plan_from_simulator_inputs():
    # The simulator hands beam 0's whole page list (prompt + generated pages) to the planner.
    sim = BeamSearchCacheSimulator([5, 16, 1, 33], beam_width=3, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                   page_size=8, max_seq_len=64, dtype=torch.float32)
    for _ in range(10):
        step = sim.begin_step()
        sim.end_step()
    plan = build_step_plan(step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
                           3, 8, sim.num_pages, max_beam_width=3)
    table = step.beam_page_table.numpy()
    for r, p in enumerate([5, 16, 1, 33]):
        n = cdiv(p, 8)
        pages = plan.kv_page_indices[plan.kv_page_indptr[r]:plan.kv_page_indptr[r + 1]]
        np.testing.assert_array_equal(pages, table[r * 3, :n])
        np.testing.assert_array_equal(plan.prompt_lens_per_row[r * 3:(r + 1) * 3], [p] * 3)


@pytest.mark.filterwarnings("error")
def test_device_tensors_are_int32_copies_cached_per_device():
    plan = build_step_plan([0, 2, 3], [4, 1, 2], [9, 8], 3, 8, 5)
    t = plan.device_tensors("cpu")
    for name, tensor in t.items():
        assert tensor.dtype == torch.int32, name
        np.testing.assert_array_equal(tensor.numpy(), getattr(plan, name), err_msg=name)
    assert plan.device_tensors(torch.device("cpu")) is t
    # The tensors are copies: writing one does not corrupt the cached plan's read-only arrays.
    t["kv_page_indices"][0] = 3
    assert plan.kv_page_indices[0] == 4


# ------------------------------------------------------------------------------------------
# Caching


def _inputs(lens=(20, 7), pages=((3, 4), (9,)), beam_width=4):
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])])
    indices = np.asarray([x for p in pages for x in p])
    return indptr, indices, np.asarray(lens), beam_width


def test_same_key_returns_same_object_without_rebuild():
    planner = StepPlanner(page_size=16, num_cache_pages=16, max_beam_width=4)
    plan = planner.plan(*_inputs(), key=("req", 1, 2))
    assert planner.num_builds == 1 and plan.key == ("req", 1, 2)
    # With a key, a hit touches no array at all: the caller promised equal keys mean equal inputs.
    assert planner.plan(None, None, None, 4, key=("req", 1, 2)) is plan
    assert planner.lookup(("req", 1, 2)) is plan
    assert planner.lookup(("req", 9)) is None
    assert planner.num_builds == 1


def test_digest_key_distinguishes_inputs():
    planner = StepPlanner(page_size=16, num_cache_pages=16, max_beam_width=8, capacity=16)
    base = planner.plan(*_inputs())
    variants = [
        _inputs(lens=(20, 8)),  # a prompt length
        _inputs(pages=((3, 5), (9,))),  # a page
        _inputs(beam_width=3),  # the beam width
        _inputs(lens=(20, 7, 1), pages=((3, 4), (9,), (10,))),  # one more request
        _inputs(lens=(7, 20), pages=((9,), (3, 4))),  # same requests, other order
        _inputs(pages=((3, 4, 1), (9,))),  # an extra listed page moves the split ...
        _inputs(pages=((3, 4), (1, 9))),  # ... and the same flat pages split differently
    ]
    plans = [planner.plan(*v) for v in variants]
    assert planner.num_builds == 1 + len(variants)
    assert len({id(p) for p in [base] + plans}) == 1 + len(variants)
    assert plans[0].prompt_lens.tolist() == [20, 8]
    assert plans[2].beam_width == 3
    # Equal contents in other containers / dtypes hit the same plan.
    indptr, indices, lens, w = _inputs()
    assert planner.plan(torch.tensor(indptr), indices.astype(np.int32), lens.tolist(), w) is base
    assert planner.num_builds == 1 + len(variants)


def test_unkeyed_repeat_hits_and_in_place_mutation_replans():
    # The steady state of a serving loop: the same arrays every step. The planner keeps copies of
    # the last unkeyed inputs, so a caller that rewrites its arrays in place gets a fresh plan.
    planner = StepPlanner(page_size=16, num_cache_pages=16, max_beam_width=4)
    indptr, indices, lens, w = _inputs()
    first = planner.plan(indptr, indices, lens, w)
    for _ in range(3):
        assert planner.plan(indptr, indices, lens, w) is first
    assert planner.num_builds == 1
    indices[0] = 11  # in place: same object, new contents
    second = planner.plan(indptr, indices, lens, w)
    assert second is not first and second.kv_page_indices[0] == 11
    assert planner.num_builds == 2
    indices[0] = 3  # back to the first contents: its plan is still cached under its digest
    assert planner.plan(indptr, indices, lens, w) is first
    assert planner.plan(indptr, indices, lens, w - 1) is not first  # beam width is part of the inputs
    planner.clear()
    assert planner.plan(indptr, indices, lens, w) is not first


def test_digest_keeps_values_beyond_int32_apart():
    # Values are hashed as int32 when they fit: a value that does not must not alias its wrapped twin.
    indptr, indices, lens, w = _inputs(pages=((3, 4, 5), (9,)))
    wide = indices.copy()
    wide[2] = 5 + 2**32  # an extra listed page (stale column): not used, but part of the inputs
    assert StepPlanner.input_key(indptr, indices, lens, w) != StepPlanner.input_key(indptr, wide, lens, w)
    assert StepPlanner.input_key(indptr, indices, lens, w) == StepPlanner.input_key(
        indptr.astype(np.uint8), indices.astype(np.int16), torch.tensor(lens), w
    )


def test_digest_hit_still_refuses_2d_or_float_inputs():
    # A 2-D or float copy of cached inputs flattens/truncates to the same ints: it must not hit.
    planner = StepPlanner(page_size=16, num_cache_pages=16)
    indptr, indices, lens, w = _inputs()
    planner.plan(indptr, indices, lens, w)
    with pytest.raises(PlanError, match=r"prompt_lens must hold integers, got dtype float64"):
        planner.plan(indptr, indices, lens.astype(np.float64), w)
    with pytest.raises(PlanError, match=r"prompt_page_indices must be 1-D, got shape \(1, 3\)"):
        planner.plan(indptr, indices[None], lens, w)
    assert planner.num_builds == 1


def test_lru_eviction():
    planner = StepPlanner(page_size=16, num_cache_pages=16, capacity=2)
    a = planner.plan(*_inputs(lens=(1, 1)), key="a")
    b = planner.plan(*_inputs(lens=(2, 2)), key="b")
    assert planner.lookup("a") is a  # touch a: b becomes least recently used
    c = planner.plan(*_inputs(lens=(3, 3)), key="c")
    assert planner.lookup("b") is None
    assert planner.lookup("a") is a and planner.lookup("c") is c
    assert planner.num_builds == 3
    b2 = planner.plan(*_inputs(lens=(2, 2)), key="b")  # rebuilt after eviction
    assert b2 is not b and planner.num_builds == 4
    np.testing.assert_array_equal(b2.prompt_lens, b.prompt_lens)
    assert planner.lookup("c") is c and planner.lookup("a") is None  # a was the LRU now
    planner.clear()
    assert planner.lookup("c") is None


def test_failed_plan_is_not_cached():
    planner = StepPlanner(page_size=16, num_cache_pages=4)
    bad = _inputs()  # page 9 is outside a 4-page pool
    for _ in range(2):
        with pytest.raises(PlanError, match="outside the pool"):
            planner.plan(*bad, key="x")
    assert planner.num_builds == 0 and planner.lookup("x") is None


# ------------------------------------------------------------------------------------------
# Validation: one test per refused input; each message names the value, the limit and the fix.


def plan(indptr=(0, 2, 3), indices=(4, 1, 2), lens=(20, 8), beam_width=4, page_size=16, num_cache_pages=8,
         max_beam_width=None):
    return build_step_plan(np.asarray(indptr), np.asarray(indices), np.asarray(lens), beam_width, page_size,
                           num_cache_pages, max_beam_width=max_beam_width)


def test_valid_defaults_plan():
    # The helper's defaults are valid, so each test below fails for its one reason only.
    assert plan().num_rows == 8


def test_beam_width_above_max_beam_width():
    with pytest.raises(PlanError, match=r"beam_width=5 exceeds max_beam_width=4.*max_beam_width >= 5"):
        plan(beam_width=5, max_beam_width=4)
    assert plan(beam_width=4, max_beam_width=4).beam_width == 4


def test_beam_width_below_one():
    with pytest.raises(PlanError, match=r"beam_width=0 must be >= 1"):
        plan(beam_width=0)


@pytest.mark.parametrize("page", [8, 1000, -1])
def test_page_index_outside_pool(page):
    with pytest.raises(
        PlanError,
        match=rf"request 1: prompt page 0 has page index {page}, outside the pool \[0, 8\).*Re-derive the page table",
    ):
        plan(indices=(4, 1, page))


def test_page_index_outside_pool_names_position_in_request():
    with pytest.raises(PlanError, match=r"request 0: prompt page 1 has page index 8, outside the pool \[0, 8\)"):
        plan(indices=(4, 8, 2))


def test_prompt_longer_than_its_pages():
    with pytest.raises(
        PlanError,
        match=r"request 0: prompt_lens\[0\]=33 tokens need 3 pages of 16 but only 2 are listed "
        r"\(they hold at most 32 tokens\); pass the request's full beam-0 page list",
    ):
        plan(lens=(33, 8))


@pytest.mark.parametrize("length", [0, -3])
def test_non_positive_prompt_length(length):
    with pytest.raises(PlanError, match=rf"prompt_lens\[1\]={length} must be >= 1"):
        plan(lens=(20, length))


def test_indptr_wrong_length():
    with pytest.raises(
        PlanError,
        match=r"prompt_page_indptr has 4 entries but prompt_lens has 2 requests; it must have "
        r"len\(prompt_lens\) \+ 1 = 3",
    ):
        plan(indptr=(0, 2, 3, 3))


def test_indptr_not_starting_at_zero():
    with pytest.raises(PlanError, match=r"prompt_page_indptr\[0\]=1 must be 0"):
        plan(indptr=(1, 2, 3))


def test_indptr_decreasing():
    with pytest.raises(PlanError, match=r"prompt_page_indptr decreases at request 1 \(3 -> 2\).*non-decreasing"):
        plan(indptr=(0, 3, 2), indices=(4, 1, 2))


def test_indptr_last_not_len_indices():
    with pytest.raises(
        PlanError, match=r"prompt_page_indptr\[-1\]=3 but prompt_page_indices has 4 entries; they must be equal"
    ):
        plan(indices=(4, 1, 2, 5))


def test_empty_batch():
    with pytest.raises(PlanError, match=r"empty batch: prompt_lens has 0 requests.*>= 1 generation request"):
        plan(indptr=(0,), indices=(), lens=())


@pytest.mark.parametrize("name", ["indptr", "indices", "lens"])
def test_non_integer_dtype(name):
    full = {"indptr": "prompt_page_indptr", "indices": "prompt_page_indices", "lens": "prompt_lens"}[name]
    args = dict(indptr=(0, 2, 3), indices=(4, 1, 2), lens=(20, 8))
    args[name] = np.asarray(args[name], dtype=np.float32)
    with pytest.raises(PlanError, match=rf"{full} must hold integers, got dtype float32; pass an int32/int64"):
        plan(**args)


@pytest.mark.parametrize("convert, message", [
    (lambda t: t.to(torch.bfloat16), r"prompt_lens must hold integers, got dtype torch.bfloat16"),
    (lambda t: t.to("meta"), r"prompt_lens is a meta tensor \(no data\)"),
], ids=["bf16", "meta"])
def test_a_tensor_numpy_cannot_take_is_refused_by_name(convert, message):
    """A bfloat16 tensor (NumPy has no such dtype) or a meta tensor (no data) is refused naming the argument, as a
    float32 one is, not by torch's conversion error."""
    with pytest.raises(PlanError, match=message):
        build_step_plan(np.asarray((0, 2, 3)), np.asarray((4, 1, 2)), convert(torch.tensor([20, 8])), 4, 16, 8)


@pytest.mark.parametrize("call, message", [
    (lambda: build_step_plan([0, 1], [3], np.array([2**64 - 1], np.uint64), 2, 16, 64),
     r"prompt_lens\[0\]=18446744073709551615 exceeds the int32 range"),
    (lambda: build_step_plan([0, 1], np.array([2**63 + 3], np.uint64), [5], 2, 16, 64),
     r"prompt_page_indices\[0\]=9223372036854775811 exceeds the int32 range"),
    (lambda: build_step_plan([0, 1], [3], [[5], [1, 2]], 2, 16, 64), r"prompt_lens is not a flat int array"),
    (lambda: build_step_plan([0, 1], [3], torch.tensor([5]).to_sparse(), 2, 16, 64),
     r"prompt_lens is a torch.sparse_coo tensor; pass a dense one"),
    (lambda: build_step_plan([0, 1], [3], [5], torch.tensor(2, device="meta"), 16, 64), r"beam_width=.* must be an integer"),
    (lambda: build_step_plan([0, 1], [3], [5], 3, 16, 64, max_beam_width=2.9), r"max_beam_width=2.9 must be an integer"),
    (lambda: build_step_plan([0, 1], [3], [5], 1, 16, 64, max_beam_width=True), r"max_beam_width=True must be an integer"),
    (lambda: StepPlanner(16, 64).plan([0, 1], [3], [5], 2**63), r"beam_width=9223372036854775808 exceeds the int32"),
], ids=["uint64 length", "uint64 page", "ragged", "sparse", "meta width", "float max width", "bool max width",
        "width past int64"])
def test_inputs_numpy_or_torch_would_take_apart_are_named(call, message):
    """Inputs whose conversion would fail inside numpy or torch, or silently change the value (a uint64 past int64
    wrapping negative, a float cut to an int), are refused by the planner naming the argument and the value."""
    with pytest.raises(PlanError, match=message):
        call()


def test_bool_dtype_refused():
    with pytest.raises(PlanError, match=r"prompt_lens must hold integers, got dtype bool"):
        plan(lens=np.asarray([True, True]))


@pytest.mark.parametrize("name", ["indptr", "indices", "lens"])
def test_2d_input(name):
    full = {"indptr": "prompt_page_indptr", "indices": "prompt_page_indices", "lens": "prompt_lens"}[name]
    args = dict(indptr=(0, 2, 3), indices=(4, 1, 2), lens=(20, 8))
    args[name] = np.asarray(args[name])[None, :]
    shape = rf"\(1, {len(args[name][0])}\)"
    with pytest.raises(PlanError, match=rf"{full} must be 1-D, got shape {shape}; pass a flat int array"):
        plan(**args)


def test_page_size_and_pool_size_below_one():
    with pytest.raises(PlanError, match=r"page_size=0 must be >= 1"):
        plan(page_size=0)
    with pytest.raises(PlanError, match=r"num_cache_pages=0 must be >= 1: the KV pool holds no page"):
        plan(num_cache_pages=0)


@pytest.mark.parametrize("args, message", [
    (dict(beam_width=2.9), r"beam_width=2.9 must be an integer"),  # never truncated to 2
    (dict(page_size=16.0), r"page_size=16.0 must be an integer"),
    (dict(lens=(2**31, 8), indptr=(0, 2, 3), page_size=2**30), r"prompt_lens\[0\]=2147483648 exceeds the int32"),
    (dict(page_size=2**31), r"page_size=2147483648 exceeds the int32"),
    (dict(beam_width=2**31), r"beam_width=2147483648 exceeds the int32 range the kernels index with"),
    (dict(num_cache_pages=2**31), r"num_cache_pages=2147483648 exceeds the int32 range the kernels index with"),
    # (refused by the row count before any per-row array is built: 32 GiB otherwise)
    (dict(beam_width=2**31 - 1), r"2 requests x beam_width=2147483647 = 4294967294 beam rows exceed the int32"),
])
def test_sizes_are_integers_within_int32(args, message):
    with pytest.raises(PlanError, match=message):
        plan(**args)
    assert plan(beam_width=np.int64(4)).beam_width == 4  # integer scalars of any type
    assert plan(num_cache_pages=2**31 - 1).num_cache_pages == 2**31 - 1  # page numbers up to the int32 limit


def test_a_request_listing_no_page_is_named_as_short_of_pages():
    # indptr repeating a value does not decrease: the request that lists no page is named.
    with pytest.raises(PlanError, match=r"request 1: prompt_lens\[1\]=8 tokens need 1 pages of 16 but only 0 are "
                                        r"listed"):
        plan(indptr=(0, 2, 2), indices=(4, 1))


@pytest.mark.parametrize("case", ["same length, other pages", "same length and first page, other last page"])
def test_only_exact_copies_of_a_request_share_its_pages(case):
    """Copies of a request (a padded CUDA-graph batch's dummy) share all its pages; a request of the same prompt
    length with other pages is no copy, and its conflicts are refused. Pages of 4, drawn at random:

    - same length, other pages: request 0 on (a, b), request 1 of the same 6 tokens on (b, c): request 0's partly
      filled last page b is request 1's full first page;
    - same first page, other last page: request 0 on (a, b), request 1 of the same 6 tokens on (a, c) (block reuse
      of a), and request 2 (2 tokens) on c: request 1's partly filled last page c is request 2's too."""
    a, b, c = (int(p) for p in np.random.default_rng(len(case)).permutation(32)[:3])
    if case == "same length, other pages":
        indptr, indices, lens = [0, 2, 4], [a, b, b, c], [6, 6]
        message = rf"request 0: its last prompt page {b} holds 2 of 4 tokens.*request 1 lists page {b}"
    else:
        indptr, indices, lens = [0, 2, 4, 5], [a, b, a, c, c], [6, 6, 2]
        message = rf"request 1: its last prompt page {c} holds 2 of 4 tokens.*request 2 lists page {c}"
    with pytest.raises(PlanError, match=message):
        build_step_plan(indptr, indices, lens, 2, 4, 32)
    build_step_plan([0, 2, 4], [a, b, a, b], [6, 6], 2, 4, 32)  # exact copies of request 0: one request listed twice


@pytest.mark.parametrize("lens,ids,refused", [
    ((6, 6, 2), ("x", "x", "y"), None),  # copies of one request under one id: a padded batch
    ((6, 6, 2), ("x", "z", "y"), (0, 1)),  # two requests given one partly filled page
    ((8, 8, 2), ("x", "z", "y"), None),  # only full pages shared: block reuse
    # block reuse beside a padded dummy: the dummy's copies over partly filled c make the planner compare ids, and
    # requests 0 and 1, of two ids over full pages only, are no copies that write into a page
    ((8, 8, 2, 2), ("x", "z", "y", "y"), None),
])
def test_copies_of_a_request_share_its_id_where_ids_are_given(lens, ids, refused):
    """Without ids the planner takes requests of one prompt length and one page list as copies of one request; with
    them, two requests so listed whose shared last page is partly filled are refused, in build_step_plan and
    through a planner (whose digest key covers the ids: the same pages under copies' ids do not hide them). Pages
    of 4: requests 0 and 1 on (a, b) (listed with a page past the prompt, as a whole block list may be), request 2
    on c, and request 3, where a case lists one, a copy of request 2 (a padded CUDA-graph batch's dummy)."""
    a, b, c, d = (int(p) for p in np.random.default_rng(3).permutation(32)[:4])
    pages = [[a, b, d], [a, b, d], [c], [c]][:len(lens)]
    indptr, indices = np.cumsum([0] + [len(p) for p in pages]).tolist(), [p for ps in pages for p in ps]
    build_step_plan(indptr, indices, lens, 2, 4, 32)  # the planner alone serves every case
    planner = StepPlanner(4, 32)
    planner.plan(indptr, indices, lens, 2, request_ids=("x", "x", "y", "y")[:len(lens)])
    if refused is None:
        served = build_step_plan(indptr, indices, lens, 2, 4, 32, request_ids=ids)
        # Each request keeps its own prompt pages and lengths: copies are checked, never merged in the plan.
        check_plan(served, loop_plan(indptr, indices, lens, 2, 4), len(lens), 2, 4, 32)
        assert planner.plan(indptr, indices, lens, 2, request_ids=ids).page_table.tolist() == served.page_table.tolist()
        return
    f, r = refused
    message = (rf"requests {f} \(id '{ids[f]}'\) and {r} \(id '{ids[r]}'\) list the same 2 prompt pages for "
               rf"6-token prompts, and the last, page {b}, holds 2 of 4")
    with pytest.raises(PlanError, match=message):
        build_step_plan(indptr, indices, lens, 2, 4, 32, request_ids=ids)
    with pytest.raises(PlanError, match=message):
        planner.plan(indptr, indices, lens, 2, request_ids=ids)
    with pytest.raises(PlanError, match="request_ids holds 2 ids for 3 requests"):
        build_step_plan(indptr, indices, lens, 2, 4, 32, request_ids=ids[:2])


def test_copies_read_without_ids_are_logged_once(monkeypatch, caplog):
    """Without ids, copies over a partly filled page are served and logged, once a process, naming both requests and
    the page; copies over full pages (nothing written into them) and copies under ids are not logged."""
    import beam_shared_prefix.plan as plan_module

    a, b, c = (int(p) for p in np.random.default_rng(5).permutation(32)[:3])
    monkeypatch.setattr(plan_module, "_warned_copies_without_ids", False)
    caplog.set_level("WARNING", logger="beam_shared_prefix")
    build_step_plan([0, 2, 4], [a, c, a, c], [8, 8], 2, 4, 32)  # full pages: block reuse, nothing to say
    build_step_plan([0, 2, 4, 6], [a, b, a, b, c, a], [6, 6, 8], 2, 4, 32, request_ids=("x", "x", "y"))
    assert not caplog.records
    build_step_plan([0, 2, 4, 6], [a, b, a, b, c, a], [6, 6, 8], 2, 4, 32)
    build_step_plan([0, 2, 4, 6], [a, b, a, b, c, a], [6, 6, 8], 2, 4, 32)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert f"requests 0 and 1 list the same prompt pages, the last (page {b}) partly filled" in message
    assert "pass request_ids" in message


def test_planner_capacity_must_be_positive():
    with pytest.raises(PlanError, match=r"capacity=0 must be >= 1"):
        StepPlanner(16, 8, capacity=0)


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)
