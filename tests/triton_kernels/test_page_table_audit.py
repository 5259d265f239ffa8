"""The page-table audit (:mod:`triton_kernels.page_table_audit`): a write page that a beam of its request holds at an
earlier generated column raises ``HELD_WRITE_PAGE`` at the page's first token, in the kernel and its torch twin
(:func:`triton_kernels.device_errors.fresh_write_page_bad_torch`) alike; the other cases (a later token of the page,
a beam at another length, a missing held entry, a page past the pool, padding rows, what :func:`held_write_page_bits`
judges) raise nothing; and the launcher refuses bad arguments by name.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_kernels import KernelInputError, device_errors, page_table_audit
from triton_kernels.device_errors import fresh_write_page_bad_torch, new_error_flags
from triton_kernels.page_table_audit import audit_fresh_write_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: conftest set TRITON_INTERPRET=1)
BIT = device_errors.HELD_WRITE_PAGE.value

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
        audit_fresh_write_pages(kv[rows].to(DEVICE), prompt[rows].to(DEVICE), table[rows].to(DEVICE), W, flags, **p)
        got[case] = int(flags.item())
    assert got == {c: 1 | (BIT if want[r].any() else 0) for r, c in enumerate(CASES)}
    twin = fresh_write_page_bad_torch(kv, prompt, table, W, p["page_size"], p["page_index_divisor"],
                                      p["num_pages"], p["max_seq_len"])
    assert torch.equal(twin.view(-1, W), want), {c: twin.view(-1, W)[r].nonzero().flatten().tolist()
                                                 for r, c in enumerate(CASES)}
    # The whole batch in one launch: one word for all, and nothing read past the table's rows (a strided view).
    wide = torch.full((table.shape[0] + W, table.shape[1] + 3), -7, dtype=torch.int32)
    wide[:table.shape[0], :table.shape[1]] = table
    flags = new_error_flags(DEVICE)
    audit_fresh_write_pages(kv.to(DEVICE), prompt.to(DEVICE), wide.to(DEVICE)[:, :table.shape[1]], W, flags, **p)
    assert int(flags.item()) == BIT


def _rule_by_loops(kv, prompt, table, W, pg, div, num_pages, max_seq_len):
    """The rule, written from its statement with Python ints (floor division on entries >= 0 only): a bool per row."""
    kv, prompt, table = kv.tolist(), prompt.tolist(), table.tolist()
    cols = len(table[0])
    bad = []
    for i in range(len(kv)):
        first = i - i % W
        cur0, plen = kv[first] - 1, prompt[first]
        if not (plen < cur0 < max_seq_len and cur0 % pg == 0 and cur0 // pg < cols) or kv[i] - 1 != cur0:
            bad.append(False)
            continue
        entry = table[i][cur0 // pg]
        if entry < 0 or entry // div >= num_pages:
            bad.append(False)
            continue
        held = {table[b][c] // div for b in range(first, first + W) for c in range(max(plen, 0) // pg, cur0 // pg)
                if table[b][c] >= 0}
        bad.append(entry // div in held)
    return torch.tensor(bad, dtype=torch.bool)


@st.composite
def _batches(draw):
    """Requests of ``W`` beams near a page boundary (a page's first token, or a token or two past it), their tables of
    distinct pages (full prompt pages shared by the beams) with a few changes: a write entry copied from an earlier
    column of the request, any entry copied from any other, a beam at another length, a missing entry, a page past the
    pool."""
    R, W = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    pg, div = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    cols = draw(st.integers(3, 8))
    kv, prompt = [], []
    for _ in range(R):
        plen = draw(st.integers(1, pg * (cols - 2)))
        kv_len = min(max(draw(st.integers(plen // pg + 1, cols - 1)) * pg + draw(st.sampled_from([1, 1, 0, 2])), plen + 1),
                     pg * cols)
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
        kind = draw(st.sampled_from(["held", "held", "held", "copy", "length", "missing", "past_pool"]))
        i, j = draw(st.integers(0, R * W - 1)), draw(st.integers(0, R * W - 1))
        a, b = draw(st.integers(0, cols - 1)), draw(st.integers(0, cols - 1))
        first = i - i % W
        write_col, first_col = (kv[first] - 1) // pg, prompt[first] // pg
        if kind == "held" and first_col < write_col < cols:  # row i's write page from its request's earlier columns
            table[i, write_col] = table[first + j % W, draw(st.integers(first_col, write_col - 1))]
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_audit_and_twin_match_the_rule_on_random_tables(batch):
    """Random batches near page boundaries with copied entries (within and across requests), beams at another
    length, missing entries and pages past the pool: the kernel's word for each request and the twin's rows equal the
    rule computed entry by entry in Python."""
    kv, prompt, table, W, p = batch
    want = _rule_by_loops(kv, prompt, table, W, p["page_size"], p["page_index_divisor"], p["num_pages"],
                          p["max_seq_len"])
    twin = fresh_write_page_bad_torch(kv, prompt, table, W, p["page_size"], p["page_index_divisor"], p["num_pages"],
                                      p["max_seq_len"])
    assert torch.equal(twin, want)
    for r in range(kv.numel() // W):
        rows = slice(r * W, r * W + W)
        flags = new_error_flags(DEVICE)
        audit_fresh_write_pages(kv[rows].to(DEVICE), prompt[rows].to(DEVICE), table[rows].to(DEVICE), W, flags, **p)
        assert int(flags.item()) == (BIT if want[rows].any() else 0), r


def test_audit_judges_nothing_on_a_valid_batch_at_any_step():
    """A valid table over a whole page of steps (every token of the write page, the page's first included) and an
    empty batch: the flag stays 0."""
    W, pg = 3, 4
    g = torch.Generator().manual_seed(3)
    R, prompt_len, cols = 2, 9, 8
    pages = (torch.randperm(R * W * cols, generator=g) + 1).view(R, W, cols)
    pages[:, :, :prompt_len // pg] = pages[:, :1, :prompt_len // pg]
    table = pages.view(R * W, cols).int().to(DEVICE)
    prompt = torch.full((R * W,), prompt_len, dtype=torch.int32, device=DEVICE)
    for kv_len in range(prompt_len + 1, prompt_len + 2 * pg + 1):
        flags = new_error_flags(DEVICE)
        kv = torch.full((R * W,), kv_len, dtype=torch.int32, device=DEVICE)
        audit_fresh_write_pages(kv, prompt, table, W, flags, page_size=pg, num_pages=R * W * cols + 1,
                                max_seq_len=cols * pg)
        assert int(flags.item()) == 0, kv_len
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    flags = new_error_flags(DEVICE)
    audit_fresh_write_pages(empty, empty, table[:0], W, flags, page_size=pg, num_pages=1, max_seq_len=cols * pg)
    assert int(flags.item()) == 0


def _good_args():
    kv = torch.full((6,), 9, dtype=torch.int32, device=DEVICE)
    return dict(kv_lens=kv, prompt_lens=kv - 4, beam_page_table=torch.ones(6, 4, dtype=torch.int32, device=DEVICE),
                beam_width=3, error_flags=new_error_flags(DEVICE), page_size=4, num_pages=8, max_seq_len=16)


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
], ids=["dtype", "table_dims", "table_rows", "partial_request", "beam_width", "prompt_rows", "stride", "page_size",
        "max_seq_len", "divisor", "no_flag", "flag_shape"])
def test_audit_refuses_bad_arguments_by_name(change, match):
    args = _good_args()
    args.update(change)
    flags = args["error_flags"]
    with pytest.raises(KernelInputError, match=match):
        audit_fresh_write_pages(**args)
    if isinstance(flags, torch.Tensor) and flags.numel() == 1:
        assert int(flags.item()) == 0  # refused before any launch
