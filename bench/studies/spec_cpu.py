"""Issue 17's measurement: speculative decoding at batch 1 on the CPU, the built-in model through
the whole stack (`llmserve serve`), on a copy-heavy workload and a chat workload.

    python -m bench.studies.spec_cpu [--out bench/results/spec_cpu.json] [--rounds 2]
        [--max-tokens 128]
                             [--methods none,ngram,draft,model-10] [--num-speculative-tokens 4]

Methods: none (the baseline, first), ngram, draft (self-speculation: the model's first third of its
layers), model-N (a separate draft model, --speculative-model, with its own KV pool: the model's
first N layers, norm and LM head, written by scripts/make_draft_model.py into a temporary
directory); any of these with `-treeW` (ngram-tree3, draft-tree2): token trees of width W
(--speculative-tree-width W, SpecInfer: depth --num-speculative-tokens, W x depth nodes at most).
Each method runs in a fresh stack; the stacks take turns for --rounds rounds (none,
ngram, draft, none, ...), so a slow spell of the machine hits every method alike. In each, after
one warm-up request, the workloads' prompts are sent one at a time (batch 1), greedy, through the
chat template, ending at EOS or --max-tokens: output tokens/s is the output tokens over the sum of
the requests' end-to-end times. Greedy speculation must give the tokens decoding without it gives:
every run's tokens are compared with the first `none` run's (`same_tokens`). The scheduler's
counters give the acceptance rate, the mean accepted length and acceptance per proposal position.

Workloads: `copy` asks to repeat a given passage word for word (what prompt lookup is for);
`similar` the same with passages whose sentences share their openings (where the latest n-gram
match is often the wrong sentence's: what token trees add); `chat` asks open questions whose
answers copy nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmserve.bench.cli import spec_summary
from llmserve.bench.report import hardware, save
from llmserve.client import Client, make_request
from llmserve.serve_flags import serve_locally
from llmserve.stats import stats_delta

ROOT = Path(__file__).resolve().parents[2]

PASSAGES = [
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker "
    "opened her shutters, and a dog chased gulls along the harbour wall until the bell of the "
    "old church rang seven times and the first bus left for the city.",
    "To replace a bicycle tyre, first release the brake and remove the wheel. Push the valve "
    "in, lever one side of the tyre over the rim, pull out the tube, and check the inside of "
    "the tyre for thorns before fitting the new tube and pumping it up.",
    "Our library is open from nine in the morning until eight in the evening on weekdays, and "
    "from ten until four on Saturdays. Books may be borrowed for three weeks and renewed twice, "
    "online or at the desk, unless another reader has reserved them.",
    "Mix two cups of flour with a teaspoon of salt and a packet of dry yeast. Add warm water "
    "slowly, knead the dough for ten minutes until it is smooth, then leave it covered in a "
    "warm place for an hour before shaping the loaf and baking it.",
]
# Passages whose sentences share their openings and differ after them: a copy's latest n-gram
# match is often another sentence's, and the right continuation an earlier match's (what a token
# tree adds).
SIMILAR = [
    "The red train leaves at nine and the red bus leaves at ten. The red train stops at the "
    "mill, and the red bus stops at the bridge. On Sundays the red train runs late and the red "
    "bus does not run at all.",
    "Add the flour to the bowl, then add the sugar to the jug. Stir the flour with a spoon, then "
    "stir the sugar with a fork. Pour the flour into the tin, then pour the sugar over the top.",
    "Anna went to the market on Monday and bought apples. Ben went to the market on Tuesday and "
    "bought bread. Anna went to the park on Friday and saw Ben. Ben went to the park on Sunday "
    "and saw nobody.",
]
WORKLOADS = {
    "copy": [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES],
    "similar": [f"Repeat the following text exactly, word for word:\n\n{p}" for p in SIMILAR],
    "chat": [
        "What are three tips for staying productive while working from home?",
        "Write a short story about a robot who learns to paint.",
        "Why is the sky blue? Explain it to a ten-year-old.",
        "What should I pack for a weekend camping trip in the mountains?",
    ],
}


def run_prompts(address: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt alone, one after the other: its tokens and end-to-end seconds."""
    out = []
    with Client(address) as client:
        for prompt in prompts:
            request = make_request(
                messages=[("user", prompt)], max_tokens=max_tokens, temperature=0.0
            )
            t0 = time.perf_counter()
            completion = client.generate(request)
            out.append({"token_ids": list(completion.token_ids), "e2e_s": time.perf_counter() - t0})
    return out


