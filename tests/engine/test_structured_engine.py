"""Structured output in the engine, in-process: the real Scheduler driving the real Engine (a
tiny random model with the byte-level tokenizer, so every byte is a token and the model's own
preferences are arbitrary: only the grammar makes its output valid). Each constrained output
must parse and validate; greedy outputs must be identical one step at a time, two steps in
flight, under preemption (a tight pool) and with speculative decoding (ngram); unconstrained
requests batched with constrained ones must give the tokens they give alone."""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from llmserve.bench.byte_tokenizer import EOS_TOKEN_ID
from llmserve.common.step_plan import GrammarCompile
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.contract.mirror import ScheduledSeq, SeqState
from llmserve.engine.features.grammar import Grammars
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import ChoiceList, StructuredOutput
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import sampling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["x", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" num ("+" num){0,2} ")"\nnum ::= [1-9] [0-9]?'


def constraints() -> list[tuple[StructuredOutput, Callable[[str], None]]]:
    """Each constraint and the check its whole output must pass."""

    def schema_check(schema: dict[str, Any]) -> Callable[[str], None]:
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def matches(pattern: str) -> Callable[[str], None]:
        return lambda text: _assert(re.fullmatch(pattern, text) is not None, text)

    return [
        (StructuredOutput(json_schema=json.dumps(PERSON)), schema_check(PERSON)),
        (StructuredOutput(json_schema=json.dumps(POINTS)), schema_check(POINTS)),
        (StructuredOutput(regex=REGEX), matches(REGEX)),
        (StructuredOutput(choice=ChoiceList(choices=CHOICES)), lambda t: _assert(t in CHOICES, t)),
        (StructuredOutput(grammar=GRAMMAR), matches(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)")),
    ]


def _assert(ok: bool, text: str) -> None:
    assert ok, text


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def engines(model: Path) -> dict[str, Engine]:
    common = {"model": str(model), "device": "cpu", "num_kv_blocks": 96, "block_size": 4}
    return {
        "plain": Engine(EngineConfig(**common, max_num_seqs=16)),
        "ngram": Engine(
            EngineConfig(
                **common, max_num_seqs=16, speculative_method="ngram", num_speculative_tokens=3
            )
        ),
    }


def requests(
    items: list[tuple[StructuredOutput | None, dict[str, Any]]], max_tokens: int = 48
) -> list[Request]:
    out = []
    for i, (so, fields) in enumerate(items):
        params = sampling(**fields) if so is None else sampling(structured_output=so, **fields)
        prompt = [(i * 31 + j * 7) % 200 + 3 for j in range(6 + i % 5)]
        out.append(Request(f"r{i}", i + 1, prompt, params, max_tokens=max_tokens))
    return out


def serve(
    engine: Engine,
    reqs: list[Request],
    depth: int = 1,
    num_blocks: int = 0,
    on_step: Callable[[Scheduler], None] | None = None,
) -> dict[int, list[int]]:
    """Run reqs through a Scheduler and engine, up to depth steps in flight; num_blocks: give
    the scheduler fewer blocks than the engine holds (a tight pool: preemptions); on_step: called
    after each result is applied."""
    engine.reset()
    info = engine.info
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64).adopt(info.max_num_seqs, 64),
        num_blocks or info.num_blocks,
        info.block_size,
        info.max_model_len,
        info.vocab_size,
        info.eos_token_ids,
        num_speculative_tokens=info.num_speculative_tokens,
    )
    for r in reqs:
        s.add(r)
    outputs: dict[int, list[int]] = {r.seq_id: [] for r in reqs}
    in_flight: deque[tuple[Any, Any]] = deque()
    for _ in range(5000):
        if not s.has_work and not in_flight:
            return outputs
        if len(in_flight) < depth and s.has_work:
            plan = s.schedule()
            if not plan.is_empty:
                in_flight.append((plan, engine.launch(plan_from_proto(plan_to_proto(plan)))))
                continue
        assert in_flight, "nothing in flight and nothing to plan"
        plan, step = in_flight.popleft()
        out = engine.finish(step)
        s.grammars_compiled(out.compiled_seq_ids)
        s.grammar_dead_ends(out.dead_end_seq_ids)
        drafts = out.num_draft_tokens or None
        update = s.update(
            plan, out.sampled_token_ids, out.logprobs, None, out.num_sampled_tokens or None, drafts
        )
        for o in update:
            outputs[o.request.seq_id].append(o.token_id)
        s.block_manager.check_integrity(list(s.requests.values()))
        if on_step is not None:
            on_step(s)
    raise AssertionError("did not finish")


