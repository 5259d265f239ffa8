#!/usr/bin/env bash
# Installs the package and runs the benchmark CLI on its default preset (A). With an NVIDIA GPU the
# `gpu` extra (FlashInfer, FA4) is installed and every arm is measured; without one the CLI says so
# and runs the CPU reference path on a reduced shape. Extra arguments go to the CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch
  "$PY" -m pip install -q -e ".[gpu,bench]"
else
  "$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e ".[bench]"
fi
# The interpreter that installed the package runs it (a venv need not be activated for its console script).
exec "$PY" -m microbenchmarks "$@"
