"""Process-wide OpenTelemetry providers for the tests: an in-memory span exporter and an
in-memory metric reader, installed once (a process has one tracer and one meter provider).

Once installed, tracing and metrics stay on for the rest of the session, which is what a
worker with an exporter configured sees too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_spans: InMemorySpanExporter | None = None
_reader: InMemoryMetricReader | None = None


def span_exporter() -> InMemorySpanExporter:
    """Every finished span of the process, from now on."""
    global _spans
    if _spans is None:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        _spans = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_spans))
    return _spans


def metric_reader() -> InMemoryMetricReader:
    """A reader of every metric of the process (installed before any worker of the test
    starts, so that the Temporal SDK's metrics come through it too)."""
    global _reader
    if _reader is None:
        assert not isinstance(metrics.get_meter_provider(), MeterProvider), (
            "a meter provider is installed already"
        )
        _reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[_reader]))
    return _reader


def points(data: MetricsData | None, name: str) -> Iterator[Any]:
    """The data points of metric ``name``."""
    if data is None:
        return
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    yield from metric.data.data_points


def metric_names(data: MetricsData | None) -> set[str]:
    if data is None:
        return set()
    return {
        metric.name
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


def span_texts(spans: Iterable[ReadableSpan]) -> Iterator[str]:
    """Every string a span carries: its name, attribute values, events, links and status."""
    for span in spans:
        yield span.name
        yield str(span.status.description or "")
        yield from (str(v) for v in (span.attributes or {}).values())
        for event in span.events:
            yield event.name
            yield from (str(v) for v in (event.attributes or {}).values())
        for link in span.links:
            yield from (str(v) for v in (link.attributes or {}).values())
