"""The page-table audit (:mod:`triton_kernels.page_table_audit`), in its kernels and their torch twins
(:func:`~triton_kernels.device_errors.fresh_write_page_bad_torch`,
:func:`~triton_kernels.device_errors.other_request_page_bad_torch`) alike:

- ``HELD_WRITE_PAGE``: a write page that a beam of its request holds at an earlier generated column, at the page's
  first token; a later token of the page, a beam at another length, a missing held entry, a page past the pool,
  padding rows and what :func:`held_write_page_bits` judges raise nothing;
- ``OTHER_REQUEST_PAGE``: a write page that a row of another request holds within its length, from the second
  generated token, judged against this step's table only (the stamps);
- the launcher refuses bad arguments by name.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_kernels import KernelInputError, device_errors, page_table_audit
from triton_kernels.device_errors import fresh_write_page_bad_torch, new_error_flags, other_request_page_bad_torch
from triton_kernels.page_table_audit import audit_page_table, new_audit_workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: conftest set TRITON_INTERPRET=1)
BIT = device_errors.HELD_WRITE_PAGE.value
OTHER = device_errors.OTHER_REQUEST_PAGE.value


def _audit(kv, prompt, table, W, flags=None, workspace=None, **p):
    """The audit of one step on ``DEVICE`` (a fresh workspace unless one is given): the flag word."""
    flags = new_error_flags(DEVICE) if flags is None else flags
    workspace = new_audit_workspace(p["num_pages"], DEVICE) if workspace is None else workspace
    audit_page_table(kv.to(DEVICE), prompt.to(DEVICE), table.to(DEVICE), W, flags, workspace, **p)
    return int(flags.item())


CASES = ["valid", "other_beam_earlier_column", "own_earlier_column", "other_beams_prompt_copy",
         "beam0_partial_prompt_page", "mid_page", "longer_beam", "held_entry_missing", "padding",
         "same_column_pair", "on_full_prompt_page", "full_prompt_earlier_column", "outside_pool"]


def _case(seed: int, W: int):
    """Requests of ``W`` beams (page 4, divisor 2) at a page's first token (``kv_len - 1 = 4 x column``), two to five
    pages past their prompt's last page, one request per entry of :data:`CASES`, each valid or broken one way:
    ``(kv_lens, prompt_lens, table, want, params)``, ``want`` a bool per row. Page 0 is nobody's."""
    pg, div = 4, 2
    g = torch.Generator().manual_seed(seed)
    R = len(CASES)
    k = torch.randint(2, 12, (R,), generator=g)  # the prompt's last column (its partly filled page)
    prompt = pg * k + 1 + torch.randint(0, pg - 1, (R,), generator=g)
    prompt[CASES.index("full_prompt_earlier_column")] = pg * k[CASES.index("full_prompt_earlier_column")]
    col = k + 2 + torch.randint(0, 4, (R,), generator=g)  # the write column: one to four full generated columns
    kv = pg * col + 1
    cols = int(col.max()) + 2
    num_pages = R * W * cols + 1
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).view(R, W, cols)
    for r in range(R):
        pages[r, :, :int(k[r])] = pages[r, 0, :int(k[r])]  # the full prompt pages, shared by the beams
    table = pages * div + torch.randint(0, div, pages.shape, generator=g)
    kv, prompt = kv.repeat_interleave(W), prompt.repeat_interleave(W)
    want = torch.zeros(R, W, dtype=torch.bool)
    edge = seed % 2 == 1  # the held page in the last block of the comparison (the last beam, the last column)
    for r, case in enumerate(CASES):
        i, j = (int(v) for v in 1 + torch.randperm(W - 1, generator=g)[:2])
        c_w, c_p = int(col[r]), int(k[r])
        c = c_w - 1 if edge else int(torch.randint(c_p + 1, c_w, (1,), generator=g))  # a full generated column
        if edge:
            j = W - 1
        t = table[r]  # (a view)
        if case == "other_beam_earlier_column":
            t[i, c_w] = t[j, c] // div * div + (t[j, c] + 1) % div  # the page in the divisor's other code
            want[r, i] = True
        elif case == "own_earlier_column":
            t[i, c_w] = t[i, c]
            want[r, i] = True
        elif case == "other_beams_prompt_copy":
            t[i, c_w] = t[j, c_p]
            want[r, i] = True
        elif case == "beam0_partial_prompt_page":  # (held_write_page_bits sees it too)
            t[0, c_w] = t[0, c_p]
            want[r, 0] = True
        elif case == "full_prompt_earlier_column":  # a prompt of whole pages: column c_p is the first generated one
            t[i, c_w] = t[j, c_p]
            want[r, i] = True
        elif case == "mid_page":  # a token past the page's first: not judged (the rule's blind spot)
            kv[r * W:r * W + W] += 1
            t[i, c_w] = t[j, c]
        elif case == "longer_beam":  # beam i a page ahead of beam 0 (BEAM_KV_LEN's): not judged, at either column
            kv[r * W + i] += pg
            t[i, c_w + 1] = t[j, c]
            t[i, c_w] = t[j, c - 1]
        elif case == "outside_pool":  # a write page past the pool is WRITE_PAGE's (the kernels'), held or not
            t[i, c_w] = t[j, c] = num_pages * div
        elif case == "held_entry_missing":  # -1 // 2 must not make page 0 a held page
            t[i, c_w] = 1
            t[j, c] = -1
        elif case == "padding":  # TensorRT-LLM's padding rows: kv_len 1, a one-token prompt, one page for all
            kv[r * W:r * W + W], prompt[r * W:r * W + W] = 1, 1
            t[:, 0] = t[0, 0]
        elif case == "same_column_pair":  # held_write_page_bits's, not this rule's
            t[j, c_w] = t[i, c_w]
        elif case == "on_full_prompt_page":  # held_write_page_bits's too: the full prompt pages are not compared
            t[i, c_w] = t[0, int(torch.randint(0, c_p, (1,), generator=g))]
    params = dict(page_size=pg, page_index_divisor=div, num_pages=num_pages, max_seq_len=cols * pg)
    return kv.int(), prompt.int(), table.view(R * W, cols).int(), want, params


