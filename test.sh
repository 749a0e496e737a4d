#!/usr/bin/env bash
# Lint, type-check and run the whole test suite on the CPU. Sets itself up on first run.
# Extra arguments go to pytest (e.g. ./test.sh -k scheduler).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
# mypy runs beside pytest: a cold run is ~20 s of one core, which overlaps the stack tests'
# waits on subprocesses and sockets. Its verdict is printed, and counts, after pytest's.
mypy_log=$(mktemp)
trap 'rm -f "$mypy_log"' EXIT
mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Let the test processes keep the bytecode they compile (each stack test starts processes that
# import torch and transformers; compiling them again in each one costs seconds of CPU).
unset PYTHONDONTWRITEBYTECODE
# Three workers on the 2-core VM: stack tests spend much of their time waiting on subprocesses
# and sockets (two workers kept 1.4 cores busy on average; three: 7 min 17 s -> 6 min 23 s of
# pytest, measured once each on that VM). --dist loadgroup keeps the tests that share a
# module-scoped fixture (a stack) on one worker, so it starts once, and spreads the rest
# (tests/conftest.py: group_by_shared_fixture).
# `./test.sh -n 0` runs in one process; the 30 slowest tests are listed at the end.
rc=0
python -m pytest -q -n 3 --dist loadgroup --durations=30 "$@" || rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "mypy:"
cat "$mypy_log"
[ "$mypy_rc" -eq 0 ] || exit "$mypy_rc"
exit "$rc"
