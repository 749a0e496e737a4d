"""What the benchmark asks: request sets of exact token lengths, seeded so they are reproducible.

A prompt's length is what the gateway will count: raw text through `Tokenizer.encode` (BOS
included when the model adds one), chat messages through the model's chat template (with --chat,
the whole rendered prompt; one shorter than the template is raised to its length + 1). A
request's output length is its max_tokens; the runner sends ignore_eos so the server produces
exactly that many. Datasets fixed, random, sharegpt (log-normal fits to published statistics:
SHAREGPT_* below), prefix and jsonl: docs/benchmarks.md#workloads.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmserve.gateway.tokenizer import ChatMessage, Tokenizer

DATASETS = ("fixed", "random", "sharegpt", "prefix", "jsonl")

# Words prompts are made of: plain English, so every tokenizer splits them into a few tokens each.
_WORD_TEXT = """the model serves many requests at once while the scheduler plans every step and the
engine runs one forward pass over prefill chunks and decode tokens together paged memory keeps
blocks for each sequence river mountain window garden music ocean silver planet bridge story
letter winter summer coffee market science history language number question answer little
people water light house morning evening travel simple yellow forest animal doctor teacher
"""
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length distribution given by its mean (tokens) and the sigma of its log."""

    mean: float
    sigma: float

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(self.mu, self.sigma)))


# ShareGPT's mean prompt and output lengths as published with vLLM (Kwon et al., SOSP 2023,
# Fig. 11: 161.31 and 337.99 tokens, 8.4x and 5.8x Alpaca's 19.31 and 58.45). The paper gives
# histograms, not spreads: the sigmas are our reading of their long right tails, an assumption.
SHAREGPT_INPUT = LogNormal(mean=161.31, sigma=1.0)
SHAREGPT_OUTPUT = LogNormal(mean=337.99, sigma=0.8)
# vLLM's ShareGPT filter: drop prompts or outputs under 4 tokens, prompts over 1024 tokens and
# pairs over 2048; we redraw such pairs instead.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    """One request: raw text or chat messages, its prompt length in tokens, its output length."""

    num_prompt_tokens: int
    max_tokens: int
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    num_requests: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # random only
    num_prefixes: int = 4  # prefix only
    prefix_len: int = 256  # prefix only
    path: str | None = None  # jsonl only
    chat: bool = False  # send prompts as one user message through the chat template
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset={self.dataset!r} must be one of {', '.join(DATASETS)}")
        for name in ("num_requests", "input_len", "output_len", "num_prefixes", "prefix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio={self.range_ratio} must be in [0, 1)")
        if self.dataset == "jsonl" and not self.path:
            raise ValueError("dataset=jsonl needs a path (--dataset-path)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_workload(
    config: WorkloadConfig, tokenizer: Tokenizer, variant: int = 0
) -> list[BenchRequest]:
    """The requests config describes, in send order. The same config and variant give the same
    requests. Variants share every length and differ in their words, so the runs of a sweep (and
    the warm-up, variant -1) do the same work without hitting each other's prefix cache; a JSONL
    file's prompts are the same in every variant."""
    if config.dataset == "jsonl":
        assert config.path is not None
        return read_jsonl(Path(config.path), config, tokenizer)
    words_rng = random.Random(f"{config.seed}/{variant}")
    if config.dataset == "prefix":
        return _prefix_requests(config, tokenizer, words_rng)
    lengths_rng = random.Random(config.seed)
    lengths = [_draw_lengths(config, lengths_rng) for _ in range(config.num_requests)]
    builder = PromptBuilder(tokenizer, config.chat)
    return [builder.request(n_in, n_out, words_rng) for n_in, n_out in lengths]


def _draw_lengths(config: WorkloadConfig, rng: random.Random) -> tuple[int, int]:
    if config.dataset == "fixed":
        return config.input_len, config.output_len
    if config.dataset == "random":
        return (
            uniform_length(config.input_len, config.range_ratio, rng),
            uniform_length(config.output_len, config.range_ratio, rng),
        )
    return sharegpt_lengths(rng)


