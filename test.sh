#!/usr/bin/env bash
# Lint, type-check and run the whole test suite on the CPU. Sets itself up on first run.
# Extra arguments go to pytest (e.g. ./test.sh -k scheduler).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
python -m pytest -q --durations=25 "$@"
