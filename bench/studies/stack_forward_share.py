"""Issue 42: one stream at a time, where a token's time goes: the model's decode step timed
in-process (`llmserve bench step`, batch 1) against the same engine's forward inside the serving
stack, and the token interval a client sees.

    python -m bench.studies.stack_forward_share [--rounds 3] [--requests 3] [--output-len 128]
        [--arm NAME:VAR=VALUE,...] [--concurrency 1] [--out bench/results/stack_forward_share.json]

Per round, in turn (so a machine whose load drifts slows both alike): (A) `llmserve bench step
--arms mode:auto --batches 1` in a process of its own; (B) a fresh `llmserve serve --device cpu`
(the built-in model, its defaults) serving --requests streaming completions one after another
(a 128-token prompt, --output-len tokens, ignore_eos), with the engine's /metrics read before
and after: its forward and step seconds per step, against the wall time per output token.
The gap between (A) and (B)'s forward is what serving beside the scheduler and gateway does to
the forward itself; the gap between (B)'s step and the token interval is the machinery's hop.
With --arm (repeatable), (B) runs once per arm in each round, in turn (the order reversed every
other round), each a stack with the arm's environment (e.g. `--arm before:LLMSERVE_CPU_ONE_REGION=0
--arm after:`); the token interval's median (ITL p50) is kept beside the mean.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.studies.stack_token_cost import warm_up
from llmserve.bench.report import hardware, save
from llmserve.serve_flags import serve_locally
from llmserve.topology import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox jumps over the lazy dog " * 14  # ~128 tokens
ENGINE_METRICS = ("forward", "step")


def in_process_step(steps: int) -> dict[str, Any]:
    """`llmserve bench step` at batch 1 in its own process: median ms per step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        command = [sys.executable, "-m", "llmserve.cli", "bench", "step", "--arms", "mode:auto"]
        command += ["--batches", "1", "--steps", str(steps), "--out", str(out)]
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
        row = json.loads(out.read_text())["results"][0]["rows"][0]
    return {"step_ms": row["step_ms_median"], "loadavg_1m": os.getloadavg()[0]}


def engine_seconds(metrics_url: str) -> dict[str, float]:
    """The engine's llmserve_engine_{forward,step}_duration_seconds sums and counts."""
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in ENGINE_METRICS:
            for part in ("sum", "count"):
                if line.startswith(f"llmserve_engine_{name}_duration_seconds_{part}"):
                    found[f"{name}_{part}"] = float(line.rsplit(" ", 1)[1])
    return found


def stream_gaps(url: str, prompt: str, output_len: int) -> list[float]:
    """One streaming completion (as stack_token_cost.stream_one): the ms between its chunks."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/completions",
        data=json.dumps({**body, "model": "SmolLM2-135M-Instruct", "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    stamps = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def service_threads(stack: Any) -> dict[str, dict[str, float]]:
    """Per service (engine, scheduler, gateway): its threads' CPU seconds and voluntary /
    involuntary context switches so far, summed (Linux /proc; empty elsewhere)."""
    totals: dict[str, dict[str, float]] = {}
    for name, proc in stack.procs.items():
        row = totals.setdefault(name, {"cpu_s": 0.0, "voluntary": 0.0, "involuntary": 0.0})
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
            except OSError:  # the thread ended
                continue
            row["cpu_s"] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for line in status.splitlines():
                key, _, value = line.partition(":")
                if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    row["voluntary" if key[0] == "v" else "involuntary"] += int(value)
    return totals


def per_token(before: dict[str, Any], after: dict[str, Any], tokens: int) -> dict[str, Any]:
    """service_threads' growth per output token (CPU in ms)."""
    return {
        name: {
            ("cpu_ms" if key == "cpu_s" else key): (value - before[name][key])
            * (1e3 if key == "cpu_s" else 1.0)
            / tokens
            for key, value in row.items()
        }
        for name, row in after.items()
        if name in before
    }


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    """NAME:VAR=VALUE,VAR=VALUE -> (NAME, its environment)."""
    name, _, assignments = spec.partition(":")
    env = dict(item.split("=", 1) for item in assignments.split(",") if item)
    return name, env


