"""The C++ client (clients/cpp) built with CMake against gRPC C++ and run against a stack (the
echo engine behind a real scheduler and gateway): it streams a generation, the same text the
Python client gets, and cancels one mid-stream, after which the scheduler holds nothing.

The build is cached under ~/.cache/llmserve/cpp_client/<hash of the sources> (LLMSERVE_KERNEL_CACHE
moves the root, as for the CPU kernels): the first build takes about a minute on 2 cores, a
cached one nothing. Skipped, with the reason, where cmake, a C++ compiler, protoc, the gRPC C++
plugin or gRPC's CMake package is missing (Debian: apt-get install cmake g++ libgrpc++-dev
protobuf-compiler-grpc).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.client import make_request
from tests.stack import Stack, start_echo_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "clients/cpp/CMakeLists.txt",
    ROOT / "clients/cpp/llmserve_client.cc",
    ROOT / "llmserve/protos/api.proto",
    ROOT / "llmserve/protos/common.proto",
]
TOOLS = ("cmake", "c++", "protoc", "grpc_cpp_plugin")
MAX_TOKENS = 200  # 200 steps of 20 ms: the cancelled stream would otherwise run 4 s


def build_dir() -> Path:
    root = os.environ.get("LLMSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "llmserve"
    key = hashlib.sha256()
    for path in SOURCES:
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    return Path(root) / "cpp_client" / key.hexdigest()[:16]


def build_client() -> Path:
    """The llmserve_client binary, built now unless the cache holds one for these sources."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the C++ client's toolchain is missing {', '.join(missing)}")
    target = build_dir()
    binary = target / "llmserve_client"
    if binary.exists():
        return binary
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the cache and renamed into it whole: a build cut short leaves no half binary.
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT / "clients/cpp"), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True,
    )  # fmt: skip
    if configure.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        if "gRPC" in configure.stderr or "Protobuf" in configure.stderr:
            reason = configure.stderr.strip().splitlines()[-1:] or ["?"]
            pytest.skip(f"CMake finds no gRPC C++ / protobuf package: {reason[0]}")
        raise AssertionError(f"cmake configure failed:\n{configure.stderr}")
    built = subprocess.run(["cmake", "--build", str(work), "-j2"], capture_output=True, text=True)
    assert built.returncode == 0, f"the C++ client does not build:\n{built.stdout}{built.stderr}"
    try:
        work.rename(target)
    except OSError:  # another run built it first
        shutil.rmtree(work, ignore_errors=True)
    return binary


@pytest.fixture(scope="module")
def client_binary() -> Path:
    return build_client()


@pytest.fixture(scope="module")
def stack(
    client_binary: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        "--fake-step-delay-ms", "20", "--num-kv-blocks", "64", "--max-model-len", "512",
    )  # fmt: skip
    yield s
    s.close()


def run_client(binary: Path, stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "--address", stack.gateway_address, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_cpp_client_streams_what_the_python_client_gets(client_binary: Path, stack: Stack) -> None:
    prompt = "the C++ client streams"
    run = run_client(client_binary, stack, "--max-tokens", "24", "--ignore-eos", prompt)
    assert run.returncode == 0, run.stderr
    with stack.client() as client:
        expected = client.generate(make_request(prompt, max_tokens=24, ignore_eos=True))
    assert expected.completion_tokens == 24 and expected.text
    assert run.stdout == expected.text
    assert "model=fake-echo" in run.stderr
    assert "finish_reason=FINISH_REASON_LENGTH" in run.stderr
    assert "completion_tokens=24" in run.stderr
    stack.assert_idle()


def test_cpp_client_cancels_mid_stream_and_the_server_frees_it(
    client_binary: Path, stack: Stack
) -> None:
    before = stack.stats()
    args = ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--cancel-after", "3"]
    run = run_client(client_binary, stack, *args, "cancel me")
    assert run.returncode == 0, run.stderr
    assert "cancelled after 3 deltas: CANCELLED" in run.stderr
    assert "finish_reason" not in run.stderr  # it never reached its last message
    # The request was running when cancelled: the scheduler aborts it, nothing stays running
    # or waiting, and every block is free again.
    after = stack.assert_idle()
    generated = after.num_generated_tokens - before.num_generated_tokens
    assert 3 <= generated < MAX_TOKENS
