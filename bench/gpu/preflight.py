"""The first stage of bench/gpu_engine_check.sh, and its CPU dry run.

    python3 -m bench.gpu.preflight             on the GPU machine: < 30 s, exit 2 with ONE line
                                               saying what is missing and how to fix it
    python3 -m bench.gpu.preflight --dry-run   anywhere (no GPU): the CPU-checkable parts
    python3 -m bench.gpu.preflight --pins      the wheels .whl/ must hold (fetch_gpu_wheels.sh)
    python3 -m bench.gpu.preflight --check-wheels [DIR]

On the GPU (`preflight`): import every module the later stages import, compile and launch one
kernel beside its reference, start a tiny engine (configs/smollm2-135m, dummy weights) with
`--attention-backend cuda` (so the kernels' start-up self-check runs and a fallback is an error),
which captures CUDA graphs of batch sizes 1 and 2, and replay both.

The dry run (`dry_run`): the wheels in .whl/ against what the GPU machine has (GPU_MACHINE, from
docs/gpu.md#the-gpu-machine): one wheel per package it lacks, each importable under Python 3.12 on
manylinux x86_64 (tags, Requires-Python) with every Requires-Dist met by another wheel or by the
machine (grpcio-health-checking's `grpcio>=` must accept 1.84.0); the same imports as on the GPU
(CuPy excepted); each stage command's script options against its `--help` and each pytest stage's
selection (collected, not run); with nvcc, tests/kernels/test_kernels_compile.py's nvcc checks.

Nothing here imports torch at module level: `--pins` and `--check-wheels` run under any python3.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".whl"

# ---- what the GPU machine has, and the wheels that make up for what it lacks --------------------

MACHINE_PYTHON = (3, 12)
MACHINE_GLIBC = (2, 28)  # manylinux_2_28 and older; a newer tag is not accepted
# docs/gpu.md#the-gpu-machine (read there 2026-11-29), with the packages torch and transformers
# themselves require (present wherever they import). None: present, version not recorded.
GPU_MACHINE: dict[str, str | None] = {
    "torch": "2.11",
    "cupy-cuda13x": "14.2",
    "grpcio": "1.84.0",
    "protobuf": "7.36.2",
    "uvloop": "0.23",
    "transformers": "5.17",
    "triton": "3.6",
    "numpy": None,
    "safetensors": None,
    "tokenizers": None,
    "typing-extensions": None,
    "filelock": None,
    "jinja2": None,
    "markupsafe": None,
    "networkx": None,
    "sympy": None,
    "fsspec": None,
    "huggingface-hub": None,
    "pyyaml": None,
    "regex": None,
    "tqdm": None,
}
# The wheels .whl/ carries (--no-deps; pure Python but llguidance), pinned: versions this repo's
# CI runs with, grpcio-health-checking at the machine's grpcio (1.85 requires grpcio >= 1.85.1
# and refuses to import under 1.84). packaging, pygments and requests (+ their requirements) are
# there too because pytest and gguf require versions the machine may not have.
GPU_WHEELS: dict[str, str] = {
    "grpcio-health-checking": "1.84.0",
    "structlog": "26.1.0",
    "opentelemetry-api": "1.45.2",
    "opentelemetry-sdk": "1.45.2",
    "opentelemetry-semantic-conventions": "0.66b2",
    "opentelemetry-proto": "1.45.2",
    "opentelemetry-exporter-otlp-common": "0.66b2",
    "opentelemetry-exporter-otlp-proto-common": "1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc": "1.45.2",
    "opentelemetry-exporter-prometheus": "0.66b2",
    "prometheus-client": "0.26.0",
    "googleapis-common-protos": "1.76.0",
    "gguf": "0.19.0",
    "requests": "2.34.2",
    "urllib3": "2.8.0",
    "idna": "3.20",
    "certifi": "2026.10.19.post1",
    "charset-normalizer": "3.4.4",
    "pytest": "9.2.0",
    "pluggy": "1.7.0",
    "iniconfig": "2.3.1",
    "packaging": "26.4",
    "pygments": "2.21.0",
    # Structured output's grammar matchers (engine/features/grammar.py): a binary abi3 wheel; 1.6.1
    # is the last with a manylinux_2_28 build (1.7 on need glibc 2.31); the API we use is the same.
    "llguidance": "1.6.1",
}
WHEEL_FIX = "run `bash scripts/fetch_gpu_wheels.sh` and call the device tool with carry=['.whl']"

# Every module a later stage imports (the check script's pytest files, bench scripts and the
# services they start); CUDA-only ones are imported on the GPU alone.
MODULES = [
    "grpc", "grpc_health.v1.health", "google.protobuf", "structlog", "opentelemetry.sdk.trace",
    "opentelemetry.sdk.metrics", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.prometheus", "gguf", "pytest", "jinja2", "tokenizers", "safetensors",
    "transformers", "uvloop", "numpy", "torch", "llmserve.common.net", "llmserve.engine.config",
    "llmserve.engine.step.engine", "llmserve.engine.model.ops", "llmserve.engine.step.cuda_graphs",
    "llmserve.engine.contract.service", "llmserve.scheduler.service.service",
    "llmserve.gateway.service", "llmserve.kernels.cuda", "llmserve.kernels.reference",
    "llmserve.cli", "llmserve.bench.engine_driver", "llmserve.bench.hf", "bench.gpu.engine",
    "bench.gpu.lora", "bench.gpu.kernels_bench", "llmserve.bench.quality",
    "tests.engine.test_engine_gpu", "tests.kernels.test_kernels_cuda",
    "tests.engine.parallel.test_parallel", "tests.engine.kv.test_kv_transfer",
    "tests.engine.kv.test_kv_offload_engine",
]  # fmt: skip
CUDA_MODULES = ["cupy"]


class PreflightError(Exception):
    """One line: what failed and how to fix it."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Wheel:
    path: Path
    name: str
    version: str
    python_tags: list[str]
    abi_tags: list[str]
    platform_tags: list[str]

    @classmethod
    def parse(cls, path: Path) -> Wheel:
        parts = path.name.removesuffix(".whl").split("-")
        if len(parts) not in (5, 6):
            raise ValueError(f"{path.name}: not a wheel file name")
        py, abi, plat = parts[-3:]
        return cls(
            path, normalize(parts[0]), parts[1], py.split("."), abi.split("."), plat.split(".")
        )

    def metadata(self) -> dict[str, list[str]]:
        with zipfile.ZipFile(self.path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(name).decode()
        fields: dict[str, list[str]] = {}
        for line in text.split("\n\n", 1)[0].splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line[0].isspace():
                fields.setdefault(key, []).append(value.strip())
        return fields


def tag_problem(wheel: Wheel) -> str | None:
    """Why the machine's Python 3.12 on manylinux x86_64 would not install this wheel."""
    major, minor = MACHINE_PYTHON
    py_ok = {"py3", f"py{major}{minor}", f"cp{major}{minor}"}
    if not py_ok & set(wheel.python_tags) and not (
        "abi3" in wheel.abi_tags and any(t.startswith("cp3") for t in wheel.python_tags)
    ):
        return f"python tag {'.'.join(wheel.python_tags)} is not for CPython {major}.{minor}"
    if not {"none", "abi3", f"cp{major}{minor}"} & set(wheel.abi_tags):
        return f"abi tag {'.'.join(wheel.abi_tags)} is not cp{major}{minor}, abi3 or none"
    for plat in wheel.platform_tags:
        if plat == "any":
            return None
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", plat)
        legacy = {
            "manylinux1_x86_64": (2, 5),
            "manylinux2010_x86_64": (2, 12),
            "manylinux2014_x86_64": (2, 17),
        }
        glibc = (int(m[1]), int(m[2])) if m else legacy.get(plat)
        if glibc is not None and glibc <= MACHINE_GLIBC:
            return None
    return f"platform {'.'.join(wheel.platform_tags)} is not manylinux (<= 2.28) x86_64 or any"


def marker_environment() -> dict[str, str]:
    major, minor = MACHINE_PYTHON
    return {
        "python_version": f"{major}.{minor}",
        "python_full_version": f"{major}.{minor}.3",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def check_wheels(directory: Path = WHEEL_DIR) -> tuple[list[str], list[str]]:
    """(problems, notes) of the wheels in `directory` for the GPU machine: one wheel per
    GPU_WHEELS entry at its pinned version and nothing else, tags and Requires-Python for
    CPython 3.12 manylinux x86_64, and every Requires-Dist (markers evaluated for that machine,
    no extras) met by a wheel here or by GPU_MACHINE. Needs `packaging`."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if not directory.is_dir() or not list(directory.glob("*.whl")):
        return [f"no wheels in {directory}: {WHEEL_FIX}"], []
    problems, notes = [], []
    wheels: dict[str, Wheel] = {}
    for path in sorted(directory.glob("*.whl")):
        wheel = Wheel.parse(path)
        if wheel.name in wheels:
            problems.append(
                f"two wheels of {wheel.name}: {wheels[wheel.name].path.name}, "
                f"{path.name} (keep one)"
            )
        wheels[wheel.name] = wheel
    for name, version in GPU_WHEELS.items():
        have = wheels.get(name)
        if have is None:
            problems.append(f"{name}=={version} missing from {directory.name}/: {WHEEL_FIX}")
        elif Version(have.version) != Version(version):
            problems.append(f"{have.path.name}: {name} is pinned to {version}: {WHEEL_FIX}")
    for name in sorted(set(wheels) - set(GPU_WHEELS)):
        problems.append(f"{wheels[name].path.name}: not in GPU_WHEELS (remove it or pin it)")
    python = Version("{}.{}.3".format(*MACHINE_PYTHON))
    env = marker_environment()
    for wheel in wheels.values():
        if (why := tag_problem(wheel)) is not None:
            problems.append(f"{wheel.path.name}: {why}")
        meta = wheel.metadata()
        for spec in meta.get("Requires-Python", []):
            if python not in SpecifierSet(spec):
                problems.append(f"{wheel.path.name}: Requires-Python {spec} excludes {python}")
        for line in meta.get("Requires-Dist", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = normalize(req.name)
            if dep in wheels:
                found: str | None = wheels[dep].version
            elif dep in GPU_MACHINE:
                found = GPU_MACHINE[dep]
                if found is None:
                    if str(req.specifier):
                        notes.append(
                            f"{wheel.name} needs {req}: the machine's version is not recorded"
                        )
                    continue
            else:
                problems.append(
                    f"{wheel.path.name} requires {req}, which neither "
                    f"{directory.name}/ nor the GPU machine has"
                )
                continue
            if not req.specifier.contains(found, prereleases=True):
                where = "wheel" if dep in wheels else "GPU machine's"
                problems.append(f"{wheel.path.name} requires {req}; the {where} {dep} is {found}")
    return problems, notes


# ---- imports ------------------------------------------------------------------------------------


def import_all(modules: list[str]) -> None:
    """Import each module; PreflightError naming the first that fails and where the fix is:
    .whl/ for a package of GPU_WHEELS, the machine itself for one it should have, the repo."""
    sys.path.insert(0, str(ROOT))
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:
            missing = (getattr(err, "name", None) or "") if isinstance(err, ImportError) else ""
            top = missing.split(".")[0]
            if top in _WHEEL_MODULES:
                fix = WHEEL_FIX
            elif top and top not in _REPO_PACKAGES:
                fix = (
                    f"{top} is not in .whl/ and docs/gpu.md#the-gpu-machine says the machine has "
                    "it: "
                    "check `python3 -c 'import " + top + "'` there"
                )
            else:
                fix = "fix the import error in the repo"
            raise PreflightError(f"import {name}: {type(err).__name__}: {err} -> {fix}") from err


_REPO_PACKAGES = {"llmserve", "bench", "tests"}
# top-level import names of GPU_WHEELS' packages
_WHEEL_MODULES = {
    "grpc_health",
    "structlog",
    "opentelemetry",
    "prometheus_client",
    "google",
    "gguf",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset_normalizer",
    "pytest",
    "_pytest",
    "pluggy",
    "iniconfig",
    "packaging",
    "pygments",
    "llguidance",
}


# ---- on the GPU ---------------------------------------------------------------------------------


def launch_one_kernel() -> None:
    """kernels.cuda.rms_norm on a small bf16 tensor beside kernels/reference.py."""
    import torch

    import llmserve.kernels.cuda as kc
    from llmserve.kernels import reference as ref

    if not torch.cuda.is_available():
        raise PreflightError(
            "torch sees no CUDA device (torch.cuda.is_available() is False) -> "
            "run on the GPU machine, or use --dry-run here"
        )
    if not kc.is_available():
        raise PreflightError(
            "kernels.cuda.is_available() is False (CuPy missing or GPU older "
            "than sm_80) -> check `python3 -c 'import cupy'` there"
        )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(512, generator=gen).to("cuda", torch.bfloat16)
    try:
        got = kc.rms_norm(x, w, 1e-6, None)[0]
        torch.cuda.synchronize()
    except Exception as err:
        raise PreflightError(
            f"kernel compile/launch (rms_norm): {type(err).__name__}: "
            f"{_first_line(err)} -> see kernels/README.md"
        ) from err
    want = ref.rms_norm(x, w, 1e-6, None)[0]
    error = (got.float() - want.float()).abs().max().item()
    if not error <= 2e-2 * max(1.0, want.float().abs().max().item()):
        raise PreflightError(f"rms_norm kernel differs from kernels/reference.py by {error:.3g}")


def tiny_engine_graphs() -> dict[str, Any]:
    """A SmolLM2-135M-shaped engine (dummy weights) with --attention-backend cuda and graphs
    of batch sizes 1 and 2; a decode of two requests, then of one, replays both graphs."""
    from llmserve.bench.engine_driver import generate
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    config = EngineConfig(
        model=str(ROOT / "configs" / "smollm2-135m"),
        load_format="dummy",
        seed=0,
        device="cuda",
        dtype="bfloat16",
        attention_backend="cuda",
        max_num_seqs=2,
        max_model_len=256,
        num_kv_blocks=32,
        max_num_batched_tokens=256,
    )
    try:
        engine = Engine(config)
    except Exception as err:
        raise PreflightError(
            f"engine start with --attention-backend cuda: {type(err).__name__}: {_first_line(err)}"
        ) from err
    graphs = engine.runner.graphs
    if graphs is None or sorted(graphs.graphs) != [1, 2]:
        raise PreflightError(
            f"CUDA graphs of sizes 1 and 2 were not captured (got "
            f"{None if graphs is None else sorted(graphs.graphs)})"
        )
    replayed: list[int] = []
    run = graphs.run

    def counted(*args: Any) -> Any:
        replayed.append(len(args[2].seq_lens))
        return run(*args)

    graphs.run = counted  # type: ignore[method-assign]
    vocab = engine.model_config.vocab_size
    tokens = generate(engine, [[1, 2, 3, 4], [5, 6, 7]], 3) + generate(engine, [[8, 9]], 3)
    if sorted(set(replayed)) != [1, 2] or not all(0 <= t < vocab for r in tokens for t in r):
        raise PreflightError(
            f"graph replay: batch sizes replayed {sorted(set(replayed))}, tokens {tokens}"
        )
    return {
        "ops": engine.model.ops.name,
        "ops_reason": getattr(engine, "ops_reason", None),
        "graph_sizes": sorted(graphs.graphs),
        "replays": len(replayed),
    }


def preflight() -> dict[str, Any]:
    t0 = time.perf_counter()
    steps: dict[str, Any] = {}
    import_all(MODULES + CUDA_MODULES)
    steps["imports_s"] = round(time.perf_counter() - t0, 1)
    launch_one_kernel()
    steps["kernel_s"] = round(time.perf_counter() - t0, 1)
    steps.update(tiny_engine_graphs())
    steps["total_s"] = round(time.perf_counter() - t0, 1)
    return steps


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


# ---- the dry run --------------------------------------------------------------------------------


def help_text(script: str) -> str:
    """script: a path, or `-m MODULE`."""
    done = subprocess.run(
        [sys.executable, *script.split(), "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise PreflightError(
            f"{script} --help exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
        )
    return done.stdout


def _check_choices(stage: str, script: str, help_out: str, rest: list[str]) -> None:
    """Each `--option value` whose option lists its choices in --help (`--shape {a,b}`) names
    one of them: a stage's shape must be one of configs/."""
    for option, value in itertools.pairwise(rest):
        found = re.search(re.escape(option) + r" \{([^}]*)\}", help_out)
        choices = re.sub(r"\s+", "", found.group(1)).split(",") if found else []
        if option.startswith("--") and found and value not in choices:
            raise PreflightError(
                f"stage {stage}: {script} {option} {value}: not one of {', '.join(choices)}"
            )


def check_stage_commands(plan: list[dict[str, Any]]) -> list[str]:
    """Each python stage command's options against its script's --help; each pytest stage's
    selection collected (at least one test). Returns a line per command checked."""
    import pytest

    lines, helps = [], {}
    for stage in plan:
        for cmd in stage["commands"]:
            argv = shlex.split(cmd)
            if argv[:3] == ["python3", "-m", "pytest"]:
                args = [a for a in argv[3:] if not a.startswith(("--junitxml", "--durations"))]
                code = pytest.main(
                    [*args, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[]
                )
                if code != 0:
                    raise PreflightError(
                        f"stage {stage['name']}: `pytest {' '.join(args)}` "
                        f"collects nothing or fails (exit {code})"
                    )
                lines.append(f"{stage['name']}: pytest selection collects")
            elif argv[0] == "python3" and (argv[1].endswith(".py") or argv[1] == "-m"):
                script, rest = (
                    (f"-m {argv[2]}", argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
                )
                helps.setdefault(script, help_text(script))
                options = {a.split("=")[0] for a in rest if a.startswith("--")}
                unknown = sorted(o for o in options if o not in helps[script])
                if unknown:
                    raise PreflightError(
                        f"stage {stage['name']}: {script} has no option {', '.join(unknown)}"
                    )
                _check_choices(stage["name"], script, helps[script], rest)
                lines.append(f"{stage['name']}: {script} takes {' '.join(sorted(options))}")
    return lines


def nvcc_check() -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "nvcc",
            "tests/kernels/test_kernels_compile.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode != 0:
        raise PreflightError(
            f"nvcc compile checks failed: {tail[0]} (tests/kernels/test_kernels_compile.py)"
        )
    return f"nvcc: {tail[0]}"


def dry_run(plan_path: Path | None, nvcc: bool) -> list[str]:
    """The CPU-checkable parts, in order; PreflightError at the first failure."""
    problems, notes = check_wheels()
    if problems:
        raise PreflightError(f"{len(problems)} wheel problem(s): " + "; ".join(problems))
    lines = [
        f"wheels: {len(GPU_WHEELS)} in .whl/, each for CPython 3.12 manylinux x86_64, "
        "requirements met"
    ]
    lines += [f"  note: {n}" for n in notes]
    import_all(MODULES)
    lines.append(f"imports: {len(MODULES)} modules ({', '.join(CUDA_MODULES)} on the GPU only)")
    if plan_path is not None:
        lines += check_stage_commands(json.loads(plan_path.read_text()))
    import shutil

    if nvcc and shutil.which("nvcc"):
        lines.append(nvcc_check())
    else:
        lines.append(
            "nvcc: skipped"
            + ("" if nvcc else " (--no-nvcc)")
            + "; tests/kernels/test_kernels_compile.py covers it in the suite"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--plan", type=Path, help="the check script's stages (JSON), for --dry-run")
    p.add_argument("--no-nvcc", action="store_true", help="--dry-run without the nvcc checks")
    p.add_argument("--pins", action="store_true", help="print name==version of each wheel")
    p.add_argument("--check-wheels", type=Path, nargs="?", const=WHEEL_DIR, default=None)
    p.add_argument("--json", type=Path, help="write the preflight's figures here")
    args = p.parse_args()
    if args.pins:
        print("\n".join(f"{n}=={v}" for n, v in GPU_WHEELS.items()))
        return 0
    if args.check_wheels is not None:
        problems, notes = check_wheels(args.check_wheels)
        print("\n".join([*(f"problem: {x}" for x in problems), *(f"note: {x}" for x in notes)]))
        print(f"wheels: {'FAIL' if problems else 'ok'} ({args.check_wheels})")
        return 1 if problems else 0
    os.chdir(ROOT)
    try:
        if args.dry_run:
            for line in dry_run(args.plan, nvcc=not args.no_nvcc):
                print(f"dry run: {line}")
            return 0
        figures = preflight()
    except PreflightError as err:
        print(f"preflight FAILED: {err}", flush=True)
        return 2
    except Exception as err:  # anything unforeseen still ends in one line
        print(f"preflight FAILED: {type(err).__name__}: {_first_line(err)}", flush=True)
        return 2
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"preflight ok: {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
