"""Quality of a quantized or low-precision-KV engine against the unquantized one, on prompts made
here: top-1 agreement and mean KL divergence of next-token distributions, teacher-forced over
every position of each prompt (the same tokens go through both models). And bf16 comparisons
that count a differing token only where the reference's own top-2 gap is above a stated
epsilon (issue 24: compare_top1, compare_streams, seeded_margins), with agreement rates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.bench.engine_driver import Driver
from llmserve.common.model_config import ModelConfig
from llmserve.common.sampling import normalized
from llmserve.common.step_plan import StepOutput
from llmserve.engine.model.layers import AttentionContext
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import SamplingParams

# Prose, code, facts and dialogue: what a chat model meets. Written for these tests.
PASSAGES = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is "
    "Rome, and the capital of Spain is Madrid. Each of these cities has a long history.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning they walked into the forest together, and every "
    "evening they came home with a cart full of wood.",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature, which is why cooking takes longer in the "
    "mountains.",
    "User: Can you recommend a good book for a long flight?\nAssistant: Sure! If you like "
    "mysteries, try a classic detective novel. If you prefer something lighter, a collection of "
    "short stories is easy to pick up and put down.",
    "To make a simple tomato sauce, heat olive oil in a pan, add chopped garlic and cook it "
    "gently. Then add crushed tomatoes, a pinch of salt and some basil, and let it simmer for "
    "twenty minutes, stirring from time to time.",
    "The mitochondria is the part of the cell that produces energy. Plants also have "
    "chloroplasts, which capture sunlight and turn it into sugar through photosynthesis.",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;\n"
    "-- This query returns the first ten users, by name, who signed up this year.",
]


@dataclass
class Agreement:
    top1: float  # share of positions where both models' most likely next token is the same
    mean_kl: float  # mean KL(reference || other) over positions, nats
    positions: int


def prompt_logits(
    model: LlamaForCausalLM,
    config: ModelConfig,
    ids: list[int],
    kv_dtype: torch.dtype = torch.float32,
    block_size: int = 16,
) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one prompt run as a single prefill, through a
    fresh paged pool of kv_dtype (the attention reads back what it stored)."""
    n = len(ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = [
        (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
        for _ in range(config.num_layers)
    ]
    ctx = AttentionContext(torch.arange(n), torch.arange(num_blocks)[None], [n], [0, n], kv)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), ctx)
        return model.compute_logits(hidden).float()


def agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> Agreement:
    same, kl, n = 0, 0.0, 0
    for ref, got in zip(reference, other, strict=True):
        same += int((ref.argmax(-1) == got.argmax(-1)).sum())
        ref_log, got_log = ref.log_softmax(-1), got.log_softmax(-1)
        kl += float((ref_log.exp() * (ref_log - got_log)).sum())
        n += ref.shape[0]
    return Agreement(same / n, kl / n, n)


# ---- bf16 comparisons that tolerate near ties (issue 24) ----------------------------------------

# bf16 keeps 8 significant bits: logits in [1, 2) lie 2**-7 apart, in [2, 4) 2**-6. Two bf16 runs
# that sum in different orders (another GEMM tiling for another batch shape, the prefill kernel
# instead of the decode kernel, HF's rotary tables rounded to bf16 where ours rotate in fp32)
# give logits a few such steps apart: at most 0.037 between this engine and HF transformers on
# SmolLM2-135M's shape with dummy weights (CPU, bf16, 140 positions), where 5% of positions have
# a top-2 gap under 0.008 and the argmax differs at 5%, all with gaps <= 0.016. Where the
# reference's own top-2 gap is within these epsilons either token is right, so a differing token
# there is a near tie, reported but not counted; above them it is a mismatch.
BF16_TOP2_EPS = 0.0625  # the same model and kernels, another batch shape or path
BF16_HF_TOP2_EPS = 0.125  # against another implementation (HF transformers)


