"""Options of a benchmark invocation, and what every workload gets to run with."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.bridge_run import bench_settings
from bench.cpu import CpuMeter, pid_process, postgres_root
from bench.servers import TemporalServer, temporal
from bench.tuning import Tuning
from outbox_bridge import OutboxSettings

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MODES = {"file": ["file"], "memory": ["memory"], "both": ["file", "memory"]}
SHARD_MODES = {"on-demand": ["on-demand"], "always": ["always"], "both": ["on-demand", "always"]}


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
    # Which shard workflow modes to measure: on-demand (the default), always, or both. With
    # both, always is measured beside on-demand on one server mode (file) with each drain
    # capped at always_share seconds: it starts a workflow for every shard.
    shard_workflows: str = "on-demand"
    always_share: float = 45.0
    handler_yield: bool = False  # every handler call yields to the event loop once
    tuning: Tuning = field(default_factory=Tuning)
    # OutboxSettings fields to override (the benchmark itself overrides none but
    # idle_timeout; the smoke test shortens timers). Recorded in the results.
    settings_overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_environment(cls, **fields: Any) -> BenchConfig:
        """``fields``, with the servers named by ``OUTBOX_DATABASE_URL`` and
        ``TEMPORAL_ADDRESS`` when set (else the bench starts its own)."""
        return cls(
            database_url=os.environ.get("OUTBOX_DATABASE_URL"),
            temporal_address=os.environ.get("TEMPORAL_ADDRESS"),
            **fields,
        )


def scaled(count: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(count * scale))


@dataclass
class Context:
    config: BenchConfig
    database_url: str
    base_dir: Path
    deadline: float  # time.monotonic() by which the whole invocation must be done

    def modes(self, default: str, shard_workflows: str = "on-demand") -> list[str]:
        """The Temporal server modes to measure (one ``external`` when an address is given).
        Beside on demand, ``always`` runs on the file server only, unless a mode was asked
        for."""
        if self.config.temporal_address:
            return ["external"]
        if shard_workflows == "always" and self.config.shard_workflows == "both":
            return MODES[self.config.temporal or "file"]
        return MODES[self.config.temporal or default]

    def shard_modes(self) -> list[str]:
        """The shard workflow modes to measure, on demand first."""
        return SHARD_MODES[self.config.shard_workflows]

    def share(self, wanted: float, shard_workflows: str) -> float:
        """The seconds one drain may take: ``always`` beside on demand is capped."""
        if shard_workflows == "always" and self.config.shard_workflows == "both":
            return min(wanted, self.config.always_share)
        return wanted

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
            self.config.idle_timeout,
            **{**self.config.settings_overrides, **self.config.tuning.settings(), **overrides},
        )

    def cpu_meter(self, server: TemporalServer | None) -> CpuMeter:
        """CPU seconds of this process (the bench and the worker it runs), of the embedded
        PostgreSQL and of the embedded Temporal server (None for servers given by address)."""
        postgres = None if self.config.database_url else postgres_root(self.base_dir / "postgres")
        embedded = server.embedded if server is not None else None
        temporal_process = pid_process(embedded.pid_file) if embedded is not None else None
        return CpuMeter(
            {"bench": psutil.Process(), "postgres": postgres, "temporal": temporal_process}
        )

    def close_timeout(self, settings: OutboxSettings) -> float:
        """How long shard workflows may take to close once the table is empty: a lingering
        drain waits for rows first, then the workflow idles."""
        linger = float(getattr(settings, "linger", 0.0))
        return min(settings.idle_timeout + linger + 30.0, max(self.left() - 20.0, 0.0))
