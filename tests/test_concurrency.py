"""How many handler calls run at once: a handler's ``max_concurrency`` (and its
``fleet_max_concurrency``, with one worker), held by a real worker while other categories go
on, and the checks of the values. Several workers: tests/test_fleet_concurrency.py."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage, OutboxSettings, OutboxTable, RegistryError
from outbox_bridge.runtime.call_slots import Slots
from outbox_bridge.runtime.waiters import RoundShards, await_turn
from outbox_bridge.workflows.models import PartitionOptions
from tests.harness import (
    SCOPES,
    Category,
    Servers,
    create_tables,
    fast_settings,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)

LIMIT = 2
FULL_WAIT = 10.0  # seconds a limited call waits for the limit to be reached
LIMITED_SHARDS = 12  # each with 2 groups of the limited category
OTHER_SHARDS = 30  # each with 1 group of another category


@dataclass
class Gauge:
    """Calls of the limited category running now, and the most seen at once (kept under a lock:
    plain-def handlers run in several threads)."""

    running: int = 0
    peak: int = 0
    calls: int = 0
    others: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Limited calls wait until every other category's call is done: those must not wait for them.
    others_done: threading.Event = field(default_factory=threading.Event)
    # Then until the limit was reached once (a while at most): the calls that may overlap do,
    # however slowly a slot of the database comes on a loaded machine.
    full: threading.Event = field(default_factory=threading.Event)

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            if self.running >= LIMIT:
                self.full.set()

    def leave(self) -> None:
        with self.lock:
            self.running -= 1
            self.calls += 1

    def other(self) -> None:
        with self.lock:
            self.others += 1
            if self.others == OTHER_SHARDS:
                self.others_done.set()


def limited_app(gauge: Gauge, *, plain: bool, limit: str = "max_concurrency") -> OutboxApp:
    """``limit``: the keyword of app.handler that limits ORGANIZATION_UPDATE's calls."""
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    others = [c for c in Category if c is not Category.ORGANIZATION_UPDATE]
    limits: dict[str, Any] = {limit: LIMIT}
    limited_handler = app.handler(Category.ORGANIZATION_UPDATE, **limits)

    if plain:

        @limited_handler
        def limited_sync(message: OutboxMessage) -> None:
            gauge.enter()
            try:
                assert gauge.others_done.wait(timeout=60), "other categories did not proceed"
                gauge.full.wait(timeout=FULL_WAIT)
            finally:
                gauge.leave()

        @app.handler(*others)
        def other_sync(message: OutboxMessage) -> None:
            gauge.other()

        return app

    others_done = asyncio.Event()  # the same, for calls on the event loop

    @limited_handler
    async def limited(message: OutboxMessage) -> None:
        gauge.enter()
        try:
            await asyncio.wait_for(others_done.wait(), timeout=60)
            deadline = time.monotonic() + FULL_WAIT
            while not gauge.full.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            gauge.leave()

    @app.handler(*others)
    async def other(message: OutboxMessage) -> None:
        gauge.other()
        if gauge.others_done.is_set():
            others_done.set()

    return app


@pytest.mark.parametrize("limit", ["max_concurrency", "fleet_max_concurrency"])
@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain-def"])
async def test_max_concurrency_holds_while_other_categories_proceed(
    servers: Servers, engine: AsyncEngine, plain: bool, limit: str
) -> None:
    gauge = Gauge()
    app = limited_app(gauge, plain=plain, limit=limit)
    await create_tables(engine, app)
    limited_rows = [
        {"category": Category.ORGANIZATION_UPDATE, "shard_identifier": s, "object_identifier": o}
        for s in range(1, LIMITED_SHARDS + 1)
        for o in (1, 2)
    ]
    other_rows = [
        {"category": Category.USER_UPDATE, "shard_identifier": s, "object_identifier": 1}
        for s in range(1, OTHER_SHARDS + 1)
    ]
    # The limited rows first: they come first in every round.
    await write_rows(engine, app, limited_rows)
    await write_rows(engine, app, other_rows)
    async with running_worker(servers, app, fast_settings(drain_time_budget=0.5)):
        await wait_until(gauge.others_done.is_set, timeout=60, what="the other categories' calls")
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="an empty table")
    assert gauge.calls == len(limited_rows)
    assert gauge.peak <= LIMIT, f"{gauge.peak} calls of a category limited to {LIMIT} at once"
    assert gauge.peak == LIMIT  # the limit was reached: the calls did overlap