def text_of(tokens: list[int]) -> str:
    """The byte tokenizer's text of an output that ended with EOS."""
    assert tokens and tokens[-1] == EOS_TOKEN_ID, f"no EOS at the end: {tokens}"
    return bytes(tokens[:-1]).decode()


def check_all(outputs: dict[int, list[int]], checks: dict[int, Callable[[str], None]]) -> None:
    for seq_id, check in checks.items():
        check(text_of(outputs[seq_id]))


def test_constrained_outputs_valid_and_equal_across_settings(engines: dict[str, Engine]) -> None:
    """Every kind of constraint, greedy and seeded (temperature 1), and n = 2 (two requests of
    one constraint, different seeds: each its own matcher): valid under every setting, and the
    same tokens under all of them."""
    items: list[tuple[StructuredOutput | None, dict[str, Any]]] = []
    checks: dict[int, Callable[[str], None]] = {}
    for so, check in constraints():
        for fields in (
            {"temperature": 0.0},
            {"temperature": 1.0, "seed": 3},
            {"temperature": 1.0, "seed": 4},
        ):
            items.append((so, fields))
            checks[len(items)] = check
    runs: dict[str, dict[int, list[int]]] = {}
    tight: list[Request] = []
    for name, engine, depth, blocks in (
        ("one step", "plain", 1, 0),
        ("overlap", "plain", 2, 0),
        ("tight pool", "plain", 1, 40),
        ("tight pool, overlap", "plain", 2, 40),
        ("ngram", "ngram", 1, 0),
    ):
        reqs = requests(items)
        runs[name] = serve(engines[engine], reqs, depth, blocks)
        check_all(runs[name], checks)
        if blocks:
            tight += reqs
    assert sum(r.num_preemptions for r in tight) > 0, "the tight pool preempted nothing"
    first = runs["one step"]
    for name, outputs in runs.items():
        assert outputs == first, name
    # the seeded pairs (n = 2) drew different outputs, each valid
    assert any(first[i + 2] != first[i + 3] for i in range(0, len(items), 3))


def test_free_requests_unchanged_by_constrained_neighbours(engines: dict[str, Engine]) -> None:
    """16 requests, 8 constrained: the 8 free ones give exactly the tokens they give alone."""
    engine = engines["plain"]
    cs = constraints()
    items: list[tuple[StructuredOutput | None, dict[str, Any]]] = []
    for i in range(16):
        so = cs[i % len(cs)][0] if i % 2 else None
        items.append((so, {"temperature": 0.0} if i % 4 < 2 else {"temperature": 0.8, "seed": i}))
    mixed = serve(engine, requests(items, max_tokens=24), depth=2)
    free_only = [r for i, r in enumerate(requests(items, max_tokens=24)) if i % 2 == 0]
    alone = serve(engine, free_only, depth=2)
    for i in range(0, 16, 2):
        assert mixed[i + 1] == alone[i + 1], f"free request {i}"
    for i in range(1, 16, 2):  # the constrained ones that finished within 24 tokens are valid
        if mixed[i + 1][-1] == EOS_TOKEN_ID:
            cs[i % len(cs)][1](text_of(mixed[i + 1]))


def test_max_tokens_mid_object_ends_by_length(engines: dict[str, Engine]) -> None:
    """A constrained request that runs out of tokens ends with what it made, a prefix of valid
    output (the scheduler's length finish), not EOS."""
    engine = engines["plain"]
    so = StructuredOutput(json_schema=json.dumps(PERSON))
    [r] = requests([(so, {"temperature": 0.0})], max_tokens=5)
    out = serve(engine, [r])[1]
    assert len(out) == 5 and EOS_TOKEN_ID not in out
    assert bytes(out).decode().startswith("{")


