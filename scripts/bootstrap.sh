#!/usr/bin/env bash
# Create .venv at the repository root if missing and install ctxpatch-lite into it (editable, with every extra:
# embedded model, notebooks, tests).
# torch comes first and only if the venv lacks one: TORCH_SPEC (default torch==2.13.0, a CPU build on the
# reference machine) can name the build you need, e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# constraints.txt pins the versions the stored outputs were made with; CONSTRAINTS= (empty) installs the newest allowed.
CONSTRAINTS="${CONSTRAINTS-constraints.txt}"
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[bootstrap] installing $TORCH_SPEC"
  # shellcheck disable=SC2086
  "${PIP[@]}" install $TORCH_SPEC
fi
stamp=.venv/.ctxpatch-installed
want="$(cat pyproject.toml ${CONSTRAINTS:+"$CONSTRAINTS"} | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c "import ctxpatch_lite" >/dev/null 2>&1; then
  echo "[bootstrap] installing ctxpatch-lite and its dependencies into .venv"
  "${PIP[@]}" install -e ".[all]" ${CONSTRAINTS:+-c "$CONSTRAINTS"}
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import torch, transformers; print(f'[bootstrap] torch {torch.__version__}, transformers {transformers.__version__}, CUDA: {torch.cuda.is_available()}')"
