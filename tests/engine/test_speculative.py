"""Speculative decoding: the scheduler's lookahead slots, rollback and blocks given back (with the
echo engine, in process, through the real contract), the n-gram proposer, the back-off policy,
greedy identity on the built-in model through the whole stack, and a chi-square test that
sampling at temperature 1 keeps the target's distribution."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig
from llmserve.engine.features.proposer import ngram_match
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.speculation import FIRST_BACKOFF_STEPS, MIN_ACCEPTANCE, SpeculationPolicy
from tests.factories import sampling
from tests.spec_driver import Driven, drive, make_scheduler_for, plan_from_proto, plan_to_proto

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

BS = 4
VOCAB = 100
EOS = 99


def echo_engine(k: int, num_blocks: int = 64, max_model_len: int = 256) -> EchoEngine:
    config = EngineConfig(block_size=BS, num_kv_blocks=num_blocks, max_model_len=max_model_len)
    fake = EchoEngineConfig(vocab_size=VOCAB, eos_token_ids=(EOS,), num_speculative_tokens=k)
    return EchoEngine(config, fake)


def request(seq_id: int, prompt: list[int], max_tokens: int, **fields: object) -> Request:
    return Request(f"req-{seq_id}", seq_id, prompt, sampling(), max_tokens, **fields)  # type: ignore[arg-type]


def echo(prompt: list[int], n: int) -> list[int]:
    """The echo engine's first n outputs for prompt."""
    return [prompt[i % len(prompt)] for i in range(n)]


PROMPTS = [[(7 * s + i) % 90 + 1 for i in range(5 + 3 * s)] for s in range(6)]


def run_echo(k: int, max_tokens: int = 30, num_blocks: int = 64, **config: object) -> Driven:
    engine = echo_engine(k, num_blocks)
    scheduler = make_scheduler_for(engine, **config)
    requests = [request(i + 1, p, max_tokens) for i, p in enumerate(PROMPTS)]
    run = drive(scheduler, engine, requests)
    run.spec = scheduler.counters.spec  # type: ignore[attr-defined]
    return run


# -- the scheduler's side, with the echo engine ---------------------------------------------------


def test_echo_speculation_same_tokens_fewer_steps() -> None:
    plain, spec = run_echo(0), run_echo(4)
    expected = {i + 1: echo(p, 30) for i, p in enumerate(PROMPTS)}
    assert plain.outputs == expected
    assert spec.outputs == expected
    assert set(spec.finished.values()) == {RequestStatus.FINISHED_LENGTH}
    # The echo's proposals are wrong at output indices 2, 5, 8, ...: each verification accepts
    # up to the next such index, so decoding takes about a third of the steps.
    assert spec.num_steps < 0.5 * plain.num_steps
    counters = spec.spec  # type: ignore[attr-defined]
    assert 0 < counters.num_spec_accepted_tokens < counters.num_spec_draft_tokens
    per_pos = counters.num_spec_accepted_tokens_per_pos
    assert sum(per_pos) == counters.num_spec_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position j accepted only after j - 1
    assert counters.num_spec_draft_tokens_per_pos[0] == counters.num_spec_rows


def test_lookahead_slots_rollback_and_blocks_given_back() -> None:
    """One request, block size 4, 4 lookahead slots, prompt of 6 tokens:

    step 1: prefill 6 tokens, output 0 (2 blocks).
    step 2: decode token 6 + 4 slots (positions 7-10: 3 blocks); proposals for outputs 1-4,
            wrong at 2: accepts output 1, samples output 2. Tokens 9 = 6 + 3, computed 8:
            rolled back from the 11 the slots covered; 3 blocks needed, 3 kept.
    step 3: decode token 8 + 4 slots (9-12: 4 blocks); proposals for outputs 3-6, wrong at 5:
            accepts 3 and 4, samples 5. Tokens 12, computed 11; 3 blocks needed: the 4th is
            given back."""
    engine = echo_engine(4)
    scheduler = make_scheduler_for(engine)
    prompt = [1, 2, 3, 4, 5, 6]
    r = request(1, prompt, 20)
    scheduler.add(r)
    steps = []
    for _ in range(3):
        plan = scheduler.schedule()
        lookahead = [row.num_lookahead_tokens for row in plan.running]
        free_planned = scheduler.block_manager.num_free_blocks
        out = engine.step(plan_from_proto(plan_to_proto(plan)))
        scheduler.update(
            plan,
            out.sampled_token_ids,
            num_sampled_tokens=out.num_sampled_tokens or None,
            num_draft_tokens=out.num_draft_tokens or None,
        )
        steps.append(
            (lookahead, len(r.token_ids), r.num_computed_tokens, len(r.block_table), free_planned)
        )
        assert engine.mirror.seqs[1].block_table == r.block_table
    total = scheduler.block_manager.num_blocks
    assert steps == [
        ([], 7, 6, 2, total - 2),
        ([4], 9, 8, 3, total - 3),
        ([4], 12, 11, 3, total - 4),
    ]
    assert r.token_ids == [*prompt, *echo(prompt, 6)]
    assert scheduler.block_manager.num_free_blocks == total - 3
    scheduler.abort(1)
    scheduler.block_manager.check_integrity([])


