"""Launcher of the fused tail kernel (work in progress: the kernel lands in the next commit)."""

from __future__ import annotations

from .tail_merge_args import check_tail_index_values, check_tail_merge_args

__all__ = ["beam_tail_attention_merge"]


def beam_tail_attention_merge(
    q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
    prefix_out, prefix_lse, out, *, sm_scale=None, kv_layout="HND", page_index_divisor=1,
    prefix_lse_layout="NH", prefix_lse_base="log2", write_kv=True, validate_indices=False,
):
    """Fused tail attention + KV write + LSE merge (see beam_tail_attention_merge_torch for the contract)."""
    geom = check_tail_merge_args(
        q, new_k, new_v, kv_cache, beam_page_table, kv_lens, prompt_lens, cache_indirection, beam_width,
        prefix_out, prefix_lse, out, sm_scale=sm_scale, kv_layout=kv_layout,
        page_index_divisor=page_index_divisor, prefix_lse_layout=prefix_lse_layout,
        prefix_lse_base=prefix_lse_base,
    )
    if validate_indices:
        check_tail_index_values(geom, beam_page_table, kv_lens, prompt_lens, cache_indirection, page_index_divisor)
    raise NotImplementedError("the Triton tail kernel is not committed yet; use beam_tail_attention_merge_torch")
