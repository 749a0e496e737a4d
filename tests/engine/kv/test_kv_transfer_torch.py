"""The `torch` KV transfer backend (engine/kv/transfer_torch.py) on gloo, as it runs between two
CPU engines: the payload over a 2-rank process group made on the pair's first transfer, the
control on the authenticated connection. Whole blocks arrive into the blocks named (the group
reused after); a wrong token is refused before any group exists; a sender killed or stalled
mid-transfer leaves the receiver reporting the transfer failed, its group discarded, and the
next transfer builds a new one; a cancelled transfer is never written; the two backends refuse
each other; --kv-transfer-backend reaches KVTransfers and `llmserve engine --help`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

import llmserve.engine.kv.transfer as kv_transfer
import llmserve.engine.kv.transfer_torch as kv_transfer_torch
from llmserve.engine.kv.transfer import KVReceiver, TransferError, block_layout, send_blocks
from llmserve.engine.kv.transfer_torch import TorchSender, gather_payload

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

SHAPE = (2, 2, 8, 4, 2, 16)  # [layers, 2, blocks, block_size, kv heads, head_dim]
TOKEN = "internal-token"


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    r = KVReceiver(torch.zeros(SHAPE), TOKEN, backend="torch")
    yield r
    r.close()


@pytest.fixture
def sender() -> Iterator[TorchSender]:
    s = TorchSender(torch.device("cpu"))
    yield s
    s.close()


def send(sender: TorchSender, receiver: KVReceiver, transfer_id: int, source: torch.Tensor,
         block_ids: list[int]) -> None:  # fmt: skip
    payload = gather_payload(source, block_ids)
    layout = block_layout(source)
    sender.send(
        receiver.address, TOKEN, transfer_id, payload, len(block_ids), layout, timeout_s=5.0
    )


def wait_failed(receiver: KVReceiver, transfer_id: int, within_s: float) -> float:
    """Seconds until receiver reports transfer_id failed (fails the test after within_s)."""
    t0 = time.monotonic()
    while not receiver.poll_failed(transfer_id):
        assert time.monotonic() - t0 < within_s, f"transfer {transfer_id} not reported failed"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_blocks_arrive_whole_over_the_pairs_group(
    receiver: KVReceiver, sender: TorchSender
) -> None:
    source = torch.randn(SHAPE)
    send(sender, receiver, 1, source, [3, 1, 6])
    assert receiver.take(1, [0, 5, 2], time.monotonic() + 5)
    for src, dst in ((3, 0), (1, 5), (6, 2)):
        assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])
    assert not receiver.kv_cache[:, :, [1, 3, 4, 6, 7]].any()
    assert receiver.torch is not None
    (pair_id, group), = receiver.torch.groups.items()  # fmt: skip
    # The second transfer of the pair reuses its group.
    send(sender, receiver, 2, source, [7])
    assert receiver.take(2, [4], time.monotonic() + 5)
    assert torch.equal(receiver.kv_cache[:, :, 4], source[:, :, 7])
    assert list(receiver.torch.groups.items()) == [(pair_id, group)]
    assert receiver.arrived == {} and receiver.failed == set()


def test_a_wrong_token_is_refused_before_any_group(receiver: KVReceiver) -> None:
    stranger = TorchSender(torch.device("cpu"))
    with pytest.raises(TransferError, match="transfer 8"):
        stranger.send(receiver.address, "not-the-token", 8, gather_payload(torch.randn(SHAPE),
                      [0]), 1, receiver.layout, timeout_s=2.0)  # fmt: skip
    assert not receiver.take(8, [0], time.monotonic() + 0.2)
    assert receiver.torch is not None and not receiver.torch.groups and not stranger.pairs
    assert not receiver.kv_cache.any()


SENDER_SCRIPT = """
import sys, time, torch
import llmserve.engine.kv.transfer_torch as t
address = (sys.argv[1], int(sys.argv[2]))
source = torch.arange({numel}, dtype=torch.float32).view({shape})
sender = t.TorchSender(torch.device("cpu"))
from llmserve.engine.kv.transfer import block_layout
sender.send(address, "{token}", 1, t.gather_payload(source, [2]), 1, block_layout(source))
def stall(group, tensor):
    print("stalling", flush=True)
    time.sleep(60)
