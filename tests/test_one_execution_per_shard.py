"""Two executions of one shard never overlap in time (the design contract, invariant 5), by
behaviour: two drain engines, as two workers have, on the same shards of a real PostgreSQL,
with handlers that record when each call starts and ends. No engine knows of the other's
calls: only the per-shard lock in the database keeps them apart.

The fault suite does the same with worker processes (tests/faults/test_stuck.py: a plain-def
handler that outlives its attempt while the retry runs in the other worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    Recorder,
    Scope,
    count_rows,
    create_tables,
    make_app,
    unique_table,
    wait_until,
    write_rows,
)

# The handlers' pace: long enough that a second execution of a shard, were it allowed, would
# start while the first is still in its call.
CALL_SECONDS = 0.02
MAX_GROUPS = 3  # per shard and round: a shard takes several rounds, so the engines take turns


@dataclass(frozen=True)
class CallSpan:
    engine: str
    shard: int
    row: int
    started: float
    finished: float


@dataclass
class Calls:
    """Every handler call of both engines, from both the event loop and handler threads."""

    spans: list[CallSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, span: CallSpan) -> None:
        with self.lock:
            self.spans.append(span)

    def overlaps(self) -> list[str]:
        """Calls of one shard that started before the previous one of the shard ended."""
        by_shard: dict[int, list[CallSpan]] = defaultdict(list)
        for span in self.spans:
            by_shard[span.shard].append(span)
        found = []
        for shard, spans in sorted(by_shard.items()):
            spans.sort(key=lambda s: s.started)
            for first, second in pairwise(spans):
                if second.started < first.finished:
                    found.append(
                        f"shard {shard}: row {second.row} ({second.engine}) started "
                        f"{first.finished - second.started:.4f} s before row {first.row} "
                        f"({first.engine}) ended"
                    )
        return found


class Worker:
    """One drain engine, with its own app and handler threads: what one worker process has.
    Its first call in each shard of ``hold`` waits until ``release`` is set."""

    def __init__(self, name: str, engine: AsyncEngine, table: str, calls: Calls) -> None:
        self.name = name
        self.calls = calls
        self.app: OutboxApp = make_app(table, Recorder(), handle_all=False)
        self.app.handler(Category.PROJECT_UPDATE)(self.plain)
        self.app.handler(Category.USER_UPDATE)(self.coroutine)
        self.handler_calls = HandlerCalls(self.app, redact_errors=False, threads=4)
        self.drains = DrainEngine(engine, self.app, calls=self.handler_calls)
        self.hold: set[int] = set()
        self.held: set[int] = set()  # the shards of ``hold`` whose first call has begun
        self.release = threading.Event()

    def _record(self, message: OutboxMessage, started: float) -> None:
        self.calls.add(
            CallSpan(self.name, message.shard_identifier, message.id, started, time.monotonic())
        )

    def _holds(self, message: OutboxMessage) -> bool:
        with self.calls.lock:
            shard = message.shard_identifier
            if shard not in self.hold or shard in self.held:
                return False
            self.held.add(shard)
            return True

    def plain(self, message: OutboxMessage) -> None:
        started = time.monotonic()
        if self._holds(message):
            assert self.release.wait(30), "the test never released the call"
        time.sleep(CALL_SECONDS)
        self._record(message, started)

    async def coroutine(self, message: OutboxMessage) -> None:
        started = time.monotonic()
        if self._holds(message):
            await asyncio.to_thread(self.release.wait, 30)
        await asyncio.sleep(CALL_SECONDS)
        self._record(message, started)

    async def round(self, shards: list[ShardRef]) -> int:
        """One round over ``shards``, as a partition's drain runs it; how many it locked."""
        table = self.app.table()
        async with self.drains.locked(table, shards) as round_:
            locked = len(round_.locked)
            heads = await self.drains.read_heads(round_, max_groups=MAX_GROUPS, skip_held=True)
            await self.drains.run(round_, heads, deadline=math.inf)
        return locked

    async def drain(self, shards: list[ShardRef]) -> None:
        """Rounds until the table is empty."""
        while await count_rows(self.drains.engine, self.app):
            if not await self.round(shards):
                await asyncio.sleep(0.005)  # every shard is the other engine's: let it run


@pytest.fixture
def workers(engine: AsyncEngine) -> Iterator[tuple[Worker, Worker, Calls]]:
    table = unique_table()
    calls = Calls()
    first, second = Worker("first", engine, table, calls), Worker("second", engine, table, calls)
    yield first, second, calls
    first.handler_calls.close()
    second.handler_calls.close()


