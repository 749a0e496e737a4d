#!/usr/bin/env bash
# Issue 7's comparison: the same workload through the gRPC API and the OpenAI HTTP API of one
# running stack (built-in SmolLM2-135M-Instruct on the CPU), twice each, alternating. Prefix
# caching is off: every run sends the same seeded prompts, which would otherwise hit the cache.
#   bash bench/studies/http_vs_grpc.sh            # ~4 minutes on 2 cores; JSON in bench/results/http_vs_grpc/
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
llmserve() { python -m llmserve.cli "$@"; }  # this checkout's code, whatever is installed
out=bench/results/http_vs_grpc
mkdir -p "$out"
grpc_port=${GRPC_PORT:-51051}
http_port=${HTTP_PORT:-58000}
LLMSERVE_LOG_LEVEL=WARNING python -m llmserve.cli serve --port "$grpc_port" --http-port "$http_port" \
  --scheduler-port 51052 --engine-port 51053 --metrics-port 0 --kv-cache-gb 1 --no-prefix-caching >/dev/null 2>&1 &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
llmserve health --address "localhost:$grpc_port" --wait 300 >/dev/null
workload=(--dataset-name fixed --num-prompts 32 --input-len 128 --output-len 128
          --request-rate inf --temperature 0 --num-warmups 1 --no-progress)
for round in 1 2; do
  llmserve bench serve --backend grpc --address "localhost:$grpc_port" "${workload[@]}" \
    --label "grpc-$round" --output "$out/grpc-$round.json"
  llmserve bench serve --backend openai --base-url "http://localhost:$http_port" "${workload[@]}" \
    --label "http-$round" --output "$out/http-$round.json"
done
for round in 1 2; do llmserve bench compare "$out/grpc-$round.json" "$out/http-$round.json"; done
