"""Gateway + scheduler over real gRPC, with the model-free echo engine (engine/contract/echo.py).

The echo engine returns the prompt's tokens cyclically, and the test tokenizer has one token per
byte, so a test controls the streamed text exactly by choosing the prompt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmserve.client import make_request
from llmserve.stack import FRONT_NICE
from tests.factories import EOS_TOKEN_ID
from tests.stack import Stack, StreamWatch, start_echo_stack, wait_mid_stream

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)


@pytest.fixture(scope="module")
def stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        "--fake-step-delay-ms",
        "5",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
    )
    yield s
    s.close()


def echo(prompt: str, n: int) -> str:
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


def test_stream_echoes_prompt_with_whole_characters(stack: Stack) -> None:
    prompt = "héllo 🤖 世界 ok"
    n = len(prompt.encode()) * 2
    chunks = []
    with stack.client() as client:
        for msg in client.stream(make_request(text=prompt, max_tokens=n)):
            chunks.append(msg)
    text = "".join(m.text for m in chunks)
    assert text == echo(prompt, n)
    assert all("\ufffd" not in m.text for m in chunks)
    # A 4-byte emoji arrives as four tokens but in one chunk, never split.
    assert any(m.text == "🤖" or "🤖" in m.text for m in chunks)
    assert sum(len(m.token_ids) for m in chunks) == n
    last = chunks[-1]
    assert last.finish_reason and last.usage.completion_tokens == n
    assert last.usage.prompt_tokens == len(prompt.encode())
    stack.assert_idle()


def test_stop_string_is_not_streamed_and_aborts_upstream(stack: Stack) -> None:
    with stack.client() as client:
        result = client.generate(
            make_request(text="abc STOP def", max_tokens=100, stop=["STOP", "zzz"])
        )
    assert result.text == "abc "
    assert result.finish_reason == "stop"
    assert result.completion_tokens < 100
    stack.assert_idle(timeout=2)


def test_stop_token_id_and_eos(stack: Stack) -> None:
    with stack.client() as client:
        # "b" is token 98: stops there, and the stop token itself is reported.
        result = client.generate(make_request(text="abcd", max_tokens=50, stop_token_ids=[98]))
        assert result.token_ids == [97, 98] and result.finish_reason == "stop"
        # The echo of an EOS token (<|im_end|> in the prompt text) ends the request...
        result = client.generate(make_request(text="x<|im_end|>", max_tokens=50))
        assert result.token_ids == [120, EOS_TOKEN_ID] and result.finish_reason == "stop"
        assert result.text == "x"
        # ...unless EOS is ignored.
        result = client.generate(make_request(text="x<|im_end|>", max_tokens=5, ignore_eos=True))
        assert len(result.token_ids) == 5 and result.finish_reason == "length"
    stack.assert_idle()


def test_cancel_frees_blocks_within_a_step(stack: Stack) -> None:
    with stack.client() as client:
        call = client.stub.Generate(make_request(text="cancel me " * 8, max_tokens=400))
        for i, _ in enumerate(call):
            if i == 3:
                break
        assert stack.stats().num_running == 1
        call.cancel()
    stack.assert_idle(timeout=1.0)


def test_invalid_requests_refused_while_others_run(stack: Stack) -> None:
    bad = {
        "temperature": make_request(text="hi", temperature=-1.0),
        "top_p": make_request(text="hi", top_p=0.0),
        "top_k": make_request(text="hi", top_k=-2),
        "max_tokens": make_request(text="hi", max_tokens=0),
        "text": make_request(text=""),
        "prompt": make_request(),
        "role": make_request(messages=[("wizard", "hi")]),
        "stop_token_ids": make_request(text="hi", stop_token_ids=[10_000]),
        "remaining context": make_request(text="hi", max_tokens=10_000),
    }
    with stack.client() as client:
        steady = StreamWatch(client, make_request(text="steady", max_tokens=400), at_least=1)
        wait_mid_stream([steady])
        for field, request in bad.items():
            with pytest.raises(grpc.RpcError) as err:
                client.generate(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in err.value.details(), (field, err.value.details())
        at_last_refusal = steady.num_tokens
        result = steady.result(timeout=30)
    assert at_last_refusal < 400, "the steady request ended before the refusals did"
    assert result.finish_reason == "length"
    assert result.text == echo("steady", 400)
    stack.assert_idle()


def test_nan_temperature_refused(stack: Stack) -> None:
    with stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(make_request(text="hi", temperature=float("nan")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature=nan" in err.value.details()


GROUP_127 = b"\xfb\x07"  # start of group, field 127: unknown to GenerateRequest


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x0a\x03a\xffb", "String field had bad UTF-8"),  # text = b"a\xffb"
        (b"\x18" + b"\xff" * 11, "Wire format was corrupt"),  # max_tokens: an 11-byte varint
        (b"\x0a\x10abc", "Wire format was corrupt"),  # text of 16 bytes, 3 sent
        (GROUP_127 * 200_000, "Wire format was corrupt"),  # groups nested 200,000 deep
    ],
)
def test_malformed_grpc_request_is_invalid_argument(stack: Stack, data: bytes, why: str) -> None:
    """Bytes that do not parse as a GenerateRequest: INVALID_ARGUMENT saying so, not UNKNOWN
    with a Python class name; the gateway goes on serving."""
    with grpc.insecure_channel(stack.gateway_address) as channel:
        generate = channel.unary_stream(
            "/llmserve.api.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(generate(data, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"request is not a valid GenerateRequest: {why}"
    with stack.client() as client:
        assert client.generate(make_request(text="ok", max_tokens=2)).text == "ok"


def test_many_concurrent_streams(stack: Stack) -> None:
    prompts = [f"request number {i}: " + "x" * i for i in range(24)]
    with stack.client() as client, ThreadPoolExecutor(24) as pool:
        results = list(
            pool.map(lambda p: client.generate(make_request(text=p, max_tokens=40)), prompts)
        )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.text == echo(prompt, 40)
    stack.assert_idle()


def test_queue_full_is_resource_exhausted(tokenizer_dir: Path, tmp_path: Path) -> None:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path,
        "--fake-step-delay-ms",
        "20",
        scheduler=("--max-num-seqs", "1", "--max-waiting", "1"),
    )
    try:
        codes: list[grpc.StatusCode | None] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                with s.client() as client:
                    client.generate(make_request(text=f"q{i}", max_tokens=20))
                code = None
            except grpc.RpcError as err:
                code = err.code()
                assert "queue full" in err.details()
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        assert codes.count(None) >= 2
        s.assert_idle()
    finally:
        s.close()


def test_one_step_in_flight_without_overlap(tokenizer_dir: Path, tmp_path: Path) -> None:
    """--no-overlap-scheduling (one step in flight) streams the same tokens, stops included."""
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path,
        "--fake-step-delay-ms",
        "2",
        scheduler=("--no-overlap-scheduling", "--max-num-batched-tokens", "16"),
    )
    try:
        prompts = [f"one at a time {i}: " + "y" * i for i in range(8)]
        with s.client() as client, ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(lambda p: client.generate(make_request(text=p, max_tokens=30)), prompts)
            )
            stopped = client.generate(make_request(text="abcd", max_tokens=50, stop_token_ids=[99]))
        for prompt, result in zip(prompts, results, strict=True):
            assert result.text == echo(prompt, 30)
        assert stopped.token_ids == [97, 98, 99] and stopped.finish_reason == "stop"
        s.assert_idle()
    finally:
        s.close()


def test_pipeline_stages_keep_two_steps_in_flight(tokenizer_dir: Path, tmp_path: Path) -> None:
    """An echo engine of 2 pipeline stages (a 20 ms step, 10 ms a stage) behind a scheduler
    without overlap: the scheduler still keeps 2 steps in flight, one per pipeline slot, so 8
    requests (split over both slots) stream the same tokens as ever and take about as long as
    one request alone; one step at a time would take twice as long. The echo engine refuses a
    plan that shares a request with a step in flight, so no engine reset means none did."""
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path,
        "--fake-step-delay-ms",
        "20",
        "--fake-pipeline-parallel-size",
        "2",
        scheduler=("--no-overlap-scheduling",),
    )
    try:
        n = 40
        prompts = [f"pipelined {i}: " for i in range(8)]
        with s.client() as client, ThreadPoolExecutor(8) as pool:
            t0 = time.perf_counter()
            alone = client.generate(make_request(text="alone", max_tokens=n))
            t1 = time.perf_counter()
            results = list(
                pool.map(lambda p: client.generate(make_request(text=p, max_tokens=n)), prompts)
            )
            t2 = time.perf_counter()
        assert alone.text == echo("alone", n)
        for prompt, result in zip(prompts, results, strict=True):
            assert result.text == echo(prompt, n)
        t_alone, t_eight = t1 - t0, t2 - t1
        assert t_alone > n * 0.020  # a step's result comes 20 ms after it starts
        assert t_eight < 1.4 * t_alone, f"8 requests took {t_eight:.3f} s, 1 took {t_alone:.3f} s"
        stats = s.assert_idle()
        assert stats.num_engine_resets == 0
    finally:
        s.close()


def test_engine_crash_loses_nothing(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Kill the engine once every request has streamed some tokens, and start a new one: every
    request still completes with exactly the right tokens, none duplicated, none missing."""
    s = start_echo_stack(tokenizer_dir, tmp_path, "--fake-step-delay-ms", "10")
    try:
        prompts = [f"survivor {i} " for i in range(6)]
        with s.client() as client:
            watches = [
                StreamWatch(client, make_request(text=p, max_tokens=80), at_least=10)
                for p in prompts
            ]
            wait_mid_stream(watches)
            s.kill_engine()
            at_kill = [w.num_tokens for w in watches]
            s.wait_for_stats(lambda stats: stats.num_engine_resets == 1)  # the loss was seen
            s.start_engine()
            results = [w.result(timeout=60) for w in watches]
        assert all(10 <= n < 80 for n in at_kill), at_kill
        for prompt, result in zip(prompts, results, strict=True):
            assert result.text == echo(prompt, 80)
            assert len(result.token_ids) == 80
        stats = s.assert_idle()
        assert stats.num_engine_resets == 1
    finally:
        s.close()


