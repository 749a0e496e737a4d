"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, min-p, seeds.

Presence and frequency penalties (OpenAI's) and logit_bias come first, on the rows that set
them; then temperature, top-k, top-p over what top-k kept, and min-p (HF's order). A draw is
argmax(probs / E) with E ~ Exponential(1) noise: from the engine's generator for unseeded rows,
from a counter-based hash of (seed, output index) for seeded ones (`seeded_exponential`), so a
seeded token depends only on the seed, its output index and the logits, not on its batch-mates,
preemptions or the device. Logprobs come from the unmodified distribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmserve.common.sampling import has_logit_bias, has_penalties, is_greedy, seed_of
from llmserve.protos.common_pb2 import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never
# overflows (and torch's arithmetic >> is a logical shift on these non-negative values).
_MIX_ROUNDS = ((0x7FEB352D, 0x2C1B3C6D), (0x297A2D39, 0x6B43A9B5))


def seed_for(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for one (request seed, output position) pair (splitmix64)."""
    z = (seed + (output_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _mix32(x: torch.Tensor, mul_a: int, mul_b: int) -> torch.Tensor:
    """A bijective 32-bit mixer (xorshift-multiply, lowbias32's shape) on int64 values < 2**32,
    in place where it can be."""
    x ^= x >> 16
    x.mul_(mul_a).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(mul_b).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def seeded_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exponential(1) noise [len(keys), vocab_size] float32, a pure function of each row's key
    (int64 [n], values in [0, 2**63), e.g. from seed_for) and the column index: the same key gives
    the same row on any device, in any batch. Within a row the 32-bit hashes are distinct (the
    mixer is a bijection for a fixed key):

        h[j] = mix32(mix32(j ^ key_lo) ^ key_hi)            (j: vocabulary index; exact int64 ops)
        E[j] = -log1p(-(h[j] + 0.5) / 2**32)                (float64, then float32)

    The integer part is exact on CPU and CUDA alike; the float64 log1p is rounded to float32,
    where the devices' last-ulp differences essentially never survive."""
    lo = (keys & _MASK32)[:, None]
    hi = (keys >> 32)[:, None]
    x = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :] ^ lo
    (a1, b1), (a2, b2) = _MIX_ROUNDS
    x = _mix32(x, a1, b1)
    x ^= hi
    x = _mix32(x, a2, b2)
    u = x.to(torch.float64).add_(0.5).mul_(2.0**-32)  # in (0, 1), exact
    return u.neg_().log1p_().neg_().to(torch.float32)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor | None  # [n] the chosen tokens'; None unless a row asked
    # [n, k], k = the batch's largest top_logprobs, most likely first; None when k = 0.
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], output_token_ids: Sequence[list[int]]
) -> torch.Tensor:
    """logits [n, vocab] with each penalized row's presence and frequency penalties subtracted
    (a new tensor; logits itself is unchanged). output_token_ids[i] are row i's generated tokens;
    only penalized rows' lists are read. Rows without penalties cost nothing."""
    rows = [i for i, p in enumerate(params) if has_penalties(p)]
    if not rows:
        return logits
    device = logits.device
    token_ids = list(itertools.chain.from_iterable(output_token_ids[i] for i in rows))
    row_ids = [r for r, i in enumerate(rows) for _ in output_token_ids[i]]
    counts = torch.zeros(len(rows), logits.shape[1], dtype=logits.dtype, device=device)
    counts.index_put_(
        (to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device)),
        torch.ones(len(token_ids), dtype=logits.dtype, device=device),
        accumulate=True,
    )
    frequency = to_device([params[i].frequency_penalty for i in rows], logits.dtype, device)
    presence = to_device([params[i].presence_penalty for i in rows], logits.dtype, device)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)
    rows_t = to_device(rows, torch.long, device)
    return logits.index_put((rows_t,), logits[rows_t] - penalty)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [n, vocab] with each row's logit_bias added (a new tensor; logits is unchanged).
    Ids outside the vocabulary (the gateway refuses them) are skipped. Rows without a bias cost
    nothing."""
    rows = [i for i, p in enumerate(params) if has_logit_bias(p)]
    if not rows:
        return logits
    vocab = logits.shape[1]
    entries = [(r, t, b) for r in rows for t, b in params[r].logit_bias.items() if 0 <= t < vocab]
    if not entries:
        return logits
    device = logits.device
    row_ids, token_ids, biases = zip(*entries, strict=True)
    index = (to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))
    return logits.index_put(index, to_device(biases, logits.dtype, device), accumulate=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
        output_token_ids: Sequence[list[int]] = (),
    ) -> SamplerOutput:
        """Draw one token per row of logits [n, vocab] float32.

        output_indices[i]: how many tokens row i's request has generated before this one.
        output_token_ids[i]: those tokens; read only for rows with penalties (may be empty then).
        """
        want_top = max((p.top_logprobs for p in params), default=0)
        want_logprobs = any(p.logprobs for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want_top or want_logprobs else None
        logits = apply_logit_bias(apply_penalties(logits, params, output_token_ids), params)
        if all(is_greedy(p) for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, params, output_indices)
        out = SamplerOutput(tokens, None)
        if want_logprobs:
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if want_top:
            top = logprobs.topk(min(want_top, logprobs.shape[1]), dim=-1)
            out.top_token_ids, out.top_logprobs = top.indices, top.values
        return out

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> torch.Tensor:
        temperature = to_device(
            [p.temperature if not is_greedy(p) else 1.0 for p in params],
            torch.float32,
            logits.device,
        )
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = self._noise(probs, params, output_indices)
        # An exact 0 from exponential_ would turn a masked token's 0/0 into NaN, which argmax picks.
        tokens = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)
        if any(is_greedy(p) for p in params):
            greedy = to_device([is_greedy(p) for p in params], torch.bool, logits.device)
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return tokens

    def _noise(
        self, probs: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> torch.Tensor:
        """Exponential(1) noise shaped like probs: seeded rows from seeded_exponential (all of
        them in one call), the others from the engine's generator."""
        seeded: list[int] = []
        keys: list[int] = []
        for i, p in enumerate(params):
            seed = seed_of(p)
            if seed is not None and not is_greedy(p):
                seeded.append(i)
                keys.append(seed_for(seed, output_indices[i]))
        device = probs.device
        if len(seeded) == len(params):
            return seeded_exponential(to_device(keys, torch.int64, device), probs.shape[1])
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        if seeded:
            rows = to_device(seeded, torch.int64, device)
            noise[rows] = seeded_exponential(to_device(keys, torch.int64, device), probs.shape[1])
        return noise

    @staticmethod
    def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask (to -inf) what top-k, top-p and min-p drop, row by row, on one sort."""
        vocab = scaled.shape[1]
        device = scaled.device
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device)
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows without top-p keep everything: float32 sums can exceed 1.0 on big vocabularies.
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on device without waiting for the device: on a GPU through pinned
    memory, so the copy queues behind the kernels already launched (a blocking copy, or one
    from pageable memory, can wait for them all)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)
