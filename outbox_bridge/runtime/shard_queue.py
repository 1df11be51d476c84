"""The shards a partition's drain has yet to drain, in arrival order, and those in its rounds."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

from outbox_bridge.runtime.local_retries import LocalRetries
from outbox_bridge.runtime.unhandled import UnhandledShards
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger(__name__)


class ShardQueue:
    """At most ``limit`` shards queued; the shards left out are found by a scan of every shard
    once the queue runs low (:attr:`overflowed`)."""

    def __init__(
        self,
        partition: str,
        limit: int,
        unhandled: UnhandledShards | None,
        retries: LocalRetries | None = None,
    ) -> None:
        self._partition = partition  # the partition's workflow id, for the log
        self._limit = limit
        self._unhandled = unhandled
        self._retries = retries
        self._queued: dict[ShardRef, None] = {}
        self.in_flight: set[ShardRef] = set()
        self.overflowed = False  # shards were left out of the queue: scan every shard again

    def __len__(self) -> int:
        return len(self._queued)

    def __iter__(self) -> Iterator[ShardRef]:
        return iter(self._queued)

    def room(self) -> int:
        return self._limit - len(self._queued)

    def runs_low(self) -> bool:
        """Fewer than half the cap queued: the time to scan for the shards left out, if any."""
        return len(self._queued) < self._limit // 2

    def add(self, shard: ShardRef) -> None:
        """Queue ``shard`` unless it is queued already, waits for room under the cap on shards
        the app cannot handle or for its retry, or the queue is full."""
        if (
            shard in self._queued
            or (self._unhandled is not None and self._unhandled.waits(shard))
            or (self._retries is not None and self._retries.waits(shard))
        ):
            return
        if len(self._queued) >= self._limit:
            if not self.overflowed:
                log.warning(
                    "partition %s has %s shards queued: further shards wait for a scan of "
                    "every shard once these are drained",
                    self._partition,
                    len(self._queued),
                )
            self.overflowed = True
            return
        self._queued[shard] = None

    def next_round(self, max_shards: int) -> list[ShardRef]:
        """Take up to ``max_shards`` queued shards that no round of this drain has."""
        shards: list[ShardRef] = []
        # Queued shards that are in flight are passed over: look no further than needed.
        for shard in list(itertools.islice(self._queued, max_shards + len(self.in_flight))):
            if len(shards) == max_shards:
                break
            if shard in self.in_flight:
                continue
            del self._queued[shard]
            self.in_flight.add(shard)
            shards.append(shard)
        return shards
