"""Vectorised builder of one decode step's paged KV cache, laid out as TensorRT-LLM lays out beam search.

:class:`beam_shared_prefix.testing.BeamSearchCacheSimulator` reaches a step by simulating the
context phase and every earlier step with Python loops, which takes minutes at 128 requests x 96
beams x 3,000 tokens. This module builds the same layout for a given shape directly, with array
operations only:

- a request's full prompt pages are shared by all of its beams;
- the last, partially filled prompt page is private per beam (block reuse off), the prompt valid
  only in beam 0's copy (the other copies hold random data there, as after TensorRT-LLM's context
  phase, which writes through beam 0's table);
- every generated page is private per beam;
- pages come from a random permutation of the pool, and the whole pool starts as random data, so
  a kernel that reads a wrong page, slot or beam gets a wrong answer;
- ``cache_indirection`` follows a simulated beam-search ancestry: after each generated token every
  beam picks a parent (skewed towards the leading beams, as a sorted beam search does), so beam
  ``b``'s position ``t`` lives in the pages of the beam ``cache_indirection[r, b, t]`` that wrote it.
  With ``shape.ancestry == "uniform"`` parents are uniform over the beams (histories coalesce about
  ``2 W`` steps back); with ``"independent"`` every beam is its own parent: no generated row is shared.
  Prompt positions map to beam 0; the current position and later ones hold random beams (a kernel
  must not read them);
- ``kv_lens = prompt + tail`` (the tail counts this step's token, whose K/V are ``new_k``/``new_v``);
  with ``tail_jitter`` each request draws its own tail (requests that joined the batch at different
  steps), and its ancestry is that of a beam search of its own length.

Baseline pages. A per-beam paged kernel (FlashInfer decode, the cascade's unique level) reads one
page list per beam and cannot follow ``cache_indirection`` slot by slot. For those arms the builder
also *materialises* every beam's history in pages of its own: beam ``b``'s private columns (the
partial prompt page onward) are copied from where the indirection says they live, and this step's
token is written at ``kv_len - 1``, as a copy-on-fork cache would hold them. Baseline arms then read
the shared full prompt pages plus the beam's materialised pages and compute exactly the same
function as the library, so every arm is checked against one oracle. They move the same bytes as a
kernel that follows the indirection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from beam_shared_prefix.plan import cdiv as _cdiv
from beam_shared_prefix.testing import PAGE_TABLE_PAD

from .shapes import BenchShape

__all__ = [
    "PAGE_TABLE_PAD",
    "BenchWorkload",
    "LayoutError",
    "build_workload",
    "ancestry_from_parents",
    "draw_parents",
    "draw_prompt_lens",
    "draw_tail_lens",
    "ragged_ancestry",
    "validate_layout",
    "select_requests",
    "torch_dtype",
]


class LayoutError(AssertionError):
    """A page layout that breaks the TensorRT-LLM beam-search layout rules (names the row and page)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a shape's dtype name (``"bfloat16"`` or ``"float16"``)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class BenchWorkload:
    """One decode step's inputs plus the host-side facts the benchmark needs.

    Device tensors (on ``device``):
        q: ``[R*W, Hq, D]``; new_k, new_v: ``[R*W, Hkv, D]`` (dtype of the shape).
        kv_cache: ``[num_pages, 2, Hkv, Pg, D]`` (HND) or ``[num_pages, 2, Pg, Hkv, D]`` (NHD).
        beam_page_table: ``[R*W, max_pages]`` int32, the library's view (unused entries ``PAGE_TABLE_PAD``).
        kv_lens: ``[R*W]`` int32 ``= P_r + T_r``; prompt_lens: ``[R*W]`` int32.
        prompt_lens_per_request: ``[R]`` int32.
        cache_indirection: ``[R, W, max_seq_len]`` int32.
        baseline_page_table: ``[R*W, max_pages]`` int32 or ``None``: shared full prompt pages, then
            the beam's materialised pages (see the module docstring).

    Host arrays (numpy / CPU tensors):
        prompt_page_indptr, prompt_page_indices: CPU int32, beam 0's page list per request (the
            planner's input; the prompt pages come first).
        prompt_lens_host, kv_lens_host: ``[R]`` int64.
        tail_ancestry: ``[R, W, T-1]`` int32, the source beam of every earlier generated position
            (``-1`` past a request's own ``T_r - 1`` positions).
        page_table_host, baseline_page_table_host: int32 copies of the tables.
    """

    shape: BenchShape
    seed: int
    kv_layout: str
    device: torch.device
    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    kv_cache: torch.Tensor
    beam_page_table: torch.Tensor
    kv_lens: torch.Tensor
    prompt_lens: torch.Tensor
    prompt_lens_per_request: torch.Tensor
    cache_indirection: torch.Tensor
    prompt_page_indptr: torch.Tensor
    prompt_page_indices: torch.Tensor
    prompt_lens_host: np.ndarray
    kv_lens_host: np.ndarray
    tail_ancestry: np.ndarray
    page_table_host: np.ndarray
    baseline_page_table: Optional[torch.Tensor]
    baseline_page_table_host: Optional[np.ndarray]
    num_pages: int
    max_seq_len: int

    @property
    def num_requests(self) -> int:
        """``R``."""
        return self.shape.requests

    @property
    def beam_width(self) -> int:
        """``W``."""
        return self.shape.beams

    @property
    def num_rows(self) -> int:
        """``R * W`` beam rows."""
        return self.shape.rows

    @property
    def dtype(self) -> torch.dtype:
        """Q/KV dtype (bf16 or fp16)."""
        return self.q.dtype

    @property
    def full_prompt_pages(self) -> np.ndarray:
        """``[R]``: ``P_r // Pg``, the pages every beam of request ``r`` shares."""
        return self.prompt_lens_host // self.shape.page_size

    @property
    def tail_lens_host(self) -> np.ndarray:
        """``[R]`` int64: ``T_r = L_r - P_r``, each request's generated tokens, this step's included."""
        return self.kv_lens_host - self.prompt_lens_host

    @property
    def seq_pages(self) -> np.ndarray:
        """``[R]``: ``ceil(L_r / Pg)``, the page columns a beam of request ``r`` uses."""
        return _cdiv(self.kv_lens_host, self.shape.page_size)

    def kv_bytes(self) -> int:
        """Bytes of the whole KV pool."""
        return self.kv_cache.numel() * self.kv_cache.element_size()


