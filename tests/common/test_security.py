"""The internal ports are closed doors: only the stack's own services (holding its internal token,
or its certificates) may drive the engine or the scheduler; one scheduler at a time; nothing a
peer sends is trusted (the scheduler checks Submit as strictly as the gateway, the engine checks
every plan, and one bad request fails alone); the services bind loopback unless told otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmserve.client import make_request
from llmserve.common.net import CHANNEL_OPTIONS, check_health, wait_until_serving
from llmserve.common.step_plan import StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig
from llmserve.gateway.config import GatewayConfig
from llmserve.protos import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from llmserve.scheduler.config import SchedulerConfig
from llmserve.stack import local_stack
from llmserve.topology import free_port
from tests.factories import EOS_TOKEN_ID, TINY_VOCAB, sampling
from tests.stack import ROOT, Stack, start_echo_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

STRANGER = (("authorization", "Bearer not-the-token"),)


@pytest.fixture(scope="module")
def stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_echo_stack(tokenizer_dir, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64")
    yield s
    s.close()


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def submit(prompt: list[int], **sampling_fields: Any) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt,
        max_tokens=4,
        sampling=common_pb2.SamplingParams(**sampling_fields),
    )


def plan_stealing(block_ids: list[int]) -> engine_pb2.StepPlan:
    """A plan that points a new request at someone's KV blocks to read them back."""
    return engine_pb2.StepPlan(
        step_id=1,
        new_requests=[
            engine_pb2.NewRequest(
                seq_id=99, token_ids=[1], num_prompt_tokens=1, block_table=block_ids,
                num_computed_tokens=0, num_scheduled_tokens=1,
            )
        ],
    )  # fmt: skip


def test_strangers_cannot_drive_the_engine_or_the_scheduler(stack: Stack) -> None:
    for metadata in ((), STRANGER):
        with grpc.insecure_channel(stack.engine_address, options=CHANNEL_OPTIONS) as channel:
            engine = engine_pb2_grpc.EngineStub(channel)
            describe = engine.Describe.future(engine_pb2.DescribeRequest(), metadata=metadata)
            assert code_of(describe.result) == grpc.StatusCode.UNAUTHENTICATED
            step = engine.Step(iter([plan_stealing([0, 1, 2])]), metadata=metadata)
            assert code_of(step.__iter__().__next__) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(stack.scheduler_address, options=CHANNEL_OPTIONS) as channel:
            scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
            stream = scheduler.Submit(submit([1, 2, 3]), metadata=metadata)
            assert code_of(stream.__iter__().__next__) == grpc.StatusCode.UNAUTHENTICATED
            stats = scheduler.GetStats.future(scheduler_pb2.GetStatsRequest(), metadata=metadata)
            assert code_of(stats.result) == grpc.StatusCode.UNAUTHENTICATED
    # Health probes stay open; the stack itself (holding the token) still serves.
    assert check_health(stack.engine_address) == "SERVING"
    assert check_health(stack.scheduler_address) == "SERVING"
    with stack.client() as client:
        assert client.generate(make_request(text="abc", max_tokens=3)).completion_tokens == 3
    assert stack.assert_idle().num_engine_resets == 0


def test_a_second_step_stream_is_refused_not_swapped_in(stack: Stack) -> None:
    token = stack.engine.peer_metadata()
    with grpc.insecure_channel(stack.engine_address, options=CHANNEL_OPTIONS) as channel:
        step = engine_pb2_grpc.EngineStub(channel).Step(iter([plan_stealing([0])]), metadata=token)
        assert code_of(lambda: list(step)) == grpc.StatusCode.ALREADY_EXISTS
    with stack.client() as client:
        assert client.generate(make_request(text="abc", max_tokens=3)).completion_tokens == 3
    assert stack.assert_idle().num_engine_resets == 0  # the scheduler kept its stream


