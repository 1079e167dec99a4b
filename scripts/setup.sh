#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the project and its
# development extras. CPU torch comes from the pinned build (an unpinned torch pulls GB of CUDA).
# Source it (". scripts/setup.sh") to stay in the environment afterwards.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_py=${PYTHON:-python3}
_new_enough='import sys; sys.exit(sys.version_info < (3, 10))' # pyproject's requires-python
# A .venv whose interpreter does not start (its base Python removed or upgraded: a dangling link, which `venv`
# without --clear leaves as it is and PATH then skips, so pip ran on the system Python) is made again.
if ! "$_root/.venv/bin/python" -c "$_new_enough" >/dev/null 2>&1; then
  if ! "$_py" -c "$_new_enough" >/dev/null 2>&1; then
    echo "setup.sh: $_py is not Python >= 3.10 (or does not run); set PYTHON to one, e.g. PYTHON=python3.12" >&2
    return 2 2>/dev/null || exit 2
  fi
  "$_py" -m venv --clear "$_root/.venv"
fi
# shellcheck disable=SC1091
. "$_root/.venv/bin/activate"
if ! python -c "import kernel_templates, optuna, rich, pytest, cutlass, onnxscript, onnxruntime, psycopg, matplotlib" >/dev/null 2>&1; then
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" >/dev/null 2>&1; then
    if python -c "import sys; sys.exit(0 if sys.platform == 'linux' else 1)"; then
      python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    else
      python -m pip install -q torch
    fi
  fi
  python -m pip install -q -e "$_root[dev,cutlass]"
fi
set +euo pipefail
