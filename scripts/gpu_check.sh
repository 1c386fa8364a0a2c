#!/usr/bin/env bash
# One-shot GPU check (about 8 minutes at most on one GPU; downloads nothing): library versions, `pytest -m cuda`, and
# Algorithm 1 timed on a random Gemma-3-1B-shaped model in bfloat16 and float32 (CUDA events, max_memory_allocated,
# host transfers per token). Writes benchmarks/results/gpu_check-<stamp>.json. Without CUDA it says so, runs the
# CPU parts and exits 0. Uses .venv/bin/python when present, else python3 (PYTHON overrides).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT_JSON:-benchmarks/results/gpu_check-$(date -u +%Y%m%d-%H%M%S).json}"
exec "$PY" scripts/gpu_check.py --out "$OUT" "$@"
