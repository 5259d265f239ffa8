"""A slot-by-slot oracle of one decode step's K/V safety, and random small steps to hold check mode to it.

Independent of ``beam_shared_prefix.check`` (plain Python loops over positions): every position a step reads or
writes is mapped to its physical slot, and a slot may hold one logical token. A token is ``(request, owner,
position)``: the owner is ``"P"`` for a prompt position, which every beam of the request reads through the plan's
pages, or the beam whose pages hold a generated position. Exact copies of a request (a padded CUDA-graph batch repeats
its dummy: the same prompt, pages, lengths and table entries over every column a beam uses) count as one request.
Two requests may share a slot only where neither writes it and one reads it as a prompt token (block reuse).

Two models: ``"now"``, the slots this step touches under its ``cache_indirection``; ``"later"``, what the table
commits to: every beam's generated positions to the end of its write page (any later indirection may read them,
later steps fill the page). Check mode judges the pages rows hold, so it must refuse exactly the ``"later"``-unsafe
steps.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import List, Optional

import torch
from hypothesis import strategies as st

from beam_shared_prefix.check import BeamSharedPrefixCheckError, check_indices
from beam_shared_prefix.plan import build_step_plan


def _cdiv(a, b):
    return -(-a // b)


@dataclass
class Step:
    """One step: ``page_size``, a pool of ``num_pages``, ``W`` beams; per request its prompt length and the page
    list handed to the planner (beam 0's, possibly longer than the prompt); per row its table and ``kv_len``;
    ``indirection[r][b][t]``, the beam whose pages hold position ``t`` of beam ``b``."""

    page_size: int
    num_pages: int
    W: int
    prompt_lens: List[int]
    listed: List[List[int]]
    table: List[List[int]]
    kv_lens: List[int]
    indirection: List[List[List[int]]]

    def plan_pages(self):
        return [pages[:_cdiv(p, self.page_size)] for pages, p in zip(self.listed, self.prompt_lens)]

    def plan(self):
        indptr = [0]
        for pages in self.listed:
            indptr.append(indptr[-1] + len(pages))
        return build_step_plan(indptr, [p for pages in self.listed for p in pages], self.prompt_lens, self.W,
                               self.page_size, self.num_pages)

    def check_mode(self, plan) -> Optional[str]:
        """``None`` when :func:`check_indices` passes the step, else its refusal."""
        try:
            check_indices(plan, torch.zeros(self.num_pages, 1), self.page_size, torch.tensor(self.table, dtype=torch.int32),
                          torch.tensor(self.kv_lens, dtype=torch.int32), torch.tensor(self.indirection, dtype=torch.int32))
        except BeamSharedPrefixCheckError as exc:
            return str(exc)
        return None


def _columns_used(page_size, prompt_len, kv_len, beam):
    return range(0 if beam == 0 else prompt_len // page_size, _cdiv(kv_len, page_size))


def _copy_classes(step: Step) -> List[int]:
    seen, canon = {}, []
    for r, (p, pages) in enumerate(zip(step.prompt_lens, step.plan_pages())):
        kv = step.kv_lens[r * step.W]
        rows = tuple(tuple(step.table[r * step.W + b][c] for c in _columns_used(step.page_size, p, kv, b))
                     for b in range(step.W))
        canon.append(seen.setdefault((p, tuple(pages), tuple(step.kv_lens[r * step.W:(r + 1) * step.W]), rows), r))
    return canon


def unsafe(step: Step, model: str) -> Optional[str]:
    """Why the step is unsafe under ``model`` (``"now"`` or ``"later"``), or ``None``."""
    ps, W = step.page_size, step.W
    for r, pages in enumerate(step.plan_pages()):
        if step.table[r * W][:len(pages)] != list(pages):
            return f"request {r}: beam 0's prompt columns are not the plan's pages"
    canon = _copy_classes(step)
    slots = defaultdict(dict)  # (page, slot) -> {token: written}
    pages_touched = []

    def touch(page, t, token, written):
        pages_touched.append(page)
        tokens = slots[(page, t % ps)]
        tokens[token] = tokens.get(token, False) or written

    for r, pages in enumerate(step.plan_pages()):
        p, kv, c = step.prompt_lens[r], step.kv_lens[r * W], canon[r]
        for t in range(p):
            touch(pages[t // ps], t, (c, "P", t), False)
        for b in range(W):
            if model == "now":
                for t in range(p, kv - 1):
                    src = step.indirection[r][b][t]
                    touch(step.table[r * W + src][t // ps], t, (c, src, t), False)
                touch(step.table[r * W + b][(kv - 1) // ps], kv - 1, (c, b, kv - 1), True)
            else:
                for t in range(p, _cdiv(kv, ps) * ps):
                    touch(step.table[r * W + b][t // ps], t, (c, b, t), t >= kv - 1)
    if any(not 0 <= page < step.num_pages for page in pages_touched):
        return "a page outside the pool"
    for slot, tokens in slots.items():
        keys = list(tokens)
        for i, x in enumerate(keys):
            for y in keys[i + 1:]:
                if x[0] == y[0] or tokens[x] or tokens[y] or (x[1] != "P" and y[1] != "P"):
                    return f"slot {slot} holds {x} and {y}"
    return None


@st.composite
def steps(draw) -> Step:
    """Small random steps: 1-4 requests of 1-3 beams, each fresh, an exact copy of an earlier one (sometimes with
    junk in a prompt column no row reads), sharing its full prompt pages, sharing its partly filled last page (a new
    tail, another length or page, another prompt length), or continuing its pages (block reuse of generated ones);
    then random page edits."""
    ps, N = draw(st.integers(2, 4)), draw(st.integers(8, 24))
    R, W = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    order = draw(st.permutations(range(N)))
    taken = [0]

    def new_page():
        if taken[0] < N:
            taken[0] += 1
            return order[taken[0] - 1]
        return draw(st.integers(0, N - 1))  # the pool is spent: a collision

    def rows_for(p, kv, prompt_pages):
        beam0 = list(prompt_pages) + [new_page() for _ in range(_cdiv(kv, ps) - len(prompt_pages))]
        return [beam0] + [[beam0[c] if c < p // ps else new_page() for c in range(len(beam0))] for _ in range(1, W)]

    reqs = []
    for r in range(R):
        kind = "fresh" if r == 0 else draw(st.sampled_from(["fresh", "copy", "copy", "full", "partial", "continue"]))
        src = reqs[draw(st.integers(0, r - 1))] if r else None
        if (kind == "full" and src["p"] < ps) or (kind == "partial" and src["p"] % ps == 0):
            kind = "fresh"
        if kind == "fresh":
            p = draw(st.integers(1, 10))
            kv = p + draw(st.integers(1, 6))
            rows = rows_for(p, kv, [new_page() for _ in range(_cdiv(p, ps))])
        elif kind == "copy":
            p, kv, rows = src["p"], src["kv"], [list(x) for x in src["rows"]]
            if W > 1 and p >= ps and draw(st.booleans()):
                rows[draw(st.integers(1, W - 1))][draw(st.integers(0, p // ps - 1))] = draw(st.sampled_from([-1, N]))
        elif kind == "full":
            k = draw(st.integers(1, src["p"] // ps))
            p = draw(st.integers(k * ps, max(k * ps, 10)))
            kv = p + draw(st.integers(1, 6))
            rows = rows_for(p, kv, src["rows"][0][:k] + [new_page() for _ in range(_cdiv(p, ps) - k)])
        elif kind == "partial":
            n = _cdiv(src["p"], ps)
            p = draw(st.integers((n - 1) * ps + 1, n * ps))
            kv = p + draw(st.integers(1, 6))
            if p == src["p"] and draw(st.booleans()):  # the same prompt, then one change
                kv, rows = src["kv"], [list(x) for x in src["rows"]]
                b = draw(st.integers(0, W - 1))
                cols = [c for c in range(p // ps if b else n, len(rows[b]))]
                if cols:
                    rows[b][draw(st.sampled_from(cols))] = new_page()
                else:
                    kv += ps
                    rows = [x + [new_page() for _ in range(_cdiv(kv, ps) - len(x))] for x in rows]
            else:
                rows = rows_for(p, kv, src["rows"][0][:n])
        else:  # continue: a prompt reading src's beam-0 pages, generated ones included
            k = draw(st.integers(1, len(src["rows"][0])))
            p = draw(st.integers((k - 1) * ps + 1, k * ps + 4))
            kv = p + draw(st.integers(1, 6))
            rows = rows_for(p, kv, src["rows"][0][:k] + [new_page() for _ in range(_cdiv(p, ps) - k)])
        listed = list(rows[0]) if draw(st.booleans()) else rows[0][:_cdiv(p, ps)]
        reqs.append(dict(p=p, kv=kv, rows=rows, listed=listed))
    cols = max(len(x) for q in reqs for x in q["rows"]) + draw(st.integers(0, 1))
    pad = draw(st.sampled_from([-1, 0, 1 << 30]))
    table = [row + [pad] * (cols - len(row)) for q in reqs for row in q["rows"]]
    mode = draw(st.sampled_from(["zero", "self", "random"]))
    indirection = [[[(0 if mode == "zero" else b if mode == "self" else draw(st.integers(0, W - 1)))
                     if q["p"] <= t < q["kv"] - 1 else 0 for t in range(cols * ps)] for b in range(W)] for q in reqs]
    used = sorted({p for row in table for p in row if 0 <= p < N})
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        i, c = draw(st.integers(0, R * W - 1)), draw(st.integers(0, cols - 1))
        table[i][c] = draw(st.one_of(st.sampled_from(used), st.integers(0, N - 1), st.sampled_from([-1, N])))
    return Step(ps, N, W, [q["p"] for q in reqs], [q["listed"] for q in reqs], table, [q["kv"] for q in reqs for _ in
                                                                                      range(W)], indirection)
