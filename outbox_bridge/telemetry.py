"""Tracing setup: the OpenTelemetry tracer provider and Temporal's tracing interceptor."""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from temporalio.contrib.opentelemetry import TracingInterceptor

log = logging.getLogger("outbox_bridge.telemetry")


def _otlp_exporter() -> SpanExporter:
    # The OTLP exporters read OTEL_EXPORTER_OTLP_{ENDPOINT,HEADERS,...} themselves.
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc()


def build_tracer_provider(exporter: str) -> TracerProvider | None:
    """A tracer provider exporting to ``exporter`` (none, console, otlp), or None for none.

    ``service.name`` defaults to ``outbox-bridge``; ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` are honoured.
    """
    if exporter == "none":
        return None
    # Resource.create() reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ours is only the
    # default when neither names the service.
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {SERVICE_NAME: "outbox-bridge"})
    provider = TracerProvider(resource=resource)
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    else:
        raise ValueError(f"unknown span exporter {exporter!r}")
    return provider


def setup_tracing(exporter: str) -> TracerProvider | None:
    """Install :func:`build_tracer_provider`'s provider as the process-wide one."""
    provider = build_tracer_provider(exporter)
    if provider is not None:
        trace.set_tracer_provider(provider)
        log.info("spans are exported to %s", exporter)
    return provider


def tracing_interceptor() -> TracingInterceptor:
    """Temporal's interceptor: client calls, workflows and activities get spans, and the trace
    context crosses Temporal in headers (never in payloads)."""
    return TracingInterceptor(trace.get_tracer("outbox_bridge"))
