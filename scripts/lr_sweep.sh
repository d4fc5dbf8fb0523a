#!/usr/bin/env bash
# The learning-rate sweep behind the demo's defaults: cpu-demo preset, 2 CPU ranks, same steps.
#   bash scripts/lr_sweep.sh [steps] [which]  -> runs/sweep/<run>/summary.json, runs/sweep/summary.md
# which: all (default), muon (DMuonFSDP and AdamW), normuon (DMuonFSDP with --variant normuon) or
# adamw-lr (DMuonFSDP at lr 0.01 with the AdamW side's --adamw-lr swept).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-400}
WHICH=${2:-all}
run() {  # run NAME OPTIMIZER LR [more flags]
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --no-progress \
        --steps "$STEPS" --optimizer "$2" --lr "$3" --run-dir "runs/sweep/$1-lr$3" --overwrite "${@:4}"
}
if [ "$WHICH" = adamw-lr ]; then
    for alr in 0.0003 0.001 0.003 0.01; do run dmuon-adamw"$alr" dmuon 0.01 --adamw-lr "$alr"; done
elif [ "$WHICH" != normuon ]; then
    for lr in 0.005 0.01 0.02 0.04; do run dmuon dmuon "$lr"; done
    for lr in 0.001 0.003 0.006; do run adamw adamw "$lr"; done
fi
if [ "$WHICH" = all ] || [ "$WHICH" = normuon ]; then
    for lr in 0.005 0.01 0.02 0.04; do run normuon dmuon "$lr" --variant normuon; done
fi
.venv/bin/python -m recipes.report runs/sweep
