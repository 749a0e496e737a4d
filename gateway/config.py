"""The gateway service's settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = None  # for the tokenizer and chat template; None = built-in
    scheduler_address: str = "localhost:50052"
    host: str = "0.0.0.0"
    port: int = 50051

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
