"""Tracing: the OpenTelemetry tracer provider, Temporal's tracing interceptor, and the trace
context that travels with an outbox row from its producer to its handler.

A row written inside an active span stores that span's W3C trace context (``traceparent`` and
``tracestate``) in its ``trace_context`` column. The handler's span links to the producer span of
every row its call covers, so the traces of coalesced rows are not lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Link, SpanContext, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio.contrib.opentelemetry import TracingInterceptor

log = logging.getLogger("outbox_bridge.observability.telemetry")

TRACER_NAME = "outbox_bridge"
_PROPAGATOR = TraceContextTextMapPropagator()

# The W3C carrier stored on a row: {"traceparent": ..., "tracestate": ...} (tracestate optional).
TraceCarrier = Mapping[str, str]


def otlp_protocol(signal: str) -> str:
    """The OTLP protocol for ``signal`` (TRACES, METRICS), as the OTEL_* variables set it."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )


def telemetry_resource() -> Resource:
    """``service.name`` is ``outbox-bridge`` unless ``OTEL_SERVICE_NAME`` or
    ``OTEL_RESOURCE_ATTRIBUTES`` name the service; other resource attributes come from
    ``OTEL_RESOURCE_ATTRIBUTES``."""
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    # Resource.create() reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself.
    return Resource.create({} if named else {SERVICE_NAME: "outbox-bridge"})


def _otlp_exporter() -> SpanExporter:
    # The OTLP exporters read OTEL_EXPORTER_OTLP_{ENDPOINT,HEADERS,...} themselves.
    if otlp_protocol("TRACES").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc()


def build_tracer_provider(exporter: str) -> TracerProvider | None:
    """A tracer provider exporting to ``exporter`` (none, console, otlp), or None for none."""
    if exporter == "none":
        return None
    provider = TracerProvider(resource=telemetry_resource())
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
    return TracingInterceptor(trace.get_tracer(TRACER_NAME))


_active: tuple[object, Tracer] | None = None


def active_tracer() -> Tracer | None:
    """outbox-bridge's tracer when an SDK tracer provider is installed, else None.

    Callers skip their span work (and the trace-context reads) on None, so that tracing costs
    nothing when it is off.
    """
    global _active
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    if _active is None or _active[0] is not provider:
        _active = (provider, provider.get_tracer(TRACER_NAME))
    return _active[1]


# -- the trace context of a row -----------------------------------------------------------------


def carrier_of_current() -> dict[str, str] | None:
    """The current span's W3C trace context, or None outside a valid span."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier or None


def span_context_of(carrier: object) -> SpanContext | None:
    """The span context a stored carrier names, or None when there is none (or it is not a
    W3C carrier: rows written with plain SQL may hold anything)."""
    if not isinstance(carrier, Mapping) or not isinstance(carrier.get("traceparent"), str):
        return None
    context = _PROPAGATOR.extract({k: v for k, v in carrier.items() if isinstance(v, str)})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def context_of(carrier: object) -> otel_context.Context | None:
    """A context whose parent is the span a stored carrier names, or None."""
    span_context = span_context_of(carrier)
    if span_context is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def links_to(carriers: Iterable[object]) -> list[Link]:
    """One link per distinct producer span among ``carriers`` (many rows of one transaction
    share a span). The SDK's span limits (``OTEL_SPAN_LINK_COUNT_LIMIT``, 128 by default) cap
    the links of a very large coalescing group."""
    seen: dict[str, Link] = {}
    for carrier in carriers:
        if not isinstance(carrier, Mapping):
            continue
        traceparent = carrier.get("traceparent")
        if not isinstance(traceparent, str) or traceparent in seen:
            continue
        span_context = span_context_of(carrier)
        if span_context is not None:
            seen[traceparent] = Link(span_context)
    return list(seen.values())
