#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite in parallel (CPU + gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${DMUON_TEST_WORKERS:-2}" "$@"
