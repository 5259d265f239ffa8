"""The end-to-end arm's instrumentation (``microbenchmarks/e2e_trtllm.py``) against the interface model.

The arm reports host planning time by wrapping ``planning.plan_metadata`` and the library's work by reading
``beam_shared_prefix.trtllm.stats()`` by key. Both are only ever read inside a TensorRT-LLM process, which this
machine cannot start, so a wrapper the ``prepare()`` hook bypasses, or a renamed counter, would print zeros there
rather than fail. Here a served and a handed-over step must each show in both. (The arm's own run needs TensorRT-LLM
and a GPU: ``tests/microbenchmarks/test_bench_e2e.py``.)
"""

from __future__ import annotations

import pytest
import torch

from beam_shared_prefix.trtllm import planning, register
from interface_model import build
from microbenchmarks import e2e_trtllm

STEPS = 3
TOL = 2e-2


@pytest.mark.parametrize("served", [True, False], ids=["served", "handed-over"])
def test_the_arms_planning_timer_and_counters_see_every_step(request, monkeypatch, served):
    """``served``: the decline rule off, the library plans and serves every step. Otherwise the rule is on and the
    interface model's small batch is under its beam-rows threshold: each step is planned, then handed to the
    default kernel at the forward."""
    if served:
        model = request.getfixturevalue("trt")(layout="new")
        monkeypatch.setenv("TLLM_FMHA_LIBS", "+beam_shared_prefix")
        register()
    else:
        model = request.getfixturevalue("with_decline")(any_rows=False)
    setup = build(model, prompts=(37, 70), beam_width=3)
    monkeypatch.setattr(planning, "plan_metadata", planning.plan_metadata)  # undoes the arm's wrapper afterwards
    timer = e2e_trtllm._timed_planning()
    before = e2e_trtllm._library_stats()
    for _ in range(STEPS):
        step = setup.sim.begin_step()
        out, _ = setup.run(step)
        got = out.view(-1, setup.sim.num_qo_heads, setup.sim.head_dim)
        torch.testing.assert_close(got.float(), setup.oracle(step), atol=TOL, rtol=TOL)
        setup.sim.end_step(write_kv=False)  # both paths wrote the step's K/V; later steps read it
    after = e2e_trtllm._library_stats()
    counted = {key: after[key] - before.get(key, 0) for key in ("steps_planned", "generation_forwards",
                                                                "delegated_steps")}

    assert timer["calls"] == STEPS, timer  # one hooked prepare() a step, each through the arm's wrapper
    assert timer["total_us"] > 0
    served_forwards = STEPS if served else 0
    assert counted == {"steps_planned": STEPS, "generation_forwards": served_forwards,
                       "delegated_steps": STEPS - served_forwards}
