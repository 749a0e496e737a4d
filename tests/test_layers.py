"""The layer rules, checked on the code itself. Every product module lives under llmserve/ (one
import name); its layers:

    bench/               the studies (run as `python -m bench.x`): llmserve/ and what engine/ may
                         import
    llmserve/*.py, llmserve/bench/   CLI, client, launcher, bench: may import everything below
    llmserve/{gateway, scheduler, engine}/  the services: never each other; engine/ may use
                                            kernels/
    llmserve/{common, protos, kernels}/     the base: imports no service and nothing above it

scheduler/ and gateway/ never load torch, and neither do engine/'s torch-free modules (the step
contract, the mirror, the fake engine, the service); no two modules import each other in a loop;
no product module or bench/ script imports tests/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("common", "protos", "kernels", "engine", "scheduler", "gateway", "llmserve", "bench")
SERVICES_AND_BASE = ("common", "protos", "kernels", "engine", "scheduler", "gateway")
# What each layer may import (besides itself and third-party code).
ALLOWED = {
    "common": {"protos"},
    "protos": set(),
    "kernels": set(),
    "engine": {"common", "protos", "kernels"},
    "scheduler": {"common", "protos"},
    "gateway": {"common", "protos"},
    "llmserve": set(LAYERS) - {"bench"},
    "bench": {"llmserve", "common", "protos", "engine", "kernels"},
}
# The bench/ scripts that measure a service's own code in-process, or build a stack from the
# services' config types, and the service layers each of them may import for it.
BENCH_SERVICE_IMPORTS = {
    "bench.studies.telemetry_overhead": {"scheduler", "gateway"},  # the telemetry hooks, timed
    "bench.studies.fairness_study": {"scheduler", "gateway"},  # its stack's configs
    "bench.studies.overlap_echo": {"scheduler"},  # its stack's configs
    "bench.studies.plan_conversion": {"scheduler"},  # the scheduler's plan conversion, timed alone
    "bench.studies.structured_cpu": {"scheduler"},  # the Scheduler driving the engine in-process
    "bench.studies.checkpoint_formats_quality": {"gateway"},  # the model's tokenizer
    "bench.studies.token_level_kv": {"scheduler"},  # the Scheduler's per-step cost, timed alone
    "bench.studies.pd_by_hand": {"scheduler"},  # its scheduler's config, written by hand
    "bench.studies.prompt_logprobs_accuracy": {"scheduler"},  # the Scheduler driving the engine
    "bench.studies.state_snapshots_cpu": {"scheduler"},  # the Scheduler driving the engine
}


def layer(module: str) -> str:
    """The layer a project module belongs to: llmserve.engine.x -> engine, llmserve.cli ->
    llmserve, bench.x -> bench."""
    parts = module.split(".")
    if parts[0] == "llmserve" and len(parts) > 1 and parts[1] in SERVICES_AND_BASE:
        return parts[1]
    return parts[0]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("llmserve", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path], runtime_only: bool = False) -> set[str]:
    """The project modules path imports, at any depth (function-level imports too); with
    runtime_only, not those under `if TYPE_CHECKING:` (a part naming its owner's type)."""
    out = set()
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if runtime_only and id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known or n.split(".")[0] in ("llmserve", "bench"))
    return out


def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {
        m: {d for d in imports(p, known, runtime_only) if d in known and d != m}
        for m, p in known.items()
    }


def test_each_package_imports_only_the_layers_below() -> None:
    known = modules()
    bad = []
    for module, path in known.items():
        package = layer(module)
        for dep in imports(path, known):
            target = layer(dep)
            allowed = ALLOWED[package] | BENCH_SERVICE_IMPORTS.get(module, set())
            if target != package and target not in allowed:
                bad.append(f"{module} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_nothing_but_tests_imports_tests() -> None:
    """tests/ is no library: a product module or a bench/ script that needs a test helper moves
    the helper into the product (as llmserve.bench.byte_tokenizer was)."""
    bad = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{module} imports {n}" for n in names if n.split(".")[0] == "tests"]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    """No strongly connected component of more than one module (Tarjan's algorithm), in the
    imports that run: a part may name its owner's type for the type checker (the Scheduler's
    policy, slots, swaps and handoffs do), which imports nothing at run time."""
    edges = graph(runtime_only=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"modules importing each other in a loop: {cycles}"


@pytest.mark.parametrize(
    "module",
    [
        "llmserve.scheduler.service.service",
        "llmserve.scheduler.policies.static_batching",
        "llmserve.gateway.service",
        "llmserve.gateway.http",
        "llmserve.cli",
        "llmserve.stack",
        "llmserve.serve_flags",
        "llmserve.client",
    ],
)
def test_torch_free_modules_never_load_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", f"importing {module} loads torch"


TORCH_FREE_FOLDERS = ("llmserve/engine/contract",)


def test_torch_free_folders_never_load_torch() -> None:
    """engine/contract/ (what the engine speaks: the contract, the mirror, the service, the echo
    engine) is torch-free as a folder: every module in it, imported together, loads no torch."""
    names = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for folder in TORCH_FREE_FOLDERS
        for p in (ROOT / folder).rglob("*.py")
    )
    assert len(names) > 5, names
    code = f"import sys, {', '.join(names)}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", f"importing {names} loads torch"


STARTS_PROCESSES = re.compile(
    r'start_stack|start_echo_stack|serve_command|Popen|multiprocessing|\.spawn\(|"serve"'
)


def test_test_modules_that_start_processes_are_marked_stack() -> None:
    """`pytest -m "not stack"` (the fast loop the README gives) leaves out exactly the test
    modules that start service processes: each carries the `stack` marker, and no other."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue  # the pattern itself is written here
        text = path.read_text()
        marked = any(
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            and "pytest.mark.stack" in ast.unparse(node.value)
            for node in ast.parse(text).body
        )
        if marked != bool(STARTS_PROCESSES.search(text)):
            wrong.append(f"{path.name}: marked {marked}")
    assert not wrong, wrong
