"""The gateway's side of issue 18 through running servers: a gateway (in-process) in front of
fake schedulers that speak the real contract (tests/fake_scheduler.py). Tenants from keys and
from `user`, the fields every Submit carries, quotas as RESOURCE_EXHAUSTED + retry-after and
HTTP 429 + Retry-After, the admin key, every Admin RPC, Drain, and `llmserve admin`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import pytest

from llmserve.cli import main as llmserve_main
from llmserve.client import Client, make_request
from llmserve.protos import admin_pb2, admin_pb2_grpc, api_pb2
from tests.fake_scheduler import (
    FakeScheduler,
    GatewayThread,
    gateway_config,
    start_fake_scheduler,
)

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

ADMIN_KEY = "admin-secret"
ACME_KEY, BETA_KEY, PLAIN_KEY = "sk-acme", "sk-beta", "sk-plain"
TENANTS = {
    "default": {"weight": 1},
    "tenants": {
        "acme": {"weight": 2, "tokens_per_minute": 60},
        "beta": {"weight": 0.5, "max_concurrent_requests": 1},
    },
    "keys": [
        {"key": ACME_KEY, "tenant": "acme", "name": "acme-prod"},
        {"key": BETA_KEY, "tenant": "beta"},
        {"key": PLAIN_KEY},
    ],
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Setup:
    def __init__(self, schedulers: list[FakeScheduler], gateway: GatewayThread):
        self.schedulers = schedulers
        self.gateway = gateway
        self.channel = gateway.channel()
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    @property
    def scheduler(self) -> FakeScheduler:
        return self.schedulers[0]

    def client(self, key: str | None = None) -> Client:
        return Client(self.gateway.address, api_key=key)

    def call(self, method: str, request: Any, key: str | None = ADMIN_KEY) -> Any:
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        return getattr(self.admin, method)(request, metadata=metadata, timeout=10)


def start(
    tmp_path: Path,
    tokenizer_dir: Path,
    num_schedulers: int = 1,
    http: bool = False,
    tenants: dict[str, Any] | None = TENANTS,
    operator_rpcs: bool = True,
    **fields: Any,
) -> tuple[Setup, list[grpc.Server]]:
    schedulers = [FakeScheduler(operator_rpcs=operator_rpcs) for _ in range(num_schedulers)]
    servers, addresses = zip(*(start_fake_scheduler(s) for s in schedulers), strict=True)
    if tenants is not None:
        path = tmp_path / "tenants.json"
        path.write_text(json.dumps(tenants))
        fields["api_keys"] = str(path)
    fields.setdefault("admin_key", ADMIN_KEY)
    config = gateway_config(tokenizer_dir, list(addresses), **fields)
    gateway = GatewayThread(config, http=http)
    gateway.wait_serving()
    return Setup(schedulers, gateway), list(servers)


@pytest.fixture
def setup(tmp_path: Path, tokenizer_dir: Path) -> Iterator[Setup]:
    s, servers = start(tmp_path, tokenizer_dir, http=True)
    yield s
    s.channel.close()
    s.gateway.close()
    for server in servers:
        server.stop(0)


def echo(prompt: str, n: int) -> str:
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def trailing(err: grpc.RpcError) -> dict[str, str]:
    return dict(err.trailing_metadata() or ())


def post(setup: Setup, body: dict[str, Any], key: str | None) -> httpx.Response:
    assert setup.gateway.http_url is not None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{setup.gateway.http_url}/v1/completions", json=body, headers=headers, timeout=30
    )


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- tenants --------------------------------------------------------------------------------------


def test_every_submit_carries_tenant_weight_and_priority(setup: Setup) -> None:
    with setup.client(ACME_KEY) as client:
        out = client.generate(make_request(text="hello", max_tokens=3, priority=-2, user="x"))
    assert out.text == echo("hello", 3)
    submit = setup.scheduler.submitted[-1]
    # The key decides; user is ignored when keys name tenants.
    assert (submit.tenant, submit.tenant_weight, submit.priority) == ("acme", 2.0, -2)
    # n = 2 is more than beta's max_concurrent_requests=1 could ever admit: 400, not 429.
    reply = post(setup, {"prompt": "hi", "max_tokens": 2, "n": 2}, BETA_KEY)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "n"
    reply = post(setup, {"prompt": "hi", "max_tokens": 2, "priority": 7}, PLAIN_KEY)
    assert reply.status_code == 200, reply.text
    submit = setup.scheduler.submitted[-1]
    assert (submit.tenant, submit.tenant_weight, submit.priority) == ("", 1.0, 7)


def test_keys_are_required_and_the_admin_key_is_not_one(setup: Setup) -> None:
    for key in (None, "wrong", ADMIN_KEY):
        with setup.client(key) as client:
            err = rpc_error(lambda c=client: c.generate(make_request(text="hi", max_tokens=1)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, key
        reply = post(setup, {"prompt": "hi", "max_tokens": 1}, key)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_without_keys_the_user_field_names_the_tenant(tmp_path: Path, tokenizer_dir: Path) -> None:
    s, servers = start(tmp_path, tokenizer_dir, http=True, tenants=None)
    try:
        with s.client() as client:
            client.generate(make_request(text="hello", max_tokens=1, user="alice"))
            assert s.scheduler.submitted[-1].tenant == "alice"
            assert s.scheduler.submitted[-1].tenant_weight == 1.0
            client.generate(make_request(text="hello", max_tokens=1))
            assert s.scheduler.submitted[-1].tenant == ""
            err = rpc_error(
                lambda: client.generate(make_request(text="hi", max_tokens=1, user="u" * 200))
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details() == "user has 200 characters; the limit is 128"
        reply = post(s, {"prompt": "hi", "max_tokens": 1, "user": "bob"}, None)
        assert reply.status_code == 200 and s.scheduler.submitted[-1].tenant == "bob"
        # A weight set at run time for a tenant named only by `user`.
        s.call("SetTenantWeight", admin_pb2.SetTenantWeightRequest(tenant="bob", weight=4))
        post(s, {"prompt": "hi", "max_tokens": 1, "user": "bob"}, None)
        assert s.scheduler.submitted[-1].tenant_weight == 4.0
    finally:
        s.gateway.close()
        for server in servers:
            server.stop(0)


# -- quotas ---------------------------------------------------------------------------------------


def test_tokens_per_minute_is_429_with_the_computed_retry_after(setup: Setup) -> None:
    """acme: 60 tokens a minute (1 a second). On a frozen clock: a request of 5 + 25 tokens
    leaves 30; one of 5 + 35 then waits exactly (40 - 30) / 1 = 10 s."""
    clock = Clock()
    setup.gateway.core.quotas.clock = clock
    with setup.client(ACME_KEY) as client:
        client.generate(make_request(text="hello", max_tokens=25))
        err = rpc_error(lambda: client.generate(make_request(text="hello", max_tokens=35)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailing(err)["retry-after"] == "10"
        assert err.details() == (
            "tenant 'acme' is over its quota of tokens_per_minute=60: this request reserves "
            "40 tokens (prompt + max_tokens), 30 are left"
        )
        reply = post(setup, {"prompt": "hello", "max_tokens": 35}, ACME_KEY)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "10"
        assert reply.json()["error"]["type"] == "rate_limit_error"
        assert "tokens_per_minute=60" in reply.json()["error"]["message"]
        # Larger than the quota itself: never admissible, so 400, not 429.
        err = rpc_error(lambda: client.generate(make_request(text="hello", max_tokens=60)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the quota of tenant 'acme', tokens_per_minute=60" in str(err.details())
        reply = post(setup, {"prompt": "hello", "max_tokens": 60}, ACME_KEY)
        assert reply.status_code == 400
        # Everyone else is served meanwhile.
        with setup.client(PLAIN_KEY) as other:
            assert other.generate(make_request(text="hello", max_tokens=40)).text
        clock.now += 10
        assert client.generate(make_request(text="hello", max_tokens=35)).text


def test_concurrent_requests_quota(setup: Setup) -> None:
    """beta may run 1 request at a time; a second waits for it (Retry-After 1 before any
    finished), at both APIs; other tenants are not held up."""
    setup.scheduler.gate.clear()
    with setup.client(BETA_KEY) as client:
        first = client.start(make_request(text="hello", max_tokens=2))
        wait_until(lambda: setup.scheduler.requests)
        err = rpc_error(lambda: client.generate(make_request(text="hi", max_tokens=1)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailing(err)["retry-after"] == "1"
        assert err.details() == (
            "tenant 'beta' has 1 requests in flight; its quota is max_concurrent_requests=1"
        )
        reply = post(setup, {"prompt": "hi", "max_tokens": 1}, BETA_KEY)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        setup.scheduler.gate.set()
        with setup.client(PLAIN_KEY) as other:
            assert other.generate(make_request(text="hi", max_tokens=2)).text == "hi"
        assert "".join(m.text for m in first) == "he"
        assert client.generate(make_request(text="hi", max_tokens=1)).text == "h"


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_client_gone_releases_its_quota(setup: Setup, stream: bool) -> None:
    """beta (1 at a time) disconnects while its request waits: the request ends upstream and
    its concurrency is free again."""
    setup.scheduler.gate.clear()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{setup.gateway.http_url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2, "stream": stream},
            headers={"Authorization": f"Bearer {BETA_KEY}"},
            timeout=0.5,
        )
    wait_until(lambda: setup.gateway.core.quotas.num_in_flight("beta") == 0)
    wait_until(lambda: not setup.scheduler.requests)
    setup.scheduler.gate.set()
    with setup.client(BETA_KEY) as client:
        assert client.generate(make_request(text="hi", max_tokens=2)).text == "hi"


def test_refusals_are_counted_by_tenant_and_reason(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []
    telemetry = setup.gateway.core.telemetry
    original = telemetry.refused

    def refused(tenant: str, reason: str) -> None:
        seen.append((tenant, reason))
        original(tenant, reason)

    monkeypatch.setattr(telemetry, "refused", refused)
    with setup.client(ACME_KEY) as client:
        rpc_error(lambda: client.generate(make_request(text="hello", max_tokens=100)))
    assert seen == [("acme", "too_large")]


# -- the admin key --------------------------------------------------------------------------------


def test_admin_needs_the_admin_key(setup: Setup, tmp_path: Path, tokenizer_dir: Path) -> None:
    request = admin_pb2.GetHealthRequest()
    for key in (None, ACME_KEY, PLAIN_KEY, "wrong"):
        err = rpc_error(lambda k=key: setup.call("GetHealth", request, key=k))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, key
        assert "admin key" in str(err.details())
    assert setup.call("GetHealth", request).components
    # Without --admin-key the Admin service is off.
    s, servers = start(tmp_path, tokenizer_dir, admin_key=None)
    try:
        for key in (None, ADMIN_KEY, ACME_KEY):
            err = rpc_error(lambda k=key: s.call("GetHealth", request, key=k))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.details() == "the Admin service is off: start the gateway with --admin-key"
    finally:
        s.gateway.close()
        for server in servers:
            server.stop(0)


def test_admin_key_may_not_be_a_client_key(tmp_path: Path, tokenizer_dir: Path) -> None:
    from llmserve.gateway.tenants import TenantError, load_tenants

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"keys": [{"key": "same"}]}))
    config = gateway_config(tokenizer_dir, ["127.0.0.1:1"], api_keys=str(path), admin_key="same")
    with pytest.raises(TenantError, match="admin_key is also a client key"):
        load_tenants(config)
    with pytest.raises(ValueError, match="admin_key must differ from api_key"):
        gateway_config(tokenizer_dir, ["127.0.0.1:1"], api_key="k", admin_key="k")


def test_llmserve_admin_dials_like_the_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llmserve admin` and the client share one channel setup (llmserve.client.GatewayChannel):
    the gateway's default port, the key (@PATH read) as a Bearer value."""
    from llmserve.admin import _Admin
    from llmserve.cli import build_parser
    from llmserve.common.net import DEFAULT_GATEWAY_PORT

    monkeypatch.delenv("LLMSERVE_ADDRESS", raising=False)
    monkeypatch.delenv("LLMSERVE_ADMIN_KEY", raising=False)
    (tmp_path / "admin.key").write_text("the admin key\n")
    args = build_parser().parse_args(["admin", "health", "--admin-key", f"@{tmp_path}/admin.key"])
    admin = _Admin(args)
    with admin.gateway as gateway:
        assert gateway.address == f"localhost:{DEFAULT_GATEWAY_PORT}"
        assert gateway.metadata == (("authorization", "Bearer the admin key"),)
        assert admin.timeout == 30.0
    with Client("localhost") as client:
        assert (client.address, client.metadata) == (gateway.address, ())


