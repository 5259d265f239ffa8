"""The page-table audit (:mod:`triton_kernels.page_table_audit`), in its kernels and its torch twin
(:func:`~triton_kernels.page_table_audit.audit_page_table_torch`, from the rules' twins in
:mod:`triton_kernels.device_errors`) alike:

- ``HELD_WRITE_PAGE``: a write page another row of its request holds (but beam 0 at the row's column), or the row
  itself at an earlier column, at any token of the page from the second generated token;
- ``SHARED_WRITE_PAGE`` and ``BEAM_KV_LEN``: a beam on beam 0's page of its column, or at another length;
- ``OTHER_REQUEST_PAGE``: a write page that a row of another request holds within its length, from the second
  generated token, judged against this step's table only (the stamps);
- ``PLAN_PAGE``: beam 0's pages over the prompt's columns unlike the plan's, by a digest whose host (``StepPlan``),
  torch and device forms agree, and which one changed page always changes;
- a valid table at every step, padding rows and TensorRT-LLM's warm-up layout raise nothing;
- the launcher refuses bad arguments by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beam_shared_prefix.plan import build_step_plan
from triton_kernels import KernelInputError, device_errors, page_table_audit
from triton_kernels.device_errors import new_error_flags, other_request_page_bad_torch, prompt_pages_digest_torch
from triton_kernels.page_table_audit import audit_page_table, audit_page_table_torch, new_audit_workspace
from triton_kernels.page_table_audit_kernel import prompt_page_digest_term

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: conftest set TRITON_INTERPRET=1)
HELD = device_errors.HELD_WRITE_PAGE.value
OTHER = device_errors.OTHER_REQUEST_PAGE.value
SHARED = device_errors.SHARED_WRITE_PAGE.value
LEN = device_errors.BEAM_KV_LEN.value
PLAN = device_errors.PLAN_PAGE.value


def _plan_digest(table, prompt, W, pg, div):
    """The digest of beam 0's pages over each request's prompt columns (a plan made from this table), int64 [R]."""
    first = table[::W].long()
    plen = prompt[::W].long()
    pages = torch.where(first >= 0, first // div, -1)
    return prompt_pages_digest_torch(pages, -(-plen.clamp(min=0) // pg))


def _audit(kv, prompt, table, W, flags=None, workspace=None, plan_digest=None, **p):
    """The audit of one step on ``DEVICE`` (a fresh workspace unless one is given), and its torch twin on the CPU: the
    flag word, after checking that the two agree."""
    flags = new_error_flags(DEVICE) if flags is None else flags
    twin_flags = flags.cpu().clone()
    workspace = new_audit_workspace(p["num_pages"], DEVICE) if workspace is None else workspace
    audit_page_table(kv.to(DEVICE), prompt.to(DEVICE), table.to(DEVICE), W, flags, workspace,
                     plan_digest=None if plan_digest is None else plan_digest.to(DEVICE), **p)
    audit_page_table_torch(kv, prompt, table, W, twin_flags, plan_digest=plan_digest, **p)
    assert int(flags.item()) == int(twin_flags.item()), (device_errors.decode_error_flags(int(flags.item())),
                                                         device_errors.decode_error_flags(int(twin_flags.item())))
    return int(flags.item())


CASES = {  # case: the bits its request raises
    "valid": 0, "other_beam_earlier_column": HELD, "own_earlier_column": HELD, "other_beams_prompt_copy": HELD,
    "beam0_partial_prompt_page": HELD, "full_prompt_earlier_column": HELD, "same_column_pair": HELD,
    "on_full_prompt_page": HELD, "beam0_own_full_prompt_page": HELD, "mid_page": HELD, "own_earlier_column_mid_page": HELD,
    "on_beam0_same_column": SHARED | HELD, "longer_beam": LEN | HELD, "shorter_beam": LEN,
    "plan_earlier_prompt_page": PLAN, "plan_entry_missing": PLAN, "plan_in_other_code": 0, "first_generated_token": 0, "warmup_request": 0,
    "held_entry_missing": 0, "own_entry_missing": 0, "padding": 0, "outside_pool": 0,
}


def _case(seed: int, W: int):
    """Requests of ``W`` beams (page 4, divisor 2) at a page's first token (``kv_len - 1 = 4 x column``), two to five
    pages past their prompt's last page, one request per entry of :data:`CASES`, each valid or broken one way:
    ``(kv_lens, prompt_lens, table, plan_digest, params)``. Pages 0 and ``num_pages - 1`` are nobody's."""
    pg, div = 4, 2
    names = list(CASES)
    g = torch.Generator().manual_seed(seed)
    R = len(names)
    k = torch.randint(2, 12, (R,), generator=g)  # the prompt's last column (its partly filled page)
    prompt = pg * k + 1 + torch.randint(0, pg - 1, (R,), generator=g)
    prompt[names.index("full_prompt_earlier_column")] = pg * k[names.index("full_prompt_earlier_column")]
    col = k + 2 + torch.randint(0, 4, (R,), generator=g)  # the write column: one to four full generated columns
    kv = pg * col + 1
    cols = int(col.max()) + 2
    num_pages = R * W * cols + 2
    pages = (torch.randperm(num_pages - 2, generator=g) + 1).view(R, W, cols)
    for r in range(R):
        pages[r, :, :int(k[r])] = pages[r, 0, :int(k[r])]  # the full prompt pages, shared by the beams
    table = pages * div + torch.randint(0, div, pages.shape, generator=g)
    kv, prompt = kv.repeat_interleave(W), prompt.repeat_interleave(W)
    plan_digest = _plan_digest(table.view(R * W, cols), prompt, W, pg, div)
    edge = seed % 2 == 1  # the held page in the last block of the comparison (the last beam, the last column)
    for r, case in enumerate(names):
        i, j = (int(v) for v in 1 + torch.randperm(W - 1, generator=g)[:2])
        c_w, c_p = int(col[r]), int(k[r])
        c = c_w - 1 if edge else int(torch.randint(c_p + 1, c_w, (1,), generator=g))  # a full generated column
        if edge:
            i, j = (i if i != W - 1 else W - 2), W - 1
        rows = slice(r * W, r * W + W)
        t = table[r]  # (a view)
        if case == "other_beam_earlier_column":
            t[i, c_w] = t[j, c] // div * div + (t[j, c] + 1) % div  # the page in the divisor's other code
        elif case == "own_earlier_column":
            t[i, c_w] = t[i, c]
        elif case == "other_beams_prompt_copy":
            t[i, c_w] = t[j, c_p]
        elif case == "beam0_partial_prompt_page":
            t[0, c_w] = t[0, c_p]
        elif case == "full_prompt_earlier_column":  # a prompt of whole pages: column c_p is the first generated one
            t[i, c_w] = t[j, c_p]
        elif case == "same_column_pair":  # two beams other than beam 0 write one page
            t[j, c_w] = t[i, c_w]
        elif case == "on_full_prompt_page":
            t[i, c_w] = t[0, int(torch.randint(0, c_p, (1,), generator=g))]
        elif case == "beam0_own_full_prompt_page":  # beam 0 alone holds it: its own earlier column, from column 0
            t[0, c_w] = t[0, int(torch.randint(0, c_p, (1,), generator=g))]
        elif case == "mid_page":  # a token past the page's first, which the page's holder wrote before
            kv[rows] += 1 + int(torch.randint(0, pg - 1, (1,), generator=g))
            t[i, c_w] = t[j, c]
        elif case == "own_earlier_column_mid_page":
            kv[rows] += pg - 1
            t[i, c_w] = t[i, c]
        elif case == "on_beam0_same_column":  # (HELD_WRITE_PAGE's too, for both rows)
            t[i, c_w] = t[0, c_w]
        elif case == "longer_beam":  # beam i a page ahead of beam 0, onto beam j's earlier page
            kv[r * W + i] += pg
            t[i, c_w + 1] = t[j, c]
        elif case == "shorter_beam":
            kv[r * W + i] -= 1
        elif case == "plan_earlier_prompt_page":  # beam 0's first prompt page unlike the plan's (nobody else's)
            t[0, 0] = (num_pages - 1) * div
        elif case == "plan_entry_missing":  # the plan's page 0 where the table has no entry (-1 // 2 is not page 0)
            plan_row = t[0].clone()
            plan_row[0] = 0
            plan_digest[r] = _plan_digest(plan_row[None], prompt[rows][:1], 1, pg, div)[0]
            t[0, 0] = -1
        elif case == "plan_in_other_code":
            t[0, 0] = t[0, 0] // div * div + (t[0, 0] + 1) % div
        elif case == "first_generated_token":  # kv_len = prompt + 1: not judged (the warm-up's look)
            kv[rows] = prompt[rows] + 1
            t[j, c_p] = t[i, c_p]
        elif case == "warmup_request":  # TensorRT-LLM's: all context, every page shared, kv_len = prompt + 1
            kv[rows] = prompt[rows] + 1
            t[:] = t[0]
        elif case == "outside_pool":  # a write page past the pool is WRITE_PAGE's (the kernels'), held or not
            t[i, c_w] = t[j, c] = num_pages * div
        elif case == "held_entry_missing":  # -1 // 2 must not make page 0 a held page
            t[i, c_w] = 1
            t[j, c] = -1
        elif case == "own_entry_missing":  # nor one of the row's own earlier entries
            t[i, c_w] = 1
            t[i, c] = -1
        elif case == "padding":  # TensorRT-LLM's padding rows: kv_len 1, a one-token prompt, one page for all
            kv[rows], prompt[rows] = 1, 1
            t[:, 0] = t[0, 0]
            plan_digest[r] = _plan_digest(t[:1, :1].reshape(1, 1), prompt[rows][:1], 1, pg, div)[0]
    params = dict(page_size=pg, page_index_divisor=div, num_pages=num_pages, max_seq_len=cols * pg)
    return kv.int(), prompt.int(), table.view(R * W, cols).int(), plan_digest, params


