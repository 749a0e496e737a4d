"""The scheduling-policy study (issue 18): two tenants on one server, through the whole stack
(gRPC client -> gateway -> scheduler -> engine), under --scheduling-policy fcfs, fair, priority.

    python -m bench.studies.fairness_study                          # every scenario, then the plot
    python -m bench.studies.fairness_study --scenarios alone fcfs   # some; merged into --output
    python -m bench.studies.fairness_study --plot-only

The engine is the echo engine (engine/contract/echo.py) with a step time modelled on the built-in
model's on this machine's CPU (bench/results/cpu_engine_steps.json, "cpu ops": 40 ms for a 1-token
step, 77.5 ms for 16, 248 ms for 64): 40 ms + 2.5 ms per token computed. Why not the model itself:
on 2 shared cores one scenario at the rates below would take many minutes and its step times would
move with whatever else runs; the policies only see step times and token counts, which the echo
engine reproduces exactly, and the same run is repeatable. The scheduler, gateway and client are the
real ones.

Scenarios (seeded Poisson arrivals; every request ignores EOS and runs to its max_tokens):

- alone:  tenant B alone: short chats (32-token prompts, 16 tokens out) at --b-rate.
- alone_sync, fair_sync: alone and fair with --no-overlap-scheduling (one step in flight, not
  two: a request arriving mid-step waits for less).
- fcfs, fair: B as above plus tenant A at 10x B's rate with long outputs (32 in, 128 out): A
  alone asks for more than the server computes, so a queue of A's requests builds up. B's TTFT
  p50/p99 per policy; a B request still waiting when the run ends counts as not served (its
  TTFT is at least the time it waited, and the p99 is "not served" if more than 1% were not).
- fair_1_1, fair_2_1: both tenants flood (A at weight 1 or 2, set at run time through the
  gateway's Admin.SetTenantWeight; B at the default 1), both always backlogged;
  the weighted service each received (prefill + 2 x decode tokens, the counter's charge) and
  the tokens generated, over a window in the middle of the run, against the weights.
- priority_fcfs, priority: a flood of low-priority requests (priority 1) and a trickle of
  high-priority ones (priority 0), under fcfs and under the priority policy: high-priority TTFT.
- alone_flat, fair_flat: alone and fair with a step time shaped like a GPU's (FLAT_STEP_MS +
  FLAT_TOKEN_MS per token: it hardly grows with the batch), to separate the policy's delay from
  the CPU's cost of a bigger batch.
- drain: 64 requests in flight (16 running, 48 waiting), then the gateway's Admin.Drain: time
  until nothing runs or waits, every request finished with all its tokens, a Submit during the
  drain refused UNAVAILABLE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from llmserve.bench.byte_tokenizer import EOS_TOKEN_ID, TINY_VOCAB, write_byte_tokenizer
from llmserve.bench.report import git_commit, hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.gateway.config import GatewayConfig
from llmserve.protos import (
    admin_pb2,
    admin_pb2_grpc,
    api_pb2,
    api_pb2_grpc,
    common_pb2,
    scheduler_pb2,
)
from llmserve.scheduler.config import SchedulerConfig
from llmserve.stack import Stack, local_stack
from llmserve.stats import stats_delta

ROOT = Path(__file__).resolve().parents[2]

SCENARIOS = (
    "alone", "fcfs", "fair", "alone_sync", "fair_sync", "fair_1_1", "fair_2_1", "priority_fcfs",
    "priority", "drain", "alone_flat", "fair_flat",
)  # fmt: skip
STEP_MS, TOKEN_MS = 40.0, 2.5  # the echo engine's step time: STEP_MS + TOKEN_MS per token
# The *_flat scenarios: a step time that hardly grows with the batch, shaped like the H200's
# measured in docs/gpu.md#the-gpu-machine (HF generate, Llama-3-8B shape, bf16: 62 ms a step at
# batch 1, 75 ms at batch 64, so about 0.2 ms per decode token).
FLAT_STEP_MS, FLAT_TOKEN_MS = 62.0, 0.2
MAX_NUM_SEQS = 16
ADMIN_KEY = "fairness-study-admin"  # the gateway's Admin service: weights, drain
ADMIN_METADATA = (("authorization", f"Bearer {ADMIN_KEY}"),)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--b-rate", type=float, default=1.0, help="B's requests per second")
    p.add_argument("--grace-steps", type=int, default=8, help="--preemption-grace-steps")
    p.add_argument("--max-preemptions", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/fairness_study.json")
    p.add_argument("--plot", type=Path, default=ROOT / "bench/results/fairness_study.png")
    p.add_argument("--plot-only", action="store_true")
    return p.parse_args()


# -- the stack ------------------------------------------------------------------------------------


def start_stack(
    policy: str,
    args: argparse.Namespace,
    tokenizer: Path,
    overlap: bool = True,
    step_ms: tuple[float, float] = (STEP_MS, TOKEN_MS),
) -> Stack:
    engine = EngineConfig(
        num_kv_blocks=2048, max_model_len=1024, max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=512,
    )  # fmt: skip
    scheduler = SchedulerConfig(
        scheduling_policy=policy,
        max_preemptions=args.max_preemptions,
        preemption_grace_steps=args.grace_steps,
        overlap_scheduling=overlap,
    )
    gateway = GatewayConfig(
        model=str(tokenizer), served_model_name=("fake-echo",), admin_key=ADMIN_KEY
    )
    fake = EchoEngineConfig(
        vocab_size=TINY_VOCAB, eos_token_ids=(EOS_TOKEN_ID,), step_delay_ms=step_ms[0],
        step_token_delay_ms=step_ms[1],
    )  # fmt: skip
    stack = local_stack(
        engine, scheduler, gateway, fake=fake,
        env={"LLMSERVE_LOG_LEVEL": "WARNING", "OTEL_SDK_DISABLED": "true"},
    )  # fmt: skip
    stack.start()
    stack.wait_ready(120)
    return stack


def stats(stack: Stack) -> scheduler_pb2.SchedulerStats:
    return stack.scheduler_stats()


# -- the client -----------------------------------------------------------------------------------


@dataclass
class Sent:
    tenant: str
    priority: int
    arrival: float  # seconds since the run started
    max_tokens: int
    ttft_s: float | None = None
    num_tokens: int = 0
    finish_reason: str = ""
    error: str = ""


@dataclass
class Stream:
    tenant: str
    rate: float
    prompt_len: int
    max_tokens: int
    priority: int = 0
    sent: list[Sent] = field(default_factory=list)


def prompt(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


async def one(stub: Any, s: Stream, text: str, start: float, out: Sent) -> None:
    req = api_pb2.GenerateRequest(
        text=text, max_tokens=s.max_tokens, ignore_eos=True, user=s.tenant, priority=s.priority
    )
    req.sampling.temperature = 0.0
    t0 = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=600):
            if msg.token_ids and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
            out.num_tokens += len(msg.token_ids)
            if msg.finish_reason:
                out.finish_reason = common_pb2.FinishReason.Name(msg.finish_reason)
    except grpc.aio.AioRpcError as err:
        out.error = err.code().name
    except asyncio.CancelledError:
        out.error = "CANCELLED (run ended)"


async def drive(
    stack: Stack, streams: list[Stream], duration: float, seed: int, tail_s: float,
    windows: tuple[float, float] | None = None,
) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """Send every stream's Poisson arrivals for duration seconds; then wait up to tail_s for what
    is left and cancel the rest. With windows=(t1, t2): scheduler stats at t1 and t2 (seconds
    into the run). Returns (run seconds, {"t1": stats, "t2": stats})."""
    rng = random.Random(seed)
    snapshots: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        events = arrivals(streams, duration, seed)
        tasks = []

        async def snapshot(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            snapshots[name] = await asyncio.to_thread(stats, stack)

        if windows is not None:
            names = zip(("t1", "t2"), windows, strict=True)
            tasks += [asyncio.create_task(snapshot(n, t)) for n, t in names]
        for t, s in events:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
            sent = Sent(s.tenant, s.priority, t, s.max_tokens)
            s.sent.append(sent)
            text = prompt(rng, s.prompt_len)
            tasks.append(asyncio.create_task(one(stub, s, text, start, sent)))
        _, pending = await asyncio.wait(tasks, timeout=tail_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return time.perf_counter() - start, snapshots


def arrivals(streams: list[Stream], duration: float, seed: int) -> list[tuple[float, Stream]]:
    """Each stream's Poisson arrival times in [0, duration), merged in time order. Each stream
    draws from its own generator (seed, tenant), so B's arrivals are the same in every scenario."""
    events = []
    for s in streams:
        rng = random.Random(f"{seed}-{s.tenant}")
        t = rng.expovariate(s.rate)
        while t < duration:
            events.append((t, s))
            t += rng.expovariate(s.rate)
    return sorted(events, key=lambda e: e[0])


