"""The device error flags' rules of :mod:`triton_kernels.device_errors`, through small test kernels.

The kernels and their torch twins must report one bad value the same way, so each rule is written twice
(:func:`kv_len_bad` and :func:`beam_agreement_bits` run only inside a kernel, their ``_torch`` twins on
tensors): here the two are compared over the cases each rule separates (for ``kv_len``: negative, the padding
rows' one-token prompt, inside the prompt, the cache's end; for the beams' agreement with beam 0: lengths,
a shared write page, and the slots that are not judged). The rules that judge a whole table (held pages, the
plan's digest) are the page-table audit's, tested with it (``test_page_table_audit.py``).
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
    kv_len_bad,
    kv_len_bad_torch,
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


def test_error_bits_name_every_bit_once():
    bits = [device_errors.PROMPT_PAGE, device_errors.PROMPT_LEN, device_errors.KV_LEN, device_errors.SOURCE_BEAM,
            device_errors.TAIL_PAGE, device_errors.WRITE_PAGE, device_errors.BEAM_KV_LEN,
            device_errors.SHARED_WRITE_PAGE, device_errors.PLAN_PAGE, device_errors.HELD_WRITE_PAGE,
            device_errors.OTHER_REQUEST_PAGE]
    values = [b.value for b in bits]
    assert sorted(device_errors.ERROR_BITS) == sorted(values) == [1 << i for i in range(len(bits))]
    messages = device_errors.decode_error_flags(sum(values))
    assert len(messages) == len(bits)
