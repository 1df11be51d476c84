"""One drain round over many shards at once: lock them, read their heads, run their handlers,
delete what was handled, unlock them.

Every write of a round goes through the one connection that holds its shard locks
(:mod:`~outbox_bridge.runtime.fence`): if it dies, the locks are gone and so is every later write
of the round, and its handled rows run again. The rounds of a worker together are bounded by the
groups handled and not deleted (:mod:`~outbox_bridge.runtime.round_writes`) and by the payload
bytes of their groups' newest rows (:mod:`~outbox_bridge.runtime.payload_budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg
from sqlalchemy import Row, Table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox_bridge.db.locks import lock_shard_waiting, try_lock_shards, unlock_shards
from outbox_bridge.db.reads import GroupRows, read_trace_contexts
from outbox_bridge.db.scans import read_first_row
from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN
from outbox_bridge.observability.observe import RoundObserver
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.calls import Call, HandlerCalls, HandlerFailed
from outbox_bridge.runtime.heads import ShardHead, read_shard_heads
from outbox_bridge.runtime.payload_budget import PAYLOAD_BUDGET_BYTES, PayloadBudget
from outbox_bridge.runtime.round_writes import Round, ShardOutcome, Undeleted
from outbox_bridge.runtime.waiters import RoundShards
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger(__name__)


# Queues, under a shard's lock, what a round writes about its outcome (a hold, a release).
Settle = Callable[[Round, ShardOutcome], None]


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
        self._payloads = PayloadBudget(max_round_bytes)
        self._running: dict[ShardRef, int] = {}
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
    ) -> AsyncIterator[Round]:
        """Lock the free ones of ``shards`` (waiting up to ``wait_seconds`` for each taken one)
        on a connection of their own; everything is written and unlocked when the block ends,
        and the connection is dropped if it may still hold a lock. With ``recover``, what a
        lost connection left undeleted is deleted from a new one that gets those locks."""
        conn = await self.engine.connect()
        round_: Round | None = None
        try:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            candidates = [shard for shard in shards if not self._running.get(shard)]
            taken = await self._take(conn, candidates, wait_seconds)
            round_ = Round(
                conn,
                table,
                [s for s, t in zip(candidates, taken, strict=True) if t],
                self._undeleted,
                self.calls,
            )
            await round_.attach()
            try:
                yield round_
            except BaseException:
                # Failed or cancelled (a timeout, a skip, a shutdown): what was handled is
                # still deleted, so that it does not run again.
                with contextlib.suppress(Exception):
                    await round_.flush()
                raise
            for shard in list(round_.locked):
                round_.unlock(shard)
            await round_.flush()
        finally:
            if round_ is not None:
                self._payloads.give(round_.payload_bytes)
                round_.payload_bytes = 0
            await self._close(conn, round_)
            if recover and round_ is not None and round_.unwritten:
                await self._delete_unwritten(round_)

    async def _delete_unwritten(self, lost: Round) -> None:
        """Delete what a round that lost its connection had handled, in the shards whose locks
        a new connection gets; the others' groups run again."""
        groups = lost.unwritten
        shards = list(dict.fromkeys(outcome.shard for _, outcome in groups))
        mine = []
        try:
            async with self.locked(lost.table, shards, recover=False) as round_:
                mine = [
                    (group, outcome) for group, outcome in groups if outcome.shard in round_.locked
                ]
                for group, outcome in mine:
                    round_.deleted(group, outcome)
        except Exception as exc:
            log.warning(
                "%s group(s) handled by a round of %s that lost its connection cannot be "
                "deleted (%s): they run again",
                len(groups),
                lost.table.name,
                type(exc).__name__,
            )
            return
        if not round_.lost:
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
    async def _close(conn: AsyncConnection, round_: Round | None) -> None:
        try:
            if round_ is not None and round_.locked and not round_.lost and not round_.stuck:
                await unlock_shards(conn, list(round_.locked))
                round_.locked.clear()
        except BaseException:
            # A connection that may still hold a lock must never go back to the pool.
            await conn.invalidate()
            raise
        finally:
            if round_ is not None and (round_.lost or round_.locked):
                await conn.invalidate()
            await conn.close()

    # -- reading -----------------------------------------------------------------------------

    async def read_heads(
        self,
        round_: Round,
        *,
        max_groups: int,
        skip_held: bool,
        skip_paused: bool = False,
        seconds: float | None = None,
    ) -> list[ShardHead]:
        """The head groups of every locked shard (at most ``max_groups`` each, within the
        round's payload budget, and of a rate-limited category no more than the round's
        ``seconds`` may get tokens for) and their newest rows. A shard whose own read fails
        gets a head that carries why."""
        rates = self.calls.rates
        read = functools.partial(
            read_shard_heads,
            round_.execute,
            round_.table,
            max_groups=max_groups,
            skip_held=skip_held,
            skip_paused=skip_paused,
            with_trace_context=RoundObserver.tracing(),
            max_bytes=self._payloads.limit,
            max_payload_bytes=self.calls.max_payload_bytes,
            reserve=functools.partial(round_.reserve, self._payloads),
            rated=None
            if rates is None or seconds is None
            else rates.round_groups(round_.table.name, seconds),
        )
        heads: list[ShardHead] = []

        async def read_into(shards: list[ShardRef]) -> None:
            heads.extend(await read(shards))

        for shard, exc in (await round_.apart(read_into, list(round_.locked))).items():
            heads.append(await _unreadable(round_, self.calls, shard, exc))
        return heads

    # -- running -----------------------------------------------------------------------------

    async def run(
        self,
        round_: Round,
        heads: Sequence[ShardHead],
        *,
        deadline: float,
        attempt: int | Callable[[ShardRef], int] = 1,
        unlock_each: bool = True,
        settle: Settle | None = None,
        partition: str | None = None,
        went_idle: Callable[[], None] | None = None,
    ) -> list[ShardOutcome]:
        """Handle every shard's head groups, the shards concurrently, each in order; a shard
        stops at its first failure, or at the deadline (after at least one group). ``attempt``
        numbers the calls (of each shard, if a function). With ``unlock_each``, each shard is
        unlocked once done, after ``settle`` queued what else must be written under its lock.
        ``went_idle`` is told once no shard of the round is busy (the rest wait for a slot or a
        token)."""
        outcomes = [ShardOutcome(head.shard, highest_seen_id=head.highest_id) for head in heads]
        round_.outcomes.update((outcome.shard, outcome) for outcome in outcomes)
        busy = RoundShards(len(heads), went_idle)

        async def run_shard(head: ShardHead, outcome: ShardOutcome) -> None:
            shard = head.shard
            self._running[shard] = self._running.get(shard, 0) + 1
            try:
                number = attempt if isinstance(attempt, int) else attempt(shard)
                await self._handle(round_, head, outcome, deadline, number, partition, busy)
            finally:
                busy.done()
                self._running[shard] -= 1
                if not self._running[shard]:
                    del self._running[shard]
                outcome.lock_lost = round_.lost
            if settle is not None:
                settle(round_, outcome)
            if unlock_each and head.shard in round_.locked:
                round_.unlock(head.shard)

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
        round_: Round,
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
        observer: RoundObserver | None = None

        def handled(call: Call) -> None:
            outcome.groups_handled += 1
            round_.deleted(call.group, outcome)

        step = "its head groups cannot be prepared for their handlers"
        try:
            calls: list[Call] = []
            for group in head.groups:
                row = head.rows.get(group.last_id)
                if row is None:  # deleted behind our back: read the head again
                    break
                calls.append(self.calls.prepare(shard, group, row))
            step = "its calls cannot be observed (tracing, metrics)"
            observer = await _observer(round_, shard, calls, head.rows, partition)
            head.rows = {}  # the calls hold what they need: the round need not keep the rows
            step = "its handlers cannot be called"
            finished = await self.calls.run(
                shard,
                calls,
                handled,
                observer,
                deadline=deadline,
                attempt=attempt,
                may_continue=functools.partial(round_.may_continue, outcome),
                pace=round_,
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
                outcome.handler_raised = True
        except Exception as exc:  # one shard's trouble, whatever it is, stays with it
            unhandled = head.groups[outcome.groups_handled :]
            round_.fault(shard, unhandled[0] if unhandled else None, step, exc)
        finally:
            if observer is not None:
                try:
                    observer.finish()
                except Exception as exc:
                    round_.fault(shard, None, "its calls cannot be recorded (metrics)", exc)


async def _unreadable(
    round_: Round, calls: HandlerCalls, shard: ShardRef, exc: BaseException
) -> ShardHead:
    """The head of a shard whose rows cannot be read: its first group, failing with why."""
    failure = calls.fault(shard, "its rows cannot be read", exc)
    head = ShardHead(shard, [], 0, fault=failure)
    try:
        first = await round_.execute(lambda conn: read_first_row(conn, round_.table, shard))
    except Exception as error:
        if round_.gone(error):
            raise
        return head
    if first is not None:
        head.groups = [GroupRows(first.category, first.object_identifier, [first.id])]
        head.highest_id = first.id
    return head


async def _observer(
    round_: Round,
    shard: ShardRef,
    calls: list[Call],
    rows: dict[int, Row[Any]],
    partition: str | None,
) -> RoundObserver:
    """The shard's observer, with the producer trace context of every row (tracing on)."""
    observer = RoundObserver(shard, partition=partition)
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
                    await round_.execute(
                        lambda conn: read_trace_contexts(conn, round_.table, covered)
                    )
                )
            except (DBAPIError, psycopg.Error):
                pass  # the calls matter more than their links; the round notices the loss
        observer.contexts = contexts
    return observer
