#!/usr/bin/env bash
# The main job: set up .venv if needed, then train the demo model on 2 CPU ranks (or every GPU)
# with DMuonFSDP and with AdamW, same seed and data, and print the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
else
    NPROC=${NPROC:-2}
fi
OUT=${OUT:-runs/demo}
for opt in dmuon adamw; do
    .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" scripts/demo_train.py --optimizer "$opt" --out "$OUT" "$@"
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.load(open(f"{sys.argv[1]}/{o}.json")) for o in ("dmuon", "adamw")]
print("\n| optimizer | ranks | steps | validation loss | median optimizer step (ms) |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['optimizer']} | {r['world_size']} | {r['steps']} | {r['val_loss']:.4f} | {r['median_opt_step_ms']:.2f} |")
PY
