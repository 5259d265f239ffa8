"""End to end with a real TensorRT-LLM: a small Qwen3 model, beam 16, library on versus off.

Needs a GPU, an importable ``tensorrt_llm`` and a Qwen3 checkpoint (e.g. Qwen3-0.6B) whose path is in
``BEAM_SHARED_PREFIX_QWEN3_PATH``. Two prompts of 300 and 173 tokens (several KV blocks), beam 16,
3 new tokens: step 1 has an empty tail, steps 2-3 gather tails through ``cache_indirection``. Each run
is its own process (TensorRT-LLM reads ``TLLM_FMHA_LIBS`` when it builds the layers). The library run
uses check mode and ``DECLINE=never`` so every generation step goes through it; Qwen3 applies RoPE in
the module (fused QK-norm + RoPE), as the layer gate requires.

Pass criteria (those of the original in-tree test): 16 beams per prompt, the same top beam, at least
90 % of the beams shared, and cumulative log-probabilities within ``0.1 + 0.02 * |reference|``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.trtllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_generate.py")
MODEL_ENV = "BEAM_SHARED_PREFIX_QWEN3_PATH"


def generate(tmp_path, name, library: bool):
    pth_dir = tmp_path / f"site-{name}"
    pth_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "beam_shared_prefix_autoload.pth"), pth_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    for var in ("TLLM_FMHA_LIBS", "TLLM_BEAM_SHARED_PREFIX_CHECK", "TLLM_BEAM_SHARED_PREFIX_DECLINE"):
        env.pop(var, None)
    if library:
        env.update(
            TLLM_FMHA_LIBS="+beam_shared_prefix",
            TLLM_BEAM_SHARED_PREFIX_CHECK="1",
            TLLM_BEAM_SHARED_PREFIX_DECLINE="never",
        )
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, SCRIPT, "--model", os.environ[MODEL_ENV], "--out", str(out), "--pth-dir", str(pth_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{name} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


def test_library_matches_default_decode(tmp_path):
    if not os.environ.get(MODEL_ENV):
        pytest.skip(f"set {MODEL_ENV} to a Qwen3 checkpoint directory (e.g. Qwen3-0.6B)")
    reference = generate(tmp_path, "off", library=False)
    library = generate(tmp_path, "on", library=True)
    stats = library["stats"]
    assert stats.get("generation_forwards", 0) > 0 and stats.get("plans", 0) > 0, f"library never ran: {stats}"
    for p, (ref_beams, lib_beams) in enumerate(zip(reference["beams"], library["beams"])):
        assert len(ref_beams) == len(lib_beams) == 16, f"prompt {p}: beam counts {len(ref_beams)}, {len(lib_beams)}"
        assert lib_beams[0]["tokens"] == ref_beams[0]["tokens"], f"prompt {p}: top beams differ"
        ref_by_tokens = {tuple(b["tokens"]): b["cum_logprob"] for b in ref_beams}
        shared = [b for b in lib_beams if tuple(b["tokens"]) in ref_by_tokens]
        assert len(shared) >= 0.9 * 16, f"prompt {p}: only {len(shared)}/16 beams shared"
        for b in shared:
            ref_lp = ref_by_tokens[tuple(b["tokens"])]
            assert abs(b["cum_logprob"] - ref_lp) <= 0.1 + 0.02 * abs(ref_lp), (
                f"prompt {p}: cumulative log-prob {b['cum_logprob']:.4f} vs {ref_lp:.4f} for beam {b['tokens']}"
            )
