#!/usr/bin/env bash
# Set up (if needed) and run the main job: tune the kernels for a GPU and write artifacts/<gpu>/.
# Arguments go to `autotune run` (default: --gpu h100).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
if [ $# -eq 0 ]; then set -- --gpu h100; fi
exec autotune run "$@"
