"""The workloads of ``python -m bench peers``: the same rows for every system.

- ``backlog``: 100,000 rows over 1,000 keys, 20% of them coalescible (a pending duplicate of an
  earlier object), no-op handler;
- ``io``: 10,000 rows at random over 1,000 keys, every call waits 50 ms (``asyncio.sleep``, or
  ``time.sleep`` where the system runs plain functions only);
- ``latency``: 100 rows/s for 60 s over 1,000 keys, one transaction each, the workers running;
  p50/p99 from commit to handler start;
- ``hot-key``: 20,000 rows in one key;
- ``flaky``: the backlog's rows; 2% of the coalescing groups fail 3 times, then succeed.

``--scale`` multiplies the row and key counts (latency: its duration). Which groups fail is
:func:`bench.app.fails` of the group, as in the other workloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.app import fails
from bench.context import scaled
from bench.peers.checker import Row
from bench.rows import SCOPE, RowSet, backlog_rows, distinct_rows

LATENCY_RATE = 100.0  # rows/s
LATENCY_SECONDS = 60.0
IO_WAIT_SECONDS = 0.05
FLAKY_SHARE = 0.02


@dataclass(frozen=True)
class PeerWorkload:
    name: str
    summary: str
    make_rows: Callable[[float], RowSet]
    share: float  # seconds a system may take to drain before the run is capped
    wait_seconds: float = 0.0
    failing_share: float = 0.0
    rate: float | None = None  # rows/s written while the workers run (else a backlog first)

    def rows(self, scale: float) -> list[Row]:
        rowset = self.make_rows(scale)
        return [Row(i + 1, shard, category, obj) for i, (_, shard, category, obj) in enumerate(
            rowset.rows
        )]  # fmt: skip

    def failing(self, rows: list[Row]) -> list[tuple[int, int, int]]:
        """The groups (key, category, object) whose handler fails."""
        if not self.failing_share:
            return []
        groups = {(r.key, r.category, r.obj) for r in rows}
        return sorted(g for g in groups if fails((SCOPE, *g), self.failing_share))


def _backlog(scale: float) -> RowSet:
    return backlog_rows(scaled(100_000, scale), scaled(1_000, scale), 0.2)


def _latency(scale: float) -> RowSet:
    count = max(300, round(LATENCY_RATE * LATENCY_SECONDS * scale))
    return distinct_rows(count, 1_000)


WORKLOADS: dict[str, PeerWorkload] = {
    w.name: w
    for w in [
        PeerWorkload(
            "backlog",
            "100,000 rows over 1,000 keys, 20% coalescible, no-op handler",
            _backlog,
            share=300.0,
        ),
        PeerWorkload(
            "io",
            "10,000 rows at random over 1,000 keys, each its own group, every call waits 50 ms",
            lambda s: backlog_rows(scaled(10_000, s), scaled(1_000, s), 0.0, seed=2),
            share=180.0,
            wait_seconds=IO_WAIT_SECONDS,
        ),
        PeerWorkload(
            "latency",
            f"{LATENCY_RATE:.0f} rows/s over 1,000 keys, one transaction each, workers running",
            _latency,
            share=60.0,
            rate=LATENCY_RATE,
        ),
        PeerWorkload(
            "hot-key",
            "20,000 rows in one key, no-op handler",
            lambda s: distinct_rows(scaled(20_000, s), 1),
            share=180.0,
        ),
        PeerWorkload(
            "flaky",
            "the backlog's rows; 2% of the coalescing groups fail 3 times, then succeed",
            _backlog,
            share=300.0,
            failing_share=FLAKY_SHARE,
        ),
    ]
}
