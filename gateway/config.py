"""The gateway service's settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = None  # for the tokenizer and chat template; None = built-in
    scheduler_address: str = "localhost:50052"
    host: str = "0.0.0.0"
    port: int = 50051  # gRPC
    http_port: int = 8000  # the OpenAI-compatible HTTP API; 0 turns it off
    # Required of every client (HTTP and gRPC) as `Authorization: Bearer <key>` when set.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port={self.http_port} is not a TCP port (0 turns HTTP off)")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port={self.http_port} is the gRPC port too")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; leave it unset to serve without a key")