@pytest.mark.parametrize("W,block_w", [(5, 2), (45, None)], ids=["5_beams_blocks_of_2", "45_beams"])
@pytest.mark.parametrize("seed", [0, 1])
def test_audit_flags_each_kind_of_bad_table(seed, W, block_w, monkeypatch):
    """Each request alone (the flag is one word): exactly its case's bits. At 45 beams (and at 5 in blocks of 2 beams)
    the held page spans several beam blocks; the odd seed puts it in the last beam and column."""
    if block_w is not None:
        monkeypatch.setattr(page_table_audit, "AUDIT_BLOCK_W", block_w)
    kv, prompt, table, digest, p = _case(seed, W)
    got = {}
    for r, case in enumerate(CASES):
        rows = slice(r * W, r * W + W)
        flags = new_error_flags(DEVICE)
        flags.fill_(1)  # (another kind's bit, already set: the audit ORs into the word, it never clears it)
        got[case] = _audit(kv[rows], prompt[rows], table[rows], W, flags, plan_digest=digest[r:r + 1], **p)
    assert got == {c: 1 | bits for c, bits in CASES.items()}
    # The whole batch at once: one word for all (the two "entry_missing" requests both write page 0, the quotient a
    # truncating -1 // 2 would give: OTHER_REQUEST_PAGE; no other page of one request is another's), and nothing
    # read past the table's rows or columns (a strided view whose other entries are another request's pages).
    wide = torch.full((table.shape[0] + W, table.shape[1] + 3), int(table[0, 0]), dtype=torch.int32)
    wide[:table.shape[0], :table.shape[1]] = table
    want = OTHER
    for bits in CASES.values():
        want |= bits
    assert _audit(kv, prompt, wide[:, :table.shape[1]], W, plan_digest=digest, **p) == want
    other = other_request_page_bad_torch(kv, prompt, table, W, p["page_size"], p["page_index_divisor"],
                                         p["num_pages"], p["max_seq_len"]).view(-1, W).any(1)
    assert [c for r, c in enumerate(CASES) if other[r]] == ["held_entry_missing", "own_entry_missing"]


