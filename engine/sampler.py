"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, min-p, seeds.

Order of filters (as HF applies them): temperature, then top-k, then top-p over what top-k kept,
then min-p. A draw is argmax(probs / E) with E ~ Exponential(1) noise, which samples from probs.
A seeded request takes its noise from a generator seeded by (seed, index of the output token), so
its tokens depend only on its own logits: not on its batch-mates, and not on preemptions.
The logprob returned is the chosen token's log-probability under the unmodified distribution.
"""

from __future__ import annotations

import torch

from engine.mirror import SamplingParams

_MASK64 = (1 << 64) - 1


def seed_for(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for one (request seed, output position) pair (splitmix64)."""
    z = (seed + (output_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n, vocab] float32 -> (token ids [n] int64, chosen-token logprobs [n] or None).

        output_indices[i]: how many tokens row i's request has generated before this one.
        """
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1)
        if all(p.is_greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, params, output_indices)
        chosen = None
        if logprobs is not None:
            chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens, chosen

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> torch.Tensor:
        vocab = logits.shape[1]
        temperature = torch.tensor(
            [p.temperature if not p.is_greedy else 1.0 for p in params],
            device=logits.device,
            dtype=torch.float32,
        )
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy:
                g = torch.Generator(device=logits.device)
                g.manual_seed(seed_for(p.seed, output_indices[i]))
                noise[i] = torch.empty(vocab, device=logits.device).exponential_(generator=g)
        # An exact 0 from exponential_ would turn a masked token's 0/0 into NaN, which argmax picks.
        tokens = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        if bool(greedy.any()):
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return tokens

    @staticmethod
    def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask (to -inf) what top-k, top-p and min-p drop, row by row, on one sort."""
        vocab = scaled.shape[1]
        device = scaled.device
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows without top-p keep everything: float32 sums can exceed 1.0 on big vocabularies.
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