WARMUP_S = 5.0  # the first seconds: A's first 16 requests prefill together in long steps


def after_warmup(summary: dict[str, Any], run_s: float) -> dict[str, Any]:
    """summary's percentiles over the requests that arrived after WARMUP_S (from its raw)."""
    sent = [Sent("", 0, a, 0, None if v is None else v / 1e3) for a, v in summary["raw"]]
    out = ttft_summary([x for x in sent if x.arrival >= WARMUP_S], run_s)
    del out["raw"]
    return out


def ttft_summary(sent: list[Sent], run_s: float) -> dict[str, Any]:
    """TTFT p50 / p90 / p99 in ms (nearest rank); a request with no first token counts as
    waiting until the run ended (a lower bound), and a percentile that falls on one is reported
    as None, with that lower bound beside it."""
    served = [s.ttft_s * 1e3 for s in sent if s.ttft_s is not None]
    censored = [(run_s - s.arrival) * 1e3 for s in sent if s.ttft_s is None]
    values = sorted([(v, True) for v in served] + [(v, False) for v in censored])
    out: dict[str, Any] = {"num_requests": len(sent), "num_served": len(served)}
    for q in (50, 90, 99):
        k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
        v, ok = values[k] if values else (0.0, True)
        out[f"p{q}_ms"] = round(v, 1) if ok else None
        if not ok:
            out[f"p{q}_ms_at_least"] = round(v, 1)
    if served:
        out["mean_served_ms"] = round(sum(served) / len(served), 1)
    out["raw"] = [
        [round(s.arrival, 3), round(s.ttft_s * 1e3, 1) if s.ttft_s is not None else None]
        for s in sent
    ]  # [arrival s, TTFT ms or None: not served]
    return out


