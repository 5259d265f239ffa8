"""Float32 oracle: dense attention of every beam row over its own gathered history.

This is the ground truth every kernel and backend is tested against. It shares no code with the
planner or the kernels: positions are mapped to pages straight from the per-beam page table and
``cache_indirection``, exactly as the engine defines them.

For beam row ``i = r * W + b`` with prompt length ``P`` and KV length ``L`` (after this step's
token is written):

- prompt positions ``t < P`` come from beam 0's pages (row ``r * W``);
- generated positions ``P <= t < L - 1`` come from the pages of beam ``cache_indirection[r, b, t]``;
- the current position ``L - 1`` comes from ``new_k``/``new_v`` when given (the layer input),
  otherwise from the row's own page.

LSE convention: base 2, ``lse = log2(sum_j exp(s_j * sm_scale))``, ``[rows, heads]``, float32.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = [
    "LOG2E",
    "beam_kv_positions",
    "gather_beam_kv",
    "dense_attention",
    "reference_beam_attention",
    "reference_prefix_attention",
    "reference_tail_attention",
    "merge_states_base2",
]

LOG2E = 1.4426950408889634


def _check_layout(kv_layout: str) -> None:
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout={kv_layout!r} is not supported; use 'HND' or 'NHD'.")


def pool_geometry(kv_cache: torch.Tensor, kv_layout: str) -> Tuple[int, int, int, int]:
    """``(num_pages, num_kv_heads, page_size, head_dim)`` of a ``[pages, 2, ...]`` pool."""
    _check_layout(kv_layout)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [pages, 2, Hkv, Pg, D] (HND) or [pages, 2, Pg, Hkv, D] (NHD), got "
            f"{tuple(kv_cache.shape)}."
        )
    if kv_layout == "HND":
        n, _, h, p, d = kv_cache.shape
    else:
        n, _, p, h, d = kv_cache.shape
    return n, h, p, d


def beam_kv_positions(
    beam_page_table: torch.Tensor,
    cache_indirection: torch.Tensor,
    prompt_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    beam_width: int,
    page_size: int,
    rows: torch.Tensor,
    max_len: int,
    page_index_divisor: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page and slot of every history position of the given beam rows.

    Args:
        beam_page_table: ``[>= R*W, max_pages]`` int, page entries of each beam row.
        cache_indirection: ``[>= R, W_max, max_seq_len]`` int, the source beam of each position.
        prompt_lens, kv_lens: int, indexed per beam row (``[>= max(rows) + 1]``): ``P`` and ``L``.
        beam_width: ``W``; row ``i`` is beam ``i % W`` of request ``i // W``.
        page_size: tokens a page.
        rows: ``[n]`` int, the beam rows to map.
        max_len: positions per row to map (``>= max L`` of the rows).
        page_index_divisor: what an entry is divided by to give a page number.

    Returns ``(page [n, max_len], slot [n, max_len], valid [n, max_len])`` (int64, int64, bool) for
    ``n = len(rows)``; positions ``>= kv_lens[row]`` are invalid and point at page 0. Raises ``ValueError`` where
    a valid position's source beam is outside ``[0, W)``.
    """
    dev = beam_page_table.device
    rows = rows.to(dev).long()
    t = torch.arange(max_len, device=dev)[None, :]
    plen = prompt_lens.to(dev).long()[rows][:, None]
    klen = kv_lens.to(dev).long()[rows][:, None]
    req = rows // beam_width
    beam = rows % beam_width
    t_clamped = t.clamp(max=cache_indirection.shape[2] - 1).expand(rows.shape[0], -1)
    ind = cache_indirection[req[:, None], beam[:, None], t_clamped].long()
    src = torch.where(t < plen, torch.zeros_like(ind), ind)
    src = torch.where(t == klen - 1, beam[:, None].expand_as(src), src)
    valid = t < klen
    src = torch.where(valid, src, torch.zeros_like(src))
    bad_src = valid & ((src < 0) | (src >= beam_width))
    if bool(bad_src.any()):
        n, pos = (int(v) for v in bad_src.nonzero()[0])
        raise ValueError(f"row {int(rows[n])} reads position {pos} through source beam {int(src[n, pos])}, outside "
                         f"[0, beam_width={beam_width}); cache_indirection names a beam of the row's own request.")
    src_row = req[:, None] * beam_width + src
    col = torch.where(valid, t // page_size, torch.zeros_like(t))
    page = beam_page_table[src_row, col].long() // page_index_divisor
    page = torch.where(valid, page, torch.zeros_like(page))
    slot = t.expand_as(page) % page_size
    return page, slot, valid


def gather_beam_kv(
    kv_cache: torch.Tensor,
    kv_layout: str,
    page: torch.Tensor,
    slot: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``(page, slot)`` (int64 ``[n, T]`` each, pages inside the pool) as float32 ``[n, T, Hkv, D]``
    each, from a ``[pages, 2, ...]`` pool in ``kv_layout``."""
    _check_layout(kv_layout)
    if kv_layout == "HND":
        k = kv_cache[page, 0, :, slot, :]
        v = kv_cache[page, 1, :, slot, :]
    else:
        k = kv_cache[page, 0, slot, :, :]
        v = kv_cache[page, 1, slot, :, :]
    return k.float(), v.float()


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, sm_scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked dense attention in float32.

    Args:
        q: ``[n, Hq, D]``; k, v: ``[n, T, Hkv, D]``; valid: ``[n, T]`` bool; ``Hq % Hkv == 0``.

    Returns:
        ``(out [n, Hq, D], lse_base2 [n, Hq])``; a row with no valid position gives ``out = 0``
        and ``lse = -inf``.
    """
    n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qf = q.float().view(n, hkv, g, d)
    # Invalid positions may hold anything (unwritten memory): zero them, since 0 x NaN is NaN.
    k = torch.where(valid[:, :, None, None], k.float(), 0.0)
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)
    s = torch.einsum("nhgd,nthd->nhgt", qf, k) * sm_scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse_nat = torch.logsumexp(s, dim=-1)  # [n, hkv, g]
    p = torch.exp(s - torch.where(torch.isfinite(lse_nat), lse_nat, torch.zeros_like(lse_nat))[..., None])
    p = torch.where(valid[:, None, None, :], p, torch.zeros_like(p))
    out = torch.einsum("nhgt,nthd->nhgd", p, v)
    return out.reshape(n, hq, d), (lse_nat * LOG2E).reshape(n, hq)


def _to_long(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.long)
    return torch.tensor(np.array(x, dtype=np.int64), device=device)


def _default_scale(head_dim: int, sm_scale: Optional[float]) -> float:
    """``1/sqrt(D)`` for None, else ``sm_scale``, which must be a finite positive number (not a bool)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"sm_scale={sm_scale!r} must be a float (default 1/sqrt(D)).")
    if not math.isfinite(float(sm_scale)) or sm_scale <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite positive float (default 1/sqrt(D)).")
    return float(sm_scale)


def _need_int(name: str, value, least: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name}={value!r} must be an int >= {least}.")
    return int(value)


def _check_history_args(q, kv_cache, kv_layout, beam_page_table, cache_indirection, prompt_lens, kv_lens, beam_width,
                        page_index_divisor) -> None:
    """The oracle's own checks (it shares none with the library's): shapes that index each other, and lengths
    the tables hold. Raises ``ValueError`` naming the argument and the fix."""
    page_size = pool_geometry(kv_cache, kv_layout)[2]
    beam_width = _need_int("beam_width", beam_width, 1)
    _need_int("page_index_divisor", page_index_divisor, 1)
    if q.dim() != 3 or q.shape[0] % beam_width:
        raise ValueError(f"q must be [R*W, Hq, D] with rows a multiple of beam_width={beam_width}, got "
                         f"{tuple(q.shape)}.")
    rows = q.shape[0]
    for name, x in (("prompt_lens", prompt_lens), ("kv_lens", kv_lens)):
        if x.dim() != 1 or x.shape[0] != rows:
            raise ValueError(f"{name} must have one entry per beam row ([{rows}]), got {tuple(x.shape)}; the oracle "
                             f"takes per-row lengths (a per-request prompt_lens: prompt_lens.repeat_interleave(W)).")
    if beam_page_table.dim() != 2 or beam_page_table.shape[0] < rows:
        raise ValueError(f"beam_page_table must be [>= {rows}, max_pages], got {tuple(beam_page_table.shape)}.")
    if (cache_indirection.dim() != 3 or cache_indirection.shape[0] < rows // beam_width
            or cache_indirection.shape[1] < beam_width or cache_indirection.shape[2] < 1):
        raise ValueError(f"cache_indirection must be [>= R={rows // beam_width}, >= W={beam_width}, >= 1], got "
                         f"{tuple(cache_indirection.shape)}.")
    if rows:
        longest = int(kv_lens.max())
        if longest > beam_page_table.shape[1] * page_size:
            raise ValueError(f"a kv_len of {longest} is past the page table's {beam_page_table.shape[1]} columns of "
                             f"{page_size} tokens; pass the table that holds every row's history.")
        # (the kernels mask such a row; reading on with the last column's source beam would answer something else)
        if longest > cache_indirection.shape[2]:
            raise ValueError(f"a kv_len of {longest} is past cache_indirection's {cache_indirection.shape[2]} "
                             f"positions; pass the indirection that covers every row's history (max_seq_len >= "
                             f"{longest}).")


def _row_chunks(num_rows: int, max_len: int, hkv: int, d: int, budget_bytes: int = 1 << 28):
    per_row = max(1, max_len * hkv * d * 4 * 3)
    step = max(1, budget_bytes // per_row)
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def _attend_history(
    q, kv_cache, kv_layout, beam_page_table, cache_indirection, prompt_lens, kv_lens, beam_width,
    sm_scale, page_index_divisor, new_k, new_v, tail_only,
):
    """Attention of each row over positions ``[0, L)`` of its history, or ``[P, L)`` if ``tail_only``."""
    _check_history_args(q, kv_cache, kv_layout, beam_page_table, cache_indirection, prompt_lens, kv_lens, beam_width,
                        page_index_divisor)
    num_rows, hq, d = q.shape
    num_pages, hkv, page_size, head_dim = pool_geometry(kv_cache, kv_layout)
    sm_scale = _default_scale(head_dim, sm_scale)
    dev = q.device
    plen = prompt_lens.to(dev).long()
    klen = kv_lens.to(dev).long()
    out = torch.empty(num_rows, hq, d, dtype=torch.float32, device=dev)
    lse = torch.empty(num_rows, hq, dtype=torch.float32, device=dev)
    max_len = int(klen.max().item()) if num_rows else 0
    max_len = max(max_len, 1)
    for a, b in _row_chunks(num_rows, max_len, hkv, d):
        rows = torch.arange(a, b, device=dev)
        page, slot, valid = beam_kv_positions(
            beam_page_table, cache_indirection, plen, klen, beam_width, page_size, rows, max_len,
            page_index_divisor,
        )
        bad = valid & ((page < 0) | (page >= num_pages))
        if bool(bad.any()):
            row, pos = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"row {a + row} reads position {pos} from page {int(page[row, pos])}, outside the pool's "
                             f"[0, {num_pages}); fix the page table (or page_index_divisor={page_index_divisor}).")
        k, v = gather_beam_kv(kv_cache, kv_layout, page, slot)
        # Positions past a row's history read whatever the pool holds there (possibly NaN in a
        # never-written slot); zeroed, they cannot reach the output as 0 x NaN.
        k = torch.where(valid[..., None, None], k, 0.0)
        v = torch.where(valid[..., None, None], v, 0.0)
        t = torch.arange(max_len, device=dev)[None, :]
        if new_k is not None:
            cur = (t == klen[a:b, None] - 1)[..., None, None]
            k = torch.where(cur, new_k[a:b, None].float(), k)
            v = torch.where(cur, new_v[a:b, None].float(), v)
        mask = (valid & (t >= plen[a:b, None])) if tail_only else valid
        out[a:b], lse[a:b] = dense_attention(q[a:b], k, v, mask, sm_scale)
    return out, lse


def reference_beam_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    cache_indirection: torch.Tensor,
    beam_width: int,
    new_k: Optional[torch.Tensor] = None,
    new_v: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    kv_layout: str = "HND",
    page_index_divisor: int = 1,
    return_lse: bool = False,
):
    """Dense float32 attention of every beam row over its whole history (the oracle).

    Args:
        q: ``[R*W, Hq, D]`` queries, beam row ``i = r*W + b``.
        kv_cache: paged pool, ``[pages, 2, Hkv, Pg, D]`` (HND) or ``[pages, 2, Pg, Hkv, D]`` (NHD), any float
            dtype (read as float32).
        beam_page_table: ``[>= R*W, max_pages]`` int, page entries of each beam row; entry
            ``// page_index_divisor`` is the page number.
        kv_lens: ``[R*W]`` int, KV length after this step's token (``L``).
        prompt_lens: ``[R*W]`` int, prompt length of each row's request (``P``).
        cache_indirection: ``[>= R, W_max, max_seq_len]`` int32.
        beam_width: ``W``.
        new_k, new_v: ``[R*W, Hkv, D]``, this step's K/V (position ``L - 1``); ``None`` reads it
            from the row's own page.
        sm_scale: softmax scale on ``q . k`` (default ``1/sqrt(D)``), finite and positive.
        kv_layout: ``"HND"`` or ``"NHD"``.
        page_index_divisor: an int >= 1 (``layers * kv_factor`` for TensorRT-LLM's block offsets).
        return_lse: also return the base-2 LSE.

    Returns:
        ``out`` float32 ``[R*W, Hq, D]`` (and ``lse_base2 [R*W, Hq]`` if ``return_lse``). Raises ``TypeError``
        for an ``sm_scale`` that is no number, ``ValueError`` for arguments it would misread: lengths per request,
        a kv_len past the table, a source beam outside ``[0, W)`` or a page outside the pool at a position a row
        attends.
    """
    out, lse = _attend_history(
        q, kv_cache, kv_layout, beam_page_table, cache_indirection, prompt_lens, kv_lens, beam_width,
        sm_scale, page_index_divisor, new_k, new_v, tail_only=False,
    )
    return (out, lse) if return_lse else out


def reference_tail_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    cache_indirection: torch.Tensor,
    beam_width: int,
    new_k: Optional[torch.Tensor] = None,
    new_v: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    kv_layout: str = "HND",
    page_index_divisor: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of every beam row over its generated positions ``[P, L)`` only.

    Same arguments as :func:`reference_beam_attention`. Returns ``(out float32 [R*W, Hq, D],
    lse_base2 float32 [R*W, Hq])``; a row with ``L == P`` (no tail) gets ``out = 0, lse = -inf``.
    """
    return _attend_history(
        q, kv_cache, kv_layout, beam_page_table, cache_indirection, prompt_lens, kv_lens, beam_width,
        sm_scale, page_index_divisor, new_k, new_v, tail_only=True,
    )


def reference_prefix_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    prompt_page_indptr: torch.Tensor,
    prompt_page_indices: torch.Tensor,
    prompt_lens: torch.Tensor,
    beam_width: int,
    sm_scale: Optional[float] = None,
    kv_layout: str = "HND",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of every beam row over its request's prompt ``[0, P_r)`` (non-causal).

    Args:
        q: ``[R*W, Hq, D]``, exactly ``len(prompt_lens) * beam_width`` rows.
        kv_cache: paged pool, ``[pages, 2, Hkv, Pg, D]`` (HND) or ``[pages, 2, Pg, Hkv, D]`` (NHD), any float dtype.
        prompt_page_indptr: ``[R + 1]`` int, offsets of each request's pages.
        prompt_page_indices: flat int, beam 0's pages; the first ``ceil(P_r / Pg)`` of each
            request hold the prompt.
        prompt_lens: ``[R]`` int, ``P_r`` per request (0 gives an empty prefix: out 0, lse -inf).
        beam_width: ``W``, query rows a request.
        sm_scale: softmax scale on ``q . k`` (default ``1/sqrt(D)``).
        kv_layout: ``"HND"`` or ``"NHD"``.

    Returns:
        ``(out float32 [R*W, Hq, D], lse_base2 float32 [R*W, Hq])``. Raises ``ValueError`` where the rows, the
        listed pages or their numbers do not match (a prompt past its listed pages, a page outside the pool).
    """
    num_pages, hkv, page_size, d = pool_geometry(kv_cache, kv_layout)
    scale = _default_scale(d, sm_scale)
    beam_width = _need_int("beam_width", beam_width, 1)
    dev = q.device
    indptr = _to_long(prompt_page_indptr, dev)
    indices = _to_long(prompt_page_indices, dev)
    plen = _to_long(prompt_lens, dev)
    num_rows, hq, _ = q.shape
    requests = plen.shape[0] if plen.dim() == 1 else -1
    if plen.dim() != 1 or num_rows != requests * beam_width:
        raise ValueError(f"q has {num_rows} rows but prompt_lens lists {requests} requests of beam_width={beam_width} "
                         f"({requests * beam_width} rows); pass per-request lengths of the batch q holds.")
    if indptr.shape != (requests + 1,) or bool((indptr[1:] < indptr[:-1]).any()) or int(indptr[0]) < 0 \
            or int(indptr[-1]) > indices.shape[0]:
        raise ValueError(f"prompt_page_indptr must be [{requests + 1}] non-decreasing offsets into the "
                         f"{indices.shape[0]} listed pages, got {indptr.tolist()}.")
    needed = (plen + page_size - 1) // page_size
    short = (plen < 0) | (needed > indptr[1:] - indptr[:-1])
    if bool(short.any()):
        r = int(short.nonzero()[0])
        raise ValueError(f"request {r}: prompt_lens[{r}]={int(plen[r])} needs {int(needed[r])} pages of {page_size} "
                         f"but {int(indptr[r + 1] - indptr[r])} are listed.")
    out = torch.full((num_rows, hq, d), float("nan"), dtype=torch.float32, device=dev)
    lse = torch.full((num_rows, hq), float("nan"), dtype=torch.float32, device=dev)
    for r in range(plen.shape[0]):
        p = int(plen[r])
        rows = slice(r * beam_width, (r + 1) * beam_width)
        t = torch.arange(max(p, 1), device=dev)
        pages = indices[int(indptr[r]) + t // page_size] if p > 0 else torch.zeros_like(t)
        if p > 0 and bool(((pages < 0) | (pages >= num_pages)).any()):
            raise ValueError(f"request {r} lists a prompt page outside the pool's [0, {num_pages}): "
                             f"{pages[(pages < 0) | (pages >= num_pages)][0].item()}.")
        k, v = gather_beam_kv(kv_cache, kv_layout, pages[None], (t % page_size)[None])
        valid = (t < p)[None].expand(beam_width, -1)
        out[rows], lse[rows] = dense_attention(
            q[rows], k.expand(beam_width, -1, -1, -1), v.expand(beam_width, -1, -1, -1), valid, scale
        )
    return out, lse


def merge_states_base2(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states by log-sum-exp, base 2, in float32.

    ``o_*``: ``[n, H, D]``; ``lse_*``: ``[n, H]`` base 2. Two empty states (``-inf``) give 0, ``-inf``.
    """
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp2(lse_a - m_safe)
    wb = torch.exp2(lse_b - m_safe)
    denom = wa + wb
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = (o_a.float() * wa[..., None] + o_b.float() * wb[..., None]) / safe[..., None]
    lse = torch.where(denom > 0, m_safe + torch.log2(safe), torch.full_like(m, float("-inf")))
    return out, lse
