#!/usr/bin/env bash
# Set up .venv if needed, lint (ruff check, ruff format --check), type-check dmuon_fsdp/,
# recipes/, instruments/ and benchmarks/ (mypy; its settings in pyproject.toml), then run the
# whole test suite in parallel (CPU + gloo).
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev,recipes,scale
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -n "${DMUON_TEST_WORKERS:-2}" "$@"
