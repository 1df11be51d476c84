"""Structured logs: structlog renders every stdlib log record (outbox-bridge's, the Temporal
SDK's, a handler's own) as text or JSON lines. A line logged inside an activity or a handler
carries its shard, category, trace and span ids from context variables (copied into the handler
threads), whatever logger emitted it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TextIO

import structlog
from opentelemetry import trace

# The attribute that marks the log record of a failed handler call: what the summary counts.
FAILED_CALL = "outbox_failed_call"


@dataclass(frozen=True)
class FailedCall:
    """A handler call that failed, as its log line reports it."""

    shard: str
    category: str
    error_type: str


# Fields bound for the lines logged in the current context (shard, category); read-only.
_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})
LOG_CONTEXT: ContextVar[Mapping[str, Any]] = ContextVar("outbox_log_context", default=_NO_FIELDS)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (None values are left out) to every line logged inside the block."""
    token = LOG_CONTEXT.set(
        {**LOG_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}}
    )
    try:
        yield
    finally:
        LOG_CONTEXT.reset(token)


def add_outbox_context(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: the bound fields, and the current span's trace and span ids."""
    for key, value in LOG_CONTEXT.get().items():
        event.setdefault(key, value)
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event.setdefault("trace_id", format(span_context.trace_id, "032x"))
        event.setdefault("span_id", format(span_context.span_id, "016x"))
    return event


def _renderers(log_format: str) -> list[Any]:
    if log_format == "json":
        return [
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("message"),
            structlog.processors.JSONRenderer(default=str),
        ]
    if log_format == "text":
        # A plain traceback: a rich one would print the frames' local variables (payloads).
        return [
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            )
        ]
    raise ValueError(f"unknown log format {log_format!r}")


_installed: logging.Handler | None = None


def installed_handler() -> logging.Handler | None:
    """The handler :func:`configure_logging` installed, if it was called."""
    return _installed


def configure_logging(
    level: str = "INFO", log_format: str = "text", *, stream: TextIO | None = None
) -> logging.Handler:
    """Route every log record through structlog to ``stream`` (stderr by default), as text or
    JSON lines; replaces the handler of an earlier call. Returns the installed handler."""
    global _installed
    shared: list[Any] = [
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_outbox_context,
    ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *_renderers(log_format),
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _installed = handler
    # structlog's own loggers (a handler may use them) go through the same handler.
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return handler


def quiet_sdk_loggers() -> None:
    """The Temporal SDK's loggers as a worker wants them: warnings and above, and no line of
    their own for a failed activity attempt (the drain logs each handler failure with its
    shard and category; the SDK's line would repeat it)."""
    logging.getLogger("temporalio").setLevel(logging.WARNING)
    logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
