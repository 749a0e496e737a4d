"""--kv-transfer-host (engine/config.py): where a decode engine reports its KV transfer port to be
reached (EngineInfo.kv_transfer_address), which across machines is not where it binds. Refused
on an engine that takes no transfers, and as a wildcard; by default --host, or for a wildcard
bind this machine's hostname resolved. KV blocks move to a decode engine bound to one loopback
address only (127.0.0.3) because it reports that address."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from llmserve.cli import build_parser
from llmserve.common.flags import from_flags
from llmserve.common.step_plan import KVReceive, KVSend, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.kv.disaggregation import KVTransfers

SHAPE = (2, 2, 8, 4, 2, 16)  # [layers, 2, blocks, block_size, kv heads, head_dim]
TOKEN = "internal-token"


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_refused_on_an_engine_that_takes_no_transfers(role: str) -> None:
    with pytest.raises(ValueError, match=rf"kv_transfer_host='10.0.0.7' .* engine_role='{role}'"):
        EngineConfig(engine_role=role, kv_transfer_host="10.0.0.7")


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="not one a prefill engine can reach"):
        EngineConfig(engine_role="decode", kv_transfer_host=host)


def test_the_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(
        ["engine", "--engine-role", "decode", "--host", "0.0.0.0", "--kv-transfer-host", "dec-1"]
    )
    assert from_flags(EngineConfig, args).kv_transfer_host == "dec-1"
    args = build_parser().parse_args(["engine", "--kv-transfer-host", "dec-1"])
    with pytest.raises(ValueError, match="engine_role='both' takes none"):
        from_flags(EngineConfig, args)


def _decode(host: str, kv_transfer_host: str = "") -> KVTransfers:
    config = EngineConfig(
        engine_role="decode", host=host, kv_transfer_host=kv_transfer_host, internal_token=TOKEN
    )
    return KVTransfers.for_engine(torch.zeros(SHAPE), config)


def test_the_address_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_transfer_host with the port bound; without it the bind address, or for a wildcard
    bind the hostname's address (loopback when the hostname does not resolve); nothing on a
    prefill engine."""
    named = _decode("127.0.0.1", "decode-1.llmserve-decode")
    port = named.receiver.address[1]  # type: ignore[union-attr]
    assert named.address == f"decode-1.llmserve-decode:{port}"
    plain = _decode("127.0.0.1")
    assert plain.address == f"127.0.0.1:{plain.receiver.address[1]}"  # type: ignore[union-attr]
    monkeypatch.setattr(socket, "gethostname", lambda: "node-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"node-7": "10.1.2.3"}[name])
    wildcard = _decode("0.0.0.0")
    assert wildcard.address == f"10.1.2.3:{wildcard.receiver.address[1]}"  # type: ignore[union-attr]

    def unresolved(name: str) -> str:
        raise socket.gaierror(name)

    monkeypatch.setattr(socket, "gethostbyname", unresolved)
    fallback = _decode("0.0.0.0")
    assert fallback.address.startswith("127.0.0.1:")
    prefill = KVTransfers.for_engine(
        torch.zeros(SHAPE), EngineConfig(engine_role="prefill", internal_token=TOKEN)
    )
    assert prefill.address == ""
    for side in (named, plain, wildcard, fallback, prefill):
        side.close()


def test_blocks_reach_a_decode_engine_bound_to_another_loopback_address() -> None:
    """A decode engine bound to 127.0.0.3 only: the prefill engine's send to the address it
    reports arrives."""
    decode = _decode("127.0.0.3", "127.0.0.3")
    assert decode.address.startswith("127.0.0.3:")
    prefill = KVTransfers(torch.randn(SHAPE), "prefill", TOKEN, "127.0.0.2", 0)
    sent = prefill.kv_cache[:, :, [4, 2]].clone()
    decode.execute(StepPlanData(1, [], [], kv_receives=[KVReceive(1, [6, 7])]))
    prefill.execute(StepPlanData(1, [], [], kv_sends=[KVSend(1, [4, 2], decode.address)]))
    deadline = time.monotonic() + 5
    received: list[int] = []
    while not received and time.monotonic() < deadline:
        received, _ = decode.execute(StepPlanData(2, [], []))
    assert received == [1] and torch.equal(decode.kv_cache[:, :, [6, 7]], sent)
    for side in (prefill, decode):
        side.close()


def test_serve_takes_no_kv_transfer_host(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve` runs its engines on one machine's loopback: the setting is one it sets, not a
    flag of its own (like --kv-transfer-port)."""
    from llmserve.serve_flags import parse_serve_flags

    with pytest.raises(SystemExit):
        parse_serve_flags(["--kv-transfer-host", "10.0.0.7"])
    assert "unrecognized arguments: --kv-transfer-host" in capsys.readouterr().err
