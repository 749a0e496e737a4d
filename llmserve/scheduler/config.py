"""The scheduler service's settings; `llmserve scheduler` and `llmserve serve` make their flags
from these fields (common/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmserve.common.auth import PeerSecurity
from llmserve.common.flags import check_ports, setting
from llmserve.scheduler.lora import check_lora_name

# "continuous" is "fcfs" under its older name (continuous batching in arrival order).
SCHEDULING_POLICIES = ("continuous", "fcfs", "fair", "priority", "static")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig(PeerSecurity):
    engine_address: tuple[str, ...] = setting(
        ("localhost:50053",),
        "the engine's gRPC address; with --prefill-engine-address, once per decode engine",
        repeat=True,
    )
    prefill_engine_address: tuple[str, ...] = setting(
        (),
        "prefill / decode disaggregation (docs/disaggregation.md): a prefill engine's gRPC "
        "address (--engine-role prefill), once per prefill engine; --engine-address then names "
        "the decode engines. Prompts run on a prefill engine, their KV moves to a decode engine "
        "(none: one engine does both)",
        repeat=True,
    )
    kv_transfer_timeout_s: float = setting(
        2.0,
        "disaggregation: a KV transfer not arrived by then is given up and the request "
        "recomputes its prompt on the decode engine",
    )
    host: str = setting("127.0.0.1", "bind address (0.0.0.0 exposes it)")
    port: int = setting(50052, "gRPC port for the gateway")
    metrics_port: int = setting(
        9102, "Prometheus /metrics port (0: off)", env="LLMSERVE_METRICS_PORT"
    )
    max_num_batched_tokens: int = setting(
        0, "tokens per step, prefill chunks + decodes (0: the engine's; never more)"
    )
    max_num_seqs: int = setting(0, "requests running at once (0: the engine's; never more)")
    max_waiting: int = setting(4096, "queued requests beyond which new ones get RESOURCE_EXHAUSTED")
    enable_prefix_caching: bool = setting(
        True, "share the KV blocks of identical prompt prefixes", flag="--prefix-caching"
    )
    max_model_len: int = setting(0, "lower the engine's context length (0: the engine's)")
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs (alias continuous): continuous batching in arrival order; fair: admit from the "
        "tenant that received the least weighted service (virtual token counter), preempt from "
        "the one that received the most; priority: lower `priority` first, and a waiting "
        "request may preempt running ones of lower priority; static: admit a batch only when "
        "nothing runs; finished members pad it until its last one finishes (the baseline "
        "`llmserve bench` compares against)",
        choices=SCHEDULING_POLICIES,
    )
    max_preemptions: int = setting(
        0, "a request preempted this many times is not chosen as a victim again (0: no limit)"
    )
    preemption_grace_steps: int = setting(
        0, "a request admitted fewer than this many steps ago is not chosen as a victim"
    )
    fair_prefill_weight: float = setting(
        1.0, "fair policy: virtual tokens per prefill token (divided by the tenant's weight)"
    )
    fair_decode_weight: float = setting(
        2.0, "fair policy: virtual tokens per decode token (divided by the tenant's weight)"
    )
    static_batch_wait_ms: float = setting(
        100.0, "static policy: wait up to this long for a new batch to fill to --max-num-seqs"
    )
    preemption_mode: str = setting(
        "recompute",
        "what a preempted request's KV becomes: recompute = freed (its full blocks stay in the "
        "prefix cache, copied down a tier if evicted, like any cached block); swap = its full "
        "blocks are copied to the host tier at once, and readmission brings them back (needs "
        "the engine's --kv-offload-gb and --prefix-caching)",
        choices=PREEMPTION_MODES,
    )
    overlap_scheduling: bool = setting(
        True, "plan step N+1 while the engine runs step N (two steps in flight)"
    )
    max_registered_loras: int = setting(
        64,
        "LoRA adapters served at once, by name (--lora-modules and load-lora together); a load "
        "past it is RESOURCE_EXHAUSTED until one is unloaded",
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters to serve, NAME=PATH each (PEFT directories: adapter_config.json + "
        "adapter_model.safetensors); the engine checks each when it connects, and one it refuses "
        "is logged with the reason and not served. A request names one in the OpenAI `model` "
        "field or GenerateRequest.lora_name",
    )

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting={self.max_waiting} must be >= 1")
        if self.max_registered_loras < 1:
            raise ValueError(f"max_registered_loras={self.max_registered_loras} must be >= 1")
        for name in ("max_preemptions", "preemption_grace_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("fair_prefill_weight", "fair_decode_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.fair_prefill_weight + self.fair_decode_weight <= 0:
            raise ValueError("fair_prefill_weight and fair_decode_weight are both 0")
        if self.static_batch_wait_ms < 0:
            raise ValueError(f"static_batch_wait_ms={self.static_batch_wait_ms} must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} must be one of "
                f"{', '.join(PREEMPTION_MODES)}"
            )
        if self.preemption_mode == "swap" and not self.enable_prefix_caching:
            raise ValueError(
                "preemption_mode='swap' needs enable_prefix_caching (blocks are "
                "indexed by their prefix hashes in every tier)"
            )
        check_ports(self, "port", "metrics_port")
        self.lora_paths()
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s} must be > 0")
        if not self.engine_address:
            raise ValueError("engine_address: at least one is needed")
        if len(self.engine_address) > 1 and not self.prefill_engine_address:
            raise ValueError(
                f"{len(self.engine_address)} engine_address values without "
                "prefill_engine_address: more than one engine per scheduler is built for decode "
                "engines (with prefill engines); for more engines that each do both, run "
                "replicas (--data-parallel-size)"
            )
        for addresses in (self.engine_address, self.prefill_engine_address):
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"engine address listed twice: {', '.join(addresses)}")
        if set(self.engine_address) & set(self.prefill_engine_address):
            raise ValueError("an address is both a prefill and a decode engine's")
        if self.prefill_engine_address and not self.enable_prefix_caching:
            raise ValueError(
                "prefill_engine_address needs enable_prefix_caching: transferred blocks join "
                "the decode engine's pool as prefix-cache hits"
            )

    def lora_paths(self) -> dict[str, str]:
        """lora_modules as {name: path}; ValueError naming a malformed entry."""
        paths: dict[str, str] = {}
        for entry in self.lora_modules:
            name, _, path = entry.partition("=")
            if not name or not path or name in paths:
                raise ValueError(f"lora_modules entry {entry!r} must be NAME=PATH, each NAME once")
            if (why := check_lora_name(name)) is not None:
                raise ValueError(f"lora_modules entry {entry!r}: {why}")
            paths[name] = path
        if len(paths) > self.max_registered_loras:
            raise ValueError(
                f"lora_modules names {len(paths)} adapters; max_registered_loras="
                f"{self.max_registered_loras}"
            )
        return paths

    @property
    def policy(self) -> str:
        """scheduling_policy with its alias resolved: fcfs, fair, priority or static."""
        return "fcfs" if self.scheduling_policy == "continuous" else self.scheduling_policy

    def adopt(self, max_num_seqs: int, max_num_batched_tokens: int) -> SchedulerConfig:
        """This config with the engine's step limits where it has none of its own (0). Raises
        ValueError when one of its own is larger than the engine's: the scheduler would plan
        steps the engine did not size its memory and CUDA graphs for."""
        engine = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        for name, limit in engine.items():
            own = getattr(self, name)
            if own > limit:
                raise ValueError(
                    f"{name}={own} exceeds the engine's {name}={limit}; lower it, or start "
                    f"the engine with --{name.replace('_', '-')} {own}"
                )
        return replace(
            self,
            max_num_seqs=self.max_num_seqs or max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or max_num_batched_tokens,
        )
