"""The device error flags' rules of :mod:`triton_kernels.device_errors`, through a one-program test kernel.

The kernels and their torch twins must report one bad ``kv_len`` the same way, so the rule is written twice
(:func:`kv_len_bad` runs only inside a kernel, :func:`kv_len_bad_torch` on tensors): here the two are compared
over every position of a window around the cases the rule separates (negative, the padding rows' one-token
prompt, inside the prompt, the cache's end).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels import device_errors
from triton_kernels.device_errors import kv_len_bad, kv_len_bad_torch

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


def test_error_bits_name_every_bit_once():
    bits = [device_errors.PROMPT_PAGE, device_errors.PROMPT_LEN, device_errors.KV_LEN, device_errors.SOURCE_BEAM,
            device_errors.TAIL_PAGE, device_errors.WRITE_PAGE]
    values = [b.value for b in bits]
    assert sorted(device_errors.ERROR_BITS) == sorted(values) == [1 << i for i in range(len(bits))]
    messages = device_errors.decode_error_flags(sum(values))
    assert len(messages) == len(bits)
