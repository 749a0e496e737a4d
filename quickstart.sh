#!/usr/bin/env bash
# Start the whole stack (gateway, scheduler, engine) on the built-in SmolLM2-135M-Instruct, ask it
# a question, then keep serving on localhost:50051 until Ctrl-C. Sets itself up on first run.
#   ./quickstart.sh          serve until Ctrl-C
#   ./quickstart.sh --once   stop after the answer
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
. .venv/bin/activate
export LLMSERVE_LOG_LEVEL=${LLMSERVE_LOG_LEVEL:-WARNING}
llmserve serve --port 50051 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
trap 'exit 0' INT TERM
llmserve health --address localhost:50051 --wait 600 >/dev/null
echo "> What is the capital of France?"
llmserve chat "What is the capital of France?" --temperature 0 --max-tokens 64
[ "${1:-}" = "--once" ] && exit 0
echo "Serving on localhost:50051. In another terminal: .venv/bin/llmserve chat   (Ctrl-C stops)"
wait $server
