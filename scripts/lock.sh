#!/usr/bin/env bash
# Regenerate the locked development environments, requirements/dev-py3{11,12}.txt, from
# pyproject.toml's ranges (the `dev` extra). scripts/setup.sh installs from them, so ./test.sh,
# ./quickstart.sh and CI get the same versions whatever was released since.
#
#   scripts/lock.sh                 # resolve again within pyproject's ranges, newest first
#   scripts/lock.sh --upgrade-package transformers   # extra arguments go to `uv pip compile`
#
# Run scripts/check_latest.sh first: it tries the newest releases of everything on purpose.
#
# torch is left out of the locks (scripts/setup.sh installs it first: the CPU build where one is
# on the machine, else PyPI's, which brings its CUDA libraries); the version the locks are made
# against is TORCH below, and the CUDA libraries of PyPI's torch are left out with it.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.13.0
uv=$(command -v uv || true)
if [ -z "$uv" ]; then
  tools=${XDG_CACHE_HOME:-$HOME/.cache}/llmserve/uv-venv
  [ -x "$tools/bin/uv" ] || { python3 -m venv "$tools" && "$tools/bin/pip" install -q uv; }
  uv=$tools/bin/uv
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH" >"$constraints"
for py in 3.11 3.12; do
  out=requirements/dev-py${py/./}.txt
  # The packages only torch's PyPI wheel needs (CUDA runtime libraries, triton): not locked.
  skip=$("$uv" pip compile pyproject.toml --extra dev --python-version "$py" \
    --python-platform x86_64-manylinux_2_28 -c "$constraints" --no-header --no-annotate -q "$@" \
    | sed -nE 's/^((nvidia|cuda)-[a-z0-9-]+|triton)==.*/\1/p')
  "$uv" pip compile pyproject.toml --extra dev --python-version "$py" \
    --python-platform x86_64-manylinux_2_28 -c "$constraints" -o "$out" -q \
    --custom-compile-command "scripts/lock.sh" --no-emit-package torch \
    $(printf -- '--no-emit-package %s ' $skip) "$@"
  echo "wrote $out"
done
