"""Shared fixtures. GPU tests are marked `gpu` and skip cleanly where torch sees no CUDA."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmserve.engine.step.cpu_threads import configure_openmp

# The scheduler tests' `make` fixture (a Scheduler driven by a fake engine step).
pytest_plugins = ["tests.scheduler_harness"]

# Services started by tests serve no /metrics unless a test asks (fixed default ports would
# collide with a stack the developer is running); OTEL_* from the developer's shell is ignored.
os.environ["LLMSERVE_METRICS_PORT"] = "0"
for _name in [n for n in os.environ if n.startswith("OTEL_")]:
    del os.environ[_name]
# Nor an API key: test stacks and clients get theirs from the test.
os.environ.pop("LLMSERVE_API_KEY", None)
# Under ./test.sh's workers (two or more), each worker and the stacks it starts run one torch
# (OpenMP) thread: with two threads each, two workers' engines share two cores four ways and spin
# in OpenMP barriers while descheduled. A test that wants threads sets them itself.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# OpenMP threads that sleep when idle, as the engine service sets them (engine/step/cpu_threads.py):
# libgomp's default spin turned a 20 ms decode step into 1.5-3 s on the shared 2-core VM
# (bench/results/omp_wait.json). Before torch loads: libgomp reads it once.
configure_openmp()


HF_REFERENCE_HOW = (
    "re-runs HF transformers (a minute or two) to check tests/data/hf_reference_smollm2.json: "
    "run with `pytest --hf-reference -m hf_reference`"
)


FAMILY_STACKS_HOW = (
    "serves every family from an HF directory and a GGUF, a stack each (minutes): run with "
    "`pytest --family-stacks -m family_stacks tests/system/test_families_stack.py`"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--hf-reference",
        action="store_true",
        help="run the tests marked hf_reference (transformers re-run against tests/data)",
    )
    parser.addoption(
        "--family-stacks",
        action="store_true",
        help="run the tests marked family_stacks (every family through `llmserve serve`)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        group_by_shared_fixture(items)
        # xdist hands out work in collection order; the modules that start processes (minutes
        # of stacks, the bulk of the run) go first so that the many short tests fill the
        # workers at the end instead of one stack running alone there (with tests/ in folders,
        # system/ sorts last).
        items.sort(key=lambda item: item.get_closest_marker("stack") is None)
    for marker, option, how in (
        ("hf_reference", "--hf-reference", HF_REFERENCE_HOW),
        ("family_stacks", "--family-stacks", FAMILY_STACKS_HOW),
    ):
        if not config.getoption(option):
            skip = pytest.mark.skip(reason=how)
            for item in items:
                if item.get_closest_marker(marker) is not None:
                    item.add_marker(skip)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not the keyword: a parameter id "gpu" is a keyword too.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def group_by_shared_fixture(items: list[pytest.Item]) -> None:
    """./test.sh runs three workers with `--dist loadgroup`: a test that uses a module- or
    class-scoped fixture of its own module (a stack, a loaded engine, a baseline), or is marked
    `xdist_group`, joins its module's group, which one worker runs, so the fixture is made once;
    every other test goes to whichever worker is idle, which keeps the two busy to the end. The
    group is written into the node id as xdist's own marker handling does (its hook may run
    before this one, and would not see a marker added here; under pytest 9 it writes where
    pytest no longer reads, see set_node_id)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = item.nodeid.split("::", 1)[0]
        if info is None or "@" in item.nodeid:
            continue
        shared = item.get_closest_marker("xdist_group") is not None or any(
            d.scope in ("module", "class") and d.baseid == module
            for defs in info.name2fixturedefs.values()
            for d in defs
        )
        if shared:
            set_node_id(item, f"{item.nodeid}@{module}")


def set_node_id(item: pytest.Item, nodeid: str) -> None:
    """pytest 9 keeps a node's id as a NodeId in `_id` (xdist 3.8 still writes `_nodeid`, which
    pytest 9 no longer reads: its own xdist_group marks group nothing there)."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(**kwargs) -> directory of a tiny random Llama (tests/factories.make_tiny_llama),
    built once per distinct kwargs per session."""
    from tests.factories import make_tiny_llama

    cache: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(**kwargs: Any) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            directory = tmp_path_factory.mktemp("tiny-llama")
            cache[key] = make_tiny_llama(directory, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def builtin_model_path() -> Path:
    from llmserve.common.model_config import ModelSourceError, builtin_model_path

    try:
        return builtin_model_path()
    except ModelSourceError as err:
        pytest.fail(f"the built-in model must be installed for the test suite: {err}")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For modules of small tensors: one thread is fastest, and immune to a busy machine's
    oversubscription. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only the tiny byte-level tokenizer (tests/factories.py): what
    the gateway needs in front of the echo engine."""
    from tests.factories import write_byte_tokenizer

    directory = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(directory)
    # The gateway reads the tokenizer from a model directory; config.json marks it as one.
    (directory / "config.json").write_text("{}")
    return directory
