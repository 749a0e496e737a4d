"""The one SamplingParams (protos/common.proto): its defaults, its limits and what greedy means.

The gateway checks a client's params with `normalized` and forwards the result; the scheduler
checks whatever reaches its Submit the same way (a peer may skip the gateway); the engine's mirror
normalizes what it is sent once more, so the sampler always reads explicit values. Adding a
sampling field means: the proto, a check here if it has limits, the sampler, and a test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from llmserve.protos import common_pb2

SamplingParams = common_pb2.SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request: a bound on the work per row, OpenAI sets none
# OpenAI's seeds are int64, ours uint64: both ranges are accepted, a negative seed counting modulo
# 2**64 (-1 is 2**64 - 1).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# Temperatures below this sample as greedy: dividing logits by 1e-38 overflows to inf and the
# softmax to NaN (vLLM draws the same line).
MIN_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """A sampling field is out of range; the message names it, its value and the limit."""


def show(value: float) -> str:
    """A float32 field as the client wrote it (0.1, not 0.10000000149011612)."""
    text = f"{value:.7g}"
    return text if any(c in text for c in ".eni") else text + ".0"


# generation_config.json fields that become a request's sampling defaults (as vLLM applies them)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


def with_defaults(params: SamplingParams, defaults: Mapping[str, float]) -> SamplingParams:
    """params, with each field of `defaults` (the model's generation_config.json) filled in
    where the request left it unset: temperature and top_p when absent, top_k and min_p when 0
    (a request disables top_k with -1)."""
    if not defaults:
        return params
    p = SamplingParams()
    p.CopyFrom(params)
    for name in ("temperature", "top_p"):
        if name in defaults and not p.HasField(name):
            setattr(p, name, float(defaults[name]))
    if "top_k" in defaults and p.top_k == 0:
        p.top_k = int(defaults["top_k"])
    if "min_p" in defaults and p.min_p == 0.0:
        p.min_p = float(defaults["min_p"])
    return p


def normalized(params: SamplingParams, prefix: str = "sampling.") -> SamplingParams:
    """A copy of params with every default filled in (temperature 1.0, top_p 1.0). Raises
    SamplingError naming the first bad field as `prefix + name`."""
    p = SamplingParams()
    p.CopyFrom(params)
    if not p.HasField("temperature"):
        p.temperature = 1.0
    if not p.HasField("top_p"):
        p.top_p = 1.0
    _check(p, prefix)
    return p


def _check(p: SamplingParams, prefix: str) -> None:
    def bad(name: str, limit: str) -> SamplingError:
        value = getattr(p, name)
        shown = show(value) if isinstance(value, float) else str(value)
        return SamplingError(f"{prefix}{name}={shown} {limit}")

    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise bad("temperature", "must be a finite number >= 0")
    if not 0 < p.top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if p.top_k < -1:
        raise bad("top_k", "must be >= -1 (-1 or 0 disables it)")
    if not 0 <= p.min_p <= 1:
        raise bad("min_p", "must be in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            raise bad(name, "must be in [-2, 2]")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
    if p.top_logprobs and not p.logprobs:
        raise bad("top_logprobs", f"needs {prefix}logprobs=true")
    _check_logit_bias(p, prefix)


def _check_logit_bias(p: SamplingParams, prefix: str) -> None:
    """OpenAI's limits: values in [-100, 100]; the count is ours (the token ids against the
    vocabulary are the gateway's check: it knows the vocabulary)."""
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingError(
            f"{prefix}logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    for token_id, bias in sorted(p.logit_bias.items()):
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise SamplingError(
                f"{prefix}logit_bias[{token_id}]={show(bias)} must be in [-100, 100]"
            )


def seed_value(seed: int) -> int:
    """The uint64 a client's seed travels as (SamplingParams.seed). Raises SamplingError naming
    seed and the range outside [MIN_SEED, MAX_SEED]; the HTTP API and the CLI both check here."""
    if not MIN_SEED <= seed <= MAX_SEED:
        raise SamplingError(
            f"seed={seed} is outside [{MIN_SEED}, {MAX_SEED}] (an int64 or a uint64; a negative "
            "seed counts modulo 2**64)"
        )
    return seed % 2**64


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < MIN_TEMPERATURE or p.top_k == 1


def has_logit_bias(p: SamplingParams) -> bool:
    return bool(p.logit_bias)


def has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def seed_of(p: SamplingParams) -> int | None:
    return p.seed if p.HasField("seed") else None