def test_lookahead_bounded_by_max_tokens_and_budget() -> None:
    engine = echo_engine(8)
    scheduler = make_scheduler_for(engine, max_num_batched_tokens=6)
    r = request(1, [1, 2, 3], 4)
    scheduler.add(r)
    plan = scheduler.schedule()  # prefill
    scheduler.update(plan, [1])
    plan = scheduler.schedule()
    # 3 outputs left: at most 2 proposals (the step returns one token more); budget 6 allows 5.
    assert [row.num_lookahead_tokens for row in plan.running] == [2]
    scheduler.abort(1)
    r2 = request(2, [1, 2, 3], 50)
    scheduler.add(r2)
    plan = scheduler.schedule()
    scheduler.update(plan, [1])
    plan = scheduler.schedule()
    assert [row.num_lookahead_tokens for row in plan.running] == [5]  # budget 6 - 1 decode


def test_eos_mid_bundle_drops_the_tokens_after_it() -> None:
    """The echo of a prompt holding EOS stops there, even when it arrives with tokens after it
    in one verification."""
    prompt = [1, 2, 3, 4, EOS, 6, 7]
    plain = drive(*_echo_pair(0), [request(1, prompt, 30)])
    spec = drive(*_echo_pair(4), [request(1, prompt, 30)])
    assert plain.outputs == spec.outputs == {1: [1, 2, 3, 4, EOS]}
    assert spec.finished == {1: RequestStatus.FINISHED_STOPPED}


def _echo_pair(k: int, num_blocks: int = 64) -> tuple[object, EchoEngine]:
    engine = echo_engine(k, num_blocks)
    return make_scheduler_for(engine), engine


def test_disable_speculation_gets_no_lookahead() -> None:
    scheduler, engine = _echo_pair(4)
    off = request(1, PROMPTS[0], 10, disable_speculation=True)
    run = drive(scheduler, engine, [off])  # type: ignore[arg-type]
    assert run.outputs == {1: echo(PROMPTS[0], 10)}
    # A prefill, 9 decode steps, and a plan that only drops the finished request.
    assert run.num_steps == 11
    assert scheduler.counters.spec.num_spec_rows == 0  # type: ignore[attr-defined]


def test_preemption_with_speculation_same_tokens() -> None:
    """6 requests in 12 blocks of 4 tokens: preempted and recomputed, lookahead never causing a
    preemption of its own, the same tokens as without speculation; every block free at the end."""
    plain = run_echo(0, max_tokens=20, num_blocks=12)
    spec = run_echo(4, max_tokens=20, num_blocks=12)
    assert plain.outputs == spec.outputs == {i + 1: echo(p, 20) for i, p in enumerate(PROMPTS)}