# -- the Admin RPCs -------------------------------------------------------------------------------


def test_list_abort_capacity_and_health(tmp_path: Path, tokenizer_dir: Path) -> None:
    s, servers = start(tmp_path, tokenizer_dir, num_schedulers=2)
    try:
        for scheduler in s.schedulers:
            scheduler.gate.clear()
        clients = [s.client(ACME_KEY), s.client(PLAIN_KEY)]
        calls = [
            clients[0].start(make_request(text="hello", max_tokens=5, request_id="r-acme")),
            clients[1].start(make_request(text="hello", max_tokens=5, request_id="r-plain")),
        ]
        wait_until(lambda: sum(len(x.requests) for x in s.schedulers) == 2)
        listed = s.call("ListRequests", admin_pb2.ListRequestsRequest())
        by_id = {e.request.request_id: e for e in listed.requests}
        assert set(by_id) == {"r-acme", "r-plain"}
        assert by_id["r-acme"].request.tenant == "acme"
        assert {e.replica for e in listed.requests} <= set(s.gateway.config.scheduler_address)
        only = s.call("ListRequests", admin_pb2.ListRequestsRequest(tenant="default"))
        assert [e.request.request_id for e in only.requests] == ["r-plain"]
        # Abort: the replica holding it ends it; its client sees UNAVAILABLE, not retried.
        aborted = s.call("AbortRequest", admin_pb2.AbortRequestRequest(request_id="r-acme"))
        assert aborted.num_aborted == 1
        err = rpc_error(lambda: list(calls[0]))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details() == "aborted by an operator (Admin.AbortRequest)"
        err = rpc_error(
            lambda: s.call("AbortRequest", admin_pb2.AbortRequestRequest(request_id="nope"))
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "request_id='nope' is not running or waiting on any replica" in str(err.details())
        for scheduler in s.schedulers:
            scheduler.gate.set()
        assert "".join(m.text for m in calls[1]) == echo("hello", 5)
        # The gateway's view is each replica's last streamed stats: the one after the request
        # ended may still be on its way.
        deadline = time.monotonic() + 5
        capacity = s.call("GetCapacity", admin_pb2.GetCapacityRequest())
        while capacity.num_free_blocks != 128 and time.monotonic() < deadline:
            time.sleep(0.05)
            capacity = s.call("GetCapacity", admin_pb2.GetCapacityRequest())
        assert len(capacity.replicas) == 2
        assert capacity.num_blocks == 128 and capacity.num_free_blocks == 128
        assert all(r.ready and not r.draining for r in capacity.replicas)
        assert capacity.steps_per_s == pytest.approx(sum(r.steps_per_s for r in capacity.replicas))
        health = s.call("GetHealth", admin_pb2.GetHealthRequest())
        names = [c.component for c in health.components]
        a, b = s.gateway.config.scheduler_address
        assert names == ["gateway", f"scheduler {a}", f"engine of {a}", f"scheduler {b}",
                         f"engine of {b}"]  # fmt: skip
        assert all(c.healthy for c in health.components)
        assert health.components[0].detail == "2 of 2 replicas ready"
        for client in clients:
            client.close()
    finally:
        s.gateway.close()
        for server in servers:
            server.stop(0)


def test_steps_per_second_while_running(setup: Setup) -> None:
    setup.scheduler.step_s = 0.01
    with setup.client(PLAIN_KEY) as client:
        call = client.start(make_request(text="hello", max_tokens=150))
        time.sleep(1.0)
        capacity = setup.call("GetCapacity", admin_pb2.GetCapacityRequest())
        assert 10 < capacity.steps_per_s < 110, capacity
        assert capacity.replicas[0].tenants[0].num_running == 1
        assert capacity.num_running == 1 and capacity.num_free_blocks < capacity.num_blocks
        call.cancel()


def test_tenant_weight_and_quota_at_run_time(setup: Setup) -> None:
    config = setup.call(
        "SetTenantWeight", admin_pb2.SetTenantWeightRequest(tenant="acme", weight=3)
    )
    assert (config.tenant, config.weight, config.tokens_per_minute) == ("acme", 3.0, 60)
    with setup.client(ACME_KEY) as client:
        client.generate(make_request(text="hi", max_tokens=1))
    assert setup.scheduler.submitted[-1].tenant_weight == 3.0
    config = setup.call(
        "SetQuota", admin_pb2.SetQuotaRequest(tenant="default", max_concurrent_requests=0)
    )
    assert config.tenant == "" and config.weight == 1.0
    config = setup.call("SetQuota", admin_pb2.SetQuotaRequest(tenant="new", tokens_per_minute=5))
    assert (config.weight, config.tokens_per_minute, config.max_concurrent_requests) == (1, 5, 0)
    config = setup.call("SetQuota", admin_pb2.SetQuotaRequest(tenant="acme", tokens_per_minute=0))
    assert config.tokens_per_minute == 0 and config.weight == 3.0
    for method, request, message in (
        ("SetTenantWeight", admin_pb2.SetTenantWeightRequest(tenant="acme"), "weight=0.0 must"),
        (
            "SetQuota",
            admin_pb2.SetQuotaRequest(tenant="acme", max_concurrent_requests=-1),
            "max_concurrent_requests=-1 must be an integer >= 0",
        ),
    ):
        err = rpc_error(lambda m=method, r=request: setup.call(m, r))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in str(err.details())
    tenants = setup.call("ListTenants", admin_pb2.ListTenantsRequest()).tenants
    assert [t.tenant for t in tenants] == ["", "acme", "beta", "new"]
    assert [t.weight for t in tenants] == [1.0, 3.0, 0.5, 1.0]


def test_scheduler_without_operator_rpcs(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Until the schedulers have ListRequests / AbortRequest / Drain, the gateway answers from
    what it knows: the requests it streams, and cancelling its own Submit calls."""
    s, servers = start(tmp_path, tokenizer_dir, operator_rpcs=False)
    try:
        s.scheduler.gate.clear()
        with s.client(ACME_KEY) as client:
            call = client.start(make_request(text="hello", max_tokens=5, request_id="r-1"))
            wait_until(lambda: s.scheduler.requests)
            listed = s.call("ListRequests", admin_pb2.ListRequestsRequest()).requests
            assert [(e.request.request_id, e.request.tenant) for e in listed] == [("r-1", "acme")]
            assert listed[0].request.num_prompt_tokens == 5
            aborted = s.call("AbortRequest", admin_pb2.AbortRequestRequest(request_id="r-1"))
            assert aborted.num_aborted == 1
            err = rpc_error(lambda: list(call))
            assert err.details() == "aborted by an operator (Admin.AbortRequest)"
            wait_until(lambda: not s.scheduler.requests)  # its Submit call was cancelled
    finally:
        s.gateway.close()
        for server in servers:
            server.stop(0)


# -- drain ----------------------------------------------------------------------------------------


def test_drain_finishes_what_runs_and_refuses_the_rest(setup: Setup) -> None:
    setup.scheduler.step_s = 0.02
    prompts = [f"request {i}" for i in range(3)]
    results: list[str] = [""] * 3
    with setup.client(PLAIN_KEY) as client:

        def run(i: int) -> None:
            results[i] = client.generate(make_request(text=prompts[i], max_tokens=30)).text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(setup.scheduler.requests) == 3)
        progress = setup.admin.Drain(
            admin_pb2.DrainRequest(), metadata=(("authorization", f"Bearer {ADMIN_KEY}"),)
        )
        first = next(progress)
        assert first.num_in_flight == 3 and not first.done
        assert setup.scheduler.draining
        err = rpc_error(lambda: client.generate(make_request(text="late", max_tokens=1)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in str(err.details())
        reply = post(setup, {"prompt": "late", "max_tokens": 1}, PLAIN_KEY)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        rest = list(progress)
        assert rest[-1].done and rest[-1].num_aborted == 0 and rest[-1].num_in_flight == 0
        assert all(not p.done for p in rest[:-1])
        for t in threads:
            t.join(10)
        assert results == [echo(p, 30) for p in prompts]  # nothing lost
        health = setup.call("GetHealth", admin_pb2.GetHealthRequest())
        assert not health.components[0].healthy
        assert health.components[0].detail.startswith("draining, 0 in flight")
        setup.call("Resume", admin_pb2.ResumeRequest())
        assert not setup.scheduler.draining
        setup.gateway.wait_serving()
        assert client.generate(make_request(text="back", max_tokens=2)).text == "ba"


def test_drain_timeout_aborts_what_is_left(setup: Setup) -> None:
    setup.scheduler.gate.clear()
    with setup.client(PLAIN_KEY) as client:
        calls = [client.start(make_request(text="held", max_tokens=3)) for _ in range(2)]
        wait_until(lambda: len(setup.scheduler.requests) == 2)
        messages = list(
            setup.admin.Drain(
                admin_pb2.DrainRequest(timeout_s=0.3),
                metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
            )
        )
        last = messages[-1]
        assert last.done and last.num_aborted == 2 and last.elapsed_s >= 0.3
        for call in calls:
            err = rpc_error(lambda c=call: list(c))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "timeout_s=0.3 passed" in str(err.details())
        wait_until(lambda: not setup.scheduler.requests)


# -- the command line -----------------------------------------------------------------------------


def admin_cli(setup: Setup, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The exit code and output of `llmserve admin ARGS` (less the in-process gateway's log)."""
    code = llmserve_main(
        ["admin", *args, "--address", setup.gateway.address, "--admin-key", ADMIN_KEY]
    )
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if " [info     ] " not in line]
    return code, "\n".join(lines)


def test_admin_cli(setup: Setup, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    setup.scheduler.gate.clear()
    with setup.client(ACME_KEY) as client:
        call = client.start(make_request(text="hello", max_tokens=3, request_id="cli-1"))
        wait_until(lambda: setup.scheduler.requests)
        code, out = admin_cli(setup, capsys, "requests")
        assert code == 0 and "cli-1" in out and "acme" in out, out
        code, out = admin_cli(setup, capsys, "requests", "--json")
        assert json.loads(out)["requests"][0]["request"]["request_id"] == "cli-1"
        code, out = admin_cli(setup, capsys, "tenants")
        assert code == 0 and "acme" in out and "(default)" in out, out
        code, out = admin_cli(setup, capsys, "abort", "cli-1")
        assert code == 0 and "aborted 1" in out, out
        code, out = admin_cli(setup, capsys, "abort", "cli-1")
        assert code == 1 and "NOT_FOUND" in out, out
        rpc_error(lambda: list(call))
    setup.scheduler.gate.set()
    code, out = admin_cli(setup, capsys, "capacity")
    assert code == 0 and "BLOCKS_USED" in out and "total" in out, out
    code, out = admin_cli(setup, capsys, "health")
    assert code == 0 and "gateway" in out and "engine of" in out, out
    code, out = admin_cli(setup, capsys, "set-weight", "acme", "5")
    assert code == 0 and "acme" in out, out
    code, out = admin_cli(
        setup, capsys, "set-quota", "acme", "--tokens-per-minute", "100", "--max-concurrent", "2"
    )
    assert code == 0, out
    code, out = admin_cli(setup, capsys, "tenants", "--json")
    acme = next(t for t in json.loads(out)["tenants"] if t["tenant"] == "acme")
    assert (acme["weight"], acme["tokens_per_minute"], acme["max_concurrent_requests"]) == (
        5.0, "100", 2,
    )  # fmt: skip
    code, out = admin_cli(setup, capsys, "set-quota", "acme")
    assert code == 2 and "give --tokens-per-minute, --max-concurrent or both" in out, out
    code, out = admin_cli(setup, capsys, "set-weight", "acme", "0")
    assert code == 1 and "weight=0.0 must be > 0" in out, out
    code, out = admin_cli(setup, capsys, "drain", "--timeout", "5")
    assert code == 0 and "done" in out, out
    code, out = admin_cli(setup, capsys, "health")
    assert code == 1 and "draining" in out, out  # exit 1: a component is not healthy
    code, out = admin_cli(setup, capsys, "resume")
    assert code == 0, out
    code = llmserve_main(["admin", "health", "--address", setup.gateway.address])
    assert code == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    address = setup.gateway.address
    assert (
        llmserve_main(["admin", "tenants", "--address", address, "--admin-key", f"@{key_file}"])
        == 0
    )


def test_make_request_carries_user_and_priority() -> None:
    request = make_request(text="x", user="u", priority=3)
    assert isinstance(request, api_pb2.GenerateRequest)
    assert (request.user, request.priority) == ("u", 3)


def test_openapi_document_has_the_new_fields_and_the_429(setup: Setup) -> None:
    assert setup.gateway.http_url is not None
    document = httpx.get(f"{setup.gateway.http_url}/openapi.json").json()
    for schema in ("CompletionRequest", "ChatCompletionRequest"):
        fields = document["components"]["schemas"][schema]["properties"]
        assert fields["priority"]["type"] == "integer" and "lower runs first" in str(
            fields["priority"]
        )
        assert "tenant" in str(fields["user"])
    responses = document["paths"]["/v1/completions"]["post"]["responses"]
    assert "Retry-After" in responses["429"]["headers"]
    assert "tokens per minute" in responses["429"]["description"]


def test_serve_takes_the_tenant_flags_and_checks_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmserve.serve_flags import parse_serve_flags, stack_from_flags

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    args = parse_serve_flags(["--api-keys", str(path), "--admin-key", ADMIN_KEY])
    stack = stack_from_flags(args)
    assert (stack.gateway.api_keys, stack.gateway.admin_key) == (str(path), ADMIN_KEY)
    # Relative paths are the caller's, made absolute for the gateway's config.
    monkeypatch.chdir(tmp_path)
    args = parse_serve_flags(["--api-keys", "tenants.json", "--admin-key", "@admin.key"])
    with pytest.raises(ValueError, match=r"admin_key='@.*admin\.key' cannot be read: No such file"):
        stack_from_flags(args)
    (tmp_path / "admin.key").write_text("the admin key\n")
    stack = stack_from_flags(args)
    assert stack.gateway.api_keys == str(path)
    assert stack.gateway.admin_key == f"@{tmp_path / 'admin.key'}"
    path.write_text(json.dumps({"keys": [{"key": "k", "tenant": "nobody"}]}))
    with pytest.raises(ValueError, match=r"keys\[0\].tenant='nobody' is not in tenants"):
        stack_from_flags(args)
    assert llmserve_main(["serve", "--api-keys", str(path)]) == 2


def test_admin_in_front_of_the_real_scheduler(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The real stack (echo engine) with --api-keys and no --api-key: the launcher still tells
    its gateway (GetModelInfo with the internal token), the tenant's key admits, the Admin
    service answers, and `llmserve admin` runs as a command. Whether or not the scheduler
    already has the operator RPCs, ListRequests shows the request and Drain ends done."""
    import subprocess
    import sys

    from tests.stack import ROOT, start_echo_stack

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    stack = start_echo_stack(
        tokenizer_dir,
        tmp_path,
        "--num-kv-blocks", "64", "--fake-step-delay-ms", "20",
        gateway_args=["--api-keys", str(path), "--admin-key", ADMIN_KEY],
    )  # fmt: skip
    try:
        channel = grpc.insecure_channel(stack.gateway_address)
        admin = admin_pb2_grpc.AdminStub(channel)
        metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
        with Client(stack.gateway_address, api_key=PLAIN_KEY) as client:
            call = client.start(make_request(text="hello", max_tokens=100, request_id="real-1"))
            next(iter(call))
            listed = admin.ListRequests(admin_pb2.ListRequestsRequest(), metadata=metadata)
            assert [e.request.request_id for e in listed.requests] == ["real-1"]
            capacity = admin.GetCapacity(admin_pb2.GetCapacityRequest(), metadata=metadata)
            assert capacity.num_blocks == 64 and capacity.replicas[0].ready
            done = list(admin.Drain(admin_pb2.DrainRequest(timeout_s=30), metadata=metadata))
            assert done[-1].done and done[-1].num_aborted == 0
            assert "".join(m.text for m in call) == echo("hello", 100)[1:]
        out = subprocess.run(
            [sys.executable, "-m", "llmserve.cli", "admin", "health",
             "--address", stack.gateway_address],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**__import__("os").environ, "LLMSERVE_ADMIN_KEY": ADMIN_KEY},
        )  # fmt: skip
        assert out.returncode == 1 and "draining" in out.stdout, out  # drained: not healthy
        admin.Resume(admin_pb2.ResumeRequest(), metadata=metadata)
        # Every Admin call is logged with who made it.
        lines = [json.loads(line) for line in (tmp_path / "gateway.log").read_text().splitlines()]
        calls = [line for line in lines if line["event"] == "admin call"]
        methods = [c["method"] for c in calls]
        assert methods == ["ListRequests", "GetCapacity", "Drain", "GetHealth", "Resume"]
        assert calls[2]["arguments"] == {"timeout_s": 30.0} and calls[2]["key"] == "admin"
        assert all(c["peer"].startswith("ipv4:127.0.0.1:") for c in calls)
        with Client(stack.gateway_address, api_key=ACME_KEY) as client:
            assert client.generate(make_request(text="hi", max_tokens=2)).text == "hi"
        channel.close()
        stack.assert_idle()
    finally:
        stack.close()
