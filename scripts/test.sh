#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Without a GPU, Triton kernels run under the Triton
# interpreter (fp32/fp16) and CuTe DSL kernels are compiled for sm_90a with fake tensors; with a
# GPU the `gpu`-marked tests also run (bf16/fp16 numerics against the reference).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
python -m pytest -q "$@"
