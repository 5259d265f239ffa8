"""The end-to-end TensorRT-LLM arm: environment per variant, a clear failure without tensorrt_llm, and the parent's report
of what its children measured."""

import statistics
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


def _child_result(variant, walls, top, stats=None, plan=None):
    median = statistics.median(walls)
    res = {"variant": variant, "wall_s": walls, "wall_s_median": median, "prompts_per_s": 8 / median,
           "beams_returned": [16] * 8, "top_beam_tokens": top}
    if variant == "on":
        res.update(library_stats_timed=stats, plan_calls_timed=plan[0], plan_host_us_per_prepare=plan[1],
                   plan_host_us_per_planned_step=plan[2])
    return res


@pytest.mark.parametrize("same_beams", [True, False], ids=["same-beams", "other-beams"])
def test_the_parent_reports_what_its_children_measured(monkeypatch, capsys, tmp_path, same_beams):
    """The parent's side of the arm, with the children's results given (a child needs TensorRT-LLM and a GPU):
    the on/off speedup from the median prompts/s, whether the top beams agree, the library's counters and host
    planning time in the report, and the JSON document; a failed child makes the exit status 1."""
    import json

    top_off = [[5, 6, 7], [8, 9, 10]]
    top_on = top_off if same_beams else [[5, 6, 7], [8, 9, 11]]
    children = {
        "off": _child_result("off", [0.30, 0.20, 0.25], top_off),
        "on": _child_result("on", [0.10, 0.125, 0.15], top_on,
                            stats={"steps_planned": 12, "generation_forwards": 4, "delegated_steps": 0},
                            plan=(14, 9.5, 11.3)),
    }
    ran = []

    def fake_variant(args, variant, argv):
        ran.append((variant, list(argv)))
        return children[variant]

    monkeypatch.setattr(e2e_trtllm, "require_tensorrt_llm", lambda import_it=True: None)
    monkeypatch.setattr(e2e_trtllm, "_run_variant", fake_variant)
    out = tmp_path / "e2e.json"
    argv = ["--model", str(tmp_path), "--end-id", "2", "--json", str(out)]
    assert e2e_trtllm.main(argv) == 0
    assert [v for v, _ in ran] == ["off", "on"] and all(a == argv for _, a in ran)  # each child gets the same flags
    printed = capsys.readouterr().out
    assert "off: 32.00 prompts/s (median wall 250.0 ms)" in printed
    assert "on: 64.00 prompts/s (median wall 125.0 ms)" in printed
    assert ("12 steps planned, 4 eager layer forwards served, 0 layer forwards handed to the default kernel; host "
            "planning 11.3 us per planned step (9.5 us per prepare())") in printed
    assert f"speedup on/off: 2.00x; top beams identical: {same_beams}" in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == "beam-shared-prefix-e2e/1" and [r["variant"] for r in doc["results"]] == ["off", "on"]
    assert doc["summary"] == {"speedup": pytest.approx(2.0), "top_beams_equal": same_beams}

    children["on"] = {"variant": "on", "error": "child exited with status 1 (see its output above)"}
    assert e2e_trtllm.main(argv) == 1
    printed = capsys.readouterr().out
    assert "on: FAILED: child exited with status 1" in printed and "speedup" not in printed
