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
# Two workers: most stack tests wait on subprocesses and sockets, so two share the 2-core VM
# well. --dist loadgroup keeps the tests that share a module-scoped fixture (a stack) on one
# worker, so it starts once, and spreads the rest (tests/conftest.py: group_by_shared_fixture).
# `./test.sh -n 0` runs in one process; the 30 slowest tests are listed at the end.
python -m pytest -q -n 2 --dist loadgroup --durations=30 "$@"
