"""Beam-search generation with TensorRT-LLM for the end-to-end test (run as a script, one process per run).

    python tests/trtllm/e2e_generate.py --model /path/to/Qwen3-0.6B --out run.json [--pth-dir DIR]

Two prompts of 300 and 173 tokens (fixed random token ids), beam width 16, ``--max-tokens`` new
tokens; the executor stays in this process (``TLLM_WORKER_USE_SINGLE_PROCESS=1``) so the library's
counters can be read back. ``--pth-dir`` is processed as a site directory *before* TensorRT-LLM is
imported, exactly as site-packages is at start-up (for a checkout that is not pip-installed). The
library is on when ``TLLM_FMHA_LIBS`` names it (set by the caller). Writes JSON:
``{"beams": [[{"tokens": [...], "cum_logprob": float}, ...], ...], "stats": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import site
import sys

PROMPT_LENS = (300, 173)
BEAM_WIDTH = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pth-dir", default=None)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--no-cuda-graph", action="store_true")
    args = parser.parse_args()

    if args.pth_dir:
        site.addsitedir(args.pth_dir)
    os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")

    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

    rng = random.Random(1234)
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in PROMPT_LENS]
    llm = LLM(
        model=args.model,
        max_beam_width=BEAM_WIDTH,
        max_batch_size=len(prompts),
        max_seq_len=max(PROMPT_LENS) + args.max_tokens + 8,
        kv_cache_config=KvCacheConfig(enable_block_reuse=False, free_gpu_memory_fraction=0.3),
        cuda_graph_config=None if args.no_cuda_graph else CudaGraphConfig(batch_sizes=[len(prompts)]),
        disable_overlap_scheduler=True,
        enable_chunked_prefill=False,
    )
    from microbenchmarks.e2e_trtllm import checkpoint_end_id

    # No tokenizer is loaded: the checkpoint's end id (the Torch sampler wants a real one), and ignore_eos so
    # that every beam runs max_tokens steps in both runs.
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, n=BEAM_WIDTH, best_of=BEAM_WIDTH, use_beam_search=True,
            end_id=checkpoint_end_id(args.model), ignore_eos=True,
        )
    except TypeError:  # releases without end_id
        params = SamplingParams(max_tokens=args.max_tokens, n=BEAM_WIDTH, best_of=BEAM_WIDTH, use_beam_search=True)
    outputs = llm.generate(prompts, params)
    beams = [
        [{"tokens": list(beam.token_ids), "cum_logprob": float(beam.cumulative_logprob)} for beam in out.outputs]
        for out in outputs
    ]
    stats = {}
    if "beam_shared_prefix.trtllm" in sys.modules:
        from beam_shared_prefix.trtllm import stats as library_stats

        stats = library_stats()
    llm.shutdown()
    with open(args.out, "w") as f:
        json.dump({"beams": beams, "stats": stats}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
