"""Structured logs for every service: structlog when installed, the standard library otherwise
(the engine must start on machines without structlog).

Lines are JSON when stderr is not a terminal, readable key=value lines when it is. Records of
the standard library's loggers (uvicorn's, grpc's) are rendered the same way, with a `logger`
field, so a collector reading the stream never meets a plain-text line.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

try:
    import structlog
except ImportError:  # pragma: no cover - exercised on the GPU machine
    structlog = None

_configured = False


def configure(service: str) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = getattr(logging, os.environ.get("LLMSERVE_LOG_LEVEL", "INFO").upper(), logging.INFO)
    if structlog is None:
        logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
        return
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )

    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)  # threads do not inherit contextvars
        return event

    shared = [
        structlog.contextvars.merge_contextvars,
        add_service,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.format_exc_info,
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


class _StdlibLogger:
    """The subset of structlog's BoundLogger the services use, over the logging module."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name)

    def _log(self, level: int, event: str, exc_info: bool = False, **kw: Any) -> None:
        fields = " ".join(f"{k}={v!r}" for k, v in kw.items())
        self._logger.log(level, f"{event} {fields}".rstrip(), exc_info=exc_info)

    debug = functools.partialmethod(_log, logging.DEBUG)
    info = functools.partialmethod(_log, logging.INFO)
    warning = functools.partialmethod(_log, logging.WARNING)
    error = functools.partialmethod(_log, logging.ERROR)
    exception = functools.partialmethod(_log, logging.ERROR, exc_info=True)


def get_logger(name: str) -> Any:
    if structlog is not None:
        return structlog.get_logger(name)
    return _StdlibLogger(name)


def bind(**fields: Any) -> None:
    """Attach fields (request_id, trace_id) to every line logged from the current asyncio task
    or thread from now on. Each gRPC call runs in its own task, so this scopes them to a request."""
    if structlog is not None:
        structlog.contextvars.bind_contextvars(**{k: v for k, v in fields.items() if v})
