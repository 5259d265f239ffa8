"""The floors a decode step cannot beat: bytes that must move and FLOPs that must be done.

Bytes (one step, one layer; ``s`` = bytes per element of the dtype, rows = ``R*W``):

| term | bytes | why it must move |
| --- | --- | --- |
| prompt KV | ``sum_r P_r * Hkv * D * 2 * s`` | every request's prompt K and V, read once (not once per beam) |
| tail KV | ``E * Hkv * D * 2 * s`` | ``E`` = distinct ``(request, source beam, position)`` entries the beams' earlier generated positions point to (beams that share an ancestor share its K/V) |
| new K/V | ``rows * Hkv * D * 2 * s * 2`` | this step's K and V, read from the layer input and written into the cache |
| q | ``rows * Hq * D * s`` | read |
| out | ``rows * Hq * D * s`` | written |
| metadata | ``4 * (sum_r ceil(P_r/Pg) + R + 1 + 2 rows + rows (T-1) + rows C)`` | int32: prompt page indices and indptr, per-row ``kv_len`` and ``prompt_len``, the rows' ``cache_indirection`` entries of earlier tail positions, and ``C`` page-table entries per row (the columns its tail spans) |

The *assembled* floor adds the round trip of the prefix state a two-stage design keeps in memory
between its prefix and tail kernels: ``2 * rows * Hq * (D * s + 4)`` (the prefix output in the
dtype and its float32 LSE, written once and read once).

FLOPs: ``4 * D * Hq * sum_rows kv_len`` (``q.k`` and ``p.v``, a multiply-add counted as 2). The
prompt is shared in memory, not in arithmetic: every beam's query differs, so every (row, position)
pair costs its dot products. The exponentials (``Hq * sum_rows kv_len``) run on the SFU and are not
counted.

Rates are measured in the same run: the copy bandwidth by a large device-to-device copy
(``2 * bytes / time``, read + write) and the matmul rate by an ``N x N x N`` matmul in the
benchmark's dtype (``2 N^3 / time``). The floor of a shape is ``max(bytes / bandwidth,
FLOPs / matmul rate)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

import numpy as np
import torch

__all__ = [
    "Traffic",
    "count_traffic",
    "count_flops",
    "distinct_tail_entries",
    "mean_traffic",
    "measure_copy_bandwidth",
    "measure_matmul_rate",
    "floor_times",
    "stage_work",
]


@dataclass(frozen=True)
class Traffic:
    """Bytes one step must move, by term (see the module docstring)."""

    prompt_kv: int
    tail_kv: int
    new_kv: int
    q: int
    out: int
    metadata: int
    prefix_state_round_trip: int
    tail_kv_per_beam: int  # informative: tail K/V if every beam read its own copy (E = rows * (T-1))

    @property
    def total(self) -> int:
        """The floor's bytes: everything but the prefix-state round trip."""
        return self.prompt_kv + self.tail_kv + self.new_kv + self.q + self.out + self.metadata

    @property
    def assembled(self) -> int:
        """Bytes of a two-stage design: :attr:`total` plus the prefix output/LSE written and read back."""
        return self.total + self.prefix_state_round_trip

    def to_dict(self) -> Dict[str, int]:
        """JSON-ready dict of the fields (used in the results document)."""
        d = asdict(self)
        d["total"] = self.total
        d["assembled"] = self.assembled
        return d


def mean_traffic(traffics: "list[Traffic]") -> Traffic:
    """The term-by-term mean (rounded) of several input sets' :class:`Traffic`."""
    n = len(traffics)
    fields = asdict(traffics[0]).keys()
    return Traffic(**{f: int(round(sum(getattr(t, f) for t in traffics) / n)) for f in fields})


def _per_request(tail, prompt_lens: np.ndarray) -> np.ndarray:
    """``[R]`` int64 tails from one int or an ``[R]`` array."""
    return np.broadcast_to(np.asarray(tail, dtype=np.int64), prompt_lens.shape)


def distinct_tail_entries(tail_ancestry: np.ndarray) -> int:
    """Distinct ``(request, source beam, position)`` entries in a ``[R, W, T-1]`` ancestry array
    (a position holding ``-1``, past its request's tail, counts none)."""
    if tail_ancestry.size == 0:
        return 0
    s = np.sort(tail_ancestry, axis=1)
    per_position = 1 + (np.diff(s, axis=1) != 0).sum(axis=1)  # [R, T-1]
    return int(per_position[s[:, -1, :] >= 0].sum())


