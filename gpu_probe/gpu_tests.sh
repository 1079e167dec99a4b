#!/usr/bin/env bash
# GPU tests of the suite on whatever GPU this host has; logs + junit under $OUT.
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD >> "$OUT/gpu.txt" 2>&1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
first="tests/test_input_safety.py tests/test_hstu_attention.py tests/test_gemm_silu.py tests/test_graphs.py tests/test_ops.py tests/test_heatmap.py tests/test_tile_table.py tests/test_recheck.py tests/test_measure_gpu.py tests/test_dispatch.py"
timeout ${T1:-200} python -m pytest -q -p no:cacheprovider $first --junitxml="$OUT/junit1.xml" > "$OUT/pytest1.log" 2>&1
echo "rc=$?" >> "$OUT/pytest1.log"
timeout ${T2:-120} python -m pytest -q -p no:cacheprovider -m gpu tests/test_cute_hstu_fwd.py tests/test_cute_hstu_bwd.py --junitxml="$OUT/junit2.xml" > "$OUT/pytest2.log" 2>&1
echo "rc=$?" >> "$OUT/pytest2.log"
