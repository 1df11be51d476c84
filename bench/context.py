"""Options of a benchmark invocation, and what every workload gets to run with."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from bench.servers import TemporalServer, temporal

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
    idle_timeout: float = 5.0
    latency_seconds: float | None = None  # None: 60 s × scale, at least 3 s
    latency_grace: float = 5.0
    budget: float = 19 * 60.0  # seconds for the whole invocation


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
