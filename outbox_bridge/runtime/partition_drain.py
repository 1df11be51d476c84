"""A partition's drain: the healthy path, many shards at a time, in a lingering activity of its
``OutboxPartition`` workflow. It learns of shards with rows from this worker's notifications, a
scan for ids above the newest seen (every poll interval) and a scan of every shard (every rescan
interval, and at start), and drains them in concurrent rounds. A shard that needs attention is
held for its ``OutboxShard`` workflow under its lock, then handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from outbox_bridge.db import ownership
from outbox_bridge.db.disconnects import connection_lost
from outbox_bridge.db.scans import ShardRange, read_row_ages, read_shard_ranges
from outbox_bridge.db.timestamps import iso_utc
from outbox_bridge.runtime.hub import (
    PartitionInbox,
    ShardHub,
    shard_of,
    wait_any,
)
from outbox_bridge.runtime.local_retries import LocalRetries
from outbox_bridge.runtime.round_writes import Round, ShardOutcome
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.runtime.shard_queue import ShardQueue
from outbox_bridge.runtime.shards import ShardStarter, static_skip
from outbox_bridge.runtime.share import PartitionShare
from outbox_bridge.runtime.unhandled import UnhandledShards
from outbox_bridge.workflows.models import (
    SHARDS_COUNTED,
    HandoverInput,
    HeldFor,
    PartitionDrainInput,
    PartitionOptions,
    PartitionRound,
    ShardBacklog,
    ShardOptions,
    ShardRef,
)

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
BACKLOG_SHOWN = 3  # deepest and oldest shards in a partition's details
# Shards a partition's drain keeps queued at most (a scan reads no more); the shards left out are
# found by a scan of every shard once the queue runs low. Each costs about 150 bytes.
MAX_QUEUED_SHARDS = 20_000
MAX_GROUPS_PER_SHARD = 1000  # of one shard in one round, however few shards the round has


@dataclass
class _ScanTimes:
    """When a partition's drain last scanned for new rows, and next scans every shard."""

    last_poll: float
    next_rescan: float
    empty_polls: int = 0  # scans in a row that found no new row while the bridge listens

    def next_poll(self, options: PartitionOptions, listening: bool) -> float:
        """When to scan for new rows next: a poll interval after the last scan; while the bridge
        of this worker listens, doubled after each scan that found nothing, up to the interval
        of full scans (notifications bring the new rows; the scans only catch what they
        missed)."""
        interval = options.poll_interval_seconds
        if listening:
            wait = interval * (1 << min(self.empty_polls, 16))
            interval = min(wait, options.rescan_interval_seconds)
        return self.last_poll + interval


def groups_per_shard(options: PartitionOptions, shards: int) -> int:
    """The groups a round may take from each of its ``shards``: ``max_groups``, or more when it
    has fewer than ``max_shards`` shards (a hot shard drains in long rounds), up to
    ``MAX_GROUPS_PER_SHARD``."""
    share = options.max_shards * options.max_groups // max(1, shards)
    return max(options.max_groups, min(MAX_GROUPS_PER_SHARD, share))


def carried_round(details: Sequence[object]) -> PartitionRound | None:
    """The counts of the last heartbeat of an earlier attempt of a drain (None if it sent
    none): its worker died or stopped while it ran."""
    last = details[-1] if details else None
    if not isinstance(last, dict):
        return None
    carried = PartitionRound()
    for name in ("rows_handled", "groups_handled", "handed_over"):
        if isinstance(value := last.get(name), int):
            setattr(carried, name, value)
    return carried


def elsewhere(why: str) -> ApplicationError:
    """This worker leaves the drain to another: a benign failure (logged at debug level), which
    the server retries on any worker of the task queue."""
    return ApplicationError(
        why, type="PartitionElsewhere", category=ApplicationErrorCategory.BENIGN
    )


