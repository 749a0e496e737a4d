#!/usr/bin/env bash
# The one command for the GPU machine: the GPU tests of kernels/ (correctness against
# kernels/reference.py), then the kernel benchmark (bench/kernels_bench.py). Logs and JSON go to
# $OUT (the device tool's output folder; bench/results/ when $OUT is unset); the benchmark's
# short table and the target verdicts are printed last. Budget: under 5 minutes in one call.
#
#   device tool:  run(command="bash bench/gpu_check.sh", timeout_s=420)
#   elsewhere:    bash bench/gpu_check.sh
#
# Needs there: python3 with torch (CUDA), cupy-cuda13x, pytest. Nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, torch, cupy; print(sys.version.split()[0], torch.__version__, cupy.__version__)"
} 2>&1 | tee "$OUT/env.txt"

timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_cuda.py -p no:cacheprovider \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

left=$((285 - ($(date +%s) - start)))
if [ "$left" -lt 60 ]; then left=60; fi
timeout "$left" python3 bench/kernels_bench.py --out "$OUT/kernels_h200.json" \
    --budget-s $((left - 40)) 2>&1 |
    tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo
echo "== gpu tests: exit $tests_rc | $(tail -n 1 "$OUT/tests.log")"
echo "== benchmark: exit $bench_rc | total $(($(date +%s) - start)) s | files in $OUT"
if [ -f "$OUT/kernels_h200.json" ]; then
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["summary"])' \
        "$OUT/kernels_h200.json"
fi
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