def _rules_by_loops(kv, prompt, table, W, pg, div, num_pages, max_seq_len, plan_pages=None):
    """The rules, written from their statements with Python ints (floor division on entries >= 0 only): a bool per row
    for ``HELD``, ``OTHER``, ``SHARED`` and ``LEN``, and per request for ``PLAN`` (against ``plan_pages``, a list of
    each request's plan pages, when given)."""
    kv, prompt, table = kv.tolist(), prompt.tolist(), table.tolist()
    rows, cols = len(kv), len(table[0])

    def page(entry):
        return entry // div if 0 <= entry and entry // div < num_pages else None

    holders = {}  # page -> the rows holding it within their length (beams past beam 0 from their prompt's last column)
    for i in range(rows):
        start = 0 if i % W == 0 else max(prompt[i], 0) // pg
        for c in range(start, min(-(-max(min(kv[i], max_seq_len), 0) // pg), cols)):
            if page(table[i][c]) is not None:
                holders.setdefault(page(table[i][c]), set()).add(i)
    rules = {name: [] for name in ("held", "other", "shared", "len")}
    for i in range(rows):
        first = i - i % W
        cur, cur0 = kv[i] - 1, kv[first] - 1
        w_page = page(table[i][cur // pg]) if 0 <= cur < max_seq_len and cur // pg < cols else None
        judged = w_page is not None and cur > prompt[i]
        request = range(first, first + W)
        rules["other"].append(judged and any(h not in request for h in holders[w_page]))
        earlier = range(0 if i == first else max(prompt[i], 0) // pg, cur // pg)
        # Another row of the request: exact where no other request holds the page (OTHER_REQUEST_PAGE's, where the
        # audit's two holders, the lowest and the highest row, may both lie outside the request).
        extremes = (min(holders[w_page]), max(holders[w_page])) if judged else ()
        rules["held"].append(judged and (any(h in request and h != i for h in extremes)
                                         or any(page(table[i][c]) == w_page for c in earlier)))
        rules["len"].append(i != first and kv[i] != kv[first])
        rules["shared"].append(i != first and w_page is not None and cur == cur0 and cur > prompt[first]
                               and table[first][cur // pg] >= 0 and table[first][cur // pg] // div == w_page)
    out = {name: torch.tensor(v, dtype=torch.bool) for name, v in rules.items()}
    if plan_pages is not None:
        plan = []
        for r, want in enumerate(plan_pages):
            plen = prompt[r * W]
            n = -(-plen // pg)
            judged = 1 <= plen <= min(max_seq_len, cols * pg)
            got = [table[r * W][c] // div if table[r * W][c] >= 0 else -1 for c in range(n)] if judged else []
            plan.append(judged and got != list(want[:n]))
        out["plan"] = torch.tensor(plan, dtype=torch.bool)
    return out


def _word(rules, rows=slice(None), requests=slice(None)):
    """The flag word the rules give for some rows (and their requests' plan)."""
    word = 0
    for name, bit in (("held", HELD), ("other", OTHER), ("shared", SHARED), ("len", LEN)):
        word |= bit if rules[name][rows].any() else 0
    return word | (PLAN if "plan" in rules and rules["plan"][requests].any() else 0)


@st.composite
def _batches(draw):
    """Requests of ``W`` beams near a page boundary (a page's first token, or a token or two past it), their tables of
    distinct pages (full prompt pages shared by the beams) with a few changes: a write entry copied from an earlier
    column of the request or from another request's row, any entry copied from any other, a beam at another length,
    a missing entry, a page past the pool, a plan page changed; and the plan's pages (beam 0's, before the changes)."""
    R, W = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    pg, div = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    cols = draw(st.integers(3, 8))
    kv, prompt = [], []
    for _ in range(R):
        plen = draw(st.integers(1, pg * (cols - 2)))
        kv_len = min(max(draw(st.integers(plen // pg + 1, cols - 1)) * pg + draw(st.sampled_from([1, 1, 0, 2])),
                         plen + 1), pg * cols)
        kv += [kv_len] * W
        prompt += [plen] * W
    num_pages = R * W * cols + 2
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(num_pages - 1, generator=g)[:R * W * cols] + 1).view(R, W, cols)
    for r in range(R):
        full = prompt[r * W] // pg
        pages[r, :, :full] = pages[r, 0, :full].clone()
    plan_pages = pages[:, 0].tolist()
    table = (pages * div + torch.randint(0, div, pages.shape, generator=g)).view(R * W, cols)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["held", "held", "cross", "cross", "copy", "length", "missing", "past_pool",
                                     "plan"]))
        i, j = draw(st.integers(0, R * W - 1)), draw(st.integers(0, R * W - 1))
        a, b = draw(st.integers(0, cols - 1)), draw(st.integers(0, cols - 1))
        first = i - i % W
        write_col, first_col = (kv[i] - 1) // pg, prompt[first] // pg
        if kind == "held" and first_col < write_col < cols:  # row i's write page from its request's earlier columns
            table[i, write_col] = table[first + j % W, draw(st.integers(first_col, write_col - 1))]
        elif kind == "cross" and write_col < cols:  # from a row's columns within its length (any request)
            table[i, write_col] = table[j, draw(st.integers(0, (kv[j] - 1) // pg))]
        elif kind == "copy":
            table[i, a] = table[j, b]
        elif kind == "length":
            kv[i] = min(kv[i] + pg, pg * cols)
        elif kind == "missing":
            table[i, a] = -1
        elif kind == "plan":  # a plan of another batch: one of its pages moved
            plan_pages[i // W][a] = (plan_pages[i // W][a] + 1 + j) % num_pages
        else:
            table[i, a] = num_pages * div
    kv, prompt = torch.tensor(kv, dtype=torch.int32), torch.tensor(prompt, dtype=torch.int32)
    n_cols = -(-prompt[::W].long() // pg)
    digest = prompt_pages_digest_torch(torch.tensor(plan_pages), n_cols)
    return (kv, prompt, table.int(), W, plan_pages, digest,
            dict(page_size=pg, page_index_divisor=div, num_pages=num_pages, max_seq_len=pg * cols))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_audit_and_twins_match_the_rules_on_random_tables(batch):
    """Random batches near page boundaries with copied entries (within and across requests), beams at another
    length, missing entries, pages past the pool and plans of another batch: the rules' twins name the rows the
    rules computed entry by entry in Python name, and the kernels' word (and the audit's twin's) is theirs, for the
    batch and for each request alone."""
    kv, prompt, table, W, plan_pages, digest, p = batch
    args = (W, p["page_size"], p["page_index_divisor"], p["num_pages"], p["max_seq_len"])
    rules = _rules_by_loops(kv, prompt, table, *args, plan_pages=plan_pages)
    assert torch.equal(device_errors.held_write_page_bad_torch(kv, prompt, table, *args), rules["held"])
    assert torch.equal(other_request_page_bad_torch(kv, prompt, table, *args), rules["other"])
    differs, shared = device_errors.beam_agreement_bad_torch(kv, prompt[torch.arange(kv.numel()) // W * W], table,
                                                             *args)
    assert torch.equal(differs, rules["len"]) and torch.equal(shared, rules["shared"])
    assert torch.equal(device_errors.plan_digest_bad_torch(table, prompt, digest, W, p["page_size"],
                                                           p["page_index_divisor"], p["max_seq_len"]), rules["plan"])
    assert _audit(kv, prompt, table, W, plan_digest=digest, **p) == _word(rules)
    for r in range(kv.numel() // W):
        rows = slice(r * W, r * W + W)
        alone = _rules_by_loops(kv[rows], prompt[rows], table[rows], *args, plan_pages=plan_pages[r:r + 1])
        assert _audit(kv[rows], prompt[rows], table[rows], W, plan_digest=digest[r:r + 1], **p) == _word(alone), r


@triton.jit
def _digest_terms_kernel(col_ptr, page_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, prompt_page_digest_term(tl.load(col_ptr + i, mask=ok), tl.load(page_ptr + i, mask=ok)),
             mask=ok)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.data())
def test_prompt_digest_is_one_on_the_host_the_device_and_in_torch(lens, data):
    """The plan's digest (``StepPlan.prompt_pages_digest``, numpy), the torch twin's and the kernel's terms are one
    function; and one page changed, to any other value, changes a prompt's digest (each term is a bijection of its
    page), while the padding past a prompt's pages counts for nothing."""
    pg = 4
    R = len(lens)
    pages = data.draw(st.lists(st.integers(0, 2**31 - 2), min_size=sum(lens), max_size=sum(lens), unique=True))
    prompts = [pages[sum(lens[:r]):sum(lens[:r + 1])] for r in range(R)]
    indptr = np.cumsum([0] + lens).astype(np.int32)
    indices = np.array([page for p in prompts for page in p], dtype=np.int32)
    prompt_lens = np.array([pg * n - data.draw(st.integers(0, pg - 1)) for n in lens], dtype=np.int32)
    plan = build_step_plan(indptr, indices, prompt_lens, 2, pg, 2**31 - 1)
    width = max(lens)
    padded = torch.tensor([p + [-7] * (width - len(p)) for p in prompts])
    twin = prompt_pages_digest_torch(padded, torch.tensor(lens))
    assert plan.prompt_pages_digest.dtype == np.int64
    assert plan.prompt_pages_digest.tolist() == twin.tolist()
    col = torch.arange(width).repeat(R)
    page = padded.flatten()
    terms = torch.empty(col.numel(), dtype=torch.int64, device=DEVICE)
    _digest_terms_kernel[(1,)](col.to(DEVICE), page.to(DEVICE), terms, col.numel(),
                               BLOCK=triton.next_power_of_2(col.numel()))
    assert torch.equal(terms.cpu(), device_errors.prompt_page_digest_terms_torch(col, page))
    r = data.draw(st.integers(0, R - 1))
    c = data.draw(st.integers(0, lens[r] - 1))
    moved = padded.clone()
    moved[r, c] = data.draw(st.integers(-1, 2**31 - 1).filter(lambda v: v != int(padded[r, c])))
    assert int(prompt_pages_digest_torch(moved, torch.tensor(lens))[r]) != int(twin[r])


def _two_requests(W=3, pg=4, prompt_len=9, kv_len=14, cols=6):
    """Two requests of ``W`` beams, distinct pages (the full prompt pages shared by each request's beams):
    ``(kv, prompt, table, params)``."""
    g = torch.Generator().manual_seed(5)
    pages = (torch.randperm(2 * W * cols, generator=g) + 1).view(2, W, cols)
    pages[:, :, :prompt_len // pg] = pages[:, :1, :prompt_len // pg].clone()
    kv = torch.full((2 * W,), kv_len, dtype=torch.int32)
    prompt = torch.full((2 * W,), prompt_len, dtype=torch.int32)
    return kv, prompt, pages.view(2 * W, cols).int(), dict(page_size=pg, num_pages=2 * W * cols + 1,
                                                             max_seq_len=cols * pg)


@pytest.mark.parametrize("case,rows", [
    ("valid", []),
    ("other_request_write_page", [2, 4]),  # request 0's beam 2 writes it too: both rows are named
    ("other_request_prompt_page", [4]),  # request 0's first prompt page (every beam of it reads it)
    ("other_request_partly_filled_copy", [4]),  # request 0's beam 1's copy of the prompt's last page
    ("past_the_other_rows_length", []),  # a stale entry of request 0's beam 2, one column past its kv_len: not held
    ("at_the_first_generated_token", []),  # not judged (the warm-up's shared last block)
    ("other_request_padding_row", [4]),  # a padding row (kv_len 1) holds its one page
    ("onto_a_later_requests_page", [1]),  # request 0's beam 1 onto request 1's first prompt page
])
def test_audit_flags_a_write_page_another_request_holds(case, rows):
    """Request 1's beam 1 (row 4) writes at position 13 (column 3, its second generated page) onto a page of request
    0: its beam 2's write page, a prompt page, a beam's copy of the partly filled page; not a stale entry past that
    row's length, nor at the first generated token; and request 0's beam 1 onto a page of request 1 (the holder above
    the row's request, where the others are below). The twin names the rows."""
    kv, prompt, table, p = _two_requests()
    if case == "other_request_write_page":
        table[4, 3] = table[2, 3]
    elif case == "other_request_prompt_page":
        table[4, 3] = table[0, 0]
    elif case == "other_request_partly_filled_copy":
        table[4, 3] = table[1, 2]
    elif case == "past_the_other_rows_length":
        table[4, 3] = table[2, 4]
    elif case == "at_the_first_generated_token":
        kv[3:] = 10  # (request 1 at position 9 = its prompt length; its write column is 2)
        table[4, 2] = table[0, 0]
    elif case == "other_request_padding_row":
        kv[:3], prompt[:3] = 1, 1
        table[4, 3] = table[0, 0]
    elif case == "onto_a_later_requests_page":
        table[1, 3] = table[3, 0]
    assert _audit(kv, prompt, table, 3, **p) == (OTHER if rows else 0)
    bad = other_request_page_bad_torch(kv, prompt, table, 3, p["page_size"], 1, p["num_pages"], p["max_seq_len"])
    assert bad.nonzero().flatten().tolist() == rows


@pytest.mark.parametrize("block_w", [None, 2], ids=["one_beam_block", "two_beam_blocks"])
def test_audit_judges_each_step_against_its_own_table(block_w, monkeypatch):
    """The holders are stamped by audit: a page request 0 held at one step and gave back is free at the next, so
    request 1 writing it then raises nothing; the same table audited again (a replayed graph) gives the same word.
    The stamp moves by one an audit, however many programs a request takes."""
    if block_w is not None:
        monkeypatch.setattr(page_table_audit, "AUDIT_BLOCK_W", block_w)
    kv, prompt, table, p = _two_requests()
    workspace = new_audit_workspace(p["num_pages"], DEVICE)
    assert _audit(kv, prompt, table, 3, workspace=workspace, **p) == 0
    moved = table.clone()
    moved[4, 3] = table[2, 3]
    moved[2, 3] = 0  # (request 0's beam 2 gave its page back: it now holds page 0, nobody else's)
    for _ in range(2):
        assert _audit(kv, prompt, moved, 3, workspace=workspace, **p) == 0
    moved[2, 3] = table[2, 3]  # held by both again
    for _ in range(2):
        assert _audit(kv, prompt, moved, 3, workspace=workspace, **p) == OTHER
    assert workspace.audit_state.tolist() == [6]  # five audits, from stamp 1


def test_audit_judges_nothing_on_a_valid_batch_at_any_step():
    """A valid table over two pages of steps (every token of the write page, the page's first included), audited
    step after step on one workspace, and an empty batch: the flag stays 0."""
    W, pg = 3, 4
    g = torch.Generator().manual_seed(3)
    R, prompt_len, cols = 2, 9, 8
    pages = (torch.randperm(R * W * cols, generator=g) + 1).view(R, W, cols)
    pages[:, :, :prompt_len // pg] = pages[:, :1, :prompt_len // pg].clone()
    table = pages.view(R * W, cols).int()
    prompt = torch.full((R * W,), prompt_len, dtype=torch.int32)
    p = dict(page_size=pg, num_pages=R * W * cols + 1, max_seq_len=cols * pg)
    workspace = new_audit_workspace(p["num_pages"], DEVICE)
    for kv_len in range(prompt_len + 1, prompt_len + 2 * pg + 1):
        kv = torch.full((R * W,), kv_len, dtype=torch.int32)
        assert _audit(kv, prompt, table, W, workspace=workspace, plan_digest=_plan_digest(table, prompt, W, pg, 1),
                      **p) == 0, kv_len
    empty = torch.zeros(0, dtype=torch.int32)
    assert _audit(empty, empty, table[:0], W, page_size=pg, num_pages=1, max_seq_len=cols * pg) == 0


def _good_args():
    kv = torch.full((6,), 9, dtype=torch.int32, device=DEVICE)
    return dict(kv_lens=kv, prompt_lens=kv - 4, beam_page_table=torch.ones(6, 4, dtype=torch.int32, device=DEVICE),
                beam_width=3, error_flags=new_error_flags(DEVICE), workspace=new_audit_workspace(8, DEVICE),
                page_size=4, num_pages=8, max_seq_len=16)


AUDIT_BAD_ARGUMENTS = [
    (dict(kv_lens=torch.ones(6, dtype=torch.int64, device=DEVICE)), "kv_lens has dtype int64"),
    (dict(beam_page_table=torch.ones(6, 1, 4, dtype=torch.int32, device=DEVICE)), r"beam_page_table must be \[>= R\*W"),
    (dict(beam_page_table=torch.ones(5, 4, dtype=torch.int32, device=DEVICE)),
     "beam_page_table has 5 rows but kv_lens has 6"),
    (dict(beam_width=4), "6 rows, not a multiple of beam_width=4"),
    (dict(beam_width=0), "beam_width=0 must be an int >= 1"),
    (dict(prompt_lens=torch.ones(3, dtype=torch.int32, device=DEVICE)), r"prompt_lens must be int32 \[6\]"),
    (dict(kv_lens=torch.ones(12, dtype=torch.int32, device=DEVICE)[::2]), "kv_lens has stride 2"),
    (dict(page_size=0), r"page_size=0 must be an int in \[1, 2\*\*31\)"),
    (dict(max_seq_len=2.0), r"max_seq_len=2.0 must be an int"),
    (dict(page_index_divisor=0), "page_index_divisor=0 must be an int"),
    (dict(error_flags=None), "error_flags is None"),
    (dict(error_flags=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
     "error_flags must be an int32 tensor of one element"),
    (dict(workspace=new_audit_workspace(9, DEVICE)), r"workspace must be new_audit_workspace\(num_pages=8"),
    (dict(workspace=None), r"workspace must be new_audit_workspace\(num_pages=8"),
    (dict(max_seq_len=17), r"beam_page_table has 4 columns of 4 tokens, fewer than max_seq_len=17"),
    (dict(plan_digest=torch.zeros(2, dtype=torch.int32, device=DEVICE)), r"plan_digest must be a contiguous int64"),
    (dict(plan_digest=torch.zeros(6, dtype=torch.int64, device=DEVICE)), r"int64 \[R=2\] tensor .* got torch.int64 \(6,\)"),
]
AUDIT_BAD_IDS = ["dtype", "table_dims", "table_rows", "partial_request", "beam_width", "prompt_rows", "stride",
                 "page_size", "max_seq_len", "divisor", "no_flag", "flag_shape", "workspace_of_another_pool",
                 "no_workspace", "table_short_of_the_cache", "digest_dtype", "digest_per_row"]


@pytest.mark.parametrize("audit,change,match", [
    pytest.param(audit, change, match, id=f"{audit}-{name}")
    for audit in ("triton", "torch") for (change, match), name in zip(AUDIT_BAD_ARGUMENTS, AUDIT_BAD_IDS)
    if audit == "triton" or "workspace" not in change])  # (the torch twin takes no workspace)
def test_audit_refuses_bad_arguments_by_name(audit, change, match):
    """Both audits (the torch twin takes no workspace) refuse each bad argument by name, before any launch."""
    args = _good_args()
    args.update(change)
    flags, state = args["error_flags"], args["workspace"].audit_state if args["workspace"] else None
    with pytest.raises(KernelInputError, match=match):
        if audit == "triton":
            audit_page_table(**args)
        else:
            audit_page_table_torch(**{k: v for k, v in args.items() if k != "workspace"})
    if isinstance(flags, torch.Tensor) and flags.numel() == 1:
        assert int(flags.item()) == 0  # refused before any launch
    if state is not None:
        assert state.tolist() == [1]


@pytest.mark.parametrize("audit,inside", [("triton", "kv_lens"), ("torch", "kv_lens"), ("triton", "audit_state")])
def test_audit_refuses_an_error_flag_inside_what_it_reads_or_keeps(audit, inside):
    """A flag that is an element of ``kv_lens`` (or of the audit's own workspace) would OR its bits into a length
    the step's layers then attend: refused by name, nothing written."""
    args = _good_args()
    args["error_flags"] = args["kv_lens"][5:] if inside == "kv_lens" else args["workspace"].audit_state
    with pytest.raises(KernelInputError, match=f"error_flags overlaps {inside} in memory"):
        if audit == "triton":
            audit_page_table(**args)
        else:
            audit_page_table_torch(**{k: v for k, v in args.items() if k != "workspace"})
    assert args["kv_lens"].tolist() == [9] * 6 and args["workspace"].audit_state.tolist() == [1]
