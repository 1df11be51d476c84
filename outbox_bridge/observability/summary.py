"""A running worker's summary for a person watching it: every few seconds, one line with the rows
written and handled per second, the rows pending and the shards they are in, and how many shard
workflows are running, and blocked, skipped or deferred among them.

Rates come from PostgreSQL's statistics (:mod:`outbox_bridge.db.stats`), pending rows and shards
from the same aggregate a sweep reads, states from Temporal's visibility store (the
``OutboxState`` search attribute). A reading that fails leaves a blank and is tried again at the
next line: the summary never stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.db.stats import RowCounters, read_row_counters
from outbox_bridge.db.store import read_shard_ranges
from outbox_bridge.observability.backlog import count_shard_states
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardState

log = logging.getLogger("outbox_bridge.observability.summary")

SUMMARY_INTERVAL = 5.0  # seconds
STATES = (ShardState.BLOCKED, ShardState.SKIPPED, ShardState.DEFERRED)
COLUMNS = ("written/s", "handled/s", "pending", "shards", "workflows", *STATES)
# What the columns mean, for the banner.
LEGEND = (
    "rows written and handled per second, rows pending and the shards they are in, running "
    "shard workflows (lingering ones included) and how many of them are blocked, skipped or "
    "deferred"
)
HEADER_EVERY = 10  # lines


@dataclass(frozen=True)
class _Reading:
    at: float
    counters: RowCounters | None
    pending: tuple[int, int] | None  # rows, shards
    states: dict[str | None, int | None]  # None: running, in any state


class WorkerSummary:
    """Prints one line every ``interval`` seconds until stopped (a header every few lines)."""

    def __init__(
        self,
        app: OutboxApp,
        engine: AsyncEngine,
        client: Client,
        task_queue: str,
        *,
        console: Console | None = None,
        interval: float = SUMMARY_INTERVAL,
    ) -> None:
        self._app = app
        self._engine = engine
        self._client = client
        self._task_queue = task_queue
        self._console = console or Console(highlight=False)
        self._interval = interval
        self._lines = 0

    async def run(self, stop: asyncio.Event) -> None:
        previous = await self._read()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self._interval)
                return
            except TimeoutError:
                pass
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
        try:
            states = await count_shard_states(self._client, self._task_queue, (None, *STATES))
        except RPCError as exc:  # count_shard_states logs per state; this is the connection
            log.warning("summary: cannot count shard workflows: %s", exc.message)
            states = {}
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


def _count(value: int | None) -> str:
    return "" if value is None else str(value)