def draw_prompt_lens(shape: BenchShape, rng: np.random.Generator) -> np.ndarray:
    """``[R]`` int64 prompt lengths: all ``P``, or uniform in ``[P(1-j), P(1+j)]`` with jitter ``j``."""
    if shape.prompt_jitter <= 0:
        return np.full(shape.requests, shape.prompt, dtype=np.int64)
    lo = max(1, int(round(shape.prompt * (1 - shape.prompt_jitter))))
    return rng.integers(lo, shape.longest_prompt + 1, size=shape.requests).astype(np.int64)


def draw_tail_lens(shape: BenchShape, rng: np.random.Generator) -> np.ndarray:
    """``[R]`` int64 tails: all ``T``, or uniform in ``[max(1, round(T(1-j))), T]`` with ``j = tail_jitter``,
    one request (drawn) at ``T``, so that ``T`` is always the step's longest tail (the one the rule judges)."""
    if shape.shortest_tail >= shape.tail:
        return np.full(shape.requests, shape.tail, dtype=np.int64)
    tails = rng.integers(shape.shortest_tail, shape.tail + 1, size=shape.requests).astype(np.int64)
    tails[rng.integers(shape.requests)] = shape.tail
    return tails


def ragged_ancestry(parents: np.ndarray, tail_lens: np.ndarray) -> np.ndarray:
    """``[R, W, max(T_r) - 1]`` int32 source beams when request ``r`` has run ``T_r - 1`` steps.

    Request ``r`` took the first ``T_r - 1`` steps of ``parents`` (``[G, R, W]``), so its ancestry
    is computed from those alone (a shorter search ends with other survivors); positions past
    its tail hold ``-1``.
    """
    G, R, W = parents.shape
    anc = np.full((R, W, G), -1, dtype=np.int32)
    for t in np.unique(tail_lens):
        reqs = np.flatnonzero(tail_lens == t)
        if t > 1:
            anc[reqs, :, : t - 1] = ancestry_from_parents(parents[: t - 1][:, reqs])
    return anc


