"""The activities of a shard workflow: its drain, its category activity, a flush's wait, and
holding the shard. Each call holds the shard's advisory lock for its whole duration (two
executions of one shard never overlap) and no transaction or row lock while a handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

from sqlalchemy import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db import ownership
from outbox_bridge.db.parked import read_parked
from outbox_bridge.db.pauses import read_shard_pause
from outbox_bridge.db.scans import read_pending_up_to
from outbox_bridge.db.timestamps import iso_utc
from outbox_bridge.errors import ShardFaultError, ShardLockedError
from outbox_bridge.runtime.calls import HandlerFailed
from outbox_bridge.runtime.pause_control import member_name, view_of
from outbox_bridge.runtime.round_writes import Round, ShardOutcome
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import (
    DrainInput,
    DrainResult,
    FlushCheck,
    FlushCheckInput,
    HandleHeadInput,
    HandleHeadResult,
    HeldFor,
    HoldInput,
    ParkedNote,
    PauseInfo,
    PauseKind,
    ShardRef,
)

log = logging.getLogger(__name__)

# How long a shard workflow's drain or category activity waits for the shard's lock: a partition
# round may hold a held shard's lock for a moment (it locks before it reads, and reads nothing
# of a held shard), and failing at once would count that as a failed attempt of the handler.
LOCK_WAIT_SECONDS = 5.0
# A waiting flush reads the table after 10 ms, then less and less often, at least every 250 ms.
FLUSH_POLL_FIRST = 0.01
FLUSH_POLL_MAX = 0.25


class ShardLockLostError(ShardLockedError):
    """The connection holding the shard's lock died during the call: what was handled but not
    yet deleted runs again."""


class ShardDrainer:
    """Runs one shard's handlers for the activities of its workflow."""

    def __init__(self, engine: DrainEngine) -> None:
        self._engine = engine
        self._app = engine.app

    @contextlib.asynccontextmanager
    async def _locked(
        self, shard: ShardRef, wait_seconds: float = LOCK_WAIT_SECONDS
    ) -> AsyncIterator[Round]:
        table = self._app.table(shard.table)
        async with self._engine.locked(table, [shard], wait_seconds=wait_seconds) as round_:
            if not round_.locked:
                raise ShardLockedError(
                    f"shard {shard.key} is locked by another execution (a previous attempt may "
                    "still be running its handler, or a partition is draining it); retrying"
                )
            yield round_
        if round_.lost:
            raise ShardLockLostError(
                f"the connection holding the lock of shard {shard.key} was lost; retrying"
            )

    # -- draining --------------------------------------------------------------------------

    async def drain(self, request: DrainInput) -> DrainResult:
        """Hold the shard for its workflow, then handle head groups in order until the shard is
        empty (and give it back to its partition), a handler fails, the head is deferred, or
        the call's limits are reached. A shard held because it is skipped is left alone."""
        shard = request.shard
        deadline = time.monotonic() + request.time_budget_seconds
        outcome = ShardOutcome(shard)
        released = False
        parked: list[ParkedNote] = []
        paused: PauseInfo | None = None
        async with self._locked(shard) as round_:
            round_.hold(shard, HeldFor.WORKFLOW)  # never over a skip (ownership.take)
            heads = await self._engine.read_heads(
                round_, max_groups=request.max_groups, skip_held=False, skip_paused=True
            )
            if heads:
                [outcome] = await self._engine.run(
                    round_, heads, deadline=deadline, unlock_each=False
                )
            if outcome.emptied:
                round_.release(shard)
                released = True
            else:
                parked, paused = await round_.execute(
                    lambda conn: self._seen(conn, round_.table, outcome)
                )
        if outcome.failure is not None and outcome.failed is None:
            # Failed before any group could be named (its rows cannot be read, its unlock
            # failed): the activity fails, and is retried with backoff, saying why.
            failure = outcome.failure
            raise ShardFaultError(f"{failure.error_type}: {failure.message}")
        return _result(outcome, released, parked, paused)

    async def _seen(
        self, conn: AsyncConnection, table: Table, outcome: ShardOutcome
    ) -> tuple[list[ParkedNote], PauseInfo | None]:
        """What the shard's workflow shows beside its state: the shard's parked groups, and the
        pause its head waits for (read only when the head is not due)."""
        shard = outcome.shard
        parked = [
            ParkedNote(
                category_name=member_name(self._app, PauseKind.CATEGORY, group.category),
                object_identifier=group.object_identifier,
                reason=group.reason,
                parked_by=group.parked_by,
                parked_at=iso_utc(group.parked_at),
                rows=group.rows,
            )
            for group in await read_parked(conn, table, shard)
        ]
        pause = None
        if outcome.deferred_until is not None and outcome.failed is None:
            pause = await self._waited_pause(conn, table, shard)
        return parked, pause

    async def _waited_pause(
        self, conn: AsyncConnection, table: Table, shard: ShardRef
    ) -> PauseInfo | None:
        """The pause the shard's not-due head waits for, as the workflow shows it (if any)."""
        pause = await read_shard_pause(conn, table, shard)
        return None if pause is None else view_of(self._app, [pause]).pauses[0]

    # -- a blocked head --------------------------------------------------------------------

    async def handle_head(self, request: HandleHeadInput, *, attempt: int = 1) -> HandleHeadResult:
        """Handle the shard's head group if it is still the given group (it may have been
        handled or removed meanwhile). Raises :class:`HandlerFailed`. The calls are numbered on
        from the group's earlier ones (the partition's first call at least)."""
        shard = request.shard
        calls_before = max(request.prior_attempts, 1)
        async with self._locked(shard) as round_:
            heads = await self._engine.read_heads(
                round_, max_groups=1, skip_held=False, skip_paused=True
            )
            group = heads[0].groups[0] if heads and heads[0].groups else None
            wanted = (request.category, request.object_identifier)
            if group is None or (group.category, group.object_identifier) != wanted:
                return HandleHeadResult(handled=False)
            [outcome] = await self._engine.run(
                round_, heads, deadline=math.inf, attempt=calls_before + attempt, unlock_each=False
            )
        if outcome.failed is not None and outcome.failure is not None:
            raise HandlerFailed(outcome.failure, group)
        return HandleHeadResult(
            handled=True, rows_handled=outcome.rows_handled, last_id=group.last_id
        )

    # -- holding ---------------------------------------------------------------------------

    async def hold(self, request: HoldInput) -> None:
        """Record that the shard's workflow holds it (skipped, or taken back from a skip), once
        a drain of the shard under way has ended."""
        shard = request.shard
        move = ownership.skip if request.held_for == HeldFor.SKIPPED else ownership.resume
        async with self._locked(shard, wait_seconds=request.wait_seconds) as round_:
            await round_.execute(lambda conn: move(conn, round_.table, shard))

    # -- flushing --------------------------------------------------------------------------

    async def wait_handled(self, request: FlushCheckInput) -> FlushCheck:
        """Wait until no row of the shard up to ``up_to_id`` is pending, one of them is a
        deferred head, or the timeout passes. Polls the table and takes no lock."""
        shard = request.shard
        table = self._app.table(shard.table)
        deadline = time.monotonic() + request.timeout_seconds
        pause = FLUSH_POLL_FIRST
        while True:
            try:
                async with self._engine.engine.connect() as conn:
                    pending, deferred_until = await read_pending_up_to(
                        conn, table, shard, request.up_to_id
                    )
                    paused = None
                    if deferred_until is not None:
                        paused = await self._waited_pause(conn, table, shard)
            except SQLAlchemyError as exc:
                log.warning("flush of shard %s cannot read the table: %s", shard.key, exc)
            else:
                if not pending:
                    return FlushCheck(handled=True)
                if deferred_until is not None:
                    return FlushCheck(
                        handled=False, deferred_until=iso_utc(deferred_until), paused=paused
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                return FlushCheck(handled=False)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 1.5, FLUSH_POLL_MAX)


def _result(
    outcome: ShardOutcome, released: bool, parked: list[ParkedNote], paused: PauseInfo | None
) -> DrainResult:
    result = DrainResult(
        groups_handled=outcome.groups_handled,
        rows_handled=outcome.rows_handled,
        highest_seen_id=outcome.highest_seen_id,
        more=outcome.more,
        released=released,
        parked=parked,
    )
    if outcome.failed is not None:
        result.failed = outcome.failed
        result.failure = outcome.failure
    elif not outcome.more and outcome.deferred_until is not None:
        result.deferred_until = iso_utc(outcome.deferred_until)
        result.deferred_seconds = outcome.deferred_seconds
        result.paused = paused
    return result
