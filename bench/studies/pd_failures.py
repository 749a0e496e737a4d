"""Prefill / decode disaggregation's failure handling, timed: faults injected into stacks of echo
engines (engine/contract/echo.py) with bench/studies/pd_gpu_model.py's modelled 8B step times and
KV, through the real gateway, scheduler and transfer channel. Not a GPU measurement.

    python -m bench.studies.pd_failures      # every scenario twice: bench/results/pd_failures.json

Three stacks, each started once (`serve --prefill-engines N --decode-engines M`, fake engines):

- A: 1 prefill + 1 decode, the 20 GB/s link, faults through the engines' test hook
  LLMSERVE_KV_TRANSFER_FAULT=@file (engine/kv/disaggregation.py): `baseline` (no fault), `drop`
  (every transfer's connection dropped half-way), `stall` (every transfer held; the scheduler gives
  it up at the default --kv-transfer-timeout-s 2), `cancel` (the client cancels a request whose
  transfer is held).
- B: 1 prefill + 1 decode over the modelled 1.25 GB/s link (a 2,000-token prompt's KV holds it
  208 ms, so transfers queue): `kill-prefill` (kill -9 with transfers in flight), `kill-decode`
  (kill -9 mid-decode, transfers in flight too), each engine restarted after; then `kill-all`
  (both killed while requests stream: how fast a new request gets UNAVAILABLE, and what happens
  to the streaming ones when the engines come back).
- C: 2 prefill + 2 decode over 1.25 GB/s: `kill-one-of-each` (a prefill and a decode engine
  killed once every request has its first token).

Per request: the time from the fault (kills) or from its own first token (drop, stall) to its
next token and to its end; whether it got exactly the echo's tokens (none lost, none twice); per
scenario the transfer counters' change (GetStats num_kv_transfers_done / _failed by reason).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from bench.studies.pd_gpu_model import (
    BLOCK_SIZE,
    KV_BYTES_PER_TOKEN,
    STEP_MS,
    TOKEN_MS,
    fake_engine,
)
from bench.studies.pd_mixed import CHAT_TOPICS, WORDS, pct, write_results
from llmserve.bench.byte_tokenizer import write_byte_tokenizer
from llmserve.client import Client, make_request
from llmserve.engine.kv.disaggregation import FAULT_ENV
from llmserve.serve_flags import serve_locally
from llmserve.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
FAST_LINK, SLOW_LINK = 20.0, 1.25  # GB/s: pd_gpu_model's PCIe / RDMA and 10 Gb Ethernet links
REASONS = ("deadline", "dropped", "prefill_lost", "decode_lost", "cancelled")
READY_S = 120.0  # an engine restarted: until the scheduler sees it up


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=4, help="short prompts per scenario")
    p.add_argument("--longs", type=int, default=2, help="~2,000-token prompts per scenario")
    p.add_argument("--cancels", type=int, default=6, help="requests cancelled mid-transfer")
    p.add_argument("--rounds", type=int, default=2, help="every scenario this many times")
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/pd_failures.json")
    return p.parse_args()


def echo(prompt: str, n: int) -> str:
    """The echo engine's completion of n tokens (byte tokenizer: a token a byte)."""
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


