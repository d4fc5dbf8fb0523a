#!/usr/bin/env bash
# Create .venv (if missing) and install dmuon_fsdp with the extras given as the first argument
# (default: dev,recipes, what the tests need; the demo asks for recipes alone).
# torch first, when .venv has none, saying which build it took:
#   - DMUON_TORCH set: that requirement, as given (e.g. DMUON_TORCH="torch==2.13.0");
#   - an NVIDIA GPU: torch>=2.6 from pip's sources (the package index serves the CUDA build);
#   - no NVIDIA GPU: torch==2.13.0 from PyTorch's CPU wheel index when it answers, so that no
#     CUDA wheels are downloaded; otherwise from pip's configured sources (a local wheel, a
#     mirror), which on Linux may be the CUDA build: the last line says which build came.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ -n "${DMUON_TORCH:-}" ]; then
        echo "setup: torch from DMUON_TORCH ($DMUON_TORCH)"
        .venv/bin/python -m pip install -q "$DMUON_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found: torch>=2.6 from pip's sources"
        .venv/bin/python -m pip install -q "torch>=2.6"
    elif .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
        echo "setup: no NVIDIA GPU: torch==2.13.0 CPU build from $CPU_INDEX"
        .venv/bin/python -m pip install -q --index-url "$CPU_INDEX" "torch==2.13.0"
    else
        echo "setup: no NVIDIA GPU and $CPU_INDEX does not answer: torch==2.13.0 from pip's configured sources"
        .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
    installed=1
fi
.venv/bin/python -m pip install -q -e ".[${1:-dev,recipes}]"
if [ -n "${installed:-}" ]; then  # after the package, whose numpy torch imports quietly
    .venv/bin/python -c "import torch; print('setup: torch', torch.__version__, '(CUDA %s build)' % torch.version.cuda if torch.version.cuda else '(CPU build)')"
fi
