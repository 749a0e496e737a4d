"""Moving KV blocks from one engine's pool to another's: the transfer channel of prefill / decode
disaggregation. engine/kv/disaggregation.py runs a plan's sends and receives through it; the
scheduler decides which blocks move, under which transfer id and by when.

One authenticated TCP connection per transfer (challenge, HMAC under the internal token, a
header checked against the receiving pool before anything is allocated); the payload goes on
that connection (`tcp`, this module) or over a process group (`torch`,
engine/kv/transfer_torch.py). Only a whole transfer is delivered. The wire:
docs/disaggregation.md#the-wire.
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time

import torch

from llmserve.common.log import get_logger
from llmserve.engine.kv.transfer_torch import TorchReceiver
from llmserve.engine.kv.transfer_wire import (
    ACCEPTED,
    BACKENDS,
    CHALLENGE_BYTES,
    DTYPES,
    HEADER,
    IO_TIMEOUT_S,
    BlockLayout,
    TransferError,
    _proof,
    _read_exactly,
    connect,
    refuse,
)

__all__ = [
    "BACKENDS", "CHALLENGE_BYTES", "HEADER", "IO_TIMEOUT_S", "BlockLayout", "KVReceiver",
    "TransferError", "block_layout", "connect", "gather_blocks", "send_blocks", "send_payload",
]  # fmt: skip
log = get_logger("llmserve.engine.kv.transfer")


def _block_span(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """One block's shape as it travels: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    layers, kv, _, *block = kv_cache.shape
    return (layers, kv, *block)


def block_layout(kv_cache: torch.Tensor) -> BlockLayout:
    """The layout of one of kv_cache's blocks, as a transfer's header states it."""
    span = _block_span(kv_cache)
    return BlockLayout(
        num_layers=span[0],
        block_size=kv_cache.shape[3],
        dtype=str(kv_cache.dtype).removeprefix("torch."),
        block_bytes=kv_cache.element_size() * int(torch.Size(span).numel()),
    )


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> bytes:
    """The contents of kv_cache's block_ids as they travel: block after block, each its every
    layer's keys and values (a copy: the pool may reuse the blocks once this returns)."""
    blocks = kv_cache[:, :, torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)]
    return bytes(blocks.movedim(2, 0).contiguous().cpu().view(torch.uint8).numpy().tobytes())


def send_blocks(
    address: tuple[str, int],
    token: str,
    transfer_id: int,
    kv_cache: torch.Tensor,
    block_ids: list[int],
    timeout_s: float = IO_TIMEOUT_S,
) -> None:
    """Push the contents of kv_cache's block_ids to the receiver at address under transfer_id.
    Raises TransferError if it is refused, drops or takes longer than timeout_s."""
    payload = gather_blocks(kv_cache, block_ids)
    layout = block_layout(kv_cache)
    send_payload(address, token, transfer_id, payload, len(block_ids), layout, timeout_s)


def send_payload(
    address: tuple[str, int],
    token: str,
    transfer_id: int,
    payload: bytes,
    num_blocks: int,
    layout: BlockLayout,
    timeout_s: float = IO_TIMEOUT_S,
) -> None:
    """Push payload (gather_blocks' num_blocks blocks of layout) to the receiver at address; as
    send_blocks."""
    try:
        with connect(address, token, transfer_id, num_blocks, layout, "tcp", timeout_s) as conn:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            if conn.recv(1) != b"\x01":
                raise TransferError(f"transfer {transfer_id}: the receiver did not accept it")
    except OSError as err:
        raise TransferError(f"transfer {transfer_id} to {address}: {err}") from err


