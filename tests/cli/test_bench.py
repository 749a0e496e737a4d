"""`llmserve bench`: the statistics against hand-computed values, the arrival processes' rates and
spreads, seeded workloads of exact lengths, the result document, the OpenAI backend against a
small fake SSE server, and runs against the real stack (echo engine; a tiny random Llama for
`bench offline` and the static batching policy)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmserve.bench.arrivals import ArrivalConfig, arrival_offsets, gamma_gaps
from llmserve.bench.backends import OpenAIBackend, SamplingConfig, sse_events
from llmserve.bench.compare import compare
from llmserve.bench.metrics import (
    RequestRecord,
    parse_goodput,
    percentile,
    summarize,
)
from llmserve.bench.report import (
    DISTRIBUTIONS,
    SCALARS,
    STATS,
    fmt,
    format_run,
    result_document,
    run_entry,
)
from llmserve.bench.runner import run_benchmark
from llmserve.bench.workload import (
    SHAREGPT_MAX_INPUT_LEN,
    SHAREGPT_MAX_TOTAL_LEN,
    SHAREGPT_MIN_LEN,
    BenchRequest,
    WorkloadConfig,
    build_workload,
)
from llmserve.gateway.tokenizer import ChatMessage, Tokenizer
from tests.stack import ROOT, Stack, start_echo_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

# -- statistics on synthetic timings --------------------------------------------------------------


def synthetic_records() -> list[RequestRecord]:
    """Three completed requests and two refused ones; times in seconds.

    request  start  chunks at (tokens)          end   TTFT  TPOT                 ITL
    0        0.0    0.1 (1), 0.3 (2), 0.4 (1)   0.5   0.1   (0.5-0.1)/3 = 0.1333 0.2, 0.1
    1        0.2    0.2 (1), 0.5 (1)            0.6   0.2   (0.6-0.2)/1 = 0.4    0.3
    2        0.3    0.05 (1)                    0.1   0.05  -                    -
    3        0.4    refused RESOURCE_EXHAUSTED after 0.01
    4        1.0    refused HTTP 429 at once
    """
    return [
        RequestRecord(0, 10, 4, 0.0, chunk_times_s=[0.1, 0.3, 0.4], chunk_num_tokens=[1, 2, 1],
                      latency_s=0.5),
        RequestRecord(1, 20, 2, 0.2, chunk_times_s=[0.2, 0.5], chunk_num_tokens=[1, 1],
                      latency_s=0.6),
        RequestRecord(2, 30, 3, 0.3, chunk_times_s=[0.05], chunk_num_tokens=[1], latency_s=0.1),
        RequestRecord(3, 40, 5, 0.4, status="RESOURCE_EXHAUSTED", error="queue full",
                      latency_s=0.01),
        RequestRecord(4, 50, 5, 1.0, status="HTTP 429", latency_s=0.0),
    ]  # fmt: skip


def test_summary_matches_hand_computed_values() -> None:
    m = summarize(synthetic_records(), {"ttft": 150, "tpot": 300})
    approx = pytest.approx
    assert (m["num_requests"], m["num_completed"], m["num_failed"]) == (5, 3, 2)
    assert m["num_short_outputs"] == 1  # request 2: 1 of 3 tokens
    assert m["duration_s"] == approx(1.0)  # the last request's end
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 7)  # completed only
    assert m["request_throughput"] == approx(3.0)
    assert m["input_throughput"] == approx(60.0)
    assert m["output_throughput"] == approx(7.0)
    assert m["total_token_throughput"] == approx(67.0)
    # Good: 0 (TTFT 100, TPOT 133) and 2 (TTFT 50, one token so TPOT 0); 1 misses TTFT (200).
    assert (m["num_good_requests"], m["goodput"]) == (2, approx(2.0))
    assert m["max_in_flight"] == 3  # 0, 1, 2 at 0.3; at 0.4 request 2 ends as 3 starts
    assert m["ttft_ms"] == approx(
        {"mean": 350 / 3, "p50": 100.0, "p90": 180.0, "p99": 198.0, "max": 200.0}
    )
    assert m["tpot_ms"] == approx(
        {
            "mean": (400 / 3 + 400) / 2,
            "p50": (400 / 3 + 400) / 2,
            "p90": 400 / 3 + 0.9 * (400 - 400 / 3),
            "p99": 400 / 3 + 0.99 * (400 - 400 / 3),
            "max": 400.0,
        }
    )
    assert m["itl_ms"] == approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0,
                                  "max": 300.0})  # fmt: skip
    assert m["e2el_ms"] == approx({"mean": 400.0, "p50": 500.0, "p90": 580.0, "p99": 598.0,
                                   "max": 600.0})  # fmt: skip
    assert m["errors"] == {"RESOURCE_EXHAUSTED": 1, "HTTP 429": 1}
    assert summarize(synthetic_records(), {"e2el": 550})["num_good_requests"] == 2
    assert summarize(synthetic_records())["goodput"] is None


def test_empty_and_all_failed_runs_have_no_numbers_to_invent() -> None:
    m = summarize([RequestRecord(0, 5, 5, 0.0, status="UNAVAILABLE", latency_s=0.2)])
    assert (m["num_completed"], m["request_throughput"], m["errors"]) == (
        0,
        0.0,
        {"UNAVAILABLE": 1},
    )
    assert m["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert summarize([])["request_throughput"] is None


def test_percentile_is_numpys_linear_interpolation() -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_goodput_targets_are_parsed_and_checked() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 2000.0,
    }
    with pytest.raises(ValueError, match="NAME one of ttft, tpot, e2el"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="'fast' is not a number"):
        parse_goodput(["ttft:fast"])


# -- arrivals -------------------------------------------------------------------------------------


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gamma_gaps_have_the_rate_and_spread_asked(burstiness: float, cv: float) -> None:
    gaps = gamma_gaps(40_000, 8.0, burstiness, random.Random(11))
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.02)
    assert _cv(gaps) == pytest.approx(cv, rel=0.03)


def test_poisson_gaps_are_exponential() -> None:
    """Exponential gaps: P(gap <= t) = 1 - exp(-rate t), checked at a few quantiles."""
    rate = 5.0
    gaps = gamma_gaps(40_000, rate, 1.0, random.Random(5))
    for q in (0.1, 0.5, 0.9, 0.99):
        t = -math.log(1 - q) / rate
        assert sum(g <= t for g in gaps) / len(gaps) == pytest.approx(q, abs=0.01)


def test_arrival_offsets() -> None:
    config = ArrivalConfig(request_rate=20.0, seed=7)
    offsets = arrival_offsets(2000, config)
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(20.0, rel=0.05)
    assert offsets == arrival_offsets(2000, config)  # seeded
    assert offsets != arrival_offsets(2000, ArrivalConfig(request_rate=20.0, seed=8))
    assert arrival_offsets(3, ArrivalConfig()) == [0.0, 0.0, 0.0]  # rate inf: all at once
    assert ArrivalConfig.from_json(ArrivalConfig(math.inf, 1.0, 4, 2).to_json()) == ArrivalConfig(
        math.inf, 1.0, 4, 2
    )
    with pytest.raises(ValueError, match="burstiness=0"):
        ArrivalConfig(request_rate=1.0, burstiness=0)


@dataclass
class SleepBackend:
    """No server: each request takes `seconds`, with one chunk of max_tokens tokens at the end."""

    seconds: float = 0.02
    name: str = "sleep"
    sent: list[float] = field(default_factory=list)

    async def describe(self) -> dict[str, Any]:
        return {"model": "sleep"}

    async def send(self, request: BenchRequest, record: RequestRecord, sent: float) -> None:
        self.sent.append(sent)
        await asyncio.sleep(self.seconds)
        record.chunk_times_s, record.chunk_num_tokens = [self.seconds], [request.max_tokens]
        record.latency_s = self.seconds
        record.finish_reason = "length"

    async def close(self) -> None:
        pass


REQUESTS = [BenchRequest(8, 4, text="x") for _ in range(12)]


def test_runner_caps_concurrency() -> None:
    records = asyncio.run(run_benchmark(SleepBackend(), REQUESTS, ArrivalConfig(max_concurrency=3)))
    m = summarize(records)
    assert (m["num_completed"], m["max_in_flight"]) == (12, 3)
    assert 4 * 0.02 * 0.99 <= m["duration_s"] < 1.0  # at least 4 waves of 3


def test_runner_sends_on_the_arrival_schedule() -> None:
    config = ArrivalConfig(request_rate=100.0, seed=1)
    records = asyncio.run(run_benchmark(SleepBackend(0.001), REQUESTS, config))
    for record, due in zip(records, arrival_offsets(len(REQUESTS), config), strict=True):
        assert due - 1e-3 <= record.start_s <= due + 0.25  # never early; late only if busy


# -- workloads ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(builtin_model_path: Path) -> Tokenizer:
    return Tokenizer.from_model_path(builtin_model_path)


def _counted(tokenizer: Tokenizer, request: BenchRequest) -> int:
    if request.messages is not None:
        return len(tokenizer.encode_chat([ChatMessage(r, c) for r, c in request.messages]))
    assert request.text is not None
    return len(tokenizer.encode(request.text))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("dataset", ["fixed", "random", "sharegpt", "prefix"])
def test_workloads_are_seeded_and_exact(
    smollm2_tokenizer: Tokenizer, dataset: str, chat: bool
) -> None:
    config = WorkloadConfig(
        dataset=dataset,
        num_requests=24,
        input_len=40,
        output_len=16,
        range_ratio=0.5,
        num_prefixes=3,
        prefix_len=48,
        chat=chat,
        seed=3,
    )
    requests = build_workload(config, smollm2_tokenizer)
    assert len(requests) == 24
    for r in requests:
        assert _counted(smollm2_tokenizer, r) == r.num_prompt_tokens
        assert (r.messages is not None) == chat and (r.text is not None) == (not chat)
    assert build_workload(config, smollm2_tokenizer) == requests
    # Another variant (a sweep's next run): the same lengths, other words.
    other = build_workload(config, smollm2_tokenizer, variant=1)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in other] == [
        (r.num_prompt_tokens, r.max_tokens) for r in requests
    ]
    assert [r.text or r.messages for r in other] != [r.text or r.messages for r in requests]
    reseeded = build_workload(WorkloadConfig(**{**config.to_json(), "seed": 4}), smollm2_tokenizer)
    assert [r.text or r.messages for r in reseeded] != [r.text or r.messages for r in requests]


def test_workload_lengths(smollm2_tokenizer: Tokenizer) -> None:
    def lengths(**kwargs: Any) -> list[tuple[int, int]]:
        config = WorkloadConfig(num_requests=64, seed=1, **kwargs)
        return [
            (r.num_prompt_tokens, r.max_tokens) for r in build_workload(config, smollm2_tokenizer)
        ]

    assert set(lengths(dataset="fixed", input_len=33, output_len=7)) == {(33, 7)}
    pairs = lengths(dataset="random", input_len=40, output_len=20, range_ratio=0.25)
    assert all(30 <= i <= 50 and 15 <= o <= 25 for i, o in pairs)
    assert len({i for i, _ in pairs}) > 10  # spread, not constant
    for i, o in lengths(dataset="sharegpt"):
        assert SHAREGPT_MIN_LEN <= i <= SHAREGPT_MAX_INPUT_LEN and o >= SHAREGPT_MIN_LEN
        assert i + o <= SHAREGPT_MAX_TOTAL_LEN


def test_sharegpt_lengths_follow_the_fit() -> None:
    """The log of the drawn lengths is normal with the fit's mu and sigma (before the filter
    removes the far tail, which moves them a little)."""
    from llmserve.bench.workload import SHAREGPT_OUTPUT, sharegpt_lengths

    rng = random.Random(0)
    logs = [math.log(sharegpt_lengths(rng)[1]) for _ in range(20_000)]
    assert statistics.fmean(logs) == pytest.approx(SHAREGPT_OUTPUT.mu, abs=0.05)
    assert statistics.pstdev(logs) == pytest.approx(SHAREGPT_OUTPUT.sigma, abs=0.05)


def test_prefix_workload_shares_exact_prefixes(smollm2_tokenizer: Tokenizer) -> None:
    config = WorkloadConfig(dataset="prefix", num_requests=6, input_len=12, num_prefixes=2,
                            prefix_len=40)  # fmt: skip
    ids = [
        smollm2_tokenizer.encode(r.text or "") for r in build_workload(config, smollm2_tokenizer)
    ]
    assert all(len(i) == 52 for i in ids)
    assert ids[0][:40] == ids[2][:40] == ids[4][:40] != ids[1][:40]
    assert ids[1][:40] == ids[3][:40] == ids[5][:40]
    assert len({tuple(i[40:]) for i in ids}) == 6


def test_jsonl_workload(smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Tell me a story.", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "Hi"}], "output_tokens": 3},
        {"prompt": "No length given."},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    config = WorkloadConfig(dataset="jsonl", path=str(path), num_requests=4, output_len=9)
    requests = build_workload(config, smollm2_tokenizer)
    assert [r.max_tokens for r in requests] == [5, 3, 9, 5]
    assert requests[1].messages == (("user", "Hi"),) and requests[3] == requests[0]
    assert all(_counted(smollm2_tokenizer, r) == r.num_prompt_tokens for r in requests)
    path.write_text('{"text": "wrong key"}\n')
    with pytest.raises(ValueError, match=r'prompts\.jsonl:1: expected an object with "prompt"'):
        build_workload(config, smollm2_tokenizer)
    with pytest.raises(ValueError, match="dataset='nope' must be one of fixed"):
        WorkloadConfig(dataset="nope")


# -- the result document and what is printed -------------------------------------------------------


def printed_numbers_are_saved(printed: str, run: dict[str, Any]) -> None:
    """Every number in run's printed table is the saved value, formatted."""
    m = run["metrics"]
    lines = printed.splitlines()
    for label, key in SCALARS:
        if m[key] is None and key == "goodput":
            continue
        line = next(line for line in lines if line.startswith(label))
        assert line.split()[-1] == fmt(m[key]), label
    for label, key in DISTRIBUTIONS:
        line = next(line for line in lines if line.split()[0] == label)
        assert line.split()[1:] == [fmt(m[key][s]) for s in STATS], label