def streams(url: str, requests: int, output_len: int, concurrency: int) -> list[float]:
    """--requests streams, --concurrency at once (over 1: each its own prompt, so no prefix cache
    serves one from another): every gap between chunks, in ms."""
    if concurrency == 1:
        return [gap for _ in range(requests) for gap in stream_gaps(url, PROMPT, output_len)]
    prompts = [f"{i} {PROMPT}" for i in range(requests)]
    with ThreadPoolExecutor(concurrency) as pool:
        runs = pool.map(lambda prompt: stream_gaps(url, prompt, output_len), prompts)
        return [gap for gaps in runs for gap in gaps]


def in_stack(
    requests: int, output_len: int, env: dict[str, str], concurrency: int = 1
) -> dict[str, Any]:
    """A fresh stack with env, --requests streams (--concurrency at once): wall ms per output token,
    the median gap between chunks, the engine's forward / step ms per step over them, and each
    service's CPU ms and context switches per output token (`per_token`)."""
    metrics_port = free_port()
    flags = ["--device", "cpu", "--http-port", str(free_port())]
    with serve_locally([*flags, "--metrics-port", str(metrics_port)], 300, env=env) as stack:
        url = stack.http_url
        assert url is not None
        warm_up(url, PROMPT)
        engine_url = f"http://127.0.0.1:{metrics_port + 2}/metrics"  # the engine's: PORT+2
        before, threads = engine_seconds(engine_url), service_threads(stack)
        t0 = time.perf_counter()
        gaps = streams(url, requests, output_len, concurrency)
        wall = time.perf_counter() - t0
        after, threads_after = engine_seconds(engine_url), service_threads(stack)
    spent = {key: after[key] - before[key] for key in after}
    row: dict[str, Any] = {"token_ms": wall * 1e3 / (requests * output_len)}
    row["chunks_received"] = len(gaps)
    row["per_token"] = per_token(threads, threads_after, requests * output_len)
    row["itl_p50_ms"] = statistics.median(gaps)
    for name in ENGINE_METRICS:
        row[f"engine_{name}_ms"] = spent[f"{name}_sum"] * 1e3 / spent[f"{name}_count"]
    row["engine_steps"] = spent["forward_count"]
    return {**row, "loadavg_1m": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="in-process steps timed per round")
    p.add_argument("--concurrency", type=int, default=1, help="streams at once")
    p.add_argument("--arm", action="append", default=[], help="NAME:VAR=VALUE,... (repeatable)")
    p.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "stack_forward_share.json"
    )
    args = p.parse_args()
    arms = [parse_arm(spec) for spec in args.arm or ["default:"]]
    rounds = []
    for r in range(args.rounds):
        step = in_process_step(args.steps)
        stacks = {}
        for name, env in arms if r % 2 == 0 else arms[::-1]:
            stacks[name] = stack = in_stack(args.requests, args.output_len, env, args.concurrency)
            print(
                f"round {r} {name}: in-process step {step['step_ms']:.2f} ms; in the stack: "
                f"forward {stack['engine_forward_ms']:.2f}, step {stack['engine_step_ms']:.2f}, "
                f"token interval {stack['token_ms']:.2f} (p50 {stack['itl_p50_ms']:.2f}) ms "
                f"(load {stack['loadavg_1m']:.1f}); engine per token: CPU "
                f"{stack['per_token']['engine']['cpu_ms']:.1f} ms, "
                f"{stack['per_token']['engine']['voluntary']:.0f} sleeps",
                flush=True,
            )
        rounds.append({"in_process": step, "in_stack": stacks})
    keys = ("engine_forward_ms", "engine_step_ms", "token_ms", "itl_p50_ms")
    median: dict[str, Any] = {
        "in_process_step_ms": statistics.median(r["in_process"]["step_ms"] for r in rounds)
    }
    for name, _ in arms:
        median[name] = {k: statistics.median(r["in_stack"][name][k] for r in rounds) for k in keys}
    print(json.dumps(median))
    settings = {**vars(args), "out": str(args.out), "arms": dict(arms)}
    document = {"kind": "stack_forward_share", "hardware": hardware(), "settings": settings}
    save({**document, "median": median, "rounds": rounds}, args.out)


if __name__ == "__main__":
    main()
