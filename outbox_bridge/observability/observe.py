"""The span, metrics and log context of each handler call. With tracing and metrics off (the
default), a call costs one context-variable set and reset (the log context); with them on, its
span and two histogram records. Payloads never enter a span, an attribute or an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer

from outbox_bridge.db.reads import GroupRows
from outbox_bridge.observability.logs import LOG_CONTEXT
from outbox_bridge.observability.metrics import OutboxMetrics, active_metrics
from outbox_bridge.observability.telemetry import active_tracer, context_of, links_to
from outbox_bridge.registry import OutboxMessage
from outbox_bridge.workflows.models import ShardRef


class RoundObserver:
    """Observes the handler calls of one drain round (or one category activity) of a shard.

    When ``traced``, the caller reads the trace contexts of the round's rows into ``contexts``
    (row id → carrier). Counters are added once per round, by :meth:`finish`.
    """

    def __init__(self, shard: ShardRef, *, partition: str | None = None) -> None:
        self.shard = shard
        # Drained by this partition: no Temporal span leads from a row's producer to the drain,
        # so each handler span is the child of its row's producer span and names the partition.
        self.partition = partition
        self.tracer: Tracer | None = active_tracer()
        self.metrics: OutboxMetrics | None = active_metrics()
        self.contexts: Mapping[int, Any] = {}
        self._log_fields: dict[str, dict[str, Any]] = {}
        self._handled: dict[str, list[int]] = {}  # category -> [rows, coalesced]

    @property
    def traced(self) -> bool:
        return self.tracer is not None

    @staticmethod
    def tracing() -> bool:
        """Whether observers made now trace their calls (and want the rows' trace contexts)."""
        return active_tracer() is not None

    def call(
        self, group: GroupRows, message: OutboxMessage, category: str, attempt: int
    ) -> ObservedCall:
        """A context manager around one handler call (its span, timing and log context)."""
        return ObservedCall(self, group, message, category, attempt)

    def log_fields(self, category: str) -> dict[str, Any]:
        fields = self._log_fields.get(category)
        if fields is None:
            fields = {**LOG_CONTEXT.get(), "shard": self.shard.key, "category": category}
            self._log_fields[category] = fields
        return fields

    def handled(self, category: str, rows: int) -> None:
        counts = self._handled.setdefault(category, [0, 0])
        counts[0] += rows
        counts[1] += rows - 1

    def finish(self) -> None:
        """Add the round's counters (rows handled and coalesced, per category)."""
        if self.metrics is None:
            return
        shard = self.shard
        for category, (rows, coalesced) in self._handled.items():
            attributes = self.metrics.category_attributes(shard.table, shard.scope_name, category)
            self.metrics.rows_handled.add(rows, attributes)
            if coalesced:
                self.metrics.rows_coalesced.add(coalesced, attributes)
        self._handled.clear()


class ObservedCall:
    """One handler call: a span ``outbox.handle <CATEGORY>`` (a child of the current span, the
    activity's, linked to the producer span of every row the call covers), its duration and
    outcome, and the log context (shard, category)."""

    __slots__ = ("_category", "_group", "_message", "_observer", "_span", "_start", "_token")

    def __init__(
        self,
        observer: RoundObserver,
        group: GroupRows,
        message: OutboxMessage,
        category: str,
        attempt: int,
    ) -> None:
        self._observer = observer
        self._group = group
        self._message = message
        self._category = category
        self._span: contextlib.AbstractContextManager[trace.Span] | None = None
        self._start = 0.0
        if observer.tracer is not None:
            self._span = observer.tracer.start_as_current_span(
                f"outbox.handle {category}",
                context=self._parent(),
                kind=SpanKind.CONSUMER,
                attributes=self._attributes(attempt),
                links=self._links(),
                record_exception=False,
                set_status_on_exception=False,
            )

    def _parent(self) -> otel_context.Context | None:
        """On a partition's path, the producer span of the row handed to the handler; else
        (None) the current span: the activity's."""
        if self._observer.partition is None:
            return None
        carrier = self._observer.contexts.get(self._group.last_id)
        return context_of(carrier) if carrier is not None else None

    def _attributes(self, attempt: int) -> dict[str, Any]:
        shard, group = self._observer.shard, self._group
        attributes: dict[str, Any] = {
            "outbox.table": shard.table,
            "outbox.scope": shard.scope_name,
            "outbox.shard_identifier": shard.shard_identifier,
            "outbox.category": self._category,
            "outbox.object_identifier": group.object_identifier,
            "outbox.id": group.last_id,
            "outbox.coalesced": len(group.ids),
            "outbox.attempt": attempt,
            "outbox.queue_time_seconds": _age(self._message),
        }
        if shard.region is not None:
            attributes["outbox.region"] = shard.region
        if self._observer.partition is not None:
            attributes["outbox.partition"] = self._observer.partition
        return attributes

    def _links(self) -> list[Link]:
        contexts = self._observer.contexts
        return links_to(contexts[i] for i in reversed(self._group.ids) if i in contexts)

    def __enter__(self) -> None:
        self._token = LOG_CONTEXT.set(self._observer.log_fields(self._category))
        if self._span is not None:
            self._span.__enter__()
        if self._observer.metrics is not None:
            self._start = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._observer.metrics is not None:
                self._record(self._observer.metrics, exc)
            if exc is not None and self._span is not None:
                self._fail_span(exc)
        finally:
            if self._span is not None:
                self._span.__exit__(exc_type, exc, tb)
            LOG_CONTEXT.reset(self._token)

    def _record(self, metrics: OutboxMetrics, exc: BaseException | None) -> None:
        shard = self._observer.shard
        if isinstance(exc, asyncio.CancelledError):
            return  # a skip or a shutdown: neither a success nor a failure of the handler
        key = (shard.table, shard.scope_name, self._category)
        outcome = "success" if exc is None else "failure"
        duration = time.perf_counter() - self._start
        metrics.handler_duration.record(duration, metrics.category_attributes(*key, outcome))
        attributes = metrics.category_attributes(*key)
        if exc is None:
            metrics.queue_time.record(_age(self._message), attributes)
            self._observer.handled(self._category, len(self._group.ids))
        else:
            error = {**attributes, "error.type": type(exc).__qualname__}
            metrics.handler_failures.add(1, error)

    def _fail_span(self, exc: BaseException) -> None:
        span = trace.get_current_span()
        error_type = type(exc).__qualname__
        if isinstance(exc, asyncio.CancelledError):
            span.set_attribute("outbox.cancelled", True)
            return
        # The whole exception, even with redact_errors: that option keeps handler messages
        # (which may hold personal data) out of Temporal history, which every user of the
        # namespace sees and nobody can edit; spans, like logs, are the service's own.
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{error_type}: {exc}"))
        span.set_attribute("error.type", error_type)


def _age(message: OutboxMessage) -> float:
    return max(0.0, time.time() - message.date_added.timestamp())
