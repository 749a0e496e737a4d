"""Quality of a quantized or low-precision-KV engine against the unquantized one, on prompts made
here: top-1 agreement and mean KL divergence of next-token distributions, teacher-forced over
every position of each prompt (the same tokens go through both models)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model_config import ModelConfig
from engine.layers import AttentionContext
from engine.model import LlamaForCausalLM

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
