"""KV transfer throughput of the two --kv-transfer-backend paths (docs/disaggregation.md#transfer-
backends): tcp against torch (gloo on a CPU), for transfers of 1, 8 and 37 blocks of the
built-in model's pool (SmolLM2-135M: 30 layers, keys and values, block_size 16, 3 KV heads,
head_dim 64, float32: 737,280 bytes a block). As between a prefill and a decode engine: the
receiver (a KVReceiver, as a decode engine runs it) in this process, the sender in a second
process, each transfer gathered out of the sender's pool (engine/kv/disaggregation.py's way for
that backend) and pushed to its ack; the receiver takes every arrival into its pool.

    python -m bench.studies.kv_transfer_backends --output bench/results/kv_transfer_backends.json

Per backend and size: the first transfer (torch: it builds the pair's group) apart, then
--repeats transfers; bytes / s over the send (connect, challenge, payload, ack) and over gather
+ send. The backends alternate round by round (--rounds), so the machine's load falls on both.

End to end (a manual check, not in the suite: two stacks of the built-in model cost minutes):

    python -m bench.studies.kv_transfer_backends --stack
        --output bench/results/kv_transfer_stack.json

`llmserve serve --device cpu --prefill-engines 1 --decode-engines 1 --num-threads 1` once per
backend, the same greedy requests (prompts of about 1, 9 and 37 full blocks, 8 tokens each)
one after the other: their tokens must match across the backends, every transfer done.

GPU check (the NCCL path; for bench/gpu_engine_check.sh, a stage of its own when wanted):

    python -m bench.studies.kv_transfer_backends --gpu-check [--output PATH]

With >= 2 GPUs: the receiver's pool on cuda:0, the sender's on cuda:1, backend torch (NCCL),
1 / 8 / 37 blocks of the shape in bfloat16, each arrival compared with what was sent; exit 1 on
a mismatch or a failed transfer. With one GPU: both pools on cuda:0, where NCCL cannot join two
processes: checks that the pair falls back to TCP (a warning) and still delivers exact blocks.
Exit 2 without a GPU. Prints one JSON document (and writes it to --output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from llmserve.engine.kv.transfer import KVReceiver, block_layout, gather_blocks, send_payload
from llmserve.engine.kv.transfer_torch import TorchSender, gather_payload

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # layers, k/v, block_size, kv heads, head_dim
SIZES = (1, 8, 37)
TOKEN = "bench-token"
POOL_BLOCKS = 40


def pool(device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A pool of POOL_BLOCKS blocks: [layers, 2, blocks, block_size, kv heads, head_dim]."""
    layers, kv, *block = BLOCK_SHAPE
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layers, kv, POOL_BLOCKS, *block, generator=generator)
    return values.to(dtype).to(device)


def block_ids(num_blocks: int, i: int) -> list[int]:
    return [(i + 3 * b) % POOL_BLOCKS for b in range(num_blocks)]


def run_sender(args: argparse.Namespace) -> None:
    """The second process: --repeats transfers per size to --send, timings as JSON on stdout."""
    host, _, port = args.send.rpartition(":")
    address = (host, int(port))
    kv_cache = pool(args.device, getattr(torch, args.dtype), args.seed)
    sender = TorchSender(kv_cache.device) if args.backend == "torch" else None
    results: list[dict[str, Any]] = []
    transfer_id = args.first_id
    for num_blocks in args.sizes:
        for i in range(args.repeats + 1):
            ids = block_ids(num_blocks, i)
            t0 = time.perf_counter()
            if sender is not None:
                payload = gather_payload(kv_cache, ids)
                if payload.ready is not None:
                    payload.ready.synchronize()
                t1 = time.perf_counter()
                sender.send(
                    address, TOKEN, transfer_id, payload, num_blocks, block_layout(kv_cache)
                )
            else:
                data = gather_blocks(kv_cache, ids)
                t1 = time.perf_counter()
                send_payload(address, TOKEN, transfer_id, data, num_blocks, block_layout(kv_cache))
            t2 = time.perf_counter()
            results.append(
                {"transfer_id": transfer_id, "num_blocks": num_blocks, "first": i == 0,
                 "block_ids": ids, "gather_s": t1 - t0, "send_s": t2 - t1}
            )  # fmt: skip
            transfer_id += 1
    if sender is not None:
        sender.close()
    print(json.dumps(results), flush=True)


