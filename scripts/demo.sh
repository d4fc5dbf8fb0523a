#!/usr/bin/env bash
# The main job: set up .venv if needed, then pretrain the cpu-demo Llama-style model on the Python
# standard library's source with DMuonFSDP and with AdamW (same seed, data and steps), on 2 CPU
# ranks (or every GPU when present), print the summary table (the loss plot goes to
# runs/demo/loss.png) and a sample of text from the DMuonFSDP model's final checkpoint.
# A rerun replaces the previous demo (--overwrite). Extra arguments go to recipes.pretrain
# (e.g. --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DMUON_VENV:-.venv}
bash scripts/setup_env.sh recipes  # what the demo runs; the tests' set-up adds the frameworks
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
else
    NPROC=${NPROC:-2}
fi
OUT=${OUT:-runs/demo}
for opt in dmuon adamw; do
    "$VENV"/bin/torchrun --standalone --nproc-per-node "$NPROC" -m recipes.pretrain \
        --preset "${PRESET:-cpu-demo}" --optimizer "$opt" --run-dir "$OUT/$opt" --overwrite "$@"
done
"$VENV"/bin/python -m recipes.report "$OUT"
echo; echo "A sample from the DMuonFSDP model (python -m recipes.sample):"
"$VENV"/bin/python -m recipes.sample --run-dir "$OUT/dmuon" --prompt "def " --tokens 200
