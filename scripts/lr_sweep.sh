#!/usr/bin/env bash
# The learning-rate sweep behind the demo's defaults: cpu-demo preset, 2 CPU ranks, same steps.
#   bash scripts/lr_sweep.sh [steps] [which]  -> runs/sweep/<run>/summary.json, runs/sweep/summary.md
# which: all (default), muon (DMuonFSDP and AdamW), normuon (DMuonFSDP with --variant normuon),
# adamw-lr (DMuonFSDP at lr 0.01 with the AdamW side's --adamw-lr swept) or sizes (three presets,
# tiny, cpu-demo and cpu-bench: DMuonFSDP's lr, DMuonFSDP with --adjust-lr-fn match_rms_adamw at
# AdamW's lrs, and AdamW, fewer lrs on cpu-bench; -> runs/sweep-sizes/summary.md).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-400}
WHICH=${2:-all}
PRESET=cpu-demo
OUT=runs/sweep
run() {  # run NAME OPTIMIZER LR [more flags]
    .venv/bin/torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset "$PRESET" --no-progress \
        --steps "$STEPS" --optimizer "$2" --lr "$3" --run-dir "$OUT/$1-lr$3" --overwrite "${@:4}"
}
if [ "$WHICH" = sizes ]; then
    OUT=runs/sweep-sizes
    for PRESET in tiny cpu-demo cpu-bench; do
        MUON="0.005 0.01 0.02 0.04" RMS="0.001 0.003 0.006" ADAMW="0.001 0.003 0.006"
        if [ "$PRESET" = cpu-bench ]; then  # about 7 min a run on 2 cores: the smaller lrs only
            MUON="0.005 0.01 0.02" RMS="0.003" ADAMW="0.003"
        fi
        for lr in $MUON; do run "$PRESET-dmuon" dmuon "$lr"; done
        for lr in $RMS; do run "$PRESET-dmuon-rms" dmuon "$lr" --adjust-lr-fn match_rms_adamw; done
        for lr in $ADAMW; do run "$PRESET-adamw" adamw "$lr"; done
    done
    .venv/bin/python -m recipes.report "$OUT"
    exit 0
fi
if [ "$WHICH" = adamw-lr ]; then
    for alr in 0.0003 0.001 0.003 0.01; do run dmuon-adamw"$alr" dmuon 0.01 --adamw-lr "$alr"; done
elif [ "$WHICH" != normuon ]; then
    for lr in 0.005 0.01 0.02 0.04; do run dmuon dmuon "$lr"; done
    for lr in 0.001 0.003 0.006; do run adamw adamw "$lr"; done
fi
if [ "$WHICH" = all ] || [ "$WHICH" = normuon ]; then
    for lr in 0.005 0.01 0.02 0.04; do run normuon dmuon "$lr" --variant normuon; done
fi
.venv/bin/python -m recipes.report "$OUT"
