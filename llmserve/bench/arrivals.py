"""When each request is sent.

request_rate = inf   all at once: every request is due at the start.
request_rate = r     a renewal process of r requests/s on average: the first request at the start,
                     then gaps drawn from a gamma distribution with shape = burstiness and mean
                     1 / r (vLLM's convention). burstiness = 1 is a Poisson process (exponential
                     gaps, coefficient of variation 1); the gaps' CV is 1 / sqrt(burstiness), so
                     burstiness < 1 is burstier and > 1 more regular.
max_concurrency = c  at most c requests in flight (a semaphore). With request_rate = inf this is a
                     closed loop of c users; with a rate, a request due while c are in flight waits
                     at the client, and its latencies count from when it is sent (as in vLLM).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness={self.burstiness} must be > 0 (1: Poisson)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")

    @property
    def label(self) -> str:
        """Short text for tables and plots, e.g. `rate 4/s, bursty 0.5, conc 8`."""
        parts = ["rate inf" if math.isinf(self.request_rate) else f"rate {self.request_rate:g}/s"]
        if self.burstiness != 1.0 and not math.isinf(self.request_rate):
            parts.append(f"burstiness {self.burstiness:g}")
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "request_rate": rate_to_json(self.request_rate),
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArrivalConfig:
        rate = float(data["request_rate"])  # "inf" too
        return cls(rate, data["burstiness"], data["max_concurrency"], data["seed"])


def rate_to_json(rate: float) -> float | str:
    """JSON has no infinity: "inf" stands for all at once."""
    return "inf" if math.isinf(rate) else rate


def gamma_gaps(num_gaps: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """num_gaps gaps (seconds) with mean 1 / rate and coefficient of variation
    1 / sqrt(burstiness): gamma with shape burstiness and scale 1 / (rate * burstiness)."""
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num_gaps)]


def arrival_offsets(num_requests: int, config: ArrivalConfig) -> list[float]:
    """Seconds after the start at which each request is due (non-decreasing, the first 0)."""
    if num_requests == 0:
        return []
    if math.isinf(config.request_rate):
        return [0.0] * num_requests
    rng = random.Random(config.seed)
    offsets = [0.0]
    for gap in gamma_gaps(num_requests - 1, config.request_rate, config.burstiness, rng):
        offsets.append(offsets[-1] + gap)
    return offsets
