"""A handler's ``fleet_max_concurrency`` across workers: two drain engines, as two workers have,
each with its own connection for the fleet slots, on the same table of a real PostgreSQL. No
engine knows of the other's calls: only the advisory locks in the database keep the count."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.runtime.call_slots import CallSlots, Slots
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.fleet_slots import FleetLimit
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    SCOPES,
    Category,
    Scope,
    count_rows,
    create_tables,
    lock_holders,
    sql,
    unique_table,
    wait_until,
    write_rows,
)

FLEET_LIMIT = 2
# The two categories of the limited handler: the limit counts their calls together.
LIMITED = (Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)


@dataclass
class Gauge:
    """The limited calls of both engines running now, the most seen at once, and who ran them."""

    running: int = 0
    peak: int = 0
    by_engine: Counter[str] = field(default_factory=Counter)
    # The first calls wait until the limit is reached once: the calls do overlap.
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    others: int = 0

    def enter(self, engine: str) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.by_engine[engine] += 1
        if self.running == FLEET_LIMIT:
            self.reached.set()


class Worker:
    """One drain engine with its own app, handler calls and fleet connection."""

    def __init__(self, name: str, engine: AsyncEngine, table: str, gauge: Gauge) -> None:
        self.name = name
        self.gauge = gauge
        self.app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(table)])
        self.app.handler(*LIMITED, fleet_max_concurrency=FLEET_LIMIT)(self.limited)
        self.app.handler(Category.MEMBER_UPDATE, Category.USER_UPDATE)(self.other)
        self.calls = HandlerCalls(self.app, redact_errors=False, threads=2, engine=engine)
        self.drains = DrainEngine(engine, self.app, calls=self.calls)
        self.hold: asyncio.Event | None = None  # set: the limited calls wait until it is set
        self.handled: list[int] = []

    async def limited(self, message: OutboxMessage) -> None:
        self.gauge.enter(self.name)
        try:
            await asyncio.wait_for(self.gauge.reached.wait(), 30)
            if self.hold is not None:
                await asyncio.wait_for(self.hold.wait(), 30)
            await asyncio.sleep(0.01)  # room for a call over the limit to show, were one let in
        finally:
            self.gauge.running -= 1
        self.handled.append(message.shard_identifier)

    async def other(self, message: OutboxMessage) -> None:
        self.gauge.others += 1

    async def round(self, shards: list[ShardRef]) -> int:
        """One round over ``shards``, as a partition's drain runs it; how many it locked."""
        async with self.drains.locked(self.app.table(), shards) as round_:
            heads = await self.drains.read_heads(round_, max_groups=2, skip_held=True)
            await self.drains.run(round_, heads, deadline=math.inf)
            return len(round_.locked)

    async def drain(self, shards: list[ShardRef]) -> None:
        """Rounds until the table is empty."""
        while await count_rows(self.drains.engine, self.app):
            if not await self.round(shards):
                await asyncio.sleep(0.005)  # every shard is the other engine's: let it run

    def fleet_slots(self, category: Category) -> FleetLimit:
        slots = self.calls.slots.limits(category)[0]
        assert isinstance(slots, FleetLimit)
        return slots

    async def close(self) -> None:
        self.calls.close()
        assert self.calls.slots.fleet is not None
        await self.calls.slots.fleet.aclose()


@pytest.fixture
async def workers(engine: AsyncEngine) -> AsyncIterator[tuple[Worker, Worker]]:
    table = unique_table()
    gauge = Gauge()
    first, second = Worker("first", engine, table, gauge), Worker("second", engine, table, gauge)
    await create_tables(engine, first.app)
    yield first, second
    await first.close()
    await second.close()


def shards_of(worker: Worker, ids: range) -> list[ShardRef]:
    return [
        ShardRef(worker.app.table().name, int(Scope.ORGANIZATION), "ORGANIZATION", s) for s in ids
    ]


async def test_two_workers_never_run_more_calls_than_the_fleet_limit(
    engine: AsyncEngine, workers: tuple[Worker, Worker]
) -> None:
    first, second = workers
    ids = range(1, 13)
    rows = [
        {
            "category": LIMITED[(shard + obj) % 2],
            "shard_identifier": shard,
            "object_identifier": obj,
        }
        for shard in ids
        for obj in range(3)
    ] + [
        {"category": Category.MEMBER_UPDATE, "shard_identifier": shard, "object_identifier": 9}
        for shard in ids
    ]
    await write_rows(engine, first.app, rows)
    shards = shards_of(first, ids)
    await asyncio.wait_for(asyncio.gather(first.drain(shards), second.drain(shards)), 120)

    gauge = first.gauge
    assert sum(gauge.by_engine.values()) == 3 * len(ids)
    assert gauge.others == len(ids)  # the other categories ran on
    assert gauge.peak <= FLEET_LIMIT, f"{gauge.peak} calls at once, the fleet's limit is 2"
    assert gauge.peak == FLEET_LIMIT
    assert set(gauge.by_engine) == {"first", "second"}
    # Every slot was given back.
    prefix = first.fleet_slots(Category.ORGANIZATION_UPDATE).prefix
    for slot in range(FLEET_LIMIT):
        assert await lock_holders(engine, f"{prefix}{slot}") == []


