"""What the drains have handled but not deleted yet: the groups that a kill -9 at that moment
makes run again (the design contract, invariant 5: docs/explanation/contract.md).

A round deletes what it handled as soon as its connection is free (what is handled meanwhile
goes with the next delete), and no round takes a further group while the worker's rounds
together have ``max_undeleted_groups`` handled and not deleted (by default as many as the
worker can run calls at once): a crash repeats at most that many groups however slow the
deletes are and however many rounds run (docs/explanation/processing.md, "Delete, on the
fence").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage, OutboxSettings, OutboxTable
from outbox_bridge.runtime.assembly import build_drains
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    SCOPES,
    Category,
    Scope,
    create_tables,
    unique_table,
    wait_until,
    write_rows,
)

DELETE_SECONDS = 0.3  # each DELETE statement on the table takes this long
LIMIT = 10  # an explicit max_undeleted_groups


async def counting_app(engine: AsyncEngine, *, sync: bool) -> tuple[OutboxApp, list[int]]:
    """An app on a table of its own whose handler (a plain ``def`` one with ``sync``, run in
    worker threads) records the id of every call, with statements on the table that take
    DELETE_SECONDS each (a loaded database)."""
    table = unique_table()
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(table)])
    calls: list[int] = []
    if sync:

        def handle(message: OutboxMessage) -> None:
            calls.append(message.id)

        app.handler(*Category)(handle)
    else:

        async def handle_async(message: OutboxMessage) -> None:
            calls.append(message.id)

        app.handler(*Category)(handle_async)
    await create_tables(engine, app)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                f"CREATE FUNCTION {table}_slow() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN PERFORM pg_sleep({DELETE_SECONDS}); RETURN NULL; END $$"
            )
        )
        await conn.execute(
            text(
                f"CREATE TRIGGER {table}_slow BEFORE DELETE ON {table} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {table}_slow()"
            )
        )
    return app, calls


@contextlib.asynccontextmanager
async def most_ahead(engine: AsyncEngine, table: str, calls: list[int]) -> AsyncIterator[list[int]]:
    """Samples, while the block runs, how many groups were handled and not deleted (every row
    is a group of its own); yields a list that holds the most of them once the block ends."""
    total = await rows_left(engine, table)
    most = [0]
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            # Calls counted before the rows: a delete committed in between is not counted as
            # ahead (the sample never exceeds the truth).
            handled = len(calls)
            left = await rows_left(engine, table)
            most[0] = max(most[0], handled - (total - left))
            await asyncio.sleep(0.01)

    watching = asyncio.create_task(watch())
    try:
        yield most
    finally:
        done.set()
        await watching


async def rows_left(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


async def write_groups(engine: AsyncEngine, app: OutboxApp, shard: int, groups: int) -> None:
    await write_rows(
        engine,
        app,
        [
            {
                "shard_scope": Scope.ORGANIZATION,
                "shard_identifier": shard,
                "category": Category.PROJECT_UPDATE,
                "object_identifier": n,
            }
            for n in range(groups)
        ],
    )


async def drain_in_rounds(drain: DrainEngine, app: OutboxApp, rounds: list[list[int]]) -> None:
    """One round for each list of shards, all at once (as a worker's partitions and shard
    workflows run)."""
    table = app.table()

    async def one_round(shards: list[int]) -> None:
        refs = [
            ShardRef(table.name, int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, shard)
            for shard in shards
        ]
        async with drain.locked(table, refs) as round_:
            heads = await drain.read_heads(round_, max_groups=1_000, skip_held=True)
            await drain.run(round_, heads, deadline=math.inf)

    await asyncio.gather(*(one_round(shards) for shards in rounds))


@pytest.mark.parametrize("sync", [True, False], ids=["def", "async"])
@pytest.mark.parametrize(
    ("rounds", "shards", "groups", "threads"),
    [(1, 1, 100, 2), (4, 1, 40, 5), (1, 40, 5, 2)],
    ids=["1-round", "4-rounds", "40-shards-2-threads"],
)
async def test_the_drains_handle_at_most_a_few_groups_ahead_of_their_deletes(
    engine, sync: bool, rounds: int, shards: int, groups: int, threads: int
) -> None:
    """``rounds`` rounds of ``shards`` shards each, ``groups`` groups in each shard, ``threads``
    threads for the plain-def handlers."""
    app, calls = await counting_app(engine, sync=sync)
    table = app.table().name
    plan = [[r * shards + n + 1 for n in range(shards)] for r in range(rounds)]
    for shard in (shard for round_shards in plan for shard in round_shards):
        await write_groups(engine, app, shard, groups)
    handlers = HandlerCalls(app, redact_errors=False, threads=threads)
    try:
        async with most_ahead(engine, table, calls) as most:
            drain = DrainEngine(engine, app, calls=handlers, max_undeleted_groups=LIMIT)
            await drain_in_rounds(drain, app, plan)
    finally:
        handlers.close()
    assert len(calls) == rounds * shards * groups
    assert await rows_left(engine, table) == 0
    # The bound, and the calls that other threads had under way when it was reached.
    assert 0 < most[0] <= LIMIT + threads - 1, f"{most[0]} groups handled ahead of their delete"


async def test_the_bound_is_the_workers_setting(engine) -> None:
    """``max_undeleted_groups`` sets the bound: an async handler in one shard (one call under
    way at a time) runs at most that many groups ahead of the deletes."""
    app, calls = await counting_app(engine, sync=False)
    table = app.table().name
    await write_groups(engine, app, 1, 20)
    settings = OutboxSettings(max_undeleted_groups=3)
    drains = build_drains(engine, app, settings)
    assert drains.engine.max_undeleted_groups == 3
    try:
        async with most_ahead(engine, table, calls) as most:
            await drain_in_rounds(drains.engine, app, [[1]])
    finally:
        drains.close()
    assert len(calls) == 20
    assert await rows_left(engine, table) == 0
    assert 0 < most[0] <= 3, f"{most[0]} groups handled ahead of their delete"


async def test_by_default_plain_def_drains_run_only_their_threads_ahead(engine) -> None:
    """With every handler plain def, the calls at once are the handler threads, and so is the
    default bound: 2 threads run at most 2 groups ahead of the deletes (and 1 call under way)."""
    app, calls = await counting_app(engine, sync=True)
    table = app.table().name
    await write_groups(engine, app, 1, 30)
    handlers = HandlerCalls(app, redact_errors=False, threads=2)
    try:
        drain = DrainEngine(engine, app, calls=handlers)
        assert drain.max_undeleted_groups == 2
        async with most_ahead(engine, table, calls) as most:
            await drain_in_rounds(drain, app, [[1]])
    finally:
        handlers.close()
    assert len(calls) == 30
    assert await rows_left(engine, table) == 0
    assert 0 < most[0] <= 2 + 2 - 1, f"{most[0]} groups handled ahead of their delete"


async def test_by_default_async_calls_go_on_while_a_delete_is_under_way(engine) -> None:
    """A delete that does not return holds no async call back below the calls the worker can
    run at once: all 30 groups of a shard are handled while the round's first delete waits,
    and they go out in one further statement (pipelined, not a round trip per group)."""
    table = unique_table()
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(table)])
    calls: list[int] = []

    async def handle(message: OutboxMessage) -> None:
        calls.append(message.id)

    app.handler(*Category)(handle)
    await create_tables(engine, app)
    gate = (48_151, 62_342)  # an advisory lock the deletes wait for, not a shard's
    async with engine.begin() as conn:
        await conn.execute(text(f"CREATE SEQUENCE {table}_deletes"))
        await conn.execute(
            text(
                f"CREATE FUNCTION {table}_gated() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"PERFORM nextval('{table}_deletes'); PERFORM pg_advisory_lock_shared{gate}; "
                f"PERFORM pg_advisory_unlock_shared{gate}; RETURN NULL; END $$"
            )
        )
        await conn.execute(
            text(
                f"CREATE TRIGGER {table}_gated BEFORE DELETE ON {table} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {table}_gated()"
            )
        )
    await write_groups(engine, app, 1, 30)
    handlers = HandlerCalls(app, redact_errors=False, threads=2)
    drain = DrainEngine(engine, app, calls=handlers)
    try:
        async with engine.connect() as holder:
            await holder.execute(text(f"SELECT pg_advisory_lock{gate}"))
            draining = asyncio.create_task(drain_in_rounds(drain, app, [[1]]))
            try:
                await wait_until(lambda: len(calls) == 30, timeout=60, what="30 calls")
            finally:
                await holder.execute(text(f"SELECT pg_advisory_unlock{gate}"))
            await draining
    finally:
        handlers.close()
    assert await rows_left(engine, table) == 0
    async with engine.connect() as conn:
        statements = (await conn.execute(text(f"SELECT last_value FROM {table}_deletes"))).scalar()
    assert statements in (1, 2), f"{statements} delete statements for 30 groups"


async def test_a_round_unlocks_each_shard_once(engine) -> None:
    """A shard unlocked at the end of its groups is not unlocked again when the round ends
    while that unlock is under way (PostgreSQL warned "you don't own a lock of type
    ExclusiveLock" once per round in the server log)."""
    app, calls = await counting_app(engine, sync=False)
    table = app.table()
    for shard in (1, 2):
        await write_groups(engine, app, shard, 5)
    refs = [
        ShardRef(table.name, int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, shard)
        for shard in (1, 2)
    ]
    handlers = HandlerCalls(app, redact_errors=False, threads=2)
    drain = DrainEngine(engine, app, calls=handlers)
    notices: list[str] = []
    try:
        async with drain.locked(table, refs) as round_:
            raw = (await round_.conn.get_raw_connection()).driver_connection
            assert raw is not None
            raw.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
            heads = await drain.read_heads(round_, max_groups=1_000, skip_held=True)
            await drain.run(round_, heads, deadline=math.inf)
    finally:
        handlers.close()
    assert len(calls) == 10
    assert await rows_left(engine, table.name) == 0
    assert notices == []
