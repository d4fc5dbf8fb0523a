#!/usr/bin/env bash
# Set up the virtual environment (DMUON_VENV, default .venv; DMUON_TORCH picks its torch, see
# scripts/setup_env.sh) if needed, lint (ruff check, ruff format --check), type-check dmuon_fsdp/,
# recipes/, instruments/ and benchmarks/ (mypy; its settings in pyproject.toml), then run the
# whole test suite in parallel (CPU + gloo).
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev,recipes,scale
VENV=${DMUON_VENV:-.venv}
"$VENV"/bin/ruff check --quiet .
"$VENV"/bin/ruff format --check --quiet .
"$VENV"/bin/python -m mypy
exec "$VENV"/bin/python -m pytest -n "${DMUON_TEST_WORKERS:-2}" "$@"
