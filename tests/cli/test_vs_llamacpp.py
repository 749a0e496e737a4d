"""bench/studies/vs_llamacpp.py without llama.cpp: the loads it parses, the rows and ratios it
builds from
two servers' results, the table it prints, and the process-tree memory it samples."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "vs_llamacpp", ROOT / "bench" / "studies" / "vs_llamacpp.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


vs = _load_script()
MiB = 2**20


def _load(concurrency: int, tok_s: float, ttft_ms: float, rss_mib: int) -> dict[str, Any]:
    summary = {
        "output_tok_s": tok_s,
        "ttft_p50_ms": ttft_ms,
        "ttft_p99_ms": 2 * ttft_ms,
        "itl_p50_ms": 10.0,
    }
    return {"concurrency": concurrency, "peak_rss_bytes": rss_mib * MiB, "summary": summary}


def test_parse_loads_pairs_counts_with_concurrencies_and_gives_each_a_seed() -> None:
    Load = vs.Load
    assert vs.parse_loads("1,16,64", "16,64,192") == [
        Load(1, 16, 0),
        Load(16, 64, 1),
        Load(64, 192, 2),
    ]
    assert vs.parse_loads("1,4", "3", seed=5) == [Load(1, 3, 5), Load(4, 3, 6)]
    with pytest.raises(ValueError, match="one per concurrency"):
        vs.parse_loads("1,16,64", "8,8")
    with pytest.raises(ValueError, match=">= 1"):
        vs.parse_loads("0", "8")


def test_rows_hold_every_server_and_llmserve_over_each_peer() -> None:
    servers = {
        "llamacpp": {"loads": [_load(1, 80.0, 100.0, 900), _load(16, 140.0, 400.0, 1000)]},
        "vllm": {"loads": [_load(16, 420.0, 100.0, 3000)]},
        "llmserve": {"loads": [_load(1, 40.0, 300.0, 3600), _load(16, 210.0, 200.0, 1500)]},
    }
    rows = vs.load_rows(servers)
    assert [row["concurrency"] for row in rows] == [1, 16]
    assert rows[0]["ratios"] == {"llamacpp": {"output_tok_s": 0.5, "ttft_p50": 3.0, "rss": 4.0}}
    assert rows[1]["ratios"]["llamacpp"] == {"output_tok_s": 1.5, "ttft_p50": 0.5, "rss": 1.5}
    assert rows[1]["ratios"]["vllm"] == {"output_tok_s": 0.5, "ttft_p50": 2.0, "rss": 0.5}
    assert rows[1]["llmserve"]["peak_rss_bytes"] == 1500 * MiB

    table = vs.format_table(rows).splitlines()
    assert table[1].split() == ["1", "llamacpp", "80.0", "100.0", "200.0", "10.0", "900.0"]
    assert table[2].split() == ["1", "vllm", *["-"] * 5]
    assert table[4].split() == ["/llamacpp", "0.50x", "3.00x", "4.00x"]
    assert table[8].split() == ["/llamacpp", "1.50x", "0.50x", "1.50x"]
    assert table[9].split() == ["/vllm", "0.50x", "2.00x", "0.50x"]


def test_vllm_bench_results_summarize_like_ours() -> None:
    """`vllm bench serve`'s result document gives the same figures as our client's."""
    document = {
        "completed": 4, "failed": 0, "output_throughput": 120.5, "median_ttft_ms": 30.0,
        "p99_ttft_ms": 90.0, "median_itl_ms": 8.0, "median_tpot_ms": 8.5,
        "total_input_tokens": 512, "output_lens": [128, 128, 128, 127],
    }  # fmt: skip
    summary = vs.summarize(document)
    assert summary["output_tok_s"] == 120.5 and summary["ttft_p50_ms"] == 30.0
    assert summary["mean_prompt_tokens"] == 128 and summary["output_lens_min_max"] == [127, 128]


def test_a_server_alone_gives_rows_without_ratios() -> None:
    rows = vs.load_rows({"llmserve": {"loads": [_load(4, 50.0, 20.0, 100)]}})
    assert "ratios" not in rows[0]
    assert vs.format_table(rows).splitlines()[1].split() == ["4", "llamacpp", *["-"] * 5]
    assert vs.ratio(1.0, 0.0) is None
    assert vs.ratio(None, 2.0) is None
    # a peer alone (no llmserve to compare): rows, no ratios
    rows = vs.load_rows({"vllm": {"loads": [_load(1, 13.5, 500.0, 3000)]}})
    assert "ratios" not in rows[0] and rows[0]["vllm"]["output_tok_s"] == 13.5


def test_vllm_summary_without_detailed_lists_and_its_platform_named() -> None:
    """vllm bench serve keeps per-request lists only with --save-detailed (asked for); a result
    without them still summarizes. The server and client name vLLM's CPU platform, whose
    detection otherwise reads our stand-in dist-info and imports the AVX-512 build."""
    document = {
        "completed": 2, "failed": 0, "output_throughput": 13.5, "median_ttft_ms": 500.0,
        "median_itl_ms": 70.0, "median_tpot_ms": 71.0, "total_input_tokens": 256,
    }  # fmt: skip
    assert vs.summarize(document)["output_lens_min_max"] is None
    assert vs.VLLM_ENV == {"VLLM_TARGET_DEVICE": "cpu"}
    load = vs.Load(1, 2, 0)
    args = vs.parse_args(["--servers", "vllm"])
    spec = vs.vllm_spec(args)
    assert spec.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "--save-detailed" in vs.vllm_bench_command(spec, load, Path("/tmp/x.json"), args)
    assert vs.vllm_dtype(["avx2", "avx512f", "avx512_bf16"]) == "bfloat16"
    assert vs.vllm_dtype(["avx2", "fma", "f16c"]) == "float32"


def test_tree_memory_counts_children() -> None:
    """A child holding 64 MiB shows up in its parent's tree peak."""
    code = "b = bytearray(64 << 20); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        memory = vs.TreeMemory(child.pid)
        deadline = time.monotonic() + 10
        while memory.peak_bytes < 64 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        memory.stop()
        assert child.pid in vs.tree_pids(child.pid)
        assert memory.peak_bytes >= 64 * MiB
    finally:
        child.kill()
        child.wait()
