"""beam-shared-prefix: cascade attention for wide beam-search decoding.

The shared prompt of each request is attended once for all of its beams (the prefix pass); each
beam's generated tail is gathered through ``cache_indirection`` and merged by log-sum-exp in one
fused Triton launch. This package is engine-agnostic; the TensorRT-LLM adapter lives in
:mod:`beam_shared_prefix.trtllm` and is the only code that imports ``tensorrt_llm``.
"""

from .plan import PlanError, StepPlan, StepPlanner, build_step_plan

__version__ = "0.1.0"

__all__ = ["PlanError", "StepPlan", "StepPlanner", "build_step_plan", "BeamSharedPrefixAttention", "__version__"]


def __getattr__(name):
    # Lazy: the wrapper pulls in Triton and the prefix backends, the planner alone does not.
    if name == "BeamSharedPrefixAttention":
        from .attention import BeamSharedPrefixAttention

        return BeamSharedPrefixAttention
    raise AttributeError(name)
