"""One drain round over many shards at once: lock them, read their heads, run their handlers,
delete what was handled, unlock them.

Every write of a round goes through the one connection that holds its shard locks: if it dies,
the locks are gone and so is every later write of the round (the fence), and its handled rows run
again. Deletes are pipelined, and no round takes a further group while the worker's rounds have
``max_undeleted_groups`` handled and not deleted: a crash repeats at most those and the calls
under way. The rounds of a worker together are also bounded by the payload bytes of their
groups' newest rows (:mod:`~outbox_bridge.runtime.payload_budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import select
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Row, Table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox_bridge.db import ownership
from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN
from outbox_bridge.db.store import (
    GroupRows,
    GroupTail,
    ShardWindow,
    WindowRow,
    driver_writes,
    lock_key,
    lock_shard_waiting,
    read_first_row,
    read_group_tails,
    read_payload_sizes,
    read_rows,
    read_trace_contexts,
    read_windows,
    try_lock_shards,
    unlock_shards,
)
from outbox_bridge.observability.observe import BatchObserver
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.call_slots import MAX_CONCURRENT_CALLS, RoundShards
from outbox_bridge.runtime.calls import Call, HandlerCalls, HandlerFailed, Pace
from outbox_bridge.runtime.payload_budget import PAYLOAD_BUDGET_BYTES, PayloadBudget
from outbox_bridge.runtime.waiters import Waiters
from outbox_bridge.workflows.models import HandlerFailure, HeadGroup, HeldFor, ShardRef

log = logging.getLogger(__name__)

# poll() events of a socket the peer has closed (POLLRDHUP: Linux only).
HANGUP = (
    getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR
    if hasattr(select, "poll")
    else 0
)


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


@dataclass
class ShardHead:
    """What a round found at the head of one shard: the groups to handle, in order."""

    shard: ShardRef
    groups: list[GroupRows]
    highest_id: int
    more: bool = False  # due rows may remain after these groups
    open_ended: bool = False  # the read stopped at its window, not at a deferred row
    deferred_seconds: float | None = None  # then the head is a row not due for this long
    deferred_until: datetime | None = None  # (when it is due)
    rows: dict[int, Row[Any]] = field(default_factory=dict)  # the newest row of each group
    fault: HandlerFailure | None = None  # why the head cannot be read (its first group fails)


@dataclass
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


class LockedShards:
    """Shards locked on one connection for one round, and the round's writes on it, in order:
    deletes, holds, releases, unlocks.

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
        self.conn = conn
        self.table = table
        # The shards still locked, in locking order (a dict: membership tests stay cheap).
        self.locked: dict[ShardRef, None] = dict.fromkeys(locked)
        self.lost = False
        self.suspect = False  # something arrived between statements: take no further group
        self._statements = 0  # odd while a statement is under way
        self._socket: psycopg.AsyncConnection[Any] | None = None
        self._busy = asyncio.Lock()  # one statement at a time on the connection
        self._pending: list[tuple[GroupRows, ShardOutcome]] = []
        # Handled and not deleted when the connection was lost (DrainEngine.locked retries).
        self.unwritten: list[tuple[GroupRows, ShardOutcome]] = []
        self.outcomes: dict[ShardRef, ShardOutcome] = {}  # of the shards the round runs
        self.held: set[ShardRef] = set()  # shards whose hold this round wrote
        self._calls = calls
        self._unlocks: dict[ShardRef, None] = {}
        # Unlocks under way: not to queue again (PostgreSQL warns of a second unlock).
        self._unlocking: set[ShardRef] = set()
        self._holds: list[tuple[ShardRef, HeldFor, bool]] = []  # shard, why, only if free
        self._faulted: list[ShardRef] = []  # shards a write failed for: held next
        self.stuck: set[ShardRef] = set()  # locks only closing the connection releases
        self._releases: list[ShardRef] = []
        self._flusher: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.undeleted = undeleted or Undeleted()
        self.payload_bytes = 0  # taken from the worker's payload budget by this round

    async def attach(self) -> None:
        raw = await self.conn.get_raw_connection()
        driver = raw.driver_connection
        self._socket = driver if isinstance(driver, psycopg.AsyncConnection) else None

    def alive(self) -> bool:
        """Whether the connection (and every lock of the round) still seems to stand; asked
        before each handler call, also from handler threads. An idle connection that is not
        listening receives nothing unless the server is closing it. The socket is only polled,
        never read (psycopg may be awaiting an answer on it); the next statement is the fence."""
        if self.lost or self.suspect:
            return False
        driver = self._socket
        if driver is None:
            return True
        statements = self._statements
        try:
            if driver.pgconn.status != psycopg.pq.ConnStatus.OK:
                self._lose("the connection is closed")
                return False
            if statements % 2:  # an answer may be arriving: only a hang-up says anything
                return not self._closed_by_server(driver.pgconn.socket)
            readable, _, _ = select.select([driver.pgconn.socket], [], [], 0)
        except (OSError, psycopg.Error, ValueError) as exc:
            self._lose(str(exc))
            return False
        if readable and self._statements == statements:
            self._suspect("received something between statements (the server may be closing it)")
        return not self.suspect

    def _closed_by_server(self, socket: int) -> bool:
        """Whether the server closed the connection; marks the round suspect if it did."""
        if not HANGUP:
            return False
        poller = select.poll()  # one per call: handler threads ask at the same time
        poller.register(socket, HANGUP)
        if not poller.poll(0):
            return False
        self._suspect("was closed by the server while a statement was under way")
        return True

    def _suspect(self, seen: str) -> None:
        if not self.suspect:
            self.suspect = True
            self._warn(f"{seen}: this round takes no further group")

    def _lose(self, why: str) -> None:
        if not self.lost:
            self.lost = True
            self._warn(
                f"is gone ({why}): no further groups or deletes in this round; its handled "
                "rows stay and run again"
            )

    def _warn(self, what: str) -> None:
        log.warning(
            "the connection holding %s shard lock(s) of %s %s",
            len(self.locked),
            self.table.name,
            what,
        )

    async def execute(self, work: Any) -> Any:
        """Run ``work(conn)`` on the round's connection, after every write queued before."""
        await self.flush()
        async with self._busy:
            return await self._statement(work)

    async def _statement(self, work: Any) -> Any:
        # Look at the idle socket before the statement hides a server's close from alive().
        self.alive()
        self._statements += 1
        try:
            return await work(self.conn)
        except BaseException as exc:
            if self.gone(exc):
                self._lose(type(exc).__name__)
            raise
        finally:
            self._statements += 1

    def gone(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a statement of this round, means its locks are gone."""
        if self.lost or isinstance(exc, OSError) or self.conn.invalidated:
            return True
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
        driver = self._socket
        return driver is not None and (driver.closed or driver.broken)

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

    def may_continue(self, outcome: ShardOutcome) -> bool:
        """Whether ``outcome``'s shard may take a further group (asked from handler threads)."""
        return outcome.failure is None and self.alive()

    # -- queued writes -----------------------------------------------------------------------

    def deleted(self, group: GroupRows, outcome: ShardOutcome) -> None:
        """Queue the delete of a handled group."""
        self._pending.append((group, outcome))
        self.undeleted.added()
        self._kick()

    async def pace(self) -> None:
        """Wait while the worker's rounds are too far ahead of their deletes."""
        if not self.lost and self._error is None:
            await self.undeleted.room()

    def hold(self, shard: ShardRef, held_for: HeldFor, *, if_free: bool = False) -> None:
        """Hold ``shard`` for its workflow; with ``if_free`` only if no workflow holds it yet."""
        self._holds.append((shard, held_for, if_free))

    def release(self, shard: ShardRef) -> None:
        self._releases.append(shard)

    def unlock(self, shard: ShardRef) -> None:
        """Release ``shard``'s lock once everything queued for it is written."""
        if (
            shard in self.locked
            and shard not in self._unlocks
            and shard not in self._unlocking
            and shard not in self.stuck
        ):
            self._unlocks[shard] = None
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
        while self._pending or self._unlocks or self._holds or self._releases:
            pending, self._pending = self._pending, []
            holds, self._holds = self._holds, []
            releases, self._releases = self._releases, []
            unlocks, self._unlocks = self._unlocks, {}
            self._unlocking.update(unlocks)
            try:
                if self.lost or self._error is not None:
                    self.unwritten += pending
                    continue  # fenced: nothing more is written in this round
                async with self._busy:
                    await self._statement(
                        functools.partial(self._write, pending, holds, releases, unlocks)
                    )
            except Exception as exc:  # no one shard's reason: the round writes nothing more
                self._error = exc
                self.unwritten += pending
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
                self.undeleted.done(len(pending))
                self._unlocking.difference_update(unlocks)

    async def _write(
        self,
        pending: list[tuple[GroupRows, ShardOutcome]],
        holds: list[tuple[ShardRef, HeldFor, bool]],
        releases: list[ShardRef],
        unlocks: dict[ShardRef, None],
        _conn: AsyncConnection | None = None,
    ) -> None:
        if pending:
            await self._delete_handled(pending)
        await self._write_holds(holds)
        for shard in releases:
            await ownership.release(self.conn, self.table, shard)
        if unlocks:
            await self._unlock_each(list(unlocks))

    async def apart(
        self, work: Callable[[list[ShardRef]], Awaitable[None]], shards: list[ShardRef]
    ) -> dict[ShardRef, Exception]:
        """``work(shards)``, else shard by shard; returns the shards whose own ``work`` failed.
        An error that means the connection is gone is raised."""
        try:
            await work(shards)
            return {}
        except Exception as exc:
            if self.gone(exc):
                raise
        failed: dict[ShardRef, Exception] = {}
        for shard in shards:
            try:
                await work([shard])
            except Exception as exc:
                if self.gone(exc):
                    raise
                failed[shard] = exc
        return failed

    async def _delete_handled(self, pending: list[tuple[GroupRows, ShardOutcome]]) -> None:
        groups: dict[ShardRef, list[GroupRows]] = {}
        for group, outcome in pending:
            groups.setdefault(outcome.shard, []).append(group)
        deleted: list[int] = []

        async def delete(shards: list[ShardRef]) -> None:
            deleted.extend(
                await self._delete([i for s in shards for g in groups[s] for i in g.ids])
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
        failed = await self.apart(self._unlock, shards)
        for shard, exc in failed.items():
            self.fault(shard, None, "its lock cannot be released", exc)
            self.stuck.add(shard)
            self._faulted.append(shard)
        if failed:
            await self._write_holds([])
        for shard in shards:
            if shard not in self.stuck:
                self.locked.pop(shard, None)

    async def _delete(self, ids: list[int]) -> list[int]:
        assert self._socket is not None  # attached by DrainEngine.locked
        return await driver_writes(self.table, self.conn.dialect).delete_handled(self._socket, ids)

    async def _unlock(self, shards: list[ShardRef]) -> None:
        assert self._socket is not None
        await driver_writes(self.table, self.conn.dialect).unlock_shards(self._socket, shards)


# Queues, under a shard's lock, what a round writes about its outcome (a hold, a release).
Settle = Callable[[LockedShards, ShardOutcome], None]


class DrainEngine:
    """Rounds over the shards of ``app``'s tables, shared by every drain of one worker.

    It knows which shards have a handler call running in this process: a round whose lock was
    lost may still be running one (a thread cannot be stopped), and no other round of this
    worker calls that shard until it returns."""

    def __init__(
        self,
        engine: AsyncEngine,
        app: OutboxApp,
        *,
        calls: HandlerCalls,
        max_round_bytes: int = PAYLOAD_BUDGET_BYTES,
        max_undeleted_groups: int | None = None,
    ) -> None:
        self.engine = engine
        self.app = app
        self.calls = calls
        # Payload bytes one round reads, and all the rounds of this worker hold, at most.
        self.max_round_bytes = max_round_bytes
        self._payloads = PayloadBudget(max_round_bytes)
        self._running: dict[str, int] = {}
        # By default the work in flight bounds the repeats: as many as the calls under way.
        self._undeleted = Undeleted(max_undeleted_groups or calls.at_once)

    @property
    def max_undeleted_groups(self) -> int:
        """Groups the drains may have handled and not deleted before they take no further one."""
        return self._undeleted.limit

    def calls_in_flight(self) -> int:
        """Handler calls running in this worker's drains now."""
        return sum(self._running.values())

    # -- locking -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def locked(
        self,
        table: Table,
        shards: Sequence[ShardRef],
        *,
        wait_seconds: float = 0.0,
        recover: bool = True,
    ) -> AsyncIterator[LockedShards]:
        """Lock the free ones of ``shards`` (waiting up to ``wait_seconds`` for each taken one)
        on a connection of their own; everything is written and unlocked when the block ends,
        and the connection is dropped if it may still hold a lock. With ``recover``, what a
        lost connection left undeleted is deleted from a new one that gets those locks."""
        conn = await self.engine.connect()
        batch: LockedShards | None = None
        try:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            busy = {key for key, count in self._running.items() if count}
            candidates = [shard for shard in shards if lock_key(shard) not in busy]
            taken = await self._take(conn, candidates, wait_seconds)
            batch = LockedShards(
                conn,
                table,
                [s for s, t in zip(candidates, taken, strict=True) if t],
                self._undeleted,
                self.calls,
            )
            await batch.attach()
            try:
                yield batch
            except BaseException:
                # Failed or cancelled (a timeout, a skip, a shutdown): what was handled is
                # still deleted, so that it does not run again.
                with contextlib.suppress(Exception):
                    await batch.flush()
                raise
            for shard in list(batch.locked):
                batch.unlock(shard)
            await batch.flush()
        finally:
            if batch is not None:
                self._payloads.give(batch.payload_bytes)
                batch.payload_bytes = 0
            await self._close(conn, batch)
            if recover and batch is not None and batch.unwritten:
                await self._delete_unwritten(batch)

    async def _delete_unwritten(self, lost: LockedShards) -> None:
        """Delete what a round that lost its connection had handled, in the shards whose locks
        a new connection gets; the others' groups run again."""
        groups = lost.unwritten
        shards = list(dict.fromkeys(outcome.shard for _, outcome in groups))
        mine = []
        try:
            async with self.locked(lost.table, shards, recover=False) as batch:
                mine = [
                    (group, outcome) for group, outcome in groups if outcome.shard in batch.locked
                ]
                for group, outcome in mine:
                    batch.deleted(group, outcome)
        except Exception as exc:
            log.warning(
                "%s group(s) handled by a round of %s that lost its connection cannot be "
                "deleted (%s): they run again",
                len(groups),
                lost.table.name,
                type(exc).__name__,
            )
            return
        if not batch.lost:
            log.info(
                "deleted %s of the %s group(s) a round of %s handled before it lost its "
                "connection (the others' shards were taken meanwhile: they run again)",
                len(mine),
                len(groups),
                lost.table.name,
            )

    async def _take(
        self, conn: AsyncConnection, shards: Sequence[ShardRef], wait_seconds: float
    ) -> list[bool]:
        taken = await try_lock_shards(conn, shards)
        if wait_seconds <= 0 or all(taken):
            return taken
        # Wait for the others in turn: a round that holds one finishes within its time budget
        # (or its handler's timeout), and lock_timeout bounds the wait.
        for index, shard in enumerate(shards):
            if not taken[index]:
                taken[index] = await lock_shard_waiting(conn, shard, wait_seconds)
        return taken

    @staticmethod
    async def _close(conn: AsyncConnection, batch: LockedShards | None) -> None:
        try:
            if batch is not None and batch.locked and not batch.lost and not batch.stuck:
                await unlock_shards(conn, list(batch.locked))
                batch.locked.clear()
        except BaseException:
            # A connection that may still hold a lock must never go back to the pool.
            await conn.invalidate()
            raise
        finally:
            if batch is not None and (batch.lost or batch.locked):
                await conn.invalidate()
            await conn.close()

    # -- reading -----------------------------------------------------------------------------

    async def read_heads(
        self,
        batch: LockedShards,
        *,
        max_groups: int,
        skip_held: bool,
        skip_paused: bool = False,
    ) -> list[ShardHead]:
        """The head groups of every locked shard (at most ``max_groups`` each, within the
        round's payload budget) and their newest rows. A shard whose own read fails gets a head
        that carries why."""
        read = functools.partial(
            read_shard_heads,
            batch.execute,
            batch.table,
            max_groups=max_groups,
            skip_held=skip_held,
            skip_paused=skip_paused,
            with_trace_context=BatchObserver.tracing(),
            max_bytes=self.max_round_bytes,
            max_payload_bytes=self.calls.max_payload_bytes,
            reserve=functools.partial(self._reserve, batch),
        )
        heads: list[ShardHead] = []

        async def read_into(shards: list[ShardRef]) -> None:
            heads.extend(await read(shards))

        for shard, exc in (await batch.apart(read_into, list(batch.locked))).items():
            heads.append(await self._unreadable(batch, shard, exc))
        return heads

    async def _reserve(self, batch: LockedShards, size: int) -> None:
        """Take ``size`` payload bytes for ``batch``'s round, waiting for room the first time;
        then count what it read instead."""
        if batch.payload_bytes:
            self._payloads.add(size)
        else:
            await self._payloads.take(size)
        batch.payload_bytes += size

    async def _unreadable(
        self, batch: LockedShards, shard: ShardRef, exc: BaseException
    ) -> ShardHead:
        """The head of a shard whose rows cannot be read: its first group, failing with why."""
        failure = self.calls.fault(shard, "its rows cannot be read", exc)
        head = ShardHead(shard, [], 0, fault=failure)
        try:
            first = await batch.execute(lambda conn: read_first_row(conn, batch.table, shard))
        except Exception as error:
            if batch.gone(error):
                raise
            return head
        if first is not None:
            head.groups = [GroupRows(first.category, first.object_identifier, [first.id])]
            head.highest_id = first.id
        return head

    # -- running -----------------------------------------------------------------------------

    async def run(
        self,
        batch: LockedShards,
        heads: Sequence[ShardHead],
        *,
        deadline: float,
        attempt: int = 1,
        unlock_each: bool = True,
        settle: Settle | None = None,
        partition: str | None = None,
    ) -> list[ShardOutcome]:
        """Handle every shard's head groups, the shards concurrently, each in order; a shard
        stops at its first failure, or at the deadline (after at least one group). With
        ``unlock_each``, each shard is unlocked once done, after ``settle`` queued what else
        must be written under its lock."""
        outcomes = [ShardOutcome(head.shard, highest_seen_id=head.highest_id) for head in heads]
        batch.outcomes.update((outcome.shard, outcome) for outcome in outcomes)
        busy = RoundShards(len(heads))

        async def run_shard(head: ShardHead, outcome: ShardOutcome) -> None:
            key = lock_key(head.shard)
            self._running[key] = self._running.get(key, 0) + 1
            try:
                await self._handle(batch, head, outcome, deadline, attempt, partition, busy)
            finally:
                busy.done()
                self._running[key] -= 1
                if not self._running[key]:
                    del self._running[key]
                outcome.lock_lost = batch.lost
            if settle is not None:
                settle(batch, outcome)
            if unlock_each and head.shard in batch.locked:
                batch.unlock(head.shard)

        # Every shard's calls end before the round does, also when it is cancelled: a plain-def
        # call cannot be stopped, and its shard stays locked until it returns.
        ended = await asyncio.gather(
            *(run_shard(head, outcome) for head, outcome in zip(heads, outcomes, strict=True)),
            return_exceptions=True,
        )
        for result in ended:
            if isinstance(result, BaseException):
                raise result
        return outcomes

    async def _handle(
        self,
        batch: LockedShards,
        head: ShardHead,
        outcome: ShardOutcome,
        deadline: float,
        attempt: int,
        partition: str | None,
        busy: RoundShards,
    ) -> None:
        """Run one shard's head groups; whatever fails in it fails this shard alone."""
        shard = head.shard
        if head.fault is not None:
            outcome.failure = head.fault
            outcome.failed = self.calls.head(head.groups[0]) if head.groups else None
            return
        observer: BatchObserver | None = None

        def handled(call: Call) -> None:
            outcome.groups_handled += 1
            batch.deleted(call.group, outcome)

        step = "its head groups cannot be prepared for their handlers"
        try:
            calls: list[Call] = []
            for group in head.groups:
                row = head.rows.get(group.last_id)
                if row is None:  # deleted behind our back: read the head again
                    break
                calls.append(self.calls.prepare(shard, group, row))
            step = "its calls cannot be observed (tracing, metrics)"
            observer = await self._observer(batch, shard, calls, head.rows, partition)
            head.rows = {}  # the calls hold what they need: the round need not keep the rows
            step = "its handlers cannot be called"
            finished = await self.calls.run(
                shard,
                calls,
                handled,
                observer,
                deadline=deadline,
                attempt=attempt,
                may_continue=functools.partial(batch.may_continue, outcome),
                pace=Pace(
                    batch.pace,
                    batch.undeleted.ahead,
                    batch.undeleted.unreported,
                    batch.undeleted.limit,
                ),
                round_=busy,
            )
            outcome.more = head.more or len(calls) < len(head.groups) or not finished
            if not outcome.more:
                outcome.deferred_seconds = head.deferred_seconds
                outcome.deferred_until = head.deferred_until
        except HandlerFailed as failed:
            if outcome.failure is None:
                outcome.failed = self.calls.head(failed.group)
                outcome.failure = failed.failure
        except Exception as exc:  # one shard's trouble, whatever it is, stays with it
            unhandled = head.groups[outcome.groups_handled :]
            batch.fault(shard, unhandled[0] if unhandled else None, step, exc)
        finally:
            if observer is not None:
                try:
                    observer.finish()
                except Exception as exc:
                    batch.fault(shard, None, "its calls cannot be recorded (metrics)", exc)

    async def _observer(
        self,
        batch: LockedShards,
        shard: ShardRef,
        calls: list[Call],
        rows: dict[int, Row[Any]],
        partition: str | None,
    ) -> BatchObserver:
        """The shard's observer, with the producer trace context of every row (tracing on)."""
        observer = BatchObserver(shard, partition=partition)
        if observer.traced and calls:
            contexts = {
                row_id: carrier
                for row_id, row in rows.items()
                if (carrier := getattr(row, TRACE_CONTEXT_COLUMN, None)) is not None
            }
            covered = [row_id for call in calls for row_id in call.group.ids[:-1]]
            if covered:
                try:
                    contexts.update(
                        await batch.execute(
                            lambda conn: read_trace_contexts(conn, batch.table, covered)
                        )
                    )
                except (DBAPIError, psycopg.Error):
                    pass  # the calls matter more than their links; the round notices the loss
            observer.contexts = contexts
        return observer


# Runs one statement on the connection that holds the shards' locks: ``execute(work)`` awaits
# ``work(conn)`` (see LockedShards.execute).
Execute = Callable[[Callable[[AsyncConnection], Awaitable[Any]]], Awaitable[Any]]


async def read_shard_heads(
    execute: Execute,
    table: Table,
    shards: Sequence[ShardRef],
    *,
    max_groups: int,
    skip_held: bool,
    max_payload_bytes: int,
    skip_paused: bool = False,
    with_trace_context: bool = False,
    deferred_as_due: bool = False,
    max_bytes: int | None = None,
    reserve: Callable[[int], Awaitable[None]] | None = None,
) -> list[ShardHead]:
    """The head groups of each of ``shards`` (at most ``max_groups`` each) and their newest
    rows, in a few statements for all of them: the windows, the groups' tails past a full
    window, then the rows. ``deferred_as_due`` (``drain_outbox(run_deferred=True)``) counts
    rows not yet due as due in the windows; ``max_bytes`` keeps each shard's prefix of groups
    whose newest rows fit that many payload bytes in all (their JSON text). A payload over
    ``max_payload_bytes`` is never read (its row comes without it, and its call fails), and
    its shard's later groups wait for a later round. ``reserve(bytes)`` is awaited before the
    rows are read, with what they may hold (given back, when negative, once they are read)."""
    window = max(2 * max_groups, 16)
    windows = await execute(
        lambda conn: read_windows(
            conn,
            table,
            shards,
            window=window,
            skip_held=skip_held,
            skip_paused=skip_paused,
        )
    )
    heads: list[ShardHead] = []
    tails: list[tuple[ShardHead, GroupRows, GroupTail]] = []
    for found in windows:
        if deferred_as_due:
            found.rows = [dataclasses.replace(row, deferred_seconds=None) for row in found.rows]
        head = head_of(shards[found.index], found, window, max_groups)
        heads.append(head)
        if head.open_ended:  # the head groups may go on past the window
            after = found.rows[-1].id
            for group in head.groups:
                tail = GroupTail(head.shard, group.category, group.object_identifier, after)
                tails.append((head, group, tail))
    if tails:
        found_tails = await execute(
            lambda conn: read_group_tails(conn, table, [t for _, _, t in tails])
        )
        for (head, group, _), (ids, deferred) in zip(tails, found_tails, strict=True):
            group.ids.extend(ids)
            if deferred is not None:
                head.more = True  # the rows up to the barrier come first
    newest = [group.last_id for head in heads for group in head.groups]
    # Without sizes (a lone group), what its payload may take at most, until it is read.
    expected = max_payload_bytes * len(newest)
    if max_bytes is not None and len(newest) > 1:
        sizes = await execute(lambda conn: read_payload_sizes(conn, table, newest))
        if _keep_within(heads, sizes, max_bytes, max_payload_bytes):
            newest = [group.last_id for head in heads for group in head.groups]
        expected = sum(size for i in newest if (size := sizes.get(i, 0)) <= max_payload_bytes)
    if reserve is not None:
        await reserve(expected)
    rows = await execute(
        lambda conn: read_rows(
            conn,
            table,
            newest,
            with_trace_context=with_trace_context,
            max_payload_bytes=max_payload_bytes,
        )
    )
    if reserve is not None:
        await reserve(sum(len(row.payload or "") for row in rows.values()) - expected)
    for head in heads:
        head.rows = {g.last_id: rows[g.last_id] for g in head.groups if g.last_id in rows}
    return heads


def _keep_within(
    heads: Sequence[ShardHead], sizes: dict[int, int], budget: int, limit: int
) -> bool:
    """Keep, of each shard's groups, the prefix whose newest rows' payloads (``sizes``, by row
    id) fit ``budget`` bytes in all, every shard's first group before any shard's second; at
    least one group. A payload over ``limit`` is not read (it costs nothing) and ends its
    shard's prefix: its call fails. True if any group was left for a later round."""
    kept = [0] * len(heads)
    used = taken = 0
    open_ = [index for index, head in enumerate(heads) if head.groups]
    level = 0
    while open_:
        still = []
        for index in open_:
            groups = heads[index].groups
            size = sizes.get(groups[level].last_id, 0)
            unread = size > limit
            if unread:
                size = 0
            elif taken and used + size > budget:
                continue  # this shard stops here
            used += size
            taken += 1
            kept[index] += 1
            if level + 1 < len(groups) and not unread:
                still.append(index)
        open_ = still
        level += 1
    cut = False
    for head, count in zip(heads, kept, strict=True):
        if count < len(head.groups):
            del head.groups[count:]
            head.more = True  # the rest of its groups come first, in the next round
            head.deferred_seconds = head.deferred_until = None
            cut = True
    return cut


def head_of(shard: ShardRef, window: ShardWindow, size: int, max_groups: int) -> ShardHead:
    """Coalescing groups of the window, ordered by their first id, up to the first row not yet
    due (the barrier: order within a shard waits for it). A full window (``size`` rows)
    without a barrier is open-ended: the head groups may go on past it."""
    groups: dict[tuple[int, int], GroupRows] = {}
    head = ShardHead(shard, [], window.highest_id)
    barrier: WindowRow | None = None
    for row in window.rows:
        if row.deferred_seconds is not None:
            barrier = row
            break
        key = (row.category, row.object_identifier)
        group = groups.get(key)
        if group is None:
            if len(groups) == max_groups:
                head.more = True
                continue  # later rows of the groups already taken still coalesce into them
            group = groups[key] = GroupRows(row.category, row.object_identifier, [])
        group.ids.append(row.id)
    if barrier is None and len(window.rows) == size:
        head.open_ended = head.more = True  # rows go on past the window
    if barrier is not None and not head.more:
        # Once these groups are handled, the shard waits for this row.
        head.deferred_seconds = barrier.deferred_seconds
        head.deferred_until = barrier.scheduled_for
    head.groups = list(groups.values())
    return head
