"""The W3C trace context an outbox row carries from its producer to its handler (see the
tracing page), and outbox-bridge's tracer when tracing is on.

Only the OpenTelemetry API is imported here: an application that writes rows must not pay for
the SDK, which the worker installs (:mod:`outbox_bridge.observability.sdk`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "outbox_bridge"
_PROPAGATOR = TraceContextTextMapPropagator()


def sdk_provider(provider: object, module: str, name: str) -> Any:
    """``provider`` if it is the SDK's ``module.name``, else None. The SDK is looked up, not
    imported: a process that never imported it cannot have installed one of its providers,
    and importing it would cost every producer."""
    sdk = sys.modules.get(module)
    return provider if sdk is not None and isinstance(provider, getattr(sdk, name)) else None


def active_tracer() -> Tracer | None:
    """outbox-bridge's tracer when an SDK tracer provider is installed, else None (callers
    then skip their span work, so that tracing off costs nothing)."""
    provider = sdk_provider(
        trace.get_tracer_provider(), "opentelemetry.sdk.trace", "TracerProvider"
    )
    return None if provider is None else _tracer_of(provider)


@functools.lru_cache(maxsize=1)
def _tracer_of(provider: Any) -> Tracer:
    return cast(Tracer, provider.get_tracer(TRACER_NAME))


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
    seen: dict[tuple[int, int], Link] = {}
    for carrier in carriers:
        span_context = span_context_of(carrier)
        if span_context is not None:
            seen.setdefault((span_context.trace_id, span_context.span_id), Link(span_context))
    return list(seen.values())
