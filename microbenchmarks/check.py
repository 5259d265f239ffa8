"""Before an arm is timed, its output is compared with the float32 oracle.

The oracle (:mod:`beam_shared_prefix.reference`) is dense attention of each beam over its own
gathered history. For big shapes it runs on a subset of whole requests (all of their beams, so the
sub-batch keeps the request-major layout): the first and the last request and a few drawn at random.

Metric: ``rel_err = max |out - ref| / max |ref|`` over the checked rows, in float32; an arm passes
when every checked element is finite and ``rel_err <= tol`` (2e-2 for bf16, 4e-3 for fp16: a few
units in the last place of the dtype, the tolerance TensorRT-LLM's beam prefix check mode uses).
A prefix-only arm is compared on its output and on its base-2 LSE (absolute error <= 2e-2).

Besides the checked rows, every element of the output must be finite (it was poisoned with NaN),
and the KV pool may change only where the step writes: an arm that writes this step's K/V must
store ``new_k``/``new_v`` at ``kv_len - 1`` of each row's own page (those slots hold a sentinel
before its check call and are restored after it), and no arm may change any other slot (a per-slot
fingerprint taken before the arm ran). A pool an arm wrote outside those slots is rebuilt before
the next arm runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .workload import BenchWorkload, select_requests

__all__ = ["CheckResult", "Oracle", "pick_check_requests", "compare", "merge_results", "OUT_TOL", "LSE_TOL",
           "slot_fingerprint", "write_slots", "set_write_slots", "stray_writes", "pool_write_problem"]

OUT_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-2


@dataclass
class CheckResult:
    """One arm's output checked against the float32 oracle: errors are absolute, in output units;
    ``rel_err = max_abs_err / ref_max_abs`` is compared with ``tol``; ``nonfinite`` counts NaN/inf outputs
    (a poisoned element left unwritten)."""

    ok: bool
    rel_err: float
    max_abs_err: float
    ref_max_abs: float
    tol: float
    rows_checked: int
    nonfinite: int
    lse_max_abs_err: Optional[float] = None
    message: str = ""

    def to_dict(self) -> Dict:
        """JSON-ready dict of the fields (used in the results document)."""
        return asdict(self)


def pick_check_requests(num_requests: int, max_requests: int, seed: int = 0) -> List[int]:
    """First, last and random requests, at most ``max_requests`` (all when the batch is small)."""
    if num_requests <= max_requests:
        return list(range(num_requests))
    picks = {0, num_requests - 1}
    rng = np.random.default_rng(seed + 7919)
    middle = rng.permutation(np.arange(1, num_requests - 1))
    for r in middle:
        if len(picks) >= max_requests:
            break
        picks.add(int(r))
    return sorted(picks)


class Oracle:
    """Float32 reference results of one workload on a subset of requests, computed once.

    :func:`precompute` runs before any arm touches the workload (``runner.run_point``): an arm that
    writes into the wrong slots must not corrupt the reference it is checked against."""

    def __init__(self, wl: BenchWorkload, max_requests: int = 4):
        self.wl = wl
        self.requests = pick_check_requests(wl.num_requests, max_requests, wl.seed)
        self.sub = select_requests(wl, self.requests)
        self._full = None
        self._prefix = None

    @property
    def rows(self) -> torch.Tensor:
        """Beam rows (int64, ``[n]``) of the checked requests in the full batch."""
        return self.sub["rows"]

    def precompute(self) -> None:
        """Compute both references now, from the untouched workload."""
        self.full()
        self.prefix()

    def full(self) -> torch.Tensor:
        """``[n, Hq, D]`` float32: attention over prompt + tail with this step's K/V from new_k/new_v."""
        if self._full is None:
            from beam_shared_prefix.reference import reference_beam_attention

            s = self.sub
            self._full = reference_beam_attention(
                s["q"], self.wl.kv_cache, s["beam_page_table"], s["kv_lens"], s["prompt_lens"],
                s["cache_indirection"], self.wl.beam_width, new_k=s["new_k"], new_v=s["new_v"],
                kv_layout=self.wl.kv_layout,
            )
        return self._full

    def prefix(self):
        """``(out [n, Hq, D], lse_base2 [n, Hq])`` float32 over the prompts only."""
        if self._prefix is None:
            from beam_shared_prefix.reference import reference_prefix_attention

            s = self.sub
            self._prefix = reference_prefix_attention(
                s["q"], self.wl.kv_cache, s["prompt_page_indptr"], s["prompt_page_indices"],
                s["prompt_lens_per_request"], self.wl.beam_width, kv_layout=self.wl.kv_layout,
            )
        return self._prefix


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, lse: Optional[torch.Tensor] = None,
            lse_ref: Optional[torch.Tensor] = None) -> CheckResult:
    """Compare ``out`` (rows already selected) with ``ref``; see the module docstring for the metric."""
    out_f = out.float()
    ref_f = ref.float().to(out_f.device)
    finite = torch.isfinite(out_f)
    nonfinite = int((~finite).sum())
    diff = (out_f - ref_f).abs()
    max_abs = float(diff.max()) if nonfinite == 0 else float("inf")
    ref_max = float(ref_f.abs().max())
    rel = max_abs / max(ref_max, 1e-30)
    tol = OUT_TOL.get(dtype, 2e-2)
    ok = nonfinite == 0 and rel <= tol
    lse_err = None
    msg = ""
    if lse is not None and lse_ref is not None:
        lf = lse.float()
        lr = lse_ref.float().to(lf.device)
        lse_err = float((lf - lr).abs().max()) if torch.isfinite(lf).all() else float("inf")
        if not lse_err <= LSE_TOL:
            ok = False
            msg = f"LSE max abs error {lse_err:.3g} > {LSE_TOL}"
    if nonfinite:
        msg = f"{nonfinite} non-finite elements (an unwritten or overflowing output)"
    elif not rel <= tol:  # (also a NaN in the reference: rel is NaN)
        msg = f"relative error {rel:.3g} > tolerance {tol}"
    return CheckResult(
        ok=ok, rel_err=rel, max_abs_err=max_abs, ref_max_abs=ref_max, tol=tol,
        rows_checked=int(out.shape[0]), nonfinite=nonfinite, lse_max_abs_err=lse_err, message=msg,
    )


