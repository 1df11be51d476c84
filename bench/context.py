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
# How long shard workflows may take to complete once the table is empty.
CLOSE_SECONDS = 30.0


@dataclass
class BenchConfig:
    """What ``python -m bench`` was asked for (see ``--help``)."""

    scale: float = 1.0
    out: Path = DEFAULT_OUT
    temporal: str | None = None  # file | memory | both; None: each workload's default
    database_url: str | None = None
    temporal_address: str | None = None
    latency_seconds: float | None = None  # None: 60 s × scale, at least 3 s
    latency_grace: float = 5.0
    latency_rate: float = 100.0  # rows/s of the latency writer
    latency_shards: int = 200
    budget: float = 18 * 60.0  # seconds for the whole invocation
    handler_yield: bool = False  # every handler call yields to the event loop once
    tuning: Tuning = field(default_factory=Tuning)
    # OutboxSettings fields to override (the benchmark itself overrides none; the smoke test
    # shortens timers). Recorded in the results.
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
        """Settings of one bridge run: defaults and a unique task queue."""
        return bench_settings(
            **{**self.config.settings_overrides, **self.config.tuning.settings(), **overrides}
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

    def close_timeout(self) -> float:
        """How long shard workflows may take to complete once the table is empty (each does
        as soon as its shard is), within the run's budget."""
        return min(CLOSE_SECONDS, max(self.left() - 20.0, 0.0))
