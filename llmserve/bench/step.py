"""`llmserve bench step`: the engine's decode step, in-process (no gRPC, no scheduler), for one or
more arms side by side (the arm specs: llmserve/bench/step_arms.py).

    llmserve bench step --arms mode:gguf mode:auto --batches 1,16,64 [--steps 15]
    llmserve bench step --arms mode:gguf --profile          # where the step's time goes
    llmserve bench step --table RESULT.json                 # a saved run as a markdown table

The arms take decode steps in turn, the order reversed every other round (A B B A ...), so load
drift slows them alike; each figure is a median, given as a ratio to the first arm's. Tensor-
parallel arms run alone after the others. See docs/benchmarks.md#one-step-timer.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TOP_OPS = 20


def add_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=["mode:auto"], help="arm specs (kind:name)")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=15, help="timed decode steps per arm and batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--prefill-rounds",
        type=int,
        default=1,
        help="timed prefills per arm and batch (each the batch's prompts in one step)",
    )
    p.add_argument("--shape", help="the family arms' shape: a directory with a config.json")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's rule)")
    p.add_argument("--profile", action="store_true", help="also each operator's time per step")
    p.add_argument("--out", type=Path, help="save the result document (JSON) here")
    p.add_argument("--table", type=Path, help="print a saved run's markdown table and exit")


def cmd_step(args: argparse.Namespace) -> int:
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    from llmserve.engine.step.cpu_threads import configure_openmp

    configure_openmp()  # as the engine service does, before torch loads libgomp
    document = run(args.arms, [int(b) for b in args.batches.split(",")], args)
    print(text_table(document))
    if args.out:
        from llmserve.bench.report import save

        save(document, args.out)
        print(f"raw JSON: {args.out}")
    return 0


def run(specs: list[str], batches: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Every arm's rows (see the module's docstring), in a result document."""
    import os

    from llmserve.bench.engine_driver import blocks_needed
    from llmserve.bench.report import hardware
    from llmserve.bench.step_arms import make_arm
    from llmserve.engine.config import EngineConfig

    blocks = blocks_needed([args.prompt_len] * max(batches), args.steps + 8, 16)
    base = EngineConfig(
        model=args.shape, device="cpu", num_kv_blocks=blocks, seed=0, num_threads=args.threads
    )
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        arms = [make_arm(spec, base, Path(tmp)) for spec in specs]
        local = [arm for arm in arms if not arm.group]
        rows: dict[str, list[dict[str, Any]]] = {arm.spec: [] for arm in arms}
        for batch in batches:
            for arm, row in zip(local, paired_steps(local, batch, args), strict=True):
                rows[arm.spec].append(row)
        for arm in arms:
            if arm.group:
                rows[arm.spec] = time_group(arm, batches, args)
        if args.profile:
            for arm in local:
                for row in rows[arm.spec]:
                    row["top_ops"] = profile(arm, row["batch"], args)
    load.append(os.getloadavg()[0])
    first = rows[specs[0]]
    for spec in specs:
        for row, base_row in zip(rows[spec], first, strict=True):
            row["vs_first"] = round(row["step_ms_median"] / base_row["step_ms_median"], 3)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "out", "table")}
    return {
        "kind": "llmserve bench step",
        "hardware": hardware(torch_threads=True),
        "settings": settings,
        "load_average_1min": [round(x, 2) for x in load],
        # the process's peak resident memory, all arms together: time one arm a run to read
        # an arm's own (engine build and steps included)
        "max_rss_mib": peak_rss_mib(),
        "results": [{"arm": a.spec, "config": _config_row(a), "rows": rows[a.spec]} for a in arms],
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: since its exec, where ru_maxrss keeps the
    parent's peak across it), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def paired_steps(arms: list[Any], batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each arm's row at batch: --prefill-rounds prefills of the batch's prompts (one step
    each, timed, the arms in turn ABBA), 3 warm-up decodes, then --steps rounds of one decode
    step of every arm in turn (ABBA)."""
    from llmserve.bench.engine_driver import Driver, step_row
    from llmserve.bench.step_arms import prompts

    vocab = min(arm.engine.model_config.vocab_size for arm in arms)
    batch_prompts = prompts(batch, args.prompt_len, vocab)
    drivers = [Driver(arm.engine) for arm in arms]
    with ThreadPoolExecutor(1) as worker:

        def call(i: int, fn: Any) -> Any:
            with arms[i].active():
                return worker.submit(fn).result() if arms[i].worker_thread else fn()

        prefill_ms: list[list[float]] = [[] for _ in arms]
        for rnd in range(max(1, args.prefill_rounds)):
            order = list(range(len(arms)))
            for i in order if rnd % 2 == 0 else order[::-1]:
                drivers[i] = Driver(arms[i].engine)
                slots = arms[i].slots_for(batch)
                start = functools.partial(
                    drivers[i].start, batch_prompts, slots, arms[i].lora_loads
                )
                t0 = time.perf_counter()
                call(i, start)
                prefill_ms[i].append((time.perf_counter() - t0) * 1e3)
        for i, driver in enumerate(drivers):
            for _ in range(3):
                call(i, driver.decode)
        times: list[list[float]] = [[] for _ in arms]
        for step in range(args.steps):
            order = list(range(len(arms)))
            for i in order if step % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                call(i, drivers[i].decode)
                times[i].append((time.perf_counter() - t0) * 1e3)
    rows = [step_row(batch, t, d.generated[0][:8]) for t, d in zip(times, drivers, strict=True)]
    for row, ms in zip(rows, prefill_ms, strict=True):
        row |= prefill_row(ms, sum(len(p) for p in batch_prompts))
    return rows


def prefill_row(times_ms: list[float], num_tokens: int) -> dict[str, Any]:
    """The prefill figures of a row: every timed prefill step (num_tokens prompt tokens in
    one step), the median and the median's milliseconds per prompt token."""
    median = statistics.median(times_ms)
    return {
        "prefill_tokens": num_tokens,
        "prefill_ms": [round(t, 1) for t in times_ms],
        "prefill_ms_median": round(median, 1),
        "prefill_ms_per_token": round(median / num_tokens, 3),
    }