def spawn_sender(
    backend: str, address: tuple[str, int], device: str, dtype: str, args: argparse.Namespace,
    first_id: int,
) -> list[dict[str, Any]]:  # fmt: skip
    command = [
        sys.executable, "-m", "bench.studies.kv_transfer_backends",
        "--send", f"{address[0]}:{address[1]}",
        "--backend", backend, "--device", device, "--dtype", dtype, "--repeats",
        str(args.repeats), "--seed", str(args.seed), "--first-id", str(first_id),
        "--sizes", *map(str, args.sizes),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the sender failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Drain:
    """Takes every arrival into the receiver's pool, in the background, and checks each one
    against the sender's pool (the same seed) when `expected` is given."""

    def __init__(self, receiver: KVReceiver, expected: torch.Tensor | None = None):
        self.receiver = receiver
        self.expected = expected
        self.mismatches: list[int] = []
        self.num_taken = 0
        self.pending: dict[int, list[int]] = {}
        self.cond = threading.Condition()

    def expect(self, transfers: list[tuple[int, list[int]]]) -> None:
        for transfer_id, ids in transfers:
            self.pending[transfer_id] = ids

    def take_all(self, timeout_s: float = 30.0) -> list[int]:
        """Take the expected transfers, in id order; the ids not delivered."""
        missing = []
        for transfer_id in sorted(self.pending):
            ids = self.pending[transfer_id]
            dst = list(range(len(ids)))
            if not self.receiver.take(transfer_id, dst, time.monotonic() + timeout_s):
                missing.append(transfer_id)
                continue
            self.num_taken += 1
            if self.expected is not None:
                got = self.receiver.kv_cache[:, :, dst].cpu()
                if not torch.equal(got, self.expected[:, :, ids].cpu()):
                    self.mismatches.append(transfer_id)
        self.pending.clear()
        return missing


def summarize(rows: list[dict[str, Any]], block_bytes: int) -> list[dict[str, Any]]:
    out = []
    for num_blocks in sorted({r["num_blocks"] for r in rows}):
        of_size = [r for r in rows if r["num_blocks"] == num_blocks]
        steady = [r for r in of_size if not r["first"]]
        first = [r for r in of_size if r["first"]]
        num_bytes = num_blocks * block_bytes
        send = statistics.median(r["send_s"] for r in steady)
        total = statistics.median(r["send_s"] + r["gather_s"] for r in steady)
        out.append({
            "num_blocks": num_blocks,
            "num_bytes": num_bytes,
            "num_transfers": len(steady),
            "send_s_median": send,
            "send_s_min": min(r["send_s"] for r in steady),
            "gather_s_median": statistics.median(r["gather_s"] for r in steady),
            "bytes_per_s_send": num_bytes / send,
            "bytes_per_s_gather_and_send": num_bytes / total,
            "first_send_s": [r["send_s"] for r in first],
            "bytes_per_s_send_by_round": [
                num_bytes / statistics.median(r["send_s"] for r in steady if r.get("round", 0) == k)
                for k in sorted({r.get("round", 0) for r in steady})
            ],
        })  # fmt: skip
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from llmserve.bench.report import git_commit, hardware

    runs: dict[str, list[dict[str, Any]]] = {"tcp": [], "torch": []}
    block_bytes = 0
    for round_index in range(args.rounds):
        order = ("tcp", "torch") if round_index % 2 == 0 else ("torch", "tcp")
        for backend in order:
            receiver = KVReceiver(pool("cpu", torch.float32, args.seed + 1), TOKEN, backend=backend)
            block_bytes = receiver.block_bytes
            expected = pool("cpu", torch.float32, args.seed)
            drain = Drain(receiver, expected)
            rows = spawn_sender(backend, receiver.address, "cpu", "float32", args, 1)
            drain.expect([(r["transfer_id"], r["block_ids"]) for r in rows])
            missing = drain.take_all()
            receiver.close()
            if missing or drain.mismatches:
                raise RuntimeError(f"{backend}: missing {missing}, mismatched {drain.mismatches}")
            for r in rows:
                r["round"] = round_index
            runs[backend] += rows
            print(backend, round_index, summarize(rows, block_bytes), file=sys.stderr)
    return {
        "what": "KV transfer backends, sender and receiver in two processes on this machine",
        "block_shape": BLOCK_SHAPE,
        "dtype": "float32",
        "block_bytes": block_bytes,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "summary": {backend: summarize(rows, block_bytes) for backend, rows in runs.items()},
        "raw": runs,
        "load_average": os.getloadavg(),
        "hardware": hardware(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


STACK_PROMPTS = [
    "Tell me three short, true facts about rivers, the stones that lie in them and the fish "
    "that swim there, please.",
    "Summarize: " + " ".join(f"word{i % 37} river stone" for i in range(30)),
    "Summarize: "
    + " ".join(f"line {i}: the lantern, the harbor and the copper bell" for i in range(45)),
]  # fmt: skip


def stack_check(args: argparse.Namespace) -> int:
    """Both backends through a real 1 prefill + 1 decode stack (module docstring); the exit
    status (1: tokens differ or a transfer did not complete)."""
    from llmserve.bench.report import git_commit, hardware
    from llmserve.client import Client, make_request
    from llmserve.serve_flags import serve_locally

    runs: list[dict[str, Any]] = []
    for backend in ("tcp", "torch"):
        serve_args = ["--device", "cpu", "--prefill-engines", "1", "--decode-engines", "1",
                      "--num-threads", "1", "--kv-transfer-backend", backend]  # fmt: skip
        with serve_locally(serve_args) as stack, Client(stack.gateway_address) as client:
            outputs = []
            for text in STACK_PROMPTS:
                request = make_request(text, max_tokens=8, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                tokens = [t for m in client.stream(request, timeout=300) for t in m.token_ids]
                outputs.append({"tokens": tokens, "seconds": time.perf_counter() - t0})
            stats = stack.scheduler_stats()
        runs.append({
            "backend": backend,
            "serve_args": serve_args,
            "requests": outputs,
            "num_kv_transfers": stats.num_kv_transfers,
            "num_kv_transfers_done": stats.num_kv_transfers_done,
            "num_kv_transfers_failed": dict(stats.num_kv_transfers_failed),
            "kv_transfer_blocks": stats.kv_transfer_blocks,
            "kv_transfer_bytes": stats.kv_transfer_bytes,
            "kv_transfer_s": stats.kv_transfer_s,
        })  # fmt: skip
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "requests"}), file=sys.stderr)
    same = [r["tokens"] for r in runs[0]["requests"]] == [r["tokens"] for r in runs[1]["requests"]]
    done = all(r["num_kv_transfers_done"] == r["num_kv_transfers"] == 3 for r in runs)
    result: dict[str, Any] = {"status": "ok" if same and done else "failed", "same_tokens": same,
              "all_transfers_done": done, "runs": runs, "hardware": hardware(),
              "load_average": os.getloadavg(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("status", "same_tokens", "all_transfers_done")}))
    return 0 if same and done else 1


