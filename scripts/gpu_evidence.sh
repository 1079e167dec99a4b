#!/usr/bin/env bash
# The GPU evidence runs behind docs/RESULTS.md, one step per argument, logs and JSON under $OUT.
#
#   bash scripts/gpu_evidence.sh tune [autotune run args...]   # the tuning run; artifacts -> $OUT/artifacts.tar
#   bash scripts/gpu_evidence.sh model                          # seed-preset model: default vs tuned vs reference
#   bash scripts/gpu_evidence.sh bench                          # tuned vs default per bucket (autotune bench)
#   bash scripts/gpu_evidence.sh verify [autotune verify args...] # every committed entry re-checked, --write
#   bash scripts/gpu_evidence.sh tests [pytest args...]         # GPU-marked tests
#
# Meant for a GPU host that already has the project's dependencies on PYTHONPATH (see README, "GPU host").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
step="${1:?usage: gpu_evidence.sh tune|model|bench|verify|tests [args...]}"
shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/gpu.txt" 2>&1 || true
case "$step" in
tune)
  start=$(date +%s)
  python -m autotune.tuning.cli run --gpu auto "$@" 2>&1 | tee "$OUT/tune.log" | tail -5
  rc=$?
  echo "tune wall time: $(($(date +%s) - start)) s" | tee -a "$OUT/tune.log"
  tar cf "$OUT/artifacts.tar" artifacts || rc=$((rc ? rc : 1))
  exit "$rc" # the tuner's status (1: a task failed), not tar's: what it wrote is packed either way
  ;;
model)
  python benchmarks/bench_model.py --preset "${PRESET:-seed}" --artifacts artifacts --steps 10 \
    --reference-steps 2 --warmup 2 --workers 2 --no-progress --json "$OUT/model.json" "$@" 2>&1 |
    tee "$OUT/model.log" | tail -12
  ;;
bench)
  python -m autotune.tuning.cli bench --gpu auto "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
  ;;
verify)
  python -m autotune.tuning.cli verify --gpu auto --jobs "${JOBS:-12}" --write --json "$OUT/verify.json" "$@" 2>&1 |
    tee "$OUT/verify.log" | tail -5
  rc=$?
  tar cf "$OUT/artifacts.tar" artifacts || rc=$((rc ? rc : 1))
  exit "$rc" # 1 when an entry failed its re-check
  ;;
tests)
  python -m pytest -q -m gpu "$@" 2>&1 | tee "$OUT/tests.log" | tail -15
  ;;
*)
  echo "unknown step $step" >&2
  exit 2
  ;;
esac
