"""In-process hand-off from the bridge's notifications to this worker's partition drains (one
that runs elsewhere finds the rows by its own scans). Both sides run on one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from outbox_bridge.db.scans import partition_number
from outbox_bridge.workflows.models import PartitionRef, ShardRef

if TYPE_CHECKING:
    from outbox_bridge.registry import OutboxApp


def shard_of(
    app: OutboxApp, table: str, region: str | None, scope: int, shard_identifier: int
) -> ShardRef:
    """A shard named from its columns (a notification's, a scan's), its scope named by ``app``."""
    return ShardRef(table, scope, app.scope_name(scope), shard_identifier, region)


def in_regions(region: str | None, regions: Sequence[str] | None) -> bool:
    """Whether this worker serves a shard of ``region`` (None: a table without regions)."""
    return region is None or regions is None or region in regions


def partition_of(shard: ShardRef, partitions: int) -> int:
    """The partition that drains a healthy shard, the same in every process and in SQL."""
    return partition_number(shard.region, shard.scope, shard.shard_identifier, partitions)


# Shards a partition's inbox keeps news of; past that, its drain scans every shard instead.
MAX_NEWS = 100_000


class PartitionInbox:
    """News for one partition drain of this worker: shards with new rows, newest id each."""

    def __init__(self, table: str, partition: int, partitions: int) -> None:
        self.table = table
        self.partition = partition
        self.partitions = partitions
        self.news: dict[ShardRef, int] = {}
        self.rescan = False  # a statement touched too many shards to name them
        self.event = asyncio.Event()

    def offer(self, key: ShardRef, max_id: int) -> None:
        known = self.news.get(key)
        if known is None and len(self.news) >= MAX_NEWS:
            self.rescan = True
        elif known is None or max_id > known:
            self.news[key] = max_id
        self.event.set()

    def take(self) -> dict[ShardRef, int]:
        news, self.news = self.news, {}
        self.event.clear()
        return news


async def wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Return once one of ``events`` is set, or after ``timeout`` seconds."""
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class ShardHub:
    def __init__(self) -> None:
        self._partitions: dict[tuple[str, int], PartitionInbox] = {}
        self.closed = False
        self.listening = False  # the bridge LISTENs: notifications bring the new rows

    def set_listening(self, listening: bool) -> None:
        """The bridge started or stopped listening. Every drain scans every shard now (rows
        may have come while nobody listened) and sets its polling again."""
        if listening != self.listening:
            self.listening = listening
            for inbox in self._partitions.values():
                inbox.rescan = True
                inbox.event.set()

    def close(self) -> None:
        """Shutting down: wake every drain so that it returns now."""
        self.closed = True
        for inbox in self._partitions.values():
            inbox.event.set()

    # -- partition drains ------------------------------------------------------------------

    def open_partition(self, table: str, partition: int, partitions: int) -> PartitionInbox:
        """Register this worker's drain of ``partition`` of ``table``."""
        inbox = PartitionInbox(table, partition, partitions)
        self._partitions[(table, partition)] = inbox
        return inbox

    def drains(self) -> list[PartitionInbox]:
        """This worker's partition drains, the oldest first."""
        return list(self._partitions.values())

    def drains_partition(self, ref: PartitionRef) -> bool:
        """True if this worker runs the drain of ``ref`` (of as many partitions)."""
        inbox = self._partitions.get((ref.table, ref.partition))
        return inbox is not None and inbox.partitions == ref.partitions

    def close_partition(self, inbox: PartitionInbox) -> None:
        if self._partitions.get((inbox.table, inbox.partition)) is inbox:
            del self._partitions[(inbox.table, inbox.partition)]

    def rescan(self, table: str) -> None:
        """Ask this worker's partitions of ``table`` to scan every shard now."""
        for (name, _), inbox in self._partitions.items():
            if name == table:
                inbox.rescan = True
                inbox.event.set()

    def offer_to_partition(self, key: ShardRef, max_id: int) -> bool:
        """Queue news of ``key`` for this worker's drain of its partition; False if none runs."""
        for (table, partition), inbox in self._partitions.items():
            if table == key.table and partition_of(key, inbox.partitions) == partition:
                inbox.offer(key, max_id)
                return True
        return False
