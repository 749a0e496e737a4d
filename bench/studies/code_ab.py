"""Two source trees of llmserve, alternated: one request at a time through `llmserve serve
--device cpu` (the built-in SmolLM2 GGUF, `llmserve bench serve` greedy, ignore_eos) and, with
--step-steps, the in-process batch-1 decode step (`llmserve bench step --arms mode:auto`), each
round running every tree in turn, with the load average read before each run. For a change
whose gain is too small to see across runs on a shared machine: the arms see the same load.

    python -m bench.studies.code_ab --arm before:/tmp/base --arm after:. --rounds 3 \
        [--num-prompts 8] [--step-steps 60] [--out bench/results/code_ab.json]

Each tree runs with PYTHONPATH=TREE from the tree's root (the same virtualenv, so the same
torch and kernel builds: the GGUF kernel's build is keyed by its sources' contents).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.studies.vs_llamacpp import stop, wait_ready
from llmserve.bench.report import git_commit, hardware
from llmserve.common.model_config import builtin_model_path
from llmserve.topology import free_ports


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "LLMSERVE_LOG_LEVEL": "WARNING"}


def load_average() -> float:
    return os.getloadavg()[0]


def serve_run(tree: Path, args: argparse.Namespace, seed: int, work: Path) -> dict[str, Any]:
    """One `llmserve serve` of tree and one concurrency-1 bench against it: the bench's
    summary numbers and the load before and after."""
    grpc_port, scheduler_port, engine_port, http_port = free_ports(4)
    cli = [sys.executable, "-m", "llmserve.cli"]
    command = [*cli, "serve", "--device", "cpu", "--model", str(builtin_model_path())]
    command += ["--port", str(grpc_port), "--scheduler-port", str(scheduler_port)]
    command += ["--engine-port", str(engine_port), "--http-port", str(http_port)]
    command += ["--metrics-port", "0", "--served-model-name", "m"]
    log = work / f"serve-{seed}-{tree.name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, cwd=tree, env=_env(tree), stdout=sink, stderr=sink)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(proc, url + "/ready", 180, log)
        out = work / f"bench-{seed}-{tree.name}.json"
        bench = [*cli, "bench", "serve", "--backend", "openai", "--base-url", url]
        bench += ["--model", "m", "--dataset-name", "random", "--max-concurrency", "1"]
        bench += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        bench += ["--num-prompts", str(args.num_prompts), "--seed", str(seed)]
        bench += ["--temperature", "0", "--ignore-eos", "--no-progress", "--num-warmups", "1"]
        bench += ["--output", str(out)]
        load_before = load_average()
        subprocess.run(bench, cwd=tree, env=_env(tree), check=True, capture_output=True)
        load_after = load_average()
    finally:
        stop(proc)
    document = json.loads(out.read_text())
    return {"load_before": load_before, "load_after": load_after, "bench": document}


def step_run(tree: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The in-process batch-1 decode step of tree (`llmserve bench step`)."""
    out = work / f"step-{tree.name}-{time.monotonic_ns()}.json"
    command = [sys.executable, "-m", "llmserve.cli", "bench", "step", "--arms", "mode:auto"]
    command += ["--batches", "1", "--steps", str(args.step_steps), "--out", str(out)]
    load_before = load_average()
    subprocess.run(command, cwd=tree, env=_env(tree), check=True, capture_output=True)
    return {
        "load_before": load_before,
        "load_after": load_average(),
        "step": json.loads(out.read_text()),
    }


def _serve_numbers(run: dict[str, Any]) -> dict[str, float]:
    """Output tok/s, ITL p50 and TPOT p50 (ms) from a bench serve document."""
    metrics = run["bench"]["runs"][0]["metrics"]
    return {
        "output_tok_s": metrics["output_throughput"],
        "itl_p50_ms": metrics["itl_ms"]["p50"],
        "tpot_p50_ms": metrics["tpot_ms"]["p50"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", required=True, help="NAME:TREE (twice or more)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-steps", type=int, default=0, help="0: no in-process step runs")
    p.add_argument("--no-serve", action="store_true", help="only the in-process step")
    p.add_argument("--out", type=Path, default=Path("bench/results/code_ab.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = [(spec.partition(":")[0], Path(spec.partition(":")[2]).resolve()) for spec in args.arm]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = arms if round_ % 2 == 0 else arms[::-1]
            for name, tree in order:
                row: dict[str, Any] = {"round": round_, "arm": name, "tree": str(tree)}
                if args.step_steps:
                    row["step"] = step_run(tree, args, Path(tmp))
                if not args.no_serve:
                    row["serve"] = serve_run(tree, args, 10 + round_, Path(tmp))
                rows.append(row)
                print(json.dumps(_summary(row)), flush=True)
    document = {
        "schema": "llmserve-code-ab/1",
        "hardware": hardware(),
        "commit": git_commit(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "summary": [_summary(row) for row in rows],
        "medians": _medians(rows, [name for name, _ in arms]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(json.dumps(document["medians"], indent=1))
    return 0


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"round": row["round"], "arm": row["arm"]}
    if "step" in row:
        step = row["step"]
        out["step_ms"] = _step_row(step["step"])["step_ms_median"]
        out["first_tokens"] = _step_row(step["step"])["first_tokens"]
        out["step_load"] = step["load_before"]
    if "serve" in row:
        out.update(_serve_numbers(row["serve"]))
        out["serve_load"] = [row["serve"]["load_before"], row["serve"]["load_after"]]
    return out


def _step_row(doc: dict[str, Any]) -> dict[str, Any]:
    """The batch-1 row of a bench step document."""
    for row in doc["results"][0]["rows"]:
        if row["batch"] == 1:
            return dict(row)
    raise ValueError("no batch-1 row")


def _medians(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        mine = [_summary(row) for row in rows if row["arm"] == name]
        keys = [k for k in ("step_ms", "output_tok_s", "itl_p50_ms", "tpot_p50_ms") if k in mine[0]]
        out[name] = {k: statistics.median(r[k] for r in mine) for k in keys}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