def test_grammar_with_no_allowed_token_ends_with_eos(model: Path) -> None:
    """A request whose generated tokens the grammar refuses (a peer sent them, or a recompute of
    a request the grammar cannot follow) gets a mask of EOS alone: it ends, never a NaN draw."""
    grammars = Grammars(model, 259, (EOS_TOKEN_ID,))
    so = StructuredOutput(regex="[0-9]+")
    seq = SeqState(1, [5, 6, ord("x")], 2, sampling(structured_output=so), [0], 2)
    job = grammars.start_masks([ScheduledSeq(seq, 2, 1, True)])
    assert job is not None
    positions, bitmask = job.result()
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:259])
    assert positions == [0] and allowed.tolist() == [EOS_TOKEN_ID]
    # a well-formed one allows the digits only
    seq = SeqState(2, [5, 6, ord("7")], 2, sampling(structured_output=so), [0], 2)
    _, bitmask = grammars.start_masks([ScheduledSeq(seq, 2, 1, True)]).result()  # type: ignore[union-attr]
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:259])
    assert set(allowed.tolist()) == {*range(ord("0"), ord("9") + 1), EOS_TOKEN_ID}
    grammars.close()


def test_a_slow_compile_holds_only_its_request(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar whose compile takes long (held here until the free request is done) keeps only
    its own request waiting, off the step path: the unconstrained request beside it runs to its
    end meanwhile (were the compile in a step, that step would wait for it, and the release
    below would never come), then the constrained one is admitted and gives valid output."""
    engine = engines["plain"]
    release = threading.Event()
    compile_ = engine.grammars._compile

    def slow_compile(key: tuple[str, str]) -> Any:
        assert release.wait(30), "the free request did not finish while the compile waited"
        return compile_(key)

    monkeypatch.setattr(engine.grammars, "_compile", slow_compile)
    so = StructuredOutput(regex="[x-z]{3}!")  # compiled nowhere before: not cached
    free, held = requests([(None, {"temperature": 0.0}), (so, {"temperature": 0.0})], 8)
    seen: list[tuple[bool, int]] = []

    def on_step(s: Scheduler) -> None:
        seen.append((held.seq_id in s.grammar_wait.held, len(s.running)))
        if free.status.is_finished:
            release.set()

    outputs = serve(engine, [free, held], depth=2, on_step=on_step)
    assert len(outputs[free.seq_id]) == 8
    held_steps = [num_running for is_held, num_running in seen if is_held]
    assert sum(n > 0 for n in held_steps) >= 7, seen  # the free request stepped meanwhile
    assert re.fullmatch(r"[x-z]{3}!", text_of(outputs[held.seq_id]))


def test_compiles_ahead_report_compiled_and_refused(model: Path) -> None:
    """The plan's grammar_compiles: each is reported once, compiled or (a constraint the
    library refuses: a peer that skipped the gateway's check) refused with its reason; a step
    with nothing else waits a little for the first to end."""
    grammars = Grammars(model, 259, (EOS_TOKEN_ID,))
    grammars.start_compiles(
        [
            GrammarCompile(7, StructuredOutput(regex="[0-9]{2}")),
            GrammarCompile(8, StructuredOutput(regex="a(b")),
        ]
    )
    done: list[int] = []
    refused: list[tuple[int, str]] = []
    for _ in range(200):
        compiled, failed = grammars.take_compiled(wait_s=0.05)
        done += compiled
        refused += failed
        if not grammars.has_pending:
            break
    assert done == [7] and [seq_id for seq_id, _ in refused] == [8]
    assert "does not compile" in refused[0][1] and "group" in refused[0][1]
    assert grammars.take_compiled() == ([], [])  # each reported once
    grammars.close()


def test_a_dead_end_while_decoding_ends_with_its_own_finish_reason(
    engines: dict[str, Engine],
) -> None:
    """A grammar whose start compiles but that leads nowhere after "ab" (its `x` derives no text:
    the gateway's check cannot see it from the start state): the engine forces EOS and reports
    the dead end, and the scheduler ends the request with FINISHED_GRAMMAR_DEAD_END, not "stop",
    keeping the valid text; its free neighbour is untouched, with or without speculation."""
    so = StructuredOutput(grammar='root ::= "ab" x\nx ::= x "c"')
    for name, engine in engines.items():
        reqs = requests([(so, {}), (None, {})], max_tokens=12)
        outputs = serve(engine, reqs, depth=2)
        assert reqs[0].status == RequestStatus.FINISHED_GRAMMAR_DEAD_END, name
        assert bytes(outputs[1][:2]) == b"ab" and len(outputs[1]) <= 3, (name, outputs[1])
        assert reqs[1].status != RequestStatus.FINISHED_GRAMMAR_DEAD_END and len(outputs[2]) >= 1
