"""Prefill / decode disaggregation through the whole stack, as `llmserve serve --prefill-engines 1
--decode-engines 1` starts it, on the built-in model: greedy tokens identical to one engine's
(the prompt in chunks on the prefill engine, a prefix hit on both sides), and the failure paths:
a transfer connection dropped half-way, a cancel mid-transfer and kill -9 of the prefill engine
mid-transfer each lose no request and leave no block held on either side (the scheduler's stats).
One stack for the module; faults are switched on in the running prefill engine through
LLMSERVE_KV_TRANSFER_FAULT=@file (engine/kv/disaggregation.py)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.bench.otlp import OtlpReceiver
from llmserve.client import make_request
from llmserve.engine.kv.disaggregation import FAULT_ENV
from tests.stack import Stack, free_port, start_stack
from tests.system.test_telemetry import _scrape, _total

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

MAX_TOKENS = 5
SYSTEM = (
    "The history of the city of Rome spans more than two and a half thousand years, from a "
    "small settlement on the Tiber to the capital of an empire that ruled the Mediterranean."
)
TAILS = [" The first emperor was", " Its aqueducts carried"]
# The failure tests' prompts share no block with any other: each has a transfer to fail.
OPENINGS = [
    "The Senate was an assembly of elders.",
    "The Colosseum was built of stone.",
    "Latin, its language, spread far.",
    "The river Tiber floods in spring.",
    "Roads ran from the city to every province.",
    "Bread and games kept the crowds quiet.",
]
# The kill -9 of the decode engine needs a request still decoding: more tokens for it.
DECODE_KILLED, LONGER = 6, 16
PROMPTS = [SYSTEM + t for t in TAILS] + [o + " " + SYSTEM for o in OPENINGS]
ENGINE_ARGS = [
    "--device", "cpu", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32",
    "--max-num-seqs", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-fault") / "fault"


@pytest.fixture(scope="module")
def pd(
    tmp_path_factory: pytest.TempPathFactory, fault_file: Path, builtin_model_path: Path
) -> Iterator[tuple[Stack, list[list[int]], OtlpReceiver]]:
    """The stack (exporting spans to a receiver), started on a thread while this process makes
    the reference: each prompt's greedy tokens from one engine here (the whole prompt in one
    step, one request at a time)."""
    receiver = OtlpReceiver().start()
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(
            start_stack,
            engine_args=ENGINE_ARGS,
            scheduler_args=["--kv-transfer-timeout-s", "1", "--metrics-port", str(free_port())],
            env={FAULT_ENV: f"@{fault_file}", "OMP_NUM_THREADS": "1", **otlp},
            log_dir=tmp_path_factory.mktemp("pd-logs"),
            prefill_engines=1,
            timeout=180,
        )
        reference = one_engine_tokens(builtin_model_path)
        s = starting.result()
    yield s, reference, receiver
    s.close()
    receiver.stop()


@pytest.fixture
def stack(pd: tuple[Stack, list[list[int]], OtlpReceiver]) -> Stack:
    return pd[0]


@pytest.fixture
def reference(pd: tuple[Stack, list[list[int]], OtlpReceiver]) -> list[list[int]]:
    return pd[1]


@pytest.fixture
def spans(pd: tuple[Stack, list[list[int]], OtlpReceiver]) -> OtlpReceiver:
    return pd[2]


def one_engine_tokens(model_path: Path) -> list[list[int]]:
    import torch

    from llmserve.bench.engine_driver import generate
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine
    from llmserve.gateway.tokenizer import Tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(device="cpu", num_kv_blocks=16, max_num_seqs=1))
        prompts = [Tokenizer.from_model_path(model_path).encode(p) for p in PROMPTS]
        assert all(len(p) > 32 for p in prompts)  # chunked at 32 tokens, and over two blocks
        counts = [LONGER if i == DECODE_KILLED else MAX_TOKENS for i in range(len(prompts))]
        return [generate(engine, [p], n)[0] for p, n in zip(prompts, counts, strict=True)]
    finally:
        torch.set_num_threads(threads)


def ask(stack: Stack, i: int) -> list[int]:
    request = make_request(PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return list(stack.client().generate(request, timeout=60).token_ids)


def first_token_then(stack: Stack, i: int, max_tokens: int = MAX_TOKENS):  # type: ignore[no-untyped-def]
    """Start request i; return its call once its first token (the prefill engine's) arrived."""
    request = make_request(PROMPTS[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    call = stack.client().start(request, timeout=60)
    first = next(iter(call))
    assert len(first.token_ids) >= 1
    return call, list(first.token_ids)


def test_greedy_tokens_match_one_engine(
    stack: Stack, reference: list[list[int]], spans: OtlpReceiver
) -> None:
    before = stack.stats()
    assert ask(stack, 0) == reference[0]
    assert ask(stack, 1) == reference[1]  # the system prompt: a prefix hit on both sides
    s = stack.assert_idle()
    # The first moved its prompt's full blocks; the second's were in the decode pool already.
    assert s.num_kv_transfers_done - before.num_kv_transfers_done == 1
    assert s.num_prefix_cache_hit_tokens > before.num_prefix_cache_hit_tokens
    assert s.kv_transfer_bytes > 0 and sum(s.num_kv_transfers_failed.values()) == 0
    # /metrics: the transfer done, its time and bandwidth, the bytes moved (as GetStats counts)
    sc = _scrape(stack.scheduler.metrics_port)
    assert _total(sc, "llmserve_kv_transfer_transfers_total", outcome="done") == 1
    assert _total(sc, "llmserve_kv_transfer_duration_seconds_count") == 1
    assert _total(sc, "llmserve_kv_transfer_bandwidth_bytes_per_second_count") == 1
    assert _total(sc, "llmserve_kv_transfer_bytes_total") == s.kv_transfer_bytes
    # OTLP: the transfer's span, under its request's
    assert spans.wait_for(lambda got: any(x.name == "scheduler.transfer" for x in got))
    (span,) = [x for x in spans.spans if x.name == "scheduler.transfer"]
    assert span.attributes["llmserve.outcome"] == "done"
    assert span.attributes["llmserve.num_bytes"] == s.kv_transfer_bytes
    assert span.end_ns > span.start_ns


def test_a_dropped_transfer_recomputes_on_the_decode_side(
    stack: Stack, reference: list[list[int]], fault_file: Path
) -> None:
    fault_file.write_text("drop")
    try:
        t0 = time.monotonic()
        assert ask(stack, 2) == reference[2]
        assert time.monotonic() - t0 < 5
    finally:
        fault_file.unlink()
    s = stack.assert_idle()
    assert s.num_kv_transfers_failed["dropped"] == 1  # reported at once, not at the deadline


def test_a_cancel_mid_transfer_frees_both_sides(stack: Stack, fault_file: Path) -> None:
    fault_file.write_text("stall")
    try:
        call, _ = first_token_then(stack, 3)
        stack.wait_for_stats(lambda s: s.num_transferring == 1)
        call.cancel()
        s = stack.wait_for_stats(lambda s: s.num_kv_transfers_failed["cancelled"] == 1)
    finally:
        fault_file.unlink()
    assert s.num_transferring == 0
    stack.assert_idle()


def test_kill_9_of_the_decode_engine_mid_decode_loses_nothing(
    stack: Stack, reference: list[list[int]]
) -> None:
    call, tokens = first_token_then(stack, DECODE_KILLED, LONGER)
    stream = iter(call)
    while len(tokens) < 3:  # the first from the prefill engine, then the decode engine's
        tokens += next(stream).token_ids
    stack.kill("engine")
    t0 = time.monotonic()
    tokens += next(stream).token_ids  # the prefill engine took it over
    assert time.monotonic() - t0 < 5
    tokens += [t for msg in stream for t in msg.token_ids]
    assert tokens == reference[DECODE_KILLED]
    assert not stack.stats().decode_ready
    assert ask(stack, 7) == reference[7]  # while it is gone: the prefill engine does both
    stack.start(("engine",))  # back for the next test
    stack.wait_for_stats(lambda s: s.decode_ready, timeout=120)
    stack.assert_idle()


def test_kill_9_of_the_prefill_engine_mid_transfer_loses_nothing(
    stack: Stack, reference: list[list[int]], fault_file: Path
) -> None:
    failed = stack.stats().num_kv_transfers_failed
    fault_file.write_text("stall")
    call, first = first_token_then(stack, 4)
    stack.wait_for_stats(lambda s: s.num_transferring == 1)
    t0 = time.monotonic()
    stack.kill("engine-prefill")
    rest = [t for msg in call for t in msg.token_ids]
    assert time.monotonic() - t0 < 5
    assert first + rest == reference[4]  # the first token once, the rest recomputed
    fault_file.unlink()
    assert ask(stack, 5) == reference[5]  # while it is gone: the decode engine does both
    s = stack.assert_idle()
    # Given up when the link to the prefill engine broke, or at its deadline if that came first
    # (an idle link notices the loss at its next step or heartbeat).
    lost = ("prefill_lost", "deadline")
    assert sum(s.num_kv_transfers_failed[k] - failed[k] for k in lost) == 1
