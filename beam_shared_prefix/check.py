"""Check mode: synchronise after each stage, validate indices, recompute against the float32 oracle.

Switched on by ``BeamSharedPrefixAttention(check=True)`` or ``TLLM_BEAM_SHARED_PREFIX_CHECK=1``. It
turns the silent failure modes of paged beam attention (a page index past the pool, an indirection
entry naming a beam that does not exist, a kernel that wrote the wrong rows, a NaN) into a
:class:`BeamSharedPrefixCheckError` naming the stage:

- ``"plan"``: a plan found under a caller's composition key was planned from the same prompt pages and
  lengths as this call's (the promise a key makes, which the planner takes on trust);
- ``"indices"``: the plan's prompt pages and the used entries of ``beam_page_table`` lie in the
  pool, and beam 0's prompt columns of the table are the plan's prompt pages; ``kv_lens`` follow
  the prompts and fit the cache; this step's K/V write lands on no prompt page (but beam 0's partly
  filled last one) and no slot another row writes, and each row holds its pages from its prompt's partly
  filled page on alone, at one column, none of them a prompt page of its request (no slot stands for two
  positions of a request);
  ``cache_indirection`` entries of the earlier generated positions are beams in ``[0, W)``;
- ``"prefix"``: the prefix backend's output and LSE are finite and match
  :func:`~beam_shared_prefix.reference.reference_prefix_attention`;
- ``"tail"``: the final output is finite and matches
  :func:`~beam_shared_prefix.reference.reference_beam_attention` computed before the tail kernel ran,
  and the tail kernel stored this step's K/V at ``kv_len - 1`` of each row's own page.

TensorRT-LLM's warm-up layouts (:class:`WarmupRows`) pass, as the kernels' device rules let them: padding
rows are not judged, and on a CUDA-graph wrapper a warm-up request whose beams share their write slot is
judged as one write.

Every check synchronises the device and copies to the host: debugging only, never on by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from .kv_lens import kv_capacity, kv_lens_problem, padding_rows
from .plan import StepPlan, build_step_plan, first_copies
from .prefix.base import LseDescriptor, kv_planes
from .reference import reference_beam_attention, reference_prefix_attention

__all__ = [
    "BeamSharedPrefixCheckError",
    "CheckTolerance",
    "default_tolerance",
    "check_plan_inputs",
    "check_indices",
    "check_prefix_stage",
    "expected_output",
    "check_output_stage",
    "check_kv_write",
    "WarmupRows",
    "warmup_rows",
]


class BeamSharedPrefixCheckError(RuntimeError):
    """Check mode found a bad index, a non-finite value or a mismatch; :attr:`stage` names the stage."""

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"beam_shared_prefix check mode, stage '{stage}': {message}")


@dataclass(frozen=True)
class CheckTolerance:
    """``|got - want| <= atol + rtol * |want|`` for outputs; ``lse_atol + lse_rtol * |want|`` for base-2 LSEs."""

    atol: float
    rtol: float
    lse_atol: float
    lse_rtol: float


def default_tolerance(dtype: torch.dtype) -> CheckTolerance:
    """Tolerances covering two roundings to ``dtype`` (prefix output, then the merged output)."""
    if dtype == torch.bfloat16:
        return CheckTolerance(atol=2e-2, rtol=2e-2, lse_atol=2e-2, lse_rtol=2e-3)
    if dtype == torch.float16:
        return CheckTolerance(atol=5e-3, rtol=5e-3, lse_atol=1e-2, lse_rtol=1e-3)
    return CheckTolerance(atol=1e-4, rtol=1e-4, lse_atol=1e-4, lse_rtol=1e-5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _require_finite(stage: str, what: str, x: torch.Tensor, allow_neg_inf: bool = False) -> None:
    bad = torch.isnan(x) | torch.isposinf(x)
    if not allow_neg_inf:
        bad |= torch.isneginf(x)
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise BeamSharedPrefixCheckError(
            stage, f"{what} holds a non-finite value {float(x[idx])} at index {idx} "
                   f"({int(bad.sum())} non-finite of {x.numel()}); look for an unwritten buffer or a bad page."
        )


def _compare(stage: str, what: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    got = got.float()
    want = want.float().to(got.device)
    err = (got - want).abs()
    excess = err - (atol + rtol * want.abs())
    if (excess > 0).any():
        idx = tuple(int(i) for i in torch.nonzero(excess == excess.max())[0])
        raise BeamSharedPrefixCheckError(
            stage, f"{what} differs from the float32 oracle: max |error| {float(err.max()):.4g}; worst at index "
                   f"{idx}: got {float(got[idx]):.6g}, expected {float(want[idx]):.6g} (tolerance {atol:g} + "
                   f"{rtol:g} * |expected|); {int((excess > 0).sum())} of {err.numel()} elements out of tolerance."
        )


class WarmupRows(NamedTuple):
    """Rows of TensorRT-LLM's warm-up and CUDA-graph padding layouts, bool ``[rows]`` each (host tensors).

    ``padding``: no prompt and one token (``kv_len`` 1), planned with a one-token prompt; the kernels
    write and report nothing for them (:func:`triton_kernels.device_errors.kv_len_bad`), and their output
    is never read. A real row has a prompt and its token (``kv_len >= 2``); one of a one-token prompt
    whose ``kv_len`` is 1 by mistake looks the same, and is not judged either (as on the device).

    ``shared_block``: every beam of a request at its first generated token, in the last slot of a page
    all its beams share: the CUDA-graph warm-up's dummy requests are all context to the KV cache (``n``
    tokens, ``prompt_len = n - 1``), and with block reuse off the manager shares a full last context
    block among the beams, so each beam writes this step's K/V into one slot (which of them lands is a
    race, per element; the step is a dummy). A real request whose table shares the prompt's partly
    filled last page among its beams (each beam must own a copy) looks the same at that one step, when
    its prompt is one token short of a whole page; so this layout is taken as the warm-up only on a
    CUDA-graph wrapper, whose calls past the warm-up replay a graph and are never checked."""

    padding: torch.Tensor
    shared_block: torch.Tensor
    beam_width: int


def warmup_rows(step_plan: StepPlan, pages: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                shared_blocks: bool) -> WarmupRows:
    """:class:`WarmupRows` of a step: ``pages`` int64 ``[rows, >= cols]`` (the page table over
    ``page_index_divisor``, host), ``kv_lens`` int64 ``[rows]`` (host); ``shared_blocks``: whether the
    warm-up's shared blocks can occur (a CUDA-graph wrapper); ``shared_block`` is all false otherwise."""
    W, rows = step_plan.beam_width, step_plan.num_rows
    plen = torch.from_numpy(step_plan.prompt_lens_per_row.astype("int64"))
    klen = kv_lens[:rows]
    padding = padding_rows(klen, plen)
    pos = (klen - 1).clamp(min=0)
    write_page = pages[torch.arange(rows), pos // page_size]
    first_token_last_slot = ((klen == plen + 1) & (pos % page_size == page_size - 1)).view(-1, W)
    write_page = write_page.view(-1, W)
    shared = first_token_last_slot.all(1) & (write_page == write_page[:, :1]).all(1)
    shared_block = (shared & (W > 1) & shared_blocks)[:, None].expand(-1, W).reshape(-1)
    return WarmupRows(padding, shared_block, W)


def _zero_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` (float, rows first) with ``rows`` (bool ``[rows]``) zeroed: rows a stage does not judge."""
    if rows is None or not bool(rows.any()):
        return x
    keep = ~rows.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x.float(), 0.0)


def check_plan_inputs(step_plan: StepPlan, prompt_page_indptr, prompt_page_indices, prompt_lens,
                      request_ids=None) -> None:
    """Stage ``"plan"``: ``step_plan``, found under a caller's key, holds the prompt pages and lengths these
    inputs give (host only; builds the plan again without caching it, judging ``request_ids`` too).

    Args:
        step_plan: the plan the key found.
        prompt_page_indptr, prompt_page_indices, prompt_lens, request_ids: this call's ``plan()`` arguments.
    """
    fresh = build_step_plan(prompt_page_indptr, prompt_page_indices, prompt_lens, step_plan.beam_width,
                            step_plan.page_size, step_plan.num_cache_pages, request_ids=request_ids)
    why = f"equal keys must mean equal inputs: put what changed into the key, or pass key=None (key={step_plan.key!r})"
    if fresh.num_requests != step_plan.num_requests:
        raise BeamSharedPrefixCheckError(
            "plan", f"the key's plan has {step_plan.num_requests} requests, this call {fresh.num_requests}; {why}.")
    if not (step_plan.kv_page_indptr == fresh.kv_page_indptr).all():
        r = int(np.argmax(step_plan.kv_pages_per_request != fresh.kv_pages_per_request))
        raise BeamSharedPrefixCheckError(
            "plan", f"request {r} has {int(step_plan.kv_pages_per_request[r])} prompt pages in the key's plan, "
                    f"{int(fresh.kv_pages_per_request[r])} in this call; {why}.")
    for name, what in (("prompt_lens", "prompt length"), ("kv_page_indices", "prompt page")):
        planned, given = getattr(step_plan, name), getattr(fresh, name)
        differ = np.flatnonzero(planned != given)
        if differ.size:
            i = int(differ[0])
            where = f"request {i}" if name == "prompt_lens" else \
                f"request {int(np.searchsorted(fresh.kv_page_indptr, i, side='right')) - 1}, flat index {i}"
            raise BeamSharedPrefixCheckError(
                "plan", f"{what} of {where}: {int(planned[i])} in the key's plan, {int(given[i])} in this call "
                        f"({differ.size} differ); {why}.")


def check_indices(
    step_plan: StepPlan,
    kv_cache: torch.Tensor,
    page_size: int,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    cache_indirection: torch.Tensor,
    page_index_divisor: int = 1,
    warmup_shared_blocks: bool = False,
) -> WarmupRows:
    """Stage ``"indices"``: every page and beam index the step will use is valid (host copies, one sync).

    Args:
        step_plan: the active plan (prompt pages per request, prompt length per row).
        kv_cache: the pool (its dim 0 is the page count).
        page_size: tokens per page.
        beam_page_table, kv_lens, cache_indirection, page_index_divisor: ``run()``'s arguments.
        warmup_shared_blocks: take beams that share a full block's last slot at their first generated
            token as the CUDA-graph warm-up (:class:`WarmupRows`); only a CUDA-graph wrapper sets it.

    Returns:
        The step's :class:`WarmupRows`, which the later stages do not judge as real rows.
    """
    stage = "indices"
    _sync(kv_cache.device)
    num_pages = kv_cache.shape[0]
    W, rows = step_plan.beam_width, step_plan.num_rows
    prompt_pages = torch.from_numpy(step_plan.kv_page_indices.astype("int64"))
    if prompt_pages.numel() and int(prompt_pages.max()) >= num_pages:
        j = int(torch.argmax(prompt_pages))
        raise BeamSharedPrefixCheckError(
            stage, f"the plan's prompt page {int(prompt_pages[j])} (flat index {j}) is outside the pool of "
                   f"{num_pages} pages: the plan was made for a larger pool (num_cache_pages="
                   f"{step_plan.num_cache_pages}); re-plan against the current KV cache."
        )
    plen = torch.from_numpy(step_plan.prompt_lens_per_row.astype("int64"))
    klen = kv_lens[:rows].long().cpu()
    max_seq_len = kv_capacity(beam_page_table.shape[1], page_size, cache_indirection.shape[2])
    least = torch.where(padding_rows(klen, plen), 1, plen + 1)  # (WarmupRows)
    problem = kv_lens_problem(klen.numpy(), W, max_seq_len, least=least.numpy())
    if problem is not None:
        i, value = problem.row, problem.value
        if problem.kind == "too_short":
            raise BeamSharedPrefixCheckError(
                stage, f"kv_lens[{i}]={value} but the plan's prompt length of row {i} is {problem.limit - 1}: "
                       f"kv_len must count the prompt and this step's token (>= {problem.limit}). Re-plan when "
                       f"the batch changes."
            )
        if problem.kind == "too_long":
            raise BeamSharedPrefixCheckError(
                stage, f"kv_lens[{i}]={value} exceeds the cache capacity of {max_seq_len} positions "
                       f"(cache_indirection / beam_page_table); the sequence outgrew its cache."
            )
        r, b = divmod(i, W)
        raise BeamSharedPrefixCheckError(
            stage, f"kv_lens[{i}]={value} (request {r}, beam {b}) differs from beam 0's kv_lens[{r * W}]="
                   f"{problem.limit}: the beams of a request advance together, and a beam that reads another's "
                   f"position past that beam's length reads a slot being written in this step. Pass one length per "
                   f"request, repeated for each of its beams."
        )
    table = beam_page_table[:rows].long().cpu()
    cols = math.ceil(int(klen.max()) / page_size)
    # The columns the step reads: beam 0's prompt columns (the plan's pages, compared below) and every
    # row's generated columns (the tail's source beams and the write); other beams' prompt columns are
    # never read.
    col = torch.arange(cols)[None, :]
    beam0 = (torch.arange(rows) % W == 0)[:, None]
    used = (col < ((klen + page_size - 1) // page_size)[:, None]) & (beam0 | (col >= (plen // page_size)[:, None]))
    pages = table[:, :cols] // page_index_divisor
    bad = used & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        i, c = (int(v) for v in torch.nonzero(bad)[0])
        raise BeamSharedPrefixCheckError(
            stage, f"beam_page_table[{i}, {c}]={int(table[i, c])} // page_index_divisor={page_index_divisor} = page "
                   f"{int(pages[i, c])}, outside the pool [0, {num_pages}); the page table is stale, belongs to "
                   f"another pool, or page_index_divisor is wrong."
        )
    # The plan's prompt pages are beam 0's. A table in another encoding (a wrong page_index_divisor), a
    # plan from an earlier batch or another pool's table can keep every page inside the pool; this
    # catches them, since the prefix reads the plan's pages and the tail and the KV write the table's.
    indptr = step_plan.kv_page_indptr
    for r in range(step_plan.num_requests):
        want = prompt_pages[int(indptr[r]):int(indptr[r + 1])]
        got = pages[r * W, : want.numel()]
        differ = torch.nonzero(got != want).flatten()
        if differ.numel():
            c = int(differ[0])
            raise BeamSharedPrefixCheckError(
                stage, f"beam_page_table[{r * W}, {c}]={int(table[r * W, c])} // page_index_divisor={page_index_divisor} "
                       f"= page {int(got[c])}, but the plan's prompt page {c} of request {r} is {int(want[c])}: the "
                       f"plan belongs to another batch (re-plan), or page_index_divisor is wrong for this table."
            )
    warm = warmup_rows(step_plan, pages, klen, page_size, warmup_shared_blocks)
    _check_write_slots(step_plan, table, pages, klen, page_size, page_index_divisor, warm)
    earlier = klen - 1 - plen
    if int(earlier.max()) > 0:
        ind = cache_indirection.cpu()
        t = plen[:, None] + torch.arange(int(earlier.max()))[None, :]
        valid = t < (klen - 1)[:, None]
        t = torch.where(valid, t, torch.zeros_like(t))
        row = torch.arange(rows)
        src = ind[(row // W)[:, None], (row % W)[:, None], t].long()
        bad = valid & ((src < 0) | (src >= W))
        if bad.any():
            i, j = (int(v) for v in torch.nonzero(bad)[0])
            raise BeamSharedPrefixCheckError(
                stage, f"cache_indirection[{i // W}, {i % W}, {int(t[i, j])}]={int(src[i, j])} is not a beam in "
                       f"[0, beam_width={W}); pass the batch's cache_indirection for this beam width."
            )
    return warm


def _beam0_partial_prompt_column(step_plan: StepPlan, rows: torch.Tensor, cols: torch.Tensor,
                                 page_size: int) -> torch.Tensor:
    """Whether each ``(rows, cols)`` entry (int64, same shape) is beam 0's column of its prompt's partly filled last
    page: the one prompt page beam 0 keeps writing (bool, host)."""
    req = rows // step_plan.beam_width
    indptr = torch.from_numpy(step_plan.kv_page_indptr.astype("int64"))
    partial = torch.from_numpy(step_plan.kv_last_page_len.astype("int64"))[req] < page_size
    return (rows % step_plan.beam_width == 0) & partial & (cols == indptr[1:][req] - indptr[:-1][req] - 1)


def _check_write_slots(step_plan: StepPlan, table: torch.Tensor, pages: torch.Tensor, klen: torch.Tensor,
                       page_size: int, page_index_divisor: int, warm: WarmupRows) -> None:
    """This step's K/V write may land neither on a prompt page (but beam 0's own partial last one, which
    it fills) nor on a slot another row writes: either would overwrite K/V other rows read, in this
    step and every later one, and no check of the output would see it (the oracle reads the same pool).
    Padding rows write nothing; a warm-up request's beams that share their block write one slot, judged
    as beam 0's write alone (``warm``)."""
    stage = "indices"
    W = step_plan.beam_width
    row = torch.arange(step_plan.num_rows)
    pos = klen - 1
    col = pos // page_size
    write_page = pages[row, col]
    prompt_pages = torch.from_numpy(step_plan.kv_page_indices.astype("int64"))
    req = row // W
    indptr = torch.from_numpy(step_plan.kv_page_indptr.astype("int64"))
    own_last = prompt_pages[indptr[1:] - 1][req]
    not_judged = warm.padding | (warm.shared_block & (row % W != 0))
    # Copies of one request (a padded CUDA-graph batch repeats its dummy request) write the same slots: the
    # first copy's rows stand for all of them.
    first = _copies_of_one_request(step_plan, table, pages, klen, page_size, ~not_judged)
    # Beam 0 fills its prompt's partly filled last page, unless another request (no copy of it) lists that page as
    # a prompt page: then the write lands on K/V that request reads (the planner lets a one-beam request's page be
    # another's prompt page: block reuse of a page it filled earlier, which it no longer writes).
    prompt_req = torch.repeat_interleave(torch.arange(step_plan.num_requests), indptr[1:] - indptr[:-1])
    bound = int(torch.cat([write_page, prompt_pages]).max()) + 1
    listers = torch.unique(prompt_pages * step_plan.num_requests + first[prompt_req]) // step_plan.num_requests
    listed_elsewhere = torch.bincount(listers, minlength=bound)[write_page] > 1
    fills_own_last = ((write_page == own_last) & _beam0_partial_prompt_column(step_plan, row, col, page_size)
                      & ~listed_elsewhere)
    on_prompt = torch.isin(write_page, prompt_pages) & ~fills_own_last & ~not_judged
    if on_prompt.any():
        i = int(torch.nonzero(on_prompt)[0])
        others = torch.nonzero((prompt_pages == write_page[i]) & (first[prompt_req] != first[req[i]])).flatten()
        at = others if others.numel() else torch.nonzero(prompt_pages == write_page[i]).flatten()
        owner = int(prompt_req[at[0]])
        raise BeamSharedPrefixCheckError(
            stage, f"row {i} (request {i // W}, beam {i % W}) writes this step's K/V at position {int(pos[i])} into "
                   f"beam_page_table[{i}, {int(col[i])}]={int(table[i, col[i]])} // page_index_divisor="
                   f"{page_index_divisor} = page {int(write_page[i])}, a prompt page of request {owner}: it would "
                   f"overwrite prompt K/V every beam of that request reads. Each beam writes into its own pages."
        )
    slot = write_page * page_size + pos % page_size
    rows = torch.nonzero((first[req] == req) & ~not_judged).flatten()
    order = rows[torch.argsort(slot[rows], stable=True)]
    same = torch.nonzero(slot[order][1:] == slot[order][:-1]).flatten()
    if same.numel():
        a, b = int(order[same[0]]), int(order[same[0] + 1])
        raise BeamSharedPrefixCheckError(
            stage, f"rows {a} and {b} both write this step's K/V to page {int(write_page[a])}, slot "
                   f"{int(pos[a] % page_size)} (positions {int(pos[a])} and {int(pos[b])}): one would overwrite "
                   f"the other. Each beam writes into its own pages."
        )
    _check_held_pages(step_plan, pages, klen, page_size, rows)


def _copies_of_one_request(step_plan: StepPlan, table: torch.Tensor, pages: torch.Tensor, klen: torch.Tensor,
                           page_size: int, judged: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: for each request, the first request it is an exact copy of (same prompt length and pages,
    the same table entries over every column its judged rows use, the same lengths: a padded batch's copies of
    its dummy), else itself. Only the first copy's rows are judged. Requests that share a partly filled last
    prompt page must all be such copies: two requests given one would write generated tokens into it over each
    other's, so they are refused. Requests that share only full pages (block reuse) and part after them are
    judged row by row. ``judged``: ``[R * W]`` bool, rows that are no padding or warm-up beam."""
    stage = "indices"
    W, R = step_plan.beam_width, step_plan.num_requests
    same_prompt = first_copies(step_plan.kv_page_indices, step_plan.kv_page_indptr, step_plan.prompt_lens)
    if (same_prompt == np.arange(R)).all():
        return torch.from_numpy(same_prompt)
    # The columns a row uses: beam 0 every column to its write column; another beam those from its prompt's last
    # column on (its prompt columns before are never read).
    cols = pages.shape[1]
    row = torch.arange(step_plan.num_rows)
    plen = torch.from_numpy(step_plan.prompt_lens_per_row.astype("int64"))
    start = torch.where(row % W == 0, 0, plen // page_size)
    col = torch.arange(cols)[None, :]
    used = (col >= start[:, None]) & (col < ((klen + page_size - 1) // page_size)[:, None]) & judged[:, None]
    entries = torch.where(used, table[:, :cols], 0)
    signature = torch.cat([torch.where(judged, klen, -1)[:, None], used.long(), entries], 1).reshape(R, -1).numpy()
    partial = step_plan.kv_last_page_len < page_size
    first = np.arange(R)
    exact: dict = {}
    for r in range(R):  # (in order: each class keeps its earliest request)
        first[r] = exact.setdefault((int(same_prompt[r]), signature[r].tobytes()), r)
    for r in np.flatnonzero((same_prompt != np.arange(R)) & partial[same_prompt]):
        g = int(same_prompt[r])
        if first[r] == first[g]:
            continue
        rows_r, rows_g = row[r * W:(r + 1) * W], row[g * W:(g + 1) * W]
        differ = ((klen[rows_r] != klen[rows_g]) | ~(judged[rows_r] == judged[rows_g]))[:, None] | (
            (used[rows_r] | used[rows_g]) & ((entries[rows_r] != entries[rows_g]) | (used[rows_r] != used[rows_g])))
        b, c = (int(v) for v in torch.nonzero(differ)[0])
        i, j = r * W + b, g * W + b
        if int(klen[i]) != int(klen[j]):
            what = f"kv_lens[{i}]={int(klen[i])} where row {j} has {int(klen[j])}"
        else:
            what = f"beam_page_table[{i}, {c}]={int(table[i, c])} where row {j} holds {int(table[j, c])}"
        raise BeamSharedPrefixCheckError(
            stage, f"requests {g} and {r} list the same prompt pages for {int(step_plan.prompt_lens[r])}-token "
                   f"prompts, whose last page {int(step_plan.kv_page_indices[step_plan.kv_page_indptr[r + 1] - 1])} "
                   f"is partly filled, so they are taken as copies of one request (a padded batch repeats its dummy); "
                   f"but {what} (request {r}, beam {b}): two requests would write generated tokens into that page "
                   f"over each other's. Only copies of one request share a partly filled page; re-derive the page "
                   f"table from the KV cache manager."
        )
    return torch.from_numpy(first)


def _check_held_pages(step_plan: StepPlan, pages: torch.Tensor, klen: torch.Tensor, page_size: int,
                      judged_rows: torch.Tensor) -> None:
    """Each judged row (``judged_rows``, int64 row numbers: first copies, warm-up rows left out) holds its pages
    from its prompt's last column (its copy of a partly filled last page; beam 0's is the prompt page itself) to
    its write column: the K/V of its own positions there, which any beam of its request reads through
    ``cache_indirection`` (beams share K/V through it, never through a page). Such a page may be held once, and be
    no prompt page of its request (but beam 0's own partly filled one); a write page no prompt page at all. A
    page held twice, or such a prompt page, would keep two positions' K/V in one slot, so a write into it
    overwrites K/V another position needs, now or at a later step of that page. A full page the row no longer
    writes may be another request's prompt page (block reuse of a beam-width-1 request's generated blocks). A
    write page held elsewhere, the commonest way in, is named first; the write onto a prompt page and one slot
    written twice are judged before."""
    stage = "indices"
    W = step_plan.beam_width
    plen = torch.from_numpy(step_plan.prompt_lens_per_row.astype("int64"))[judged_rows]
    pos = klen[judged_rows] - 1
    col = torch.arange(pages.shape[1])[None, :]
    held = (col >= (plen // page_size)[:, None]) & (col <= (pos // page_size)[:, None])
    held_rows = judged_rows[:, None].expand_as(held)[held]
    held_cols = col.expand_as(held)[held]
    held_pages = pages[held_rows, held_cols]  # (inside the pool: judged above)
    if not held_pages.numel():
        return
    held_pos = (klen - 1)[held_rows]
    is_write = held_cols == held_pos // page_size
    prompt_pages = torch.from_numpy(step_plan.kv_page_indices.astype("int64"))
    indptr = torch.from_numpy(step_plan.kv_page_indptr.astype("int64"))
    twice = torch.bincount(held_pages)[held_pages] > 1
    # A full page a row no longer writes may be another request's prompt page: block reuse stores a beam-width-1
    # request's generated blocks, which later prompts then read. Its own request's prompt page it may not be. (A
    # write page on any prompt page was refused before.)
    pages_bound = int(torch.cat([held_pages, prompt_pages]).max()) + 1
    prompt_req = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr[1:] - indptr[:-1])
    own_prompt = torch.isin((held_rows // W) * pages_bound + held_pages, prompt_req * pages_bound + prompt_pages)
    on_prompt = own_prompt & ~_beam0_partial_prompt_column(step_plan, held_rows, held_cols, page_size)
    bad = twice | on_prompt
    if not bool(bad.any()):
        return
    k = int(torch.nonzero(bad & is_write).flatten()[0]) if bool((bad & is_write).any()) else int(torch.nonzero(bad)[0])
    i, page, c = int(held_rows[k]), int(held_pages[k]), int(held_cols[k])
    if bool(twice[k]):
        other = torch.nonzero((held_pages == page) & ((held_rows != i) | (held_cols != c))).flatten()
        j, cj = int(held_rows[other[0]]), int(held_cols[other[0]])
        whose = f"row {j} (request {j // W}, beam {j % W})" if j != i else "the same row"
        span = f"column {cj} (positions {cj * page_size}-{(cj + 1) * page_size - 1})"
        where, also = f"which {whose} also holds at {span}", f"{whose} also holds it at {span}"
    else:  # (its own request's prompt page: another request's it may read, block reuse sharing it)
        where, also = f"a prompt page of request {i // W}", f"it is a prompt page of request {i // W}"
    fix = ("Each beam holds its own pages from its prompt's partly filled last page on (beam 0 that page itself), "
           "one page a column.")
    if bool(is_write[k]):
        raise BeamSharedPrefixCheckError(
            stage, f"row {i} (request {i // W}, beam {i % W}) writes this step's K/V at position {int(held_pos[k])} "
                   f"into page {page} (its column {c}), {where}: the write would overwrite K/V of another position, "
                   f"which beams read through cache_indirection. {fix}"
        )
    raise BeamSharedPrefixCheckError(
        stage, f"row {i} (request {i // W}, beam {i % W}) holds page {page} at column {c}, past its prompt's full "
               f"pages (its generated positions there, which beams read through cache_indirection), and {also}: one "
               f"slot would hold the K/V of two positions. {fix}"
    )


def check_prefix_stage(
    step_plan: StepPlan,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_layout: str,
    prefix_out: torch.Tensor,
    lse: LseDescriptor,
    sm_scale: float,
    tol: CheckTolerance,
    skip_rows: Optional[torch.Tensor] = None,
) -> None:
    """Stage ``"prefix"``: finite output and LSE, equal to the oracle's prefix attention; rows
    ``skip_rows`` (bool ``[rows]``, :attr:`WarmupRows.padding`: a slot the engine never wrote) not judged.

    ``q`` and ``prefix_out`` are ``[rows, Hq, D]`` (the planned dtype), ``kv_cache`` the ``[pages, 2, ...]`` pool in
    ``kv_layout``, ``lse`` the backend's float32 LSE (:class:`LseDescriptor`: its layout and base), ``sm_scale`` the
    softmax scale, ``tol`` the tolerances of the comparison."""
    stage = "prefix"
    _sync(q.device)
    prefix_out, lse_base2 = _zero_rows(prefix_out, skip_rows), _zero_rows(lse.base2_rows_heads(), skip_rows)
    _require_finite(stage, "the prefix output", prefix_out)
    _require_finite(stage, "the prefix LSE", lse_base2)
    ref_out, ref_lse = reference_prefix_attention(
        q, kv_cache, step_plan.kv_page_indptr, step_plan.kv_page_indices, step_plan.prompt_lens,
        step_plan.beam_width, sm_scale=sm_scale, kv_layout=kv_layout,
    )
    ref_out, ref_lse = _zero_rows(ref_out, skip_rows), _zero_rows(ref_lse, skip_rows)
    _compare(stage, "the prefix output", prefix_out, ref_out, tol.atol, tol.rtol)
    _compare(stage, "the prefix LSE (base 2, [rows, heads])", lse_base2, ref_lse, tol.lse_atol, tol.lse_rtol)


def expected_output(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    prompt_lens_per_row: torch.Tensor,
    cache_indirection: torch.Tensor,
    beam_width: int,
    new_k: Optional[torch.Tensor],
    new_v: Optional[torch.Tensor],
    sm_scale: float,
    kv_layout: str,
    page_index_divisor: int,
) -> torch.Tensor:
    """The oracle's final output, computed before the tail kernel writes the cache (float32 ``[rows, Hq, D]``).

    The arguments are ``run()``'s (``q`` ``[rows, Hq, D]``, the pool, int32 ``beam_page_table [>= rows, max_pages]``,
    ``kv_lens [rows]`` and ``cache_indirection [>= R, W_max, max_seq_len]``, ``new_k``/``new_v`` ``[rows, Hkv, D]``
    or ``None``), with the prompt lengths per row (int ``[rows]``, not per request as ``plan()`` takes them)."""
    _sync(q.device)
    return reference_beam_attention(
        q, kv_cache, beam_page_table, kv_lens, prompt_lens_per_row, cache_indirection, beam_width,
        new_k=new_k, new_v=new_v, sm_scale=sm_scale, kv_layout=kv_layout, page_index_divisor=page_index_divisor,
    )


def check_output_stage(out: torch.Tensor, expected: torch.Tensor, tol: CheckTolerance,
                       skip_rows: Optional[torch.Tensor] = None) -> None:
    """Stage ``"tail"``: the merged output (``[rows, Hq, D]``, the planned dtype) is finite and equals the oracle's
    (float32 ``[rows, Hq, D]``, :func:`expected_output`); rows ``skip_rows`` (bool ``[rows]``,
    :attr:`WarmupRows.padding`, whose output the engine never reads) not judged."""
    _sync(out.device)
    out, expected = _zero_rows(out, skip_rows), _zero_rows(expected, skip_rows)
    _require_finite("tail", "the attention output", out)
    _compare("tail", "the attention output", out, expected, tol.atol, tol.rtol)


def check_kv_write(
    kv_cache: torch.Tensor,
    kv_layout: str,
    page_size: int,
    beam_page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    page_index_divisor: int,
    warm: Optional[WarmupRows] = None,
) -> None:
    """Stage ``"tail"``: ``new_k``/``new_v`` sit at ``kv_len - 1`` of each row's own page. With ``warm``
    (:func:`check_indices`' result), padding rows are not judged (nothing is written for them), and each
    element of the slot a warm-up request's beams share must be one of those beams'. The tensors are ``run()``'s:
    the pool in ``kv_layout``, int32 ``beam_page_table [>= rows, max_pages]`` and ``kv_lens [rows]``, and
    ``new_k``/``new_v`` ``[rows, Hkv, D]`` in the pool's dtype."""
    _sync(kv_cache.device)
    rows = new_k.shape[0]
    pos = kv_lens[:rows].long() - 1
    page = beam_page_table[:rows].long().gather(1, (pos // page_size)[:, None]).squeeze(1) // page_index_divisor
    slot = pos % page_size
    for plane, (name, want) in zip(kv_planes(kv_cache, kv_layout), (("K", new_k), ("V", new_v))):
        got = plane[page, slot]
        wrong = (got != want).flatten(1).any(1).cpu()
        if warm is not None and bool(wrong.any()):
            wrong &= ~warm.padding
            # The beams' stores race per element (programs per head, lanes within one store): each
            # element must be one of the beams'.
            for i in torch.nonzero(wrong & warm.shared_block).flatten().tolist():
                first = i - i % warm.beam_width
                beams = want[first:first + warm.beam_width]
                wrong[i] = not bool((beams == got[i][None]).any(0).all())
        if bool(wrong.any()):
            row = int(torch.nonzero(wrong)[0])
            shared = warm is not None and bool(warm.shared_block[row])
            raise BeamSharedPrefixCheckError(
                "tail", f"this step's {name} of row {row} was not stored at position kv_len - 1 = {int(pos[row])} "
                        f"(page {int(page[row])}, slot {int(slot[row])}) of "
                        + ("the page its request's beams share, by any of its beams." if shared
                           else "the row's own page.")
            )
