"""Options of a benchmark invocation, and what every workload gets to run with."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bridge_run import bench_settings
from bench.servers import TemporalServer, temporal
from outbox_bridge import OutboxSettings

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MODES = {"file": ["file"], "memory": ["memory"], "both": ["file", "memory"]}


@dataclass
class BenchConfig:
    """What ``python -m bench`` was asked for (see ``--help``)."""

    scale: float = 1.0
    out: Path = DEFAULT_OUT
    temporal: str | None = None  # file | memory | both; None: each workload's default
    database_url: str | None = None
    temporal_address: str | None = None
    idle_timeout: float = 0.0  # the settings' default: shard workflows close once empty
    latency_seconds: float | None = None  # None: 60 s × scale, at least 3 s
    latency_grace: float = 5.0
    latency_rate: float = 100.0  # rows/s of the latency writer
    latency_shards: int = 200
    budget: float = 18 * 60.0  # seconds for the whole invocation
    # OutboxSettings fields to override (the benchmark itself overrides none but
    # idle_timeout; the smoke test shortens timers). Recorded in the results.
    settings_overrides: dict[str, Any] = field(default_factory=dict)


def scaled(count: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(count * scale))


@dataclass
class Context:
    config: BenchConfig
    database_url: str
    base_dir: Path
    deadline: float  # time.monotonic() by which the whole invocation must be done

    def modes(self, default: str) -> list[str]:
        """The Temporal server modes to measure (one ``external`` when an address is given)."""
        if self.config.temporal_address:
            return ["external"]
        return MODES[self.config.temporal or default]

    def temporal(self, mode: str) -> contextlib.AbstractAsyncContextManager[TemporalServer]:
        return temporal(mode, self.base_dir, self.config.temporal_address)

    def phase_deadline(self, share: float) -> float:
        """When a drain that may take ``share`` seconds must stop (capped by the run's budget,
        keeping some time to collect results)."""
        return min(time.monotonic() + share, self.deadline - 30.0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def settings(self, **overrides: Any) -> OutboxSettings:
        """Settings of one bridge run: defaults, a unique task queue, the idle timeout."""
        return bench_settings(
            self.config.idle_timeout, **{**self.config.settings_overrides, **overrides}
        )

    def close_timeout(self, settings: OutboxSettings) -> float:
        """How long shard workflows may take to close once the table is empty: a lingering
        drain waits for rows first, then the workflow idles."""
        linger = float(getattr(settings, "linger", 0.0))
        return min(settings.idle_timeout + linger + 30.0, max(self.left() - 20.0, 0.0))