@dataclass
class TokenAgreement:
    """Tokens of a run against a reference's: `same` of `positions` agree; `near_ties` differ
    where the reference's top-2 gap is <= eps (not counted); `mismatches` (row, position,
    reference's gap) differ above it."""

    positions: int
    same: int
    near_ties: int
    mismatches: list[tuple[int, int, float]]
    eps: float

    @property
    def rate(self) -> float:
        return self.same / max(self.positions, 1)

    def __str__(self) -> str:
        return (
            f"{self.same}/{self.positions} = {self.rate:.2%} same, {self.near_ties} near ties "
            f"(reference top-2 gap <= {self.eps}), {len(self.mismatches)} mismatches"
            + (f": {self.mismatches[:5]}" if self.mismatches else "")
        )


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...]: the most likely token's logit less the runner-up's (float32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def compare_top1(
    reference_logits: torch.Tensor, tokens: torch.Tensor, eps: float
) -> TokenAgreement:
    """Position by position (teacher-forced: both runs saw the same inputs): `tokens` [n]
    against the argmax of `reference_logits` [n, vocab]."""
    want = reference_logits.float().argmax(dim=-1)
    gaps = top2_gap(reference_logits)
    differ = (tokens.to(want.device) != want).nonzero().flatten().tolist()
    counted = [(0, i, float(gaps[i])) for i in differ if float(gaps[i]) > eps]
    return TokenAgreement(
        len(want), len(want) - len(differ), len(differ) - len(counted), counted, eps
    )


def compare_streams(
    expected: list[list[int]], got: list[list[int]], gaps: list[list[float]], eps: float
) -> TokenAgreement:
    """Generated streams against the reference's (`expected`, with its top-2 gap at each
    position, `gaps`), each up to its first difference: there, a near tie when the reference's
    gap is <= eps (the streams then go on from different tokens and are compared no further),
    else a mismatch. `positions` counts the positions compared."""
    positions = same = near = 0
    mismatches = []
    for row, (want, have, gap) in enumerate(zip(expected, got, gaps, strict=True)):
        assert len(want) == len(have) == len(gap), (row, len(want), len(have), len(gap))
        for pos, (a, b) in enumerate(zip(want, have, strict=True)):
            positions += 1
            if a == b:
                same += 1
                continue
            if gap[pos] <= eps:
                near += 1
            else:
                mismatches.append((row, pos, gap[pos]))
            break
    return TokenAgreement(positions, same, near, mismatches, eps)


def step_gaps(out: StepOutput) -> list[float]:
    """Each sampled token's top-2 logprob gap (= its logits' top-2 gap: log_softmax shifts every
    logit of a row alike) from a step that returned >= 2 top logprobs per token."""
    gaps, offset = [], 0
    for k in out.num_top_logprobs:
        values = out.top_logprobs[offset : offset + k]
        offset += k
        gaps.append(values[0] - values[1] if k >= 2 else float("inf"))
    return gaps


def generate_with_gaps(
    engine: Engine, prompts: list[list[int]], num_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """llmserve.bench.engine_driver.generate (greedy, all prompts in one batch) with each
    token's top-2 logit gap."""
    sampling = normalized(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2))
    driver = Driver(engine, sampling)
    gaps = [[g] for g in step_gaps(driver.start(prompts))]
    for _ in range(num_tokens - 1):
        for row, g in zip(gaps, step_gaps(driver.decode()), strict=True):
            row.append(g)
    return driver.generated, gaps


def seeded_scores(
    logprobs: torch.Tensor, temperature: float, seed: int, index: int
) -> torch.Tensor:
    """engine/step/sampler.py's seeded draw (no top-k / top-p / min-p) is the argmax over the
    vocabulary of logits / T - log E, E the noise of (seed, output index): that score from a
    row's T = 1 logprobs [vocab] (which give logits / T up to a constant)."""
    from llmserve.engine.step.sampler import seed_for, seeded_exponential

    noise = seeded_exponential(torch.tensor([seed_for(seed, index)]), logprobs.shape[0])[0]
    return logprobs / temperature - noise.log()


def seeded_margins(
    token_ids: list[int],
    logprobs: list[float],
    top_token_ids: list[list[int]],
    top_logprobs: list[list[float]],
    temperature: float,
    seed: int,
    vocab_size: int,
) -> list[float]:
    """For a seeded stream sampled without top-k / top-p / min-p, at each output position: how
    far the drawn token's `seeded_scores` is above every other token's, from what the API
    returns (the drawn token's logprob and the top ones'). A token outside those has a logprob
    <= the least of them, which bounds its score; so the margin is a lower bound, exact when the
    runner-up is among the top logprobs. A run whose logits differ by up to d draws another
    token only where the margin is below 2 d / T: its near-tie epsilon is a greedy one's / T."""
    margins = []
    rows = zip(token_ids, logprobs, top_token_ids, top_logprobs, strict=True)
    for index, (token, logprob, ids, tops) in enumerate(rows):
        known = torch.full((vocab_size,), min(tops))  # the bound of tokens not returned
        known[torch.tensor(ids)] = torch.tensor(tops)
        known[token] = logprob
        scores = seeded_scores(known, temperature, seed, index)
        chosen = float(scores[token])
        scores[token] = float("-inf")
        margins.append(chosen - float(scores.max()))
    return margins
