"""Overlap scheduling on the CPU, measured with the echo engine (engine/contract/echo.py): no model,
so what is measured is the serving machinery between steps (planning, the gRPC hop, the engine
service's pipeline), with and without `--overlap-scheduling`.

    python -m bench.studies.overlap_echo [--num-requests 8 64] [--output-len 256]
        [--step-delay-ms 0 5]

For each batch size, step delay and setting, a fresh echo engine and scheduler (two processes, real
gRPC on loopback; no gateway) serve --num-requests concurrent Submit streams of --prompt-len
tokens, each generating exactly --output-len tokens (EOS ignored). The echo engine models a
device: each step occupies it --step-delay-ms, steps back to back, launch returns at once.
Reported per run: steps/s and output tokens/s (all requests sent -> last token), the scheduler's
planning and update time per step, each process's CPU time per step (engine, scheduler, this
client: one asyncio loop), and for a delay > 0 the "device" busy fraction, steps x delay / wall
time. Raw numbers go to bench/results/overlap_echo.json. A CPU echo-engine figure, not a
model's or a GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import sys
import time
from pathlib import Path

from llmserve.bench.report import cpu_model, save
from llmserve.common.net import wait_until_serving
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmserve.scheduler.config import SchedulerConfig
from llmserve.stack import Stack, local_stack

ROOT = Path(__file__).resolve().parents[2]


def start(step_delay_ms: float, overlap: bool, num_requests: int) -> Stack:
    """Echo engine + scheduler (no gateway), started and serving."""
    stack = local_stack(
        EngineConfig(num_kv_blocks=4096, max_model_len=4096, max_num_seqs=num_requests),
        SchedulerConfig(overlap_scheduling=overlap),
        fake=EchoEngineConfig(step_delay_ms=step_delay_ms),
        env={"LLMSERVE_LOG_LEVEL": "WARNING", "OTEL_SDK_DISABLED": "true"},
    )
    stack.start(("engine", "scheduler"))
    if not wait_until_serving(stack.scheduler_address, timeout=60):
        stack.stop()
        raise RuntimeError("echo engine + scheduler did not start")
    return stack


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_all(
    stack: Stack, num_requests: int, prompt_len: int, output_len: int
) -> list[tuple[float, float, int]]:
    """All requests at once from one asyncio client (holding the stack's internal token); per
    request (first token time, last token time, tokens)."""
    metadata = stack.scheduler.peer_metadata()
    async with stack.scheduler.channel(stack.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def one(i: int) -> tuple[float, float, int]:
            request = scheduler_pb2.SubmitRequest(
                request_id=f"r{i}",
                prompt_token_ids=[(i * 31 + j) % 500 + 1 for j in range(prompt_len)],
                sampling=common_pb2.SamplingParams(temperature=0.0),
                max_tokens=output_len,
                ignore_eos=True,
            )
            n, t_first, t_last = 0, 0.0, 0.0
            async for msg in stub.Submit(request, timeout=600, metadata=metadata):
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                n += len(msg.token_ids)
            return t_first, t_last, n

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def run_once(stack: Stack, num_requests: int, prompt_len: int, output_len: int) -> dict[str, float]:
    """One run: steps/s, tokens/s, the scheduler's time per step, each process's CPU per step."""
    pids = [stack.procs["engine"].pid, stack.procs["scheduler"].pid, os.getpid()]
    before = stack.scheduler_stats()
    cpu_before = [cpu_seconds(pid) for pid in pids]
    t_start = time.perf_counter()
    streams = asyncio.run(stream_all(stack, num_requests, prompt_len, output_len))
    cpu_after = [cpu_seconds(pid) for pid in pids]
    after = stack.scheduler_stats()
    assert [n for *_, n in streams] == [output_len] * num_requests, streams
    wall = max(t for _, t, _ in streams) - t_start
    steps = after.num_steps - before.num_steps
    cpu_ms = [(b - a) * 1e3 / steps for a, b in zip(cpu_before, cpu_after, strict=True)]
    return {
        "wall_s": wall,
        "num_steps": steps,
        "steps_per_s": steps / wall,
        "output_tok_per_s": num_requests * output_len / wall,
        "schedule_ms_per_step": (after.schedule_ms - before.schedule_ms) / steps,
        "update_ms_per_step": (after.update_ms - before.update_ms) / steps,
        "step_rtt_ms_per_step": (after.step_rtt_ms - before.step_rtt_ms) / steps,
        "cpu_ms_per_step": dict(zip(["engine", "scheduler", "client"], cpu_ms, strict=True)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, nargs="+", default=[8, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-delay-ms", type=float, nargs="+", default=[0.0, 5.0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default=str(ROOT / "bench/results/overlap_echo.json"))
    args = p.parse_args()
    results = []
    for n, delay, overlap in itertools.product(
        args.num_requests, args.step_delay_ms, (False, True)
    ):
        stack = start(delay, overlap, n)
        try:
            run_once(stack, 4, args.prompt_len, 8)  # warm-up
            runs = [
                run_once(stack, n, args.prompt_len, args.output_len) for _ in range(args.repeats)
            ]
        finally:
            stack.stop()
        best = max(runs, key=lambda r: r["steps_per_s"])
        if delay:
            best["device_busy"] = best["num_steps"] * delay / 1e3 / best["wall_s"]
        row = {"num_requests": n, "step_delay_ms": delay, "overlap": overlap}
        results.append({**row, **best, "runs": runs})
        busy = f"  device busy {best['device_busy']:.0%}" if delay else ""
        cpu = "/".join(f"{v:.1f}" for v in best["cpu_ms_per_step"].values())
        print(
            f"batch {n:3d}  delay {delay:4.1f} ms  overlap {'on ' if overlap else 'off'}  "
            f"{best['steps_per_s']:6.1f} steps/s  {best['output_tok_per_s']:6.0f} tok/s  "
            f"plan {best['schedule_ms_per_step']:.2f} ms  update "
            f"{best['update_ms_per_step']:.2f} ms  CPU ms/step engine/scheduler/client "
            f"{cpu}{busy}",
            flush=True,
        )
    doc = {
        "what": "echo engine (engine/contract/echo.py) + scheduler on the CPU, no gateway, "
        "no model",
        "command": " ".join(sys.argv),
        "config": vars(args),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "results": results,
    }
    save(doc, Path(args.output))
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
