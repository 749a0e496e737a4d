"""The committed stubs are what scripts/gen_protos.py makes from protos/*.proto, and they load
under the GPU machine's grpcio 1.84 and protobuf 7.36."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import ROOT

GPU_MACHINE_GRPCIO = (1, 84, 0)
GPU_MACHINE_PROTOBUF = (7, 36, 2)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "llmserve" / "protos").glob("*_pb2*")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "llmserve" / "protos").glob("*_pb2*")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run scripts/gen_protos.py"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "llmserve" / "protos").glob("*_pb2_grpc.py")), ids=lambda p: p.name
)
def test_grpc_stubs_load_under_grpcio_184(path: Path) -> None:
    match = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", path.read_text())
    assert match and _version(match.group(1)) <= GPU_MACHINE_GRPCIO


@pytest.mark.parametrize(
    "path", sorted((ROOT / "llmserve" / "protos").glob("*_pb2.py")), ids=lambda p: p.name
)
def test_message_stubs_load_under_protobuf_736(path: Path) -> None:
    match = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
        r"(\d+),\s*(\d+),\s*(\d+),",
        path.read_text(),
    )
    assert match
    gencode = tuple(int(x) for x in match.groups())
    assert gencode <= GPU_MACHINE_PROTOBUF and gencode[0] == GPU_MACHINE_PROTOBUF[0]


def test_services_have_the_contract_methods() -> None:
    from llmserve.protos import api_pb2, engine_pb2, scheduler_pb2

    def methods(module: object, service: str) -> set[str]:
        return {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}

    assert methods(api_pb2, "Generation") >= {"Generate", "GetModelInfo"}
    assert methods(scheduler_pb2, "Scheduler") >= {"Submit", "GetInfo", "GetStats"}
    step = engine_pb2.DESCRIPTOR.services_by_name["Engine"].methods_by_name["Step"]
    assert step.client_streaming and step.server_streaming
