"""A running worker's summary for a person watching it: every few seconds, one line of figures
(:data:`LEGEND`), then a line that counts the handler failures since the last one by shard, whose
own log lines are left out unless ``log_failures`` (a line a second would bury the summary). A
reading that fails leaves a blank: the summary never stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge.db.scans import read_shard_ranges
from outbox_bridge.db.stats import RowCounters, read_row_counters
from outbox_bridge.observability.backlog import count_shard_states
from outbox_bridge.observability.logs import FAILED_CALL, FailedCall, installed_handler
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardState

log = logging.getLogger("outbox_bridge.observability.summary")

SUMMARY_INTERVAL = 5.0  # seconds
STATES = (ShardState.BLOCKED, ShardState.SKIPPED, ShardState.DEFERRED)
COLUMNS = ("written/s", "handled/s", "pending", "shards", "workflows", *STATES)
LEGEND = (
    "rows written and handled per second, rows pending and the shards they are in, running "
    "shard workflows and how many of them are blocked, skipped or deferred"
)
HEADER_EVERY = 10  # lines
# Shards named in a line of handler failures, the most failing first.
FAILING_SHARDS_SHOWN = 3


@dataclass(frozen=True)
class _Reading:
    at: float
    counters: RowCounters | None
    pending: tuple[int, int] | None  # rows, shards
    states: dict[str | None, int | None]  # None: running, in any state


class FailureTally(logging.Filter):
    """Counts the log records of failed handler calls (:class:`FailedCall`) and keeps them off
    the log unless ``show``; every other record passes."""

    def __init__(self, *, show: bool) -> None:
        super().__init__()
        self._show = show
        self._lock = threading.Lock()  # plain-def handlers fail in worker threads
        self._calls: list[FailedCall] = []

    def filter(self, record: logging.LogRecord) -> bool:
        failed = record.__dict__.get(FAILED_CALL)
        if not isinstance(failed, FailedCall):
            return True
        with self._lock:
            self._calls.append(failed)
        return self._show

    def take(self) -> list[FailedCall]:
        """The failures counted since the last call."""
        with self._lock:
            taken, self._calls = self._calls, []
        return taken


@contextlib.contextmanager
def failures_tallied(*, show: bool) -> Iterator[FailureTally]:
    """Count failed handler calls, and keep their lines off the log unless ``show``, while the
    block lasts (the worker's whole life: calls fail also before the first summary line)."""
    tally = FailureTally(show=show)
    handler = installed_handler()
    if handler is not None:
        handler.addFilter(tally)
    try:
        yield tally
    finally:
        if handler is not None:
            handler.removeFilter(tally)


def failures_line(calls: list[FailedCall]) -> str:
    """``  handler failures: ORGANIZATION:7 ×4, ORGANIZATION:14 ×2 (PROJECT_UPDATE:
    ReplicaUnavailable)``: the most failing shards, and what failed."""
    by_shard = Counter(call.shard for call in calls).most_common()
    shown = [f"{shard} ×{count}" for shard, count in by_shard[:FAILING_SHARDS_SHOWN]]
    if len(by_shard) > FAILING_SHARDS_SHOWN:
        shown.append(f"{len(by_shard) - FAILING_SHARDS_SHOWN} more shards")
    errors = sorted({f"{call.category}: {call.error_type}" for call in calls})
    return f"  handler failures: {', '.join(shown)} ({'; '.join(errors)})"


class WorkerSummary:
    """Prints one line every :data:`SUMMARY_INTERVAL` seconds until stopped, and a line of the
    handler failures ``tally`` counted since the last one."""

    def __init__(
        self,
        app: OutboxApp,
        engine: AsyncEngine,
        client: Client,
        task_queue: str,
        *,
        tally: FailureTally,
    ) -> None:
        self._app = app
        self._engine = engine
        self._client = client
        self._task_queue = task_queue
        self._console = Console(highlight=False)
        self._lines = 0
        self._tally = tally

    async def run(self, stop: asyncio.Event) -> None:
        previous = await self._read()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SUMMARY_INTERVAL)
                return
            reading = await self._read()
            self._print(previous, reading)
            previous = reading

    async def _read(self) -> _Reading:
        counters = pending = None
        tables = [self._app.table(name) for name in self._app.tables]
        try:
            async with self._engine.connect() as conn:
                counters = await read_row_counters(conn, tables)
                ranges = [r for t in tables for r in await read_shard_ranges(conn, t)]
                pending = (sum(r.rows for r in ranges), len(ranges))
        except SQLAlchemyError as exc:
            log.warning("summary: cannot read the outbox tables: %s", exc)
        states = await count_shard_states(self._client, self._task_queue, (None, *STATES))
        return _Reading(time.monotonic(), counters, pending, states)

    def _print(self, before: _Reading, now: _Reading) -> None:
        view = Table(box=None, show_header=self._lines % HEADER_EVERY == 0, pad_edge=False)
        for name in COLUMNS:
            view.add_column(name, justify="right", min_width=len(name))
        written = handled = ""
        if before.counters is not None and now.counters is not None:
            seconds = max(now.at - before.at, 1e-3)
            written = f"{(now.counters.inserted - before.counters.inserted) / seconds:.1f}"
            handled = f"{(now.counters.deleted - before.counters.deleted) / seconds:.1f}"
        rows, shards = (str(n) for n in now.pending) if now.pending else ("", "")
        counts = [_count(now.states.get(state)) for state in (None, *STATES)]
        view.add_row(written, handled, rows, shards, *counts)
        self._console.print(view)
        self._lines += 1
        failed = self._tally.take()
        if failed:
            self._console.print(failures_line(failed), soft_wrap=True)


def _count(value: int | None) -> str:
    return "" if value is None else str(value)