class PartitionDrain:
    """One run of a partition's drain activity (``round_seconds`` long)."""

    def __init__(
        self,
        engine: DrainEngine,
        starter: ShardStarter,
        hub: ShardHub,
        request: PartitionDrainInput,
        *,
        heartbeat: Callable[[PartitionRound], None] = lambda _: None,
        max_queued: int = MAX_QUEUED_SHARDS,
        share: PartitionShare | None = None,
        attempt: int = 1,
        carried: PartitionRound | None = None,
        unhandled: UnhandledShards | None = None,
        retries: LocalRetries | None = None,
    ) -> None:
        self._engine = engine
        self._starter = starter
        self._hub = hub
        self._ref = request.partition
        # A round locks no more shards than the worker runs calls at once (plain def: threads).
        at_most = min(request.options.max_shards, engine.calls.at_once)
        self._options = dataclasses.replace(request.options, max_shards=at_most)
        self._table: Table = engine.app.table(self._ref.table)
        self._heartbeat = heartbeat
        # Failing shards tried again here before their handover (none by default).
        self._retries = retries or LocalRetries(ShardOptions(), 0.0)
        self._queue = ShardQueue(self._ref.workflow_id, max_queued, unhandled, self._retries)
        self._watermark = 0
        # What the attempt before, on a worker that left, handled: this run counts on from it.
        self._stats = carried if carried is not None else PartitionRound()
        self._drained: set[ShardRef] = set()  # those this run drained, up to SHARDS_COUNTED
        # The partition's skip list and this worker's (a new list applies at once).
        self._skip = frozenset(request.options.skip_shards) | starter.skip_shards
        self._round_done = asyncio.Event()
        self._idle_rounds = 0  # rounds whose shards only wait for a slot or a token
        self._share = share  # None: this drain runs wherever the task queue gives it
        self._attempt = attempt
        self._ran_before = carried is not None  # an earlier attempt ran: its worker left
        self._unhandled = unhandled  # the cap on shards held for rows the app cannot handle

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> PartitionRound:
        if self._hub.closed:  # not a return: the next round would start here again at once
            raise elsewhere("this worker is stopping: another worker takes the partition")
        await self._check_share()
        options = self._options
        began = time.monotonic()
        end = began + options.round_seconds
        inbox = self._hub.open_partition(self._ref.table, self._ref.partition, self._ref.partitions)
        rounds: set[asyncio.Task[None]] = set()
        try:
            await self._scan(full=True)
            scans = _ScanTimes(time.monotonic(), time.monotonic() + options.rescan_interval_seconds)
            next_beat = time.monotonic() + HEARTBEAT_SECONDS
            while not self._hub.closed and time.monotonic() < end:
                rescan = self._take_news(inbox)
                now = time.monotonic()
                next_poll = await self._scan_if_due(scans, rescan, now)
                self._start_rounds(rounds)
                if now >= next_beat:
                    self._heartbeat(self._report(began))
                    next_beat = now + HEARTBEAT_SECONDS
                    if await self._give_back(inbox):
                        end = now  # the rounds in flight finish; no new one starts
                wake = min(next_poll, scans.next_rescan, next_beat, end, self._retries.next_due())
                if self._unhandled is not None:
                    wake = min(wake, await self._unhandled.recount(self._table))
                await self._wait(inbox, wake - time.monotonic())
            # Rounds end within their time budget (or their handlers' timeout): finish them.
            while rounds:
                await asyncio.wait(rounds, timeout=HEARTBEAT_SECONDS)
                self._heartbeat(self._report(began))
        finally:
            self._hub.close_partition(inbox)
            for task in rounds:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*rounds, return_exceptions=True)
        report = self._report(began)
        if self._hub.closed:
            # Stopping: a failure, not a result, so that the server retries this drain at once
            # on another worker, which takes it without a refusal (it ran before) and carries
            # on these counts from the heartbeat details.
            self._heartbeat(report)
            raise elsewhere("this worker is stopping: another worker takes the partition")
        return report

    async def _check_share(self) -> None:
        """Raise if this worker runs more than its share of the partition drains."""
        if self._share is None:
            return
        running = len(self._hub.drains())
        refusal = await self._share.refusal(
            self._ref, running, self._attempt, ran_before=self._ran_before
        )
        if refusal is not None:
            raise elsewhere(refusal)

    async def _scan_if_due(self, scans: _ScanTimes, rescan: bool, now: float) -> float:
        """Scan every shard, or for new rows, when it is time (or ``rescan`` asks for a full
        scan); returns when the next scan for new rows is due."""
        next_poll = scans.next_poll(self._options, self._hub.listening)
        if self._queue.overflowed and self._queue.runs_low():
            scans.next_rescan = min(scans.next_rescan, next_poll)  # the left-out shards are next
        if now >= scans.next_rescan or rescan:
            await self._scan(full=True)
            scans.next_rescan = now + self._options.rescan_interval_seconds
            scans.last_poll = now
        elif now >= next_poll:
            found = await self._scan(full=False)
            empty = not found and self._hub.listening
            scans.last_poll, scans.empty_polls = now, scans.empty_polls + 1 if empty else 0
        return scans.next_poll(self._options, self._hub.listening)

    def _start_rounds(self, rounds: set[asyncio.Task[None]]) -> None:
        """Start rounds of the queued shards, up to ``max_rounds`` at once, not counting the
        idle ones (their shards wait for a slot or a token, until the round's deadline or a
        grace after it went idle), and half as many again with them: each holds a connection,
        and a worker running every partition's drain stays within its connection pool."""
        at_most = self._options.max_rounds
        with_idle = at_most + max(1, at_most // 2)
        while len(rounds) - self._idle_rounds < at_most and len(rounds) < with_idle:
            shards = self._queue.next_round(self._options.max_shards)
            if not shards:
                return
            task = asyncio.create_task(self._round(shards))
            rounds.add(task)
            task.add_done_callback(rounds.discard)

    async def _wait(self, inbox: PartitionInbox, seconds: float) -> None:
        if seconds <= 0 or inbox.event.is_set():
            return
        self._round_done.clear()
        await wait_any(inbox.event, self._round_done, timeout=seconds)

    def _take_news(self, inbox: PartitionInbox) -> bool:
        """Queue the shards the notifications named and those due for a retry; True if a
        notification asked for a full scan."""
        rescan, inbox.rescan = inbox.rescan, False
        for key in [*self._retries.due(time.monotonic()), *inbox.take()]:
            self._queue.add(key)
        return rescan

    async def _give_back(self, inbox: PartitionInbox) -> bool:
        """True if this drain should end now so that a less busy worker takes its partition:
        the youngest drain of a worker that runs two more than another."""
        drains = self._hub.drains()
        if self._share is None or not drains or drains[-1] is not inbox:
            return False
        reason = await self._share.give_back(self._ref, len(drains))
        if reason is None:
            return False
        log.info(
            "partition %s: %s; this drain ends so that another worker takes it",
            self._ref.workflow_id,
            reason,
        )
        return True

    # -- finding shards with rows --------------------------------------------------------------

    async def _scan(self, *, full: bool) -> bool:
        """Queue this partition's shards with rows: every one (``full``), or those with rows
        above the newest id seen so far; True if it found any. The database returns only this
        partition's shards, and no more than the queue has room for (those with the oldest rows
        first): a scan holds a page of shards, however many the table has."""
        room = self._queue.room()
        try:
            async with self._engine.engine.connect() as conn:
                ranges = await read_shard_ranges(
                    conn,
                    self._table,
                    after_id=None if full else self._watermark,
                    regions=self._ref.regions,
                    partition=(self._ref.partition, self._ref.partitions),
                    limit=max(room, 0) + 1,  # one more: to know that some were left out
                )
                if full:
                    self._stats.deepest, self._stats.oldest = await _backlog(
                        conn, self._table, ranges, self._key
                    )
        except SQLAlchemyError as exc:
            log.warning(
                "partition %s cannot scan %s: %s", self._ref.workflow_id, self._table.name, exc
            )
            return False
        if full:
            self._queue.overflowed = False  # this scan finds every shard the queue left out
        if len(ranges) > room:
            self._queue.overflowed = True  # the shards left out wait for a scan of every shard
            ranges = ranges[: max(room, 0)]
        self._watermark = max([self._watermark, *(r.max_id for r in ranges)])
        for shard_range in ranges:
            self._queue.add(self._key(shard_range))
        return bool(ranges)

    def _key(self, r: ShardRange) -> ShardRef:
        return shard_of(self._engine.app, self._table.name, r.region, r.scope, r.shard_identifier)

    # -- one round -----------------------------------------------------------------------------

    async def _round(self, shards: list[ShardRef]) -> None:
        outcomes: list[ShardOutcome] = []
        skipped: list[ShardRef] = []
        held: set[ShardRef] = set()  # those the round's writes held for their workflow
        released: set[ShardRef] = set()  # queued again before the round ended
        lost = idle = False

        def went_idle() -> None:
            nonlocal idle
            idle = True
            self._idle_rounds += 1
            self._round_done.set()  # another round may start

        try:
            async with self._engine.locked(self._table, shards) as round_:
                held = round_.held
                round_.unlocked = functools.partial(_leave_round, self, round_, released)
                skipped = await _hold_skipped(round_, self._skip)
                heads = await self._engine.read_heads(
                    round_,
                    max_groups=groups_per_shard(self._options, len(shards)),
                    skip_held=True,
                    seconds=self._options.time_budget_seconds,
                )
                deadline = time.monotonic() + self._options.time_budget_seconds
                outcomes = await self._engine.run(
                    round_,
                    heads,
                    deadline=deadline,
                    settle=self._settle,
                    partition=self._ref.workflow_id,
                    went_idle=went_idle,
                    attempt=self._retries.attempt,
                )
            lost = round_.lost
        except Exception as exc:
            _log_failed_round(self._ref.workflow_id, exc)
            lost = True
        finally:
            self._idle_rounds -= idle
            shards = [shard for shard in shards if shard not in released]
            for shard in shards:
                self._queue.in_flight.discard(shard)
            self._round_done.set()
        handovers = _handovers(skipped, outcomes, held, self._skip)
        handed = {shard for shard, _ in handovers}
        if lost:
            for shard in shards:  # nothing else this round wrote can be trusted: read them again
                if shard not in handed:
                    self._queue.add(shard)
        else:
            self._count(outcomes, handed | released)
            self._stats.handed_over += len(handed)
        if handovers:
            await asyncio.gather(
                *(self._starter.hand_over(shard, handover) for shard, handover in handovers)
            )

    def _settle(self, round_: Round, outcome: ShardOutcome) -> None:
        """Under the shard's lock: a shard that failed or waits for a deferred head is held for
        its workflow, unless one holds it already, its handler failed and it is tried again
        here first, or it failed on a row the app cannot handle and the cap on such shards is
        reached (it waits, unheld)."""
        handover = _handover(outcome)
        if handover is None or outcome.groups_handled:  # a group succeeded: a new streak
            self._retries.succeeded(outcome.shard)
        if handover is None or outcome.lock_lost or self._retries.later(outcome, time.monotonic()):
            return
        cap = self._unhandled
        if cap is not None and cap.applies(outcome.failure) and not cap.admit(outcome.shard):
            return
        round_.hold(outcome.shard, handover.held_for, if_free=True)

    def _count(self, outcomes: list[ShardOutcome], queued: set[ShardRef]) -> None:
        """Count what the round did; queue again its shards with more rows (but ``queued``)."""
        stats = self._stats
        for outcome in outcomes:
            key = outcome.shard
            stats.rows_handled += outcome.rows_handled
            stats.groups_handled += outcome.groups_handled
            if outcome.groups_handled and len(self._drained) < SHARDS_COUNTED:
                self._drained.add(key)
            if outcome.more and key not in queued:
                self._queue.add(key)

    # -- reporting -----------------------------------------------------------------------------

    def _report(self, began: float) -> PartitionRound:
        stats = self._stats
        stats.seconds = round(time.monotonic() - began, 3)
        stats.shards_drained = len(self._drained)
        stats.queued = len(self._queue)
        rates = self._engine.calls.rates
        stats.rate_limited = [] if rates is None else rates.waiting_lines(self._ref.table)
        return stats


def _handovers(
    skipped: list[ShardRef],
    outcomes: list[ShardOutcome],
    held: set[ShardRef],
    skip: frozenset[str],
) -> list[tuple[ShardRef, HandoverInput]]:
    """What a round gives the workflows of the shards it held: the skipped ones, and those
    whose outcome asks for one."""
    handovers = [
        (s, HandoverInput(held_for=HeldFor.SKIPPED, skip=static_skip(s, skip))) for s in skipped
    ]
    handovers += [
        (outcome.shard, handover)
        for outcome in outcomes
        if outcome.shard in held and (handover := _handover(outcome)) is not None
    ]
    return handovers


def _handover(outcome: ShardOutcome) -> HandoverInput | None:
    """What a shard's workflow is told when the round gives it the shard: its failure or its
    deferred head."""
    if outcome.failure is not None:
        return HandoverInput(
            max_id=outcome.highest_seen_id,
            held_for=HeldFor.FAILED,
            head=outcome.failed,
            failure=outcome.failure,
        )
    if outcome.deferred_until is not None:
        return HandoverInput(
            max_id=outcome.highest_seen_id,
            held_for=HeldFor.DEFERRED,
            deferred_until=iso_utc(outcome.deferred_until),
            deferred_seconds=outcome.deferred_seconds,
        )
    return None


def _leave_round(
    drain: PartitionDrain, round_: Round, released: set[ShardRef], shard: ShardRef
) -> None:
    """``shard`` is done and unlocked: with nothing to hand over (or waiting for its retry),
    it leaves its round now, not when the round's last shard is done (one waiting for a rate
    limit's token, say), and a next round of ``drain`` drains its further rows meanwhile."""
    outcome = round_.outcomes.get(shard)
    if outcome is None or round_.lost or shard in round_.held:
        return
    if _handover(outcome) and not drain._retries.waits(shard):
        return
    released.add(shard)
    drain._queue.in_flight.discard(shard)
    if outcome.more:
        drain._queue.add(shard)
        drain._round_done.set()


def _log_failed_round(partition: str, exc: Exception) -> None:
    """A round ended early (its shards are read again): an outage, or a failure."""
    if connection_lost(exc):
        log.warning("partition %s: a round failed: %s", partition, exc)
    else:
        log.error(
            "partition %s: a round failed: %s: %s",
            partition,
            type(exc).__qualname__,
            exc,
            exc_info=exc,
        )


async def _backlog(
    conn: AsyncConnection,
    table: Table,
    ranges: Sequence[ShardRange],
    key: Callable[[ShardRange], ShardRef],
) -> tuple[list[ShardBacklog], list[ShardBacklog]]:
    """The deepest and the oldest shards of this partition (of those the scan returned),
    for its details."""
    deepest = heapq.nlargest(BACKLOG_SHOWN, ranges, key=lambda r: r.rows)
    oldest = heapq.nsmallest(BACKLOG_SHOWN, ranges, key=lambda r: r.min_id)
    ages = await read_row_ages(conn, table, [r.min_id for r in {*deepest, *oldest}])

    def shown(r: ShardRange) -> ShardBacklog:
        age = round(ages.get(r.min_id, 0.0), 1)
        return ShardBacklog(key(r).key, r.rows, age)

    return [shown(r) for r in deepest], [shown(r) for r in oldest]


async def _hold_skipped(round_: Round, skip: frozenset[str]) -> list[ShardRef]:
    """Hold the listed shards that nobody holds for their workflow, skipped; returns them.
    One its workflow holds is left to it (an operator may have resumed it)."""
    listed = [shard for shard in round_.locked if shard.workflow_id in skip]
    if not listed:
        return []
    held: list[ShardRef] = await round_.execute(
        functools.partial(
            ownership.hand_over, table=round_.table, shards=listed, held_for=HeldFor.SKIPPED
        )
    )
    return held
