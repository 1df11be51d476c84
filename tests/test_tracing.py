"""The Temporal client and worker carry OpenTelemetry spans; exporters follow the settings."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox_bridge.telemetry import build_tracer_provider
from tests.harness import (
    Category,
    fresh_app,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


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
    monkeypatch.setenv("OTEL_SERVICE_NAME", "billing-outbox")
    provider = build_tracer_provider("console")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "billing-outbox"


async def test_signals_and_activities_are_traced(servers, engine, spans) -> None:
    _, _, app = await fresh_app(engine)
    spans.clear()
    async with running_worker(servers, app):
        await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 1, "object_identifier": 1}],
        )
        await wait_until(lambda: table_empty(engine, app), what="the row handled")
    names = {span.name for span in spans.get_finished_spans()}
    starts = {"StartWorkflow:OutboxShard", "SignalWithStartWorkflow:OutboxShard"}
    assert names & starts
    assert "RunActivity:drain_shard" in names
    run = next(s for s in spans.get_finished_spans() if s.name == "RunActivity:drain_shard")
    start = next(s for s in spans.get_finished_spans() if s.name in starts)
    assert run.context.trace_id == start.context.trace_id  # one trace across Temporal
