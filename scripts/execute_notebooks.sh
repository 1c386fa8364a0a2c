#!/usr/bin/env bash
# Re-execute the committed notebooks in place (their stored outputs are what nbval compares against).
# Run after changing a notebook or the package code it shows; commit the result.
set -euo pipefail
cd "$(dirname "$0")/../notebooks"
for nb in ${@:-[0-9][0-9]_*.ipynb}; do
  echo "executing $nb"
  CTXPATCH_THREADS=1 ../.venv/bin/jupyter nbconvert --to notebook --execute --inplace \
    --ExecutePreprocessor.kernel_name=python3 --ExecutePreprocessor.timeout=1800 "$nb" 2>&1 | grep -v "WARNING\|Converting" || true
done
