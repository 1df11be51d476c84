"""Traces: a row carries its producer's trace context; its handler runs in a span under the
Temporal activity's, linked to the producer span of every row it covers; a handover to a
shard's workflow and that workflow's activities share a trace; the bridge's sweeps have spans;
exporters follow the settings. No payload ever enters a span."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer
from sqlalchemy import select, text
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.observability.sdk import build_tracer_provider
from outbox_bridge.runtime.hub import partition_of
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    fast_settings,
    fresh_app,
    make_app,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.otel import span_exporter, span_texts

MARKER = f"payload-{uuid.uuid4().hex}"  # must never appear in a span
HANDLE_PROJECT = "outbox.handle PROJECT_UPDATE"


def tracer() -> Tracer:
    """The tests' tracer, on the provider installed now (the spans fixture's)."""
    return trace.get_tracer("tests")


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing is on for this module only."""
    with span_exporter() as exporter:
        yield exporter


def row(category: Category, shard: int, obj: int) -> dict[str, object]:
    return {
        "category": category,
        "shard_identifier": shard,
        "object_identifier": obj,
        "payload": {"secret": MARKER},
    }


def of_table(spans: InMemorySpanExporter, table: str, name: str) -> list[ReadableSpan]:
    found = [
        s
        for s in spans.get_finished_spans()
        if s.name == name and (s.attributes or {}).get("outbox.table") == table
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def by_id(spans: InMemorySpanExporter) -> dict[int, ReadableSpan]:
    return {s.context.span_id: s for s in spans.get_finished_spans() if s.context is not None}


async def failing_once(engine: Any) -> tuple[str, OutboxApp]:
    """An app on a fresh table whose PROJECT_UPDATE handler fails its first call."""
    recorder, table, app = await fresh_app(engine)
    failed: list[int] = []

    async def fail_once(message: OutboxMessage) -> None:
        if not failed:
            failed.append(message.id)
            raise RuntimeError("the downstream service said no")

    recorder.behaviour[Category.PROJECT_UPDATE] = fail_once
    return table, app


def partition_index(table: str, scope: int, shard: int, partitions: int = 4) -> int:
    return partition_of(ShardRef(table, scope, str(scope), shard), partitions)


def parent_of(span: ReadableSpan, spans: InMemorySpanExporter) -> ReadableSpan:
    assert span.parent is not None, f"{span.name} has no parent"
    return by_id(spans)[span.parent.span_id]


def assert_no_payload(spans: Iterable[ReadableSpan]) -> None:
    for value in span_texts(spans):
        assert MARKER not in value


def _exporter(provider: TracerProvider | None) -> object:
    assert provider is not None
    [processor] = provider._active_span_processor._span_processors
    return processor.span_exporter  # type: ignore[attr-defined]


def test_exporters_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_tracer_provider("none") is None
    assert isinstance(_exporter(build_tracer_provider("console")), ConsoleSpanExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(_exporter(build_tracer_provider("otlp")), GrpcExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert isinstance(_exporter(build_tracer_provider("otlp")), HttpExporter)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    provider = build_tracer_provider("console")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "outbox-bridge"
    assert provider.resource.attributes["deployment.environment"] == "staging"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "billing-outbox")
    provider = build_tracer_provider("console")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "billing-outbox"


async def test_a_row_stores_the_trace_context_of_the_span_it_is_written_in(engine, spans) -> None:
    _, table, app = await fresh_app(engine)
    with tracer().start_as_current_span("request") as request:
        [inside] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
    [outside] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 2)])
    await sql(
        engine,
        f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier) "
        "VALUES (1, 1, 2, 3)",
    )
    async with engine.connect() as conn:
        stored = dict(
            (await conn.execute(select(app.table().c.id, app.table().c.trace_context))).all()
        )
    [producer] = of_table(spans, table, "outbox.write PROJECT_UPDATE")
    assert producer.parent is not None
    assert producer.parent.span_id == request.get_span_context().span_id
    assert producer.kind is trace.SpanKind.PRODUCER
    assert producer.attributes is not None and producer.attributes["outbox.id"] == inside
    context = producer.context
    assert context is not None
    flags = int(context.trace_flags)
    traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    assert stored[inside] == {"traceparent": traceparent}
    assert stored[outside] is None  # written outside any span
    assert sorted(v for k, v in stored.items() if k not in (inside, outside)) == [None]
    assert_no_payload([producer])


