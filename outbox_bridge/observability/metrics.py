"""outbox-bridge's instruments, recorded only when an SDK meter provider is installed
(:func:`active_metrics` is None otherwise), so that metrics off cost nothing. Only the
OpenTelemetry API is imported here: the producer counts its rows with it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from outbox_bridge.observability.telemetry import sdk_provider

METER_NAME = "outbox_bridge"

# Seconds. A handler call takes milliseconds to minutes; a row waits milliseconds to days.
# fmt: off
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300)
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600,
                 4 * 3600, 24 * 3600)
# fmt: on

Attributes = tuple[tuple[str, Any], ...]


class OutboxMetrics:
    """outbox-bridge's instruments on one meter (the metrics page says what each counts)."""

    def __init__(self, meter: Meter) -> None:
        self.rows_written = meter.create_counter(
            "outbox.rows.written", unit="{row}", description="Rows written with the producer API."
        )
        self.rows_handled = meter.create_counter(
            "outbox.rows.handled",
            unit="{row}",
            description="Rows covered by a successful handler call (then deleted).",
        )
        self.rows_coalesced = meter.create_counter(
            "outbox.rows.coalesced",
            unit="{row}",
            description="Rows covered by a handler call for a newer row of their coalescing "
            "group, instead of a call of their own.",
        )
        self.handler_duration = meter.create_histogram(
            "outbox.handler.duration",
            unit="s",
            description="Duration of handler calls, by category and outcome.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.handler_failures = meter.create_counter(
            "outbox.handler.failures",
            unit="{failure}",
            description="Failed handler calls, by category and error class.",
        )
        self.queue_time = meter.create_histogram(
            "outbox.queue.time",
            unit="s",
            description="Time from a handled row's date_added to its handler's success.",
            explicit_bucket_boundaries_advisory=QUEUE_BUCKETS,
        )
        self.rate_limit_wait = meter.create_histogram(
            "outbox.rate_limit.wait",
            unit="s",
            description="Time a handler call of a rate-limited category waited for its token, "
            "by category.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.notifications_refused = meter.create_counter(
            "outbox.notifications.refused",
            unit="{notification}",
            description="Notifications on a table's channel that were not the trigger's "
            "(anyone who can connect can NOTIFY), by table.",
        )
        self.shards_held_back = meter.create_counter(
            "outbox.shards.held_back",
            unit="{shard}",
            description="Shards that failed on a row the app cannot handle and were left "
            "without a workflow, max_unhandled_shards being reached, by table.",
        )
        self._observed: dict[int, dict[str, dict[Attributes, float]]] = {}
        self._lock = threading.Lock()
        gauges = {
            "outbox.shards.blocked": ("{shard}", "Shard workflows blocked by a failing handler."),
            "outbox.shards.skipped": ("{shard}", "Shard workflows skipped by an operator."),
            "outbox.backlog.rows": ("{row}", "Pending rows per scope, as of the last sweep."),
            "outbox.backlog.oldest_age_seconds": (
                "s",
                "Age of the oldest pending row per scope, as of the last sweep.",
            ),
        }
        for name, (unit, description) in gauges.items():
            meter.create_observable_gauge(
                name, callbacks=[self._observer(name)], unit=unit, description=description
            )
        self._attributes: dict[tuple[str | None, ...], dict[str, Any]] = {}

    def report(self, owner: object, name: str, values: Mapping[Attributes, float]) -> None:
        """Set ``owner``'s observations of gauge ``name`` for the given attribute sets."""
        with self._lock:
            self._observed.setdefault(id(owner), {}).setdefault(name, {}).update(values)

    def forget(self, owner: object) -> None:
        """Drop ``owner``'s observations (a bridge that stopped leading, or stopped)."""
        with self._lock:
            self._observed.pop(id(owner), None)

    def _observer(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                return [
                    Observation(value, dict(attributes))
                    for owned in self._observed.values()
                    for attributes, value in owned.get(name, {}).items()
                ]

        return observe

    def category_attributes(
        self, table: str, scope: str, category: str, outcome: str | None = None
    ) -> dict[str, Any]:
        """``outbox.table``, ``outbox.scope``, ``outbox.category`` and, when given,
        ``outbox.outcome`` (success or failure): built once per key."""
        key = (table, scope, category, outcome)
        found = self._attributes.get(key)
        if found is None:
            found = {"outbox.table": table, "outbox.scope": scope, "outbox.category": category}
            if outcome is not None:
                found["outbox.outcome"] = outcome
            self._attributes[key] = found
        return found


def active_metrics() -> OutboxMetrics | None:
    """The instruments on the installed SDK meter provider, or None when metrics are off."""
    provider = sdk_provider(
        metrics.get_meter_provider(), "opentelemetry.sdk.metrics", "MeterProvider"
    )
    return None if provider is None else _metrics_of(provider)


@functools.lru_cache(maxsize=1)
def _metrics_of(provider: Any) -> OutboxMetrics:
    return OutboxMetrics(provider.get_meter(METER_NAME))
