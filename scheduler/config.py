"""The scheduler service's settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    engine_address: str = "localhost:50053"
    host: str = "0.0.0.0"
    port: int = 50052
    # Tokens computed per step across all requests (prefill chunks plus decodes).
    max_num_batched_tokens: int = 2048
    # Requests running at once.
    max_num_seqs: int = 256
    # Requests queued beyond which new ones get RESOURCE_EXHAUSTED.
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    # Lower the engine's context limit (0 keeps the model's).
    max_model_len: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_waiting"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