def test_call_limit_is_shared_by_the_categories_registered_together() -> None:
    app = OutboxApp(scopes=SCOPES, categories=[Category])
    shared = app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE, max_concurrency=3)
    shared(_noop)
    app.handler(Category.USER_UPDATE)(_noop)
    limit = app.call_limit(Category.ORGANIZATION_UPDATE)
    assert limit is not None and (limit.calls, limit.fleet_calls) == (3, None)
    assert app.call_limit(Category.PROJECT_UPDATE) is limit
    assert app.call_limit(Category.USER_UPDATE) is None
    fleet = app.handler(Category.MEMBER_UPDATE, fleet_max_concurrency=4)
    fleet(_noop)
    limit = app.call_limit(Category.MEMBER_UPDATE)
    assert limit is not None and (limit.calls, limit.fleet_calls) == (None, 4)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (0, "at least 1, not 0"),
        (-5, "at least 1, not -5"),
        (2.5, "positive integer or None, not 2.5 (float)"),
        ("5", "positive integer or None, not '5' (str)"),
        (True, "positive integer or None, not True (bool)"),
    ],
)
@pytest.mark.parametrize("limit", ["max_concurrency", "fleet_max_concurrency"])
def test_a_bad_max_concurrency_is_refused_and_registers_nothing(
    value: object, says: str, limit: str
) -> None:
    app = OutboxApp(scopes=SCOPES, categories=[Category])
    with pytest.raises(RegistryError, match=f"^{limit} must be .*{re.escape(says)}"):
        app.handler(Category.USER_UPDATE, **{limit: value})  # type: ignore[arg-type]
    assert app.handler_for(Category.USER_UPDATE) is None


async def _noop(message: OutboxMessage) -> None:
    return None


async def test_max_concurrent_calls_bounds_the_calls_of_a_worker(
    servers: Servers, engine: AsyncEngine
) -> None:
    gauge = Gauge()
    most = 3
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    overlapped = asyncio.Event()

    @app.handler(*Category)
    async def handle(message: OutboxMessage) -> None:
        gauge.enter()
        if gauge.peak >= most:
            overlapped.set()
        try:
            await asyncio.wait_for(overlapped.wait(), timeout=60)  # until `most` ran at once
        finally:
            gauge.leave()

    await create_tables(engine, app)
    rows = [
        {"category": Category.USER_UPDATE, "shard_identifier": s, "object_identifier": o}
        for s in range(1, 21)
        for o in (1, 2)
    ]
    await write_rows(engine, app, rows)
    async with running_worker(servers, app, fast_settings(max_concurrent_calls=most)):
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="an empty table")
    assert gauge.calls == len(rows)
    assert gauge.peak == most, f"{gauge.peak} calls at once in a worker limited to {most}"


