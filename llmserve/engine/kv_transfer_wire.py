"""The KV transfer connection's framing, shared by both backends (engine/kv_transfer.py's
`tcp` and engine/kv_transfer_torch.py's `torch`): the challenge, its HMAC under the internal
token, and the header that names the transfer; see engine/kv_transfer.py for the whole exchange.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

CHALLENGE_BYTES = 32
HEADER = struct.Struct("!QIQB")
IO_TIMEOUT_S = 5.0
BACKENDS = ("tcp", "torch")  # the header's backend byte: the index here


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


def connect(
    address: tuple[str, int],
    token: str,
    transfer_id: int,
    num_blocks: int,
    block_bytes: int,
    backend: str,
    timeout_s: float,
) -> socket.socket:
    """A connection to the receiver at address that has answered its challenge and sent the
    header (OSError or TransferError when that fails)."""
    conn = socket.create_connection(address, timeout=timeout_s)
    try:
        challenge = _read_exactly(conn, CHALLENGE_BYTES)
        conn.sendall(_proof(token, challenge))
        conn.sendall(HEADER.pack(transfer_id, num_blocks, block_bytes, BACKENDS.index(backend)))
    except BaseException:
        conn.close()
        raise
    return conn