async def test_a_killed_fleet_connection_frees_its_slots_and_comes_back(
    engine: AsyncEngine, workers: tuple[Worker, Worker]
) -> None:
    first, second = workers
    first.gauge.reached.set()
    first.hold = asyncio.Event()
    await write_rows(
        engine,
        first.app,
        [
            {"category": LIMITED[0], "shard_identifier": shard, "object_identifier": 1}
            for shard in (1, 2, 3, 4)
        ],
    )
    # The first worker's calls of shards 1 and 2 hold both slots until released; its call of
    # shard 4 waits for one, and so does the second worker's call of shard 3.
    held = asyncio.create_task(
        first.round([*shards_of(first, range(1, 3)), *shards_of(first, range(4, 5))])
    )
    await wait_until(lambda: first.gauge.running == FLEET_LIMIT, what="two calls holding slots")
    prefix = first.fleet_slots(LIMITED[0]).prefix
    keys = [f"{prefix}{slot}" for slot in range(FLEET_LIMIT)]
    holders = [await lock_holders(engine, key) for key in keys]
    assert holders[0] == holders[1] and len(holders[0]) == 1, holders
    killed = holders[0][0]
    waiting = asyncio.create_task(second.round(shards_of(second, range(3, 4))))
    await wait_until(second.fleet_slots(LIMITED[0]).queued, what="a call waiting")
    await wait_until(first.fleet_slots(LIMITED[0]).queued, what="a call waiting")
    assert second.handled == [] and first.gauge.by_engine["first"] == FLEET_LIMIT

    await sql(engine, "SELECT pg_terminate_backend(:pid)", pid=killed)
    # Its slots are free: the second worker's call takes one and runs.
    await asyncio.wait_for(waiting, 30)
    assert second.handled == [3]
    # The first worker's waiting call runs once its new connection holds a slot for it.
    await wait_until(lambda: first.gauge.by_engine["first"] == 3, what="shard 4's call")

    async def held_by_a_new_connection() -> bool:
        holders = [pid for key in keys for pid in await lock_holders(engine, key)]
        return len(holders) == 1 and holders[0] != killed

    await wait_until(held_by_a_new_connection, what="shard 4's slot")
    first.hold.set()
    await asyncio.wait_for(held, 30)
    assert sorted(first.handled) == [1, 2, 4]
    assert await count_rows(engine, first.app) == 0


async def test_without_a_database_the_fleet_limit_holds_in_the_worker() -> None:
    app = OutboxApp(scopes=SCOPES, categories=[Category])
    app.handler(*LIMITED, max_concurrency=5, fleet_max_concurrency=3)(_noop)
    limits = CallSlots(app, 100).limits(LIMITED[1])
    assert [type(limit) for limit in limits] == [Slots, Slots, Slots]
    assert [limit.size for limit in limits if isinstance(limit, Slots)] == [5, 3, 100]


async def test_the_fleet_slots_are_locks_of_the_app_s_first_table_and_the_handler(
    engine: AsyncEngine, workers: tuple[Worker, Worker]
) -> None:
    first, _ = workers
    slots = first.fleet_slots(LIMITED[1])
    assert slots is first.fleet_slots(LIMITED[0])
    assert slots.prefix == f"outbox-fleet:{first.app.table().name}:1+2:"
    assert await slots.take() and await slots.take()
    assert not await slots.take(deadline=0)  # both taken, and the deadline is past
    holders = [await lock_holders(engine, f"{slots.prefix}{slot}") for slot in (0, 1, 2)]
    assert holders[0] == holders[1] and len(holders[0]) == 1 and holders[2] == []
    slots.give()
    slots.give()
    keys = [f"{slots.prefix}{slot}" for slot in (0, 1)]

    async def given_back() -> bool:
        return all([await lock_holders(engine, key) == [] for key in keys])

    await wait_until(given_back, what="the slots given back")


async def _noop(message: OutboxMessage) -> None:
    return None
