"""A model of prefill / decode disaggregation on GPUs: bench/studies/pd_mixed.py's mixed load (short
chats decoding while long prompts arrive) on echo engines (engine/contract/echo.py) whose steps take
the time an 8B model's would on one H100 / H200-class GPU per engine, and whose KV transfers take
the time its KV would on the link. The scheduler, gateway, client and transfer channel are the real
ones; only the engine's arithmetic is modelled. Not a GPU measurement.

    python -m bench.studies.pd_gpu_model --repeats 2          # every config twice, then the plot
    python -m bench.studies.pd_gpu_model --num-chats 12 --long-interval 0.5 \
        --output bench/results/pd_gpu_model_heavy.json --plot bench/results/pd_gpu_model_heavy.png
    python -m bench.studies.pd_gpu_model --plot-only          # the plot of --output

The model (docs/disaggregation.md, "A model of the GPU case", says why these numbers):

- a step takes STEP_MS + TOKEN_MS per token it computes: 25 ms + 1/16 ms a token, so a decode
  step of a few requests ~25 ms and a 2,000-token prompt's step 150 ms (prefill at 16k tokens/s
  once the fixed cost is paid);
- a KV block (16 tokens) is 2 MiB: Llama-3-8B's 32 layers x 8 KV heads x 128 dims x 2 (K, V)
  x 2 bytes (bf16) = 128 KiB a token;
- the link: 20 GB/s (PCIe or a 200 Gb/s RDMA NIC, effective), 150 GB/s (NVLink between two GPUs
  of one node, effective), or 1.25 GB/s (10 Gb Ethernet), one transfer at a time.

Configs: one engine (one GPU); two data-parallel replicas (two GPUs, the gateway routing
between them); 1 prefill + 1 decode engine (two GPUs) over each link; on four GPUs, four
replicas, 2 prefill + 2 decode and 1 prefill + 3 decode engines under one scheduler:

    python -m bench.studies.pd_gpu_model --configs colocated-dp4 2p2d-20GBps 1p3d-20GBps \
        --num-chats 24 --long-interval 0.25 \
        --output bench/results/pd_gpu_model_4gpu.json --plot bench/results/pd_gpu_model_4gpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.studies.pd_mixed import add_load_args, pct, plot_runs, run_stack, write_results
from llmserve.bench.byte_tokenizer import EOS_TOKEN_ID, TINY_VOCAB, write_byte_tokenizer
from llmserve.engine.contract.echo import EchoEngineConfig

ROOT = Path(__file__).resolve().parents[2]
STEP_MS = 25.0  # a step's fixed cost: between the weights-read floor (3.75 ms) and HF's 62 ms
TOKEN_MS = 1 / 16  # each token computed: prefill at 16k tokens / s
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # Llama-3-8B, bf16: 128 KiB
BLOCK_SIZE = 16
PD = ["--prefill-engines", "1", "--decode-engines", "1"]
CONFIGS: dict[str, tuple[list[str], float]] = {  # serve flags, link GB/s
    "colocated": ([], 0.0),
    "colocated-dp2": (["--data-parallel-size", "2"], 0.0),
    "1p1d-20GBps": (PD, 20.0),
    "1p1d-150GBps": (PD, 150.0),
    "1p1d-1.25GBps": (PD, 1.25),
    # Four GPUs: four replicas, or one scheduler over more engines per role.
    "colocated-dp4": (["--data-parallel-size", "4"], 0.0),
    "2p2d-20GBps": (["--prefill-engines", "2", "--decode-engines", "2"], 20.0),
    "1p3d-20GBps": (["--prefill-engines", "1", "--decode-engines", "3"], 20.0),
}
LABELS = {
    "colocated": "colocated\n1 GPU",
    "colocated-dp2": "2 replicas\n2 GPUs",
    "1p1d-20GBps": "1p+1d\n20 GB/s",
    "1p1d-150GBps": "1p+1d\n150 GB/s",
    "1p1d-1.25GBps": "1p+1d\n1.25 GB/s",
    "colocated-dp4": "4 replicas\n4 GPUs",
    "2p2d-20GBps": "2p+2d\n20 GB/s",
    "1p3d-20GBps": "1p+3d\n20 GB/s",
}
PLOTTED = [
    ("chat ITL (ms, log)", "chat_itl_ms"),
    ("chat gap before token 2 (ms, log)", "chat_second_token_gap_ms"),
    ("chat TTFT (ms, log)", "chat_ttft_ms"),
    ("long TTFT (ms, log)", "long_ttft_ms"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    # pd_mixed's load, scaled to the GPU's speed: a long prompt (288 words, about 2,000
    # tokens of the byte tokenizer) every second, 40 s a run.
    p.set_defaults(long_len=288, long_interval=1.0, long_delay=2.0, duration=40.0)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/pd_gpu_model.json")
    p.add_argument("--plot", type=Path, default=ROOT / "bench/results/pd_gpu_model.png")
    p.add_argument("--plot-only", action="store_true")
    return p.parse_args()


def fake_engine(link_gb_per_s: float) -> EchoEngineConfig:
    """The echo engine with the modelled step time and KV (the link: prefill engines only)."""
    return EchoEngineConfig(
        vocab_size=TINY_VOCAB, eos_token_ids=(EOS_TOKEN_ID,), step_delay_ms=STEP_MS,
        step_token_delay_ms=TOKEN_MS, kv_block_bytes=KV_BYTES_PER_TOKEN * BLOCK_SIZE,
        kv_link_gb_per_s=link_gb_per_s,
    )  # fmt: skip


def run_config(name: str, args: argparse.Namespace, tokenizer: Path, seed: int) -> dict[str, Any]:
    flags, link = CONFIGS[name]
    serve_args = [
        "--model", str(tokenizer), "--served-model-name", "fake-echo", "--max-model-len", "4096",
        "--num-kv-blocks", "8192", "--block-size", str(BLOCK_SIZE), *flags,
    ]  # fmt: skip
    run = run_stack(name, serve_args, args, seed, fake=fake_engine(link))
    transfers = run["transfers"]
    done = transfers["num_kv_transfers_done"]
    transfers["mean_transfer_ms"] = transfers["kv_transfer_s"] / done * 1e3 if done else None
    longs = [r["prompt_tokens"] for r in run["requests"] if r["kind"] == "long"]
    run["long_prompt_tokens_mean"] = sum(longs) / len(longs) if longs else None
    run["link_gb_per_s"] = link
    run["repeat"] = seed
    run.update(handoff_gaps(run["requests"]))
    return run


def handoff_gaps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The chats' gap before their second token (on 1 prefill + 1 decode: the handoff, the
    transfer and the decode engine's admission), and their ITL p99 without it."""
    chats = [r for r in rows if r["kind"] == "chat" and r["itl_ms"]]
    second = [r["itl_ms"][0] for r in chats]
    later = [g for r in chats for g in r["itl_ms"][1:]]
    return {
        "chat_second_token_gap_ms_p50": pct(second, 0.5),
        "chat_second_token_gap_ms_p99": pct(second, 0.99),
        "chat_itl_after_second_ms_p50": pct(later, 0.5),
        "chat_itl_after_second_ms_p99": pct(later, 0.99),
    }


