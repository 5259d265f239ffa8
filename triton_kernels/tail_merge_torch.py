"""Unfused torch path of the tail merge: the readable reference of the fused kernel's contract.

Same arguments, same result and same side effect (the KV write) as
:func:`triton_kernels.beam_tail_attention_merge`, written as plain tensor ops: gather the earlier
generated K/V through ``cache_indirection``, append the current token's K/V from ``new_k``/``new_v``,
attend in float32 with base-2 softmax, merge with the prefix state by LSE and write ``out``.

It runs on CPU and GPU, but it reads the longest tail back to the host (one sync), so it cannot be
captured in a CUDA graph; use it for debugging and as a fallback, not on the hot path.
"""

from __future__ import annotations

import torch

from . import device_errors
from .device_errors import check_error_flags
from .step_args import LOG2E, check_tail_index_values, need_flag
from .tail_merge_args import check_tail_merge_args

__all__ = ["beam_tail_attention_merge_torch"]


def _pool_kv(kv_cache: torch.Tensor, kv_layout: str, which: int) -> torch.Tensor:
    """The K (``which=0``) or V pool as a ``[pages, Pg, Hkv, D]`` view (HND is permuted, not copied)."""
    pool = kv_cache.select(1, which)
    return pool.permute(0, 2, 1, 3) if kv_layout == "HND" else pool


