"""A partition's retries of a shard whose handler failed, before the shard goes to a workflow of
its own: most failures are transient (a replica that restarts, a lock that times out), and a
handover costs a workflow start, which the Temporal server makes at a few dozen a second.

A failed head is tried again at once, then after ``initial_retry_interval`` and each time twice
as long (up to ``max_retry_interval``), the schedule the shard's workflow follows too, for as long
as the next attempt begins within ``handover_after`` seconds of the first failure; the failure
after that hands the shard over. Meanwhile the shard waits out of the partition's queue (its
order is kept: its head stays its head) and the other shards go on.
"""

from __future__ import annotations

import heapq
import itertools
import math

from outbox_bridge.runtime.round_writes import ShardOutcome
from outbox_bridge.runtime.unhandled import UnhandledShards
from outbox_bridge.workflows.models import ShardOptions, ShardRef
from outbox_bridge.workflows.shard_transitions import BACKOFF_COEFFICIENT


def attempt_offsets(options: ShardOptions, window: float) -> list[float]:
    """Seconds after the first failure at which each further attempt of the partition begins,
    as many as begin within ``window`` (none if it is 0)."""
    offsets: list[float] = []
    if window <= 0:
        return offsets
    at, interval = 0.0, options.initial_retry_seconds
    offsets.append(at)  # at once
    while at + interval <= window:
        at += interval
        offsets.append(at)
        interval = min(interval * BACKOFF_COEFFICIENT, options.max_retry_interval_seconds)
    return offsets


class LocalRetries:
    """The failing shards of one partition's drain, and when each is tried next."""

    def __init__(self, options: ShardOptions, window: float) -> None:
        offsets = attempt_offsets(options, window)
        # The wait before each retry: the first at once, then the backoff's intervals.
        self._waits = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
        self._failures: dict[ShardRef, int] = {}  # failed attempts in a row, per shard
        self._due: dict[ShardRef, float] = {}  # shards waiting for their retry: when
        self._heap: list[tuple[float, int, ShardRef]] = []
        self._order = itertools.count()

    def attempt(self, shard: ShardRef) -> int:
        """The number of the shard's next attempt (1 unless it failed just before)."""
        return self._failures.get(shard, 0) + 1

    def later(self, outcome: ShardOutcome, now: float) -> bool:
        """True if the shard of a failed ``outcome`` is tried again here (at :meth:`due`): its
        handler raised, and the window has room. False if its workflow takes over (its failures
        are forgotten)."""
        shard = outcome.shard
        if not outcome.handler_raised or UnhandledShards.applies(outcome.failure):
            return False
        failures = self._failures.get(shard, 0)
        if failures >= len(self._waits):
            self._failures.pop(shard, None)
            return False
        self._failures[shard] = failures + 1
        at = now + self._waits[failures]
        self._due[shard] = at
        heapq.heappush(self._heap, (at, next(self._order), shard))
        return True

    def succeeded(self, shard: ShardRef) -> None:
        self._failures.pop(shard, None)

    def waits(self, shard: ShardRef) -> bool:
        """Whether the shard waits for its retry (it is not queued before)."""
        return shard in self._due

    def due(self, now: float) -> list[ShardRef]:
        """The shards whose retry is due, no longer waiting."""
        ready: list[ShardRef] = []
        while self._heap and self._heap[0][0] <= now:
            at, _, shard = heapq.heappop(self._heap)
            if self._due.get(shard) == at:
                del self._due[shard]
                ready.append(shard)
        return ready

    def next_due(self) -> float:
        """When the next retry is due (monotonic), infinity if none waits."""
        return self._heap[0][0] if self._heap else math.inf

    @property
    def waiting(self) -> int:
        """How many shards wait for their retry (a count, not a truth value: an instance with
        none waiting is still an instance)."""
        return len(self._due)
