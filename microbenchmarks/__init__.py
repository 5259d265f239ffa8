"""Layer-level benchmark of one beam-search decode step: ``beam-shared-prefix-bench`` (:mod:`.cli`).

Workloads (:mod:`.workload`, :mod:`.shapes`), the measured arms (:mod:`.arms`: this library, its
stages, FlashInfer baselines), timing (:mod:`.timing`), oracle checks (:mod:`.check`), byte and FLOP
floors (:mod:`.floors`) and reports (:mod:`.report`); :mod:`.tune_tail` sweeps the tail kernel's tiling.
"""