class KVReceiver:
    """Accepts transfers for kv_cache's pool on (host, port) (port 0: a free one, see
    `address`), from senders proving the internal token and using backend; `take` puts one
    into blocks."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "tcp",
    ):
        self.kv_cache = kv_cache
        self.token = token
        self.backend = backend
        self.torch: TorchReceiver | None = None
        if backend == "torch":
            self.torch = TorchReceiver(kv_cache.device)
        self.layout = block_layout(kv_cache)
        self.block_bytes = self.layout.block_bytes
        self.num_blocks = kv_cache.shape[2]
        self.arrived: dict[int, torch.Tensor] = {}
        # Transfers given up (deadline passed, or cancelled) before they arrived: dropped if
        # they arrive after all, so nothing is held for nobody.
        self.given_up: set[int] = set()
        # Transfers whose connection failed after naming them (dropped, timed out, refused
        # block size): reported by `poll_failed`, so the caller need not wait for a deadline.
        self.failed: set[int] = set()
        self.cond = threading.Condition()
        self.server = socket.create_server((host, port))
        self.address: tuple[str, int] = self.server.getsockname()[:2]
        self.closed = False
        threading.Thread(target=self._serve, name="kv-receiver", daemon=True).start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        """One transfer: challenge, header (checked against this pool before anything is
        allocated: refused with the reason otherwise), payload; delivered only whole. Whatever
        goes wrong ends this connection alone, never the receiver."""
        transfer_id: int | None = None
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                challenge = os.urandom(CHALLENGE_BYTES)
                conn.sendall(challenge)
                proof = _read_exactly(conn, len(_proof("", challenge)))
                if not hmac.compare_digest(proof, _proof(self.token, challenge)):
                    log.warning("kv transfer refused: bad internal token")
                    return
                header = HEADER.unpack(_read_exactly(conn, HEADER.size))
                transfer_id, num_blocks = header[0], header[1]
                reason = self._check_header(*header)
                if reason is not None:
                    log.warning("kv transfer refused", transfer_id=transfer_id, reason=reason)
                    refuse(conn, reason)
                    self._fail(transfer_id)
                    return
                conn.sendall(ACCEPTED)
                data = self._receive_payload(conn, transfer_id, num_blocks * self.block_bytes)
                conn.sendall(b"\x01")
            except (OSError, TransferError) as err:
                log.warning("kv transfer dropped", transfer_id=transfer_id, error=str(err))
                self._fail(transfer_id)
                return
            except Exception as err:  # a bug must not end the receiver: this transfer fails
                log.exception("kv transfer failed", transfer_id=transfer_id, error=repr(err))
                self._fail(transfer_id)
                return
        span = _block_span(self.kv_cache)
        with self.cond:
            if transfer_id in self.given_up:
                self.given_up.discard(transfer_id)
                return
            self.arrived[transfer_id] = data.view(self.kv_cache.dtype).view(num_blocks, *span)
            self.cond.notify_all()

    def _check_header(
        self, transfer_id: int, num_blocks: int, block_bytes: int, backend: int,
        num_layers: int, block_size: int, dtype: int,
    ) -> str | None:  # fmt: skip
        """Why this pool refuses the header's transfer (None: it does not)."""
        mine = self.layout
        dtype_name = DTYPES[dtype] if dtype < len(DTYPES) else f"#{dtype}"
        if backend != BACKENDS.index(self.backend):
            name = BACKENDS[backend] if backend < len(BACKENDS) else f"#{backend}"
            return (
                f"transfer {transfer_id}: the sender's --kv-transfer-backend is {name}, "
                f"this engine's {self.backend}; both engines of a pair need the same one"
            )
        for field, theirs, ours in (
            ("num_layers", num_layers, mine.num_layers),
            ("block_size", block_size, mine.block_size),
            ("dtype", dtype_name, mine.dtype),
            ("block_bytes", block_bytes, mine.block_bytes),
        ):
            if theirs != ours:
                return f"transfer {transfer_id}: {field}={theirs}, this pool's is {ours}"
        if not 1 <= num_blocks <= self.num_blocks:
            return (
                f"transfer {transfer_id}: num_blocks={num_blocks} is outside 1..{self.num_blocks}"
                " (this pool's size)"
            )
        return None

    def _receive_payload(
        self, conn: socket.socket, transfer_id: int, num_bytes: int
    ) -> torch.Tensor:
        """The payload after the header: num_bytes into a new uint8 buffer (on the pool's device
        with the torch backend)."""
        if self.torch is not None:
            return self.torch.receive(conn, transfer_id, num_bytes, time.monotonic() + IO_TIMEOUT_S)
        # Pinned for a pool on a GPU: its copy into the pool need not wait for the device.
        data = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.kv_cache.is_cuda)
        _read_exactly(conn, num_bytes, data.numpy().data)
        return data

    def take(self, transfer_id: int, block_ids: list[int], deadline: float) -> bool:
        """Wait until transfer_id has arrived whole (True: its blocks are now block_ids of the
        pool, in order) or time.monotonic() passes deadline (False: nothing written)."""
        with self.cond:
            while transfer_id not in self.arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.given_up.add(transfer_id)
                    return False
                self.cond.wait(left)
            blocks = self.arrived.pop(transfer_id)
        if blocks.shape[0] != len(block_ids):
            return False
        self._write(blocks, block_ids)
        return True

    def _write(self, blocks: torch.Tensor, block_ids: list[int]) -> None:
        """Write an arrived transfer's blocks into block_ids of the pool. On a GPU the copy is
        enqueued on the current stream, after whatever was launched on it, and nothing here
        waits for the device (the payload is pinned host memory or already on the device, the
        block ids go through pinned memory): a step in flight keeps running. On a CPU: now."""
        device = self.kv_cache.device
        index = torch.tensor(block_ids, dtype=torch.long)
        if self.kv_cache.is_cuda:
            index = index.pin_memory()
        index = index.to(device, non_blocking=True)
        self.kv_cache[:, :, index] = blocks.to(device, non_blocking=True).movedim(0, 2)

    def _fail(self, transfer_id: int | None) -> None:
        if transfer_id is None:
            return  # it never said which transfer it was: its deadline will tell
        with self.cond:
            if transfer_id not in self.given_up:
                self.failed.add(transfer_id)
                self.cond.notify_all()

    def poll_failed(self, transfer_id: int) -> bool:
        """Whether transfer_id's connection failed (once: it is forgotten here)."""
        with self.cond:
            if transfer_id in self.failed:
                self.failed.discard(transfer_id)
                return True
            return False

    def poll(self, transfer_id: int, block_ids: list[int]) -> bool:
        """Without waiting: if transfer_id has arrived whole, put it into block_ids (as `take`)
        and return True; else False, changing nothing. One that arrived with another number of
        blocks than block_ids is refused: failed (`poll_failed`), so its request recomputes at
        once rather than at its deadline."""
        with self.cond:
            blocks = self.arrived.pop(transfer_id, None)
            if blocks is not None and blocks.shape[0] != len(block_ids):
                log.warning(
                    "kv transfer refused: another number of blocks than awaited",
                    transfer_id=transfer_id,
                    num_blocks=blocks.shape[0],
                    num_awaited=len(block_ids),
                )
                self.failed.add(transfer_id)
                return False
        if blocks is None:
            return False
        self._write(blocks, block_ids)
        return True

    def wait_any(self, transfer_ids: set[int], timeout_s: float) -> None:
        """Return once one of transfer_ids has arrived, or after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not transfer_ids & (self.arrived.keys() | self.failed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def discard(self, transfer_id: int) -> None:
        """Forget transfer_id, arrived or not (cancelled: its blocks were freed)."""
        with self.cond:
            if self.arrived.pop(transfer_id, None) is None and transfer_id not in self.failed:
                self.given_up.add(transfer_id)
            self.failed.discard(transfer_id)

    def close(self) -> None:
        self.closed = True
        self.server.close()
        if self.torch is not None:
            self.torch.close()