def test_printed_table_is_the_saved_document() -> None:
    run = run_entry(ArrivalConfig(2.0), synthetic_records(), {"ttft": 150})
    saved = json.loads(json.dumps(run))
    printed_numbers_are_saved(format_run(saved, {"ttft": 150}), saved)
    assert "errors by status: RESOURCE_EXHAUSTED 1, HTTP 429 1" in format_run(saved)
    document = result_document("serve", {"workload": {"seed": 0}}, {"model": "m"}, [run])
    assert document["llmserve_version"] and document["hardware"]["logical_cores"] >= 1
    assert document["hardware"]["cpu"] and "python" in document["hardware"]
    assert document["config"] == {"workload": {"seed": 0}}


def test_compare_reports_changes_and_setting_differences() -> None:
    runs_a = [run_entry(ArrivalConfig(2.0), synthetic_records(), None)]
    faster = synthetic_records()
    for r in faster:
        r.latency_s /= 2
        r.chunk_times_s = [t / 2 for t in r.chunk_times_s]
    runs_b = [run_entry(ArrivalConfig(2.0), faster, None)]
    a = result_document("serve", {"workload": {"num_requests": 5}}, {"model": "m"}, runs_a)
    b = result_document("serve", {"workload": {"num_requests": 6}}, {"model": "m"}, runs_b)
    text = compare(a, b, "a.json", "b.json")
    assert "config.workload.num_requests: 5 -> 6" in text
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT p50"))
    assert ttft.split()[3:] == ["100.00", "50.00", "-50.0%", "better"]
    failed = next(line for line in text.splitlines() if line.startswith("failed requests"))
    assert failed.split()[2:] == ["2", "2", "same"]


