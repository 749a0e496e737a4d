"""KV offload on a multi-turn chat: `llmserve serve --device cpu` (the built-in SmolLM2-135M-
Instruct) with and without a host tier (--kv-offload-gb), on conversations whose histories
outgrow the KV pool: prefix hit rate and time to first token per turn.

    python -m bench.studies.kv_offload_chat --output bench/results/kv_offload_chat.json

(bench/results/kv_offload_chat.json: --num-chats 6 --num-turns 3 --user-len 40 --output-len 8
--num-kv-blocks 16 --kv-offload-gb 0.1, on a heavily shared 2-core VM.)

Each of --num-chats conversations has --num-turns turns; turn t sends the whole conversation so
far (the replies included) plus a new user message of about --user-len tokens, greedy, and
--output-len tokens back. Turns go round-robin over the conversations (turn 1 of every chat,
then turn 2 of every chat, ...), one request at a time, so a conversation comes back after every
other has run: with a pool of --num-kv-blocks blocks, far fewer than the histories take, LRU
has evicted its history by then; the host tier keeps it. The configurations alternate, run
after run (--repeats), in one process, so the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from llmserve.bench.report import git_commit, hardware
from llmserve.client import Client, make_request
from llmserve.serve_flags import serve_locally

WORDS = [
    "river",
    "stone",
    "cloud",
    "garden",
    "market",
    "lantern",
    "harbor",
    "violin",
    "pepper",
    "candle",
    "meadow",
    "orbit",
    "copper",
    "winter",
    "signal",
    "planet",
    "thunder",
    "pocket",
    "saddle",
    "forest",
    "mirror",
    "engine",
    "basket",
    "tunnel",
    "falcon",
    "glacier",
    "velvet",
    "compass",
    "island",
    "ladder",
    "marble",
    "needle",
    "oyster",
    "piano",
    "quartz",
    "rocket",
    "silver",
]
SYSTEM = "You are a helpful assistant. Answer briefly."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-chats", type=int, default=12)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=60, help="words per user message (~tokens)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=48, help="the device pool (16 tokens)")
    p.add_argument("--kv-offload-gb", type=float, default=0.3, help="the host tier, when on")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("kv_offload_chat.json"))
    return p.parse_args()


def user_message(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def run_chats(address: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every turn of every chat, round-robin, one at a time: a row per request."""
    rng = random.Random(args.seed)
    chats: list[list[tuple[str, str]]] = [[("system", SYSTEM)] for _ in range(args.num_chats)]
    rows = []
    with Client(address) as client:
        for turn in range(args.num_turns):
            for c, history in enumerate(chats):
                history.append(("user", user_message(rng, args.user_len)))
                request = make_request(
                    messages=history, max_tokens=args.output_len, temperature=0.0,
                    ignore_eos=True,
                )  # fmt: skip
                t0 = time.perf_counter()
                ttft, text, usage = None, "", None
                for msg in client.stream(request, timeout=300):
                    if ttft is None and msg.token_ids:
                        ttft = time.perf_counter() - t0
                    text += msg.text
                    if msg.finish_reason:
                        usage = msg.usage
                assert usage is not None and ttft is not None
                history.append(("assistant", text))
                print(
                    f"  turn {turn} chat {c}: {usage.prompt_tokens} prompt tokens, "
                    f"{usage.cached_prompt_tokens} cached, TTFT {ttft * 1e3:.0f} ms",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                rows.append({
                    "chat": c, "turn": turn, "ttft_ms": ttft * 1e3,
                    "latency_ms": (time.perf_counter() - t0) * 1e3,
                    "prompt_tokens": usage.prompt_tokens,
                    "cached_prompt_tokens": usage.cached_prompt_tokens,
                    "text": text,
                })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Hit rate (cached / prompt tokens) and TTFT over the turns after the first (a first turn
    has no history to hit), and per turn."""
    later = [r for r in rows if r["turn"] > 0]
    per_turn = {}
    for turn in sorted({r["turn"] for r in rows}):
        these = [r for r in rows if r["turn"] == turn]
        per_turn[str(turn)] = {
            "hit_rate": sum(r["cached_prompt_tokens"] for r in these)
            / sum(r["prompt_tokens"] for r in these),
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in these),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in these),
        }
    ttfts = sorted(r["ttft_ms"] for r in later)
    return {
        "hit_rate": sum(r["cached_prompt_tokens"] for r in later)
        / sum(r["prompt_tokens"] for r in later),
        "ttft_ms_p50": statistics.median(ttfts),
        "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "ttft_ms_mean": statistics.mean(ttfts),
        "per_turn": per_turn,
    }


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    serve_args = [
        "--device", "cpu", "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "2048",
    ]  # fmt: skip
    if name == "host-tier":
        serve_args += ["--kv-offload-gb", str(args.kv_offload_gb)]
    with serve_locally(serve_args) as stack:
        rows = run_chats(stack.gateway_address, args)
        stats = stack.scheduler_stats()
    offload = {
        "hit_blocks": dict(stats.kv_offload_hit_blocks),
        "blocks_in": dict(stats.kv_offload_blocks_in),
        "bytes_in": dict(stats.kv_offload_bytes_in),
        "num_swap_ins": stats.num_swap_ins,
        "swap_in_wait_s": stats.swap_in_wait_s,
    }
    summary = summarize(rows)
    print(
        f"{name:10s} hit rate {summary['hit_rate']:.3f}  TTFT p50 {summary['ttft_ms_p50']:.0f} ms"
        f"  mean {summary['ttft_ms_mean']:.0f} ms  offload {offload}",
        flush=True,
    )
    return {"config": name, "serve_args": serve_args, **summary, "offload": offload,
            "requests": rows}  # fmt: skip


def main() -> int:
    args = parse_args()
    runs = []
    for _ in range(args.repeats):
        for name in ("no-tier", "host-tier"):
            runs.append(run_config(name, args))
    texts = {r["config"]: [row["text"] for row in r["requests"]] for r in runs}
    document = {
        "kind": "kv_offload_chat",
        "git_commit": git_commit(),
        "hardware": hardware(),
        "config": {k: v for k, v in vars(args).items() if k != "output"} | {"output": None},
        "same_replies": len({json.dumps(t) for t in texts.values()}) == 1,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"results: {args.output}  same replies with and without: {document['same_replies']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