def draw_parents(num_requests: int, beam_width: int, num_generated: int, rng: np.random.Generator,
                 ancestry: str = "beam-search") -> np.ndarray:
    """``[G, R, W]`` parent of every new beam after each of ``G`` steps: with ``ancestry="beam-search"``
    skewed towards the leading beams (``floor(W u^2)``), as a beam search that keeps its beams sorted by
    score picks them; with ``"uniform"`` uniform over the beams (``floor(W u)``: a neutral coalescent,
    whose ``W`` lineages meet about ``2 W`` steps back); with ``"independent"`` every beam's own index (no
    history is ever shared). All draw the same random numbers, so one seed gives the same pool, queries and
    pages whatever the ancestry."""
    u = rng.random((num_generated, num_requests, beam_width))
    if ancestry == "independent":
        return np.broadcast_to(np.arange(beam_width, dtype=np.int64), u.shape).copy()
    if ancestry not in ("beam-search", "uniform"):
        raise ValueError(f"ancestry={ancestry!r}; use 'beam-search', 'uniform' or 'independent'.")
    return np.minimum(((u ** 2 if ancestry == "beam-search" else u) * beam_width).astype(np.int64), beam_width - 1)


def ancestry_from_parents(parents: np.ndarray) -> np.ndarray:
    """Source beam of every earlier generated position, from the parents of ``G`` beam-search steps.

    At generation step ``g`` every beam writes position ``P + g`` into its own pages; the sampler
    then gives every new beam ``b`` a parent ``parents[g, r, b]`` whose whole history it inherits.
    So the final beam ``b``'s position ``P + g`` was written by
    ``parents[g][parents[g+1][... parents[G-1][b]]]``, computed here backwards in ``O(G R W)``.

    Args:
        parents: ``[G, R, W]`` ints in ``[0, W)``.

    Returns:
        ``[R, W, G]`` int32.
    """
    G, R, W = parents.shape
    anc = np.empty((R, W, G), dtype=np.int32)
    cur = np.broadcast_to(np.arange(W, dtype=np.int64), (R, W))
    for g in reversed(range(G)):
        cur = np.take_along_axis(parents[g], cur, axis=1)
        anc[:, :, g] = cur
    return anc