def merge_results(results: Sequence[CheckResult]) -> CheckResult:
    """The worst of several input sets' checks."""
    worst = max(results, key=lambda r: (not r.ok, r.rel_err))
    return CheckResult(
        ok=all(r.ok for r in results),
        rel_err=max(r.rel_err for r in results),
        max_abs_err=max(r.max_abs_err for r in results),
        ref_max_abs=min(r.ref_max_abs for r in results),
        tol=worst.tol,
        rows_checked=sum(r.rows_checked for r in results),
        nonfinite=sum(r.nonfinite for r in results),
        lse_max_abs_err=None if any(r.lse_max_abs_err is None for r in results) else max(r.lse_max_abs_err for r in results),
        message=worst.message,
    )


def slot_fingerprint(wl: BenchWorkload) -> torch.Tensor:
    """``[num_pages, page_size]`` int64: the sum of each pool slot's K and V bit patterns, all heads (a
    write changes it, short of a collision)."""
    bits = wl.kv_cache.view(torch.int16)
    dims = (1, 2, 4) if wl.kv_layout == "HND" else (1, 3, 4)
    # In chunks of pages: the int64 sum may widen its input first (4x the pool for a whole-pool call).
    per_page = bits[0].numel() if bits.shape[0] else 1
    chunk = max(1, (32 << 20) // per_page)
    return torch.cat([bits[i:i + chunk].sum(dim=dims, dtype=torch.int64) for i in range(0, bits.shape[0], chunk)])


def write_slots(wl: BenchWorkload):
    """``(page, slot, pos)`` (int64 ``[rows]``): where each row's step writes its K/V (``kv_len - 1``)."""
    pg = wl.shape.page_size
    pos = wl.kv_lens.long() - 1
    page = wl.beam_page_table.long().gather(1, (pos // pg)[:, None]).squeeze(1)
    return page, pos % pg, pos


def _slot_index(wl: BenchWorkload, page, slot, which: int) -> tuple:
    """Index of the ``[rows, Hkv, D]`` K (``which`` 0) or V (1) rows at ``(page, slot)`` in the pool."""
    return (page, which, slice(None), slot) if wl.kv_layout == "HND" else (page, which, slot)


def set_write_slots(wl: BenchWorkload, value: Optional[float] = None) -> None:
    """Fill the step's write slots with ``value`` (poison), or with ``new_k``/``new_v`` (``None``: restore)."""
    page, slot, _ = write_slots(wl)
    for which, new in ((0, wl.new_k), (1, wl.new_v)):
        wl.kv_cache[_slot_index(wl, page, slot, which)] = new if value is None else torch.full_like(new, value)


def stray_writes(wl: BenchWorkload, before: torch.Tensor, writes_kv: bool) -> torch.Tensor:
    """``[n, 2]`` (page, slot) of the pool slots changed since ``before`` (:func:`slot_fingerprint`)
    that the step does not write (``kv_len - 1`` of each row's page, when ``writes_kv``)."""
    allowed = torch.zeros_like(before, dtype=torch.bool)
    if writes_kv:
        page, slot, _ = write_slots(wl)
        allowed[page, slot] = True
    return torch.nonzero((slot_fingerprint(wl) != before) & ~allowed)


def pool_write_problem(wl: BenchWorkload, stray: torch.Tensor, writes_kv: bool) -> str:
    """``""`` if the pool holds this step's K/V at each row's write slot (when ``writes_kv``) and no
    other slot changed (``stray``: :func:`stray_writes`); else why not."""
    page, slot, pos = write_slots(wl)
    if stray.numel():
        p, t = (int(v) for v in stray[0])
        return (f"pool slot {t} of page {p} changed ({stray.shape[0]} slots in all), which this step does not "
                f"write: a K/V write to a wrong slot")
    if writes_kv:
        for which, (name, want) in enumerate((("K", wl.new_k), ("V", wl.new_v))):
            got = wl.kv_cache[_slot_index(wl, page, slot, which)]
            if not torch.equal(got, want):
                row = int(torch.nonzero((got != want).flatten(1).any(1))[0])
                return (f"this step's {name} of row {row} is not at kv_len - 1 = {int(pos[row])} (page "
                        f"{int(page[row])}, slot {int(slot[row])}): the KV write is missing or misplaced")
    return ""
