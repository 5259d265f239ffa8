"""Before an arm is timed, its output is compared with the float32 oracle.

The oracle (:mod:`beam_shared_prefix.reference`) is dense attention of each beam over its own
gathered history. For big shapes it runs on a subset of whole requests (all of their beams, so the
sub-batch keeps the request-major layout): the first and the last request and a few drawn at random.

Metric: ``rel_err = max |out - ref| / max |ref|`` over the checked rows, in float32; an arm passes
when every checked element is finite and ``rel_err <= tol`` (2e-2 for bf16, 4e-3 for fp16: a few
units in the last place of the dtype, the tolerance TensorRT-LLM's beam prefix check mode uses).
A prefix-only arm is compared on its output and on its base-2 LSE (absolute error <= 2e-2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .workload import BenchWorkload, select_requests

__all__ = ["CheckResult", "Oracle", "pick_check_requests", "compare", "merge_results", "OUT_TOL", "LSE_TOL"]

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
    """Float32 reference results of one workload on a subset of requests, computed lazily once."""

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
    elif rel > tol:
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