def tenant_table(snapshot: scheduler_pb2.SchedulerStats) -> dict[str, dict[str, float]]:
    return {
        t.tenant: {
            "weight": t.weight, "prompt_tokens": t.num_prompt_tokens,
            "generated_tokens": t.num_generated_tokens, "virtual_tokens": t.virtual_tokens,
        }
        for t in snapshot.tenants
    }  # fmt: skip


def counters(snapshot: scheduler_pb2.SchedulerStats) -> dict[str, Any]:
    return {
        "num_preemptions": snapshot.num_preemptions,
        "num_preemptions_by_reason": dict(snapshot.num_preemptions_by_reason),
        "num_preemptions_refused": snapshot.num_preemptions_refused,
        "num_finished_requests": snapshot.num_finished_requests,
        "num_steps": snapshot.num_steps,
        "mean_step_ms": round(snapshot.engine_total_ms / max(1, snapshot.num_steps), 1),
    }


# -- scenarios ------------------------------------------------------------------------------------


def b_stream(args: argparse.Namespace) -> Stream:
    return Stream("B", args.b_rate, 32, 16)


def a_stream(args: argparse.Namespace) -> Stream:
    return Stream("A", 10 * args.b_rate, 32, 128)


def run_two_tenants(name: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    policy = "fair" if name.startswith("fair") else "fcfs"
    alone = name.startswith("alone")
    streams = [b_stream(args)] if alone else [a_stream(args), b_stream(args)]
    overlap = not name.endswith("_sync")
    step_ms = (FLAT_STEP_MS, FLAT_TOKEN_MS) if name.endswith("_flat") else (STEP_MS, TOKEN_MS)
    stack = start_stack(policy, args, tokenizer, overlap, step_ms)
    try:
        run_s, _ = asyncio.run(drive(stack, streams, args.duration, args.seed, tail_s=10.0))
        final = stats(stack)
    finally:
        stack.stop()
    out: dict[str, Any] = {"policy": policy, "overlap_scheduling": overlap}
    out["step_ms"] = f"{step_ms[0]} + {step_ms[1]} per token computed"
    out["run_s"] = round(run_s, 1)
    for s in streams:
        out[f"{s.tenant}_ttft"] = ttft_summary(s.sent, run_s)
        out[f"{s.tenant}_workload"] = {
            "rate_per_s": s.rate, "prompt_tokens": s.prompt_len, "max_tokens": s.max_tokens,
        }  # fmt: skip
        done = [x for x in s.sent if x.finish_reason]
        out[f"{s.tenant}_finished"] = len(done)
        out[f"{s.tenant}_lost"] = sum(
            1 for x in done if x.finish_reason != "FINISH_REASON_LENGTH"
            or x.num_tokens != x.max_tokens
        )  # fmt: skip
    out["tenants"] = tenant_table(final)
    out["scheduler"] = counters(final)
    return out


def run_saturated(name: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    """Both tenants flood (each alone would fill the server); A's weight 1 or 2. The tenants'
    service between t1 and t2 (both backlogged throughout)."""
    weight_a = {"fair_1_1": 1.0, "fair_2_1": 2.0}[name]
    stack = start_stack("fair", args, tokenizer)
    duration = args.duration / 2
    streams = [Stream("A", 4.0, 32, 64), Stream("B", 4.0, 32, 64)]
    try:
        # The operator's run-time call (`llmserve admin set-weight A 2`): the gateway puts the
        # tenant's weight on each of its requests from then on.
        with grpc.insecure_channel(stack.gateway_address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            request = admin_pb2.SetTenantWeightRequest(tenant="A", weight=weight_a)
            admin.SetTenantWeight(request, metadata=ADMIN_METADATA, timeout=10)
        windows = (duration / 4, duration)
        _, snaps = asyncio.run(drive(stack, streams, duration, args.seed, 0.5, windows))
    finally:
        stack.stop()
    window = stats_delta(snaps["t1"], snaps["t2"])["tenants"]  # counters' deltas, weights
    served = {}
    for tenant in ("A", "B"):
        row = window[tenant]
        served[tenant] = {
            "weighted_service": round(row["virtual_tokens"] * row["weight"], 1),
            "prompt_tokens": int(row["num_prompt_tokens"]),
            "generated_tokens": int(row["num_generated_tokens"]),
        }
    ratio = served["A"]["weighted_service"] / served["B"]["weighted_service"]
    gen_ratio = served["A"]["generated_tokens"] / max(1, served["B"]["generated_tokens"])
    return {
        "policy": "fair",
        "weights": {"A": weight_a, "B": 1.0},
        "window_s": [duration / 4, duration],
        "workload": {"rate_per_s_each": 4.0, "prompt_tokens": 32, "max_tokens": 64},
        "served_in_window": served,
        "weighted_service_ratio_A_to_B": round(ratio, 3),
        "generated_tokens_ratio_A_to_B": round(gen_ratio, 3),
        "target_ratio": weight_a,
        "within_10_percent": abs(ratio / weight_a - 1) <= 0.10,
        "scheduler": counters(snaps["t2"]),
    }


def run_priority(name: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    policy = {"priority_fcfs": "fcfs", "priority": "priority"}[name]
    low = Stream("bulk", 10 * args.b_rate, 32, 128, priority=1)
    high = Stream("urgent", args.b_rate, 32, 16, priority=0)
    stack = start_stack(policy, args, tokenizer)
    try:
        run_s, _ = asyncio.run(drive(stack, [low, high], args.duration, args.seed, tail_s=10.0))
        final = stats(stack)
    finally:
        stack.stop()
    return {
        "policy": policy,
        "run_s": round(run_s, 1),
        "high_priority_ttft": ttft_summary(high.sent, run_s),
        "low_priority_ttft": ttft_summary(low.sent, run_s),
        "workload": {
            "low": {"priority": 1, "rate_per_s": low.rate, "max_tokens": 128},
            "high": {"priority": 0, "rate_per_s": high.rate, "max_tokens": 16},
        },
        "scheduler": counters(final),
    }


def run_drain(name: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    stack = start_stack("fcfs", args, tokenizer)
    try:
        return asyncio.run(drain(stack))
    finally:
        stack.stop()


async def drain(stack: Stack, num: int = 64, max_tokens: int = 64) -> dict[str, Any]:
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        stream = Stream("D", 1.0, 32, max_tokens)
        sent = [Sent("D", 0, 0.0, max_tokens) for _ in range(num)]
        tasks = [asyncio.create_task(one(stub, stream, prompt(rng, 32), 0.0, s)) for s in sent]
        while True:  # all 64 in the scheduler, every seat taken
            s = await asyncio.to_thread(stats, stack)
            if s.num_running + s.num_waiting == num and s.num_running == MAX_NUM_SEQS:
                break
            await asyncio.sleep(0.01)
        in_flight = {"running": s.num_running, "waiting": s.num_waiting}
        admin = admin_pb2_grpc.AdminStub(channel)
        t0 = time.perf_counter()
        progress = admin.Drain(admin_pb2.DrainRequest(), metadata=ADMIN_METADATA, timeout=600)
        first = await anext(aiter(progress))  # the gateway and its schedulers admit nothing now
        refused = Sent("late", 0, 0.0, 4)
        await one(stub, Stream("late", 1.0, 8, 4), "too late", 0.0, refused)
        last = first
        async for message in progress:
            last = message
        drained_s = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        s = await asyncio.to_thread(stats, stack)
    complete = sum(1 for x in sent if x.num_tokens == max_tokens and not x.error)
    return {
        "in_flight_at_drain": in_flight,
        "max_tokens": max_tokens,
        "drain_to_empty_s": round(drained_s, 3),
        "drain_progress_messages_first_last": [
            {
                "in_flight": m.num_in_flight,
                "elapsed_s": round(m.elapsed_s, 3),
                "done": m.done,
                "aborted": m.num_aborted,
            }
            for m in (first, last)
        ],
        "scheduler_after": {"running": s.num_running, "waiting": s.num_waiting},
        "requests_completed": complete,
        "requests_lost": num - complete,
        "submit_during_drain": refused.error or "accepted",
        "draining_after": s.draining,
        "ready_after": s.ready,
    }


RUNNERS = {
    "alone": run_two_tenants, "fcfs": run_two_tenants, "fair": run_two_tenants,
    "alone_sync": run_two_tenants, "fair_sync": run_two_tenants,
    "alone_flat": run_two_tenants, "fair_flat": run_two_tenants,
    "fair_1_1": run_saturated, "fair_2_1": run_saturated,
    "priority_fcfs": run_priority, "priority": run_priority, "drain": run_drain,
}  # fmt: skip


# -- the plot -------------------------------------------------------------------------------------


def plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = document["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.6), width_ratios=(2.2, 1, 1))

    def bar(ax: Any, labels: list[str], summaries: list[dict[str, Any]], title: str) -> None:
        for j, q in enumerate(("p50", "p99")):
            values, hatches = [], []
            for s in summaries:
                v = s.get(f"{q}_ms")
                values.append((v if v is not None else s[f"{q}_ms_at_least"]) / 1e3)
                hatches.append("" if v is not None else "//")
            xs = [i + (j - 0.5) * 0.38 for i in range(len(labels))]
            bars = ax.bar(xs, values, width=0.38, label=q)
            for b, h, v in zip(bars, hatches, values, strict=True):
                b.set_hatch(h)
                ax.annotate(f"{v:.2f}" + ("+" if h else ""), (b.get_x() + b.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s, log)")
        ax.set_title(title)
        ax.legend()

    names = {
        "alone": "B alone", "fcfs": "A+B fcfs", "fair": "A+B fair",
        "alone_sync": "B alone\n(no overlap)", "fair_sync": "A+B fair\n(no overlap)",
        "alone_flat": "B alone\n(GPU-like)", "fair_flat": "A+B fair\n(GPU-like)",
    }  # fmt: skip
    b_runs = [(names[k], runs[k]["B_ttft"]) for k in names if k in runs]
    if b_runs:
        bar(axes[0], [k for k, _ in b_runs], [s for _, s in b_runs],
            "Tenant B's TTFT (A floods at 10x)")  # fmt: skip
    p_runs = [(k, runs[k]["high_priority_ttft"]) for k in ("priority_fcfs", "priority")
              if k in runs]  # fmt: skip
    if p_runs:
        bar(axes[1], [{"priority_fcfs": "fcfs", "priority": "priority"}[k] for k, _ in p_runs],
            [s for _, s in p_runs], "High-priority TTFT under a low-priority flood")  # fmt: skip
    ax = axes[2]
    sat = [(k, runs[k]) for k in ("fair_1_1", "fair_2_1") if k in runs]
    for i, (_, r) in enumerate(sat):
        ax.bar(i - 0.2, r["weighted_service_ratio_A_to_B"], width=0.4, color="C0",
               label="measured" if i == 0 else None)  # fmt: skip
        ax.bar(i + 0.2, r["target_ratio"], width=0.4, color="C7",
               label="weights" if i == 0 else None)  # fmt: skip
        ratio = r["weighted_service_ratio_A_to_B"]
        ax.annotate(f"{ratio:.2f}", (i - 0.2, ratio), ha="center", va="bottom")
    ax.set_xticks(range(len(sat)), [f"A:B = {r['target_ratio']:g}:1" for _, r in sat])
    ax.set_ylabel("service A / service B")
    ax.set_title("Fair: weighted service under contention")
    ax.legend()
    fig.suptitle(
        f"llmserve scheduling policies (echo engine, {STEP_MS:g} ms + {TOKEN_MS:g} ms/token steps;"
        f" GPU-like: {FLAT_STEP_MS:g} ms + {FLAT_TOKEN_MS:g} ms/token; max {MAX_NUM_SEQS} running)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    document: dict[str, Any] = {"runs": {}}
    if args.output.exists():
        document = json.loads(args.output.read_text())
    if not args.plot_only:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = Path(tmp)
            write_byte_tokenizer(tokenizer)
            (tokenizer / "config.json").write_text("{}")
            for name in args.scenarios:
                t0 = time.perf_counter()
                result = RUNNERS[name](name, args, tokenizer)
                result["wall_s"] = round(time.perf_counter() - t0, 1)
                # Per run too: a later call may run some scenarios with other settings.
                result["settings"] = {"b_rate_per_s": args.b_rate, "duration_s": args.duration,
                                      "seed": args.seed, "commit": git_commit()}  # fmt: skip
                document["runs"][name] = result
                print(name, json.dumps(result), flush=True)
        document.update(
            benchmark="fairness_study",
            date=time.strftime("%Y-%m-%d"),
            commit=git_commit(),
            hardware=hardware(),
            engine={
                "kind": "echo engine (engine/contract/echo.py)",
                "step_ms": f"{STEP_MS} + {TOKEN_MS} per token computed",
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": 512,
            },
            settings={
                "duration_s": args.duration, "b_rate_per_s": args.b_rate,
                "preemption_grace_steps": args.grace_steps,
                "max_preemptions": args.max_preemptions, "seed": args.seed,
            },
        )  # fmt: skip
    for run in document["runs"].values():
        for key in ("B_ttft", "high_priority_ttft"):
            if key in run:
                run[f"{key}_after_warmup"] = after_warmup(run[key], run["run_s"])
    save(document, args.output)
    plot(document, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