# -- bench/gpu/engine.py: the quantized runs' plumbing (issue 14), on the CPU ----------------------


def gpu_engine_result(
    quantization: str, kv_cache_dtype: str, step_ms: tuple[float, float], top1: float | None
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "gpu_engine",
        "shape": "llama-3-8b",
        "environment": {"gpu": "H200"},
        "settings": {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype},
        "decode": {
            "context_tokens": 512,
            "batch_1": {"step_ms_median": step_ms[0]},
            "batch_8": {"step_ms_median": step_ms[1]},
        },
    }
    if top1 is not None:
        result["agreement"] = {"top1": top1, "mean_kl": 0.01, "positions": 4096}
    return result


def test_gpu_engine_quant_summary_sets_each_mode_beside_bf16(tmp_path: Path) -> None:
    from bench.gpu.engine import mode_label, quant_summary, quant_table, result_path

    modes = [("auto", "auto"), ("none", "auto"), ("int8", "auto"), ("auto", "fp8"), ("fp8", "fp8")]
    labels = ["", "", "int8", "kv-fp8", "fp8_kv-fp8"]
    assert [mode_label(q, kv) for q, kv in modes] == labels
    assert result_path(tmp_path, "llama-3-8b", "none", "auto").name == "gpu_engine_llama-3-8b.json"
    runs = []
    for quantization, kv, step_ms, top1 in [
        ("auto", "auto", (10.0, 12.0), None),
        ("int8", "auto", (5.0, 8.0), 0.99),
        ("auto", "fp8", (10.0, 10.0), 0.995),
    ]:
        path = result_path(tmp_path, "llama-3-8b", quantization, kv)
        path.write_text(json.dumps(gpu_engine_result(quantization, kv, step_ms, top1)))
        runs.append(path)
    broken = tmp_path / "gpu_engine_llama-3-8b_fp8.json"  # a run cut off by its timeout
    broken.write_text(json.dumps({**gpu_engine_result("fp8", "auto", (1, 1), None),
                                  "decode": {"error": "RuntimeError: boom"}}))  # fmt: skip
    summary = quant_summary([tmp_path / "missing.json"], sorted([*runs, broken]))
    assert summary["baseline"]["file"] == str(runs[0])
    assert summary["modes"]["int8"]["decode"]["batch_1"]["tok_s_vs_bf16"] == 2.0
    assert summary["modes"]["int8"]["decode"]["batch_8"]["tok_s_vs_bf16"] == 1.5
    assert summary["modes"]["kv-fp8"]["agreement"]["top1"] == 0.995
    assert summary["modes"]["fp8"]["decode"] == {}
    text = quant_table(json.loads(json.dumps(summary)))
    lines = {line.split()[0]: line for line in text.splitlines()}
    assert "b1 10.00 ms = 100 tok/s" in lines["bf16"]
    assert "b1 5.00 ms = 200 tok/s (2.00x)" in lines["int8"] and "top-1 99.00%" in lines["int8"]
    assert "b8 10.00 ms = 800 tok/s (1.20x)" in lines["kv-fp8"]
    assert "decode: RuntimeError: boom" in lines["fp8"]
    assert "no activation outliers" in lines["note:"]


