"""The float32 oracle against a naive per-beam loop in float64, over simulated beam-search steps."""

import math
import re

import numpy as np
import pytest
import torch

from beam_shared_prefix.reference import (
    LOG2E,
    merge_states_base2,
    reference_beam_attention,
    reference_prefix_attention,
    reference_tail_attention,
)
from beam_shared_prefix.testing import BeamSearchCacheSimulator

# Request mix: partial last page, block-aligned, one token, several pages; tails cross pages.
PROMPTS = [5, 8, 1, 19]
PAGE = 8


def beam_history(pool, kv_layout, table, ind, r, b, W, P, L, new_k, new_v):
    """Copy beam row r*W+b's full history, position by position, as float64 ``[L, Hkv, D]`` K and V."""
    ks, vs = [], []
    pg = pool.shape[3] if kv_layout == "HND" else pool.shape[2]
    for t in range(L):
        if t == L - 1:  # this step's token: the layer input
            ks.append(new_k[r * W + b])
            vs.append(new_v[r * W + b])
            continue
        src = 0 if t < P else int(ind[r, b, t])  # prompt: beam 0's pages; generated: the indirection
        page = int(table[r * W + src, t // pg])
        if kv_layout == "HND":
            ks.append(pool[page, 0, :, t % pg, :])
            vs.append(pool[page, 1, :, t % pg, :])
        else:
            ks.append(pool[page, 0, t % pg, :, :])
            vs.append(pool[page, 1, t % pg, :, :])
    return np.stack(ks), np.stack(vs)


def naive_attention(q, k, v, scale):
    """Plain softmax attention per query head in float64: q ``[Hq, D]``, k/v ``[T, Hkv, D]``."""
    hq, hkv = q.shape[0], k.shape[1]
    out = np.empty_like(q)
    lse2 = np.empty(hq)
    for h in range(hq):
        kh = h // (hq // hkv)  # query head h reads KV head h // group
        s = k[:, kh, :] @ q[h] * scale
        e = np.exp(s - s.max())
        out[h] = e @ v[:, kh, :] / e.sum()
        lse2[h] = math.log2(np.exp(s).sum())
    return out, lse2


def naive_step(step, pool, kv_layout, span=None):
    """Naive attention of every beam row over ``span(P, L) = (lo, hi)`` of its history (all by default)."""
    f64 = lambda x: x.detach().to(torch.float64).cpu().numpy()  # noqa: E731
    q, pool, new_k, new_v = f64(step.q), f64(pool), f64(step.new_k), f64(step.new_v)
    table, ind = step.beam_page_table.numpy(), step.cache_indirection.numpy()
    W = step.beam_width
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = np.empty_like(q)
    lse = np.empty(q.shape[:2])
    for i in range(step.num_rows):
        r, b = divmod(i, W)
        P, L = int(step.prompt_lens[i]), int(step.kv_lens[i])
        k, v = beam_history(pool, kv_layout, table, ind, r, b, W, P, L, new_k, new_v)
        a, z = (0, L) if span is None else span(P, L)
        out[i], lse[i] = naive_attention(q[i], k[a:z], v[a:z], scale)
    return out, lse


def oracle(step, sim, **kw):
    return reference_beam_attention(
        step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width, new_k=step.new_k, new_v=step.new_v, kv_layout=sim.kv_layout, **kw,
    )


def make_sim(group, head_dim, kv_layout, dtype, beam_width=3, num_kv_heads=2, seed=0, max_seq_len=48, **kw):
    return BeamSearchCacheSimulator(
        PROMPTS, beam_width=beam_width, num_qo_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=PAGE, max_seq_len=max_seq_len, kv_layout=kv_layout, dtype=dtype, seed=seed, **kw,
    )


TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_oracle_equals_naive_per_beam_loop(group, head_dim, kv_layout, dtype):
    sim = make_sim(group, head_dim, kv_layout, dtype, seed=group * 7 + head_dim)
    diverged = False
    for step_no in range(11):  # 11 steps: every request's tail crosses at least one page
        step = sim.begin_step()
        out, lse = oracle(step, sim, return_lse=True)
        want_out, want_lse = naive_step(step, sim.kv_cache, kv_layout)
        np.testing.assert_allclose(out.numpy(), want_out, **TOL)
        np.testing.assert_allclose(lse.numpy(), want_lse, **TOL)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        # The test only means something if beams read other beams' pages: check that some row's
        # history through the indirection differs from reading its own pages only.
        if not diverged and step_no >= 2:
            own = step.cache_indirection.clone()
            own[:, :, :] = torch.arange(step.beam_width, dtype=own.dtype)[None, :, None]
            wrong = reference_beam_attention(
                step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, own, step.beam_width,
                new_k=step.new_k, new_v=step.new_v, kv_layout=kv_layout,
            )
            diverged = not torch.allclose(wrong, out, **TOL)
        sim.end_step()  # random parents: beams reselect every step
    assert diverged


@pytest.mark.parametrize("parents_kind", ["all_parent_0", "reverse"])
def test_oracle_with_deterministic_reselection(parents_kind):
    sim = make_sim(2, 64, "HND", torch.bfloat16, beam_width=4, seed=3)
    for _ in range(9):
        step = sim.begin_step()
        out = oracle(step, sim)
        want, _ = naive_step(step, sim.kv_cache, "HND")
        np.testing.assert_allclose(out.numpy(), want, **TOL)
        R, W = len(step.request_ids), step.beam_width
        if parents_kind == "all_parent_0":
            parents = np.zeros((R, W), dtype=np.int64)
        else:
            parents = np.tile(np.arange(W)[::-1], (R, 1))
        sim.end_step(parents=parents)
    if parents_kind == "all_parent_0":
        # Every beam's generated history is beam 0's: the indirection reads 0 everywhere before pos.
        step = sim.begin_step()
        for r in range(len(PROMPTS)):
            L = int(step.kv_lens[r * W])
            assert (step.cache_indirection[r, :W, : L - 1] == 0).all()


def test_oracle_with_indirection_wider_than_beam_width():
    # cache_indirection sized for W_max = 5 beams, 3 in use: rows are indexed [r, b, t], not flattened.
    sim = make_sim(2, 64, "HND", torch.bfloat16, beam_width=3, max_beam_width=5, seed=9)
    for _ in range(7):
        step = sim.begin_step()
        assert step.cache_indirection.shape[1] == 5
        np.testing.assert_allclose(oracle(step, sim).numpy(), naive_step(step, sim.kv_cache, "HND")[0], **TOL)
        sim.end_step()


def test_oracle_reads_current_token_from_own_page_when_new_kv_absent():
    sim = make_sim(2, 64, "NHD", torch.bfloat16, seed=5)
    for _ in range(6):
        step = sim.begin_step()
        want = oracle(step, sim)
        for i in range(step.num_rows):
            sim.write_kv(int(step.write_page[i]), int(step.write_slot[i]), step.new_k[i], step.new_v[i])
        got = reference_beam_attention(
            step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
            step.beam_width, kv_layout="NHD",
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        sim.end_step(write_kv=False)


def test_oracle_with_strided_pool_block_offsets_and_strided_q():
    # A pool view whose page stride spans other layers, a block-offset page table (strided K-field
    # view, divisor = layers * kv_factor) and q sliced out of a fused qkv buffer.
    sim = make_sim(3, 64, "HND", torch.bfloat16, seed=11)
    layers = 3
    for _ in range(5):
        step = sim.begin_step()
        want = oracle(step, sim)
        big = torch.randn((sim.num_pages, layers) + tuple(sim.kv_cache.shape[1:])).to(sim.kv_cache.dtype)
        big[:, 1] = sim.kv_cache
        pool_view = big[:, 1]
        assert not pool_view.is_contiguous()
        offsets = sim.block_offsets(step.beam_page_table, layers * 2)
        table_view = offsets[:, 0, :]
        assert table_view.stride(0) != table_view.shape[1]
        qkv = torch.randn(step.num_rows, step.q.shape[1] + 2, step.q.shape[2])
        qkv[:, : step.q.shape[1]] = step.q.float()
        q_view = qkv[:, : step.q.shape[1]]
        got = reference_beam_attention(
            q_view, pool_view, table_view, step.kv_lens, step.prompt_lens, step.cache_indirection, step.beam_width,
            new_k=step.new_k, new_v=step.new_v, page_index_divisor=layers * 2,
        )
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        sim.end_step()


@pytest.mark.parametrize("group,head_dim,kv_layout", [(1, 128, "HND"), (3, 64, "NHD"), (8, 64, "HND")])
def test_prefix_merged_with_tail_equals_oracle(group, head_dim, kv_layout):
    sim = make_sim(group, head_dim, kv_layout, torch.bfloat16, seed=group)
    for _ in range(10):
        step = sim.begin_step()
        full_out, full_lse = oracle(step, sim, return_lse=True)
        p_out, p_lse = reference_prefix_attention(
            step.q, sim.kv_cache, step.prompt_page_indptr, step.prompt_page_indices, step.prompt_lens_per_request,
            step.beam_width, kv_layout=kv_layout,
        )
        t_out, t_lse = reference_tail_attention(
            step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
            step.beam_width, new_k=step.new_k, new_v=step.new_v, kv_layout=kv_layout,
        )
        # Each stage alone against the naive loop: prompt positions only / generated positions only.
        naive_p_out, naive_p_lse = naive_step(step, sim.kv_cache, kv_layout, span=lambda P, L: (0, P))
        np.testing.assert_allclose(p_out.numpy(), naive_p_out, **TOL)
        np.testing.assert_allclose(p_lse.numpy(), naive_p_lse, **TOL)
        naive_t_out, naive_t_lse = naive_step(step, sim.kv_cache, kv_layout, span=lambda P, L: (P, L))
        np.testing.assert_allclose(t_out.numpy(), naive_t_out, **TOL)
        np.testing.assert_allclose(t_lse.numpy(), naive_t_lse, **TOL)
        m_out, m_lse = merge_states_base2(p_out, p_lse, t_out, t_lse)
        torch.testing.assert_close(m_out, full_out, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(m_lse, full_lse, rtol=2e-5, atol=2e-5)
        sim.end_step()


def test_lse_is_log2_of_sum_of_exp():
    torch.manual_seed(0)
    n, hq, hkv, T, d = 3, 4, 2, 7, 16
    q = torch.randn(n, hq, d)
    sim = BeamSearchCacheSimulator([T - 1], beam_width=n, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   page_size=4, max_seq_len=16, dtype=torch.float32, seed=1)
    step = sim.begin_step()
    scale = 0.3
    _, lse = reference_beam_attention(q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens,
                                      step.cache_indirection, n, new_k=step.new_k, new_v=step.new_v,
                                      sm_scale=scale, return_lse=True)
    pool = sim.kv_cache.double().numpy()
    for i in range(n):
        k, _ = beam_history(pool, "HND", step.beam_page_table.numpy(), step.cache_indirection.numpy(), 0, i, n,
                            T - 1, T, step.new_k.double().numpy(), step.new_v.double().numpy())
        for h in range(hq):
            s = k[:, h // 2, :] @ q[i, h].double().numpy() * scale
            assert lse[i, h].item() == pytest.approx(math.log2(np.exp(s).sum()), rel=1e-6, abs=1e-6)
            assert lse[i, h].item() == pytest.approx(np.log(np.exp(s).sum()) * LOG2E, rel=1e-6, abs=1e-6)


def test_tail_with_no_generated_position_is_empty():
    sim = make_sim(1, 64, "HND", torch.float32)
    step = sim.begin_step()
    out, lse = reference_tail_attention(
        step.q, sim.kv_cache, step.beam_page_table, step.prompt_lens, step.prompt_lens, step.cache_indirection,
        step.beam_width,
    )
    assert (out == 0).all() and torch.isneginf(lse).all()


def _bad_source_beam(step, source_beam):
    ind = step.cache_indirection.clone()
    ind[0, 1, step.prompt_lens[1]] = source_beam  # row 1's first generated position, a beam outside [0, W)
    return dict(cache_indirection=ind)


def _kv_len_one_past_the_table(step):
    """The longest kv_len at one token past the page table (``cols * page_size + 1``), with cache_indirection a page
    wider (of beam 0) so that only the table's own bound stands before indexing past its last column."""
    past = step.beam_page_table.shape[1] * PAGE + 1
    ind = step.cache_indirection
    wider = torch.cat([ind, torch.zeros_like(ind[:, :, :PAGE])], dim=2)
    return dict(kv_lens=step.kv_lens + (past - int(step.kv_lens.max())), cache_indirection=wider)


def _page_outside_the_pool(step, num_pages):
    table = step.beam_page_table.clone()
    table[0, 0] = num_pages  # row 0's first prompt page
    return dict(beam_page_table=table)


@pytest.mark.parametrize("change,match", [
    (lambda step, n: dict(prompt_lens=step.prompt_lens_per_request), "prompt_lens must have one entry per beam row"),
    (lambda step, n: dict(sm_scale=float("nan")), "sm_scale=nan must be a finite positive float"),
    (lambda step, n: dict(sm_scale=True), "sm_scale=True must be a float"),
    (lambda step, n: dict(page_index_divisor=0), "page_index_divisor=0 must be an int >= 1"),
    (lambda step, n: dict(beam_width=5), "rows a multiple of beam_width=5"),
    (lambda step, n: _kv_len_one_past_the_table(step), "a kv_len of 49 is past the page table's 6 columns of 8 tokens"),
    (lambda step, n: _bad_source_beam(step, step.beam_width), "through source beam 3, outside [0, beam_width=3)"),
    (lambda step, n: _bad_source_beam(step, -1), "through source beam -1, outside [0, beam_width=3)"),
    (lambda step, n: _page_outside_the_pool(step, n), "outside the pool's [0, "),
    (lambda step, n: dict(cache_indirection=step.cache_indirection[:, :, :int(step.kv_lens.max()) - 1]),
     "past cache_indirection's"),
], ids=["per_request_prompt_lens", "nan_scale", "bool_scale", "zero_divisor", "beam_width_not_dividing_rows",
        "kv_len_past_the_table", "source_beam_past_the_width", "source_beam_negative", "page_outside_the_pool",
        "kv_len_past_the_indirection"])
@pytest.mark.parametrize("fn", [reference_beam_attention, reference_tail_attention], ids=["whole", "tail"])
def test_the_oracle_refuses_inputs_it_would_misread(fn, change, match):
    """The oracle shares no check with the library, so it keeps its own: an argument that would index another
    request's pages, wrap a page number, or read a length per request as per row is refused by name (before, a raw
    IndexError, or a plausible wrong answer)."""
    sim = make_sim(2, 64, "HND", torch.float32, seed=11)
    sim.begin_step()
    sim.end_step()
    step = sim.begin_step()
    args = dict(q=step.q, kv_cache=sim.kv_cache, beam_page_table=step.beam_page_table, kv_lens=step.kv_lens,
                prompt_lens=step.prompt_lens, cache_indirection=step.cache_indirection, beam_width=step.beam_width,
                new_k=step.new_k, new_v=step.new_v)
    args.update(change(step, sim.kv_cache.shape[0]))
    with pytest.raises((ValueError, TypeError), match=re.escape(match)):
        fn(**args)


def test_the_oracle_serves_a_full_cache_at_its_last_position():
    """A step whose longest kv_len is max_seq_len (the last position of a full cache: the page table's last column
    and cache_indirection's last entry in use) is served and matches the naive loop: the oracle's bounds refuse
    only a kv_len past the tables, never one that fills them (the kernels' boundary, which this pins the oracle at)."""
    max_seq_len = 3 * PAGE  # the longest prompt (19 tokens) fills it in 5 steps
    sim = make_sim(2, 64, "HND", torch.float32, seed=13, max_seq_len=max_seq_len)
    for _ in range(max_seq_len - max(PROMPTS)):
        step = sim.begin_step()
        out, lse = oracle(step, sim, return_lse=True)
        want_out, want_lse = naive_step(step, sim.kv_cache, "HND")
        np.testing.assert_allclose(out.numpy(), want_out, **TOL)
        np.testing.assert_allclose(lse.numpy(), want_lse, **TOL)
        t_out, t_lse = reference_tail_attention(
            step.q, sim.kv_cache, step.beam_page_table, step.kv_lens, step.prompt_lens, step.cache_indirection,
            step.beam_width, new_k=step.new_k, new_v=step.new_v,
        )
        naive_t_out, naive_t_lse = naive_step(step, sim.kv_cache, "HND", span=lambda P, L: (P, L))
        np.testing.assert_allclose(t_out.numpy(), naive_t_out, **TOL)
        np.testing.assert_allclose(t_lse.numpy(), naive_t_lse, **TOL)
        sim.end_step()
    # The last step served really was at capacity, on both tables.
    assert int(step.kv_lens.max()) == max_seq_len == step.cache_indirection.shape[2]
    assert step.beam_page_table.shape[1] * PAGE == max_seq_len


@pytest.mark.parametrize("change,match", [
    (lambda step: dict(beam_width=1), "q has 12 rows but prompt_lens lists 4 requests of beam_width=1"),
    (lambda step: dict(prompt_lens=step.prompt_lens_per_request[:3]), "prompt_lens lists 3 requests"),
    (lambda step: dict(prompt_lens=step.prompt_lens_per_request + 8), "are listed"),
], ids=["rows_not_covered", "a_request_missing", "prompt_past_its_pages"])
def test_the_prefix_oracle_refuses_rows_or_pages_it_does_not_cover(change, match):
    """Rows the lengths do not cover came back as uninitialised memory, and a prompt past its listed pages read the
    next request's pages; both are refused by name."""
    sim = make_sim(2, 64, "HND", torch.float32, seed=12)
    step = sim.begin_step()
    args = dict(q=step.q, kv_cache=sim.kv_cache, prompt_page_indptr=step.prompt_page_indptr,
                prompt_page_indices=step.prompt_page_indices, prompt_lens=step.prompt_lens_per_request,
                beam_width=step.beam_width)
    args.update(change(step))
    with pytest.raises(ValueError, match=re.escape(match)):
        reference_prefix_attention(**args)


# ------------------------------------------------------------------------------------------
# merge_states_base2


def test_merge_matches_formula():
    torch.manual_seed(1)
    o_a, o_b = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    lse_a, lse_b = torch.randn(5, 3) * 4, torch.randn(5, 3) * 4
    out, lse = merge_states_base2(o_a.bfloat16(), lse_a, o_b.bfloat16(), lse_b)
    a, b = o_a.bfloat16().double().numpy(), o_b.bfloat16().double().numpy()
    la, lb = lse_a.double().numpy(), lse_b.double().numpy()
    wa, wb = 2.0 ** la, 2.0 ** lb
    np.testing.assert_allclose(out.numpy(), (a * wa[..., None] + b * wb[..., None]) / (wa + wb)[..., None],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), np.log2(wa + wb), rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_merge_with_one_empty_side_returns_the_other():
    torch.manual_seed(2)
    o_a, o_b = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    lse_a = torch.randn(4, 2) * 10
    lse_b = torch.full((4, 2), float("-inf"))
    for out, lse in (merge_states_base2(o_a, lse_a, o_b, lse_b), merge_states_base2(o_b, lse_b, o_a, lse_a)):
        torch.testing.assert_close(out, o_a, rtol=0, atol=0)
        torch.testing.assert_close(lse, lse_a, rtol=0, atol=0)


def test_merge_both_empty_gives_zero_and_neg_inf():
    o_a, o_b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)  # garbage outputs of empty states
    ninf = torch.full((2, 3), float("-inf"))
    out, lse = merge_states_base2(o_a, ninf, o_b, ninf.clone())
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_merge_large_lse_does_not_overflow():
    o_a, o_b = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out, lse = merge_states_base2(o_a, torch.tensor([[500.0]]), o_b, torch.tensor([[500.0]]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, (o_a + o_b) / 2)
    assert lse.item() == pytest.approx(501.0)
