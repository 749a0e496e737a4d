"""The scheduler service's settings."""

from __future__ import annotations

from dataclasses import dataclass

# "continuous": iteration-level batching, waiting requests join at every step.
# "static": a batch is admitted only when nothing runs and runs until its last member finishes,
# finished members padding it meanwhile (see scheduler/scheduler.py). For comparison studies.
SCHEDULING_POLICIES = ("continuous", "static")


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
    scheduling_policy: str = "continuous"
    # Static batching only: after the first request of a new batch arrives, wait up to this long
    # for the batch to fill to max_num_seqs before starting it (as static servers' batch delay).
    static_batch_wait_ms: float = 100.0
    # Keep two steps in flight: plan step N+1 (and send it) before step N's result arrives, so the
    # engine finds its next plan waiting instead of idling through the hop and the planning.
    overlap_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_waiting"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.static_batch_wait_ms < 0:
            raise ValueError(f"static_batch_wait_ms={self.static_batch_wait_ms} must be >= 0")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