def time_group(arm: Any, batches: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """A tensor-parallel arm's rows: its ranks started on this machine, the driver's steps."""
    import functools

    from llmserve.common.model_config import builtin_model_path, load_model_config
    from llmserve.engine.parallel.ranks import run_group_locally

    work = functools.partial(_group_rows, batches=batches, args=args)
    rows: list[dict[str, Any]] = run_group_locally(arm.config, work, timeout=1800)[0]
    model = load_model_config(Path(arm.config.model) if arm.config.model else builtin_model_path())
    size = arm.config.tensor_parallel_size
    for row in rows:
        row["comm_bytes"] = comm_bytes(model.hidden_size, model.vocab_size, size, 4)
    return rows


def comm_bytes(hidden: int, vocab: int, tp: int, element: int) -> dict[str, float]:
    """Bytes each rank sends per token (ring all-reduce: 2 (T-1)/T of the tensor; all-gather:
    (T-1)/T of the whole), per layer and for the embeddings / LM head."""
    ring = 2 * (tp - 1) / tp
    return {
        "per_token_per_layer": 2 * ring * hidden * element,
        "embedding_per_token": ring * hidden * element,
        "lm_head_per_sampled_token": (tp - 1) / tp * vocab * 4,
    }


def _group_rows(
    engine: Any, parallel: Any, batches: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """On every rank of a group: each batch's decode steps (every rank steps; the driver's
    times are the figures), the seconds inside all-reduces and all-gathers counted."""
    from llmserve.bench.engine_driver import time_decode_steps
    from llmserve.bench.step_arms import prompts

    timed = _Collectives(parallel.tp) if parallel is not None else None
    rows = []
    for batch in batches:
        batch_prompts = prompts(batch, args.prompt_len, engine.model_config.vocab_size)
        warmed = timed.reset if timed is not None else None
        row = time_decode_steps(engine, batch, args.steps, warmed=warmed, prompts=batch_prompts)
        if timed is not None:
            row.update(timed.per_step(args.steps))
        rows.append(row)
    return rows if parallel is None or parallel.topology.is_driver else []


class _Collectives:
    """Wraps a TPGroup's all_reduce and all_gather, summing the seconds spent in each."""

    def __init__(self, tp: Any):
        self.seconds = {"all_reduce": 0.0, "all_gather": 0.0}
        self.calls = {"all_reduce": 0, "all_gather": 0}
        for name in self.seconds:
            setattr(tp, name, self._wrap(name, getattr(tp, name)))

    def _wrap(self, name: str, op: Any) -> Any:
        def timed(x: Any) -> Any:
            t0 = time.perf_counter()
            out = op(x)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        return timed

    def reset(self) -> None:
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0

    def per_step(self, steps: int) -> dict[str, Any]:
        return {
            "all_reduce_ms": round(self.seconds["all_reduce"] * 1e3 / steps, 2),
            "all_reduces_per_step": self.calls["all_reduce"] // steps,
            "all_gather_ms": round(self.seconds["all_gather"] * 1e3 / steps, 2),
        }


def profile(arm: Any, batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The TOP_OPS operators by self CPU time over --steps decode steps of arm at batch."""
    import torch

    from llmserve.bench.engine_driver import Driver
    from llmserve.bench.step_arms import prompts

    driver = Driver(arm.engine)
    with arm.active():
        vocab = arm.engine.model_config.vocab_size
        driver.start(prompts(batch, args.prompt_len, vocab), arm.slots_for(batch), arm.lora_loads)
        for _ in range(3):
            driver.decode()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                driver.decode()
            total_ms = (time.perf_counter() - t0) * 1e3
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "calls_per_step": e.count / args.steps,
            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / args.steps, 3),
            "share_of_step": round(e.self_cpu_time_total / 1e3 / total_ms, 4),
        }
        for e in events[:TOP_OPS]
    ]


def _config_row(arm: Any) -> dict[str, Any]:
    c = arm.config
    fields = ("model", "load_format", "quantization", "kv_cache_dtype", "tensor_parallel_size")
    return {name: getattr(c, name) for name in fields} | {"threads": c.num_threads}


def text_table(document: dict[str, Any]) -> str:
    results = document["results"]
    batches = [r["batch"] for r in results[0]["rows"]]
    lines = [f"{'arm':24s}" + "".join(f"{f'batch {b}: ms (x first)':>26s}" for b in batches)]
    for result in results:
        cells = "".join(
            f"{r['step_ms_median']:>16.1f} ({r['vs_first']:5.2f}x)" for r in result["rows"]
        )
        lines.append(f"{result['arm']:24s}{cells}")
        prefill = "".join(
            f"{r['prefill_ms_median']:>15.1f} ({r['prefill_ms_per_token']:.2f}/tok)"
            for r in result["rows"]
            if "prefill_ms_median" in r
        )
        if prefill:
            lines.append(f"{'  prefill: ms (ms/token)':24s}{prefill}")
        for r in result["rows"]:
            for op in r.get("top_ops", [])[:8]:
                share = op["share_of_step"]
                lines.append(
                    f"    b{r['batch']} {op['self_ms_per_step']:8.2f} ms {share:6.1%}  {op['op']}"
                )
    return "\n".join(lines)


def markdown_table(document: dict[str, Any]) -> str:
    """A saved run as the docs give it: per arm and batch, its step (ms) with the first arm's
    beside it, and their ratio."""
    results = document["results"]
    batches = [r["batch"] for r in results[0]["rows"]]
    first = results[0]["arm"]
    head = "| arm |" + "".join(f" batch {b}: ms ({first}) | x {first} |" for b in batches)
    lines = [head, "|---|" + "---:|---:|" * len(batches)]
    for result in results[1:]:
        cells = "".join(
            f" {r['step_ms_median']:.0f} ({r['step_ms_median'] / r['vs_first']:.0f})"
            f" | {r['vs_first']:.2f} |"
            for r in result["rows"]
        )
        lines.append(f"| {result['arm']} |{cells}")
    return "\n".join(lines)
