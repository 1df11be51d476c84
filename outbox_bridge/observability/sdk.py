"""The OpenTelemetry SDK, installed by the worker: the tracer and meter providers with their
exporters, Temporal's tracing interceptor, and a Temporal runtime whose SDK metrics share the
meter provider. It loads the SDK and the Temporal worker: never imported on the producer side.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, cast

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from temporalio.contrib.opentelemetry import MetricsExporter, TracingInterceptor
from temporalio.runtime import MetricBuffer, MetricBufferDurationFormat, Runtime, TelemetryConfig

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.observability.telemetry import TRACER_NAME

log = logging.getLogger("outbox_bridge.observability.sdk")


@dataclass
class Telemetry:
    """The providers the worker installed (None: that signal is off)."""

    tracing: TracerProvider | None = None
    metrics: MetricsSetup | None = None

    def shutdown(self) -> None:
        """Export what the providers still hold, and stop the scrape endpoint."""
        for provider in (self.tracing, self.metrics):
            if provider is not None:
                provider.shutdown()


def setup_telemetry(settings: OutboxSettings) -> Telemetry:
    """Install the tracer and meter providers the settings ask for, as the process-wide ones;
    with ``OTEL_SDK_DISABLED`` none (and no scrape endpoint), as the SDK would export nothing."""
    if settings.otel_sdk_disabled:
        if (settings.otel_exporter, settings.metrics_exporter) != ("none", "none"):
            log.info(
                "OTEL_SDK_DISABLED is set: no spans (%s) and no metrics (%s) are exported",
                settings.otel_exporter,
                settings.metrics_exporter,
            )
        return Telemetry()
    tracing = build_tracer_provider(settings.otel_exporter)
    if tracing is not None:
        trace.set_tracer_provider(tracing)
        log.info("spans are exported to %s", settings.otel_exporter)
    setup = build_meter_provider(
        settings.metrics_exporter, host=settings.metrics_host, port=settings.metrics_port
    )
    if setup is not None:
        metrics.set_meter_provider(setup.provider)
        log.info("metrics are exported to %s", setup.endpoint or settings.metrics_exporter)
    return Telemetry(tracing, setup)


def _otlp_exporter(signal: str) -> Any:
    """OTLP's exporter of ``signal`` (trace, metric), over HTTP or gRPC as the OTEL_* variables
    say; the exporter reads the other OTEL_EXPORTER_OTLP_* ones itself."""
    variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}S_PROTOCOL"
    protocol = os.environ.get(variable) or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    transport = "http" if protocol.startswith("http") else "grpc"
    module = importlib.import_module(
        f"opentelemetry.exporter.otlp.proto.{transport}.{signal}_exporter"
    )
    return getattr(module, "OTLPSpanExporter" if signal == "trace" else "OTLPMetricExporter")()


def telemetry_resource() -> Resource:
    """``service.name`` is ``outbox-bridge`` unless ``OTEL_SERVICE_NAME`` or
    ``OTEL_RESOURCE_ATTRIBUTES`` name the service (Resource.create() reads both)."""
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return Resource.create({} if named else {SERVICE_NAME: "outbox-bridge"})


def build_tracer_provider(exporter: str) -> TracerProvider | None:
    """A tracer provider exporting to ``exporter`` (none, console, otlp), or None for none."""
    if exporter == "none":
        return None
    provider = TracerProvider(resource=telemetry_resource())
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter("trace")))
    else:
        raise ValueError(f"unknown span exporter {exporter!r}")
    return provider


def tracing_interceptor() -> TracingInterceptor:
    """Temporal's interceptor: client calls, workflows and activities get spans, and the trace
    context crosses Temporal in headers (never in payloads). Not the experimental
    ``OpenTelemetryPlugin``: it exports a workflow's spans only when its run ends, and these
    runs last long (the tracing page compares the two)."""
    return TracingInterceptor(trace.get_tracer(TRACER_NAME))


def metric_exporter(exporter: str) -> MetricExporter:
    """The push exporter of ``exporter`` (console or otlp)."""
    if exporter == "console":
        return ConsoleMetricExporter()
    if exporter != "otlp":
        raise ValueError(f"unknown metric exporter {exporter!r}")
    return cast(MetricExporter, _otlp_exporter("metric"))


@dataclass
class MetricsSetup:
    """An installed meter provider and, for Prometheus, its scrape endpoint."""

    provider: MeterProvider
    endpoint: str | None = None
    _server: Any = None

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.provider.shutdown()


def build_meter_provider(exporter: str, *, host: str, port: int) -> MetricsSetup | None:
    """A meter provider for ``exporter`` (none, prometheus, otlp, console), or None for none:
    ``prometheus`` serves ``http://host:port/metrics``, the others push every
    ``OTEL_METRIC_EXPORT_INTERVAL`` milliseconds."""
    if exporter == "none":
        return None
    if exporter != "prometheus":
        reader = PeriodicExportingMetricReader(metric_exporter(exporter))
        return MetricsSetup(MeterProvider(metric_readers=[reader], resource=telemetry_resource()))
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror}); pick another --metrics-port"
        ) from None
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader()], resource=telemetry_resource()
    )
    return MetricsSetup(provider, f"http://{host}:{server.server_port}/metrics", server)


_runtime: tuple[object, Runtime] | None = None
_runtime_lock = threading.Lock()


def temporal_runtime() -> Runtime | None:
    """A Temporal runtime whose SDK metrics are exported through the installed meter provider
    (drained from a buffer every second by a thread of its own), or None when metrics are off.
    One runtime per process and provider: each runtime owns a thread pool."""
    global _runtime
    provider = metrics.get_meter_provider()
    if not isinstance(provider, MeterProvider):
        return None
    with _runtime_lock:
        if _runtime is None or _runtime[0] is not provider:
            buffer = MetricBuffer(100_000, MetricBufferDurationFormat.SECONDS)
            runtime = Runtime(telemetry=TelemetryConfig(metrics=buffer, attach_service_name=False))
            exporting = MetricsExporter(buffer, provider).run()
            threading.Thread(
                target=asyncio.run, args=(exporting,), name="temporal-metrics", daemon=True
            ).start()
            _runtime = (provider, runtime)
        return _runtime[1]
