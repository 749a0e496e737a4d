"""The request path both APIs share, the gRPC Generation service and the OpenAI-compatible HTTP
API, in front of the same scheduler replicas (gateway/replicas.py):

    validate -> admit -> submit to a replica -> detokenize + stop strings -> stream text

Each phase is one method or function. Closing or cancelling a `generate` stream (its client went
away) cancels the Submit call upstream: the scheduler then aborts the request and frees its
blocks before its next step. A stop string ends the request the same way, after the text before
it has been sent. Failover between replicas and the text stream are gateway/streaming.py's.

Before any of that, `admit` holds the request's tenant (gateway/tenants.py: named by the key
the interceptor or the middleware found) to the tenant's quotas (gateway/quotas.py); a draining
gateway admits nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping

import grpc

from llmserve.common.choice_id import names_request
from llmserve.common.structured_output import ConstraintError, check_structured_output
from llmserve.gateway.config import GatewayConfig, model_names
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.harmony import harmony_request
from llmserve.gateway.quotas import Admission, QuotaExceeded, Quotas, TooLarge
from llmserve.gateway.reasoning import speaks_harmony
from llmserve.gateway.replicas import ReplicaLinks
from llmserve.gateway.streaming import InFlight, routed_messages, stream_text
from llmserve.gateway.telemetry import GatewayTelemetry, RequestTelemetry
from llmserve.gateway.tenants import (
    DEFAULT_TENANT,
    ApiKey,
    Caller,
    TenantError,
    TenantTable,
    display_name,
    load_tenants,
)
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.gateway.validation import ValidationError, ValidRequest, validate
from llmserve.protos import api_pb2, scheduler_pb2

DRAINING_MESSAGE = "this gateway is draining (an operator's Drain) and admits nothing; retry"


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class GatewayCore:
    """The request path: validation, admission by tenant, and generation over `replicas` (the
    links to the scheduler replicas: routing, limits, readiness; gateway/replicas.py)."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Tokenizer,
        tenants: TenantTable | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
    ):
        # What both APIs call the model (the engine's own name for it is only logged).
        names = model_names(config)
        self.config = config
        self.model_id = names[0]
        self.replicas = ReplicaLinks(config, self.model_id)
        self.model_names = frozenset(names)  # the id and its aliases
        self.tokenizer = tokenizer
        # The model's generation_config.json sampling defaults (vLLM applies them too).
        self.sampling_defaults = sampling_defaults or {}
        self.telemetry = GatewayTelemetry()
        self.telemetry.model = self.model_id
        self.tenants = tenants or load_tenants(config)
        self.quotas = Quotas(self.tenants)
        self.in_flight: set[InFlight] = set()

    def model_info(self) -> api_pb2.ModelInfo:
        if self.replicas.info is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        return api_pb2.ModelInfo(
            model=self.model_id,
            max_model_len=self.replicas.info.max_model_len,
            vocab_size=self.replicas.info.vocab_size,
            eos_token_ids=self.replicas.info.eos_token_ids,
            instance_id=self.config.instance_id,
            num_replicas=len(self.replicas.router.replicas),
            num_replicas_ready=self.replicas.router.num_healthy,
            lora_names=sorted(self.lora_names),
        )

    @property
    def lora_names(self) -> set[str]:
        """The LoRA adapters served: those any replica's scheduler serves (its stats say)."""
        return {name for link in self.replicas.links.values() for name in link.lora_names}

    def lora_for_model(self, model: str | None) -> str:
        """The adapter an OpenAI `model` names ("": the base model, by its id or an alias, or
        when the field is left out). Any other name is NOT_FOUND, as vLLM answers it, unless
        --accept-any-model."""
        adapters = self.lora_names
        if model and model in adapters:
            return model
        if not model or model in self.model_names or self.config.accept_any_model:
            return ""
        if all(link.stats is None for link in self.replicas.links.values()):
            return ""  # no scheduler has said what it serves yet: validation answers 503
        raise GatewayError(grpc.StatusCode.NOT_FOUND, self._not_served(model, adapters))

    def _not_served(self, model: str, adapters: set[str]) -> str:
        aliases = sorted(self.model_names - {self.model_id})
        names = [self.model_id, *aliases, *sorted(adapters)]
        served = ", ".join(names[:10]) + (f", and {len(names) - 10} more" * (len(names) > 10))
        return f"model {model[:100]!r} is not served here; models: {served}"

    def validate(self, request: api_pb2.GenerateRequest) -> ValidRequest:
        """The request tokenized, with defaults filled; GatewayError INVALID_ARGUMENT (naming the
        field, value and limit) or UNAVAILABLE (no scheduler yet) otherwise."""
        if self.replicas.limits is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        name = request.lora_name
        if name and name not in (adapters := self.lora_names):
            raise GatewayError(grpc.StatusCode.NOT_FOUND, self._not_served(name, adapters))
        parser, template = self.config.reasoning_parser, self.tokenizer.chat_template
        try:
            valid = validate(request, self.tokenizer, self.replicas.limits, self.sampling_defaults)
            if request.HasField("chat") and speaks_harmony(parser, template):
                valid = harmony_request(valid, self.tokenizer.tokenizer.token_to_id)
                check_structured_output(valid.sampling.structured_output, "", "response_format")
        except (ValidationError, ConstraintError) as err:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        return valid

    # -- tenants and admission ---------------------------------------------------------------------

    def caller(self, key: ApiKey | None, user: str) -> Caller:
        """Who sent a request: the tenant of the key it presented (found once, by the
        interceptor or the middleware), else (no keys configured) its `user` field's.
        GatewayError INVALID_ARGUMENT for a `user` that cannot name a tenant."""
        try:
            return self.tenants.caller(key, user)
        except TenantError as err:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err

    def admit(self, caller: Caller, valids: list[ValidRequest], n: int = 1) -> Admission:
        """Hold caller's tenant to its quotas for valids, n sequences each (release the
        admission when they end). GatewayError: UNAVAILABLE while draining; RESOURCE_EXHAUSTED
        with retry_after_s over a quota now; INVALID_ARGUMENT for what no quota could ever
        admit. Each refusal is counted by tenant and reason."""
        if self.replicas.draining:
            self.telemetry.refused(caller.tenant, "draining")
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        limits = self.tenants.limits(caller.tenant)
        for v in valids:
            if not limits.may_use(v.submit.lora_name):
                self.telemetry.refused(caller.tenant, "lora_adapter")
                raise GatewayError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"tenant {display_name(caller.tenant)!r} may not use adapter "
                    f"{v.submit.lora_name!r} (its lora_adapters: "
                    f"{', '.join(sorted(limits.lora_adapters or ()))})",
                )
        costs = [len(v.prompt_token_ids) + v.submit.max_tokens for v in valids for _ in range(n)]
        try:
            return self.quotas.admit(caller.tenant, costs)
        except QuotaExceeded as err:
            self.telemetry.refused(err.tenant, err.reason)
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, err.message, err.retry_after_s
            ) from err
        except TooLarge as err:
            self.telemetry.refused(err.tenant, "too_large")
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, err.message) from err

    def find_in_flight(self, request_id: str) -> list[InFlight]:
        """The requests in flight request_id names: the one of that id, or the choices of an
        HTTP request (named by its response id: its choices are RESPONSE_ID-INDEX)."""
        return [e for e in self.in_flight if names_request(request_id, e.request_id)]

    @property
    def num_admitted(self) -> int:
        """Sequences admitted and not yet ended (an HTTP request's choices count before their
        Submit calls start)."""
        return sum(usage.num_in_flight for usage in self.quotas.usage.values())

    # -- the request path --------------------------------------------------------------------------

    async def generate(
        self,
        valid: ValidRequest,
        request_id: str,
        trace: RequestTelemetry,
        admission: Admission | None = None,
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Submit valid to a scheduler replica (the router's pick; others if it fails before
        its first token) and stream its text. The last message carries the finish reason and
        usage. Raises GatewayError with the scheduler's code when every replica refuses
        (RESOURCE_EXHAUSTED: queue full) or when the request is lost after its first token
        (UNAVAILABLE). Ends trace. The tokens it consumed (its prompt once a scheduler took it,
        and what it generated) are counted on admission, which the caller releases."""
        submit = scheduler_pb2.SubmitRequest()
        submit.CopyFrom(valid.submit)
        submit.request_id = request_id
        submit.tenant = admission.tenant if admission is not None else DEFAULT_TENANT
        submit.tenant_weight = self.tenants.limits(submit.tenant).weight
        entry = InFlight(request_id, submit.tenant, len(submit.prompt_token_ids), time.monotonic())
        self.in_flight.add(entry)
        metadata = (*self.replicas.peer_metadata, *trace.metadata())
        messages = routed_messages(
            self.replicas.router, self.replicas.links, submit, metadata, entry
        )
        try:
            async for msg in stream_text(self.tokenizer, request_id, valid, messages, entry):
                trace.on_response(msg)
                if msg.finish_reason:
                    trace.finish(msg.finish_reason)
                yield msg
        except grpc.aio.AioRpcError as err:
            trace.finish(code=err.code().name, message=err.details() or "")
            raise GatewayError(err.code(), err.details() or err.code().name) from err
        except GatewayError as err:
            trace.finish(code=err.code.name, message=err.message)
            raise
        finally:
            self.in_flight.discard(entry)
            if admission is not None:
                admission.use(entry.num_consumed_tokens)
            await messages.aclose()  # cancels the Submit call: the scheduler frees the request
            trace.finish(code="CANCELLED", message="client went away")  # no-op when finished
