"""The scheduler's operator RPCs (ListRequests, AbortRequest, Drain) and per-tenant stats over real
gRPC: gateway + scheduler (fair policy) + the echo engine, a client sending `user` and `priority`
through the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmserve.client import make_request
from llmserve.common.net import check_health
from llmserve.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.stack import Stack, StreamWatch, start_echo_stack, wait_mid_stream

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)


@pytest.fixture(scope="module")
def stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        "--fake-step-delay-ms", "10", "--num-kv-blocks", "64", "--max-model-len", "512",
        scheduler=("--scheduling-policy", "fair"),
    )  # fmt: skip
    yield s
    s.close()


def scheduler_call(stack: Stack, method: str, request: object) -> Any:
    with stack.scheduler.channel(stack.scheduler_address, aio=False) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return getattr(stub, method)(request, timeout=10, metadata=stack.scheduler.peer_metadata())


def test_list_requests_shows_the_gateways_user_and_priority(stack: Stack) -> None:
    info = scheduler_call(stack, "GetInfo", scheduler_pb2.GetInfoRequest())
    assert info.scheduling_policy == "fair"
    with stack.client() as client:
        req = make_request(text="abcd" * 4, max_tokens=100, user="alice", priority=2)
        req.request_id = "op-listed"
        watch = StreamWatch(client, req, at_least=3)
        wait_mid_stream([watch])
        listed = scheduler_call(stack, "ListRequests", scheduler_pb2.ListRequestsRequest())
        rows = [(r.request_id, r.tenant, r.state, r.priority) for r in listed.requests]
        assert rows == [("op-listed", "alice", "running", 2)]
        row = listed.requests[0]
        assert row.num_prompt_tokens == 16 and row.num_blocks > 0 and row.age_s > 0
        request = scheduler_pb2.ListRequestsRequest(tenant="bob")
        assert list(scheduler_call(stack, "ListRequests", request).requests) == []
        assert watch.result().finish_reason == "length"
        assert client.generate(make_request(text="hi bob", max_tokens=5, user="bob")).finish_reason
    stats = stack.assert_idle()
    tenants = {t.tenant: t for t in stats.tenants}
    assert set(tenants) == {"alice", "bob"}
    assert (tenants["alice"].num_generated_tokens, tenants["bob"].num_generated_tokens) == (100, 5)
    assert tenants["bob"].num_prompt_tokens == 6 and tenants["bob"].virtual_tokens > 0
    assert all(t.weight == 1.0 and t.num_running == t.num_waiting == 0 for t in tenants.values())


def test_abort_request_ends_every_choice_with_abort(stack: Stack) -> None:
    """Two choices as the gateway names them (`{id}-{index}`) and one other request; aborting
    the id ends both choices' Submit streams with FINISH_REASON_ABORT, and only them."""
    with stack.scheduler.channel(stack.scheduler_address, aio=False) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        metadata = stack.scheduler.peer_metadata()

        def submit(request_id: str) -> Any:
            msg = scheduler_pb2.SubmitRequest(
                request_id=request_id, prompt_token_ids=[5, 6, 7, 8], max_tokens=300,
                tenant="carol", tenant_weight=2.0,
            )  # fmt: skip
            msg.sampling.SetInParent()
            return stub.Submit(msg, timeout=30, metadata=metadata)

        calls = [submit("cmpl-op-0"), submit("cmpl-op-1"), submit("cmpl-op-10x")]
        for call in calls:
            next(call)  # each is running
        reply = scheduler_call(
            stack, "AbortRequest", scheduler_pb2.AbortRequestRequest(request_id="cmpl-op")
        )
        assert reply.num_aborted == 2
        for call in calls[:2]:
            last = list(call)[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert list(calls[2])[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    request = scheduler_pb2.AbortRequestRequest(request_id="cmpl-op")
    assert scheduler_call(stack, "AbortRequest", request).num_aborted == 0
    stats = stack.assert_idle()
    assert {t.tenant: t.weight for t in stats.tenants}["carol"] == 2.0


def test_drain_finishes_what_runs_and_refuses_the_rest(stack: Stack) -> None:
    with stack.client() as client:
        watches = [
            StreamWatch(client, make_request(text=f"drain {i}", max_tokens=60), at_least=2)
            for i in range(4)
        ]
        wait_mid_stream(watches)
        reply = scheduler_call(stack, "Drain", scheduler_pb2.DrainRequest())
        assert reply.draining
        stats = stack.stats()
        assert stats.draining and not stats.ready
        assert check_health(stack.scheduler_address) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(make_request(text="too late", max_tokens=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for w in watches:
            assert w.result().finish_reason == "length"
            assert len(w.result().token_ids) == 60
        stack.assert_idle()

        reply = scheduler_call(stack, "Drain", scheduler_pb2.DrainRequest(resume=True))
        assert not reply.draining
        deadline = time.monotonic() + 10
        while check_health(stack.gateway_address) != "SERVING":
            assert time.monotonic() < deadline, "the gateway never saw the scheduler ready again"
            time.sleep(0.05)
        assert client.generate(make_request(text="again", max_tokens=5)).finish_reason == "length"
    assert not stack.stats().draining
