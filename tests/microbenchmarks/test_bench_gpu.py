"""The benchmark CLI on a GPU: every arm runs, passes the oracle check and is timed (small shape)."""

import importlib.util
import json

import pytest
import torch

# Every arm runs here, the FlashInfer and FA4 ones included: on a GPU without either, say so rather than fail on it
# (without a GPU the gpu mark's own reason stands).
MISSING = [package for module, package in (("flashinfer", "flashinfer-python"), ("flash_attn", "flash-attn-4"))
           if importlib.util.find_spec(module) is None]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(bool(MISSING) and torch.cuda.is_available(),
                                 reason=f"needs every arm's library: {MISSING} not installed (pip install '.[gpu]')")]

ALL_ARMS = {"library/auto", "library/flashinfer", "library/fa4", "library/triton", "prefix/flashinfer", "prefix/fa4",
            "prefix/triton", "tail/triton", "fi-decode-tc", "fi-decode-cc", "fi-cascade"}


def test_every_arm_runs_checks_and_times(tmp_path):
    from microbenchmarks import cli

    out = tmp_path / "gpu.json"
    rc = cli.main(["--requests", "4", "--beams", "8", "--prompt", "200", "--tail", "5", "--sets", "2", "--iters", "3",
                   "--plan-repeats", "20", "--kernel-times", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["environment"]["gpu"] is True
    assert doc["rates"]["copy_bandwidth_GBps"] > 100 and doc["rates"]["matmul_TFLOPs"] > 10
    assert 0 < doc["rates"]["event_overhead_us"] < 50
    (point,) = doc["results"]
    arms = {a["name"]: a for a in point["arms"]}
    assert set(arms) == ALL_ARMS
    bad = {n: (a["status"], a["reason"]) for n, a in arms.items() if a["status"] != "ok"}
    assert not bad, bad
    for name, a in arms.items():
        assert a["check"]["ok"] and a["time_us"] > 0, name
        assert a["floor_multiple"] > 0, name
        # Every arm's kernels were found in the trace. A graph's span leaves out the ~3 us of launch and
        # event latency the events include; an eager multi-kernel call's span is about its event time.
        assert "kernel_error" not in a, (name, a.get("kernel_error"))
        assert 0 < a["kernel_us"] < (1.0 if a["graphed"] else 1.1) * a["time_us"], name
        assert a["kernel_floor_multiple"] > 0, name
        if a["kind"] == "stage":
            # A stage is not a whole step: no step speedup, only a multiple of its own floor.
            assert a["speedup_vs_decode"] is None and a["speedup_vs_cascade"] is None, name
        else:
            assert a["speedup_vs_decode"] > 0, name
    for name in ("library/flashinfer", "library/fa4", "tail/triton"):
        assert arms[name]["graphed"], (name, arms[name]["graph_error"])
    assert arms["library/flashinfer"]["info"]["prefix_kernel"] in ("fa2", "fa3")
    assert arms["library/fa4"]["info"]["backend"] == "fa4"
    assert point["plan"]["library/flashinfer"]["replan_keyed_us"] < point["plan"]["library/flashinfer"]["first_plan_us"]


def test_prefix_kernel_choice_is_shown_per_arm(tmp_path):
    from microbenchmarks import cli

    out = tmp_path / "k.json"
    rc = cli.main(["--requests", "2", "--beams", "4", "--prompt", "300", "--tail", "3", "--sets", "1", "--iters", "2",
                   "--arms", "library,prefix", "--prefix-kernels", "fa2,fa3", "--plan-repeats", "0", "--json", str(out)])
    assert rc == 0
    arms = {a["name"]: a for a in json.loads(out.read_text())["results"][0]["arms"]}
    for kernel in ("fa2", "fa3"):
        for kind in ("library", "prefix"):
            a = arms[f"{kind}/flashinfer-{kernel}"]
            assert a["status"] == "ok" and a["info"]["prefix_kernel"] == kernel, a
