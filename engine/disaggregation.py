"""The engine's side of prefill / decode disaggregation (docs/disaggregation.md): the KV
transfers a plan lists (engine.proto's KVSend, KVReceive, kv_receive_cancels), executed over
engine/kv_transfer.py's channel. Which blocks move, under which id and until when, is the
scheduler's; this only executes, in this order, before the plan's mirror update and forward:

1. cancels: transfers the scheduler gave up are forgotten (never written afterwards, even if
   they arrive: their blocks may belong to someone else from this plan on);
2. receives: the transfers this plan adds are awaited; every awaited transfer that has arrived
   whole is written into its blocks now and reported in this step's result, and one whose
   connection failed is reported failed (the scheduler need not wait for its deadline). A
   plan with no rows waits up to POLL_S for one to arrive, so a scheduler polling an idle
   decode engine does not spin;
3. sends: the blocks are read out of the pool now (the scheduler freed them on this side, and
   this plan's forward may reuse them), then pushed by a background thread; a send that fails
   is only logged: the receiving side's deadline turns it into a recompute there.

A test hook, LLMSERVE_KV_TRANSFER_FAULT: `drop` sends the header and half the payload of every
transfer, then closes the connection; `stall` holds every transfer (for 30 s, or while the file
says so) and never sends it; `@PATH` reads one of
those from the file PATH before each send (no file, or an empty one: no fault), so a test can
turn faults on and off in a running engine.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from common.log import get_logger
from engine.config import EngineConfig
from engine.contract import StepPlanData
from engine.kv_transfer import (
    CHALLENGE_BYTES,
    HEADER,
    KVReceiver,
    TransferError,
    _proof,
    _read_exactly,
    gather_blocks,
    send_payload,
)
from engine.mirror import MirrorMismatch

log = get_logger("engine.disaggregation")

POLL_S = 0.01  # how long a plan without rows waits for an awaited transfer
FAULT_ENV = "LLMSERVE_KV_TRANSFER_FAULT"
STALL_S = 30.0


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def advertised_host(host: str) -> str:
    """The address peers reach a listener bound to host at (a wildcard bind: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def read_fault(setting: str) -> str:
    """The fault LLMSERVE_KV_TRANSFER_FAULT's setting asks for now ("" for none)."""
    if not setting.startswith("@"):
        return setting
    try:
        with open(setting[1:]) as f:
            return f.read().strip()
    except OSError:
        return ""


class KVSender:
    """Sends payloads in the background, one at a time, in the order given."""

    def __init__(self, token: str, fault: str = ""):
        self.token = token
        self.fault = fault
        self.outbox: queue.SimpleQueue[tuple[str, int, bytes, int, float] | None] = (
            queue.SimpleQueue()
        )
        self.num_failed = 0
        threading.Thread(target=self._run, name="kv-sender", daemon=True).start()

    def submit(
        self, address: str, transfer_id: int, payload: bytes, num_blocks: int,
        not_before: float = 0.0,
    ) -> None:  # fmt: skip
        """Queue a send; it starts no earlier than not_before (time.monotonic(): a modelled
        link's arrival time, engine/fake.py)."""
        self.outbox.put((address, transfer_id, payload, num_blocks, not_before))

    def close(self) -> None:
        self.outbox.put(None)

    def _run(self) -> None:
        while (item := self.outbox.get()) is not None:
            address, transfer_id, payload, num_blocks, not_before = item
            time.sleep(max(0.0, not_before - time.monotonic()))
            t0 = time.monotonic()
            try:
                fault = read_fault(self.fault)
                if fault:
                    self._send_faulty(
                        fault, _split_address(address), transfer_id, payload, num_blocks
                    )
                else:
                    send_payload(_split_address(address), self.token, transfer_id, payload,
                                 num_blocks)  # fmt: skip
            except TransferError as err:
                self.num_failed += 1
                log.warning("kv transfer not sent", transfer_id=transfer_id, error=str(err))
                continue
            log.debug(
                "kv transfer sent",
                transfer_id=transfer_id,
                num_blocks=num_blocks,
                num_bytes=len(payload),
                ms=round((time.monotonic() - t0) * 1e3, 2),
            )

    def _send_faulty(
        self,
        fault: str,
        address: tuple[str, int],
        transfer_id: int,
        payload: bytes,
        num_blocks: int,
    ) -> None:
        """The test hook: a transfer that drops half-way, or one that stalls."""
        if fault == "stall":  # until the fault is lifted (a file's), at most STALL_S
            deadline = time.monotonic() + STALL_S
            while read_fault(self.fault) == "stall" and time.monotonic() < deadline:
                time.sleep(0.05)
            raise TransferError(f"transfer {transfer_id}: stalled by {FAULT_ENV}")
        try:
            with socket.create_connection(address, timeout=5) as conn:
                challenge = _read_exactly(conn, CHALLENGE_BYTES)
                conn.sendall(_proof(self.token, challenge))
                conn.sendall(HEADER.pack(transfer_id, num_blocks, len(payload) // num_blocks))
                conn.sendall(payload[: len(payload) // 2])
        except OSError as err:
            raise TransferError(f"transfer {transfer_id}: {err}") from err
        raise TransferError(f"transfer {transfer_id}: dropped half-way by {FAULT_ENV}=drop")


class KVTransfers:
    """An engine's transfers by role: a decode engine receives (a KVReceiver on host:port), a
    prefill engine sends; `execute` runs a plan's part (see the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, role: str, token: str, host: str, port: int):
        self.role = role
        self.kv_cache = kv_cache
        fault = os.environ.get(FAULT_ENV, "")
        self.receiver = (
            KVReceiver(kv_cache, token, host, port) if role == "decode" else None
        )  # fmt: skip
        self.sender = KVSender(token, fault) if role == "prefill" else None
        # Transfers awaited: id -> the blocks they go into.
        self.expected: dict[int, list[int]] = {}
        # A modelled link (the echo engine's): a send's number of blocks -> the time
        # (time.monotonic()) before which it may not leave. None: at once.
        self.link: Callable[[int], float] | None = None

    @classmethod
    def for_engine(cls, kv_cache: torch.Tensor, config: EngineConfig) -> KVTransfers:
        """An engine's, by its --engine-role (receiving on --host:--kv-transfer-port)."""
        return cls(
            kv_cache, config.engine_role, config.internal_token, config.host,
            config.kv_transfer_port,
        )  # fmt: skip

    @property
    def address(self) -> str:
        """Where transfers to this engine go (host:port; "" unless it receives)."""
        if self.receiver is None:
            return ""
        host, port = self.receiver.address
        return f"{advertised_host(host)}:{port}"

    def execute(self, plan: StepPlanData) -> tuple[list[int], list[int]]:
        """Run plan's cancels, receives and sends; returns the transfers written into the pool
        now, and the awaited ones whose connection failed (forgotten here). Raises
        MirrorMismatch for a part this engine's role does not take."""
        if (plan.kv_receives or plan.kv_receive_cancels) and self.receiver is None:
            raise MirrorMismatch(f"the plan lists KV receives; this engine's role is {self.role}")
        if plan.kv_sends and self.sender is None:
            raise MirrorMismatch(f"the plan lists KV sends; this engine's role is {self.role}")
        received, failed = self._receive(plan) if self.receiver is not None else ([], [])
        for send in plan.kv_sends:
            assert self.sender is not None
            payload = gather_blocks(self.kv_cache, send.block_ids)
            num_blocks = len(send.block_ids)
            not_before = self.link(num_blocks) if self.link is not None else 0.0
            self.sender.submit(send.address, send.transfer_id, payload, num_blocks, not_before)
        return received, failed

    def _receive(self, plan: StepPlanData) -> tuple[list[int], list[int]]:
        receiver = self.receiver
        assert receiver is not None
        for transfer_id in plan.kv_receive_cancels:
            self.expected.pop(transfer_id, None)
            receiver.discard(transfer_id)
        for receive in plan.kv_receives:
            self.expected[receive.transfer_id] = receive.block_ids
        if self.expected and not (plan.new_requests or plan.running.seq_ids):
            receiver.wait_any(set(self.expected), POLL_S)
        received = [t for t, ids in self.expected.items() if receiver.poll(t, ids)]
        failed = [t for t in self.expected if t not in received and receiver.poll_failed(t)]
        for transfer_id in received + failed:
            del self.expected[transfer_id]
        return received, failed

    def reset(self) -> None:
        """A new Step stream: forget every transfer awaited (arriving later: dropped)."""
        if self.receiver is not None:
            for transfer_id in self.expected:
                self.receiver.discard(transfer_id)
        self.expected.clear()

    def close(self) -> Any:
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()