@pytest.mark.parametrize(
    ("scope", "category"),
    [
        pytest.param(Scope.ORGANIZATION, Category.PROJECT_UPDATE, id="plain-def"),
        pytest.param(Scope.USER, Category.USER_UPDATE, id="async"),
    ],
)
async def test_two_drain_engines_never_run_one_shard_at_the_same_time(
    engine, workers, scope: Scope, category: Category
) -> None:
    first, second, calls = workers
    await create_tables(engine, first.app)
    shard_ids = [1, 2, 3]
    # Each row a group of its own: every row is one call, in every shard.
    rows = [
        {"category": category, "shard_identifier": shard, "object_identifier": obj}
        for obj in range(12)
        for shard in shard_ids
    ]
    ids = await write_rows(engine, first.app, rows)
    shards = [ShardRef(first.app.table().name, int(scope), scope.name, s) for s in shard_ids]

    # The first engine is in a call of shard 1 while the second runs a round over every shard:
    # the second must leave shard 1 alone until the first's round has ended.
    first.hold = {1}
    held = asyncio.create_task(first.round(shards[:1]))
    await wait_until(lambda: first.held == {1}, what="the first engine in a call of shard 1")
    try:
        await second.round(shards)
    finally:
        first.release.set()
        await held
    # Then both drain every shard at once, taking turns round by round.
    await asyncio.wait_for(asyncio.gather(first.drain(shards), second.drain(shards)), 120)

    assert calls.overlaps() == []
    handled = sorted(span.row for span in calls.spans)
    assert handled == sorted(ids), "a row was handled twice, or not at all"
    assert {span.engine for span in calls.spans} == {"first", "second"}


ORGANIZATION_SHARD, USER_SHARD = 1, 7


async def cancelled_during_calls(
    engine: AsyncEngine, workers: tuple[Worker, Worker, Calls], shard_ids: list[int], cancels: int
) -> None:
    """A round of the first engine over ``shard_ids`` (each with two rows, two groups), its
    first call in each held, is cancelled ``cancels`` times: as long as the plain-def call of
    the organization shard runs, the round must keep that shard locked (the second engine
    cannot take it) and must not end. Then the calls return: what they handled is deleted,
    for good, and the groups behind them wait for the next round."""
    first, second, calls = workers
    await create_tables(engine, first.app)
    rows = []
    for shard in shard_ids:
        category = Category.USER_UPDATE if shard == USER_SHARD else Category.PROJECT_UPDATE
        rows += [
            {"category": category, "shard_identifier": shard, "object_identifier": obj}
            for obj in (1, 2)
        ]
    ids = await write_rows(engine, first.app, rows)
    table = first.app.table().name
    shards = [
        ShardRef(table, int(Scope.USER), "USER", s)
        if s == USER_SHARD
        else ShardRef(table, int(Scope.ORGANIZATION), "ORGANIZATION", s)
        for s in shard_ids
    ]
    first.hold = set(shard_ids)
    stopping = asyncio.create_task(first.round(shards))
    await wait_until(lambda: first.held == set(shard_ids), what="a call in each shard")
    for _ in range(cancels):
        stopping.cancel()
        for _ in range(50):  # let the cancellation reach the calls: no I/O, only hops
            await asyncio.sleep(0)
    organization = [s for s in shards if s.shard_identifier == ORGANIZATION_SHARD]
    try:
        assert not stopping.done(), "the round ended while a plain-def call was still running"
        assert await second.round(organization) == 0, "the shard was unlocked during its call"
    finally:
        first.release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
    # The organization shard's first group was handled and is deleted; the async call was
    # cancelled: its rows stay, as does every group behind a call.
    handled = [span.row for span in calls.spans]
    assert handled == [ids[shard_ids.index(ORGANIZATION_SHARD) * 2]]
    async with engine.connect() as conn:
        left = await conn.execute(text(f"SELECT id FROM {table} ORDER BY id"))
        assert list(left.scalars()) == sorted(set(ids) - set(handled))


async def test_a_round_cancelled_once_waits_for_its_plain_def_call_beside_an_async_one(
    engine, workers
) -> None:
    """Cancelled once (a skip, a shutdown, a lost workflow), a round whose async call ends at
    once must still wait for the plain-def call of another of its shards, whose thread cannot
    be stopped: it must not unlock that shard, or hand its connection back to the pool, while
    the call runs (another round would overlap it, and the call's delete would run on a
    connection that is no longer the round's, and be lost)."""
    await cancelled_during_calls(engine, workers, [ORGANIZATION_SHARD, USER_SHARD], cancels=1)


async def test_a_round_cancelled_twice_waits_for_its_plain_def_call(engine, workers) -> None:
    """An activity can be cancelled again while it stops (the SDK cancels its task on every
    cancel request and every failed heartbeat: a lost workflow, a wiped server): the round
    still waits for its plain-def call."""
    await cancelled_during_calls(engine, workers, [ORGANIZATION_SHARD], cancels=2)
