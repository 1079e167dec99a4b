#!/usr/bin/env bash
# Several-GPU evidence: data-parallel training (1 and N GPUs, balanced and plain shards) and the tuning
# farm (1 and N workers, one per GPU). Logs and JSON under $OUT. Needs the project's dependencies on
# PYTHONPATH, torchrun, and for the farm the PostgreSQL server (pgserver wheel or initdb/pg_ctl on PATH).
#
#   bash scripts/multi_gpu_evidence.sh ddp  [N]     # seed-jagged, tuned kernels: 1 GPU, N GPUs x {workload, none}
#   bash scripts/multi_gpu_evidence.sh farm [N]     # 8 tasks (fwd, bwd x 4 buckets) on a fresh farm with 1, then N workers
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
step="${1:?usage: multi_gpu_evidence.sh ddp|farm [N]}"
n="${2:-$(nvidia-smi -L | wc -l)}"
steps="${STEPS:-15}"
preset="${PRESET:-seed-jagged}"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/gpus.txt" 2>&1 || true
case "$step" in
ddp)
  train() {  # $1 = GPUs, $2 = balance
    torchrun --standalone --nproc-per-node "$1" -m models.train --preset "$preset" --kernels tuned \
      --allow-same-arch --steps "$steps" --warmup 3 --log-every 5 --no-progress --balance "$2" \
      --json "$OUT/ddp_${preset}_n$1_$2.json" 2>&1 | grep -v "^\[W\|Warning" | tail -4
  }
  train 1 workload
  train "$n" workload
  train "$n" none
  ;;
farm)
  for w in 1 "$n"; do  # a fresh storage per run: the same task set on one storage would be done already
    url=$(python -m autotune.tuning.pg_local start "${PGROOT:-/tmp}/pgdata_w$w" | tail -1)
    start=$(date +%s)
    python -m autotune.tuning.cli run --gpu auto --storage "$url" --workers "$w" --kernel fwd,bwd --dims 256 \
      --heads 4 --buckets 1K,2K,4K,8K --distributions uniform --trials "${TRIALS:-6}" --verify quick \
      --time-budget "${BUDGET:-4m}" --artifacts "$OUT/farm_artifacts_w$w" >"$OUT/farm_w$w.log" 2>&1
    echo "farm with $w worker(s): rc=$? wall $(($(date +%s) - start)) s" | tee -a "$OUT/farm_wall.txt"
    tail -3 "$OUT/farm_w$w.log"
    python -m autotune.tuning.pg_local stop "${PGROOT:-/tmp}/pgdata_w$w" >/dev/null 2>&1 || true
    rm -rf "${PGROOT:-/tmp}/pgdata_w$w"
  done
  ;;
*)
  echo "unknown step $step" >&2
  exit 2
  ;;
esac
