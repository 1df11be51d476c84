"""A drain round (:class:`Round`): what it did in each shard, and what it writes under its shard
locks, queued and written in order on their connection: deletes, holds, releases, unlocks.

Deletes are pipelined, and no round takes a further group while the worker's rounds have
``max_undeleted_groups`` handled and not deleted: a crash repeats at most those and the calls
under way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db import ownership
from outbox_bridge.db.reads import GroupRows
from outbox_bridge.runtime.call_slots import MAX_CONCURRENT_CALLS
from outbox_bridge.runtime.fence import ShardLocks, Work
from outbox_bridge.runtime.waiters import Waiters
from outbox_bridge.workflows.models import HandlerFailure, HeadGroup, HeldFor, ShardRef

if TYPE_CHECKING:
    from outbox_bridge.runtime.calls import HandlerCalls
    from outbox_bridge.runtime.payload_budget import PayloadBudget

log = logging.getLogger(__name__)


class Undeleted:
    """Groups handled and not deleted yet in every round of one worker (handler threads
    included), and the calls waiting for room under ``limit``, first come first served."""

    def __init__(self, limit: int = MAX_CONCURRENT_CALLS) -> None:
        if limit < 1:
            raise ValueError(f"the limit of undeleted groups must be at least 1, not {limit}")
        self.limit = limit
        self.groups = 0  # changed on the event loop only
        self._unreported = 0
        self._lock = threading.Lock()
        self._waiters = Waiters(lambda: self.limit - self.groups - self._unreported)

    def ahead(self) -> bool:
        """Whether deletes should catch up first (also asked from handler threads)."""
        return self.groups + self._unreported >= self.limit

    def unreported(self, groups: int) -> None:
        with self._lock:
            self._unreported += groups

    def added(self) -> None:
        self.groups += 1

    def done(self, groups: int) -> None:
        """``groups`` were deleted, or will never be deleted by their round (they run again)."""
        self.groups -= groups
        self._waiters.wake()

    async def room(self) -> None:
        """Return once the rounds may take a further group."""
        await self._waiters.until(lambda: not self.ahead())


@dataclass(slots=True)
class ShardOutcome:
    """What a round did in one shard, and why it stopped."""

    shard: ShardRef
    groups_handled: int = 0
    rows_handled: int = 0
    highest_seen_id: int = 0
    more: bool = False
    deferred_seconds: float | None = None
    deferred_until: datetime | None = None
    failed: HeadGroup | None = None
    failure: HandlerFailure | None = None
    handler_raised: bool = False  # the failure is the handler's own (not a read or a fault)
    lock_lost: bool = False

    @property
    def emptied(self) -> bool:
        """Nothing is left that this round saw: no due rows, no deferred head, no failure."""
        return (
            not self.more
            and self.failure is None
            and self.deferred_seconds is None
            and not self.lock_lost
        )


Handled = tuple[GroupRows, ShardOutcome]


@dataclass
class Queued:
    """Writes queued and not yet under way."""

    deletes: list[Handled]
    holds: list[tuple[ShardRef, HeldFor, bool]]  # shard, why, only if free
    releases: list[ShardRef]
    unlocks: dict[ShardRef, None]

    def __bool__(self) -> bool:
        return bool(self.deletes or self.holds or self.releases or self.unlocks)


class Round(ShardLocks):
    """One round's locked shards, its writes on the connection of its locks, and what it did
    in each shard.

    A write that fails for one shard's reason (a trigger refusing its delete, say) is done
    again shard by shard; only the shards whose own write fails stop, held with why
    (:meth:`fault`). A lost connection stops every write of the round (the fence); what was
    handled and not deleted is kept in :attr:`unwritten`."""

    def __init__(
        self,
        conn: AsyncConnection,
        table: Table,
        locked: list[ShardRef],
        undeleted: Undeleted | None = None,
        calls: HandlerCalls | None = None,
    ) -> None:
        super().__init__(conn, table, locked)
        self.undeleted = undeleted or Undeleted()
        self.outcomes: dict[ShardRef, ShardOutcome] = {}  # of the shards the round runs
        self._calls = calls
        self.payload_bytes = 0  # taken from the worker's payload budget by this round
        self._queued = Queued([], [], [], {})
        # Unlocks under way: not to queue again (PostgreSQL warns of a second unlock).
        self._unlocking: set[ShardRef] = set()
        self._faulted: list[ShardRef] = []  # shards a write failed for: held next
        # Handled and not deleted when the connection was lost (DrainEngine.locked retries).
        self.unwritten: list[Handled] = []
        self.held: set[ShardRef] = set()  # shards whose hold this round wrote
        self.unlocked: Callable[[ShardRef], None] | None = None  # told of each shard unlocked
        self._flusher: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    def fault(
        self, shard: ShardRef, group: GroupRows | None, what: str, exc: BaseException
    ) -> None:
        """A step of the round failed for ``shard`` alone: it stops as if its handler had
        failed on ``group``, keeps its rows, and is held for its workflow with why."""
        if self._calls is None:  # a round built by hand (tests): no isolation
            raise exc
        outcome = self.outcomes.setdefault(shard, ShardOutcome(shard))
        if outcome.failure is None:
            outcome.failure = self._calls.fault(shard, what, exc)
            outcome.failed = None if group is None else self._calls.head(group)

    async def reserve(self, budget: PayloadBudget, size: int) -> None:
        """Take ``size`` payload bytes of ``budget`` for this round, waiting for room the first
        time; then count what it read instead."""
        if self.payload_bytes:
            budget.add(size)
        else:
            await budget.take(size)
        self.payload_bytes += size

    def may_continue(self, outcome: ShardOutcome) -> bool:
        """Whether ``outcome``'s shard may take a further group (asked from handler threads)."""
        return outcome.failure is None and self.alive()

    async def execute(self, work: Work) -> Any:
        """Run ``work(conn)`` on the round's connection, after every write queued before."""
        await self.flush()
        return await self.statement(work)

    def deleted(self, group: GroupRows, outcome: ShardOutcome) -> None:
        """Queue the delete of a handled group."""
        self._queued.deletes.append((group, outcome))
        self.undeleted.added()
        self._kick()

    async def pace(self) -> None:
        """Wait while the worker's rounds are too far ahead of their deletes."""
        if not self.lost and self._error is None:
            await self.undeleted.room()

    def hold(self, shard: ShardRef, held_for: HeldFor, *, if_free: bool = False) -> None:
        """Hold ``shard`` for its workflow; with ``if_free`` only if no workflow holds it yet."""
        self._queued.holds.append((shard, held_for, if_free))

    def release(self, shard: ShardRef) -> None:
        self._queued.releases.append(shard)

    def unlock(self, shard: ShardRef) -> None:
        """Release ``shard``'s lock once everything queued for it is written."""
        if (
            shard in self.locked
            and shard not in self._queued.unlocks
            and shard not in self._unlocking
            and shard not in self.stuck
        ):
            self._queued.unlocks[shard] = None
            self._kick()

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop())

    async def flush(self) -> None:
        """Write everything queued; raises what a write raised."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)
        await self._flush_loop()
        if self._error is not None:
            raise self._error

    async def _flush_loop(self) -> None:
        while self._queued:
            queued, self._queued = self._queued, Queued([], [], [], {})
            self._unlocking.update(queued.unlocks)
            try:
                if self.lost or self._error is not None:
                    self.unwritten += queued.deletes
                    continue  # fenced: nothing more is written in this round
                await self.statement(functools.partial(self._write, queued))
            except Exception as exc:  # no one shard's reason: the round writes nothing more
                self._error = exc
                self.unwritten += queued.deletes
                if not self.gone(exc):  # raised again by flush(): the round's owner reports it
                    self.lost = True
                    log.warning(
                        "a write of a round of %s failed (%s): nothing more is written in this "
                        "round, and its %s shard(s) are read again",
                        self.table.name,
                        type(exc).__qualname__,
                        len(self.locked),
                    )
            finally:  # deleted, or never by this round (they run again)
                self.undeleted.done(len(queued.deletes))
                self._unlocking.difference_update(queued.unlocks)

    async def _write(self, queued: Queued, _conn: AsyncConnection | None = None) -> None:
        if queued.deletes:
            await self._delete_handled(queued.deletes)
        await self._write_holds(queued.holds)
        for shard in queued.releases:
            await ownership.release(self.conn, self.table, shard)
        if queued.unlocks:
            await self._unlock_each(list(queued.unlocks))

    async def _delete_handled(self, pending: list[Handled]) -> None:
        groups: dict[ShardRef, list[GroupRows]] = {}
        for group, outcome in pending:
            groups.setdefault(outcome.shard, []).append(group)
        deleted: list[int] = []

        async def delete(shards: list[ShardRef]) -> None:
            deleted.extend(
                await self.delete_rows([i for s in shards for g in groups[s] for i in g.ids])
            )

        for shard, exc in (await self.apart(delete, list(groups))).items():
            # Its handled groups stay and run again, after the shard's workflow took it over.
            self.fault(shard, groups[shard][0], "its handled rows cannot be deleted", exc)
            self._faulted.append(shard)
        owner = {row_id: outcome for group, outcome in pending for row_id in group.ids}
        for row_id in deleted:
            owner[row_id].rows_handled += 1

    async def _write_holds(self, holds: list[tuple[ShardRef, HeldFor, bool]]) -> None:
        """The holds queued, then those of the shards a write failed for (if still free)."""
        faulted, self._faulted = self._faulted, []
        if_free: dict[HeldFor, list[ShardRef]] = {}
        for shard, held_for, only_free in holds:
            if only_free:
                if_free.setdefault(held_for, []).append(shard)
            else:
                await ownership.take(self.conn, self.table, shard)
                self.held.add(shard)
        if faulted:
            if_free.setdefault(HeldFor.FAILED, []).extend(faulted)
        for held_for, shards in if_free.items():
            self.held.update(await ownership.hand_over(self.conn, self.table, shards, held_for))

    async def _unlock_each(self, shards: list[ShardRef]) -> None:
        """Unlock ``shards``; one that cannot be is held and locked until the connection closes."""
        failed = await self.apart(self.unlock_now, shards)
        for shard, exc in failed.items():
            self.fault(shard, None, "its lock cannot be released", exc)
            self.stuck.add(shard)
            self._faulted.append(shard)
        if failed:
            await self._write_holds([])
        for shard in shards:
            if shard not in self.stuck:
                self.locked.pop(shard, None)
                if self.unlocked is not None:
                    self.unlocked(shard)
