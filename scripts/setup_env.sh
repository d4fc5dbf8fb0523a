#!/usr/bin/env bash
# Create the virtual environment (DMUON_VENV, default .venv) if missing and install dmuon_fsdp with
# the extras given as the first argument (default: dev,recipes, what the tests need; the demo asks
# for recipes alone). torch first, saying which build it took:
#   - DMUON_TORCH set: that requirement, as given, installed whenever the environment's torch does
#     not meet it (e.g. DMUON_TORCH="torch==2.14.1"; a torch newer than pip's configured sources
#     allow may need PIP_CONFIG_FILE=/dev/null, and a CPU build PyTorch's CPU index:
#     DMUON_TORCH="torch==2.15.0 --index-url https://download.pytorch.org/whl/cpu");
#   - none installed and an NVIDIA GPU: torch>=2.13 from pip's sources (the package index serves
#     the CUDA build);
#   - none installed and no NVIDIA GPU: torch==2.13.0 from PyTorch's CPU wheel index when it
#     answers, so that no CUDA wheels are downloaded; otherwise from pip's configured sources (a
#     local wheel, a mirror), which on Linux may be the CUDA build: the last line says which came.
# The package's extras never move the torch installed (their pins leave it alone).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${DMUON_VENV:-.venv}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ -n "${DMUON_TORCH:-}" ]; then
    echo "setup: torch from DMUON_TORCH ($DMUON_TORCH)"
    # shellcheck disable=SC2086  # (a requirement and, possibly, pip options)
    "$VENV/bin/python" -m pip install -q $DMUON_TORCH
    installed=1
elif ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found: torch>=2.13 from pip's sources"
        "$VENV/bin/python" -m pip install -q "torch>=2.13"
    elif "$VENV/bin/python" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
        echo "setup: no NVIDIA GPU: torch==2.13.0 CPU build from $CPU_INDEX"
        "$VENV/bin/python" -m pip install -q --index-url "$CPU_INDEX" "torch==2.13.0"
    else
        echo "setup: no NVIDIA GPU and $CPU_INDEX does not answer: torch==2.13.0 from pip's configured sources"
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
    installed=1
fi
"$VENV/bin/python" -m pip install -q -e ".[${1:-dev,recipes}]"
if [ -n "${installed:-}" ]; then  # after the package, whose numpy torch imports quietly
    "$VENV/bin/python" -c "import torch; print('setup: torch', torch.__version__, '(CUDA %s build)' % torch.version.cuda if torch.version.cuda else '(CPU build)')"
fi
