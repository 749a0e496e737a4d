"""Who may call whom. Two secrets, one mechanism (`Authorization: Bearer <secret>`, compared in
constant time; the gRPC health service stays open for probes):

- the client API key (gateway `--api-key`), asked of every HTTP and gRPC client;
- the internal token, asked of every peer on the internal links (gateway -> scheduler ->
  engine). `llmserve serve` makes a fresh one and hands it to its children with their configs;
  compose has an init service write one to a volume the services read (`--internal-token
  @/path`). Without it, anyone who reaches the engine's port could drive it.

For links between hosts, the internal links also speak TLS (`--tls-cert/--tls-key`), and mutual
TLS when `--tls-ca` is given: each side presents its certificate and checks the other's.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmserve.common.flags import setting
from llmserve.common.net import CHANNEL_OPTIONS, behavior_field

UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send 'Authorization: Bearer <key>'"
PEER_UNAUTHENTICATED = "missing or wrong internal token: only the stack's own services may call"
OPEN_PREFIX = "/grpc.health.v1.Health/"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata of a call that presents secret (none without one)."""
    return (("authorization", f"Bearer {secret}"),) if secret else ()


def is_authorized(authorization: str | None, secret: str) -> bool:
    """Whether an Authorization value carries secret as its Bearer token."""
    token = bearer_token(authorization)
    # compare_digest's time depends only on the length of the secret, never on where they differ.
    same = hmac.compare_digest((token or "").encode(), secret.encode())
    return token is not None and same


def read_secret(value: str | None, base: Path = Path(".")) -> str | None:
    """A secret given as itself or, written @PATH, as the contents of a file (a relative PATH
    is base's). OSError when the file cannot be read."""
    if value and value.startswith("@"):
        return (base / value[1:]).read_text().strip() or None
    return value or None


@dataclass(frozen=True)
class PeerSecurity:
    """The internal links' settings, shared by the three services' configs (a base class)."""

    internal_token: str | None = setting(
        None,
        "the secret every internal call carries (@PATH: read it from a file); `llmserve serve` "
        "makes one",
        secret=True,
        env="LLMSERVE_INTERNAL_TOKEN",
    )
    tls_cert: str | None = setting(None, "PEM certificate for the internal links (TLS)")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_ca: str | None = setting(None, "PEM CA that peers' certificates must chain to (mutual TLS)")

    def token(self) -> str | None:
        return read_secret(self.internal_token)

    def peer_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for calls to a peer service."""
        return bearer_metadata(self.token())

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for this service's port (client certificates required with a CA);
        None: plaintext."""
        if not (self.tls_cert and self.tls_key):
            return None
        pair = [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())]
        ca = Path(self.tls_ca).read_bytes() if self.tls_ca else None
        return grpc.ssl_server_credentials(pair, ca, require_client_auth=ca is not None)

    def channel(self, address: str, aio: bool = True) -> Any:
        """A channel to a peer service (asyncio, or blocking with aio=False), TLS when this
        service has a CA or a certificate (presented to the peer: mutual TLS)."""
        grpc_ = grpc.aio if aio else grpc
        if not (self.tls_ca or self.tls_cert):
            return grpc_.insecure_channel(address, options=CHANNEL_OPTIONS)
        credentials = grpc.ssl_channel_credentials(
            Path(self.tls_ca).read_bytes() if self.tls_ca else None,
            Path(self.tls_key).read_bytes() if self.tls_key else None,
            Path(self.tls_cert).read_bytes() if self.tls_cert else None,
        )
        return grpc_.secure_channel(address, credentials, options=CHANNEL_OPTIONS)

    def check_exposure(self, host: str) -> None:
        """Refuse (ValueError) to listen beyond loopback with nothing keeping strangers out."""
        if self.token() or (self.tls_ca and self.tls_cert):
            return
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ValueError(
                f"host={host} exposes an internal service without --internal-token (or mutual "
                "TLS): anyone who reaches it could drive it. Set LLMSERVE_INTERNAL_TOKEN, or "
                "bind 127.0.0.1"
            )


def authorization_of(details: grpc.HandlerCallDetails) -> str | None:
    metadata = details.invocation_metadata or ()
    value = next((v for k, v in metadata if k == "authorization"), None)
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _checked(
    handler: grpc.RpcMethodHandler | None,
    details: grpc.HandlerCallDetails,
    secret: str,
    message: str,
    aio: bool,
) -> grpc.RpcMethodHandler | None:
    """handler, or for a call without the secret (but the health service's) a handler of the
    same kind that fails it with UNAUTHENTICATED."""
    if handler is None or details.method.startswith(OPEN_PREFIX):
        return handler
    if is_authorized(authorization_of(details), secret):
        return handler
    return denied(handler, grpc.StatusCode.UNAUTHENTICATED, message, aio)


def denied(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, aio: bool = True
) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that fails every call with code and message."""

    async def deny_async(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    def deny(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    return handler._replace(**{behavior_field(handler): deny_async if aio else deny})


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health service's without the secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str, message: str = UNAUTHENTICATED_MESSAGE):
        self.secret, self.message = secret, message

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return _checked(handler, handler_call_details, self.secret, self.message, aio=True)


class SyncBearerInterceptor(grpc.ServerInterceptor):
    """BearerInterceptor for a thread-pool (non-asyncio) server: the engine's."""

    def __init__(self, secret: str, message: str = PEER_UNAUTHENTICATED):
        self.secret, self.message = secret, message

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        return _checked(handler, handler_call_details, self.secret, self.message, aio=False)


def peer_interceptors(security: PeerSecurity, aio: bool = True) -> list[Any]:
    """The interceptors an internal service's server needs: the internal token's check."""
    token = security.token()
    if token is None:
        return []
    return [BearerInterceptor(token, PEER_UNAUTHENTICATED) if aio else SyncBearerInterceptor(token)]
