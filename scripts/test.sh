#!/usr/bin/env bash
# Installs what the tests need and runs them. CPU machines: torch 2.13.0 first, so that the project's
# unpinned `torch` requirement never pulls another build (the project's CI machines resolve this pin to a
# CPU wheel from local disk; elsewhere PIP_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU
# build); Triton kernels run under TRITON_INTERPRET=1 and GPU tests skip with a reason. GPU machines keep
# their own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e ".[dev]"
# CI also compiles the kernels for sm_90 with the oldest Triton pyproject.toml accepts, installed beside the suite's
# (tests/triton_kernels/test_tail_merge_compile.py reads BSP_TRITON_FLOOR_SITE; elsewhere that test skips).
if [ -n "${CI:-}" ] && [ -z "${BSP_TRITON_FLOOR_SITE:-}" ]; then
  floor=$(sed -n 's/.*"triton>=\([0-9.]*\)".*/\1/p' pyproject.toml)
  export BSP_TRITON_FLOOR_SITE="$PWD/.triton-floor"
  "$PY" -m pip install -q --no-deps --target "$BSP_TRITON_FLOOR_SITE" "triton==$floor.*"
fi
# pytest exits 5 when it collects no test: with `set -e` that fails the run, as it should.
"$PY" -m pytest -q tests "$@"