async def test_an_existing_outbox_table_gets_the_trace_context_column(engine) -> None:
    _, table, app = await fresh_app(engine)
    await sql(engine, f"ALTER TABLE {table} DROP COLUMN trace_context")
    await create_tables(engine, app)  # what the worker and init-db run at start
    await create_tables(engine, app)  # and again: nothing left to do
    [_] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
    async with engine.connect() as conn:
        columns = (
            await conn.execute(
                text(
                    "SELECT data_type, is_nullable FROM information_schema.columns "
                    "WHERE table_name = :t AND column_name = 'trace_context'"
                ),
                {"t": table},
            )
        ).all()
    assert [tuple(c) for c in columns] == [("jsonb", "YES")]


async def test_a_handover_and_the_shard_workflow_s_activities_are_traced(
    servers, engine, spans
) -> None:
    """A failing handler makes its shard get its workflow: the partition's handover starts it,
    and the workflow's activities (the head's retry, the drain of the rows behind it) run in
    the handover's trace."""
    table, app = await failing_once(engine)
    await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 1, 1), row(Category.ORGANIZATION_UPDATE, 1, 2)]
    )
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: table_empty(engine, app), what="the rows handled")
    names = {span.name for span in spans.get_finished_spans()}
    assert "outbox.bridge.sweep" in names
    [start] = [
        s
        for s in spans.get_finished_spans()
        if s.name == "SignalWithStartWorkflow:OutboxShard"
        and (s.attributes or {}).get("temporalWorkflowID") == f"outbox:{table}:ORGANIZATION:1"
    ]
    first, retry = of_table(spans, table, HANDLE_PROJECT)
    assert parent_of(first, spans).name == "RunActivity:drain_partition"
    assert parent_of(retry, spans).name == "RunActivity:PROJECT_UPDATE"
    [behind] = of_table(spans, table, "outbox.handle ORGANIZATION_UPDATE")
    assert parent_of(behind, spans).name == "RunActivity:drain_shard"
    assert start.context is not None
    for handler in (retry, behind):
        assert handler.context is not None
        assert handler.context.trace_id == start.context.trace_id  # one trace across Temporal
    # Rows written outside any span: no producer span for a handler span to link to.
    assert not (first.links or retry.links or behind.links)
    assert_no_payload(spans.get_finished_spans())


async def test_a_row_s_trace_runs_from_its_producer_to_its_handler(servers, engine, spans) -> None:
    _, table, app = await fresh_app(engine)
    async with running_worker(servers, app, fast_settings()):
        with tracer().start_as_current_span("request"):
            [row_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 5, 7)])
        await wait_until(lambda: table_empty(engine, app), what="the row handled")
    [producer] = of_table(spans, table, "outbox.write PROJECT_UPDATE")
    [handler] = of_table(spans, table, HANDLE_PROJECT)
    assert producer.context is not None and handler.context is not None
    assert handler.context.trace_id == producer.context.trace_id
    partition = f"outbox:{table}:partition:{partition_index(table, 1, 5)}"
    # A partition drained it: the handler span is the producer span's child.
    assert parent_of(handler, spans) is producer
    assert handler.kind is trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in handler.links] == [producer.context.span_id]
    attributes = dict(handler.attributes or {})
    queue_time = attributes.pop("outbox.queue_time_seconds")
    assert isinstance(queue_time, float) and queue_time >= 0
    assert attributes == {
        "outbox.table": table,
        "outbox.scope": "ORGANIZATION",
        "outbox.shard_identifier": 5,
        "outbox.category": "PROJECT_UPDATE",
        "outbox.object_identifier": 7,
        "outbox.id": row_id,
        "outbox.coalesced": 1,
        "outbox.attempt": 1,
        "outbox.partition": partition,
    }
    assert handler.status.status_code is StatusCode.UNSET
    # No Temporal hop per row: nothing started, signalled or updated the shard's workflow.
    shard_workflow = f"outbox:{table}:ORGANIZATION:5"
    assert not [
        s.name
        for s in spans.get_finished_spans()
        if (s.attributes or {}).get("temporalWorkflowID") == shard_workflow
    ]
    assert_no_payload(spans.get_finished_spans())


