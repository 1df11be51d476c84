"""The bound on groups handled and not deleted (what a kill -9 repeats besides the calls under
way), where it lives: its default follows the calls a worker can run at once, a round's deletes
are pipelined, and no call starts while the bound is reached. Fakes only: no database, no
worker (tests/test_delete_chunks.py drives the same through real rounds)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage, OutboxSettings, OutboxTable
from outbox_bridge.db.reads import GroupRows
from outbox_bridge.runtime.assembly import build_drains
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.partition_drain import PartitionDrain
from outbox_bridge.runtime.round_writes import Round, ShardOutcome, Undeleted
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.runtime.shards import ShardStarter
from outbox_bridge.workflows.models import (
    PartitionDrainInput,
    PartitionOptions,
    PartitionRef,
    ShardRef,
)
from tests.harness import SCOPES, Category, Scope

NO_ENGINE = cast(AsyncEngine, None)  # building a drain engine touches no database


def app_with(*, plain: bool, asynchronous: bool) -> OutboxApp:
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable("undeleted")])
    categories = list(Category)

    def handle(message: OutboxMessage) -> None:
        pass

    async def handle_async(message: OutboxMessage) -> None:
        pass

    if plain and asynchronous:
        app.handler(categories[0])(handle)
        app.handler(*categories[1:])(handle_async)
    elif plain:
        app.handler(*categories)(handle)
    else:
        app.handler(*categories)(handle_async)
    return app


@pytest.mark.parametrize(
    ("plain", "asynchronous", "expected"),
    [(True, False, 8), (False, True, 50), (True, True, 50)],
    ids=["plain-def", "async", "both"],
)
def test_by_default_the_bound_is_the_calls_the_worker_can_run_at_once(
    plain: bool, asynchronous: bool, expected: int
) -> None:
    """Plain-def calls wait for one of ``handler_threads``; async ones run up to
    ``max_concurrent_calls``."""
    calls = HandlerCalls(
        app_with(plain=plain, asynchronous=asynchronous),
        redact_errors=False,
        threads=8,
        max_calls=50,
    )
    try:
        assert calls.at_once == expected
        drain = DrainEngine(NO_ENGINE, calls._app, calls=calls)
        assert drain.max_undeleted_groups == expected
        explicit = DrainEngine(NO_ENGINE, calls._app, calls=calls, max_undeleted_groups=3)
        assert explicit.max_undeleted_groups == 3
    finally:
        calls.close()


@pytest.mark.parametrize(
    ("plain", "asynchronous", "expected"),
    [(True, False, 8), (False, True, 200), (True, True, 200)],
    ids=["plain-def", "async", "both"],
)
def test_a_round_locks_no_more_shards_than_the_worker_runs_calls_at_once(
    plain: bool, asynchronous: bool, expected: int
) -> None:
    """A partition's round of plain-def handlers locks as many shards as there are threads, not
    the 200 of the partition's options: what it read and could not run was read again."""
    calls = HandlerCalls(
        app_with(plain=plain, asynchronous=asynchronous), redact_errors=False, threads=8
    )
    try:
        drain = PartitionDrain(
            DrainEngine(NO_ENGINE, calls._app, calls=calls),
            cast(ShardStarter, SimpleNamespace(skip_shards=frozenset())),
            ShardHub(),
            PartitionDrainInput(PartitionRef("undeleted", 0, 1), PartitionOptions()),
        )
        assert PartitionOptions().max_shards == 200
        assert drain._options.max_shards == expected
    finally:
        calls.close()


def test_threads_above_the_worker_s_calls_do_not_raise_the_bound() -> None:
    calls = HandlerCalls(
        app_with(plain=True, asynchronous=False), redact_errors=False, threads=64, max_calls=20
    )
    try:
        assert calls.at_once == 20
    finally:
        calls.close()


@pytest.mark.parametrize(("setting", "expected"), [(None, 1000), (7, 7)])
def test_the_worker_setting_is_an_explicit_cap(setting: int | None, expected: int) -> None:
    """The worker's default (no cap of its own: the calls at once, 1,000 with async handlers),
    and ``max_undeleted_groups`` given."""
    assert OutboxSettings.model_fields["max_undeleted_groups"].default is None
    drains = build_drains(
        NO_ENGINE,
        app_with(plain=True, asynchronous=True),
        OutboxSettings(max_undeleted_groups=setting),
    )
    try:
        assert drains.engine.max_undeleted_groups == expected
    finally:
        drains.close()


async def test_no_call_starts_while_the_bound_is_reached_and_waiters_go_in_turn() -> None:
    undeleted = Undeleted(2)
    undeleted.added()
    undeleted.added()
    order: list[str] = []

    async def call(name: str) -> None:
        await undeleted.room()
        order.append(name)
        undeleted.added()

    first = asyncio.create_task(call("first"))
    second = asyncio.create_task(call("second"))
    await asyncio.sleep(0.01)
    assert order == []  # two handled, none deleted: nothing starts
    undeleted.done(1)  # room for one: the first waiter, not both
    await asyncio.sleep(0.01)
    assert order == ["first"]
    undeleted.done(2)
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert order == ["first", "second"]
    assert undeleted.groups == 1


class Deletes:
    """A round's delete statements, each held under way until :attr:`gate` is set."""

    def __init__(self) -> None:
        self.statements: list[list[int]] = []
        self.gate = asyncio.Event()

    async def __call__(self, ids: list[int]) -> list[int]:
        self.statements.append(ids)
        await self.gate.wait()
        return ids

    async def under_way(self, count: int) -> None:
        while len(self.statements) < count:
            await asyncio.sleep(0)


def fake_round(limit: int) -> tuple[Round, ShardOutcome, Deletes]:
    app = app_with(plain=False, asynchronous=True)
    shard = ShardRef("undeleted", int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, 1)
    conn: Any = SimpleNamespace(invalidated=False)  # never sent a statement: delete_rows is faked
    round_ = Round(conn, app.table(), [shard], Undeleted(limit))
    deletes = Deletes()
    round_.delete_rows = deletes  # type: ignore[method-assign]
    return round_, ShardOutcome(shard), deletes


def group(row_id: int) -> GroupRows:
    return GroupRows(int(Category.PROJECT_UPDATE), row_id, [row_id])


async def test_what_is_handled_while_a_delete_is_under_way_goes_in_the_next_one() -> None:
    """Pipelined: one statement under way per round, the next takes every group handled
    meanwhile (never a round trip per group)."""
    round_, outcome, deletes = fake_round(limit=100)
    round_.deleted(group(1), outcome)
    await deletes.under_way(1)
    for row_id in range(2, 8):
        round_.deleted(group(row_id), outcome)
    assert round_.undeleted.groups == 7
    await asyncio.sleep(0.01)
    assert deletes.statements == [[1]]  # the others wait for the one under way
    deletes.gate.set()
    await round_.flush()
    assert deletes.statements == [[1], [2, 3, 4, 5, 6, 7]]
    assert round_.undeleted.groups == 0
    assert outcome.rows_handled == 7


async def test_a_round_waits_for_its_deletes_once_the_bound_is_reached() -> None:
    round_, outcome, deletes = fake_round(limit=3)
    for row_id in (1, 2, 3):
        round_.deleted(group(row_id), outcome)
    await deletes.under_way(1)
    paced = asyncio.create_task(round_.pace())
    await asyncio.sleep(0.01)
    assert not paced.done()  # three handled, none deleted: no further call
    deletes.gate.set()
    await asyncio.wait_for(paced, 5)
    await round_.flush()
    assert round_.undeleted.groups == 0