def test_speculation_refused_with_pipeline_stages_and_static_batching() -> None:
    engine = echo_engine(4)
    scheduler = make_scheduler_for(engine)
    with pytest.raises(ValueError, match="pipeline_parallel_size=1, not 2"):
        scheduler.set_pipeline_parallel_size(2)
        scheduler.set_num_speculative_tokens(4)
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.scheduler import Scheduler

    with pytest.raises(ValueError, match="static' does not support speculative decoding"):
        Scheduler(
            SchedulerConfig(scheduling_policy="static", max_num_seqs=4, max_num_batched_tokens=8),
            16, 4, 64, VOCAB, (EOS,), num_speculative_tokens=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs a single-rank engine"):
        EngineConfig(speculative_method="ngram", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 must be in \[1, 16\]"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)


def test_backoff_when_acceptance_is_low() -> None:
    policy = SpeculationPolicy(4)
    r = request(1, [1, 2], 100)
    assert policy.lookahead(r, 10) == 4
    policy.on_result(r, 4, 0)  # average 0.5
    assert policy.lookahead(r, 10) == 4
    policy.on_result(r, 4, 0)  # average 0.25 < MIN_ACCEPTANCE: back off
    assert [policy.lookahead(r, 10) for _ in range(FIRST_BACKOFF_STEPS + 1)] == [0] * 8 + [4]
    policy.on_result(r, 4, 0)  # the probe fails: twice as long
    assert [policy.lookahead(r, 10) for _ in range(2 * FIRST_BACKOFF_STEPS + 1)] == [0] * 16 + [4]
    policy.on_result(r, 4, 3)  # the probe succeeds: back at once
    assert r.spec.acceptance >= MIN_ACCEPTANCE
    assert policy.lookahead(r, 10) == 4
    policy.on_result(r, 0, 0)  # nothing proposed: nothing learned
    assert policy.lookahead(r, 2) == 2


# -- the n-gram proposer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the 3-gram [1, 2, 3] matched
        ([1, 2, 3, 4, 9, 2, 3, 7, 2, 3], 2, [7, 2]),  # the latest earlier match of [2, 3]
        ([1, 2, 3, 4, 5, 9, 7, 3], 3, []),  # [7, 3] never occurred before
        ([256, 1, 0, 0, 1, 256], 2, []),  # byte patterns across token boundaries do not count
        ([5, 5, 5, 5], 3, [5]),  # only what exists after the match
    ],
)
def test_ngram_match(tokens: list[int], k: int, expected: list[int]) -> None:
    assert ngram_match(tokens, k, 2, 4) == expected


# -- the real engine ----------------------------------------------------------------------------


def _engine(model: Path, method: str = "none", **fields: object) -> object:
    from llmserve.engine.step.engine import Engine

    config = EngineConfig(
        model=str(model), device="cpu", num_kv_blocks=512, seed=7, max_num_seqs=256,
        speculative_method=method, **fields,  # type: ignore[arg-type]
    )  # fmt: skip
    return Engine(config)


