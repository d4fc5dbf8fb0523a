#!/usr/bin/env bash
# Create .venv (if missing) and install dmuon_fsdp with its dev and recipes extras.
# On a machine without an NVIDIA GPU, torch is pinned first to the CPU build so that pip never
# pulls the multi-GB CUDA wheels; set DMUON_TORCH to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_REQ=${DMUON_TORCH:-"torch>=2.6"}
    else
        TORCH_REQ=${DMUON_TORCH:-"torch==2.13.0"}
    fi
    .venv/bin/python -m pip install -q "$TORCH_REQ"
fi
.venv/bin/python -m pip install -q -e ".[dev,recipes]"
