"""A beam-search KV-cache simulator, for tests and benchmarks.

It owns a paged KV pool and allocates pages the way TensorRT-LLM's KV cache manager does for beam
search (block reuse off): a request's full prompt pages are shared by all of its beams; the last,
partially filled prompt page is private per beam, with the prompt valid only in beam 0's copy
(the context phase writes through beam 0's table); every generated page is private per beam.
Beams never copy pages: after each step the simulated sampler picks every beam's parent and
rewrites ``cache_indirection`` the way a beam-search sampler does, so beam ``b``'s history at
position ``t`` lives in the pages of beam ``cache_indirection[r, b, t]``.

Pages are handed out from a shuffled free list and the whole pool starts as random data, so a
kernel that reads a wrong page, a wrong slot or the wrong beam's copy gets a wrong answer.

Typical use::

    sim = BeamSearchCacheSimulator([37, 64, 1], beam_width=4, num_qo_heads=8, num_kv_heads=2,
                                   head_dim=64, page_size=16, max_seq_len=128)
    for _ in range(steps):
        step = sim.begin_step()            # allocates pages, draws q / new K/V
        out = my_attention(step)           # may write step.new_k / new_v into sim.kv_cache
        sim.end_step()                     # writes the step's K/V, reselects beams
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from .plan import cdiv

__all__ = ["BeamSearchCacheSimulator", "StepInputs"]

# Unused page-table entries: far outside any pool, so a read past kv_len cannot pass silently.
PAGE_TABLE_PAD = 1 << 30


@dataclass
class StepInputs:
    """One decode step's inputs (all tensors on the simulator's device).

    Attributes:
        q: ``[R*W, Hq, D]`` queries of this step's token, beam row ``i = r*W + b``.
        new_k, new_v: ``[R*W, Hkv, D]``, this step's K/V, to be written at position ``kv_len - 1``.
        beam_page_table: ``[R*W, max_pages_per_seq]`` int32 page numbers of each beam row;
            entries past the row's pages are ``PAGE_TABLE_PAD``.
        kv_lens: ``[R*W]`` int32, KV length including this step's token.
        prompt_lens: ``[R*W]`` int32, prompt length of each row's request.
        prompt_lens_per_request: ``[R]`` int32.
        cache_indirection: ``[R, W_max, max_seq_len]`` int32, row ``r`` = r-th request of the batch.
        prompt_page_indptr, prompt_page_indices: beam 0's whole page list per request (int32, CPU),
            the planner's input.
        write_page, write_slot: ``[R*W]`` int64, where each row's new K/V belongs.
        request_ids: ids of the batch's requests, in batch order.
        beam_width, page_size, num_pages: as configured.
    """

    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    beam_page_table: torch.Tensor
    kv_lens: torch.Tensor
    prompt_lens: torch.Tensor
    prompt_lens_per_request: torch.Tensor
    cache_indirection: torch.Tensor
    prompt_page_indptr: torch.Tensor
    prompt_page_indices: torch.Tensor
    write_page: torch.Tensor
    write_slot: torch.Tensor
    request_ids: List[int]
    beam_width: int
    page_size: int
    num_pages: int

    @property
    def num_rows(self) -> int:
        """``R * W`` beam rows of the step."""
        return self.q.shape[0]

    @property
    def tail_lens(self) -> torch.Tensor:
        """``[R*W]`` generated positions attended per row, this step's token included."""
        return self.kv_lens - self.prompt_lens


class _Request:
    def __init__(self, rid: int, slot: int, prompt_len: int, beam_width: int):
        self.rid = rid
        self.slot = slot  # row of the simulator's full indirection buffer (TensorRT-LLM's seq_slot)
        self.prompt_len = prompt_len
        self.length = prompt_len  # tokens in the cache, the same for every beam
        self.pages: List[List[int]] = [[] for _ in range(beam_width)]


