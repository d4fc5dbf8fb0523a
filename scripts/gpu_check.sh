#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine (its python3 and torch, no install): every
# collective path of the step on CUDA (four processes sharing one GPU over gloo; with several
# GPUs, NCCL at every GPU count), syncs per step, memory over alternating gradient sets, the
# 124m step time against AdamW and the CUDA sanitizer over steps begun in backward, printed as
# one table (tests/gpu_check.py says what each row checks). Under 10 minutes on one H200.
#   bash scripts/gpu_check.sh [OUT_DIR]        # --dry-run as the 2nd argument: the same on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi -L
PYTHON=${PYTHON:-python3}  # the machine's own; a checkout's .venv where that has no torch (a dry run here)
"$PYTHON" -c "import torch" 2>/dev/null || { [ -x .venv/bin/python ] && PYTHON=.venv/bin/python; }
timeout 590 "$PYTHON" -m tests.gpu_check --out "$OUT" ${2:-} 2>&1 | tee "$OUT/gpu_check.log" \
    | grep -v -e "Warning" -e "^W1" -e "warnings.warn"
exit "${PIPESTATUS[0]}"