def test_gpu_engine_decode_floor_counts_quantized_bytes() -> None:
    """bf16: every weight but the untied embedding table's unread rows, as before; int8 / fp8
    weights halve the linear layers' bytes (the LM head's too), an fp8 pool the KV bytes."""
    from bench.gpu.engine import decode_floor_bytes
    from llmserve.common.model_config import load_model_config
    from llmserve.engine.model.dummy import hf_tensor_shapes

    config = load_model_config(Path(__file__).parents[2] / "configs" / "llama-3-8b")
    shapes = hf_tensor_shapes(config)
    params = sum(math.prod(s) for s in shapes.values())
    embed = math.prod(shapes["model.embed_tokens.weight"])
    bf16 = decode_floor_bytes("llama-3-8b", 8, 512)
    assert bf16["weights"] == (params - embed + 8 * config.hidden_size) * 2
    int8 = decode_floor_bytes("llama-3-8b", 8, 512, 2, 1, 2)
    norms = sum(math.prod(s) for n, s in shapes.items() if n.endswith("norm.weight"))
    assert int8["weights"] == bf16["weights"] - (params - embed - norms)
    assert int8["kv"] == bf16["kv"] == 8 * 512 * 32 * 2 * 8 * 128 * 2
    assert decode_floor_bytes("llama-3-8b", 8, 512, 2, 2, 1)["kv"] == bf16["kv"] // 2


def test_gpu_engine_decode_floor_reads_the_experts_a_step_hits() -> None:
    """Qwen3-30B-A3B (128 experts, top-8): batch 1 reads 8 experts a layer, the model card's
    3.3 B active parameters (which count the whole embedding table, where a step reads its
    rows); a large batch reads nearly all 30.5 B."""
    from bench.gpu.engine import decode_floor_bytes

    table = 151936 * 2048

    def params(batch: int) -> float:
        return decode_floor_bytes("qwen3-30b-a3b", batch, 0)["weights"] / 2 + table

    assert abs(params(1) / 3.3e9 - 1) < 0.03
    assert abs(params(512) / 30.5e9 - 1) < 0.01
    assert params(1) < params(8) < 8 * params(1)


def test_gpu_engine_decode_floor_kv_of_latents_and_windows() -> None:
    """DeepSeek-V2-Lite's shape reads one 576-value latent row per token and layer (27 layers);
    gpt-oss-20b's 12 sliding layers read their 128-token window, its 12 full layers the whole
    context (8 KV heads of 64, K and V); both shapes come near their published sizes at
    batch 512 (15.7 B and 20.9 B, the embedding table's unread rows aside)."""
    from bench.gpu.engine import decode_floor_bytes

    assert decode_floor_bytes("deepseek-v2-lite", 2, 1000)["kv"] == 2 * 1000 * 27 * 576 * 2
    kv_row = 2 * 8 * 64 * 2
    assert decode_floor_bytes("gpt-oss-20b", 2, 1000)["kv"] == 2 * 12 * (128 + 1000) * kv_row
    for shape, params, table in (
        ("deepseek-v2-lite", 15.7e9, 102400),
        ("gpt-oss-20b", 20.9e9, 201088),
    ):
        weights = decode_floor_bytes(shape, 512, 0)["weights"] / 2
        hidden = 2048 if shape == "deepseek-v2-lite" else 2880
        assert abs((weights + table * hidden - 512 * hidden) / params - 1) < 0.01


