"""Issue 42: what the serving machinery outside the forward costs per output token at many
streams: the gateway (HTTP, detokenizer, SSE), the scheduler and the engine service, measured on the
echo engine (engine/contract/echo.py: no model, each step's tokens made at once) so that nothing but
the machinery runs.

    python -m bench.studies.stack_token_cost [--streams 64 256] [--output-len 128]
        [--out bench/results/stack_token_cost.json]

For each stream count, a fresh stack (`llmserve serve` with the echo engine and the built-in model's
tokenizer) serves that many concurrent streaming /v1/completions requests (a 128-token prompt,
--output-len tokens, ignore_eos), from threads of this process. Each service's CPU seconds (user +
system, /proc/PID/stat) over the run, divided by the output tokens, is its cost per token; beside it
the share of a model step that cost would be, for the CPU decode step times given with --step-ms
(rows:ms pairs measured by `llmserve bench step`: per token a step of B rows costs ms /
B).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmserve.bench.report import hardware, save
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.serve_flags import serve_locally
from llmserve.topology import free_port

ROOT = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)


def stream_one(url: str, prompt: str, output_len: int) -> int:
    """One streaming completion; the number of SSE chunks with text (tokens) it got."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunks += 1
    return chunks


def warm_up(url: str, prompt: str, timeout_s: float = 60.0) -> None:
    """One short request, retried while the gateway answers 503 (ready, but its scheduler has
    not said yet what it serves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stream_one(url, prompt, 4)
            return
        except urllib.error.HTTPError as err:
            if err.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def measure(num_streams: int, output_len: int) -> dict[str, Any]:
    fake = EchoEngineConfig(vocab_size=49152)  # SmolLM2's vocabulary
    prompt = "the quick brown fox jumps over the lazy dog " * 14  # ~128 tokens
    with serve_locally(["--http-port", str(free_port())], 120, fake=fake) as stack:
        url = stack.http_url
        assert url is not None
        warm_up(url, prompt)
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(num_streams) as pool:
            jobs = [pool.submit(stream_one, url, prompt, output_len) for _ in range(num_streams)]
            chunks = [job.result() for job in jobs]
        wall = time.perf_counter() - t0
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    tokens = num_streams * output_len
    return {
        "num_streams": num_streams,
        "output_len": output_len,
        "chunks_received": sum(chunks),
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "cpu_s": spent,
        "cpu_ms_per_token": {name: s * 1e3 / tokens for name, s in spent.items()},
        "loadavg_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--step-ms", nargs="*", default=[], help="rows:ms of the model's decode step, e.g. 64:400"
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stack_token_cost.json")
    args = p.parse_args()
    steps = {int(r): float(ms) for r, ms in (pair.split(":") for pair in args.step_ms)}
    results = []
    for streams in args.streams:
        row = measure(streams, args.output_len)
        total = sum(row["cpu_ms_per_token"].values())
        row["cpu_ms_per_token_total"] = total
        rows = min(steps, key=lambda r: abs(r - streams)) if steps else None
        if rows is not None:
            row["model_ms_per_token"] = steps[rows] / rows
            row["share_of_model_token"] = total / row["model_ms_per_token"]
        results.append(row)
        per = ", ".join(f"{n} {ms:.3f}" for n, ms in row["cpu_ms_per_token"].items())
        share = f" ({row['share_of_model_token']:.1%} of a model token)" if rows else ""
        print(f"{streams} streams: {row['output_tok_s']:.0f} tok/s; CPU ms/token: {per}; "
              f"total {total:.3f}{share}", flush=True)  # fmt: skip
    save({"kind": "stack_token_cost", "hardware": hardware(), "results": results}, args.out)


if __name__ == "__main__":
    main()
