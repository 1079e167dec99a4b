#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the project and its
# development extras. CPU torch comes from the pinned build (an unpinned torch pulls GB of CUDA).
# Source it (". scripts/setup.sh") to stay in the environment afterwards. The work runs in a subshell with
# its own `set -euo pipefail`, so a sourcing shell keeps its options (an interactive one is not made to exit
# on its next failing command); only the activation runs in it, and a failure is returned as the status.
_setup_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
(
  set -euo pipefail
  _root=$_setup_root
  _py=${PYTHON:-python3}
  _new_enough='import sys; sys.exit(sys.version_info < (3, 10))' # pyproject's requires-python
  # A .venv whose interpreter does not start (its base Python removed or upgraded: a dangling link, which `venv`
  # without --clear leaves as it is and PATH then skips, so pip ran on the system Python) is made again.
  if ! "$_root/.venv/bin/python" -c "$_new_enough" >/dev/null 2>&1; then
    if ! "$_py" -c "$_new_enough" >/dev/null 2>&1; then
      echo "setup.sh: $_py is not Python >= 3.10 (or does not run); set PYTHON to one, e.g. PYTHON=python3.12" >&2
      exit 2
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
)
_setup_rc=$?
if [ "$_setup_rc" -eq 0 ]; then
  # shellcheck disable=SC1091
  . "$_setup_root/.venv/bin/activate"
fi
# The status is expanded before the unset: nothing of this script is left in a sourcing shell.
eval "unset _setup_root _setup_rc; return $_setup_rc 2>/dev/null || exit $_setup_rc"
