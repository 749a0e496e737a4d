"""Prefill / decode disaggregation across "hosts" on one machine, started by hand: every engine
on its own loopback address (127.0.0.2, 127.0.0.3, ...: all loopback on Linux), bound there
alone, so a link works only if the address it is given, or the one an engine reports, is right.

    python -m bench.studies.pd_by_hand                      # 1 prefill + 1 decode engine
    python -m bench.studies.pd_by_hand --prefill-engines 2 --decode-engines 2   # repeated flags
    python -m bench.studies.pd_by_hand
        --control            # the decode engine reports a wrong address

Starts `llmserve engine --engine-role prefill --host 127.0.0.2`, `llmserve engine --engine-role
decode --host 127.0.0.3 --kv-transfer-host 127.0.0.3`, ..., a scheduler on 127.0.0.10 given
`--engine-address` once per decode engine and `--prefill-engine-address` once per prefill engine,
and a gateway on 127.0.0.11, all on one internal token written by `llmserve internal-token`;
sends 4 greedy requests at once through the gateway (prompts of 1-2 full KV blocks; ignore_eos, so
each decodes past its first token and hands off) while polling the scheduler's GetStats. Passes
(exit 0) when every request is answered, num_kv_transfers_done is one per request, none failed,
every engine is up and every decode engine took requests (so took KV at the address it
reports). With --control the decode engines report --kv-transfer-host 127.0.0.9, where nothing
listens: every transfer must fail instead (the requests are still answered, recomputed on the
decode engines), proving the address travels from the flag to the prefill engine's connect.
Writes what it saw as JSON (--out). Built-in model, CPU."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmserve.client import Client, make_request  # noqa: E402
from llmserve.common.net import wait_until_serving  # noqa: E402
from llmserve.protos.scheduler_pb2 import GetStatsRequest  # noqa: E402
from llmserve.protos.scheduler_pb2_grpc import SchedulerStub  # noqa: E402
from llmserve.scheduler.config import SchedulerConfig  # noqa: E402

SCHEDULER_HOST, GATEWAY_HOST, NOWHERE = "127.0.0.10", "127.0.0.11", "127.0.0.9"
# Longer than a KV block (16 tokens) each: only full blocks move, so a shorter prompt moves none.
PROMPTS = [
    "Paris is the capital and largest city of France. It is known for the Eiffel Tower, the "
    "Louvre museum and its cafes. Name three other large cities of France:",
    "The water cycle describes how water evaporates from the surface of the earth, rises into "
    "the atmosphere, cools and condenses into clouds, and falls again as rain or snow. In one "
    "sentence, why does it matter?",
    "A prime number is a natural number greater than one that has no divisors other than one "
    "and itself. The first five prime numbers are",
    "The heart is a muscular organ that pumps blood through the blood vessels of the body, "
    "carrying oxygen and nutrients to the tissues. Its four chambers are called",
]


def ask(gateway: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy request through the gateway; it decodes past its first token (ignore_eos),
    so it hands off."""
    request = make_request(text=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Client(gateway) as client:
        done = client.generate(request)
    return {"prompt": prompt, "prompt_tokens": done.prompt_tokens, "text": done.text,
            "token_ids": done.token_ids, "completion_tokens": done.completion_tokens}  # fmt: skip


class Watch:
    """Polls the scheduler's GetStats in the background: each engine's most requests at once
    (running, waiting, or with KV on its way), by its address; then the last reading."""

    def __init__(self, scheduler: str, config: SchedulerConfig):
        self.scheduler, self.config = scheduler, config
        self.busiest: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def read(self) -> Any:
        with self.config.channel(self.scheduler, aio=False) as channel:
            return SchedulerStub(channel).GetStats(
                GetStatsRequest(), timeout=10, metadata=self.config.peer_metadata()
            )

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            for row in self.read().engines:
                busy = row.num_running + row.num_waiting + row.num_transferring
                key = f"{row.role} {row.address}"
                self.busiest[key] = max(self.busiest.get(key, 0), busy)

    def last(self) -> Any:
        self.stop.set()
        self.thread.join()
        return self.read()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-engines", type=int, default=1)
    p.add_argument("--decode-engines", type=int, default=1)
    p.add_argument("--control", action="store_true", help="the decode engines report 127.0.0.9")
    p.add_argument("--kv-transfer-backend", default="tcp", help="every engine's (tcp, torch)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to start")
    p.add_argument("--out", type=Path, default=None, help="write the outcome here (JSON)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pd_by_hand."))
    print(f"logs: {work}", flush=True)
    token = work / "internal-token"
    llmserve = [sys.executable, "-m", "llmserve.cli"]
    subprocess.run([*llmserve, "internal-token", str(token)], cwd=ROOT, check=True)
    common = ["--internal-token", f"@{token}", "--metrics-port", "0"]
    engine = ["engine", "--device", "cpu", "--num-threads", "1", "--max-loras", "0",
              "--kv-transfer-backend", args.kv_transfer_backend, *common]  # fmt: skip
    hosts = [f"127.0.0.{2 + i}" for i in range(args.prefill_engines + args.decode_engines)]
    prefill_hosts, decode_hosts = hosts[: args.prefill_engines], hosts[args.prefill_engines :]
    assert NOWHERE not in hosts and len(hosts) <= 7, "engines: 127.0.0.2 .. 127.0.0.8"
    commands: dict[str, list[str]] = {}
    addresses: dict[str, str] = {}
    for i, host in enumerate(prefill_hosts):
        port = free_port(host)
        addresses[f"prefill-{i}"] = f"{host}:{port}"
        commands[f"prefill-{i}"] = [*engine, "--engine-role", "prefill", "--host", host,
                                    "--port", str(port)]  # fmt: skip
    for i, host in enumerate(decode_hosts):
        port = free_port(host)
        addresses[f"decode-{i}"] = f"{host}:{port}"
        commands[f"decode-{i}"] = [
            *engine, "--engine-role", "decode", "--host", host, "--port", str(port),
            "--kv-transfer-port", str(free_port(host)),
            "--kv-transfer-host", NOWHERE if args.control else host,
        ]  # fmt: skip
    scheduler = f"{SCHEDULER_HOST}:{free_port(SCHEDULER_HOST)}"
    commands["scheduler"] = ["scheduler", "--host", SCHEDULER_HOST,
                             "--port", scheduler.rpartition(":")[2], *common]  # fmt: skip
    for name, address in addresses.items():
        flag = "--prefill-engine-address" if name.startswith("prefill") else "--engine-address"
        commands["scheduler"] += [flag, address]
    gateway = f"{GATEWAY_HOST}:{free_port(GATEWAY_HOST)}"
    commands["gateway"] = ["gateway", "--host", GATEWAY_HOST, "--port", gateway.rpartition(":")[2],
                           "--http-port", str(free_port(GATEWAY_HOST)),
                           "--scheduler-address", scheduler, *common]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT),
               LLMSERVE_LOG_LEVEL=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"))  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outcome: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "load_average_at_start": os.getloadavg(),
        "control": args.control,
        "commands": {name: ["llmserve", *argv] for name, argv in commands.items()},
    }

    def logs() -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text()[-2500:]}" for f in sorted(work.glob("*.log"))
        )

    ok = False
    t0 = time.monotonic()
    try:
        for name, argv in commands.items():
            log = open(work / f"{name}.log", "wb")  # noqa: SIM115
            procs[name] = subprocess.Popen(
                [*llmserve, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            print(f"{name}: llmserve {' '.join(argv)}", flush=True)
        if not wait_until_serving(gateway, timeout=args.timeout):
            print(f"the gateway did not serve in {args.timeout:.0f} s\n{logs()}", file=sys.stderr)
            return 1
        outcome["ready_s"] = round(time.monotonic() - t0, 1)
        watch = Watch(scheduler, SchedulerConfig(internal_token=f"@{token}"))
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: they spread over engines
            answers = list(pool.map(lambda p: ask(gateway, p, args.max_tokens), PROMPTS))
        for answer in answers:
            print(f"{answer['prompt']!r} -> {answer['text']!r}", flush=True)
        outcome["answers"] = answers
        stats = watch.last()
        outcome["engines"] = [
            {"role": r.role, "address": r.address, "ready": r.ready,
             "most_requests": watch.busiest.get(f"{r.role} {r.address}", 0)}
            for r in stats.engines
        ]  # fmt: skip
        print(json.dumps(outcome["engines"]), flush=True)
        keys = ["num_kv_transfers", "num_kv_transfers_done", "num_kv_transfers_failed",
                "kv_transfer_blocks", "kv_transfer_bytes", "kv_transfer_s"]  # fmt: skip
        outcome["stats"] = {k: getattr(stats, k) for k in keys if hasattr(stats, k)}
        failed = stats.num_kv_transfers_failed  # by reason
        outcome["stats"]["num_kv_transfers_failed"] = dict(failed)
        print(json.dumps(outcome["stats"]), flush=True)
        answered = all(a["completion_tokens"] == args.max_tokens for a in answers)
        done_count = stats.num_kv_transfers_done
        num_failed = sum(dict(failed).values())
        want = (0, len(PROMPTS)) if args.control else (len(PROMPTS), 0)
        # Every decode engine took requests (so a transfer to the address it reports, when
        # none failed), every engine is up.
        used = all(e["most_requests"] > 0 for e in outcome["engines"] if e["role"] == "decode")
        up = len(outcome["engines"]) == len(hosts) and all(e["ready"] for e in outcome["engines"])
        ok = answered and (done_count, num_failed) == want and used and up
        outcome["passed"] = ok
        print("PASS" if ok else f"FAIL\n{logs()}", flush=True)
    finally:
        for proc in reversed(list(procs.values())):
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        outcome["wall_s"] = round(time.monotonic() - t0, 1)
        if args.out is not None:
            args.out.write_text(json.dumps(outcome, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