class Watched:
    """One request streamed on its own thread: when each message arrived (time.monotonic()) and
    how many tokens it held, its text, and the error that ended it (a gRPC code's name)."""

    def __init__(self, client: Client, name: str, prompt: str, max_tokens: int, timeout: float):
        self.name, self.prompt, self.max_tokens = name, prompt, max_tokens
        self.arrivals: list[tuple[float, int]] = []
        self.text = ""
        self.error: str | None = None
        self.t_start = time.monotonic()
        self.t_end: float | None = None
        request = make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.call = client.start(request, timeout=timeout)
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        import grpc

        try:
            for msg in self.call:
                if msg.token_ids:
                    self.arrivals.append((time.monotonic(), len(msg.token_ids)))
                self.text += msg.text
        except grpc.RpcError as err:
            self.error = err.code().name
        self.t_end = time.monotonic()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def wait_tokens(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.num_tokens < n and self.t_end is None and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.num_tokens >= n

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def row(self, fault_at: float | None) -> dict[str, Any]:
        """Its times (fault_times) and whether it got exactly the echo."""
        first = self.arrivals[0][0] if self.arrivals else None
        return {
            "name": self.name,
            "prompt_tokens": len(self.prompt.encode()),
            "max_tokens": self.max_tokens,
            "ttft_ms": round((first - self.t_start) * 1e3, 1) if first is not None else None,
            **fault_times(self.arrivals, self.t_end, fault_at),
            "num_tokens": self.num_tokens,
            "exact": self.error is None and self.text == echo(self.prompt, self.max_tokens),
            "error": self.error,
        }  # fmt: skip


def fault_times(
    arrivals: list[tuple[float, int]], t_end: float | None, fault_at: float | None
) -> dict[str, Any]:
    """A request's times in ms from fault_at (None: from its own first token) to its next token
    and to its end (None: not seen), the tokens it had by then, and whether the fault hit it (it
    had not ended by then)."""
    ref = fault_at if fault_at is not None else (arrivals[0][0] if arrivals else None)
    if ref is None:
        return {"tokens_before_fault": 0, "affected": True, "next_token_ms": None, "end_ms": None}
    later = [t for t, _ in arrivals if t > ref]
    return {
        "tokens_before_fault": sum(n for t, n in arrivals if t <= ref),
        "affected": t_end is None or t_end > ref,
        "next_token_ms": round((later[0] - ref) * 1e3, 1) if later else None,
        "end_ms": round((t_end - ref) * 1e3, 1) if t_end is not None else None,
    }


def prompts(tag: str, chats: int, longs: int, seed: int) -> list[tuple[str, str]]:
    """(name, prompt): chats of ~65 tokens and ~2,000-token prompts (pd_gpu_model's load), each
    opening with tag so that no scenario's blocks are in another's prefix cache."""
    rng = random.Random(seed)
    out = []
    for i in range(chats):
        topic = CHAT_TOPICS[i % len(CHAT_TOPICS)]
        out.append((f"chat-{i}", f"[{tag} {i}] Tell me one short, true fact about {topic}."))
    for i in range(longs):
        words = " ".join(rng.choice(WORDS) for _ in range(288))
        out.append((f"long-{i}", f"[{tag} long {i}] Summarize: {words}"))
    return out


def counters(stack: Stack) -> dict[str, int]:
    s = stack.scheduler_stats()
    return {"done": s.num_kv_transfers_done, **{r: s.num_kv_transfers_failed[r] for r in REASONS}}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def wait_stats(stack: Stack, ok: Callable[[Any], bool], timeout: float) -> float | None:
    """Seconds until ok(GetStats) holds (polled every 5 ms), or None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ok(stack.scheduler_stats()):
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def idle(s: Any) -> bool:
    """No request running or waiting, every block free on both sides, no transfer awaited."""
    return (
        s.num_running == 0 and s.num_waiting == 0 and s.num_transferring == 0
        and s.num_free_blocks == s.num_blocks and s.prefill_num_free_blocks == s.prefill_num_blocks
    )  # fmt: skip


def summary(
    name: str, args: argparse.Namespace, rows: list[dict[str, Any]], moved: dict[str, int],
    **more: Any,
) -> dict[str, Any]:  # fmt: skip
    """A scenario's run: p50 and max over the requests the fault hit, and every request."""
    hit = [r for r in rows if r["affected"]]
    nxt = [r["next_token_ms"] for r in hit if r["next_token_ms"] is not None]
    end = [r["end_ms"] for r in hit if r["end_ms"] is not None]
    out = {
        "scenario": name,
        "round": args.round,
        "num_requests": len(rows),
        "num_affected": len(hit),
        "num_exact": sum(r["exact"] for r in rows),
        "next_token_ms_p50": pct(nxt, 0.5), "next_token_ms_max": max(nxt, default=None),
        "end_ms_p50": pct(end, 0.5), "end_ms_max": max(end, default=None),
        "transfers": moved,
        "load_average": os.getloadavg(),
        **more,
        "requests": rows,
    }  # fmt: skip
    shown = {k: v for k, v in out.items() if k not in ("requests",)}
    print(f"{name}: {shown}", flush=True)
    return out


def texts(tag: str, args: argparse.Namespace, chats: int, longs: int) -> list[tuple[str, str]]:
    """prompts() for this scenario and round (none shares a block with another's)."""
    tag = f"{tag} round {args.round}"
    return prompts(tag, chats, longs, seed=zlib.crc32(tag.encode()))


def load(stack: Stack, tag: str, args: argparse.Namespace, max_tokens: int) -> list[Watched]:
    client = Client(stack.gateway_address)
    return [
        Watched(client, name, text, max_tokens, timeout=120)
        for name, text in texts(tag, args, args.chats, args.longs)
    ]


def finish(watched: list[Watched], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for w in watched:
        w.join(max(0.0, deadline - time.monotonic()))


@contextmanager
def fault(path: Path, what: str) -> Iterator[None]:
    path.write_text(what)
    try:
        yield
    finally:
        path.unlink()


def hooked(stack: Stack, name: str, args: argparse.Namespace, fault_file: Path) -> dict:
    """baseline / drop / stall: every request's transfer under the fault; times from each
    request's first token (its handoff)."""
    before = counters(stack)
    if name == "baseline":
        watched = load(stack, name, args, max_tokens=24)
        finish(watched)
    else:
        with fault(fault_file, name):
            watched = load(stack, name, args, max_tokens=24)
            finish(watched)
    settle = wait_stats(stack, idle, 30)
    rows = [w.row(None) for w in watched]
    return summary(name, args, rows, delta(before, counters(stack)), idle_after_s=settle)


def cancelled_since(before: int, s: Any) -> bool:
    return bool(s.num_kv_transfers_failed["cancelled"] > before)


def cancels(stack: Stack, args: argparse.Namespace, fault_file: Path) -> dict:
    """A request whose transfer is held (stall) cancelled: the time until GetStats counts it
    cancelled, and until every block on both sides is free again."""
    before = counters(stack)
    rows: list[dict[str, Any]] = []
    client = Client(stack.gateway_address)
    held = texts("cancel", args, args.cancels - args.cancels // 2, args.cancels // 2)
    with fault(fault_file, "stall"):
        for name, text in held:
            cancelled = stack.scheduler_stats().num_kv_transfers_failed["cancelled"]
            w = Watched(client, name, text, 24, timeout=60)
            w.wait_tokens(1, 30)
            in_flight = wait_stats(stack, lambda s: s.num_transferring >= 1, 5) is not None
            t0 = time.monotonic()
            w.call.cancel()
            counted = wait_stats(stack, partial(cancelled_since, cancelled), 10)
            freed = wait_stats(stack, idle, 10)
            elapsed = time.monotonic() - t0
            w.join(5)
            rows.append({
                "name": name, "prompt_tokens": len(text.encode()), "in_flight": in_flight,
                "tokens_before_cancel": w.num_tokens, "error": w.error,
                "counted_ms": round(counted * 1e3, 1) if counted is not None else None,
                "all_free_ms": round(elapsed * 1e3, 1) if freed is not None else None,
            })  # fmt: skip
    free = [r["all_free_ms"] for r in rows if r["all_free_ms"] is not None]
    out = {
        "scenario": "cancel", "round": args.round, "num_requests": len(rows),
        "all_free_ms_p50": pct(free, 0.5), "all_free_ms_max": max(free, default=None),
        "num_freed": len(free), "transfers": delta(before, counters(stack)),
        "load_average": os.getloadavg(), "requests": rows,
    }  # fmt: skip
    print(f"cancel: { {k: v for k, v in out.items() if k != 'requests'} }", flush=True)
    return out


def restart(stack: Stack, names: tuple[str, ...]) -> dict[str, Any]:
    """Start names (killed) again, once the scheduler has seen an engine down; then one request
    (whether it moved its KV: the first after a restart may run whole). Seconds until seen
    down (None: not within 10 s) and from the start until every engine is up."""
    down = wait_stats(stack, lambda s: not all(e.ready for e in s.engines), 10)
    stack.start(names)
    up = wait_stats(stack, lambda s: all(e.ready for e in s.engines), READY_S)
    done = stack.scheduler_stats().num_kv_transfers_done
    # A prompt no engine has seen (the same one each time would be a prefix hit on a decode
    # engine that was not restarted, with nothing to move).
    request = make_request(f"[warm-up {uuid.uuid4().hex}] " + "word " * 40, max_tokens=4,
                           temperature=0.0)  # fmt: skip
    Client(stack.gateway_address).generate(request, timeout=60)
    moved = stack.scheduler_stats().num_kv_transfers_done - done
    return {"seen_down_s": down, "up_s": up, "next_request_moved_kv": moved > 0}


def kill_prefill(stack: Stack, args: argparse.Namespace) -> dict:
    """kill -9 of the prefill engine once transfers queue on the slow link."""
    before = counters(stack)
    watched = load(stack, "kill-prefill", args, max_tokens=24)
    in_flight = wait_stats(stack, lambda s: s.num_transferring >= 2, 10) is not None
    transferring = stack.scheduler_stats().num_transferring
    t_fault = time.monotonic()
    stack.kill("engine-prefill")
    finish(watched)
    rows = [w.row(t_fault) for w in watched]
    moved = delta(before, counters(stack))
    back = restart(stack, ("engine-prefill",))
    return summary(
        "kill-prefill", args, rows, moved, in_flight_at_kill=transferring if in_flight else 0,
        restart=back, idle_after_s=wait_stats(stack, idle, 30),
    )  # fmt: skip


def kill_decode(stack: Stack, args: argparse.Namespace) -> dict:
    """kill -9 of the decode engine while the chats decode there and the long prompts' KV is on
    its way."""
    before = counters(stack)
    client = Client(stack.gateway_address)
    chosen = texts("kill-decode", args, args.chats, args.longs)
    chats = [Watched(client, n, t, 48, timeout=120) for n, t in chosen if n.startswith("chat")]
    for w in chats:
        w.wait_tokens(3, 10)  # the first from the prefill engine, then the decode engine's
    longs = [Watched(client, n, t, 24, timeout=120) for n, t in chosen if n.startswith("long")]
    for w in longs:
        w.wait_tokens(1, 10)
    in_flight = wait_stats(stack, lambda s: s.num_transferring >= 1, 2) is not None
    transferring = stack.scheduler_stats().num_transferring
    t_fault = time.monotonic()
    stack.kill("engine")
    watched = chats + longs
    finish(watched)
    rows = [w.row(t_fault) for w in watched]
    moved = delta(before, counters(stack))
    back = restart(stack, ("engine",))
    return summary(
        "kill-decode", args, rows, moved, in_flight_at_kill=transferring if in_flight else 0,
        restart=back, idle_after_s=wait_stats(stack, idle, 30),
    )  # fmt: skip


def kill_all(stack: Stack, args: argparse.Namespace, tries: int = 8) -> dict:
    """Both engines killed while requests stream: new requests (each sent as the last ended)
    until `tries` got UNAVAILABLE or 20 s passed; then both restarted, and the streaming ones
    followed to their end."""
    import grpc

    client = Client(stack.gateway_address)
    watched = [
        Watched(client, n, t, 200, timeout=180) for n, t in texts("kill-all", args, args.chats, 0)
    ]
    for w in watched:
        w.wait_tokens(3, 10)
    stack.kill("engine-prefill")
    stack.kill("engine")
    t_fault = time.monotonic()
    attempts: list[dict[str, Any]] = []
    while sum(a["code"] == "UNAVAILABLE" for a in attempts) < tries:
        sent = time.monotonic()
        if sent - t_fault > 20:
            break
        text = f"[new {args.round} {len(attempts)}] hello"
        request = make_request(text, max_tokens=4, temperature=0.0)
        try:
            client.generate(request, timeout=5)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        attempts.append({
            "sent_after_ms": round((sent - t_fault) * 1e3, 1),
            "answered_ms": round((time.monotonic() - sent) * 1e3, 1), "code": code,
        })  # fmt: skip
    unavailable = [a for a in attempts if a["code"] == "UNAVAILABLE"]
    streaming = [w.num_tokens for w in watched]  # tokens each had while no engine was up
    t_restart = time.monotonic()
    back = restart(stack, ("engine-prefill", "engine"))
    finish(watched, 120)
    rows = [w.row(t_restart) for w in watched]
    for row, n in zip(rows, streaming, strict=True):
        row["tokens_while_down"] = n
    answered = [a["answered_ms"] for a in unavailable]
    return summary(
        "kill-all", args, rows, {}, attempts=attempts,
        first_unavailable_ms=(
            round(unavailable[0]["sent_after_ms"] + unavailable[0]["answered_ms"], 1)
            if unavailable else None
        ),
        unavailable_answer_ms_p50=pct(answered, 0.5),
        unavailable_answer_ms_max=max(answered, default=None), restart=back,
        times_from="the engines' restart", idle_after_s=wait_stats(stack, idle, 30),
    )  # fmt: skip


def kill_one_of_each(stack: Stack, args: argparse.Namespace) -> dict:
    """2 prefill + 2 decode: a prefill and a decode engine killed once every request has its
    first token (chats decoding, the long prompts' KV queued on the slow link)."""
    before = counters(stack)
    watched = load(stack, "kill-one-of-each", args, max_tokens=64)
    for w in watched:
        w.wait_tokens(1, 10)
    transferring = stack.scheduler_stats().num_transferring
    t_fault = time.monotonic()
    stack.kill("engine-prefill")
    stack.kill("engine-decode-2")
    finish(watched)
    rows = [w.row(t_fault) for w in watched]
    moved = delta(before, counters(stack))
    settled = wait_stats(stack, idle, 30)
    return summary(
        "kill-one-of-each", args, rows, moved, in_flight_at_kill=transferring, idle_after_s=settled,
        restart=restart(stack, ("engine-prefill", "engine-decode-2")),
    )  # fmt: skip


def serve_args(tokenizer: Path, prefill: int, decode: int) -> list[str]:
    return [
        "--model", str(tokenizer), "--served-model-name", "fake-echo", "--max-model-len", "4096",
        "--num-kv-blocks", "8192", "--block-size", str(BLOCK_SIZE),
        "--prefill-engines", str(prefill), "--decode-engines", str(decode),
    ]  # fmt: skip


def main() -> int:
    args = parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="pd-failures-") as directory:
        tokenizer = Path(directory)
        write_byte_tokenizer(tokenizer)
        (tokenizer / "config.json").write_text("{}")  # a model directory, for the gateway
        fault_file = tokenizer / "fault"
        env = {FAULT_ENV: f"@{fault_file}"}
        with serve_locally(serve_args(tokenizer, 1, 1), fake=fake_engine(FAST_LINK), env=env) as a:
            for args.round in range(args.rounds):  # noqa: B020 (a field of args, not args)
                runs += [
                    hooked(a, name, args, fault_file) for name in ("baseline", "drop", "stall")
                ]
                runs.append(cancels(a, args, fault_file))
        with serve_locally(serve_args(tokenizer, 1, 1), fake=fake_engine(SLOW_LINK)) as b:
            for args.round in range(args.rounds):  # noqa: B020 (a field of args, not args)
                runs += [kill_prefill(b, args), kill_decode(b, args)]
            # Last: after every engine came back, a prefill engine may go on running requests
            # whole (the next request does not move its KV: `next_request_moved_kv`).
            for args.round in range(args.rounds):  # noqa: B020 (a field of args, not args)
                runs.append(kill_all(b, args))
        with serve_locally(serve_args(tokenizer, 2, 2), fake=fake_engine(SLOW_LINK)) as c:
            for args.round in range(args.rounds):  # noqa: B020 (a field of args, not args)
                runs.append(kill_one_of_each(c, args))
    args.model = {
        "step_ms": STEP_MS, "token_ms": TOKEN_MS, "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "links_gb_per_s": [FAST_LINK, SLOW_LINK],
        "kv_transfer_timeout_s": 2.0,
    }  # fmt: skip
    write_results("pd_failures", args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