@pytest.mark.parametrize(
    ("fields", "prompt", "expected"),
    [
        ({"logprobs": True, "top_logprobs": -1}, [1, 2], "sampling.top_logprobs=-1"),
        ({"temperature": float("nan")}, [1, 2], "sampling.temperature=nan"),
        ({"top_p": 0.0}, [1, 2], "sampling.top_p=0.0"),
        ({}, [1, TINY_VOCAB], f"prompt_token_ids contains {TINY_VOCAB}"),
    ],
)
def test_the_scheduler_checks_submit_as_strictly_as_the_gateway(
    stack: Stack, fields: dict[str, Any], prompt: list[int], expected: str
) -> None:
    """A peer holding the token but skipping the gateway gets the gateway's answer, and the
    engine never sees the request (no reset, no failed step)."""
    with grpc.insecure_channel(stack.scheduler_address, options=CHANNEL_OPTIONS) as channel:
        stream = scheduler_pb2_grpc.SchedulerStub(channel).Submit(
            submit(prompt, **fields), metadata=stack.scheduler.peer_metadata()
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (err.value.details() or "")
    bad_stop = submit([1, 2])
    bad_stop.stop_token_ids.append(TINY_VOCAB + 5)
    with grpc.insecure_channel(stack.scheduler_address, options=CHANNEL_OPTIONS) as channel:
        stream = scheduler_pb2_grpc.SchedulerStub(channel).Submit(
            bad_stop, metadata=stack.scheduler.peer_metadata()
        )
        assert code_of(lambda: list(stream)) == grpc.StatusCode.INVALID_ARGUMENT
    assert stack.assert_idle().num_engine_resets == 0


# -- the engine trusts no plan ----------------------------------------------------------------


def new_request(seq_id: int, tokens: list[int], blocks: list[int], **fields: Any) -> Any:
    from llmserve.common.step_plan import NewRequest

    params = sampling(**fields) if "raw" not in fields else fields["raw"]
    return NewRequest(seq_id, tokens, len(tokens), params, blocks, 0, len(tokens))


def test_one_bad_request_fails_alone_not_the_batch() -> None:
    """A new request the engine cannot run (a sampling value out of range, a token outside the
    vocabulary) is refused with its reason; the rest of the step runs, later rows of it sample
    nothing, and the scheduler's 'finished' for it is taken quietly."""
    from llmserve.common.step_plan import RunningColumns

    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=16), EchoEngineConfig(100))
    bad_params = common_pb2.SamplingParams(temperature=1.0, logprobs=True, top_logprobs=-1)
    plan = StepPlanData(1, [], [
        new_request(1, [5, 6], [0]),
        new_request(2, [5, 6], [1], raw=bad_params),
        new_request(3, [7, 500], [2]),
    ])  # fmt: skip
    out = engine.step(plan)
    assert out.sampled_token_ids == [5, -1, -1]
    assert out.refused_seq_ids == [2, 3]
    assert "sampling.top_logprobs=-1" in out.refusal_reasons[0]
    assert "token id 500 is outside the vocabulary [0, 100)" in out.refusal_reasons[1]
    # Planned before the scheduler heard: 2 and 3 run on (overlap) and sample nothing.
    out = engine.step(StepPlanData(2, [], [], RunningColumns([1, 2, 3], [1, 1, 1], [2, 2, 2],
                                                           [0, 0, 0], [])))  # fmt: skip
    assert out.sampled_token_ids == [6, -1, -1] and out.refused_seq_ids == []
    out = engine.step(StepPlanData(3, [2, 3], [], RunningColumns([1], [1], [3], [1], [3])))
    assert out.sampled_token_ids == [5] and engine.mirror.refused == set()


def test_a_block_twice_in_one_table_is_a_mismatch() -> None:
    from llmserve.common.step_plan import RunningColumns
    from llmserve.engine.contract.mirror import MirrorMismatch

    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=16))
    with pytest.raises(MirrorMismatch, match="appears twice"):
        engine.step(StepPlanData(1, [], [new_request(1, [1] * 6, [3, 3])]))
    engine.reset()
    engine.step(StepPlanData(1, [], [new_request(1, [1, 2, 3, 4], [3])]))
    with pytest.raises(MirrorMismatch, match="appears twice"):
        engine.step(StepPlanData(2, [], [], RunningColumns([1], [1], [4], [1], [3])))


def test_the_scheduler_fails_a_refused_request_with_its_reason() -> None:
    """The refusal reaches the request's stream as INVALID_ARGUMENT; everyone else goes on."""
    import asyncio

    asyncio.run(_refused_request())


async def _refused_request() -> None:
    import asyncio

    from llmserve.scheduler.scheduler import Scheduler
    from llmserve.scheduler.service.engine_link import SentStep
    from llmserve.scheduler.service.service import SchedulerService

    service = SchedulerService(SchedulerConfig())
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    service.scheduler = Scheduler(config, 16, 4, 64, 100, (99,))
    from llmserve.scheduler.request import Request

    good = Request("good", 1, [1, 2], sampling(), 3)
    bad = Request("bad", 2, [1, 2], sampling(), 3)
    for request in (good, bad):
        service.scheduler.add(request)
        service.streams[request.seq_id] = asyncio.Queue()
    plan = service.scheduler.schedule()

    class Call:
        async def read(self) -> engine_pb2.StepResult:
            return engine_pb2.StepResult(
                step_id=plan.step_id, sampled_token_ids=[7, -1], refused_seq_ids=[2],
                refusal_reasons=["token id 500 is outside the vocabulary [0, 100)"],
            )  # fmt: skip

    await service.link._read_result(service.scheduler, Call(), SentStep(plan, 0.0, 0.0))
    outcome = service.streams[2].get_nowait()
    assert outcome.error == "token id 500 is outside the vocabulary [0, 100)"
    assert service.streams[1].get_nowait().token_id == 7
    assert list(service.scheduler.requests) == [1]
    assert service.scheduler.finished_seq_ids == [2]  # the engine drops it with the next plan