def test_gpu_engine_decode_floor_of_a_mamba_hybrid() -> None:
    """Granite-4.0-H-Small's shape at 10 of its 40 layers (9 Mamba-2, 1 attention): the KV of
    the one attention layer alone (8 KV heads of 128); each request's state read and written,
    9 layers x (conv [8192 + 2 x 128, 3] bf16 + SSM [128, 64, 128] fp32); its 72 stacked
    experts read as routed (top-10): at batch 1 about 10/72 of them, at batch 512 all, the
    whole 10-layer model (8.36 B; 32.2 B at 40 layers, the published 32 B)."""
    from bench.gpu.engine import decode_floor_bytes

    shape = "granite-4.0-h-small-10l"
    floor = decode_floor_bytes(shape, 2, 1000)
    assert floor["kv"] == 2 * 1000 * 2 * 8 * 128 * 2
    assert floor["state"] == 2 * 2 * 9 * ((8192 + 256) * 3 * 2 + 128 * 64 * 128 * 4)
    table = 100352 * 4096  # tied: the LM head reads the whole table
    everything = decode_floor_bytes(shape, 512, 0)["weights"] / 2
    assert abs(everything / 8.36e9 - 1) < 0.01
    experts = 10 * 72 * 3 * 768 * 4096
    one = decode_floor_bytes(shape, 1, 0)["weights"] / 2
    assert abs((everything - one) / (experts * 62 / 72) - 1) < 0.01
    assert one > table


def test_gpu_engine_teacher_forced_logits_are_one_prefills(tmp_path: Path) -> None:
    """The agreement's forwards through an engine's own pool (a prefill step for all prompts,
    then decode steps) give each prompt's logits as one whole prefill does; an engine agrees
    with itself."""
    import torch

    from bench.gpu.engine import compare_logits, teacher_forced_logits
    from llmserve.bench.quality import prompt_logits
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu",
                                 num_kv_blocks=16, seed=0))  # fmt: skip
    prompts = [[(7 * i + 31 * b) % 256 for i in range(20 + b)] for b in range(3)]
    got = teacher_forced_logits(engine, prompts, 5)
    want = [prompt_logits(engine.model, engine.model_config, p) for p in prompts]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    figures = compare_logits(want, got, 5)
    assert figures["top1"] == 1.0 and figures["mean_kl"] < 1e-6
    assert figures["positions"] == 63 and figures["by_phase"]["decode"]["positions"] == 15


# -- the OpenAI HTTP backend against a fake server -------------------------------------------------


