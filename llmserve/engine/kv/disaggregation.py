"""The engine's side of prefill / decode disaggregation (docs/disaggregation.md): executes the
KV transfers a plan lists (KVSend, KVReceive, kv_receive_cancels) over engine/kv/transfer.py's
channel, before the plan's mirror update and forward. The scheduler decides; this only runs,
in order: sends (blocks read out of the pool now, pushed by a background thread), cancels
(never written afterwards), receives (every arrived transfer written into its blocks; a failed
one given up). `report` also writes what arrived while a step ran, so an arrival is reported in
that step's result, each transfer exactly once; this is safe because the scheduler keeps those
blocks pinned in no block table (docs/disaggregation.md#reporting-an-arrival-at-the-result).
The LLMSERVE_KV_TRANSFER_FAULT test hook: docs/disaggregation.md#failures.
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

from llmserve.common.log import get_logger
from llmserve.common.step_plan import StepPlanData
from llmserve.engine.config import WILDCARD_HOSTS, EngineConfig
from llmserve.engine.contract.mirror import MirrorMismatch
from llmserve.engine.kv.transfer import (
    BlockLayout,
    KVReceiver,
    TransferError,
    block_layout,
    connect,
    gather_blocks,
    send_payload,
)
from llmserve.engine.kv.transfer_torch import DevicePayload, TorchSender, gather_payload

log = get_logger("llmserve.engine.kv.disaggregation")

POLL_S = 0.01  # how long a plan without rows waits for an awaited transfer
FAULT_ENV = "LLMSERVE_KV_TRANSFER_FAULT"
STALL_S = 30.0


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def advertised_host(host: str) -> str:
    """The address peers reach a listener bound to host at: host, or for a wildcard bind this
    machine's hostname resolved (loopback when it does not resolve)."""
    if host not in ("", *WILDCARD_HOSTS):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def read_fault(setting: str) -> str:
    """The fault LLMSERVE_KV_TRANSFER_FAULT's setting asks for now ("" for none)."""
    if not setting.startswith("@"):
        return setting
    try:
        with open(setting[1:]) as f:
            return f.read().strip()
    except OSError:
        return ""


Payload = bytes | DevicePayload  # tcp's host bytes | torch's device buffer