# An inference step: the pool and out are written in place, which autograd refuses on tensors that need grad (a K/V
# projection run outside no_grad gives new_k/new_v that do, and the step would fail between its K and V writes).
# The kernel writes through pointers and ignores autograd; so does this twin.
@torch.no_grad()
def beam_tail_attention_merge_torch(
    q,
    new_k,
    new_v,
    kv_cache,
    beam_page_table,
    kv_lens,
    prompt_lens,
    cache_indirection,
    beam_width,
    prefix_out,
    prefix_lse,
    out,
    *,
    sm_scale=None,
    kv_layout="HND",
    page_index_divisor=1,
    prefix_lse_layout="NH",
    prefix_lse_base="log2",
    write_kv=True,
    validate_indices=False,
    error_flags=None,
):
    """Tail attention + KV write + LSE merge with the prefix, in unfused torch ops.

    Arguments, shapes and result are those of :func:`triton_kernels.beam_tail_attention_merge`:
    ``out[i, h] = merge(prefix state, attention of q[i, h] over beam row i's generated positions
    [prompt_len, kv_len))``, where position ``kv_len - 1`` is ``new_k``/``new_v`` and earlier ones
    come from the pages of beam ``cache_indirection[r, b, t]``; ``error_flags`` gets the kernel's
    bits for the same invalid values (:mod:`triton_kernels.device_errors`). Returns ``out``.
    """
    write_kv = need_flag("write_kv", write_kv)
    validate_indices = need_flag("validate_indices", validate_indices)
    geom = check_tail_merge_args(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
        prefix_out, prefix_lse, out, sm_scale=sm_scale, kv_layout=kv_layout,
        page_index_divisor=page_index_divisor, prefix_lse_layout=prefix_lse_layout,
        prefix_lse_base=prefix_lse_base, write_kv=write_kv, error_flags=error_flags,
    )
    check_error_flags(error_flags, q.device)
    if validate_indices:
        check_tail_index_values(geom, beam_page_table, kv_lens, prompt_lens, cache_indirection, page_index_divisor)
    rows, W, pg = geom.num_rows, geom.beam_width, geom.page_size
    hkv, g, d = geom.num_kv_heads, geom.group_size, geom.head_dim
    if rows == 0:
        return out
    dev = q.device
    k_pool = _pool_kv(kv_cache, kv_layout, 0)
    v_pool = _pool_kv(kv_cache, kv_layout, 1)
    row = torch.arange(rows, device=dev)
    req, beam = row // W, row % W
    plen = prompt_lens.long()
    klen = kv_lens.long()
    start = plen.clamp(min=0)  # as in the kernels: a negative prompt length never indexes before position 0

    # Earlier generated positions [P, L-1), each from the pages of its source beam.
    # Positions at or past max_seq_len are masked below, so a bad kv_len (up to INT32_MAX) must not
    # size the gather: it would allocate rows x kv_len entries.
    num_earlier = (klen.clamp(max=geom.max_seq_len) - 1 - start).clamp(min=0)
    max_earlier = int(num_earlier.max())  # host sync: the reason this path is not graph-capturable
    # Every index is masked where the kernel masks it (a position past the indirection or the page
    # table, a source beam outside [0, W), a page outside the pool): invalid input reads nothing
    # out of bounds here either (check mode reports it).
    cols, num_pages = beam_page_table.shape[1], geom.num_pages
    t = start[:, None] + torch.arange(max_earlier, device=dev)[None, :]
    t_ok = (t < (klen - 1)[:, None]) & (t < geom.max_seq_len) & (t // pg < cols)
    t_safe = torch.where(t_ok, t, torch.zeros_like(t))
    src_beam = cache_indirection[req[:, None], beam[:, None], t_safe].long()
    src_ok = t_ok & (src_beam >= 0) & (src_beam < W)
    src_row = req[:, None] * W + torch.where(src_ok, src_beam, beam[:, None].expand_as(src_beam))
    entry = beam_page_table[src_row, t_safe // pg].long()
    page = entry // page_index_divisor
    earlier_valid = src_ok & (entry >= 0) & (page < num_pages)
    page = torch.where(earlier_valid, page, torch.zeros_like(page))
    wpos = klen - 1
    w_ok = (wpos >= plen) & (wpos >= 0) & (wpos < geom.max_seq_len) & (wpos // pg < cols)
    w_entry = beam_page_table[row, torch.where(w_ok, wpos // pg, torch.zeros_like(wpos))].long()
    entry_ok = (w_entry >= 0) & (w_entry // page_index_divisor < num_pages)
    if error_flags is not None:
        # The kernels' bits, as device tensors (no sync): a masked link of a valid position.
        # (The kernels report a source beam only at positions inside the table and the cache.)
        len_bad = device_errors.kv_len_bad_torch(wpos, plen, geom.max_seq_len)
        for bad, bit in ((len_bad, device_errors.KV_LEN), (plen < 0, device_errors.PROMPT_LEN),
                         (t_ok & ~src_ok, device_errors.SOURCE_BEAM),
                         (src_ok & ~earlier_valid, device_errors.TAIL_PAGE),
                         (w_ok & ~entry_ok if write_kv else None, device_errors.WRITE_PAGE)):
            if bad is not None:
                device_errors.flag_where(error_flags, bad, bit)
    slot = t_safe % pg
    # Masked positions read some slot of page 0; zero them, as the kernel's masked loads do: a weight
    # of 0 times an unwritten slot's NaN would still be NaN.
    keep = earlier_valid[:, :, None, None]
    k_earlier = torch.where(keep, k_pool[page, slot].float(), 0.0)
    v_earlier = torch.where(keep, v_pool[page, slot].float(), 0.0)
    k = torch.cat([k_earlier, new_k.float()[:, None]], dim=1)  # [rows, T+1, Hkv, D]
    v = torch.cat([v_earlier, new_v.float()[:, None]], dim=1)
    valid = torch.cat([earlier_valid, torch.ones(rows, 1, dtype=torch.bool, device=dev)], dim=1)

    # Base-2 online-softmax equivalent: scores already scaled by sm_scale * log2(e).
    qf = q.float().view(rows, hkv, g, d) * (geom.sm_scale * LOG2E)
    scores = torch.einsum("nhgd,nthd->nhgt", qf, k)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1)  # finite: the current token is always valid
    p = torch.exp2(scores - m[..., None])
    denom = p.sum(dim=-1)
    tail_out = torch.einsum("nhgt,nthd->nhgd", p, v) / denom[..., None]
    tail_lse = m + torch.log2(denom)

    lse_p = prefix_lse if prefix_lse_layout == "NH" else prefix_lse.t()
    lse_p = (lse_p.float() * geom.lse_scale).view(rows, hkv, g)
    m2 = torch.maximum(lse_p, tail_lse)
    w_prefix = torch.exp2(lse_p - m2)
    w_tail = torch.exp2(tail_lse - m2)
    o_p = prefix_out.float().view(rows, hkv, g, d)
    # An empty prefix (lse = -inf) has weight 0; its o may be anything, even NaN.
    o_p_weighted = torch.where(w_prefix[..., None] > 0, o_p * w_prefix[..., None], torch.zeros_like(o_p))
    merged = (o_p_weighted + tail_out * w_tail[..., None]) / (w_prefix + w_tail)[..., None]

    if write_kv:
        # Like the kernel, never write inside the prompt (kv_len <= prompt_len is invalid input):
        # prompt pages are shared by all beams of the request.
        w_rows = row[w_ok & entry_ok]
        wpos = wpos[w_rows]
        wpage = w_entry[w_rows] // page_index_divisor
        wslot = wpos % pg
        k_pool[wpage, wslot] = new_k[w_rows]
        v_pool[wpage, wslot] = new_v[w_rows]
    out.copy_(merged.view(rows, hkv * g, d))
    return out
