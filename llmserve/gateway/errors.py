"""The gateway's error vocabulary: GatewayError carries a gRPC status (the design's failure
table), which the gRPC API sends as it is and the HTTP API maps to an HTTP status."""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    """A request refused or failed. `code` is the gRPC status (the design's failure vocabulary);
    the HTTP API maps it to an HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # over a quota: when a retry can succeed
