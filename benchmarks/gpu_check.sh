#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): one command on a machine with one CUDA GPU, under 10 minutes.
# Writes docs/results/gpu_check.md and gpu_check.json. `--cpu_smoke` runs the CPU-runnable part (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" benchmarks/gpu_check.py "$@"
