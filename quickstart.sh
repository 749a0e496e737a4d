#!/usr/bin/env bash
# Start the whole stack (gateway, scheduler, engine) on the built-in SmolLM2-135M-Instruct, ask it
# a question, then keep serving on localhost:50051 until Ctrl-C. Sets itself up on first run.
#   ./quickstart.sh          serve until Ctrl-C
#   ./quickstart.sh --once   stop after the answer
# Exits with serve's status when serve fails (a port already in use: 2).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
. .venv/bin/activate
export LLMSERVE_LOG_LEVEL=${LLMSERVE_LOG_LEVEL:-WARNING}
# serve prints "llmserve ready" once the gateway it started answers. Waiting for that line, not
# for a health check, means another server on the port cannot pass for ours, and a serve that
# dies first ends the wait (end of its output).
fifo=$(mktemp -u)
mkfifo "$fifo"
llmserve serve --port 50051 >"$fifo" &
server=$!
exec 3<"$fifo"
rm -f "$fifo"
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
trap 'exit 0' INT TERM
ready=
while IFS= read -r line <&3; do
  echo "$line"
  case $line in "llmserve ready"*) ready=1; break ;; esac
done
if [ -z "$ready" ]; then
  status=0
  wait $server || status=$?
  echo "quickstart: llmserve serve failed (exit $status)" >&2
  exit $((status ? status : 1))
fi
cat <&3 &  # the rest of serve's output
echo "> What is the capital of France?"
llmserve chat "What is the capital of France?" --temperature 0 --max-tokens 64
[ "${1:-}" = "--once" ] && exit 0
echo "Serving on localhost:50051. In another terminal: .venv/bin/llmserve chat   (Ctrl-C stops it)"
wait $server
