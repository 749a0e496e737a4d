"""The KV transfer connection's framing, shared by both backends (engine/kv/transfer.py's
`tcp` and engine/kv/transfer_torch.py's `torch`): the challenge, its HMAC under the internal
token, the header that names the transfer and the receiver's answer to it (accepted, or refused
with its reason, before any payload moves); see engine/kv/transfer.py for the whole exchange.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

CHALLENGE_BYTES = 32
# transfer_id, num_blocks, block_bytes, backend, num_layers, block_size, dtype
HEADER = struct.Struct("!QIQBHIB")
IO_TIMEOUT_S = 5.0
BACKENDS = ("tcp", "torch")  # the header's backend byte: the index here
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
ACCEPTED = b"\x01"
REFUSED = b"\x00"  # then the reason: its length (REASON) and its UTF-8 bytes
REASON = struct.Struct("!H")


@dataclass(frozen=True)
class BlockLayout:
    """One block of a KV pool as a transfer's header states it; the receiver refuses a header
    whose layout is not its pool's."""

    num_layers: int
    block_size: int
    dtype: str  # one of DTYPES
    block_bytes: int


class TransferError(Exception):
    """A transfer that did not complete (refused, dropped, timed out)."""


def _proof(token: str, challenge: bytes) -> bytes:
    return hmac.new(token.encode(), challenge, hashlib.sha256).digest()


def _read_exactly(conn: socket.socket, num_bytes: int, into: memoryview | None = None) -> bytes:
    """num_bytes from conn (into `into` when given); TransferError when it ends first."""
    buffer = into if into is not None else memoryview(bytearray(num_bytes))
    got = 0
    while got < num_bytes:
        n = conn.recv_into(buffer[got:], num_bytes - got)
        if n == 0:
            raise TransferError(f"connection closed after {got} of {num_bytes} bytes")
        got += n
    return bytes(buffer) if into is None else b""


def pack_header(
    transfer_id: int, num_blocks: int, layout: BlockLayout, backend: str | int
) -> bytes:
    backend_index = backend if isinstance(backend, int) else BACKENDS.index(backend)
    dtype = DTYPES.index(layout.dtype) if layout.dtype in DTYPES else 255
    return HEADER.pack(
        transfer_id, num_blocks, layout.block_bytes, backend_index, layout.num_layers,
        layout.block_size, dtype,
    )  # fmt: skip


def refuse(conn: socket.socket, reason: str) -> None:
    """Answer a header with REFUSED and the reason (cut to what REASON can say)."""
    text = reason.encode()[: 2**16 - 1]
    conn.sendall(REFUSED + REASON.pack(len(text)) + text)


def connect(
    address: tuple[str, int],
    token: str,
    transfer_id: int,
    num_blocks: int,
    layout: BlockLayout,
    backend: str,
    timeout_s: float,
) -> socket.socket:
    """A connection to the receiver at address that has answered its challenge, sent the
    header and had it accepted (OSError, or TransferError with the receiver's reason when it
    refused it)."""
    conn = socket.create_connection(address, timeout=timeout_s)
    try:
        challenge = _read_exactly(conn, CHALLENGE_BYTES)
        conn.sendall(_proof(token, challenge))
        conn.sendall(pack_header(transfer_id, num_blocks, layout, backend))
        try:
            answer = _read_exactly(conn, 1)
        except TransferError as err:  # a refused token closes the connection unanswered
            raise TransferError(f"transfer {transfer_id}: no answer to its header ({err})") from err
        if answer != ACCEPTED:
            (length,) = REASON.unpack(_read_exactly(conn, REASON.size))
            reason = _read_exactly(conn, length).decode(errors="replace")
            raise TransferError(f"transfer {transfer_id} refused by the receiver: {reason}")
    except BaseException:
        conn.close()
        raise
    return conn