@pytest.mark.parametrize("W,blocks", [(5, (2, 8)), (45, None)], ids=["5_beams_small_blocks", "45_beams"])
@pytest.mark.parametrize("seed", [0, 1])
def test_audit_flags_a_write_page_held_at_an_earlier_column(seed, W, blocks, monkeypatch):
    """Each request alone (the flag is one word): its bit iff one of its rows is wanted; the twin names the rows. At
    45 beams (and at 5 in blocks of 2 beams and 8 entries) the held page spans several blocks of the comparison; the
    odd seed puts it in the last one."""
    if blocks is not None:
        monkeypatch.setattr(page_table_audit, "AUDIT_BLOCK_W", blocks[0])
        monkeypatch.setattr(page_table_audit, "AUDIT_BLOCK_H", blocks[1])
    kv, prompt, table, want, p = _case(seed, W)
    got = {}
    for r, case in enumerate(CASES):
        rows = slice(r * W, r * W + W)
        flags = new_error_flags(DEVICE)
        flags.fill_(1)  # (another kind's bit, already set: the audit ORs into the word, it never clears it)
        got[case] = _audit(kv[rows], prompt[rows], table[rows], W, flags, **p)
    assert got == {c: 1 | (BIT if want[r].any() else 0) for r, c in enumerate(CASES)}
    twin = fresh_write_page_bad_torch(kv, prompt, table, W, p["page_size"], p["page_index_divisor"],
                                      p["num_pages"], p["max_seq_len"])
    assert torch.equal(twin.view(-1, W), want), {c: twin.view(-1, W)[r].nonzero().flatten().tolist()
                                                 for r, c in enumerate(CASES)}
    # The whole batch at once: one word for all (no page of one request is another's), and nothing read past the
    # table's rows or columns (a strided view whose other entries are another request's pages).
    wide = torch.full((table.shape[0] + W, table.shape[1] + 3), int(table[0, 0]), dtype=torch.int32)
    wide[:table.shape[0], :table.shape[1]] = table
    assert _audit(kv, prompt, wide[:, :table.shape[1]], W, **p) == BIT
    assert not other_request_page_bad_torch(kv, prompt, table, W, p["page_size"], p["page_index_divisor"],
                                            p["num_pages"], p["max_seq_len"]).any()