# -- binding and exposure ---------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = str(s.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("service", ["engine", "scheduler"])
def test_internal_services_bind_loopback_by_default(service: str, tmp_path: Path) -> None:
    outside = _non_loopback_address()
    if outside is None:
        pytest.skip("this machine has no non-loopback address to try")
    port = free_port()
    argv = [service, "--port", str(port), "--metrics-port", "0"]
    argv += ["--fake"] if service == "engine" else []
    env = {**os.environ, "LLMSERVE_INTERNAL_TOKEN": "t"}
    log = open(tmp_path / "log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", *argv], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    try:
        if service == "engine":
            assert wait_until_serving(f"127.0.0.1:{port}", timeout=60), (
                tmp_path / "log"
            ).read_text()
        else:  # NOT_SERVING without an engine, but listening
            assert _answers(f"127.0.0.1:{port}")
        assert not _answers(f"{outside}:{port}", timeout=2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _answers(address: str, timeout: float = 30.0) -> bool:
    """Whether anything answers gRPC health at address within timeout (NOT_SERVING counts)."""
    import time

    deadline = time.monotonic() + timeout
    while check_health(address, timeout=0.5) == "UNAVAILABLE":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _log(directory: Path) -> str:
    return (directory / "log").read_text()


@pytest.mark.parametrize("service", ["engine", "scheduler"])
def test_exposing_an_internal_service_needs_the_token(service: str) -> None:
    argv = [service, "--host", "0.0.0.0", "--port", str(free_port()), "--metrics-port", "0"]
    argv += ["--fake"] if service == "engine" else []
    env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_INTERNAL_TOKEN"}
    out = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "host=0.0.0.0 exposes an internal service without --internal-token" in out.stderr
    assert "Traceback" not in out.stderr


# -- mutual TLS between hosts -----------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> dict[str, str]:
    """A CA, and a certificate it signs for localhost (each service presents the same one)."""
    run = lambda *a: _openssl(*a, cwd=directory)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=llmserve-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
        "-subj", "/CN=localhost")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    files = {"tls_cert": "node.pem", "tls_key": "node.key", "tls_ca": "ca.pem"}
    return {k: str(directory / v) for k, v in files.items()}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_on_the_internal_links(tokenizer_dir: Path, tmp_path: Path) -> None:
    tls = make_certificates(tmp_path)
    fake = EchoEngineConfig(vocab_size=TINY_VOCAB, eos_token_ids=(EOS_TOKEN_ID,))
    s = local_stack(
        replace(EngineConfig(), **tls),
        replace(SchedulerConfig(), **tls),
        replace(GatewayConfig(model=str(tokenizer_dir)), **tls),
        fake=fake,
        log_dir=tmp_path / "logs",
    )
    # TLS alone is enough to be exposed: with mutual TLS no stranger gets in either.
    s.engine, s.scheduler, s.gateway = (
        replace(c, internal_token=None) for c in (s.engine, s.scheduler, s.gateway)
    )
    try:
        s.start()
        s.wait_ready(60)
        from llmserve.client import Client

        with Client(s.gateway_address) as client:
            assert client.generate(make_request(text="abc", max_tokens=3)).completion_tokens == 3
        with grpc.insecure_channel(s.engine_address) as channel:  # plaintext: no handshake
            describe = engine_pb2_grpc.EngineStub(channel).Describe
            assert code_of(lambda: describe(engine_pb2.DescribeRequest(), timeout=5)) in (
                grpc.StatusCode.UNAVAILABLE,
            )
        ca_only = grpc.ssl_channel_credentials(Path(tls["tls_ca"]).read_bytes())
        with grpc.secure_channel(s.engine_address, ca_only) as channel:  # no client certificate
            describe = engine_pb2_grpc.EngineStub(channel).Describe
            assert code_of(lambda: describe(engine_pb2.DescribeRequest(), timeout=5)) in (
                grpc.StatusCode.UNAVAILABLE,
            )
    finally:
        s.stop()
