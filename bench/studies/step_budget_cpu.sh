#!/usr/bin/env bash
# Issue 42 (third session): the CPU's step budget, --max-num-batched-tokens 2048 (A, the old
# default) against the default (B: 0, 512 tokens a step on a CPU), both stacks up at once
# (the built-in SmolLM2-135M-Instruct, --cpu-dense-rows 48 on both so that the crossover
# measured at start under load does not differ between them), the workload of `vllm bench
# serve --random-input-len 128 --random-output-len 128 --ignore-eos` at 16 and 64 at once, one
# pair per seed (a new seed each pair: the same prompts twice would hit the prefix cache).
#   bash bench/studies/step_budget_cpu.sh [SEEDS...]   # ~4 minutes a pair on 2 loaded cores
# JSON (and each run's load average, in runs.log) in bench/results/step_budget_cpu_issue42_s3/.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
out=bench/results/step_budget_cpu_issue42_s3
mkdir -p "$out"
start() { # port base, extra flags
  LLMSERVE_LOG_LEVEL=WARNING python -m llmserve.cli serve --device cpu --cpu-dense-rows 48 \
    --port "${1}1" --scheduler-port "${1}2" --engine-port "${1}3" --http-port "${1}4" \
    --metrics-port 0 "${@:2}" >/dev/null 2>&1 &
}
start 1940 --max-num-batched-tokens 2048
a=$!
start 1950
b=$!
trap 'kill -TERM $a $b 2>/dev/null; wait $a $b 2>/dev/null || true' EXIT
python -m llmserve.cli health --address localhost:19401 --wait 600 >/dev/null
python -m llmserve.cli health --address localhost:19501 --wait 600 >/dev/null
run() { # arm at_once num_prompts seed
  local port=19401
  [ "$1" = B ] && port=19501
  echo "$1 c$2 seed $4 start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/runs.log"
  python -m llmserve.cli bench serve --backend grpc --address "localhost:$port" \
    --dataset-name random --range-ratio 0 --num-prompts "$3" --input-len 128 --output-len 128 \
    --ignore-eos --max-concurrency "$2" --request-rate inf --seed "$4" --no-progress \
    --label "$1" --output "$out/c$2_$1_seed$4.json"
  echo "$1 c$2 seed $4 end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/runs.log"
}
for seed in "${@:-2}"; do
  run B 16 32 "$seed"; run A 16 32 "$seed"
  run A 64 64 "$((seed + 1))"; run B 64 64 "$((seed + 1))"
done