def count_traffic(
    prompt_lens: np.ndarray,
    tail,
    beams: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    elem_bytes: int,
    tail_ancestry: Optional[np.ndarray] = None,
) -> Traffic:
    """Bytes one decode step of one layer must move (see the module docstring for every term).

    Args:
        prompt_lens: ``[R]`` prompt lengths ``P_r``.
        tail: ``T``, generated tokens per beam including this step's (``kv_len = P + T``): one
            int, or ``[R]`` per request (``T_r``).
        beams, heads, kv_heads, head_dim, page_size: ``W``, ``Hq``, ``Hkv``, ``D``, ``Pg``.
        elem_bytes: bytes per K/V/q/out element (2 for bf16/fp16).
        tail_ancestry: ``[R, W, T-1]`` source beams of earlier tail positions; ``None`` counts one
            copy per beam (an upper bound of the tail term).
    """
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    R = int(prompt_lens.shape[0])
    rows = R * beams
    tail = _per_request(tail, prompt_lens)
    kv_row = kv_heads * head_dim * 2 * elem_bytes  # K and V of one position
    per_beam_entries = beams * int((tail - 1).sum())
    entries = per_beam_entries if tail_ancestry is None else distinct_tail_entries(tail_ancestry)
    first_col = prompt_lens // page_size
    last_col = (prompt_lens + tail - 1) // page_size
    tail_cols = int(((last_col - first_col + 1) * beams).sum())
    metadata = 4 * (
        int(-(-prompt_lens // page_size).sum()) + R + 1 + 2 * rows + per_beam_entries + tail_cols
    )
    return Traffic(
        prompt_kv=int(prompt_lens.sum()) * kv_row,
        tail_kv=entries * kv_row,
        new_kv=rows * kv_row * 2,
        q=rows * heads * head_dim * elem_bytes,
        out=rows * heads * head_dim * elem_bytes,
        metadata=metadata,
        prefix_state_round_trip=2 * rows * heads * (head_dim * elem_bytes + 4),
        tail_kv_per_beam=per_beam_entries * kv_row,
    )


def count_flops(prompt_lens: np.ndarray, tail, beams: int, heads: int, head_dim: int) -> int:
    """``4 * D * Hq * sum_rows kv_len``: the tensor-core FLOPs of one step (see module docstring);
    ``tail`` is one int or ``[R]`` per request."""
    kv = np.asarray(prompt_lens, dtype=np.int64) + tail
    return int(4 * head_dim * heads * beams * int(kv.sum()))


def _event_median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def measure_copy_bandwidth(device="cuda", nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (``2 * nbytes / time``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = _event_median_ms(lambda: dst.copy_(src), iters, warmup=2)
    return 2.0 * nbytes / (ms * 1e-3)


def measure_matmul_rate(dtype=torch.bfloat16, device="cuda", n: int = 8192, iters: int = 10) -> float:
    """Dense matmul rate in FLOP/s for ``[n, n] @ [n, n]`` in ``dtype`` (``2 n^3 / time``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    ms = _event_median_ms(lambda: torch.matmul(a, b, out=c), iters, warmup=3)
    return 2.0 * n ** 3 / (ms * 1e-3)


def floor_times(traffic: Traffic, flops: int, bandwidth: Optional[float], matmul_rate: Optional[float]) -> Dict[str, Optional[float]]:
    """Floors in microseconds: ``memory_us``, ``assembled_memory_us``, ``compute_us``, ``floor_us``
    (the max of memory and compute), ``assembled_floor_us``; ``None`` where a rate is unknown."""
    mem = traffic.total / bandwidth * 1e6 if bandwidth else None
    mem_asm = traffic.assembled / bandwidth * 1e6 if bandwidth else None
    comp = flops / matmul_rate * 1e6 if matmul_rate else None
    known = [x for x in (mem, comp) if x is not None]
    known_asm = [x for x in (mem_asm, comp) if x is not None]
    return {
        "memory_us": mem,
        "assembled_memory_us": mem_asm,
        "compute_us": comp,
        "floor_us": max(known) if known else None,
        "assembled_floor_us": max(known_asm) if known_asm else None,
    }


def stage_work(work: str, traffic: Traffic, flops: int, prompt_lens: np.ndarray, tail, beams: int,
               heads: int, head_dim: int, page_size: int) -> Dict[str, int]:
    """Bytes and FLOPs of one arm's work: ``full`` (the step), ``prefix`` or ``tail`` (a stage alone).

    - prefix: prompt KV + q + the prefix state written (``rows * Hq * (D*s + 4)``) + the prompt
      page indices and indptr; FLOPs ``4 D Hq W sum_r P_r``.
    - tail: tail KV + new K/V + q + out + the prefix state read + the rest of the metadata (the
      prompt page indices and indptr are the prefix's); FLOPs ``4 D Hq W sum_r T_r``.

    ``tail`` is one int or ``[R]`` per request.
    """
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    R = prompt_lens.shape[0]
    state = traffic.prefix_state_round_trip // 2
    if work == "full":
        return {"bytes": traffic.total, "flops": flops}
    prompt_metadata = 4 * (R + 1 + int(-(-prompt_lens // page_size).sum()))
    if work == "prefix":
        return {
            "bytes": traffic.prompt_kv + traffic.q + state + prompt_metadata,
            "flops": int(4 * head_dim * heads * beams * int(prompt_lens.sum())),
        }
    if work == "tail":
        return {
            "bytes": (traffic.tail_kv + traffic.new_kv + traffic.q + traffic.out + state
                      + traffic.metadata - prompt_metadata),
            "flops": int(4 * head_dim * heads * beams * int(_per_request(tail, prompt_lens).sum())),
        }
    raise ValueError(f"work={work!r}; use 'full', 'prefix' or 'tail'.")