def gpu_check(args: argparse.Namespace) -> int:
    """The torch backend on GPUs (module docstring); the exit status."""
    count = torch.cuda.device_count()
    if count == 0:
        print(json.dumps({"status": "skipped", "why": "no GPU"}))
        return 2
    sender_device = "cuda:1" if count >= 2 else "cuda:0"
    receiver = KVReceiver(pool("cuda:0", torch.bfloat16, args.seed + 1), TOKEN, backend="torch")
    drain = Drain(receiver, pool("cpu", torch.bfloat16, args.seed))
    args.repeats = min(args.repeats, 5)
    try:
        rows = spawn_sender("torch", receiver.address, sender_device, "bfloat16", args, 1)
        drain.expect([(r["transfer_id"], r["block_ids"]) for r in rows])
        missing = drain.take_all()
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        rows, missing = [], [-1]
        print(str(err), file=sys.stderr)
    finally:
        receiver.close()
    assert receiver.torch is not None
    path = "nccl" if count >= 2 else "tcp fallback (one GPU)"
    fell_back = bool(receiver.torch.over_tcp)
    ok = not missing and not drain.mismatches and fell_back == (count < 2)
    result = {
        "status": "ok" if ok else "failed",
        "num_gpus": count,
        "path": path,
        "fell_back_to_tcp": fell_back,
        "missing": missing,
        "mismatched": drain.mismatches,
        "summary": summarize(rows, receiver.block_bytes) if rows else [],
    }
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", help="the JSON document (default: print only)")
    p.add_argument("--repeats", type=int, default=20, help="transfers per size, after the first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-check", action="store_true", help="the GPU check (module docstring)")
    p.add_argument("--stack", action="store_true", help="end to end (module docstring)")
    # the sender process's own
    p.add_argument("--send", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--first-id", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.send:
        run_sender(args)
        return 0
    if args.gpu_check:
        return gpu_check(args)
    if args.stack:
        return stack_check(args)
    result = measure(args)
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
