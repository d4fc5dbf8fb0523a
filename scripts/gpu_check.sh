#!/usr/bin/env bash
# GPU checks, one command on a CUDA machine (uses its python3 and torch, no install):
# correctness against the float64 reference on NCCL (tests/test_cuda.py, one rank per GPU),
# Newton-Schulz throughput, the optimizer benchmark on the 124M preset, standard against Gram
# Newton-Schulz (per shape in bf16, and the 124M step with ns_algorithm="auto"), a short
# pretraining run (AdamW, DMuonFSDP, DMuonFSDP with --overlap-backward), and the layout tests
# under this torch.
#   bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
GPUS=$(nvidia-smi -L | wc -l)
step() { echo; echo "== $*"; local t=$1; shift; timeout "$t" "$@" 2>&1 | grep -v -e "Warning" -e "^W1" -e "^\*\*\*"; }
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py
step 90 python3 -m benchmarks.bench_optimizer --ns-throughput --out "$OUT/bench.json"
step 90 python3 -m benchmarks.bench_optimizer --ns-throughput --preset 124m --out "$OUT/bench_124m_ns.json"
step 150 python3 -m benchmarks.bench_optimizer --world-size "$GPUS" --preset 124m --out "$OUT/bench_124m.json"
step 120 python3 -m benchmarks.bench_ns_forms --presets cpu-bench 124m 1b --dtype bfloat16 --out "$OUT/ns_forms.json"
step 120 python3 -m benchmarks.bench_ns_forms --step --preset 124m --world-size "$GPUS" --steps 30 --out "$OUT/ns_forms_step.json"
for opt in dmuon adamw; do
    step 150 torchrun --standalone --nproc-per-node "$GPUS" -m recipes.pretrain --preset 124m --optimizer $opt \
        --steps 60 --val-every 30 --no-progress --run-dir "$OUT/pretrain_$opt"
done
# overlap_backward: the same run with each layer's exchange started in backward (about 14 MiB of
# bf16 Muon matrices per 124m layer)
step 150 torchrun --standalone --nproc-per-node "$GPUS" -m recipes.pretrain --preset 124m --optimizer dmuon \
    --overlap-backward --bucket-mib 16 --steps 60 --val-every 30 --no-progress --run-dir "$OUT/pretrain_dmuon_overlap"
step 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_meshes.py tests/test_layouts.py tests/test_single_process.py