def _chi_square_critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square distribution's quantile at 1 - 0.001 (z: the normal's), Wilson-Hilferty's
    approximation (within 1% for dof >= 3)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _homogeneity(a: Counter[int], b: Counter[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square statistic for "a and b are samples of one distribution" over their
    tokens, tokens expected fewer than min_expected times in either pooled into one bin; and
    its degrees of freedom."""
    n_a, n_b = sum(a.values()), sum(b.values())
    bins: list[tuple[int, int]] = []
    rest = [0, 0]
    for t in sorted(set(a) | set(b)):
        pooled = a[t] + b[t]
        if pooled * min(n_a, n_b) / (n_a + n_b) >= min_expected:
            bins.append((a[t], b[t]))
        else:
            rest[0] += a[t]
            rest[1] += b[t]
    if sum(rest):
        bins.append((rest[0], rest[1]))
    stat = 0.0
    for x, y in bins:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return stat, len(bins) - 1


def test_temperature_one_distribution_unchanged(
    tiny_model: Callable[..., Path], one_torch_thread: None
) -> None:
    """At temperature 1 (unseeded), outputs 1-3 of 3000 requests decoded with proposals (3 per
    step) against 3000 without: per output index, Pearson's chi-square test of homogeneity of
    the token counts (tokens expected < 5 times in a sample pooled into one bin) stays under
    its 0.999 quantile, so a correct implementation fails once in 1000 runs per index.

    The proposer is the draft with all of the model's layers: it proposes the greedy tokens,
    which the peaked model (larger weights than tiny_model's default) samples often but not
    always, so many proposals are accepted and many rejected (both asserted) and both branches
    of the verification shape the counts. (A random model's own text never repeats itself, so
    n-grams would propose nothing it says; the verification is the same for every proposer.)"""
    model = tiny_model(num_heads=4, num_kv_heads=2, initializer_range=1.0)
    prompt = [10, 20, 30, 40, 50]
    n = 3000
    counts = {}
    for method in ("none", "draft"):
        engine = _engine(model, method, num_speculative_tokens=3, draft_num_layers=2)
        scheduler = make_scheduler_for(engine, max_num_batched_tokens=4096)
        requests = [request(i + 1, prompt, 5, ignore_eos=True) for i in range(n)]
        run = drive(scheduler, engine, requests)
        counts[method] = [Counter(run.outputs[i + 1][j] for i in range(n)) for j in (1, 2, 3)]
        if method == "draft":
            spec = scheduler.counters.spec
            assert spec.num_spec_rows >= n, spec
            accepted, draft = spec.num_spec_accepted_tokens, spec.num_spec_draft_tokens
            assert 0.1 * draft < accepted < 0.9 * draft, spec
    for j in range(3):
        stat, dof = _homogeneity(counts["none"][j], counts["draft"][j])
        assert dof >= 3, f"output {j + 1}: too few tokens to test ({dof} degrees of freedom)"
        assert stat < _chi_square_critical(dof), f"output {j + 1}: chi-square {stat:.1f}, {dof} dof"


def test_temperature_seeded_and_penalties_same_tokens_in_process(
    builtin_model_path: Path, one_torch_thread: None
) -> None:
    """Seeded sampling (top-k, top-p, penalties, logprobs) gives the same tokens and logprobs
    with proposals as without: each position draws with its (seed, output index) key."""
    from llmserve.gateway.tokenizer import Tokenizer

    # A list to copy: the sampled tokens repeat the prompt's n-grams, so proposals are made
    # and verified (a prompt of repeated special tokens drew none at this temperature)
    prompt = Tokenizer.from_model_path(builtin_model_path).encode(COPY_PROMPTS[0])
    params = sampling(
        temperature=0.8, top_k=40, top_p=0.9, seed=11, frequency_penalty=0.3, logprobs=True
    )
    runs, spec_rows = {}, {}
    engine = _engine(builtin_model_path, "ngram")  # one engine: "none" turns it off per request
    for method in ("none", "ngram"):
        scheduler = make_scheduler_for(engine)
        r = Request("r", 1, prompt, params, 24, ignore_eos=True)
        r.disable_speculation = method == "none"
        runs[method] = drive(scheduler, engine, [r])
        spec_rows[method] = scheduler.counters.spec.num_spec_rows
        engine.reset()
    assert spec_rows["none"] == 0 and spec_rows["ngram"] > 0
    assert runs["ngram"].outputs == runs["none"].outputs
    # The built-in model's CPU default (GGUF blocks, engine/model/gguf_linear.py) rounds activations
    # to int16 per block of 32, which turns the ~1e-6 float differences between a verification's
    # multi-row attention and a one-row decode into a rounding step here and there: logprobs
    # agree to 1e-3 (float32 or int8 weights: to 1e-5), the tokens exactly
    for a, b in zip(runs["ngram"].logprobs[1], runs["none"].logprobs[1], strict=True):
        assert a == pytest.approx(b, abs=1e-3)


# -- the whole stack, the built-in model ----------------------------------------------------------

COPY_PROMPTS = [
    f"Repeat this list exactly: {', '.join(f'item {j + i}' for j in range(6))}. "
    f"Repeat: {', '.join(f'item {j + i}' for j in range(2))}"
    for i in range(16)
]
STACK_MAX_TOKENS = 16  # ngram accepts on these prompts within a few steps; 24 blocks still preempt


def _stack_requests(disable_speculation: bool = False) -> list[object]:
    from llmserve.client import make_request

    return [
        make_request(
            text=p, max_tokens=STACK_MAX_TOKENS, temperature=0.0, ignore_eos=True,
            disable_speculation=disable_speculation,
        )
        for p in COPY_PROMPTS
    ]  # fmt: skip


def _generate(stack: object, requests: list[object], concurrent: bool) -> list[list[int]]:
    with stack.client() as client:  # type: ignore[attr-defined]
        if not concurrent:
            return [list(client.generate(r).token_ids) for r in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            return [list(c.token_ids) for c in pool.map(client.generate, requests)]


def _speculating_stack(
    model: Path, num_kv_blocks: int, log_dir: Path, tree_width: int = 1
) -> object:
    from tests.stack import start_stack

    return start_stack(
        model,
        engine_args=[
            "--num-kv-blocks", str(num_kv_blocks), "--speculative-method", "ngram",
            "--num-speculative-tokens", "4", "--speculative-tree-width", str(tree_width),
        ],
        log_dir=log_dir,
    )  # fmt: skip


@pytest.fixture(scope="module")
def roomy_stack(builtin_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """n-gram speculation with token trees of width 3 and 512 blocks: room for every request
    at once."""
    stack = _speculating_stack(builtin_model_path, 512, tmp_path_factory.mktemp("logs"), 3)
    yield stack
    stack.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def greedy_baseline(roomy_stack: object) -> list:
    """The 16 prompts' greedy tokens with speculation off (each request's
    disable_speculation: the engine's plain decode path, as a stack without speculation runs
    it), 16 at once: the test below holds speculation's tokens to these both one at a time and
    16 at once (batch invariance without speculation: tests/system/test_stack_model.py)."""
    return _generate(roomy_stack, _stack_requests(disable_speculation=True), concurrent=True)


@pytest.mark.parametrize("num_kv_blocks", [512, 24])
def test_greedy_identity_through_the_stack(
    builtin_model_path: Path,
    roomy_stack: object,
    greedy_baseline: list,
    num_kv_blocks: int,
    tmp_path: Path,
) -> None:
    """Greedy with n-gram speculation, alone and 16 at once: with 512 blocks as token trees of
    width 3 (--speculative-tree-width), with 24 blocks of 16 tokens for ~50-token requests
    (preemptions forced) as chains: token for token what the stack gives without it;
    proposals accepted; every block free after."""
    roomy = num_kv_blocks == 512
    stack = roomy_stack if roomy else _speculating_stack(builtin_model_path, 24, tmp_path)
    try:
        before = stack.stats()  # type: ignore[attr-defined]
        assert before.num_spec_rows == 0  # the baseline ran without speculation
        requests = _stack_requests()
        if roomy:
            assert _generate(stack, requests, concurrent=False) == greedy_baseline
        assert _generate(stack, requests, concurrent=True) == greedy_baseline
        stats = stack.assert_idle()  # type: ignore[attr-defined]
        assert stats.num_spec_accepted_tokens > 0
        assert (stats.num_preemptions > 0) == (not roomy)
    finally:
        if not roomy:
            stack.close()  # type: ignore[attr-defined]


# -- the whole stack, the echo engine: HTTP, gRPC, stop strings, n > 1, /metrics ------------------


def test_echo_stack_http_grpc_stop_strings_and_metrics(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The echo engine speculating (4 proposals a step, every third wrong) behind the real
    scheduler and gateway: the OpenAI body's `disable_speculation` and gRPC's give the same
    text, with no verification for the requests that turned it off; a stop string inside a
    verified bundle ends the text before it; n = 2 choices each get the whole echo; the
    scheduler's /metrics carry the acceptance counts by position and the two gauges; every
    block is free after."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    from llmserve.client import make_request
    from tests.stack import free_port, start_echo_stack

    port = free_port()
    stack = start_echo_stack(
        tokenizer_dir, tmp_path, "--fake-num-speculative-tokens", "4",
        scheduler=("--metrics-port", str(port)), http=True,
    )  # fmt: skip
    try:
        prompt = "abcdefghijklmnopqrstuvwxyz"
        body = {"model": "x", "prompt": prompt, "max_tokens": 20, "ignore_eos": True}
        url = f"{stack.http_url}/completions"
        off = httpx2.post(url, json={**body, "disable_speculation": True}).json()
        assert off["choices"][0]["text"] == prompt[:20]
        assert stack.stats().num_spec_rows == 0
        on = httpx2.post(url, json={**body, "n": 2}).json()
        assert [c["text"] for c in on["choices"]] == [prompt[:20]] * 2
        rows = stack.stats().num_spec_rows
        assert rows > 0
        stopped = httpx2.post(url, json={**body, "stop": ["klm"]}).json()
        assert stopped["choices"][0]["text"] == prompt[:10]
        with stack.client() as client:
            request = make_request(text=prompt, max_tokens=20, ignore_eos=True)
            assert client.generate(request).text == prompt[:20]
            request.disable_speculation = True
            before = stack.stats().num_spec_rows
            assert client.generate(request).text == prompt[:20]
            assert stack.stats().num_spec_rows == before
        stats = stack.assert_idle()
        metrics_body = httpx2.get(f"http://127.0.0.1:{port}/metrics").text
        samples = {
            (s.name, s.labels.get("position")): s.value
            for family in text_string_to_metric_families(metrics_body)
            for s in family.samples
        }
        assert samples[("llmserve_spec_decode_verifications_total", None)] == stats.num_spec_rows
        for j, (draft, accepted) in enumerate(
            zip(
                stats.num_spec_draft_tokens_per_pos,
                stats.num_spec_accepted_tokens_per_pos,
                strict=True,
            )
        ):
            assert samples[("llmserve_spec_decode_draft_tokens_total", str(j))] == draft
            assert samples[("llmserve_spec_decode_accepted_tokens_total", str(j))] == accepted
        rate = stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens
        assert samples[("llmserve_spec_decode_acceptance_rate", None)] == pytest.approx(rate)
        length = 1 + stats.num_spec_accepted_tokens / stats.num_spec_rows
        assert samples[("llmserve_spec_decode_mean_accepted_length", None)] == pytest.approx(length)
    finally:
        stack.close()
