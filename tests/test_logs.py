"""Structured logs: JSON lines (or text) through structlog; a line logged inside a handler or an
activity carries trace_id, span_id, shard and category; payloads never appear."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import Iterator

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox_bridge import OutboxMessage, demo
from outbox_bridge.observability.logs import configure_logging, log_context
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.otel import span_exporter

MARKER = f"payload-{uuid.uuid4().hex}"  # must never appear in a log line
handler_log = logging.getLogger("myapp.handlers")


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing is on for this module only."""
    with span_exporter() as exporter:
        yield exporter


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    """What the root logger writes, as configured by the worker, for the test's duration."""
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = configure_logging("INFO", "json", stream=stream)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


async def test_lines_inside_handlers_and_activities_carry_trace_shard_and_category(
    servers, engine, spans, logged
) -> None:
    table = unique_table()
    app = make_app(table, Recorder(), handle_all=False)
    failed: list[int] = []

    @app.handler(Category.PROJECT_UPDATE, Category.ORGANIZATION_UPDATE, Category.MEMBER_UPDATE)
    async def async_handler(message: OutboxMessage) -> None:
        handler_log.info("async handler for object %s", message.object_identifier)
        if message.category is Category.MEMBER_UPDATE and not failed:
            failed.append(message.id)
            raise RuntimeError("member service unavailable")

    @app.handler(Category.USER_UPDATE)
    def sync_handler(message: OutboxMessage) -> None:
        structlog.get_logger("myapp.sync").info("sync handler", object=message.object_identifier)

    await create_tables(engine, app)
    rows = [
        (Category.PROJECT_UPDATE, 1, 1),
        (Category.USER_UPDATE, 2, 2),
        (Category.USER_UPDATE, 2, 3),
        (Category.MEMBER_UPDATE, 3, 4),
    ]
    await write_rows(
        engine,
        app,
        [
            {
                "category": c,
                "shard_identifier": s,
                "object_identifier": o,
                "payload": {"secret": MARKER},
            }
            for c, s, o in rows
        ],
    )
    async with running_worker(servers, app):
        await wait_until(lambda: table_empty(engine, app), what="every row handled")

    everything = lines(logged)  # every line is one JSON object
    assert MARKER not in logged.getvalue()
    handler_spans = {
        s.context.span_id: s
        for s in spans.get_finished_spans()
        if s.name.startswith("outbox.handle ")
        and (s.attributes or {}).get("outbox.table") == table
        and s.context is not None
    }

    def by_message(pattern: str) -> list[dict[str, object]]:
        return [line for line in everything if re.search(pattern, str(line.get("message")))]

    expected = {
        "async handler for object 1": ("ORGANIZATION:1", "PROJECT_UPDATE"),
        "sync handler": ("USER:2", "USER_UPDATE"),
        "async handler for object 4": ("ORGANIZATION:3", "MEMBER_UPDATE"),
    }
    for message, (shard, category) in expected.items():
        found = by_message(f"^{message}$")
        assert found, f"no line {message!r} in {everything}"
        for line in found:
            assert (line["shard"], line["category"]) == (shard, category), line
            assert line["level"] == "info" and "timestamp" in line
            assert re.fullmatch(r"[0-9a-f]{32}", str(line["trace_id"])), line
            span = handler_spans[int(str(line["span_id"]), 16)]  # the handler's own span
            assert span.context is not None
            assert line["trace_id"] == format(span.context.trace_id, "032x")
            assert (span.attributes or {})["outbox.category"] == category
    assert len(by_message("^sync handler$")) == 2
    assert {line["object"] for line in by_message("^sync handler$")} == {2, 3}
    # MEMBER_UPDATE failed once (in the drain) and succeeded in its category activity.
    assert len(by_message("^async handler for object 4$")) == 2
    [failure] = by_message("^handler failed: ")
    assert (failure["shard"], failure["category"]) == ("ORGANIZATION:3", "MEMBER_UPDATE")
    assert failure["level"] == "warning"
    assert re.fullmatch(r"[0-9a-f]{16}", str(failure["span_id"]))
    assert "RuntimeError: member service unavailable" in str(failure["exception"])


def test_text_lines_carry_the_bound_fields_and_current_span(spans) -> None:
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = configure_logging("INFO", "text", stream=stream)
    try:
        log = logging.getLogger("outbox_bridge.test")
        log.debug("not shown at INFO")
        with log_context(shard="USER:7", category="USER_UPDATE"):
            with trace.get_tracer("tests").start_as_current_span("work") as span:
                log.info("handled %s rows", 3)
        log.info("outside")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()
    inside, outside = stream.getvalue().splitlines()
    assert "handled 3 rows" in inside and "[info" in inside
    assert "shard=USER:7" in inside and "category=USER_UPDATE" in inside
    context = span.get_span_context()
    assert f"span_id={context.span_id:016x}" in inside
    assert f"trace_id={context.trace_id:032x}" in inside
    assert "outside" in outside and "shard=" not in outside


def test_an_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("INFO", "xml")


def test_the_demo_drops_the_traceback_of_its_intended_failures_only() -> None:
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = configure_logging("INFO", "text", stream=stream)
    handler.addFilter(demo.IntendedFailures())
    log = logging.getLogger("outbox_bridge.test")
    try:
        for error in (demo.ReplicaUnavailable("intended"), ConnectionError("real")):
            try:
                raise error
            except ConnectionError as exc:
                log.warning("handler failed: %s", exc, exc_info=exc)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()
    intended, real = stream.getvalue().split("handler failed: real")
    assert "intended" in intended and "Traceback" not in intended
    assert "Traceback" in real and "ConnectionError: real" in real
