"""The end-to-end TensorRT-LLM arm: environment per variant, and a clear failure without tensorrt_llm."""

import sys

import pytest

from microbenchmarks import e2e_trtllm


@pytest.mark.parametrize(
    "before,variant,after",
    [
        (None, "on", "+beam_shared_prefix"),
        (None, "off", None),
        ("+beam_shared_prefix", "off", None),
        ("-prims_ts", "on", "-prims_ts,+beam_shared_prefix"),
        ("triton_custom_mask,fallback", "on", "triton_custom_mask,beam_shared_prefix,fallback"),
        ("triton_custom_mask,beam_shared_prefix,fallback", "off", "triton_custom_mask,fallback"),
    ],
)
def test_variant_env(before, variant, after):
    base = {"PATH": "/bin"} if before is None else {"PATH": "/bin", "TLLM_FMHA_LIBS": before}
    env = e2e_trtllm.variant_env(variant, base)
    assert env.get("TLLM_FMHA_LIBS") == after
    assert env["TLLM_WORKER_USE_SINGLE_PROCESS"] == "1" and env["PATH"] == "/bin"


def test_fails_clearly_without_tensorrt_llm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes `import tensorrt_llm` raise ImportError
    with pytest.raises(e2e_trtllm.TrtllmMissing, match="needs TensorRT-LLM"):
        e2e_trtllm.require_tensorrt_llm()
    assert e2e_trtllm.main(["--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "needs TensorRT-LLM" in err and "beam-shared-prefix-bench --preset A" in err


@pytest.mark.parametrize(
    "files,end_id",
    [
        ({"generation_config.json": {"eos_token_id": [151645, 151643]}, "config.json": {"eos_token_id": 7}}, 151645),
        ({"generation_config.json": {"do_sample": True}, "config.json": {"eos_token_id": 151643}}, 151643),
        ({"config.json": {"eos_token_id": 2}}, 2),
        ({"config.json": {"eos_token_id": None}}, "no eos_token_id in config.json"),
        ({}, "neither exists"),
    ],
    ids=["generation-config-list", "config-fallback", "config-only", "none", "no-files"],
)
def test_checkpoint_end_id(tmp_path, files, end_id):
    """The Torch sampler wants a real end_id: the checkpoint's, or a clear error that asks for --end-id."""
    import json

    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    if isinstance(end_id, int):
        assert e2e_trtllm.checkpoint_end_id(str(tmp_path)) == end_id
    else:
        with pytest.raises(ValueError, match=end_id) as info:
            e2e_trtllm.checkpoint_end_id(str(tmp_path))
        assert "--end-id" in str(info.value)


def test_beam_search_llm_kwargs_follow_the_tree():
    """Trees with ``enable_trtllm_sampler`` (before ``sampler_type``) need it on for beam search."""
    old = {"model", "max_beam_width", "enable_trtllm_sampler", "disable_overlap_scheduler"}
    new = {"model", "max_beam_width", "sampler_type", "disable_overlap_scheduler"}
    assert e2e_trtllm.beam_search_llm_kwargs(old) == {"enable_trtllm_sampler": True}
    assert e2e_trtllm.beam_search_llm_kwargs(new) == {}
    assert e2e_trtllm.beam_search_llm_kwargs(new, disable_overlap_scheduler=True) == {"disable_overlap_scheduler": True}


@pytest.mark.trtllm
@pytest.mark.gpu
def test_e2e_runs_with_tensorrt_llm(tmp_path):
    """Needs TRTLLM_E2E_MODEL (a small model directory) on a machine with TensorRT-LLM and a GPU."""
    import json
    import os

    model = os.environ.get("TRTLLM_E2E_MODEL")
    if not model:
        pytest.fail("set TRTLLM_E2E_MODEL to a model directory (e.g. Qwen3-0.6B) to run the end-to-end arm")
    out = tmp_path / "e2e.json"
    # 16 requests x 8 beams: the decline rule serves them on CUDA-graph steps too (prompt unknown there,
    # so 8 beams or more; and at least 120 beam rows).
    rc = e2e_trtllm.main(["--model", model, "--requests", "16", "--beams", "8", "--prompt", "100", "--max-tokens", "3",
                          "--repeats", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    on = next(r for r in doc["results"] if r["variant"] == "on")
    assert on["library_stats_timed"]["steps_planned"] > 0 and doc["summary"]["top_beams_equal"]
