"""bench/gpu_engine_check.sh on the CPU (issue 24): its dry run passes (wheels for the GPU
machine, imports, stage commands against their scripts, pytest selections), and its report
(bench/gpu/check_report.py) keeps a failing stage's error in the JSON and a pointer in the
table while the other stages keep their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.gpu.check_report import report
from bench.gpu.preflight import GPU_MACHINE, GPU_WHEELS, Wheel, check_wheels, tag_problem

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_passes() -> None:
    """Fetches .whl/ first when it is missing (a fresh clone); skips only when the package
    index cannot be reached for that (fetch_gpu_wheels.sh exits 3)."""
    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN_NVCC": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "bench/gpu_engine_check.sh", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode == 3 and not list((ROOT / ".whl").glob("*.whl")):
        pytest.skip("no .whl/ and the package index is unreachable: " + done.stdout[-300:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "sum of caps" in out and "dry run ok" in out
    stages = ("preflight", "kernels", "kbench", "8b", "tests", "smollm2", "quant", "structured")
    for stage in (*stages, "lora", "parallel", "families", "families2", "families3"):
        assert f"dry run: {stage}:" in out, stage
    assert "second call (preflight parallel families) 135 s of SECOND_CALL_S=150 s" in out
    assert "second call (preflight families2) 150 s of SECOND_CALL_S=150 s" in out
    assert "second call (preflight families3) 90 s of SECOND_CALL_S=150 s" in out


def test_wheel_checks_catch_what_the_machine_would_refuse(tmp_path: Path) -> None:
    assert tag_problem(Wheel.parse(Path("x-1.0-cp311-cp311-manylinux_2_28_x86_64.whl")))
    assert tag_problem(Wheel.parse(Path("x-1.0-cp312-cp312-manylinux_2_34_x86_64.whl")))
    assert tag_problem(Wheel.parse(Path("x-1.0-cp312-cp312-macosx_11_0_arm64.whl")))
    assert tag_problem(Wheel.parse(Path("x-1.0-py3-none-any.whl"))) is None
    assert tag_problem(Wheel.parse(Path("x-1.0-cp312-cp312-manylinux2014_x86_64.whl"))) is None
    assert GPU_MACHINE["grpcio"] == "1.84.0" and GPU_WHEELS["grpcio-health-checking"] == "1.84.0"
    problems, _ = check_wheels(tmp_path)  # empty: names the fix
    assert len(problems) == 1 and "fetch_gpu_wheels.sh" in problems[0]
    # grpcio-health-checking 1.85 needs a grpcio the machine lacks: refused, and not the pin
    wheel = tmp_path / "grpcio_health_checking-1.85.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "grpcio_health_checking-1.85.1.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: grpcio-health-checking\nVersion: 1.85.1\n"
            "Requires-Python: >=3.10\nRequires-Dist: grpcio>=1.85.1\n"
            "Requires-Dist: protobuf<8.0.0,>=7.35.1\n\nbody\n",
        )
    problems, _ = check_wheels(tmp_path)
    assert any("pinned to 1.84.0" in p for p in problems), problems
    assert any("requires grpcio>=1.85.1; the GPU machine's grpcio is 1.84.0" in p for p in problems)


def test_report_keeps_each_stage_and_points_at_a_failure(tmp_path: Path) -> None:
    out, raw = tmp_path / "out", tmp_path / "raw"
    out.mkdir()
    raw.mkdir()
    rows = [
        ("preflight", "1", "0", "12", "python3 -m bench.gpu.preflight"),
        ("kbench", "1", "0", "40", "python3 -m bench.gpu.kernels_bench"),
        ("8b", "1", "1", "90", "python3 -m bench.gpu.engine --shape llama-3-8b"),
        ("tests", "1", "124", "80", "python3 -m pytest"),
        ("quant", "1", "0", "25", "python3 -m bench.gpu.engine --quantization int8"),
        ("quant", "2", "skipped", "0", "python3 -m bench.gpu.engine --quantization fp8"),
        ("structured", "1", "0", "22", "python3 -m bench.studies.structured_cpu --device cuda"),
        ("families", "2", "0", "30", "python3 -m bench.gpu.engine --shape qwen3-30b-a3b"),
        ("families2", "2", "0", "30", "python3 -m bench.gpu.engine --shape gpt-oss-20b"),
        ("lora", "1", "0", "28", "python3 -m bench.gpu.lora --shape llama-3-8b"),
    ]
    (raw / "stages.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    (raw / "preflight.json").write_text(json.dumps({"total_s": 12.5, "ops": "cuda"}))
    (raw / "8b.log").write_text("loading\nTraceback (most recent call last):\nValueError: boom\n")
    (raw / "tests.log").write_text(
        "tests/engine/test_engine_gpu.py::test_a PASSED [ 10%]\n"
        "tests/engine/test_engine_gpu.py::test_b FAILED"
    )
    (out / "kernels_h200.json").write_text(
        json.dumps({"int8": [{"gbps": 3300.0, "pct_of_copy": 77.1}], "summary": "x"})
    )
    (out / "gpu_engine_llama-3-8b.json").write_text(
        json.dumps({"decode": {"batch_1": {"step_ms_median": 5.0, "floor_ms": 4.0,
                                           "graph_speedup": 1.5}}})
    )  # fmt: skip
    (out / "gpu_engine_llama-3-8b_quant.json").write_text(
        json.dumps({"modes": {"int8": {"decode": {"batch_1": {"tok_s_vs_bf16": 1.7}}}}})
    )
    (raw / "structured.json").write_text(
        json.dumps({
            "summary": {"0.0": {"output_tok_s_median": 900.0},
                        "1.0": {"output_tok_s_median": 850.0, "vs_none": 0.944}},
            "mask_ms_per_row_step_median": 0.05,
            "compile": {"cold_ms_median": 3.1, "cached_ms_median": 0.004},
        })
    )  # fmt: skip
    (raw / "families").mkdir()
    (raw / "families" / "gpu_engine_qwen3-30b-a3b.json").write_text(
        json.dumps({"decode": {"batch_8": {"step_ms_median": 9.0, "floor_ms": 4.5}}})
    )
    (raw / "families" / "gpu_engine_gpt-oss-20b.json").write_text(
        json.dumps({"decode": {"batch_1": {"step_ms_median": 4.0, "floor_ms": 3.0}}})
    )
    (out / "gpu_lora_llama-3-8b.json").write_text(
        json.dumps({"batch_8": {"lora_vs_base": 0.8, "lora_vs_base_eager": 0.95,
                                "lora_prefill_vs_base": 0.9}, "batch_64": {"error": "OOM"}})
    )  # fmt: skip
    doc, table, code = report(out, raw, 500, 300)
    assert code == 1
    stages = doc["stages"]
    assert stages["preflight"]["status"] == "ok" and stages["smollm2"]["status"] == "not run"
    assert stages["8b"]["status"] == "FAIL (exit 1)"
    assert stages["8b"]["error"][-1] == "ValueError: boom"
    assert stages["tests"]["status"] == "TIMEOUT"
    assert stages["tests"]["figures"] == {"pytest": "1 passed, 1 failed before it was stopped"}
    assert stages["quant"]["status"] == "ok (part skipped)"
    assert stages["kbench"]["figures"] == {"int8": {"gbps": 3300, "pct_of_copy": 77.1}}
    assert stages["8b"]["figures"]["batch_1"] == {
        "step_ms": 5.0, "mbu_pct": 80.0, "graph_vs_eager": 1.5
    }  # fmt: skip
    assert "ValueError: boom [gpu_check.json stages.8b.error]" in table
    assert "int8 3300 GB/s = 77.1%" in table and "b1 5.0 ms MBU 80.0%" in table
    assert "int8 b1 1.7x" in table
    assert stages["structured"]["figures"]["all_vs_none"] == 0.944
    assert "all constrained 0.944x none (850.0 vs 900.0 tok/s), mask 0.05 ms" in table
    assert stages["families"]["figures"]["qwen3-30b-a3b"]["batch_8"]["mbu_pct"] == 50.0
    assert "qwen3-8b: no figures | qwen3-30b-a3b: b8 9.0 ms MBU 50.0%" in table
    assert "deepseek-v2-lite: no figures | gpt-oss-20b: b1 4.0 ms MBU 75.0%" in table
    assert stages["lora"]["figures"]["batch_8"]["lora_vs_base"] == 0.8
    assert "b8 0.8x base (0.95x eager), prefill 0.9x" in table and "b64 error: OOM" in table
    assert len(table) < 3000
