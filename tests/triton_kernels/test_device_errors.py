"""The device error flags' rules of :mod:`triton_kernels.device_errors`, through small test kernels.

The kernels and their torch twins must report one bad value the same way, so each rule is written twice
(:func:`kv_len_bad` and :func:`beam_agreement_bits` run only inside a kernel, their ``_torch`` twins on
tensors): here the two are compared over the cases each rule separates (for ``kv_len``: negative, the padding
rows' one-token prompt, inside the prompt, the cache's end; for the beams' agreement with beam 0: lengths,
a shared write page, and the slots that are not judged).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from triton_kernels import device_errors
from triton_kernels.device_errors import (
    beam_agreement_bad_torch,
    beam_agreement_bits,
    held_write_page_bad_torch,
    held_write_page_bits,
    kv_len_bad,
    kv_len_bad_torch,
    plan_agreement_bad_torch,
    plan_agreement_bits,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: conftest set TRITON_INTERPRET=1)


@triton.jit
def _kv_len_bad_kernel(cur_ptr, prompt_ptr, out_ptr, n, max_seq_len, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    cur = tl.load(cur_ptr + offs, mask=mask, other=0)
    prompt = tl.load(prompt_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, kv_len_bad(cur, prompt, max_seq_len).to(tl.int8), mask=mask)


def test_kv_len_rule_is_the_same_in_the_kernels_and_their_torch_twins():
    max_seq_len = 9
    cur, prompt = torch.meshgrid(torch.arange(-2, 12, dtype=torch.int32), torch.arange(0, 11, dtype=torch.int32),
                                 indexing="ij")
    cur, prompt = cur.flatten().contiguous(), prompt.flatten().contiguous()
    out = torch.full(cur.shape, -1, dtype=torch.int8, device=DEVICE)
    _kv_len_bad_kernel[(1,)](cur.to(DEVICE), prompt.to(DEVICE), out, cur.numel(), max_seq_len,
                             BLOCK=triton.next_power_of_2(cur.numel()))
    from_kernel = out.cpu().bool()
    assert (out.cpu() >= 0).all()  # every element written
    assert torch.equal(from_kernel, kv_len_bad_torch(cur, prompt, max_seq_len))
    # The cases the rule separates, as documented: a padding row (one token, one-token prompt) is not bad, a
    # real row whose position is inside its prompt is, and so are negative positions and the cache's end.
    want = {(0, 1): False, (0, 2): True, (2, 3): True, (3, 3): False, (-1, 0): True, (8, 2): False, (9, 2): True}
    for (c, p), bad in want.items():
        i = int(((cur == c) & (prompt == p)).nonzero()[0])
        assert bool(from_kernel[i]) is bad, (c, p)


@triton.jit
def _beam_agreement_kernel(kv_lens_ptr, prompt_lens_ptr, table_ptr, out_ptr, beam_width, stride_table_row, page_size,
                           page_index_divisor, num_pages, max_seq_len, BLOCK_W: tl.constexpr):
    # One program a request, one lane a beam, as the cascade kernel's tiles call it.
    req = tl.program_id(0)
    slot = tl.arange(0, BLOCK_W)
    ok = slot < beam_width
    row64 = req.to(tl.int64) * beam_width + slot
    prompt_len = tl.load(prompt_lens_ptr + row64, mask=ok, other=0)
    bits = beam_agreement_bits(kv_lens_ptr, table_ptr, row64, ok, req.to(tl.int64) * beam_width, prompt_len,
                               stride_table_row, 1, page_size, page_index_divisor, num_pages, max_seq_len)
    tl.store(out_ptr + row64, bits, mask=ok)


def _beam_agreement_case(seed: int):
    """Requests of 4 beams (page 4, 6 columns, divisor 2) whose rows are valid, then broken one way
    each: ``(kv_lens, prompt_lens, table, want)``, ``want`` the bits each row must get."""
    W, pg, cols, div = 4, 4, 6, 2
    g = torch.Generator().manual_seed(seed)
    cases = ["valid", "len_differs", "shares_prompt_last_page", "shares_generated_page", "shared_entry_outside_pool",
             "padding", "inside_prompt", "differs_and_shares", "warmup_request", "write_entry_missing"]
    R = len(cases)
    num_pages = R * W * cols
    prompt = torch.randint(1, 10, (R,), generator=g).repeat_interleave(W)
    kv = prompt + 1 + torch.randint(0, 8, (R,), generator=g).repeat_interleave(W)
    # Every entry a page of its own (only the cases below share one), in an encoding of divisor 2.
    pages = torch.randperm(num_pages, generator=g).view(R * W, cols)
    table = pages * div + torch.randint(0, div, pages.shape, generator=g)
    col = (kv - 1) // pg
    want = torch.zeros(R * W, dtype=torch.int32)
    for r, case in enumerate(cases):
        b = 1 + int(torch.randint(0, W - 1, (1,), generator=g))  # the broken beam
        i = r * W + b
        if case == "len_differs":
            kv[i] += 1
            want[i] = device_errors.BEAM_KV_LEN.value
        elif case == "shares_prompt_last_page":
            prompt[r * W:r * W + W] = 6  # a partly filled last page at column 1; the write at 7, a token later
            kv[r * W:r * W + W] = 8
            e = int(table[r * W, 1])
            table[i, 1] = e // div * div + (e + 1) % div  # the same page, its entry in the divisor's other code
            want[i] = device_errors.SHARED_WRITE_PAGE.value
        elif case == "shares_generated_page":
            table[i, col[i]] = table[r * W, col[i]]
            want[i] = device_errors.SHARED_WRITE_PAGE.value
        elif case == "shared_entry_outside_pool":  # (WRITE_PAGE's, not this rule's)
            table[i, col[i]] = table[r * W, col[i]] = num_pages * div
        elif case == "padding":  # TensorRT-LLM's padding rows: kv_len 1, a one-token prompt, one page for all
            kv[r * W:r * W + W], prompt[r * W:r * W + W] = 1, 1
            table[r * W:r * W + W, 0] = table[r * W, 0]
        elif case == "inside_prompt":  # (KV_LEN's: never written)
            kv[r * W:r * W + W] = prompt[r * W]
            table[r * W:r * W + W, (prompt[r * W] - 1) // pg] = table[r * W, (prompt[r * W] - 1) // pg]
        elif case == "differs_and_shares":  # a longer beam on beam 0's page: its slot is not beam 0's, no share
            kv[i] += 1
            table[i, (kv[i] - 1) // pg] = table[r * W, (kv[i] - 1) // pg]
            want[i] = device_errors.BEAM_KV_LEN.value
        elif case == "warmup_request":  # TensorRT-LLM's: 8 tokens of context, all pages shared, kv_len = prompt + 1
            prompt[r * W:r * W + W], kv[r * W:r * W + W] = 7, 8
            table[r * W:r * W + W] = table[r * W]
        elif case == "write_entry_missing":  # every beam's write entry -1: WRITE_PAGE's (-1 // 2 must not be page 0)
            table[r * W:r * W + W, col[r * W]] = -1
    return kv.int(), prompt.int(), table.int(), want, {"W": W, "pg": pg, "cols": cols, "num_pages": num_pages, "div": div}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_agreement_rule_is_the_same_in_the_kernels_and_their_torch_twins(seed):
    kv, prompt, table, want, p = _beam_agreement_case(seed)
    max_seq_len = p["cols"] * p["pg"]
    out = torch.full(kv.shape, -1, dtype=torch.int32, device=DEVICE)
    _beam_agreement_kernel[(kv.numel() // p["W"],)](kv.to(DEVICE), prompt.to(DEVICE), table.to(DEVICE), out, p["W"],
                                                    table.stride(0), p["pg"], p["div"], p["num_pages"], max_seq_len,
                                                    BLOCK_W=triton.next_power_of_2(p["W"]))
    from_kernel = out.cpu()
    assert (from_kernel >= 0).all()  # every element written
    assert torch.equal(from_kernel, want), (from_kernel, want)
    differs, shares = beam_agreement_bad_torch(kv, prompt, table, p["W"], p["pg"], p["div"], p["num_pages"], max_seq_len)
    twin = differs.int() * device_errors.BEAM_KV_LEN.value | shares.int() * device_errors.SHARED_WRITE_PAGE.value
    assert torch.equal(twin.int(), want)


@triton.jit
def _held_write_page_kernel(kv_lens_ptr, prompt_lens_ptr, table_ptr, out_ptr, beam_width, stride_table_row, page_size,
                            page_index_divisor, num_pages, max_seq_len):
    # One program a request, as the tail kernels judge it (beam 0's program; the others judge nothing).
    req = tl.program_id(0)
    first_row64 = req.to(tl.int64) * beam_width
    for beam in range(beam_width):
        held = held_write_page_bits(kv_lens_ptr, table_ptr, first_row64, beam == 0, beam_width,
                                    tl.load(prompt_lens_ptr + first_row64), stride_table_row, 1, page_size,
                                    page_index_divisor, num_pages, max_seq_len)
        tl.atomic_or(out_ptr + req, held)


_HELD_CASES = ["valid", "on_beam0_same_column", "valid_later", "two_beams_share", "on_full_prompt_page",
               "beam0_on_its_prompt", "warmup_request", "first_generated_token", "padding", "pair_entry_missing",
               "longer_beam_on_other_page", "negative_prompt"]


def _held_write_page_case(seed: int, W: int):
    """Requests of ``W`` beams (page 4, prompts of 9-141 tokens, divisor 2) whose tables are valid, then broken
    one way each (:data:`_HELD_CASES`): ``(kv_lens, prompt_lens, table, want)``, ``want`` per request."""
    pg, div = 4, 2
    g = torch.Generator().manual_seed(seed)
    R = len(_HELD_CASES)
    # Prompts one token into their last page; the first two cases write into that page (the column beam 0's
    # prompt and its write share), the third into a generated page, the others 2-9 tokens on.
    prompt = 4 * torch.randint(2, 36, (R,), generator=g) + 1
    kv = prompt + 2 + torch.randint(0, 8, (R,), generator=g)
    kv[:2] = prompt[:2] + 2 + torch.randint(0, 2, (2,), generator=g)
    kv[2] = prompt[2] + 7  # "valid_later": a generated page of each beam's own
    edge = seed % 2 == 1  # the pair in the first and last beam blocks, the prompt page in the second column block
    if edge:
        prompt[4] = 4 * 35 + 1
        kv[4] = prompt[4] + 2
    cols = int((kv.max() + pg - 1) // pg)
    num_pages = R * W * cols
    pages = torch.randperm(num_pages, generator=g).view(R, W, cols)
    # Full prompt pages are beam 0's for every beam (the partly filled last one each beam's own).
    full = prompt // pg
    for r in range(R):
        pages[r, :, :full[r]] = pages[r, 0, :full[r]]
    table = pages * div + torch.randint(0, div, pages.shape, generator=g)
    kv, prompt = kv.repeat_interleave(W), prompt.repeat_interleave(W)
    want = torch.zeros(R, dtype=torch.bool)
    for r, case in enumerate(_HELD_CASES):
        i, j = (int(v) for v in 1 + torch.randperm(W - 1, generator=g)[:2])  # two beams other than beam 0
        if edge:
            i, j = 1, W - 1
        col = int(kv[r * W] - 1) // pg
        t = table[r]  # (a view)
        if case == "two_beams_share":
            t[j, col] = t[i, col] // div * div + (t[i, col] + 1) % div  # the same page in the divisor's other code
            want[r] = True
        elif case == "on_full_prompt_page":
            t[i, col] = t[0, int(full[r]) - 1 if edge else int(torch.randint(0, int(full[r]), (1,), generator=g))]
            want[r] = True
        elif case == "beam0_on_its_prompt":
            t[0, col] = t[0, 0]
            want[r] = True
        elif case == "on_beam0_same_column":  # SHARED_WRITE_PAGE's, not this rule's
            t[i, col] = t[0, col]
        elif case == "warmup_request":  # all context, every page shared, kv_len = prompt + 1
            kv[r * W:r * W + W] = prompt[r * W] + 1
            t[:] = t[0]
        elif case == "first_generated_token":  # not judged at kv_len = prompt + 1 (the warm-up's look)
            kv[r * W:r * W + W] = prompt[r * W] + 1
            c = int(prompt[r * W]) // pg
            t[j, c] = t[i, c]
        elif case == "padding":  # TensorRT-LLM's padding rows: kv_len 1, a one-token prompt, one page for all
            kv[r * W:r * W + W], prompt[r * W:r * W + W] = 1, 1
            t[:, 0] = t[0, 0]
        elif case == "pair_entry_missing":  # both entries -1 (WRITE_PAGE's): -1 // 2 must not make a shared page
            t[i, col] = t[j, col] = -1
        elif case == "longer_beam_on_other_page":  # beam i a token ahead (BEAM_KV_LEN's) on a page of its own
            kv[r * W + i] += 1
        elif case == "negative_prompt":  # (PROMPT_LEN's and KV_LEN's): no column judged, none read below 0
            kv[r * W:r * W + W], prompt[r * W:r * W + W] = 0, -3
            t[:] = t[0]
        elif case == "valid_later":
            assert col > int(prompt[r * W]) // pg
    return kv.int(), prompt.int(), table.view(R * W, cols).int(), want, {"pg": pg, "div": div, "cols": cols,
                                                                          "num_pages": num_pages}


@pytest.mark.parametrize("W", [4, 45], ids=["4_beams", "45_beams_two_blocks"])
@pytest.mark.parametrize("seed", [0, 1])
def test_held_write_page_rule_is_the_same_in_the_kernels_and_their_torch_twins(seed, W):
    """Two beams other than beam 0 on one write page, a write page that is one of beam 0's full prompt pages, beam
    0 writing onto its own prompt: reported; beam 0's partly filled page at the same column (another rule's), the
    warm-up's shared blocks, the first generated token, padding rows and missing entries: not. At 45 beams the
    beams and the prompts of up to 35 pages span two blocks of the comparison; the odd seed puts the pair in both
    blocks and the prompt page in the second."""
    kv, prompt, table, want, p = _held_write_page_case(seed, W)
    max_seq_len = p["cols"] * p["pg"]
    R = want.numel()
    out = torch.full((R,), 0, dtype=torch.int32, device=DEVICE)
    _held_write_page_kernel[(R,)](kv.to(DEVICE), prompt.to(DEVICE), table.to(DEVICE), out, W, table.stride(0), p["pg"],
                                  p["div"], p["num_pages"], max_seq_len)
    bit = device_errors.HELD_WRITE_PAGE.value
    assert torch.equal(out.cpu(), want.int() * bit), {c: int(v) for c, v in zip(_HELD_CASES, out.cpu())}
    twin = held_write_page_bad_torch(kv, prompt, table, W, p["pg"], p["div"], p["num_pages"], max_seq_len)
    assert torch.equal(twin.cpu(), want), dict(zip(_HELD_CASES, twin.tolist()))


@triton.jit
def _plan_agreement_kernel(table_ptr, prompt_lens_ptr, plan_pages_ptr, out_ptr, beam_width, stride_table_row,
                           page_size, page_index_divisor, table_tokens, BLOCK_W: tl.constexpr):
    req = tl.program_id(0)
    slot = tl.arange(0, BLOCK_W)
    ok = slot < beam_width
    row64 = req.to(tl.int64) * beam_width + slot
    prompt_len = tl.load(prompt_lens_ptr + row64, mask=ok, other=0)
    bits = plan_agreement_bits(table_ptr, row64, ok & (slot == 0), prompt_len, tl.load(plan_pages_ptr + req),
                               stride_table_row, 1, page_size, page_index_divisor, table_tokens)
    tl.store(out_ptr + row64, bits, mask=ok)


def test_plan_agreement_rule_is_the_same_in_the_kernels_and_their_torch_twins():
    """Beam 0's entry at the prompt's last token against the plan's page there (divisor 2): equal in either
    encoding passes; another page, a negative entry (-1 // 2 must not pass as page 0), fails; an empty prompt,
    a prompt past the table and the other beams are not judged."""
    W, pg, cols, div = 2, 4, 3, 2
    prompt = torch.tensor([5, 5, 5, 5, 5, 5, 0, 0, 13, 13, 4, 4], dtype=torch.int32)
    R = prompt.numel() // W
    table = (torch.arange(R * W * cols, dtype=torch.int32).view(R * W, cols) + 100) * div
    plan = (table[::W, 1] // div).clone()  # the page of token 4 (column 1) for prompts of 5
    table[2, 1] += 1  # request 1: the same page in the divisor's other code
    table[4, 1] = (plan[2] + 7) * div  # request 2: another page
    table[10, 0] = -1  # request 5 (prompt 4: column 0): no page
    plan[5] = 0
    want = torch.zeros(R * W, dtype=torch.int32)
    want[4] = want[10] = device_errors.PLAN_PAGE.value  # (request 3: empty prompt; request 4: past the table)
    out = torch.full((R * W,), -1, dtype=torch.int32, device=DEVICE)
    _plan_agreement_kernel[(R,)](table.to(DEVICE), prompt.to(DEVICE), plan.to(DEVICE), out, W, table.stride(0), pg,
                                 div, cols * pg, BLOCK_W=W)
    assert torch.equal(out.cpu(), want), (out, want)
    twin = plan_agreement_bad_torch(table, prompt, plan, W, pg, div, cols * pg)
    assert torch.equal(twin.int() * device_errors.PLAN_PAGE.value, want)


def test_error_bits_name_every_bit_once():
    bits = [device_errors.PROMPT_PAGE, device_errors.PROMPT_LEN, device_errors.KV_LEN, device_errors.SOURCE_BEAM,
            device_errors.TAIL_PAGE, device_errors.WRITE_PAGE, device_errors.BEAM_KV_LEN,
            device_errors.SHARED_WRITE_PAGE, device_errors.PLAN_PAGE, device_errors.HELD_WRITE_PAGE,
            device_errors.OTHER_REQUEST_PAGE]
    values = [b.value for b in bits]
    assert sorted(device_errors.ERROR_BITS) == sorted(values) == [1 << i for i in range(len(bits))]
    messages = device_errors.decode_error_flags(sum(values))
    assert len(messages) == len(bits)
