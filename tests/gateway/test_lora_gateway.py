"""The gateway's side of LoRA, in-process: the tenant file's lora_adapters (parsed, checked, and
enforced at admission: PERMISSION_DENIED / HTTP 403), the OpenAI `model` field resolved to an
adapter, and the adapters the gateway serves learned from its replicas' stats."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.http_errors import ApiError
from llmserve.gateway.replicas import ReplicaLink
from llmserve.gateway.tenants import Caller, TenantError, from_dict
from llmserve.gateway.validation import ValidRequest
from llmserve.protos import scheduler_pb2

TABLE = {
    "tenants": {"acme": {"lora_adapters": ["acme-ft"]}, "open": {"weight": 2}},
    "keys": [{"key": "k1", "tenant": "acme"}, {"key": "k2", "tenant": "open"}],
}


def core_with(lora_names: list[str]) -> GatewayCore:
    core = GatewayCore(GatewayConfig(scheduler_address=("a:1",)), tokenizer=None)  # type: ignore[arg-type]
    core.tenants = from_dict(TABLE)
    core.quotas.tenants = core.tenants
    link = ReplicaLink("a:1", None, None)  # type: ignore[arg-type]
    link.stats = scheduler_pb2.SchedulerStats(lora_names=lora_names)
    core.replicas.links = {"a:1": link}
    return core


def valid(lora_name: str) -> ValidRequest:
    return ValidRequest(
        scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2], max_tokens=2, lora_name=lora_name),
        [],
    )


def test_tenant_file_restricts_adapters() -> None:
    table = from_dict(TABLE)
    acme, other = table.limits("acme"), table.limits("open")
    assert acme.lora_adapters == frozenset({"acme-ft"}) and other.lora_adapters is None
    assert acme.may_use("acme-ft") and acme.may_use("") and not acme.may_use("globex-ft")
    assert other.may_use("globex-ft")
    with pytest.raises(TenantError, match=r"tenants\.x\.lora_adapters must be a list"):
        from_dict({"tenants": {"x": {"lora_adapters": "acme-ft"}}})


def test_admission_refuses_an_adapter_the_tenant_may_not_use() -> None:
    core = core_with(["acme-ft", "globex-ft"])
    core.admit(Caller("acme"), [valid("acme-ft")]).release()
    core.admit(Caller("acme"), [valid("")]).release()
    with pytest.raises(GatewayError) as err:
        core.admit(Caller("acme"), [valid("globex-ft")])
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use adapter 'globex-ft'" in err.value.message
    assert ApiError.from_gateway(err.value, "prompt").status == 403
    core.admit(Caller("open"), [valid("globex-ft")]).release()


def test_model_field_names_the_base_or_an_adapter() -> None:
    core = core_with(["ft"])
    assert core.lora_names == {"ft"}
    assert core.lora_for_model("ft") == "ft"
    assert core.lora_for_model(core.model_id) == "" and core.lora_for_model(None) == ""
    with pytest.raises(GatewayError) as err:
        core.lora_for_model("nope")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    api = ApiError.from_gateway(err.value, "prompt")
    assert api.status == 404 and api.body.error.code == "model_not_found"
    # Without adapters too, another name is 404 (as vLLM); --accept-any-model serves it with the
    # base, and a name is never refused before any scheduler said what it serves (503 first).
    with pytest.raises(GatewayError):
        core_with([]).lora_for_model("anything")
    lenient = core_with([])
    lenient.config = replace(lenient.config, accept_any_model=True)
    assert lenient.lora_for_model("anything") == ""
    unknown = core_with([])
    unknown.replicas.links["a:1"].stats = None
    assert unknown.lora_for_model("anything") == ""