def uniform_length(length: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform in [length * (1 - range_ratio), length * (1 + range_ratio)], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.randint(low, high)


def sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """One (prompt, output) length pair from the ShareGPT fits, inside vLLM's filter."""
    while True:
        n_in, n_out = SHAREGPT_INPUT.sample(rng), SHAREGPT_OUTPUT.sample(rng)
        if (
            min(n_in, n_out) >= SHAREGPT_MIN_LEN
            and n_in <= SHAREGPT_MAX_INPUT_LEN
            and n_in + n_out <= SHAREGPT_MAX_TOTAL_LEN
        ):
            return n_in, n_out


class PromptBuilder:
    """Random-word prompts of an exact token count, as raw text or as one user chat message."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat

    def count(self, text: str) -> int:
        """Tokens the gateway will count for this prompt."""
        if self.chat:
            return len(self.tokenizer.encode_chat([ChatMessage("user", text)]))
        return len(self.tokenizer.encode(text))

    def request(self, num_tokens: int, max_tokens: int, rng: random.Random) -> BenchRequest:
        """A request of num_tokens prompt tokens, or of the shortest prompt there is (the
        template's own tokens, or BOS, and one more) when that is longer."""
        num_tokens = max(num_tokens, self.count("") + 1)
        return self.wrap(self.text(num_tokens, rng), num_tokens, max_tokens)

    def wrap(self, text: str, num_tokens: int, max_tokens: int) -> BenchRequest:
        """The request for a prompt text of num_tokens tokens (as counted by `count`)."""
        if self.chat:
            return BenchRequest(num_tokens, max_tokens, messages=(("user", text),))
        return BenchRequest(num_tokens, max_tokens, text=text)

    def text(self, num_tokens: int, rng: random.Random, prefix: str = "") -> str:
        """prefix + random words such that count(result) == num_tokens.

        The words are cut at a token boundary; when decoding and re-encoding shifts the count
        (merges across the cut, the template's own tokens), the target is corrected and retried.
        """
        overhead = self.count(prefix)
        if num_tokens <= overhead and not prefix:
            raise ValueError(
                f"a prompt of {num_tokens} tokens is shorter than the {overhead} tokens the "
                "template (or BOS) adds"
            )
        want = num_tokens - overhead
        for _ in range(64):
            words = " ".join(rng.choice(WORDS) for _ in range(2 * want + 8))
            piece = " " + words if prefix else words
            ids = self.tokenizer.encode(piece, add_special_tokens=False)[: max(want, 0)]
            text = prefix + self.tokenizer.decode(ids)
            got = self.count(text)
            if got == num_tokens:
                return text
            want += num_tokens - got
        raise RuntimeError(f"no prompt of exactly {num_tokens} tokens after 64 tries")


def _prefix_requests(
    config: WorkloadConfig, tokenizer: Tokenizer, rng: random.Random
) -> list[BenchRequest]:
    """num_prefixes prefixes of prefix_len tokens, each request one of them + input_len more."""
    builder = PromptBuilder(tokenizer, config.chat)
    prefixes = [builder.text(config.prefix_len, rng) for _ in range(config.num_prefixes)]
    total = config.prefix_len + config.input_len
    texts = [
        builder.text(total, rng, prefixes[i % len(prefixes)]) for i in range(config.num_requests)
    ]
    return [builder.wrap(text, total, config.output_len) for text in texts]


def read_jsonl(path: Path, config: WorkloadConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The file's prompts in file order, repeated from the top if num_requests is larger."""
    lines = enumerate(path.read_text().splitlines(), 1)
    rows = [row for i, line in lines if (row := _jsonl_row(line, path, i)) is not None]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [
        _jsonl_request(rows[i % len(rows)], config, tokenizer) for i in range(config.num_requests)
    ]


def _jsonl_request(
    row: dict[str, Any], config: WorkloadConfig, tokenizer: Tokenizer
) -> BenchRequest:
    max_tokens = int(row.get("max_tokens", row.get("output_tokens", config.output_len)))
    if "messages" in row or config.chat:
        messages = (
            tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
            if "messages" in row
            else (("user", str(row["prompt"])),)
        )
        n = len(tokenizer.encode_chat([ChatMessage(r, c) for r, c in messages]))
        return BenchRequest(n, max_tokens, messages=messages)
    text = str(row["prompt"])
    return BenchRequest(len(tokenizer.encode(text)), max_tokens, text=text)


def _jsonl_row(line: str, path: Path, number: int) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from err
    if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
        raise ValueError(f'{path}:{number}: expected an object with "prompt" or "messages"')
    return row


def exact_length_prompts(
    tokenizer: Tokenizer, num_prompts: int, num_tokens: int, seed: int = 0
) -> list[str]:
    """num_prompts raw-text prompts of exactly num_tokens tokens each (for scripts)."""
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, chat=False)
    return [builder.text(num_tokens, rng) for _ in range(num_prompts)]


def exact_length_prompt_ids(
    model_path: str | Path, num_prompts: int, num_tokens: int, seed: int = 0
) -> tuple[list[str], list[list[int]]]:
    """exact_length_prompts measured by model_path's tokenizer, and each prompt's token ids
    (what a script sends the stack, and what it gives a reference such as HF transformers)."""
    tokenizer = Tokenizer.from_model_path(Path(model_path))
    prompts = exact_length_prompts(tokenizer, num_prompts, num_tokens, seed)
    return prompts, [tokenizer.encode(p) for p in prompts]
