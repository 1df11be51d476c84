"""Metrics: every instrument, read with an in-memory reader after a scripted workload through
the real worker; the Temporal SDK's metrics through the same provider; the Prometheus endpoint
and the push exporters by setting."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpExporter,
)
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader

from outbox_bridge import OutboxMessage
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.observability.metrics import OutboxMetrics
from outbox_bridge.observability.sdk import build_meter_provider, metric_exporter
from tests.harness import (
    Category,
    count_rows,
    fast_settings,
    fresh_app,
    running_worker,
    wait_until,
    write_rows,
)
from tests.otel import metric_names, metric_reader, points


@pytest.fixture(scope="module")
def reader() -> Iterator[InMemoryMetricReader]:
    """Metrics are on for this module only."""
    with metric_reader() as installed:
        yield installed


def row(category: Category, shard: int, obj: int) -> dict[str, object]:
    return {
        "category": category,
        "shard_identifier": shard,
        "object_identifier": obj,
        "payload": {"n": obj},
    }


class Readings:
    """One collection of the reader, filtered to one table (or task queue)."""

    def __init__(self, reader: InMemoryMetricReader, **wanted: str) -> None:
        self.data = reader.get_metrics_data()
        self.wanted = {f"outbox.{k}": v for k, v in wanted.items()}

    def _points(self, name: str, **attributes: str) -> list[Any]:
        wanted = {**self.wanted, **attributes}
        return [
            p
            for p in points(self.data, name)
            if all(p.attributes.get(k) == v for k, v in wanted.items())
        ]

    def sum(self, name: str, **attributes: str) -> float:
        return float(sum(p.value for p in self._points(name, **attributes)))

    def count(self, name: str, **attributes: str) -> int:
        return int(sum(p.count for p in self._points(name, **attributes)))

    def histogram_sum(self, name: str, **attributes: str) -> float:
        return float(sum(p.sum for p in self._points(name, **attributes)))

    def gauge(self, name: str, **attributes: str) -> float | None:
        found = self._points(name, **attributes)
        assert len(found) <= 1, found
        return found[0].value if found else None


def by(category: Category, **more: str) -> dict[str, str]:
    return {"outbox.category": category.name, **more}


async def test_every_instrument_after_a_scripted_workload(servers, engine, reader) -> None:
    recorder, table, app = await fresh_app(engine)
    project_failed: list[int] = []
    release = asyncio.Event()

    async def project_fails_once(message: OutboxMessage) -> None:
        if not project_failed:
            project_failed.append(message.id)
            raise RuntimeError("once")

    async def member_fails_until_released(message: OutboxMessage) -> None:
        if not release.is_set():
            raise ValueError("not yet")

    recorder.behaviour[Category.PROJECT_UPDATE] = project_fails_once
    recorder.behaviour[Category.MEMBER_UPDATE] = member_fails_until_released
    # Written before the worker runs, so that shard 1's three ORGANIZATION_UPDATE rows of
    # object 1 are handled in one call (two of them coalesced).
    await write_rows(
        engine,
        app,
        [row(Category.ORGANIZATION_UPDATE, 1, 1) for _ in range(3)]
        + [
            row(Category.PROJECT_UPDATE, 1, 2),
            row(Category.USER_UPDATE, 10, 10),
            row(Category.MEMBER_UPDATE, 3, 1),  # blocks shard 3 until released
            row(Category.ORGANIZATION_UPDATE, 4, 1),  # shard 4 starts skipped
        ],
    )
    settings = fast_settings(skip_shards=["ORGANIZATION:4"])
    queue = {"outbox.task_queue": settings.task_queue}
    async with running_worker(servers, app, settings):
        await wait_until(
            lambda: _rows_left(engine, app, 2),
            what="all but the blocked and the skipped shard handled",
        )

        organization = {"outbox.scope": "ORGANIZATION"}

        def states_seen() -> bool:
            now = Readings(reader)
            blocked = now.gauge("outbox.shards.blocked", **queue)
            skipped = now.gauge("outbox.shards.skipped", **queue)
            rows = Readings(reader, table=table).gauge("outbox.backlog.rows", **organization)
            return (blocked, skipped, rows) == (1, 1, 2)

        # A sweep's backlog is read before its signals, its states after them: wait for one
        # that started once only the blocked and the skipped shard had rows.
        await wait_until(states_seen, what="a sweep seeing the blocked and the skipped shard")
        backlog = Readings(reader, table=table)
        assert backlog.gauge("outbox.backlog.rows", **{"outbox.scope": "USER"}) == 0
        oldest = backlog.gauge("outbox.backlog.oldest_age_seconds", **organization)
        assert oldest is not None and oldest > 0
        assert backlog.gauge("outbox.backlog.oldest_age_seconds", **{"outbox.scope": "USER"}) == 0

        release.set()
        await wait_until(lambda: _rows_left(engine, app, 1), what="the blocked shard handled")

        def unblocked() -> bool:
            now = Readings(reader)
            backlog_now = Readings(reader, table=table)
            rows = backlog_now.gauge("outbox.backlog.rows", **organization)
            return (now.gauge("outbox.shards.blocked", **queue), rows) == (0, 1)

        await wait_until(unblocked, what="a sweep seeing the shard unblocked")

        def sdk_metrics_seen() -> bool:
            now = Readings(reader)
            return any(
                p.attributes.get("task_queue") == settings.task_queue
                for name in metric_names(now.data)
                if name.startswith("temporal_")
                for p in points(now.data, name)
            )

        # The Temporal SDK's own metrics (polls, task latencies...) come through the same
        # provider, and so to the same endpoint.
        await wait_until(sdk_metrics_seen, what="the Temporal SDK's metrics of this worker")

    seen = Readings(reader, table=table)
    written = {c: seen.sum("outbox.rows.written", **by(c)) for c in Category}
    assert written == {
        Category.ORGANIZATION_UPDATE: 4,
        Category.PROJECT_UPDATE: 1,
        Category.MEMBER_UPDATE: 1,
        Category.USER_UPDATE: 1,
    }
    handled = {c: seen.sum("outbox.rows.handled", **by(c)) for c in Category}
    assert handled == {
        Category.ORGANIZATION_UPDATE: 3,
        Category.PROJECT_UPDATE: 1,
        Category.MEMBER_UPDATE: 1,
        Category.USER_UPDATE: 1,
    }
    assert seen.sum("outbox.rows.coalesced") == 2
    assert seen.sum("outbox.rows.coalesced", **by(Category.ORGANIZATION_UPDATE)) == 2
    assert seen.sum("outbox.rows.handled", **{"outbox.scope": "USER"}) == 1

    successes = {
        c: seen.count("outbox.handler.duration", **by(c, **{"outbox.outcome": "success"}))
        for c in Category
    }
    assert successes == dict.fromkeys(Category, 1)
    failure = {"outbox.outcome": "failure"}
    assert seen.count("outbox.handler.duration", **by(Category.PROJECT_UPDATE, **failure)) == 1
    assert seen.count("outbox.handler.duration", **by(Category.MEMBER_UPDATE, **failure)) >= 1
    assert seen.count("outbox.handler.duration", **by(Category.USER_UPDATE, **failure)) == 0
    assert seen.histogram_sum("outbox.handler.duration") > 0

    project = by(Category.PROJECT_UPDATE, **{"error.type": "RuntimeError"})
    assert seen.sum("outbox.handler.failures", **project) == 1
    member = by(Category.MEMBER_UPDATE, **{"error.type": "ValueError"})
    assert seen.sum("outbox.handler.failures", **member) >= 1
    assert seen.sum("outbox.handler.failures") == 1 + seen.sum("outbox.handler.failures", **member)

    # One queue time per successful call, each at least the time the row waited.
    assert {c: seen.count("outbox.queue.time", **by(c)) for c in Category} == successes
    assert seen.histogram_sum("outbox.queue.time") > 0
    assert len(recorder.calls) == 4  # the recorder keeps successful calls only


async def _rows_left(engine, app, expected: int) -> bool:
    return await count_rows(engine, app) == expected


def test_the_prometheus_endpoint_serves_the_instruments() -> None:
    setup = build_meter_provider("prometheus", host="127.0.0.1", port=0)
    assert setup is not None and setup.endpoint is not None
    try:
        instruments = OutboxMetrics(setup.provider.get_meter("outbox_bridge"))
        attributes = instruments.category_attributes("outbox", "USER", "USER_UPDATE")
        instruments.rows_written.add(3, attributes)
        instruments.queue_time.record(0.2, attributes)
        scope = (("outbox.table", "outbox"), ("outbox.scope", "USER"))
        instruments.report("a bridge", "outbox.backlog.oldest_age_seconds", {scope: 42.0})
        with urllib.request.urlopen(setup.endpoint, timeout=10) as response:
            body = response.read().decode()
        lines = body.splitlines()
        assert any(
            line.startswith("outbox_rows_written_total{")
            and 'outbox_category="USER_UPDATE"' in line
            and line.endswith(" 3.0")
            for line in lines
        ), body
        assert any(line.startswith("outbox_queue_time_seconds_count{") for line in lines), body
        assert any(
            line.startswith("outbox_backlog_oldest_age_seconds{") and line.endswith(" 42.0")
            for line in lines
        ), body
    finally:
        setup.shutdown()


def test_a_busy_metrics_port_is_a_configuration_error() -> None:
    setup = build_meter_provider("prometheus", host="127.0.0.1", port=0)
    assert setup is not None and setup.endpoint is not None
    port = int(setup.endpoint.rsplit(":", 1)[1].split("/")[0])
    try:
        with pytest.raises(ConfigurationError, match="--metrics-port"):
            build_meter_provider("prometheus", host="127.0.0.1", port=port)
    finally:
        setup.shutdown()


def test_push_exporters_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_meter_provider("none", host="127.0.0.1", port=0) is None
    assert isinstance(metric_exporter("console"), ConsoleMetricExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(metric_exporter("otlp"), GrpcExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    assert isinstance(metric_exporter("otlp"), HttpExporter)
    with pytest.raises(ValueError, match="unknown"):
        metric_exporter("statsd")
