"""The KV transfer channel between two engines' pools (engine/kv/transfer.py), in one process
over loopback TCP: whole blocks arrive into the blocks the receiver names; a wrong token, a
connection dropped mid-payload and a sender that never comes each deliver nothing, and the
receiver's wait ends at its deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from llmserve.engine.kv.transfer import KVReceiver, TransferError, send_blocks
from llmserve.engine.kv.transfer_wire import pack_header

SHAPE = (2, 2, 8, 4, 2, 16)  # [layers, 2, blocks, block_size, kv heads, head_dim]
TOKEN = "internal-token"


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    r = KVReceiver(torch.zeros(SHAPE), TOKEN)
    yield r
    r.close()


def test_blocks_arrive_whole_into_the_blocks_named(receiver: KVReceiver) -> None:
    source = torch.randn(SHAPE)
    send_blocks(receiver.address, TOKEN, 7, source, [3, 1, 6])
    assert receiver.take(7, [0, 5, 2], time.monotonic() + 5)
    pool = receiver.kv_cache
    for src, dst in ((3, 0), (1, 5), (6, 2)):
        assert torch.equal(pool[:, :, dst], source[:, :, src])
    assert not pool[:, :, [1, 3, 4, 6, 7]].any()
    assert receiver.arrived == {}


def test_a_transfer_of_another_size_is_reported_failed_not_written(receiver: KVReceiver) -> None:
    """Two blocks arriving where three are awaited: refused at once (failed), nothing written,
    so the request recomputes now rather than at its deadline."""
    send_blocks(receiver.address, TOKEN, 8, torch.randn(SHAPE), [3, 1])
    receiver.wait_any({8}, 5)
    assert not receiver.poll(8, [0, 5, 2])
    assert receiver.poll_failed(8) and not receiver.poll_failed(8)  # reported once
    assert not receiver.kv_cache.any()


def test_a_wrong_token_is_refused_and_the_wait_ends_at_the_deadline(
    receiver: KVReceiver,
) -> None:
    with pytest.raises(TransferError, match="transfer 8"):
        send_blocks(receiver.address, "not-the-token", 8, torch.randn(SHAPE), [0])
    t0 = time.monotonic()
    assert not receiver.take(8, [0], t0 + 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert not receiver.kv_cache.any()


def test_a_connection_dropped_mid_payload_delivers_nothing(receiver: KVReceiver) -> None:
    import hashlib
    import hmac

    with socket.create_connection(receiver.address, timeout=5) as conn:
        challenge = conn.recv(32)
        conn.sendall(hmac.new(TOKEN.encode(), challenge, hashlib.sha256).digest())
        conn.sendall(pack_header(9, 2, receiver.layout, "tcp"))
        assert conn.recv(1) == b"\x01"  # the header is accepted
        conn.sendall(b"\x01" * (receiver.block_bytes + 10))  # one block and a bit, then gone
    deadline = time.monotonic() + 2
    while not receiver.poll_failed(9) and time.monotonic() < deadline:  # reported, not awaited
        time.sleep(0.01)
    assert time.monotonic() < deadline
    assert not receiver.take(9, [0, 1], time.monotonic() + 0.5)
    assert not receiver.kv_cache.any() and 9 in receiver.given_up


def test_a_transfer_arriving_after_it_was_given_up_is_dropped(receiver: KVReceiver) -> None:
    receiver.discard(10)  # cancelled before it arrived
    send_blocks(receiver.address, TOKEN, 10, torch.randn(SHAPE), [2])
    deadline = time.monotonic() + 2
    while 10 in receiver.given_up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.arrived == {} and receiver.given_up == set()


def test_a_receiver_that_is_gone_fails_the_send_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()[:2]
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="transfer 11"):
        send_blocks(address, TOKEN, 11, torch.randn(SHAPE), [0], timeout_s=1.0)
    assert time.monotonic() - t0 < 2.0


def test_an_engines_plan_parts_move_blocks_between_two_pools() -> None:
    """engine/kv/disaggregation.py between a prefill pool and a decode pool: the send reads its
    blocks when the plan runs (a later write does not travel), the receive writes them when they
    have arrived and reports them once, and a transfer cancelled is never written."""
    from llmserve.common.step_plan import KVReceive, KVSend, StepPlanData
    from llmserve.engine.kv.disaggregation import KVTransfers

    prefill = KVTransfers(torch.randn(SHAPE), "prefill", TOKEN, "127.0.0.1", 0)
    decode = KVTransfers(torch.zeros(SHAPE), "decode", TOKEN, "127.0.0.1", 0)
    sent = prefill.kv_cache[:, :, [4, 2]].clone()
    receive = StepPlanData(1, [], [], kv_receives=[KVReceive(1, [6, 7])])
    assert decode.execute(receive) == ([], [])  # nothing arrived yet (an empty plan polls)
    prefill.execute(StepPlanData(1, [], [], kv_sends=[KVSend(1, [4, 2], decode.address)]))
    prefill.kv_cache[:, :, [4, 2]] = 0.0  # the pool reused them after the plan: not sent
    deadline = time.monotonic() + 5
    received: list[int] = []
    while not received and time.monotonic() < deadline:
        received, _ = decode.execute(StepPlanData(2, [], []))
    assert received == [1] and torch.equal(decode.kv_cache[:, :, [6, 7]], sent)
    assert decode.execute(StepPlanData(3, [], [])) == ([], [])  # reported once
    # A transfer cancelled before it arrives is dropped when it does.
    decode.execute(StepPlanData(4, [], [], kv_receives=[KVReceive(2, [0])]))
    decode.execute(StepPlanData(5, [], [], kv_receive_cancels=[2]))
    prefill.execute(StepPlanData(2, [], [], kv_sends=[KVSend(2, [1], decode.address)]))
    time.sleep(0.3)
    assert (
        decode.execute(StepPlanData(6, [], [])) == ([], []) and not decode.kv_cache[:, :, 0].any()
    )
    for side in (prefill, decode):
        side.close()


def test_a_transfer_arriving_after_a_launch_is_written_and_reported_at_the_next_result() -> None:
    """KVTransfers.report (a step's result): a transfer that arrived after the last launch is
    written and reported there, once; one written at a launch is reported at the next result;
    one written but cancelled by a later launch before any result is never reported."""
    from llmserve.common.step_plan import KVReceive, KVSend, StepPlanData
    from llmserve.engine.kv.disaggregation import KVTransfers

    prefill = KVTransfers(torch.randn(SHAPE), "prefill", TOKEN, "127.0.0.1", 0)
    decode = KVTransfers(torch.zeros(SHAPE), "decode", TOKEN, "127.0.0.1", 0)
    receiver = decode.receiver
    assert receiver is not None

    def arrive(transfer_id: int, blocks: list[int]) -> None:
        send = KVSend(transfer_id, blocks, decode.address)
        prefill.execute(StepPlanData(transfer_id, [], [], kv_sends=[send]))
        receiver.wait_any({transfer_id}, 5.0)
        assert transfer_id in receiver.arrived

    decode.receive(StepPlanData(1, [], [], kv_receives=[KVReceive(1, [6, 7])]))
    arrive(1, [4, 2])  # after the launch: only the result can take it
    assert not decode.kv_cache.any()
    assert decode.report() == ([1], [])
    assert torch.equal(decode.kv_cache[:, :, [6, 7]], prefill.kv_cache[:, :, [4, 2]])
    assert decode.report() == ([], [])  # once
    decode.receive(StepPlanData(2, [], [], kv_receives=[KVReceive(2, [0])]))
    arrive(2, [1])
    decode.receive(StepPlanData(3, [], []))  # written at this launch ...
    assert torch.equal(decode.kv_cache[:, :, 0], prefill.kv_cache[:, :, 1])
    assert decode.report() == ([2], [])  # ... reported at the next result, whichever step's
    assert decode.report() == ([], [])
    decode.receive(StepPlanData(4, [], [], kv_receives=[KVReceive(3, [5])]))
    arrive(3, [3])
    decode.receive(StepPlanData(5, [], []))  # written, then given up before any result
    decode.receive(StepPlanData(6, [], [], kv_receive_cancels=[3]))
    assert decode.report() == ([], [])
    for side in (prefill, decode):
        side.close()


@pytest.mark.gpu
def test_on_a_gpu_an_arrived_transfer_is_written_without_waiting_for_the_device() -> None:
    """On a GPU the write of an arrived transfer (tcp: a pinned host payload) is enqueued on
    the current stream behind the work launched there, and the host does not wait for that
    work (a step in flight keeps running while its result reports the transfer)."""
    pool = torch.zeros(SHAPE, device="cuda")
    receiver = KVReceiver(pool, TOKEN)
    try:
        source = torch.randn(SHAPE)
        send_blocks(receiver.address, TOKEN, 7, source, [3, 1])
        receiver.wait_any({7}, 5.0)
        assert receiver.arrived[7].is_pinned()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # a kernel spinning about a second: the step in flight
        t0 = time.monotonic()
        assert receiver.poll(7, [0, 5])
        enqueued_s = time.monotonic() - t0
        torch.cuda.synchronize()
        assert enqueued_s < 0.3
        assert torch.equal(pool[:, :, [0, 5]].cpu(), source[:, :, [3, 1]])
    finally:
        receiver.close()


def _send_header(receiver: KVReceiver, header: bytes) -> bytes:
    """Prove the token, send header; the receiver's whole answer (until it closes)."""
    import hashlib
    import hmac

    with socket.create_connection(receiver.address, timeout=5) as conn:
        challenge = conn.recv(32)
        conn.sendall(hmac.new(TOKEN.encode(), challenge, hashlib.sha256).digest())
        conn.sendall(header)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_blocks": 2**32 - 1}, "num_blocks=4294967295 is outside 1..8"),
        ({"num_blocks": 0}, "num_blocks=0 is outside 1..8"),
        ({"num_layers": 3}, "num_layers=3, this pool's is 2"),
        ({"block_size": 16}, "block_size=16, this pool's is 4"),
        ({"dtype": "bfloat16"}, "dtype=bfloat16, this pool's is float32"),
        ({"block_bytes": 2**63}, f"block_bytes={2**63}, this pool's is"),
    ],
)
def test_a_header_not_matching_the_pool_is_refused_before_anything_is_allocated(
    receiver: KVReceiver, change: dict, named: str
) -> None:
    """A peer holding the internal token can still send a bad header (a bug, another version,
    a hostile peer): each field is checked against this pool first, the refusal names it, the
    transfer is reported failed at once, and the receiver goes on taking transfers."""
    from dataclasses import replace

    fields = {"num_layers", "block_size", "dtype", "block_bytes"}
    layout = replace(receiver.layout, **{k: v for k, v in change.items() if k in fields})
    answer = _send_header(receiver, pack_header(12, change.get("num_blocks", 2), layout, "tcp"))
    assert answer[:1] == b"\x00" and named in answer[3:].decode(), answer
    deadline = time.monotonic() + 2
    while not receiver.poll_failed(12) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() < deadline, "the refused transfer was not reported failed"
    send_blocks(receiver.address, TOKEN, 13, sent := torch.randn(SHAPE), [5])  # still serving
    assert receiver.take(13, [1], time.monotonic() + 5)
    assert torch.equal(receiver.kv_cache[:, :, 1], sent[:, :, 5])


def test_the_sender_reports_the_receivers_refusal() -> None:
    """A pool of another layout (here: bfloat16 blocks of the same byte size would not do, so
    another number of layers) is refused before its payload moves, and send_blocks says why."""
    receiver = KVReceiver(torch.zeros(SHAPE), TOKEN)
    try:
        other = (3, *SHAPE[1:])
        with pytest.raises(TransferError, match=r"refused by the receiver: .*num_layers=3"):
            send_blocks(receiver.address, TOKEN, 14, torch.randn(other), [0])
        assert receiver.arrived == {} and not receiver.kv_cache.any()
    finally:
        receiver.close()