def _rules_by_loops(kv, prompt, table, W, pg, div, num_pages, max_seq_len):
    """Both rules, written from their statements with Python ints (floor division on entries >= 0 only):
    ``(held, other)``, a bool per row each."""
    kv, prompt, table = kv.tolist(), prompt.tolist(), table.tolist()
    rows, cols = len(kv), len(table[0])
    holders = {}  # page -> the rows holding it within their length (beams past beam 0 from their prompt's last column)
    for i in range(rows):
        start = 0 if i % W == 0 else max(prompt[i], 0) // pg
        for c in range(start, min(-(-max(min(kv[i], max_seq_len), 0) // pg), cols)):
            if table[i][c] >= 0 and table[i][c] // div < num_pages:
                holders.setdefault(table[i][c] // div, set()).add(i)
    held, other = [], []
    for i in range(rows):
        first = i - i % W
        cur, cur0, plen0 = kv[i] - 1, kv[first] - 1, prompt[first]
        entry = table[i][cur // pg] if 0 <= cur < max_seq_len and cur // pg < cols else -1
        valid = entry >= 0 and entry // div < num_pages
        other.append(valid and cur > prompt[i] and any(h // W != i // W for h in holders[entry // div]))
        if not (plen0 < cur0 < max_seq_len and cur0 % pg == 0 and cur0 // pg < cols) or cur != cur0 or not valid:
            held.append(False)
            continue
        earlier = {table[b][c] // div for b in range(first, first + W) for c in range(max(plen0, 0) // pg, cur0 // pg)
                   if table[b][c] >= 0}
        held.append(entry // div in earlier)
    return torch.tensor(held, dtype=torch.bool), torch.tensor(other, dtype=torch.bool)


@st.composite
def _batches(draw):
    """Requests of ``W`` beams near a page boundary (a page's first token, or a token or two past it), their tables of
    distinct pages (full prompt pages shared by the beams) with a few changes: a write entry copied from an earlier
    column of the request or from another request's row, any entry copied from any other, a beam at another length,
    a missing entry, a page past the pool."""
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
    table = (pages * div + torch.randint(0, div, pages.shape, generator=g)).view(R * W, cols)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["held", "held", "cross", "cross", "copy", "length", "missing", "past_pool"]))
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
        else:
            table[i, a] = num_pages * div
    return (torch.tensor(kv, dtype=torch.int32), torch.tensor(prompt, dtype=torch.int32), table.int(), W,
            dict(page_size=pg, page_index_divisor=div, num_pages=num_pages, max_seq_len=pg * cols))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_audit_and_twins_match_the_rules_on_random_tables(batch):
    """Random batches near page boundaries with copied entries (within and across requests), beams at another
    length, missing entries and pages past the pool: the twins' rows equal the rules computed entry by entry in
    Python, and so do the kernels' word for the batch and (``HELD_WRITE_PAGE``) for each request alone."""
    kv, prompt, table, W, p = batch
    args = (W, p["page_size"], p["page_index_divisor"], p["num_pages"], p["max_seq_len"])
    held, other = _rules_by_loops(kv, prompt, table, *args)
    assert torch.equal(fresh_write_page_bad_torch(kv, prompt, table, *args), held)
    assert torch.equal(other_request_page_bad_torch(kv, prompt, table, *args), other)
    assert _audit(kv, prompt, table, W, **p) == (BIT if held.any() else 0) | (OTHER if other.any() else 0)
    for r in range(kv.numel() // W):
        rows = slice(r * W, r * W + W)
        assert _audit(kv[rows], prompt[rows], table[rows], W, **p) == (BIT if held[rows].any() else 0), r


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
    moved[2, 3] = 2 * 3 * 6  # (request 0's beam 2 gave its page back: it now holds the pool's last page)
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
        assert _audit(kv, prompt, table, W, workspace=workspace, **p) == 0, kv_len
    empty = torch.zeros(0, dtype=torch.int32)
    assert _audit(empty, empty, table[:0], W, page_size=pg, num_pages=1, max_seq_len=cols * pg) == 0


def _good_args():
    kv = torch.full((6,), 9, dtype=torch.int32, device=DEVICE)
    return dict(kv_lens=kv, prompt_lens=kv - 4, beam_page_table=torch.ones(6, 4, dtype=torch.int32, device=DEVICE),
                beam_width=3, error_flags=new_error_flags(DEVICE), workspace=new_audit_workspace(8, DEVICE),
                page_size=4, num_pages=8, max_seq_len=16)


@pytest.mark.parametrize("change,match", [
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
], ids=["dtype", "table_dims", "table_rows", "partial_request", "beam_width", "prompt_rows", "stride", "page_size",
        "max_seq_len", "divisor", "no_flag", "flag_shape", "workspace_of_another_pool", "no_workspace"])
def test_audit_refuses_bad_arguments_by_name(change, match):
    args = _good_args()
    args.update(change)
    flags, state = args["error_flags"], args["workspace"].audit_state if args["workspace"] else None
    with pytest.raises(KernelInputError, match=match):
        audit_page_table(**args)
    if isinstance(flags, torch.Tensor) and flags.numel() == 1:
        assert int(flags.item()) == 0  # refused before any launch
    if state is not None:
        assert state.tolist() == [1]
