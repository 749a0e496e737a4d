"""The `torch` KV transfer backend (--kv-transfer-backend torch): a transfer's payload moves by
torch.distributed send / recv over a 2-rank process group per (sending engine, receiving engine)
pair, NCCL between two GPUs, gloo on CPUs. The control (challenge, header, the final ack) stays
on engine/kv/transfer.py's authenticated connection, which also relays the group's rendezvous
(RelayStore), so no unauthenticated store port is opened. A pair that cannot form a group (two
engines on one GPU, a CPU pool and a GPU pool) answers `T` and falls back to the tcp payload.
Groups are made lazily, without a default group, and aborted on any failure or deadline.
The wire, the trade-offs and the measurements: docs/disaggregation.md#transfer-backends.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist

from llmserve.common.log import get_logger
from llmserve.engine.kv.transfer_wire import (
    IO_TIMEOUT_S,
    BlockLayout,
    TransferError,
    _read_exactly,
    connect,
)

if TYPE_CHECKING:
    Group: TypeAlias = dist.ProcessGroupGloo | dist.ProcessGroupNCCL

log = get_logger("llmserve.engine.kv.transfer")

PAIR_ID_BYTES = 16
KNOWN, NEW, OVER_TCP = b"K", b"N", b"T"
FRAME = struct.Struct("!cHI")  # kind (S: set, D: done), key length, value length
SET, DONE = b"S", b"D"
IDENTITY = struct.Struct("!H")
MAX_GROUPS = 16  # a receiver's pairs kept at most (least recently used out)
POLL_S = 0.0005


def device_identity(device: torch.device) -> str:
    """What the peer compares: "cpu", or "cuda:" and the physical GPU's UUID (two processes on
    one GPU see the same one, whatever their CUDA_VISIBLE_DEVICES)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    return device.type


def torch_path(mine: str, peer: str) -> bool:
    """Whether pools on these devices can move KV over a process group: both on CPUs (gloo) or
    on two different GPUs (NCCL)."""
    if mine == peer == "cpu":
        return True
    return mine.startswith("cuda:") and peer.startswith("cuda:") and mine != peer


class RelayStore(dist.Store):
    """A 2-rank group's rendezvous store over the pair's authenticated connection: `set` keeps
    the value and sends it to the peer; `get` / `wait` block until the key is known (set here or
    by the peer), the connection fails or the deadline passes (then raise). `finish` ends it:
    sends DONE and waits for the peer's, so the connection is free for the ack after; a `set`
    after that (a backend's late bookkeeping) is kept here only. Nothing here raises into the
    backend's own threads but `get` / `wait`."""

    def __init__(self, conn: socket.socket, deadline: float):
        super().__init__()
        self.conn = conn
        self.deadline = deadline
        self.values: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.send_lock = threading.Lock()
        self.peer_done = False
        self.finished = False
        self.error = ""
        self.reader = threading.Thread(target=self._read, name="kv-relay", daemon=True)
        self.reader.start()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self.cond:
            self.values[key] = data
            self.cond.notify_all()
        self._send(SET, key.encode(), data)

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self.cond:
            return self.values[key]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        with self.cond:
            while not all(key in self.values for key in keys):
                left = self.deadline - time.monotonic()
                if self.error or left <= 0:
                    raise TransferError(
                        f"rendezvous: waiting for {keys}: {self.error or 'timeout'}"
                    )
                self.cond.wait(left)

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            return all(key in self.values for key in keys)

    def finish(self) -> None:
        """Send DONE and wait for the peer's (TransferError if it does not come in time)."""
        self._send(DONE, b"", b"")
        self.finished = True
        self.reader.join(max(0.0, self.deadline - time.monotonic()))
        if not self.peer_done:
            raise TransferError(f"rendezvous: the peer did not finish: {self.error or 'timeout'}")

    def _send(self, kind: bytes, key: bytes, value: bytes) -> None:
        """Send a frame (after `finish`: nothing); a failure is recorded for the waits."""
        try:
            with self.send_lock:
                if not self.finished:
                    self.conn.sendall(FRAME.pack(kind, len(key), len(value)) + key + value)
        except OSError as err:
            with self.cond:
                self.error = self.error or f"send: {err}"
                self.cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                kind, key_len, value_len = FRAME.unpack(_read_exactly(self.conn, FRAME.size))
                key = _read_exactly(self.conn, key_len).decode() if key_len else ""
                value = _read_exactly(self.conn, value_len) if value_len else b""
                with self.cond:
                    if kind == DONE:
                        self.peer_done = True
                        return
                    self.values[key] = value
                    self.cond.notify_all()
        except (OSError, TransferError, UnicodeDecodeError) as err:
            with self.cond:
                self.error = str(err) or type(err).__name__
                self.cond.notify_all()