class BeamSearchCacheSimulator:
    """Paged KV pool + beam-search page allocation + ``cache_indirection`` maintenance.

    Args:
        prompt_lens: prompt length of each initial request (tokens, ``>= 1``).
        beam_width: ``W``.
        num_qo_heads, num_kv_heads, head_dim: attention shape (``Hq % Hkv == 0``).
        page_size: tokens per page.
        max_seq_len: capacity per sequence (last dim of ``cache_indirection``).
        max_beam_width: ``W_max`` the cache was sized for (default ``W``).
        max_requests: rows of the full indirection buffer (default: initial requests + 8).
        kv_layout: ``"HND"`` (``[pages, 2, Hkv, Pg, D]``) or ``"NHD"`` (``[pages, 2, Pg, Hkv, D]``).
        num_pages: pool size; default fits every request at ``max_seq_len`` plus slack.
        dtype, device, seed: data type, device and RNG seed of all generated data.
    """

    def __init__(
        self,
        prompt_lens: Sequence[int],
        beam_width: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        max_seq_len: int,
        max_beam_width: Optional[int] = None,
        max_requests: Optional[int] = None,
        kv_layout: str = "HND",
        num_pages: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        device="cpu",
        seed: int = 0,
    ):
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}.")
        if kv_layout not in ("HND", "NHD"):
            raise ValueError(f"kv_layout={kv_layout!r}; use 'HND' or 'NHD'.")
        self.beam_width = int(beam_width)
        self.max_beam_width = int(max_beam_width or beam_width)
        if self.beam_width > self.max_beam_width:
            raise ValueError(f"beam_width={beam_width} > max_beam_width={self.max_beam_width}.")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.kv_layout = kv_layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        prompt_lens = [int(p) for p in prompt_lens]
        self.max_requests = int(max_requests or len(prompt_lens) + 8)
        self.max_pages_per_seq = int(cdiv(max_seq_len, page_size))
        if num_pages is None:
            num_pages = self.max_requests * (self.max_pages_per_seq * self.beam_width + 1) + 4
            # Cap the default for huge benchmark shapes: what the initial batch can reach.
            need = sum(
                cdiv(p, page_size) + self.beam_width * (cdiv(max_seq_len - p, page_size) + 1) for p in prompt_lens
            )
            num_pages = min(num_pages, need + 8 * self.max_pages_per_seq * self.beam_width + 4)
        self.num_pages = int(num_pages)
        shape = (
            (self.num_pages, 2, num_kv_heads, page_size, head_dim)
            if kv_layout == "HND"
            else (self.num_pages, 2, page_size, num_kv_heads, head_dim)
        )
        self.kv_cache = self._randn(shape)
        self.free_pages = list(self.rng.permutation(self.num_pages))
        self.cache_indirection_full = torch.zeros(
            self.max_requests, self.max_beam_width, max_seq_len, dtype=torch.int32, device=self.device
        )
        self.free_slots = list(range(self.max_requests))
        self.requests: List[_Request] = []
        self._next_rid = 0
        self._step: Optional[StepInputs] = None
        self.add_requests(prompt_lens)

    # ----------------------------------------------------------------------------------------
    def _randn(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, dtype=torch.float32).to(self.dtype).to(self.device)

    def _alloc(self) -> int:
        if not self.free_pages:
            raise RuntimeError(f"simulated KV pool of {self.num_pages} pages is full; pass a larger num_pages.")
        return int(self.free_pages.pop())

    def _kv_slice(self, page: int, slot, kv: int):
        if self.kv_layout == "HND":
            return self.kv_cache[page, kv, :, slot, :]
        return self.kv_cache[page, kv, slot, :, :]

    def write_kv(self, page: int, slot, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V ``[n, Hkv, D]`` (or ``[Hkv, D]``) at ``(page, slot)``; ``slot`` int or slice."""
        if self.kv_layout == "HND":
            if k.dim() == 3:
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            self.kv_cache[page, 0, :, slot, :] = k
            self.kv_cache[page, 1, :, slot, :] = v
        else:
            self.kv_cache[page, 0, slot, :, :] = k
            self.kv_cache[page, 1, slot, :, :] = v

    def read_kv(self, page: int, slot: int):
        """K and V ``[Hkv, D]`` stored at ``(page, slot)``."""
        return self._kv_slice(page, slot, 0), self._kv_slice(page, slot, 1)

    # ----------------------------------------------------------------------------------------
    def add_requests(self, prompt_lens: Sequence[int]) -> List[int]:
        """Admit requests: allocate their prompt pages and run a simulated context phase."""
        ids = []
        pg, w = self.page_size, self.beam_width
        for p in prompt_lens:
            p = int(p)
            if p < 1 or p >= self.max_seq_len:
                raise ValueError(f"prompt_len={p} must be in [1, max_seq_len={self.max_seq_len}).")
            if not self.free_slots:
                raise RuntimeError(f"all {self.max_requests} request slots are in use.")
            req = _Request(self._next_rid, self.free_slots.pop(0), p, w)
            self._next_rid += 1
            n_full, partial = divmod(p, pg)
            shared = [self._alloc() for _ in range(n_full)]
            for b in range(w):
                req.pages[b] = list(shared)
            if partial:
                for b in range(w):
                    req.pages[b].append(self._alloc())
            # Context phase: the prompt goes through beam 0's table only.
            k = self._randn((p, self.num_kv_heads, self.head_dim))
            v = self._randn((p, self.num_kv_heads, self.head_dim))
            for j in range(cdiv(p, pg)):
                a, b_ = j * pg, min(p, (j + 1) * pg)
                self.write_kv(req.pages[0][j], slice(0, b_ - a), k[a:b_], v[a:b_])
            # Prompt positions map to beam 0; later positions start as garbage beams.
            ind = self.cache_indirection_full[req.slot]
            ind.zero_()
            junk = torch.from_numpy(self.rng.integers(0, w, size=(w, self.max_seq_len - p), dtype=np.int32))
            ind[:w, p:] = junk.to(self.device)
            self.requests.append(req)
            ids.append(req.rid)
        return ids

    def finish(self, request_ids: Sequence[int]) -> None:
        """Remove finished requests from the batch and free their pages and slot."""
        drop = set(int(r) for r in request_ids)
        keep = []
        for req in self.requests:
            if req.rid in drop:
                pages = {pgid for beam in req.pages for pgid in beam}
                self.free_pages.extend(int(x) for x in self.rng.permutation(sorted(pages)))
                self.free_slots.append(req.slot)
            else:
                keep.append(req)
        self.requests = keep

    # ----------------------------------------------------------------------------------------
    def begin_step(self) -> StepInputs:
        """Allocate each beam's page for this step's token and draw this step's inputs."""
        if not self.requests:
            raise RuntimeError("no request left in the batch")
        pg, w = self.page_size, self.beam_width
        R = len(self.requests)
        rows = R * w
        table = np.full((rows, self.max_pages_per_seq), PAGE_TABLE_PAD, dtype=np.int32)
        kv_lens = np.empty(rows, dtype=np.int32)
        plens = np.empty(rows, dtype=np.int32)
        write_page = np.empty(rows, dtype=np.int64)
        write_slot = np.empty(rows, dtype=np.int64)
        indptr = [0]
        indices: List[int] = []
        for r, req in enumerate(self.requests):
            pos = req.length  # this step's token position
            if pos >= self.max_seq_len:
                raise RuntimeError(f"request {req.rid} reached max_seq_len={self.max_seq_len}")
            # A new block: private per beam (shareAmongBeams is false for W > 1). Checked against
            # the pages held, not just pos % pg, so a repeated begin_step() does not leak a page.
            if pos % pg == 0 and len(req.pages[0]) <= pos // pg:
                if len(self.free_pages) < w:  # all beams or none: a retry must see a consistent table
                    raise RuntimeError(
                        f"simulated KV pool of {self.num_pages} pages is full; pass a larger num_pages."
                    )
                for b in range(w):
                    req.pages[b].append(self._alloc())
            for b in range(w):
                i = r * w + b
                table[i, : len(req.pages[b])] = req.pages[b]
                kv_lens[i] = pos + 1
                plens[i] = req.prompt_len
                write_page[i] = req.pages[b][pos // pg]
                write_slot[i] = pos % pg
            indices.extend(req.pages[0])
            indptr.append(len(indices))
            # The kernel must not depend on the indirection entry of the current position.
            junk = torch.from_numpy(self.rng.integers(0, w, size=(w,), dtype=np.int32)).to(self.device)
            self.cache_indirection_full[req.slot, :w, pos] = junk
        slots = torch.tensor([req.slot for req in self.requests], device=self.device, dtype=torch.long)
        dev = self.device
        step = StepInputs(
            q=self._randn((rows, self.num_qo_heads, self.head_dim)),
            new_k=self._randn((rows, self.num_kv_heads, self.head_dim)),
            new_v=self._randn((rows, self.num_kv_heads, self.head_dim)),
            beam_page_table=torch.from_numpy(table).to(dev),
            kv_lens=torch.from_numpy(kv_lens).to(dev),
            prompt_lens=torch.from_numpy(plens).to(dev),
            prompt_lens_per_request=torch.tensor([q.prompt_len for q in self.requests], dtype=torch.int32, device=dev),
            cache_indirection=self.cache_indirection_full[slots].contiguous(),
            prompt_page_indptr=torch.tensor(indptr, dtype=torch.int32),
            prompt_page_indices=torch.tensor(indices, dtype=torch.int32),
            write_page=torch.from_numpy(write_page).to(dev),
            write_slot=torch.from_numpy(write_slot).to(dev),
            request_ids=[q.rid for q in self.requests],
            beam_width=w,
            page_size=pg,
            num_pages=self.num_pages,
        )
        self._step = step
        return step

    def end_step(self, parents: Optional[np.ndarray] = None, write_kv: bool = True) -> np.ndarray:
        """Finish the step: store its K/V, then pick every beam's parent and update the indirection.

        Args:
            parents: ``[R, W]`` ints in ``[0, W)``, the parent of each new beam; random if None.
            write_kv: store ``new_k``/``new_v`` at each row's position (set False only when the
                kernel under test already did and the test wants to check exactly that).

        Returns:
            the ``[R, W]`` parents used.
        """
        step = self._step
        if step is None:
            raise RuntimeError("end_step() without begin_step()")
        w = self.beam_width
        R = len(self.requests)
        if write_kv:
            for i in range(step.num_rows):
                self.write_kv(int(step.write_page[i]), int(step.write_slot[i]), step.new_k[i], step.new_v[i])
        if parents is None:
            parents = self.rng.integers(0, w, size=(R, w))
        parents = np.asarray(parents, dtype=np.int64)
        if parents.shape != (R, w) or (parents < 0).any() or (parents >= w).any():
            raise ValueError(f"parents must be [{R}, {w}] ints in [0, {w}), got {parents.shape}")
        for r, req in enumerate(self.requests):
            pos = req.length
            ind = self.cache_indirection_full[req.slot]
            # Position `pos` of beam b was written into beam b's own pages.
            ind[:w, pos] = torch.arange(w, dtype=torch.int32, device=self.device)
            par = torch.from_numpy(parents[r]).to(self.device)
            ind[:w, : pos + 1] = ind[par, : pos + 1].clone()
            req.length = pos + 1
        self._step = None
        return parents

    # ----------------------------------------------------------------------------------------
    def block_offsets(self, page_table: torch.Tensor, page_index_divisor: int) -> torch.Tensor:
        """A page table in TensorRT-LLM's block-offset encoding: ``[rows, 2, max_pages]`` int32.

        K entry = page * divisor, V entry = K entry + 1 (V1: divisor = layers_in_pool * kv_factor).
        Use ``[:, 0, :]`` (a strided view) as the kernel's page table with that divisor.
        """
        k = page_table.long() * page_index_divisor
        k = torch.where(page_table == PAGE_TABLE_PAD, torch.full_like(k, PAGE_TABLE_PAD), k)
        return torch.stack([k, k + 1], dim=1).to(torch.int32)