def ordered(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """runs by config (CONFIGS' order), then by repeat."""
    order = list(CONFIGS)
    return sorted(runs, key=lambda r: (order.index(r["config"]), r.get("repeat", 0)))


def label(run: dict[str, Any], repeats: int) -> str:
    name = LABELS.get(run["config"], run["config"])
    return f"{name}\nrun {run['repeat'] + 1}" if repeats > 1 else name


def plot(path: Path, out: Path) -> None:
    document = json.loads(path.read_text())
    load = document["config"]
    plot_runs(
        [(label(run, load["repeats"]), run) for run in ordered(document["runs"])], out,
        "output tok/s (modelled GPUs)",
        "Modelled GPUs (echo engines, an 8B model's step times and KV): "
        f"{load['num_chats']} chats of {load['chat_tokens']} tokens, a {load['long_len']}-word "
        f"(~2,000-token) prompt every {load['long_interval']} s",
        PLOTTED,
    )  # fmt: skip


def main() -> int:
    args = parse_args()
    if not args.plot_only:
        with tempfile.TemporaryDirectory(prefix="pd-gpu-model-") as directory:
            tokenizer = Path(directory)
            write_byte_tokenizer(tokenizer)
            (tokenizer / "config.json").write_text("{}")  # a model directory, for the gateway
            runs = [
                run_config(name, args, tokenizer, seed=repeat)
                for repeat in range(args.repeats)
                for name in args.configs
            ]
        args.model = {
            "step_ms": STEP_MS, "token_ms": TOKEN_MS, "block_size": BLOCK_SIZE,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        }  # fmt: skip
        write_results("pd_gpu_model", args, runs)
    plot(args.output, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