def serve_args_for(method: str, k: int, drafts: Path) -> list[str]:
    """`llmserve serve`'s flags for method; a model-N's draft is written under drafts once."""
    if method == "none":
        return []
    if "-tree" in method:
        base, width = method.rsplit("-tree", 1)
        return [*serve_args_for(base, k, drafts), "--speculative-tree-width", width]
    if not method.startswith("model-"):
        return ["--speculative-method", method, "--num-speculative-tokens", str(k)]
    from llmserve.common.model_config import resolve_model_path
    from scripts.make_draft_model import make_draft

    path = drafts / f"{method}.gguf"
    if not path.exists():
        make_draft(resolve_model_path(None), path, int(method.removeprefix("model-")))
    return [
        "--speculative-method", "draft", "--speculative-model", str(path),
        "--num-speculative-tokens", str(k),
    ]  # fmt: skip


def run_method(method: str, k: int, max_tokens: int, drafts: Path) -> dict[str, Any]:
    """One fresh stack speculating with method (none: without): every workload at batch 1."""
    serve_args = ["--kv-cache-gb", "1", *serve_args_for(method, k, drafts)]
    results: dict[str, Any] = {}
    with serve_locally(serve_args, 300, metrics=False) as stack:
        address = stack.gateway_address
        run_prompts(address, WORKLOADS["chat"][:1], 8)  # warm-up
        for name, prompts in WORKLOADS.items():
            before = stack.scheduler_stats()
            requests = run_prompts(address, prompts, max_tokens)
            delta = stats_delta(before, stack.scheduler_stats())
            tokens = sum(len(r["token_ids"]) for r in requests)
            seconds = sum(r["e2e_s"] for r in requests)
            results[name] = {
                "output_tokens": tokens,
                "seconds": seconds,
                "output_tokens_per_s": tokens / seconds,
                "num_steps": delta["num_steps"],
                "speculation": spec_summary(delta),
                "requests": requests,
            }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/spec_cpu.json")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default="none,ngram,draft")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args()
    methods = args.methods.split(",")
    assert methods[0] == "none", "the first method is the baseline: none"
    runs: list[dict[str, Any]] = []
    drafts = Path(tempfile.mkdtemp(prefix="spec-cpu-drafts-"))
    for round_index in range(args.rounds):
        for method in methods:
            result = run_method(method, args.num_speculative_tokens, args.max_tokens, drafts)
            runs.append({"round": round_index, "method": method, "workloads": result})
            print(
                f"round {round_index} {method}: "
                + ", ".join(f"{w} {r['output_tokens_per_s']:.2f} tok/s" for w, r in result.items()),
                flush=True,
            )
    baseline = runs[0]["workloads"]
    for run in runs:
        for name, result in run["workloads"].items():
            expected = [r["token_ids"] for r in baseline[name]["requests"]]
            result["same_tokens"] = [r["token_ids"] for r in result["requests"]] == expected
    summary: dict[str, Any] = {}
    for method in methods:
        for name in WORKLOADS:
            rates = [
                r["workloads"][name]["output_tokens_per_s"] for r in runs if r["method"] == method
            ]
            base = [
                r["workloads"][name]["output_tokens_per_s"] for r in runs if r["method"] == "none"
            ]
            summary[f"{method}/{name}"] = {
                "output_tokens_per_s": statistics.mean(rates),
                "speedup": statistics.mean(rates) / statistics.mean(base),
                "speedup_per_round": [a / b for a, b in zip(rates, base, strict=True)],
            }
    document = {
        "what": "speculative decoding at batch 1, built-in model, whole stack, CPU",
        "command": " ".join(sys.argv),
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "hardware": hardware(),
        "summary": summary,
        "runs": runs,
    }
    shutil.rmtree(drafts, ignore_errors=True)
    save(document, args.out)
    for key, s in summary.items():
        rounds = ", ".join(f"{x:.2f}" for x in s["speedup_per_round"])
        print(f"{key}: {s['output_tokens_per_s']:.2f} tok/s, {s['speedup']:.2f}x ({rounds})")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