def _randn(shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if device.type == "cuda":
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    return torch.randn(shape, dtype=torch.float32, generator=gen).to(dtype)


def _page_tables(
    prompt_lens: np.ndarray, kv_lens: np.ndarray, beam_width: int, page_size: int, max_pages: int,
    num_pages_pool: int, with_baseline: bool, rng: np.random.Generator,
):
    """The library's (and optionally the baseline's) ``[R*W, max_pages]`` page tables, vectorised."""
    R, W = prompt_lens.shape[0], beam_width
    n_full = prompt_lens // page_size
    n_seq = _cdiv(kv_lens, page_size)
    n_priv = n_seq - n_full  # >= 1: the tail holds at least this step's token
    shared_total = int(n_full.sum())
    priv_total = int(W * n_priv.sum())
    used = shared_total + priv_total * (2 if with_baseline else 1)
    perm = rng.permutation(num_pages_pool)[:used].astype(np.int64)
    shared_ids = perm[:shared_total]
    priv_ids = perm[shared_total:shared_total + priv_total]
    base_ids = perm[shared_total + priv_total:] if with_baseline else None

    shared_off = np.concatenate([[0], np.cumsum(n_full)[:-1]])
    priv_req_off = np.concatenate([[0], np.cumsum(W * n_priv)[:-1]])
    rows = np.arange(R * W)
    req, beam = rows // W, rows % W
    col = np.arange(max_pages)[None, :]
    nf = n_full[req][:, None]
    ns = n_seq[req][:, None]
    shared_mask = col < nf
    priv_mask = (col >= nf) & (col < ns)
    shared_idx = shared_off[req][:, None] + col
    priv_idx = (priv_req_off[req] + beam * n_priv[req])[:, None] + (col - nf)

    def table_from(ids):
        t = np.full((R * W, max_pages), PAGE_TABLE_PAD, dtype=np.int64)
        t[shared_mask] = shared_ids[shared_idx[shared_mask]]
        t[priv_mask] = ids[priv_idx[priv_mask]]
        return t.astype(np.int32)

    table = table_from(priv_ids)
    base_table = table_from(base_ids) if with_baseline else None
    return table, base_table


def build_workload(
    shape: BenchShape,
    device="cpu",
    seed: int = 0,
    kv_layout: str = "HND",
    with_baseline_pages: bool = True,
    spare_pages: int = 8,
) -> BenchWorkload:
    """Build one decode step of ``shape`` on ``device`` (see the module docstring for the layout).

    Args:
        shape: the benchmark shape.
        device: where the tensors live.
        seed: seeds the layout (page permutation, prompt and tail jitter, ancestry) and the data.
        kv_layout: ``"HND"`` (TensorRT-LLM's) or ``"NHD"``.
        with_baseline_pages: also materialise per-beam pages for page-list baselines.
        spare_pages: pool pages no table references (random data).

    Returns:
        a :class:`BenchWorkload`. Memory: ``(R * P/Pg + W * R * (1 + T/Pg) * (2 if baseline))``
        pages of ``2 * Hkv * Pg * D`` elements.
    """
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout={kv_layout!r}; use 'HND' or 'NHD'.")
    device = torch.device(device)
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
    dtype = torch_dtype(shape.dtype)
    R, W, T, Pg = shape.requests, shape.beams, shape.tail, shape.page_size
    Hq, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim

    prompt_lens = draw_prompt_lens(shape, rng)
    tail_lens = draw_tail_lens(shape, rng)  # draws nothing without tail jitter: the same seeds, the same steps
    kv_lens = prompt_lens + tail_lens
    # Capacity one page beyond the longest sequence, as a cache sized for max_seq_len would have.
    max_pages = int(_cdiv(kv_lens.max(), Pg)) + 1
    max_seq_len = max_pages * Pg
    n_full = prompt_lens // Pg
    n_priv = _cdiv(kv_lens, Pg) - n_full
    pages_used = int(n_full.sum() + W * n_priv.sum() * (2 if with_baseline_pages else 1))
    num_pages = pages_used + int(spare_pages)

    table, base_table = _page_tables(prompt_lens, kv_lens, W, Pg, max_pages, num_pages, with_baseline_pages, rng)
    ancestry = ragged_ancestry(draw_parents(R, W, T - 1, rng, shape.ancestry), tail_lens)

    pool_shape = (num_pages, 2, Hkv, Pg, D) if kv_layout == "HND" else (num_pages, 2, Pg, Hkv, D)
    kv_cache = _randn(pool_shape, dtype, device, gen)
    q = _randn((R * W, Hq, D), dtype, device, gen)
    new_k = _randn((R * W, Hkv, D), dtype, device, gen)
    new_v = _randn((R * W, Hkv, D), dtype, device, gen)

    # cache_indirection: random beams everywhere, 0 on the prompt, the ancestry on earlier tail positions.
    ind = torch.randint(0, W, (R, W, max_seq_len), dtype=torch.int32, device=device, generator=gen)
    plen_dev = torch.from_numpy(prompt_lens).to(device)
    pos = torch.arange(max_seq_len, device=device)
    ind.masked_fill_((pos[None, :] < plen_dev[:, None])[:, None, :], 0)
    if T > 1:
        # Only a request's own earlier positions: its current one and later stay random.
        r_idx, b_idx, g_idx = (torch.from_numpy(a).to(device) for a in np.nonzero(ancestry >= 0))
        anc_dev = torch.from_numpy(ancestry).to(device)
        ind[r_idx, b_idx, plen_dev[r_idx] + g_idx] = anc_dev[r_idx, b_idx, g_idx]

    rows_req = np.repeat(np.arange(R), W)
    # Planner input: beam 0's whole page list per request (prompt pages first, then its private ones).
    seq_pages = _cdiv(kv_lens, Pg)
    beam0 = table[::W]
    listed = np.arange(max_pages)[None, :] < seq_pages[:, None]
    wl = BenchWorkload(
        shape=shape,
        seed=seed,
        kv_layout=kv_layout,
        device=device,
        q=q,
        new_k=new_k,
        new_v=new_v,
        kv_cache=kv_cache,
        beam_page_table=torch.from_numpy(table).to(device),
        kv_lens=torch.from_numpy(kv_lens[rows_req].astype(np.int32)).to(device),
        prompt_lens=torch.from_numpy(prompt_lens[rows_req].astype(np.int32)).to(device),
        prompt_lens_per_request=torch.from_numpy(prompt_lens.astype(np.int32)).to(device),
        cache_indirection=ind,
        prompt_page_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum(seq_pages)]).astype(np.int32)),
        prompt_page_indices=torch.from_numpy(beam0[listed].astype(np.int32)),
        prompt_lens_host=prompt_lens,
        kv_lens_host=kv_lens,
        tail_ancestry=ancestry,
        page_table_host=table,
        baseline_page_table=None if base_table is None else torch.from_numpy(base_table).to(device),
        baseline_page_table_host=base_table,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
    )
    if with_baseline_pages:
        _materialise_baseline(wl)
    return wl


