#!/usr/bin/env bash
# The learning-rate sweep behind the demo's defaults: cpu-demo preset, 2 CPU ranks, same steps.
#   bash scripts/lr_sweep.sh [steps]     -> runs/sweep/<optimizer>-lr<lr>/summary.json
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-400}
run() {
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --no-progress \
        --steps "$STEPS" --optimizer "$1" --lr "$2" --run-dir "runs/sweep/$1-lr$2" --overwrite "${@:3}"
}
for lr in 0.005 0.01 0.02 0.04; do run dmuon "$lr"; done
for lr in 0.001 0.003 0.006; do run adamw "$lr"; done
.venv/bin/python -m recipes.report runs/sweep
