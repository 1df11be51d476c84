"""OpenTelemetry providers for the tests: an in-memory span exporter and an in-memory metric
reader, each installed as the process-wide provider for as long as a test module needs it
(a module-scoped fixture), then shut down and uninstalled.

Uninstalled, so that results do not depend on the order of test files: a provider left
installed by one file would turn tracing (or metrics) on for every later file, and the
library takes other paths when they are on. tests/conftest.py checks after every module that
none is left installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


def installed_providers() -> list[str]:
    """The SDK providers installed process-wide: "tracer", "meter", both or none."""
    installed = []
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        installed.append("tracer")
    if isinstance(metrics.get_meter_provider(), MeterProvider):
        installed.append("meter")
    return installed


def _uninstall_tracer_provider() -> None:
    # The API installs a provider once per process; this is what OpenTelemetry's own test
    # utilities do (opentelemetry.test.globals_test.reset_trace_globals).
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    trace._PROXY_TRACER_PROVIDER = trace.ProxyTracerProvider()


def _uninstall_meter_provider() -> None:
    # (opentelemetry.test.globals_test.reset_metrics_globals)
    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None
    metrics_internal._PROXY_METER_PROVIDER = metrics_internal._ProxyMeterProvider()


@contextlib.contextmanager
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """Every span finished in the block; tracing is on for the block only."""
    assert "tracer" not in installed_providers(), "a tracer provider is installed already"
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)
    try:
        yield spans
    finally:
        provider.shutdown()
        _uninstall_tracer_provider()


@contextlib.contextmanager
def metric_reader() -> Iterator[InMemoryMetricReader]:
    """A reader of every metric recorded in the block (enter it before any worker of the test
    starts, so that the Temporal SDK's metrics come through it too); metrics are on for the
    block only."""
    assert "meter" not in installed_providers(), "a meter provider is installed already"
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(provider)
    try:
        yield reader
    finally:
        provider.shutdown()
        _uninstall_meter_provider()


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