def _kv_at(kv_cache: torch.Tensor, kv_layout: str, page: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[n, 2, Hkv, D]`` K/V of ``n`` (page, slot) pairs."""
    if kv_layout == "HND":
        return kv_cache[page, :, :, slot, :]
    return kv_cache[page, :, slot, :, :]


def _kv_put(kv_cache: torch.Tensor, kv_layout: str, page: torch.Tensor, slot: torch.Tensor, kv: torch.Tensor) -> None:
    if kv_layout == "HND":
        kv_cache[page, :, :, slot, :] = kv
    else:
        kv_cache[page, :, slot, :, :] = kv


def _materialise_baseline(wl: BenchWorkload, chunk_bytes: int = 1 << 28) -> None:
    """Copy every beam's history from the private columns on into its baseline pages (see module doc)."""
    sh = wl.shape
    W, Pg = sh.beams, sh.page_size
    dev = wl.device
    table = wl.beam_page_table.long()
    base = wl.baseline_page_table.long()
    ind = wl.cache_indirection
    n_full = torch.from_numpy(wl.full_prompt_pages).to(dev)
    plen = torch.from_numpy(wl.prompt_lens_host).to(dev)
    klen = torch.from_numpy(wl.kv_lens_host).to(dev)
    span = int((wl.kv_lens_host - wl.full_prompt_pages * Pg).max())  # positions from the first private column
    row_bytes = span * 2 * sh.kv_heads * sh.head_dim * wl.kv_cache.element_size()
    rows_per_chunk = max(1, chunk_bytes // max(1, row_bytes))
    for a in range(0, wl.num_rows, rows_per_chunk):
        b = min(wl.num_rows, a + rows_per_chunk)
        rows = torch.arange(a, b, device=dev)
        req, beam = rows // W, rows % W
        t = (n_full[req] * Pg)[:, None] + torch.arange(span, device=dev)[None, :]
        L = klen[req][:, None]
        earlier = t < L - 1
        t_safe = torch.where(earlier, t, torch.zeros_like(t))
        src = ind[req[:, None], beam[:, None], t_safe.clamp(max=ind.shape[2] - 1)].long()
        src = torch.where(t_safe < plen[req][:, None], torch.zeros_like(src), src)
        src_row = req[:, None] * W + src
        col = t_safe // Pg
        src_page = table[src_row, col][earlier]
        dst_page = base[rows[:, None].expand_as(t), col][earlier]
        slot = (t_safe % Pg)[earlier]
        _kv_put(wl.kv_cache, wl.kv_layout, dst_page, slot, _kv_at(wl.kv_cache, wl.kv_layout, src_page, slot))
        # This step's token, where a per-beam kernel reads it.
        cur = klen[req] - 1
        cur_page = base[rows, cur // Pg]
        cur_kv = torch.stack([wl.new_k[a:b], wl.new_v[a:b]], dim=1)
        _kv_put(wl.kv_cache, wl.kv_layout, cur_page, cur % Pg, cur_kv)


def validate_layout(
    beam_page_table,
    prompt_lens_per_request: Sequence[int],
    kv_lens_per_request: Sequence[int],
    beam_width: int,
    page_size: int,
    num_pages: int,
    cache_indirection=None,
    private_prompt_page: bool = True,
) -> Dict[str, int]:
    """Check a step's page layout against TensorRT-LLM's beam-search rules; raise :class:`LayoutError`.

    Rules: every used entry is a page in ``[0, num_pages)``; the full prompt pages of a request are
    the same for all of its beams and belong to no other request; every other used column
    (the partial prompt page, if ``private_prompt_page``, and generated pages) is a page no other
    (request, beam) uses; with ``cache_indirection``, earlier generated positions name beams in
    ``[0, W)``.

    Works on the simulator's :class:`~beam_shared_prefix.testing.StepInputs` tables too.

    Returns:
        counts: ``shared_pages``, ``private_pages``.
    """
    table = np.asarray(beam_page_table.cpu() if hasattr(beam_page_table, "cpu") else beam_page_table, dtype=np.int64)
    plen = np.asarray(prompt_lens_per_request, dtype=np.int64)
    klen = np.asarray(kv_lens_per_request, dtype=np.int64)
    R, W = plen.shape[0], beam_width
    if table.shape[0] < R * W:
        raise LayoutError(f"page table has {table.shape[0]} rows, need R*W = {R * W}.")
    n_shared = plen // page_size if private_prompt_page else _cdiv(plen, page_size)
    n_seq = _cdiv(klen, page_size)
    if (n_seq > table.shape[1]).any():
        r = int(np.argmax(n_seq > table.shape[1]))
        raise LayoutError(f"request {r}: kv_len {klen[r]} needs {n_seq[r]} pages, table has {table.shape[1]} columns.")
    owner: Dict[int, tuple] = {}
    for r in range(R):
        rows = table[r * W:(r + 1) * W]
        used = rows[:, : n_seq[r]]
        bad = (used < 0) | (used >= num_pages)
        if bad.any():
            b, c = np.argwhere(bad)[0]
            raise LayoutError(f"row {r * W + b} column {c}: page {used[b, c]} outside [0, {num_pages}).")
        shared = rows[:, : n_shared[r]]
        if (shared != shared[0:1]).any():
            b, c = np.argwhere(shared != shared[0:1])[0]
            raise LayoutError(f"request {r}: beam {b} column {c} holds page {shared[b, c]}, beam 0 holds {shared[0, c]}; full prompt pages must be shared.")
        for p in shared[0]:
            if owner.setdefault(int(p), ("shared", r)) != ("shared", r):
                raise LayoutError(f"page {p} is a shared prompt page of request {r} and also used by {owner[int(p)]}.")
        for b in range(W):
            for c in range(n_shared[r], n_seq[r]):
                p = int(rows[b, c])
                if owner.setdefault(p, ("private", r, b)) != ("private", r, b):
                    raise LayoutError(f"page {p} (request {r}, beam {b}, column {c}) is also used by {owner[p]}; private pages must be unique.")
    if cache_indirection is not None:
        ind = cache_indirection.cpu().numpy() if hasattr(cache_indirection, "cpu") else np.asarray(cache_indirection)
        for r in range(R):
            seg = ind[r, :W, plen[r]:klen[r] - 1]
            if seg.size and ((seg < 0) | (seg >= W)).any():
                raise LayoutError(f"request {r}: cache_indirection holds beams outside [0, {W}) on its tail.")
    n_sh = sum(1 for v in owner.values() if v[0] == "shared")
    return {"shared_pages": n_sh, "private_pages": len(owner) - n_sh}


def select_requests(wl: BenchWorkload, requests: Sequence[int]) -> Dict[str, torch.Tensor]:
    """The inputs of a sub-batch made of whole requests (all of their beams), for the oracle.

    Returns a dict with ``rows`` (beam rows in the full batch), ``q``, ``new_k``, ``new_v``,
    ``beam_page_table``, ``kv_lens``, ``prompt_lens``, ``cache_indirection``,
    ``prompt_page_indptr``, ``prompt_page_indices`` (beam 0's prompt pages only) and
    ``prompt_lens_per_request``; the pool is shared, not copied.
    """
    W = wl.beam_width
    reqs = torch.as_tensor(list(requests), dtype=torch.long)
    rows = (reqs[:, None] * W + torch.arange(W)[None, :]).reshape(-1).to(wl.device)
    reqs_dev = reqs.to(wl.device)
    plen = wl.prompt_lens_host[reqs.numpy()]
    n_prompt = _cdiv(plen, wl.shape.page_size)
    beam0 = wl.page_table_host[reqs.numpy() * W]
    indices = np.concatenate([beam0[i, : n_prompt[i]] for i in range(len(plen))]).astype(np.int32)
    return {
        "rows": rows,
        "q": wl.q[rows],
        "new_k": wl.new_k[rows],
        "new_v": wl.new_v[rows],
        "beam_page_table": wl.beam_page_table[rows],
        "kv_lens": wl.kv_lens[rows],
        "prompt_lens": wl.prompt_lens[rows],
        "cache_indirection": wl.cache_indirection[reqs_dev],
        "prompt_page_indptr": torch.from_numpy(np.concatenate([[0], np.cumsum(n_prompt)]).astype(np.int32)),
        "prompt_page_indices": torch.from_numpy(indices),
        "prompt_lens_per_request": torch.from_numpy(plen.astype(np.int32)),
    }