async def test_a_coalesced_group_links_to_every_producer(servers, engine, spans) -> None:
    recorder, table, app = await fresh_app(engine)
    # A row from plain SQL has no trace context; it is coalesced all the same.
    await sql(
        engine,
        f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier) "
        "VALUES (1, 3, 2, 9)",
    )
    for _ in range(3):  # three requests, three transactions
        with tracer().start_as_current_span("request"):
            await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 3, 9)])
    producers = of_table(spans, table, "outbox.write PROJECT_UPDATE")
    assert len(producers) == 3
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: table_empty(engine, app), what="the group handled")
    assert [(c.coalesced, c.object_identifier) for c in recorder.calls] == [(4, 9)]
    [handler] = of_table(spans, table, HANDLE_PROJECT)
    linked = {link.context.span_id for link in handler.links}
    assert linked == {p.context.span_id for p in producers if p.context is not None}
    assert handler.attributes is not None and handler.attributes["outbox.coalesced"] == 4
    newest = producers[-1].context
    assert handler.context is not None and newest is not None
    # In the newest row's trace: the workflow started in it, or the handler span is its child.
    assert handler.context.trace_id == newest.trace_id
    assert_no_payload(spans.get_finished_spans())


async def category_activity_attempt(client: Client, workflow_id: str, category: str) -> int:
    """The attempt of the shard workflow's ``category`` activity that completed (the server
    records the attempt that started last when the activity completes)."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    scheduled = {
        event.event_id
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == category
    }
    [started] = [
        event.activity_task_started_event_attributes
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and event.activity_task_started_event_attributes.scheduled_event_id in scheduled
    ]
    return int(started.attempt)


@pytest.mark.parametrize("redact", [False, True], ids=["messages", "redacted"])
async def test_a_failing_handler_s_span_records_the_exception_with_error_status(
    servers, engine, spans, client: Client, redact: bool
) -> None:
    table, app = await failing_once(engine)
    settings = fast_settings(redact_errors=redact)
    async with running_worker(servers, app, settings):
        with tracer().start_as_current_span("request"):
            await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 4, 1)])
        await wait_until(lambda: table_empty(engine, app), what="the row handled on retry")
    first, retry = of_table(spans, table, HANDLE_PROJECT)
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes is not None and first.attributes["error.type"] == "RuntimeError"
    [event] = first.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "RuntimeError"
    # Redacting keeps the message out of Temporal only: the span has it either way.
    assert event.attributes["exception.message"] == "the downstream service said no"
    assert "downstream" in str(first.status.description)
    # The first attempt ran in the partition's drain, under the producer.
    assert parent_of(first, spans).name == "outbox.write PROJECT_UPDATE"
    # The retry runs in the category activity: its attempt + 1 (the partition made the head's
    # first). That is 2 unless an attempt found the shard locked for longer than the 5 s the
    # activity waits for it, and ran no handler.
    attempt = await category_activity_attempt(
        client, f"outbox:{table}:ORGANIZATION:4", "PROJECT_UPDATE"
    )
    assert retry.status.status_code is StatusCode.UNSET
    assert retry.attributes is not None and retry.attributes["outbox.attempt"] == attempt + 1
    assert first.attributes["outbox.attempt"] == 1
    assert parent_of(retry, spans).name == "RunActivity:PROJECT_UPDATE"
    assert first.links and retry.links and first.links[0].context == retry.links[0].context
    assert_no_payload(spans.get_finished_spans())


async def test_sync_handlers_run_in_a_thread_each_call_in_its_own_span(
    servers, engine, spans
) -> None:
    """A plain-def handler runs in a thread of the handler pool, not on the event loop, and
    the span current in that thread is its own call's: the handler span of its row, under the
    round's drain activity."""
    table = unique_table()
    app = make_app(table, Recorder(), handle_all=False)
    loop_thread = threading.get_ident()
    seen: dict[int, tuple[int, int]] = {}  # row id -> (thread, current span id)

    @app.handler(*Category)
    def sync_handler(message: OutboxMessage) -> None:
        span = trace.get_current_span()
        assert span.is_recording()
        seen[message.id] = (threading.get_ident(), span.get_span_context().span_id)

    await create_tables(engine, app)
    rows = [row(Category.PROJECT_UPDATE, 6, obj) for obj in (1, 2, 3)]
    ids = await write_rows(engine, app, rows)  # before the worker: one round_
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: table_empty(engine, app), what="the rows handled")
    assert sorted(seen) == ids
    assert all(thread != loop_thread for thread, _ in seen.values()), "ran on the event loop"
    handlers = of_table(spans, table, HANDLE_PROJECT)
    span_of_row = {
        s.attributes["outbox.id"]: s.context.span_id for s in handlers if s.attributes and s.context
    }
    # The span current in the handler's thread is the handler span of that very row.
    assert {row_id: span_id for row_id, (_, span_id) in seen.items()} == span_of_row
    assert len(set(span_of_row.values())) == 3
    [run] = {parent_of(s, spans) for s in handlers}  # rows without a producer span
    assert run.name == "RunActivity:drain_partition"
    assert_no_payload(spans.get_finished_spans())
