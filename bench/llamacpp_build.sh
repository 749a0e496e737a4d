#!/usr/bin/env bash
# Builds llama.cpp's llama-server from source for bench/vs_llamacpp.py (issue 14).
#
#   bash bench/llamacpp_build.sh        # prints the llama-server binary's path last
#
# Only package registries are reachable from here, so the source is the pip sdist of
# llama-cpp-python, which vendors llama.cpp under vendor/llama.cpp (its CHANGELOG names the
# upstream commit). It is unpacked into a cache directory outside the repo and only the
# llama-server target is built, in Release, with ggml's own default CPU flags (GGML_NATIVE is left
# at its default, so the build targets this machine's CPU, as a user's own build would).
# Idempotent: an existing binary is reused; delete $LLAMACPP_DIR to rebuild.
#
# Settings (environment):
#   LLAMACPP_PY_VERSION  llama-cpp-python sdist version (default 0.3.36: llama.cpp 0c1e57098)
#   LLAMACPP_DIR         cache dir (default ~/.cache/llmserve/llama.cpp-$LLAMACPP_PY_VERSION)
#   LLAMACPP_JOBS        parallel compile jobs (default 2)
#   PYTHON               python with pip (default: the repo's .venv, else python3)
#
# Besides the flags asked for (Release, no curl), the configure turns off what would need the
# network or is not llama-server: tests, examples, the web UI (npm build or a Hugging Face
# download) and OpenSSL (HTTPS model downloads). LLAMA_CURL is deprecated in this llama.cpp (it
# is a no-op with a CMake warning) but kept so an older pinned version builds without curl too.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
DIR="${LLAMACPP_DIR:-$HOME/.cache/llmserve/llama.cpp-$VERSION}"
JOBS="${LLAMACPP_JOBS:-2}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built (delete $DIR to rebuild)" >&2
    echo "$BIN"
    exit 0
fi
for tool in cmake gcc g++; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found on PATH" >&2; exit 1; }
done

mkdir -p "$DIR/dl" "$DIR/src"
SDIST="$DIR/dl/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps --dest "$DIR/dl" \
        "llama-cpp-python==$VERSION" >&2
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$DIR/src"
fi

start=$(date +%s)
cd "$SRC"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build build --target llama-server -j"$JOBS" >&2
echo "built llama-server in $(($(date +%s) - start)) s" >&2
"$BIN" --version >&2 || true
echo "$BIN"