t._send_tensor = stall
sender.send(address, "{token}", 2, t.gather_payload(source, [2]), 1, block_layout(source),
            timeout_s=60)
"""


def test_a_sender_killed_mid_transfer_fails_it_and_the_next_builds_a_new_group(
    receiver: KVReceiver, sender: TorchSender
) -> None:
    """A prefill engine (a subprocess) moves one transfer, then dies mid-way through the next."""
    script = SENDER_SCRIPT.format(numel=torch.Size(SHAPE).numel(), shape=SHAPE, token=TOKEN)
    host, port = receiver.address
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), host, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stalling"
        assert receiver.take(1, [0], time.monotonic() + 5)
        assert receiver.torch is not None and not receiver.torch.groups  # in use by transfer 2
        proc.kill()
        assert wait_failed(receiver, 2, within_s=2.0) < 2.0  # the dead peer, not the 5 s timeout
    finally:
        proc.kill()
        proc.wait()
    assert not receiver.take(2, [1], time.monotonic() + 0.1)
    assert not receiver.kv_cache[:, :, 1].any() and not receiver.torch.groups
    source = torch.randn(SHAPE)
    send(sender, receiver, 3, source, [5])
    assert receiver.take(3, [1], time.monotonic() + 5)
    assert torch.equal(receiver.kv_cache[:, :, 1], source[:, :, 5])
    assert len(receiver.torch.groups) == 1


def test_a_stalled_sender_is_given_up_at_the_timeout_and_the_pair_rebuilt(
    receiver: KVReceiver, sender: TorchSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = torch.randn(SHAPE)
    send(sender, receiver, 1, source, [0])  # the pair's group exists
    assert receiver.take(1, [0], time.monotonic() + 5)
    monkeypatch.setattr(kv_transfer, "IO_TIMEOUT_S", 0.5)

    def stall(group: object, tensor: torch.Tensor) -> None:
        time.sleep(1.0)
        raise RuntimeError("stalled")

    monkeypatch.setattr(kv_transfer_torch, "_send_tensor", stall)
    with pytest.raises(TransferError, match="stalled"):
        send(sender, receiver, 2, source, [1])
    assert wait_failed(receiver, 2, within_s=1.0) < 1.0  # at the receiver's 0.5 s
    assert receiver.torch is not None and not receiver.torch.groups and not sender.pairs
    monkeypatch.undo()
    send(sender, receiver, 3, source, [2])
    assert receiver.take(3, [2], time.monotonic() + 5)
    assert torch.equal(receiver.kv_cache[:, :, 2], source[:, :, 2])
    assert not receiver.kv_cache[:, :, 1].any() and len(receiver.torch.groups) == 1


def test_a_cancelled_transfer_is_never_written_through_an_engines_plan() -> None:
    """engine/kv/disaggregation.py with --kv-transfer-backend torch: the send gathers its blocks
    into a device buffer when the plan runs (a later write does not travel), the receive writes
    them when they have arrived, and a transfer cancelled before it arrives never is."""
    from llmserve.common.step_plan import KVReceive, KVSend, StepPlanData
    from llmserve.engine.kv.disaggregation import KVTransfers

    prefill = KVTransfers(torch.randn(SHAPE), "prefill", TOKEN, "127.0.0.1", 0, "torch")
    decode = KVTransfers(torch.zeros(SHAPE), "decode", TOKEN, "127.0.0.1", 0, "torch")
    try:
        sent = prefill.kv_cache[:, :, [4, 2]].clone()
        decode.execute(StepPlanData(1, [], [], kv_receives=[KVReceive(1, [6, 7])]))
        send_1 = KVSend(1, [4, 2], decode.address)
        prefill.execute(StepPlanData(1, [], [], kv_sends=[send_1]))
        prefill.kv_cache[:, :, [4, 2]] = 0.0  # reused after the plan: not sent
        received = poll_until_received(decode, 2)
        assert received == [1] and torch.equal(decode.kv_cache[:, :, [6, 7]], sent)
        decode.execute(StepPlanData(4, [], [], kv_receives=[KVReceive(2, [0])]))
        decode.execute(StepPlanData(5, [], [], kv_receive_cancels=[2]))
        prefill.execute(StepPlanData(2, [], [], kv_sends=[KVSend(2, [1], decode.address)]))
        receiver = decode.receiver
        assert receiver is not None
        deadline = time.monotonic() + 5
        while 2 in receiver.given_up and time.monotonic() < deadline:  # arrived, dropped
            time.sleep(0.01)
        assert receiver.given_up == set() and receiver.arrived == {}
        assert decode.execute(StepPlanData(6, [], [])) == ([], [])
        assert not decode.kv_cache[:, :, 0].any()
        assert prefill.sender is not None and prefill.sender.num_failed == 0
    finally:
        prefill.close()
        decode.close()


def poll_until_received(decode: object, step_id: int) -> list[int]:
    from llmserve.common.step_plan import StepPlanData
    from llmserve.engine.kv.disaggregation import KVTransfers

    assert isinstance(decode, KVTransfers)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        received, failed = decode.execute(StepPlanData(step_id, [], []))
        assert failed == []
        if received:
            return received
    return []


def test_the_two_backends_refuse_each_other(receiver: KVReceiver, sender: TorchSender) -> None:
    """Both engines of a pair need the same backend: the receiver refuses the other one's
    header and reports the transfer failed (the scheduler recomputes at once)."""
    with pytest.raises(TransferError):
        send_blocks(receiver.address, TOKEN, 1, torch.randn(SHAPE), [0], timeout_s=2.0)
    wait_failed(receiver, 1, within_s=2.0)
    tcp_receiver = KVReceiver(torch.zeros(SHAPE), TOKEN)
    try:
        with pytest.raises(TransferError):
            send(sender, tcp_receiver, 2, torch.randn(SHAPE), [0])
        wait_failed(tcp_receiver, 2, within_s=2.0)
        assert not tcp_receiver.kv_cache.any()
    finally:
        tcp_receiver.close()
    assert not receiver.kv_cache.any()


def test_pools_that_cannot_form_a_group_fall_back_to_tcp() -> None:
    """Two engines on one GPU (NCCL cannot join them), or a CPU and a GPU pool: the payload
    goes over the control connection instead."""
    from llmserve.engine.kv.transfer_torch import torch_path

    assert torch_path("cpu", "cpu")
    assert torch_path("cuda:GPU-a", "cuda:GPU-b")
    assert not torch_path("cuda:GPU-a", "cuda:GPU-a")
    assert not torch_path("cpu", "cuda:GPU-a") and not torch_path("cuda:GPU-a", "cpu")
    r = KVReceiver(torch.zeros(SHAPE), TOKEN, backend="torch")
    s = TorchSender(torch.device("cpu"))
    assert r.torch is not None
    r.torch.identity = s.identity = "cuda:GPU-same"  # as two engines on one GPU see it
    try:
        source = torch.randn(SHAPE)
        send(s, r, 1, source, [2, 3])
        assert r.take(1, [0, 1], time.monotonic() + 5)
        assert torch.equal(r.kv_cache[:, :, [0, 1]], source[:, :, [2, 3]])
        assert not r.torch.groups and not s.pairs and r.torch.over_tcp == {"cuda:GPU-same"}
    finally:
        r.close()
        s.close()


def test_the_engine_flag_reaches_kv_transfers() -> None:
    import argparse

    from llmserve.cli import build_parser
    from llmserve.common.flags import add_flags
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.kv.disaggregation import KVTransfers

    for role, backend in (("decode", "torch"), ("prefill", "torch"), ("decode", "tcp")):
        config = EngineConfig(engine_role=role, kv_transfer_backend=backend)
        transfers = KVTransfers.for_engine(torch.zeros(SHAPE), config)
        try:
            if role == "decode":
                assert transfers.receiver is not None
                assert (transfers.receiver.torch is not None) == (backend == "torch")
            else:
                assert transfers.sender is not None and transfers.sender.torch is not None
        finally:
            transfers.close()
    assert EngineConfig().kv_transfer_backend == "tcp"
    with pytest.raises(ValueError, match="kv_transfer_backend='nccl'"):
        EngineConfig(kv_transfer_backend="nccl")
    args = build_parser().parse_args(["engine", "--kv-transfer-backend", "torch"])
    assert args.kv_transfer_backend == "torch"
    # `llmserve engine --help`'s engine part (the whole of it also lists engine/contract/echo.py's
    # flags)
    engine_help = argparse.ArgumentParser(prog="llmserve engine")
    add_flags(engine_help, EngineConfig)
    assert "--kv-transfer-backend {tcp,torch}" in engine_help.format_help()