def test_scheduler_adopts_the_engine_limits_and_refuses_larger_ones(tmp_path: Path) -> None:
    """A scheduler without limits of its own takes the engine's (which sized its memory and
    CUDA graphs); one asking for more than the engine's refuses to run, saying which."""
    import grpc

    from llmserve.common.net import CHANNEL_OPTIONS, wait_until_serving
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.contract.echo import EchoEngineConfig
    from llmserve.protos import scheduler_pb2, scheduler_pb2_grpc
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.stack import local_stack

    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)
    for own, expected in ((SchedulerConfig(), (4, 64)), (SchedulerConfig(max_num_seqs=2), (2, 64))):
        stack = local_stack(engine, own, fake=EchoEngineConfig(), log_dir=tmp_path / "ok")
        stack.start(("engine", "scheduler"))
        try:
            assert wait_until_serving(stack.scheduler_address, timeout=60), stack.logs()
            with grpc.insecure_channel(stack.scheduler_address, options=CHANNEL_OPTIONS) as ch:
                info = scheduler_pb2_grpc.SchedulerStub(ch).GetInfo(
                    scheduler_pb2.GetInfoRequest(), metadata=stack.scheduler.peer_metadata()
                )
            assert (info.max_num_seqs, info.max_num_batched_tokens) == expected
        finally:
            stack.stop()
    bad = SchedulerConfig(max_num_seqs=8)
    stack = local_stack(engine, bad, fake=EchoEngineConfig(), log_dir=tmp_path / "bad")
    stack.start(("engine", "scheduler"))
    try:
        assert stack.procs["scheduler"].wait(timeout=60) == 1
        log = (tmp_path / "bad" / "scheduler.log").read_text()
        assert "max_num_seqs=8 exceeds the engine's max_num_seqs=4" in log
    finally:
        stack.stop()


def test_front_services_yield_to_an_engine_on_the_cpu(stack: Stack) -> None:
    """Beside an engine on the CPU the scheduler and gateway run at FRONT_NICE, so their
    per-token wake-ups wait for a gap instead of preempting one of the engine's threads; the
    engine keeps 0 (issue 42, docs/quantization.md)."""
    want = FRONT_NICE if stack.engine_on_cpu() else 0
    nice = {
        name: int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        for name, proc in stack.procs.items()
    }
    assert nice == {"engine": 0, "scheduler": want, "gateway": want}
