"""``microbenchmarks.layer_graph``: the cascade step in a model-like CUDA graph, PDL off and on."""

from __future__ import annotations

import os

import pytest
import torch

from microbenchmarks import layer_graph
from triton_kernels.launch import PDL_ENV


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers 0 must be >= 1"),
    (["--reps", "-1"], "--reps -1 must be >= 1"),
    (["--preset", "A"], "invalid choice: 'A'"),  # A's path is FA4 + tail, not the cascade
])
def test_rejects_bad_arguments_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        layer_graph.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message (this machine has a GPU)")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert layer_graph.main(["--preset", "B-short"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0 or newer (CUDA graphs, PDL)")
def test_every_arm_gives_the_plain_layers_output_and_the_switch_is_restored(monkeypatch):
    """Two layers a graph at B-short: each arm's output equals the PDL-off layer's bit for bit, every element is
    written over NaN, every arm is timed, and ``TRTLLM_ENABLE_PDL`` is as it was (``"0"``, which the last arm
    does not leave)."""
    monkeypatch.setenv(PDL_ENV, "0")
    res = layer_graph.time_layers("B-short", layers=2, reps=2, rounds=1)
    assert res["all_written"]
    assert res["outputs_equal"] and all(res["outputs_equal"].values()), res["outputs_equal"]
    assert set(res["median_us_per_layer"]) == {"producer", "cascade, PDL off", "cascade, PDL on", "layer, PDL off",
                                               "layer, PDL on", "layer, PDL off, trigger", "layer, PDL on, trigger"}
    assert all(t > 0 for t in res["median_us_per_layer"].values())
    assert os.environ[PDL_ENV] == "0"
