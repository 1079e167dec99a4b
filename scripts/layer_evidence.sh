#!/usr/bin/env bash
# GPU evidence of the whole-layer work, one step per argument; logs and JSON under $OUT.
#
#   bash scripts/layer_evidence.sh tests              # numerics of the layer ops and the fused layer (bf16, GPU)
#   bash scripts/layer_evidence.sh tune [args...]     # tune the layer's non-attention ops -> $OUT/artifacts.tar
#   bash scripts/layer_evidence.sh ops                # each op vs its torch path and a copy kernel's bandwidth
#   bash scripts/layer_evidence.sh layer              # one layer, column by column (benchmarks/bench_layer.py)
#   bash scripts/layer_evidence.sh model [preset]     # today's tuned path vs the fused layer, same data
#   bash scripts/layer_evidence.sh profile [preset]   # device time per kernel group and copy kernels
#   bash scripts/layer_evidence.sh graphs [preset]    # eager vs CUDA-graph training steps (GPU tests first)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
step="${1:?usage: layer_evidence.sh tests|tune|ops|layer|model|profile|graphs}"
shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/gpu.txt" 2>&1 || true
FUSED="tuned:layer=fused"
BF16="tuned:layer=fused,precision=bf16"
case "$step" in
tests)
  python -m pytest -q tests/test_layer_norm.py tests/test_fused_ln_mul_dropout.py tests/test_gemm_silu_bwd.py \
    tests/test_linear_residual.py tests/test_linear_residual_bwd.py tests/test_fused_layer.py tests/test_strided_views.py \
    tests/test_gemm_silu.py "$@" 2>&1 |
    tee "$OUT/tests.log" | tail -15
  ;;
tune)
  start=$(date +%s)
  python -m autotune.tuning.cli run --gpu auto --kernel "${KERNELS:-layer}" --dims 256 --heads 4 \
    --buckets "${BUCKETS:-1K,2K,4K,8K}" --distributions "${DISTS:-uniform}" --verify quick "$@" 2>&1 |
    tee "$OUT/tune.log" | tail -40
  rc=$?
  echo "tune wall time: $(($(date +%s) - start)) s" | tee -a "$OUT/tune.log"
  tar cf "$OUT/artifacts.tar" --exclude studies artifacts || rc=$((rc ? rc : 1))
  exit "$rc" # the tuner's status (1: a task failed), not tar's
  ;;
ops)
  python benchmarks/bench_layer_ops.py --artifacts artifacts "$@" 2>&1 | tee "$OUT/ops.log" | tail -40
  ;;
layer)
  python benchmarks/bench_layer.py --artifacts artifacts --allow-same-arch "$@" 2>&1 | tee "$OUT/layer.log" | tail -12
  ;;
model)
  preset="${1:-seed}"
  shift || true
  python benchmarks/bench_model.py --preset "$preset" --artifacts artifacts --kernels tuned "$FUSED" "$BF16" \
    --base tuned --steps "${STEPS:-15}" --warmup 3 --workers 2 --no-progress \
    --json "$OUT/model_$preset.json" "$@" 2>&1 | tee "$OUT/model_$preset.log" | tail -14
  ;;
profile)
  preset="${1:-seed}"
  # sed, not head: head's early exit killed tee (the log's rest) and then the profile by a broken pipe
  python benchmarks/profile_model.py --preset "$preset" --kernels tuned --steps 3 --warmup 3 \
    --json "$OUT/profile_${preset}_unfused.json" 2>&1 | tee "$OUT/profile_${preset}.log" | sed -n 1,30p
  rc=$?
  python benchmarks/profile_model.py --preset "$preset" --kernels tuned --steps 3 --warmup 3 \
    --set layer=fused precision=bf16 --json "$OUT/profile_${preset}_fused.json" 2>&1 |
    tee -a "$OUT/profile_${preset}.log" | sed -n 1,30p || rc=$?
  exit "$rc"
  ;;
graphs)
  preset="${1:-seed}"
  shift || true
  python -m pytest -q tests/test_graphs.py 2>&1 | tee -a "$OUT/graph_tests.log" | tail -4
  rc=$?
  python benchmarks/bench_model.py --preset "$preset" --artifacts artifacts --kernels tuned "$BF16" --cuda-graph \
    --base tuned --steps "${STEPS:-15}" --warmup 3 --workers 2 --no-progress \
    --json "$OUT/graphs_$preset.json" "$@" 2>&1 | tee "$OUT/graphs_$preset.log" | tail -14 || rc=$?
  exit "$rc" # failed GPU tests fail the step even when the benchmark after them runs
  ;;
*)
  echo "unknown step $step" >&2
  exit 2
  ;;
esac