class KVSender:
    """Sends payloads in the background, one at a time, in the order given, by backend
    ("torch": over a process group per receiver, on device's pools)."""

    def __init__(
        self,
        token: str,
        fault: str = "",
        backend: str = "tcp",
        device: torch.device | None = None,
        layout: BlockLayout | None = None,
    ):
        """layout: the sending pool's blocks, as each transfer's header states them."""
        self.token = token
        self.layout = layout or BlockLayout(0, 0, "float32", 0)
        self.fault = fault
        self.backend = backend
        self.torch = TorchSender(device or torch.device("cpu")) if backend == "torch" else None
        self.outbox: queue.SimpleQueue[tuple[str, int, Payload, int, float] | None] = (
            queue.SimpleQueue()
        )
        self.num_failed = 0
        threading.Thread(target=self._run, name="kv-sender", daemon=True).start()

    def submit(
        self, address: str, transfer_id: int, payload: Payload, num_blocks: int,
        not_before: float = 0.0,
    ) -> None:  # fmt: skip
        """Queue a send; it starts no earlier than not_before (time.monotonic(): a modelled
        link's arrival time, engine/contract/echo.py)."""
        self.outbox.put((address, transfer_id, payload, num_blocks, not_before))

    def close(self) -> None:
        self.outbox.put(None)

    def _send(self, address: tuple[str, int], transfer_id: int, payload: Payload, n: int) -> None:
        if isinstance(payload, DevicePayload):
            assert self.torch is not None
            self.torch.send(address, self.token, transfer_id, payload, n, self.layout)
        else:
            send_payload(address, self.token, transfer_id, payload, n, self.layout)

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
                    self._send(_split_address(address), transfer_id, payload, num_blocks)
            except TransferError as err:
                self.num_failed += 1
                log.warning("kv transfer not sent", transfer_id=transfer_id, error=str(err))
                continue
            log.debug(
                "kv transfer sent",
                transfer_id=transfer_id,
                num_blocks=num_blocks,
                num_bytes=_num_bytes(payload),
                ms=round((time.monotonic() - t0) * 1e3, 2),
            )

    def _send_faulty(
        self,
        fault: str,
        address: tuple[str, int],
        transfer_id: int,
        payload: Payload,
        num_blocks: int,
    ) -> None:
        """The test hook: a transfer that drops half-way, or one that stalls."""
        if fault == "stall":  # until the fault is lifted (a file's), at most STALL_S
            deadline = time.monotonic() + STALL_S
            while read_fault(self.fault) == "stall" and time.monotonic() < deadline:
                time.sleep(0.05)
            raise TransferError(f"transfer {transfer_id}: stalled by {FAULT_ENV}")
        num_bytes = _num_bytes(payload)
        try:
            with connect(
                address, self.token, transfer_id, num_blocks, self.layout, self.backend,
                timeout_s=5,
            ) as conn:  # fmt: skip
                if isinstance(payload, bytes):
                    conn.sendall(payload[: num_bytes // 2])
        except OSError as err:
            raise TransferError(f"transfer {transfer_id}: {err}") from err
        raise TransferError(f"transfer {transfer_id}: dropped half-way by {FAULT_ENV}=drop")


def _num_bytes(payload: Payload) -> int:
    return payload.data.numel() if isinstance(payload, DevicePayload) else len(payload)


class KVTransfers:
    """An engine's transfers by role: a decode engine receives (a KVReceiver on host:port), a
    prefill engine sends; `execute` runs a plan's part (see the module docstring). backend:
    --kv-transfer-backend (the same on both engines of a pair)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        role: str,
        token: str,
        host: str,
        port: int,
        backend: str = "tcp",
        advertise: str = "",
    ):
        self.role = role
        self.kv_cache = kv_cache
        self.backend = backend
        fault = os.environ.get(FAULT_ENV, "")
        self.receiver = (
            KVReceiver(kv_cache, token, host, port, backend) if role == "decode" else None
        )  # fmt: skip
        self.sender = (
            KVSender(token, fault, backend, kv_cache.device, block_layout(kv_cache))
            if role == "prefill"
            else None
        )  # fmt: skip
        # Where peers send to: --kv-transfer-host, else where the bound address is reachable.
        self.advertised = ""
        if self.receiver is not None:
            bound, bound_port = self.receiver.address
            self.advertised = advertise or advertised_host(bound)
            log.info("kv transfers taken", bound=f"{bound}:{bound_port}", address=self.address)
        # Transfers awaited: id -> the blocks they go into.
        self.expected: dict[int, list[int]] = {}
        # Transfers written into the pool, and awaited ones that failed, not reported yet.
        self.written: list[int] = []
        self.failed: list[int] = []
        # A modelled link (the echo engine's): a send's number of blocks -> the time
        # (time.monotonic()) before which it may not leave. None: at once.
        self.link: Callable[[int], float] | None = None

    @classmethod
    def for_engine(cls, kv_cache: torch.Tensor, config: EngineConfig) -> KVTransfers:
        """An engine's, by its --engine-role (receiving on --host:--kv-transfer-port, reached
        at --kv-transfer-host) and --kv-transfer-backend."""
        return cls(
            kv_cache, config.engine_role, config.token() or "", config.host,
            config.kv_transfer_port, config.kv_transfer_backend, config.kv_transfer_host,
        )  # fmt: skip

    @property
    def address(self) -> str:
        """Where transfers to this engine go (host:port; "" unless it receives)."""
        if self.receiver is None:
            return ""
        return f"{self.advertised}:{self.receiver.address[1]}"

    def execute(self, plan: StepPlanData) -> tuple[list[int], list[int]]:
        """Run plan's sends, then its cancels and receives (an engine with no offload tier;
        Engine.launch runs its copies between the two), and `report` as its result would."""
        self.send(plan)
        self.receive(plan)
        return self.report()

    def send(self, plan: StepPlanData) -> None:
        """Read plan's sends out of the pool and push them in the background. Before the
        plan's KV copies: a block freed at its request's handoff may be a swap-in's target in
        this same plan. MirrorMismatch on an engine that does not send."""
        if plan.kv_sends and self.sender is None:
            raise MirrorMismatch(f"the plan lists KV sends; this engine's role is {self.role}")
        for send in plan.kv_sends:
            assert self.sender is not None
            payload: Payload = (
                gather_payload(self.kv_cache, send.block_ids)
                if self.backend == "torch"
                else gather_blocks(self.kv_cache, send.block_ids)
            )
            num_blocks = len(send.block_ids)
            not_before = self.link(num_blocks) if self.link is not None else 0.0
            self.sender.submit(send.address, send.transfer_id, payload, num_blocks, not_before)

    def receive(self, plan: StepPlanData) -> None:
        """Run plan's cancels and receives at its launch, and write the awaited transfers
        arrived whole (the next `report` lists them). After the plan's KV copies: a block
        pinned for a transfer may have been evicted to a lower tier by this same plan, its
        old contents copied out first. MirrorMismatch on an engine that does not receive."""
        if (plan.kv_receives or plan.kv_receive_cancels) and self.receiver is None:
            raise MirrorMismatch(f"the plan lists KV receives; this engine's role is {self.role}")
        receiver = self.receiver
        if receiver is None:
            return
        for transfer_id in plan.kv_receive_cancels:
            self.expected.pop(transfer_id, None)
            receiver.discard(transfer_id)
            for unreported in (self.written, self.failed):  # given up: not reported either
                if transfer_id in unreported:
                    unreported.remove(transfer_id)
        for receive in plan.kv_receives:
            self.expected[receive.transfer_id] = receive.block_ids
        if self.expected and not (plan.new_requests or plan.running.seq_ids):
            receiver.wait_any(set(self.expected), POLL_S)
        self._take_arrived()

    def report(self) -> tuple[list[int], list[int]]:
        """At a step's result: write the awaited transfers arrived whole since the last check
        (see the module docstring for why that is safe with steps in flight), then return the
        transfers written and those failed since the last report, and forget them (each is
        reported once)."""
        self._take_arrived()
        reported = self.written, self.failed
        self.written, self.failed = [], []
        return reported

    def _take_arrived(self) -> None:
        """Write every awaited transfer that has arrived whole; give up those whose
        connection failed. Both are then no longer awaited, and wait for `report`."""
        receiver = self.receiver
        if receiver is None or not self.expected:
            return
        received = [t for t, ids in self.expected.items() if receiver.poll(t, ids)]
        failed = [t for t in self.expected if t not in received and receiver.poll_failed(t)]
        for transfer_id in received + failed:
            del self.expected[transfer_id]
        self.written += received
        self.failed += failed

    def reset(self) -> None:
        """A new Step stream: forget every transfer awaited (arriving later: dropped)."""
        if self.receiver is not None:
            for transfer_id in self.expected:
                self.receiver.discard(transfer_id)
        self.expected.clear()
        self.written.clear()
        self.failed.clear()

    def close(self) -> Any:
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()
            if self.sender.torch is not None:
                self.sender.torch.close()