def make_group(
    store: dist.Store, rank: int, device: torch.device, host: str, timeout_s: float
) -> Group:
    """The pair's 2-rank group on store (rank 0 sends, rank 1 receives): NCCL for a GPU pool,
    gloo bound to host otherwise. No default group is made or touched."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def discard_group(group: Group) -> None:
    """Abort group (its peer is gone or stalled: nothing of it is reused)."""
    try:
        group.abort()
    except Exception as err:  # an abort that fails still drops our reference
        log.debug("kv transfer group abort failed", error=str(err))


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _send_tensor(group: Group, tensor: torch.Tensor) -> dist.Work:
    return group.send([tensor], 1, 0)  # type: ignore[union-attr]  # (not in torch's stubs)


def _recv_tensor(group: Group, tensor: torch.Tensor) -> dist.Work:
    return group.recv([tensor], 0, 0)  # type: ignore[union-attr]


def wait_work(work: dist.Work, deadline: float, what: str, nccl: bool) -> None:
    """Wait for work until it completes (TransferError with its error, if any) or the deadline
    passes (TransferError). gloo's send / recv take the wait's timeout; an NCCL work is polled
    instead (its wait does not block the host, and a stalled peer must not hold this thread
    past the deadline)."""
    try:
        if not nccl:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            return
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TransferError(f"{what}: timed out")
            time.sleep(POLL_S)
        work.wait()
    except RuntimeError as err:
        raise TransferError(f"{what}: {err}") from err


@dataclass
class DevicePayload:
    """A send's gathered blocks: one contiguous uint8 buffer on the pool's device, and on a GPU
    the event after the gather (the send waits for it on its own thread's stream)."""

    data: torch.Tensor
    ready: torch.cuda.Event | None = None


def gather_payload(kv_cache: torch.Tensor, block_ids: list[int]) -> DevicePayload:
    """kv_cache's block_ids as they travel (engine/kv/transfer.py's order) in a new buffer on
    the pool's device: the pool may reuse the blocks once this returns."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    data = kv_cache[:, :, index].movedim(2, 0).contiguous().reshape(-1).view(torch.uint8)
    ready = None
    if data.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return DevicePayload(data, ready)


@dataclass
class _Pair:
    pair_id: bytes
    group: Group


class TorchSender:
    """The sending side: one group per receiver address, made on the first transfer to it and
    dropped after a failure. One transfer at a time (engine/kv/disaggregation.py's KVSender
    thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.identity = device_identity(device)
        self.pairs: dict[tuple[str, int], _Pair] = {}
        self.over_tcp: set[tuple[str, int]] = set()

    def send(
        self,
        address: tuple[str, int],
        token: str,
        transfer_id: int,
        payload: DevicePayload,
        num_blocks: int,
        layout: BlockLayout,
        timeout_s: float = IO_TIMEOUT_S,
    ) -> None:
        """Push payload (gather_payload's num_blocks blocks of layout) to the receiver at
        address under transfer_id; TransferError if it is refused, fails or takes longer than
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        try:
            with connect(
                address, token, transfer_id, num_blocks, layout, "torch", timeout_s
            ) as conn:
                self._exchange(conn, address, transfer_id, payload, deadline)
                if conn.recv(1) != b"\x01":
                    raise TransferError(f"transfer {transfer_id}: the receiver did not accept it")
        except OSError as err:
            raise TransferError(f"transfer {transfer_id} to {address}: {err}") from err

    def _exchange(
        self,
        conn: socket.socket,
        address: tuple[str, int],
        transfer_id: int,
        payload: DevicePayload,
        deadline: float,
    ) -> None:
        """After the header on conn: the pair's exchange and the payload (module docstring);
        TransferError (and the pair's group discarded) when it does not complete."""
        pair = self.pairs.pop(address, None)
        pair_id = pair.pair_id if pair is not None else os.urandom(PAIR_ID_BYTES)
        identity = self.identity.encode()
        try:
            conn.sendall(pair_id + IDENTITY.pack(len(identity)) + identity)
            answer = _read_exactly(conn, 1)
            if answer == OVER_TCP:
                self._send_over_tcp(conn, address, payload)
                return
            if answer == KNOWN and pair is not None:
                self._send_on(pair.group, payload, deadline, transfer_id)
            elif answer == NEW:
                if pair is not None:
                    discard_group(pair.group)
                    pair = None
                store = RelayStore(conn, deadline)
                host = conn.getsockname()[0]
                pair = _Pair(pair_id, make_group(store, 0, self.device, host, _left(deadline)))
                self._send_on(pair.group, payload, deadline, transfer_id)
                store.finish()
            else:
                raise TransferError(f"transfer {transfer_id}: refused (answer {answer!r})")
        except (OSError, TransferError, RuntimeError) as err:
            if pair is not None:
                discard_group(pair.group)
            raise TransferError(f"transfer {transfer_id} to {address}: {err}") from err
        self.pairs[address] = pair

    def _send_on(
        self, group: Group, payload: DevicePayload, deadline: float, transfer_id: int
    ) -> None:
        if payload.ready is not None:
            torch.cuda.current_stream(payload.data.device).wait_event(payload.ready)
        work = _send_tensor(group, payload.data)
        wait_work(work, deadline, f"transfer {transfer_id}: send", payload.data.is_cuda)

    def _send_over_tcp(
        self, conn: socket.socket, address: tuple[str, int], payload: DevicePayload
    ) -> None:
        if address not in self.over_tcp:
            self.over_tcp.add(address)
            log.warning(
                "kv transfer backend torch: this pair cannot use a process group (two engines "
                "on one GPU, or a CPU pool and a GPU pool); its payloads go over TCP",
                peer=f"{address[0]}:{address[1]}",
            )
        if payload.ready is not None:
            payload.ready.synchronize()
        conn.sendall(payload.data.cpu().numpy().data)

    def close(self) -> None:
        for pair in self.pairs.values():
            discard_group(pair.group)
        self.pairs.clear()


class TorchReceiver:
    """The receiving side: the groups of the pairs that sent here (by pair id, at most
    MAX_GROUPS, least recently used out), each used by one transfer at a time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.identity = device_identity(device)
        self.groups: OrderedDict[bytes, Group] = OrderedDict()
        self.lock = threading.Lock()
        self.over_tcp: set[str] = set()

    def receive(
        self, conn: socket.socket, transfer_id: int, num_bytes: int, deadline: float
    ) -> torch.Tensor:
        """After the header on conn: the pair's exchange and the payload, into a new uint8
        buffer of num_bytes on the pool's device (on the host for a pair over TCP);
        TransferError (and the pair's group discarded) when it does not complete."""
        pair_id = _read_exactly(conn, PAIR_ID_BYTES)
        (length,) = IDENTITY.unpack(_read_exactly(conn, IDENTITY.size))
        peer = _read_exactly(conn, length).decode(errors="replace")
        if not torch_path(self.identity, peer):
            return self._receive_over_tcp(conn, peer, num_bytes)
        with self.lock:
            # Taken out of the table while this transfer uses it, so no other one shares it.
            group = self.groups.pop(pair_id, None)
        data = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        what = f"transfer {transfer_id}: recv"
        try:
            if group is not None:
                conn.sendall(KNOWN)
                wait_work(_recv_tensor(group, data), deadline, what, data.is_cuda)
            else:
                conn.sendall(NEW)
                store = RelayStore(conn, deadline)
                host = conn.getsockname()[0]
                group = make_group(store, 1, self.device, host, _left(deadline))
                wait_work(_recv_tensor(group, data), deadline, what, data.is_cuda)
                store.finish()
        except (OSError, TransferError, RuntimeError) as err:
            if group is not None:
                discard_group(group)
            raise TransferError(f"transfer {transfer_id}: {err}") from err
        self._keep(pair_id, group)
        return data

    def _keep(self, pair_id: bytes, group: Group) -> None:
        with self.lock:
            self.groups[pair_id] = group
            while len(self.groups) > MAX_GROUPS:
                discard_group(self.groups.popitem(last=False)[1])

    def _receive_over_tcp(self, conn: socket.socket, peer: str, num_bytes: int) -> torch.Tensor:
        if peer not in self.over_tcp:
            self.over_tcp.add(peer)
            log.warning(
                "kv transfer backend torch: the sender's pool and this one cannot form a process "
                "group (NCCL needs two different GPUs, gloo two CPU pools); this pair's "
                "payloads go over TCP",
                sender_device=peer,
                device=self.identity,
            )
        conn.sendall(OVER_TCP)
        # Pinned for a pool on a GPU, as the tcp backend's (KVReceiver._write).
        data = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        _read_exactly(conn, num_bytes, data.numpy().data)
        return data

    def close(self) -> None:
        with self.lock:
            for group in self.groups.values():
                discard_group(group)
            self.groups.clear()
