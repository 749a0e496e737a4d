"""The gateway service's settings; `llmserve gateway` and `llmserve serve` make their flags from
these fields (common/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.common.auth import PeerSecurity, read_secret
from llmserve.common.flags import check_ports, setting
from llmserve.common.model_config import default_model_id
from llmserve.common.net import DEFAULT_GATEWAY_PORT
from llmserve.gateway.router import ROUTING_POLICIES

# gateway/reasoning.py's parsers (named here: the config imports no gateway service code)
REASONING_PARSERS = ("auto", "none", "think", "deepseek_r1", "qwen3", "harmony")

DNS_PREFIX = "dns:///"  # a scheduler address that stands for every address a name resolves to


@dataclass(frozen=True)
class GatewayConfig(PeerSecurity):
    model: str | None = setting(
        None, "HF directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)"
    )
    scheduler_address: tuple[str, ...] = setting(
        ("localhost:50052",),
        "a scheduler's gRPC address, once per replica (a scheduler and its engines); "
        "dns:///NAME:PORT stands for every address NAME resolves to, looked up again every "
        "few seconds (a Kubernetes headless Service)",
        repeat=True,
    )
    routing: str = setting(
        "prefix",
        "how a request picks its replica: prefix (the one holding its prompt's first KV "
        "blocks, else the least loaded), least-load, round-robin",
        choices=ROUTING_POLICIES,
    )
    routing_spill_threshold: int = setting(
        8,
        "prefix routing: a request leaves its prefix's replica for the least-loaded one when "
        "the first has more than this many requests beyond the second",
    )
    host: str = setting(
        "127.0.0.1", "bind address of the gRPC and HTTP APIs (0.0.0.0 exposes them)"
    )
    port: int = setting(DEFAULT_GATEWAY_PORT, "gRPC port of the client API")
    http_port: int = setting(
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...); "
        "0 turns it off",
    )
    metrics_port: int = setting(
        9101, "Prometheus /metrics port (0: off)", env="LLMSERVE_METRICS_PORT"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "the model id both APIs report (/v1/models, GetModelInfo), then aliases a request's "
        "`model` may also name it by, as vLLM takes them (default: the name of --model: "
        "a GGUF file's stem, an HF directory's name, SmolLM2-135M-Instruct for the built-in one)",
    )
    accept_any_model: bool = setting(
        False,
        "serve an OpenAI request whose `model` names no served model with the base model, "
        "instead of 404 model_not_found (the lenient behaviour of servers of one model)",
    )
    reasoning_parser: str = setting(
        "auto",
        "split a chat answer's <think>...</think> into reasoning_content (chat) and reasoning "
        "items (Responses): auto (harmony when the chat template writes harmony's channels: "
        "gpt-oss; think when it writes <think>: Qwen3, DeepSeek-R1 distills, SmolLM3), none, "
        "think (deepseek_r1 and qwen3 are its other names), or harmony",
        choices=REASONING_PARSERS,
    )
    responses_store_size: int = setting(
        1024,
        "how many Responses API responses (store: true) this gateway keeps in memory for GET "
        "/v1/responses/{id} and previous_response_id, least recently used dropped first "
        "(256 MiB at most in all); 0 keeps none",
    )
    max_request_bytes: int = setting(
        8 << 20,
        "largest request accepted, in bytes: a larger HTTP body is refused with 413 before it is "
        "read or parsed, a larger gRPC message with RESOURCE_EXHAUSTED",
    )
    instance_id: str = setting(
        "",
        "an id GetModelInfo reports, so whoever started this gateway can tell it from another "
        "server on the same port (`llmserve serve` sets a random one)",
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' of every HTTP and gRPC client",
        secret=True,
        env="LLMSERVE_API_KEY",
    )

    api_keys: str | None = setting(
        None,
        "a JSON file of client keys, each naming a tenant, and the tenants' weights and quotas "
        "(docs/tenants.md); every HTTP and gRPC client then needs one "
        "of its keys (or --api-key, the default tenant's)",
    )
    admin_key: str | None = setting(
        None,
        "the key of the gRPC Admin service ('Authorization: Bearer KEY'; @PATH: read it from a "
        "file); without it the Admin service refuses every call",
        secret=True,
        env="LLMSERVE_ADMIN_KEY",
    )

    def admin_secret(self) -> str | None:
        return read_secret(self.admin_key)

    def __post_init__(self) -> None:
        check_ports(self, "port", "http_port", "metrics_port")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port={self.http_port} is the gRPC port too")
        self._check_scheduler_addresses()
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(
                f"routing={self.routing!r} is not one of {', '.join(ROUTING_POLICIES)}"
            )
        if self.routing_spill_threshold < 0:
            raise ValueError(f"routing_spill_threshold={self.routing_spill_threshold} must be >= 0")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r} is not one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size={self.responses_store_size} must be >= 0")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= 1024")
        if isinstance(self.served_model_name, str | None):  # one name given as a string
            names = (self.served_model_name,) if self.served_model_name is not None else ()
            object.__setattr__(self, "served_model_name", names)
        if any(not name.strip() for name in self.served_model_name):
            raise ValueError("served_model_name has an empty name; leave it unset for the model's")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; leave it unset to serve without a key")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("admin_key is empty; leave it unset to turn the Admin service off")
        if self.api_keys is not None and not self.api_keys.strip():
            raise ValueError("api_keys is empty; leave it unset to serve without a tenant file")
        if self.admin_key and not self.admin_key.startswith("@") and self.admin_key == self.api_key:
            raise ValueError("admin_key must differ from api_key: a client key must not open Admin")

    def _check_scheduler_addresses(self) -> None:
        if isinstance(self.scheduler_address, str):  # one address given as a string
            object.__setattr__(self, "scheduler_address", (self.scheduler_address,))
        if not self.scheduler_address:
            raise ValueError("scheduler_address is empty; give at least one scheduler")
        for address in self.scheduler_address:
            host, _, port = address.removeprefix(DNS_PREFIX).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"scheduler_address={address!r} is not HOST:PORT or {DNS_PREFIX}NAME:PORT"
                )
        if len(set(self.scheduler_address)) != len(self.scheduler_address):
            raise ValueError(f"scheduler_address={list(self.scheduler_address)} repeats one")


def model_names(config: GatewayConfig) -> tuple[str, ...]:
    """The names of the base model: the id both APIs report first, then its aliases."""
    return config.served_model_name or (default_model_id(config.model),)
