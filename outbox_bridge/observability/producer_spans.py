"""A row write by the producer API: its ``outbox.write`` span, the trace context stored on the
row, and the ``outbox.rows.written`` counter; never a payload. Only the OpenTelemetry API is
used, never the SDK; with tracing and metrics off, a write costs a look at the current span and
at the providers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from sqlalchemy import Insert

from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN
from outbox_bridge.observability.metrics import OutboxMetrics, active_metrics
from outbox_bridge.observability.telemetry import active_tracer, carrier_of_current
from outbox_bridge.producer import PreparedRow


@dataclass(slots=True)
class RowWrite:
    """The telemetry of one row write: its INSERT (with the trace context when there is one),
    and what to record once it ran (see :func:`observed_write`)."""

    span: trace.Span | None
    statement: Insert
    metrics: OutboxMetrics | None
    attributes: dict[str, Any]

    def written(self, row_id: int) -> int:
        """Record the new row (its id on the span, the ``outbox.rows.written`` counter)."""
        if self.span is not None:
            self.span.set_attribute("outbox.id", row_id)
        if self.metrics is not None:
            self.metrics.rows_written.add(1, self.attributes)
        return row_id


@contextlib.contextmanager
def observed_write(row: PreparedRow) -> Iterator[RowWrite]:
    """Around the INSERT of one row: inside an active span, an ``outbox.write <CATEGORY>``
    producer span whose trace context goes into the row's ``trace_context`` column."""
    shard, category = row.shard, row.category
    metrics = active_metrics()
    attributes = (
        metrics.category_attributes(shard.table, shard.scope_name, category) if metrics else {}
    )
    if not trace.get_current_span().get_span_context().is_valid:
        yield RowWrite(None, row.statement, metrics, attributes)
        return
    tracer = active_tracer()
    if tracer is None:  # a span of another tracer provider: keep its context on the row
        statement = row.statement.values({TRACE_CONTEXT_COLUMN: carrier_of_current()})
        yield RowWrite(None, statement, metrics, attributes)
        return
    span_attributes: dict[str, Any] = {
        "outbox.table": shard.table,
        "outbox.scope": shard.scope_name,
        "outbox.shard_identifier": shard.shard_identifier,
        "outbox.category": category,
        "outbox.object_identifier": row.object_identifier,
    }
    if shard.region is not None:
        span_attributes["outbox.region"] = shard.region
    with tracer.start_as_current_span(
        f"outbox.write {category}", kind=SpanKind.PRODUCER, attributes=span_attributes
    ) as span:
        statement = row.statement.values({TRACE_CONTEXT_COLUMN: carrier_of_current()})
        yield RowWrite(span, statement, metrics, attributes)