async def test_a_round_whose_other_shards_are_done_stops_waiting_for_a_slot(
    servers: Servers, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition runs 2 rounds of 2 shards at once here, with a time budget far longer than
    the test. The first limited shard holds the only slot until every other shard is done;
    the limited shards waiting for it must not keep their rounds (and the partition's two
    places) until the budget runs out, or the other shards never get a round."""
    original = OutboxSettings.partition_options

    def small_rounds(self: OutboxSettings, *args: Any, **kwargs: Any) -> PartitionOptions:
        return dataclasses.replace(original(self, *args, **kwargs), max_shards=2, max_rounds=2)

    monkeypatch.setattr(OutboxSettings, "partition_options", small_rounds)
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    others_done = asyncio.Event()
    other_shards = range(11, 17)
    handled: set[int] = set()

    @app.handler(Category.ORGANIZATION_UPDATE, max_concurrency=1)
    async def limited(message: OutboxMessage) -> None:
        await asyncio.wait_for(others_done.wait(), timeout=60)

    @app.handler(*[c for c in Category if c is not Category.ORGANIZATION_UPDATE])
    async def other(message: OutboxMessage) -> None:
        handled.add(message.shard_identifier)
        if handled == set(other_shards):
            others_done.set()

    await create_tables(engine, app)
    # The limited shards first, in scope order and in id order alike.
    await write_rows(
        engine,
        app,
        [
            {
                "category": Category.ORGANIZATION_UPDATE,
                "shard_identifier": s,
                "object_identifier": 1,
            }
            for s in (1, 2, 3)
        ],
    )
    await write_rows(
        engine,
        app,
        [
            {"category": Category.USER_UPDATE, "shard_identifier": s, "object_identifier": 1}
            for s in other_shards
        ],
    )
    settings = fast_settings(partitions=1, drain_time_budget=120.0)
    async with running_worker(servers, app, settings):
        await wait_until(others_done.is_set, timeout=30, what="the other shards' calls")
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="an empty table")


async def test_a_round_goes_idle_once_when_its_busy_shards_are_done_or_waiting() -> None:
    """The partition's drain starts another round in an idle round's place: told once, when
    no shard is busy and one was done; its waiters then give up."""
    told: list[bool] = []
    busy = RoundShards(3, lambda: told.append(True))
    waiter = asyncio.get_running_loop().create_future()
    busy.waiting(waiter)  # one shard waits for a slot or a token
    busy.done()
    assert not told and not busy.idle  # one shard is still busy
    busy.done()
    assert told == [True] and busy.idle
    assert waiter.done()  # given up: its shard goes back to the queue
    busy.woken(waiter)
    busy.done()
    assert told == [True]


async def test_a_wait_with_a_grace_gives_up_that_much_after_its_round_went_idle() -> None:
    """A wait for a rate limit's token lingers when its round goes idle (its token may be due):
    served within the grace it goes on, else it gives up once the grace has passed; a wait for a
    slot gives up at once."""
    loop = asyncio.get_running_loop()
    busy = RoundShards(4)
    slot, late, served = (loop.create_future() for _ in range(3))
    waits = [
        asyncio.create_task(await_turn(slot, math.inf, busy, lambda: None)),
        asyncio.create_task(await_turn(late, math.inf, busy, lambda: None, grace=0.2)),
        asyncio.create_task(await_turn(served, math.inf, busy, lambda: None, grace=0.2)),
    ]
    await asyncio.sleep(0)  # all three wait
    went_idle = time.monotonic()
    busy.done()  # the round's one busy shard is done: the round is idle
    assert busy.idle
    assert not await waits[0]  # a slot's wait gives up at once
    assert not late.done() and not served.done()
    served.set_result(None)  # its token came within the grace
    assert await waits[2]
    assert not await waits[1]
    assert time.monotonic() - went_idle >= 0.19


async def test_slots_go_first_come_first_served_and_a_wait_ends_at_its_deadline() -> None:
    slots = Slots(1)
    assert await slots.take()
    assert not await slots.take(time.monotonic() - 1)  # past its deadline: no slot
    order: list[str] = []

    async def wait(name: str) -> None:
        assert await slots.take()
        order.append(name)
        slots.give()

    waiters = [asyncio.create_task(wait(name)) for name in ("first", "second", "third")]
    await asyncio.sleep(0)  # all three wait
    assert order == []
    slots.give()
    await asyncio.gather(*waiters)
    assert order == ["first", "second", "third"]
    assert slots.taken == 0


async def test_a_slot_handed_to_a_cancelled_waiter_goes_to_the_next() -> None:
    slots = Slots(1)
    assert await slots.take()
    cancelled = asyncio.create_task(slots.take())
    following = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    slots.give()  # handed to the first waiter, which is cancelled before it runs
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert await following
    assert slots.taken == 1


async def test_waiters_that_gave_up_never_hold_back_a_free_slot() -> None:
    """Waits that expired or were cancelled stay queued until they reach the front, where they
    are skipped: the slot given back goes to a live waiter past them, or is free at once."""
    slots = Slots(1)
    assert await slots.take()
    expired = asyncio.create_task(slots.take(time.monotonic() + 0.05))
    cancelled = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    assert not await expired
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    live = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    slots.give()  # past the two that gave up, to the live one
    assert await live and slots.taken == 1
    late = asyncio.create_task(slots.take(time.monotonic() + 0.05))
    await asyncio.sleep(0)
    assert not await late
    slots.give()
    assert slots.taken == 0
    assert await slots.take(time.monotonic() - 1)  # free, though a dead wait was queued
