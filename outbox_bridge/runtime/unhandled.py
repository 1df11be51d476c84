"""A cap on the shard workflows that hold shards whose head row this app cannot handle (a
category it does not register, or registers in another scope): anyone who can INSERT can spread
such rows over many shard ids, and each held shard is a workflow retrying an activity forever.

Up to ``max_unhandled_shards`` of them per table get their workflow, as any failing shard does;
the others wait, their rows kept, out of this worker's drain queues, until one of those is
fixed, skipped or deleted. The count comes from the owners table (every worker's shards), read
again every :data:`COUNT_INTERVAL` seconds while shards wait."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from sqlalchemy import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.db.ownership import read_held_shards
from outbox_bridge.errors import CategoryScopeError, UnknownCategoryError
from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.hub import ShardHub, shard_of
from outbox_bridge.workflows.models import HandlerFailure, HeldFor, ShardRef

log = logging.getLogger(__name__)

# The failures of a row that no handler of the app can take, whatever the handler does.
UNHANDLEABLE = frozenset({UnknownCategoryError.__qualname__, CategoryScopeError.__qualname__})
# Seconds between two counts of a table's held shards, while shards wait for room.
COUNT_INTERVAL = 5.0
# Seconds between two log records of held-back shards of one table, at least.
LOG_INTERVAL = 60.0
# Waiting shards remembered per table; past that, a scan finds the others again.
MAX_WAITING = 100_000


@dataclass
class _TableCap:
    held: set[ShardRef] = field(default_factory=set)  # held by their workflow for such a row
    waiting: dict[ShardRef, None] = field(default_factory=dict)  # held back, oldest first
    counted_at: float = -float("inf")
    unlogged: int = 0
    logged_at: float = -float("inf")


class UnhandledShards:
    """One worker's books of the cap, by table, counted on ``engine``; ``hub`` reaches this
    worker's partition drains."""

    def __init__(self, app: OutboxApp, cap: int, engine: AsyncEngine, hub: ShardHub) -> None:
        self._app = app
        self.cap = cap
        self._engine = engine
        self._hub = hub
        self._tables: dict[str, _TableCap] = {}

    @staticmethod
    def applies(failure: HandlerFailure | None) -> bool:
        """Whether a shard failed on a row no handler of the app can take."""
        return failure is not None and failure.error_type in UNHANDLEABLE

    def admit(self, key: ShardRef) -> bool:
        """Whether the shard ``key``, failing on such a row, may be held for its workflow now;
        if not, it waits (counted in ``outbox.shards.held_back``, logged at most once a
        minute)."""
        books = self._books(key.table)
        if key in books.held:
            return True
        if len(books.held) < self.cap:
            books.held.add(key)
            books.waiting.pop(key, None)
            return True
        if len(books.waiting) < MAX_WAITING:
            books.waiting[key] = None
        books.unlogged += 1
        metrics = active_metrics()
        if metrics is not None:
            metrics.shards_held_back.add(1, {"outbox.table": key.table})
        self._log(key.table, books)
        return False

    def waits(self, key: ShardRef) -> bool:
        """Whether ``key`` waits for room (its partition leaves it alone meanwhile)."""
        books = self._tables.get(key.table)
        return books is not None and key in books.waiting

    async def recount(self, table: Table) -> float:
        """While shards of ``table`` wait for room, count its shards held for such a row every
        :data:`COUNT_INTERVAL` seconds; the waiting shards that now have room wait no more, and
        this worker's partitions of ``table`` scan every shard (the next round that meets them
        admits them). Returns when to count next (by ``time.monotonic()``; inf: none waits)."""
        books = self._tables.get(table.name)
        if books is None or not books.waiting:
            return math.inf
        if time.monotonic() < books.counted_at + COUNT_INTERVAL:
            return books.counted_at + COUNT_INTERVAL
        books.counted_at = time.monotonic()
        try:
            async with self._engine.connect() as conn:
                held = await read_held_shards(conn, table)
        except SQLAlchemyError as exc:
            log.warning("cannot count the held shards of %s: %s", table.name, exc)
            return books.counted_at + COUNT_INTERVAL
        books.held = {
            shard_of(self._app, table.name, shard.region, shard.scope, shard.shard_identifier)
            for shard in held
            if shard.held_for == HeldFor.FAILED
            and shard.head is not None
            and not self._handleable(shard.scope, shard.head.category)
        }
        released = list(books.waiting)[: max(0, self.cap - len(books.held))]
        for key in released:
            del books.waiting[key]
        if released:
            self._hub.rescan(table.name)
        return books.counted_at + COUNT_INTERVAL if books.waiting else math.inf

    def _handleable(self, scope: int, category: int) -> bool:
        owner = self._app.scope_of(category)
        return owner is not None and int(owner) == scope

    def _books(self, table: str) -> _TableCap:
        return self._tables.setdefault(table, _TableCap())

    def _log(self, table: str, books: _TableCap) -> None:
        now = time.monotonic()
        if now - books.logged_at < LOG_INTERVAL:
            return
        log.warning(
            "held back %s shards of %s whose head row this app cannot handle (a category it "
            "does not register, or registers in another scope): %s shard workflows hold such "
            "shards, the most max_unhandled_shards allows; the others wait with their rows "
            "until one of those is fixed, skipped or deleted",
            f"{books.unlogged:,}",
            table,
            len(books.held),
        )
        books.unlogged = 0
        books.logged_at = now