@dataclass
class FakeOpenAI:
    """Answers /v1/models and streams completions as chunked server-sent events."""

    refuse: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, path, _ = (await reader.readline()).decode().split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.headers.append(headers)
        if path == "/v1/models":
            await self._json(writer, 200, {"data": [{"id": "fake-model"}]})
        elif self.refuse:
            await self._json(writer, 429, {"error": {"message": "queue full", "code": 429}})
        else:
            self.bodies.append(json.loads(body))
            await self._stream(writer)
        writer.close()

    async def _json(self, writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        events = [{"choices": [{"text": t, "finish_reason": None}]} for t in ("Hel", "lo", " you")]
        events.append({"choices": [{"text": "", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})
        payloads = [f"data: {json.dumps(e)}\r\n\r\n".encode() for e in events] + [
            b"data: [DONE]\n\n"
        ]
        for payload in payloads:
            # Each event split across two chunks: the reader must reassemble it.
            for part in (payload[:9], payload[9:]):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _with_fake_server(fake: FakeOpenAI, body: Callable[[str], Any]) -> Any:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_openai_backend_streams_and_counts_tokens_from_usage() -> None:
    fake = FakeOpenAI()

    async def run(url: str) -> tuple[dict[str, Any], list[RequestRecord]]:
        backend = OpenAIBackend(url, SamplingConfig(), api_key="k1")
        info = await backend.describe()
        requests = [
            BenchRequest(6, 5, text="a b c"),
            BenchRequest(9, 5, messages=(("user", "hi"),)),
        ]
        return info, await run_benchmark(backend, requests, ArrivalConfig())

    info, records = asyncio.run(_with_fake_server(fake, run))
    assert info["model"] == "fake-model"
    for record in records:
        assert (record.status, record.finish_reason) == ("OK", "length")
        assert len(record.chunk_times_s) == 3  # the empty finishing chunk carries no token
        assert (record.num_output_tokens, record.num_prompt_tokens) == (5, 7)
        assert record.output_tokens_from == "usage"
        assert record.chunk_times_s[0] < record.chunk_times_s[1] < record.chunk_times_s[2]
        assert record.chunk_times_s[2] <= record.latency_s
    by_endpoint = {"prompt" in b: b for b in fake.bodies}
    completion = by_endpoint[True]
    assert completion == {
        "model": "fake-model",
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": "a b c",
    }
    assert by_endpoint[False]["messages"] == [{"role": "user", "content": "hi"}]
    assert all(h["authorization"] == "Bearer k1" for h in fake.headers)


def test_openai_backend_reports_http_errors_by_status() -> None:
    async def run(url: str) -> list[RequestRecord]:
        backend = OpenAIBackend(url, SamplingConfig(), model="m")
        return await run_benchmark(backend, [BenchRequest(3, 2, text="x")] * 3, ArrivalConfig())

    records = asyncio.run(_with_fake_server(FakeOpenAI(refuse=True), run))
    assert summarize(records)["errors"] == {"HTTP 429": 3}
    assert records[0].error == "queue full"

    async def nobody_listens() -> list[RequestRecord]:
        backend = OpenAIBackend("http://127.0.0.1:9", SamplingConfig(), model="m")
        return await run_benchmark(backend, [BenchRequest(3, 2, text="x")], ArrivalConfig())

    assert asyncio.run(nobody_listens())[0].status == "CONNECTION_ERROR"


def test_sse_events_join_data_lines_and_skip_comments() -> None:
    async def chunks() -> Any:
        for piece in (b": comment\n", b"data: a\ndata: b\n", b"\nevent: x\ndata: c\r\n\r\n"):
            yield piece

    async def collect() -> list[str]:
        return [e async for e in sse_events(chunks())]

    assert asyncio.run(collect()) == ["a\nb", "c"]


# -- against the real stack ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo_stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The echo engine behind a real scheduler and gateway, HTTP API on."""
    s = start_echo_stack(
        tokenizer_dir, tmp_path_factory.mktemp("logs"),
        "--fake-step-delay-ms", "2", "--num-kv-blocks", "128", "--max-model-len", "256",
        http=True,
    )  # fmt: skip
    yield s
    s.close()


def llmserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_serve_sweep_against_the_stack(
    echo_stack: Stack, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sweep.json"
    result = llmserve(
        "bench", "serve", "--address", echo_stack.gateway_address,
        "--tokenizer", str(tokenizer_dir), "--dataset-name", "random", "--num-prompts", "24",
        "--input-len", "40",
        "--output-len", "12", "--request-rate", "200,inf", "--max-concurrency", "8",
        "--goodput", "ttft:5000", "--output", str(out), "--label", "echo",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["schema"] == "llmserve-bench/1" and document["kind"] == "serve"
    assert document["llmserve_version"] and document["hardware"]["cpu"]
    assert document["command"][:3] == ["llmserve", "bench", "serve"]
    assert document["server"]["model"] == "fake-echo"
    config = document["config"]
    assert config["workload"]["num_requests"] == 24 and config["label"] == "echo"
    assert config["sweep"] == [
        {"request_rate": 200.0, "max_concurrency": 8},
        {"request_rate": "inf", "max_concurrency": 8},
    ]
    assert [r["label"] for r in document["runs"]] == [
        "rate 200/s, concurrency 8",
        "rate inf, concurrency 8",
    ]
    tables = result.stdout.split("== ")[1:]
    tokenizer = Tokenizer.from_model_path(tokenizer_dir)
    for i, (run, table) in enumerate(zip(document["runs"], tables, strict=True)):
        m = run["metrics"]
        assert (m["num_completed"], m["num_failed"], m["errors"]) == (24, 0, {})
        assert m["max_in_flight"] <= 8
        assert m["num_good_requests"] == 24
        # The server counted the prompt lengths the workload built (run i sends variant i), and
        # generated exactly the requested tokens, counted from the streamed token ids.
        workload = build_workload(WorkloadConfig(**config["workload"]), tokenizer, variant=i)
        assert [r["num_prompt_tokens"] for r in run["requests"]] == [
            w.num_prompt_tokens for w in workload
        ]
        assert [r["num_output_tokens"] for r in run["requests"]] == [w.max_tokens for w in workload]
        assert m["total_output_tokens"] == sum(w.max_tokens for w in workload)
        printed_numbers_are_saved("== " + table, run)
    assert out.with_suffix(".png").stat().st_size > 0
    echo_stack.assert_idle()

    compared = llmserve("bench", "compare", str(out), str(out))
    assert compared.returncode == 0, compared.stderr
    assert "settings: identical" in compared.stdout


def test_bench_serve_counts_refusals_by_status(echo_stack: Stack) -> None:
    """Prompts beyond the server's 256-token context are refused with INVALID_ARGUMENT; the
    others complete."""
    from llmserve.bench.backends import GrpcBackend

    requests = [BenchRequest(300, 4, text="y" * 300), BenchRequest(5, 4, text="hello")] * 3

    async def run() -> list[RequestRecord]:
        backend = GrpcBackend(echo_stack.gateway_address, SamplingConfig())
        try:
            return await run_benchmark(backend, requests, ArrivalConfig())
        finally:
            await backend.close()

    records = asyncio.run(run())
    m = summarize(records)
    assert (m["num_completed"], m["errors"]) == (3, {"INVALID_ARGUMENT": 3})
    assert "256" in records[0].error
    assert [r.num_output_tokens for r in records if r.ok] == [4, 4, 4]
    echo_stack.assert_idle()


def test_bench_serve_openai_backend_against_the_http_api(
    echo_stack: Stack, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "http.json"
    result = llmserve(
        "bench", "serve", "--backend", "openai", "--base-url",
        str(echo_stack.http_url).removesuffix("/v1"), "--tokenizer", str(tokenizer_dir),
        "--dataset-name", "random", "--num-prompts", "12", "--input-len", "30",
        "--output-len", "10", "--max-concurrency", "4", "--output", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["server"]["model"] == "fake-echo"
    m = document["runs"][0]["metrics"]
    assert (m["num_completed"], m["errors"], m["max_in_flight"]) == (12, {}, 4)
    for row in document["runs"][0]["requests"]:
        assert row["output_tokens_from"] == "usage"
        assert row["num_output_tokens"] == row["max_tokens"]
    echo_stack.assert_idle()


def test_bench_offline_static_and_continuous_give_the_same_tokens(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Both policies through `bench offline` (its own stack each time) on a tiny random Llama:
    every request completes, all blocks are free again (the stack's own check), and greedy
    tokens agree request by request: static batching's padding rows disturb nobody."""
    model = tiny_model(num_heads=4, num_kv_heads=2)
    tokens = {}
    for policy in ("continuous", "static"):
        out = tmp_path / f"{policy}.json"
        result = llmserve(
            "bench", "offline", "--dataset-name", "random", "--num-prompts", "12",
            "--input-len", "24", "--output-len", "10", "--save-detailed", "--output", str(out),
            "--", "--model", str(model), "--num-kv-blocks", "64", "--max-num-seqs", "4",
            "--scheduling-policy", policy,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        document = json.loads(out.read_text())
        assert document["kind"] == "offline"
        assert document["server"]["serve_args"][-1] == policy
        m = document["runs"][0]["metrics"]
        assert (m["num_completed"], m["errors"]) == (12, {})
        stats = document["runs"][0]["scheduler_stats"]
        assert stats["num_finished_requests"] == 12 and stats["num_preemptions"] == 0
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        tokens[policy] = [r["token_ids"] for r in document["runs"][0]["requests"]]
        assert [len(t) for t in tokens[policy]] == [
            r["max_tokens"] for r in document["runs"][0]["requests"]
        ]
        assert "scheduler:" in result.stdout
    assert tokens["static"] == tokens["continuous"]


def test_tensor_parallel_bytes_per_token_follow_the_ring_formula() -> None:
    from llmserve.bench.step import comm_bytes

    # SmolLM2 in float32 at T = 3: two all-reduces of 576 values per layer, 2 (T-1)/T each.
    at3 = comm_bytes(576, 49152, 3, 4)
    assert at3["per_token_per_layer"] == pytest.approx(6144)
    assert at3["embedding_per_token"] == pytest.approx(3072)
    assert at3["lm_head_per_sampled_token"] == pytest.approx(2 / 3 * 49152 * 4)
    assert set(comm_bytes(576, 49152, 1, 4).values()) == {0.0}
    # Llama-3-70B in bf16 at T = 8, as docs/parallelism.md ("What it costs") says.
    assert comm_bytes(8192, 128256, 8, 2)["per_token_per_layer"] == pytest.approx(57344)


def test_stats_delta_handles_every_field_kind() -> None:
    """stats_delta over SchedulerStats' scalar counters and gauges, its per-position repeated
    counters, its map of preemptions by reason and its per-tenant rows (a new tenant counts from
    0): every field kind the message has."""
    from llmserve.protos import scheduler_pb2
    from llmserve.stats import stats_delta

    before = scheduler_pb2.SchedulerStats(num_steps=10, num_running=3, ready=True)
    before.num_spec_draft_tokens_per_pos.extend([4, 2])
    before.num_preemptions_by_reason["memory"] = 1
    before.tenants.add(tenant="a", weight=2.0, num_running=1, num_generated_tokens=5)
    after = scheduler_pb2.SchedulerStats(num_steps=15, num_running=2, ready=True)
    after.num_spec_draft_tokens_per_pos.extend([6, 3, 1])
    after.num_preemptions_by_reason.update({"memory": 3, "fair": 2})
    after.tenants.add(tenant="a", weight=2.0, num_running=2, num_generated_tokens=9)
    after.tenants.add(tenant="b", weight=1.0, num_generated_tokens=4, virtual_tokens=8.0)
    delta = stats_delta(before, after)
    assert delta["num_steps"] == 5.0 and delta["num_running"] == 2.0 and delta["ready"] == 1.0
    assert delta["num_spec_draft_tokens_per_pos"] == [2.0, 1.0, 1.0]
    assert delta["num_preemptions_by_reason"] == {"memory": 2.0, "fair": 2.0}
    assert delta["tenants"]["a"]["num_generated_tokens"] == 4.0
    assert delta["tenants"]["a"]["weight"] == 2.0 and delta["tenants"]["a"]["num_running"] == 2.0
    assert delta["tenants"]["b"]["virtual_tokens"] == 8.0


def test_summed_stats_adds_the_replicas_field_by_field() -> None:
    """Stack.scheduler_stats over replicas: numbers summed, bools or-ed (ready: and-ed), maps
    summed by key, repeated counters by position, per-tenant rows listed one after another; one
    replica's stats are its own."""
    from llmserve.protos import scheduler_pb2
    from llmserve.stats import summed_stats

    a = scheduler_pb2.SchedulerStats(num_steps=10, num_running=3, ready=True, draining=False)
    a.num_spec_draft_tokens_per_pos.extend([4, 2])
    a.num_preemptions_by_reason["memory"] = 1
    a.tenants.add(tenant="t", num_generated_tokens=5)
    b = scheduler_pb2.SchedulerStats(num_steps=5, num_running=1, ready=False, draining=True)
    b.num_spec_draft_tokens_per_pos.extend([1, 1, 1])
    b.num_preemptions_by_reason.update({"memory": 2, "fair": 1})
    b.tenants.add(tenant="t", num_generated_tokens=7)
    total = summed_stats([a, b])
    assert (total.num_steps, total.num_running) == (15, 4)
    assert (total.ready, total.draining) == (False, True)
    assert list(total.num_spec_draft_tokens_per_pos) == [5, 3, 1]
    assert dict(total.num_preemptions_by_reason) == {"memory": 3, "fair": 1}
    assert [t.num_generated_tokens for t in total.tenants] == [5, 7]
    assert summed_stats([a]) is a


def test_ab_summary_is_each_sides_median_over_its_rounds() -> None:
    """`llmserve bench ab`'s table: per side, the median over its rounds of each figure of the
    sweep table (a run without one, such as TPOT of one-token outputs, is left out), and B / A."""
    from llmserve.bench.ab import format_ab, side_medians
    from llmserve.bench.metrics import distribution
    from llmserve.bench.report import SWEEP_COLUMNS

    def run(side: str, tok_s: float, ttft_p50: float, tpot: float | None) -> dict[str, Any]:
        metrics: dict[str, Any] = {key: 1.0 for _, key, stat in SWEEP_COLUMNS if stat is None}
        metrics.update({key: distribution([1.0]) for _, key, stat in SWEEP_COLUMNS if stat})
        metrics["output_throughput"], metrics["goodput"] = tok_s, None
        metrics["ttft_ms"] = {**distribution([1.0]), "p50": ttft_p50, "p99": 2 * ttft_p50}
        metrics["tpot_ms"] = distribution([tpot] if tpot is not None else [])
        return {"side": side, "metrics": metrics}

    runs = [run("a", 10.0, 100.0, 5.0), run("b", 30.0, 50.0, None), run("a", 20.0, 300.0, 7.0),
            run("b", 40.0, 70.0, None), run("a", 90.0, 200.0, None)]  # fmt: skip
    a, b = side_medians(runs, "a"), side_medians(runs, "b")
    assert (a["out tok/s"], b["out tok/s"]) == (20.0, 35.0)
    assert (a["TTFT p50"], a["TTFT p99"], b["TTFT p50"]) == (200.0, 400.0, 60.0)
    assert (a["TPOT p50"], b["TPOT p50"], a["goodput"]) == (6.0, None, None)
    lines = {line[:20].strip(): line[20:].split() for line in format_ab(runs).splitlines()}
    assert lines["out tok/s"] == ["20.00", "35.00", "1.750"]
    assert lines["TTFT p50"] == ["200.00", "60.00", "0.300"]
    assert lines["TPOT p50"] == ["6.00", "-", "-"]


def test_bench_ab_refuses_bad_settings_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from llmserve.cli import main

    assert main(["bench", "ab", "--a", "", "--b", "--max-num-seqs 4", "--rounds", "0"]) == 2
    assert "--rounds 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve's own usage error, for side B's options
        main(["bench", "ab", "--a", "", "--b", "--no-such-flag"])


def test_bench_step_times_arms_side_by_side(tmp_path: Path) -> None:
    """`llmserve bench step` on two family arms of a tiny shape: a row per arm and batch, every
    step and prefill timed, ratios to the first arm (the first's own 1.0), each arm's greedy
    tokens kept (llama's and qwen3's differ: other layouts, other weights), the saved document
    read back as the docs' markdown table; a bad arm spec is refused naming the kinds."""
    from llmserve.bench.step import markdown_table
    from llmserve.cli import main
    from tests.family_models import COMMON

    shape = tmp_path / "shape"
    shape.mkdir()
    llama = {**COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (shape / "config.json").write_text(json.dumps({**llama, "head_dim": 16}))
    out = tmp_path / "step.json"
    args = ["bench", "step", "--arms", "family:llama", "family:qwen3", "--batches", "1,3"]
    args += ["--steps", "3", "--prompt-len", "8", "--threads", "1", "--shape", str(shape)]
    assert main([*args, "--prefill-rounds", "2", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    llama, qwen3 = document["results"]
    assert [r["batch"] for r in qwen3["rows"]] == [1, 3]
    # each row's prefills: the batch's prompts in one step, timed --prefill-rounds times
    assert [r["prefill_tokens"] for r in qwen3["rows"]] == [8, 24]
    assert all(len(r["prefill_ms"]) == 2 and r["prefill_ms_per_token"] > 0 for r in qwen3["rows"])
    assert all(len(r["step_ms"]) == 3 and r["step_ms_median"] > 0 for r in qwen3["rows"])
    assert [r["vs_first"] for r in llama["rows"]] == [1.0, 1.0]
    assert len(llama["rows"][0]["first_tokens"]) == 7  # the prefill's, 3 warm-ups, 3 timed
    assert llama["rows"][0]["first_tokens"] != qwen3["rows"][0]["first_tokens"]
    table = markdown_table(document).splitlines()
    ratio = qwen3["rows"][1]["vs_first"]
    assert table[0].startswith("| arm | batch 1: ms (family:llama) |")
    assert table[-1].startswith("| family:qwen3 |") and table[-1].endswith(f"| {ratio:.2f} |")
    with pytest.raises(ValueError, match="the kind is one of"):
        main(["bench", "step", "--arms", "nonsense", "--steps", "1"])
    assert 0 < document["max_rss_mib"] < 1e6  # VmHWM of this process, MiB
    with pytest.raises(ValueError, match=r"holds no config\.json"):  # a model:DIR@QUANT arm
        main(["bench", "step", "--arms", f"model:{tmp_path / 'none'}@gguf", "--steps", "1"])


def test_pd_failures_times_a_request_from_the_fault_or_its_first_token() -> None:
    """bench/studies/pd_failures.py's per-request times: from the fault (or, without one, from the
    request's own first token) to the next token and the end; a request that ended before the
    fault is not counted as hit."""
    from bench.studies.pd_failures import echo, fault_times

    arrivals = [(10.0, 1), (10.5, 2), (12.0, 1)]
    assert fault_times(arrivals, 12.5, 11.0) == {
        "tokens_before_fault": 3, "affected": True, "next_token_ms": 1000.0, "end_ms": 1500.0
    }  # fmt: skip
    assert fault_times(arrivals, 12.5, None) == {
        "tokens_before_fault": 1, "affected": True, "next_token_ms": 500.0, "end_ms": 2500.0
    }  # fmt: skip
    assert fault_times(arrivals, 12.5, 13.0)["affected"] is False
    assert fault_times([], None, None)["next_token_ms"] is None
    assert echo("abc", 7) == "abcabca"
