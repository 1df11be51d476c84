"""Who drains a shard is one row of ``<table>_owners``, moved between its states by one
statement per transition (``outbox_bridge/db/ownership.py``) under the shard's lock (docs: How
processing works, Ownership). Each transition, and what a crash in the middle of it leaves,
checked against the real PostgreSQL (and a real worker for the repairs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.db import ownership
from outbox_bridge.db.locks import lock_key, lock_shard_waiting
from outbox_bridge.runtime.assembly import build_drains
from outbox_bridge.runtime.shard_drain import ShardDrainer
from outbox_bridge.runtime.shards import WORKFLOW, shard_status
from outbox_bridge.workflows.models import (
    DrainInput,
    HeldFor,
    HoldInput,
    PartitionInput,
    PartitionRef,
    ShardInput,
    ShardRef,
    ShardState,
)
from tests.harness import (
    Category,
    Recorder,
    count_rows,
    fast_settings,
    fresh_app,
    lock_holders,
    record_holder,
    running_worker,
    sql,
    table_empty,
    wait_until,
    write_rows,
)

SHARD_ID = 51


def shard_of(table: str) -> ShardRef:
    return ShardRef(table, 1, "ORGANIZATION", SHARD_ID)


async def holder(engine: AsyncEngine, table: str, shard: int = SHARD_ID) -> str | None:
    """Why the shard's workflow holds it, or None: its partition drains it."""
    async with engine.connect() as conn:
        found = await conn.execute(
            text(f"SELECT held_for FROM {table}_owners WHERE shard_identifier = :id"),
            {"id": shard},
        )
        row = found.first()
    return None if row is None else str(row[0])


async def one_row(engine: AsyncEngine, app: OutboxApp, obj: int = 1) -> None:
    await write_rows(
        engine,
        app,
        [
            {
                "category": Category.PROJECT_UPDATE,
                "shard_identifier": SHARD_ID,
                "object_identifier": obj,
            }
        ],
    )


@pytest.fixture
async def drainer(
    engine: AsyncEngine,
) -> AsyncIterator[tuple[ShardDrainer, OutboxApp, str, Recorder]]:
    recorder, table, app = await fresh_app(engine)
    drains = build_drains(engine, app, fast_settings())
    try:
        yield drains.shards, app, table, recorder
    finally:
        drains.close()


# -- the transitions, one statement each ---------------------------------------------------------


async def test_hand_over_moves_only_free_shards(engine) -> None:
    _, table, app = await fresh_app(engine)
    held, free = shard_of(table), ShardRef(table, 1, "ORGANIZATION", SHARD_ID + 1)
    await record_holder(engine, table, SHARD_ID, HeldFor.WORKFLOW.value)
    async with engine.begin() as conn:
        moved = await ownership.hand_over(conn, app.table(table), [held, free], HeldFor.FAILED)
    assert moved == [free]
    assert await holder(engine, table) == HeldFor.WORKFLOW  # its workflow keeps it
    assert await holder(engine, table, SHARD_ID + 1) == HeldFor.FAILED


@pytest.mark.parametrize("before", [None, HeldFor.FAILED, HeldFor.DEFERRED, HeldFor.WORKFLOW])
async def test_take_holds_a_free_or_held_shard_for_the_workflow(engine, before) -> None:
    _, table, app = await fresh_app(engine)
    if before is not None:
        await record_holder(engine, table, SHARD_ID, before.value)
    async with engine.begin() as conn:
        assert await ownership.take(conn, app.table(table), shard_of(table))
    assert await holder(engine, table) == HeldFor.WORKFLOW


async def test_take_leaves_a_skip_and_says_so(engine) -> None:
    """A drain that started before the skip was recorded never undoes it."""
    _, table, app = await fresh_app(engine)
    await record_holder(engine, table, SHARD_ID, HeldFor.SKIPPED.value)
    async with engine.begin() as conn:
        assert not await ownership.take(conn, app.table(table), shard_of(table))
    assert await holder(engine, table) == HeldFor.SKIPPED


@pytest.mark.parametrize("before", [None, HeldFor.FAILED, HeldFor.SKIPPED])
async def test_skip_replaces_any_state(engine, before) -> None:
    _, table, app = await fresh_app(engine)
    if before is not None:
        await record_holder(engine, table, SHARD_ID, before.value)
    async with engine.begin() as conn:
        assert await ownership.skip(conn, app.table(table), shard_of(table))
    assert await holder(engine, table) == HeldFor.SKIPPED


async def test_resume_moves_only_a_skipped_shard(engine) -> None:
    _, table, app = await fresh_app(engine)
    outbox, shard = app.table(table), shard_of(table)
    async with engine.begin() as conn:
        assert not await ownership.resume(conn, outbox, shard)  # free: left free
    assert await holder(engine, table) is None
    await record_holder(engine, table, SHARD_ID, HeldFor.FAILED.value)
    async with engine.begin() as conn:
        assert not await ownership.resume(conn, outbox, shard)  # held: keeps its reason
    assert await holder(engine, table) == HeldFor.FAILED
    async with engine.begin() as conn:
        await ownership.skip(conn, outbox, shard)
        assert await ownership.resume(conn, outbox, shard)
    assert await holder(engine, table) == HeldFor.WORKFLOW


async def test_release_frees_a_held_shard_never_a_skipped_one(engine) -> None:
    _, table, app = await fresh_app(engine)
    outbox, shard = app.table(table), shard_of(table)
    async with engine.begin() as conn:
        assert not await ownership.release(conn, outbox, shard)  # free already
        await ownership.skip(conn, outbox, shard)
        assert not await ownership.release(conn, outbox, shard)  # only a resume ends a skip
    assert await holder(engine, table) == HeldFor.SKIPPED
    async with engine.begin() as conn:
        assert await ownership.resume(conn, outbox, shard)
        assert await ownership.release(conn, outbox, shard)
    assert await holder(engine, table) is None


async def test_a_connection_killed_between_take_and_release_leaves_the_shard_held(
    engine, drainer
) -> None:
    """A drain's connection dies after it took the shard and before it gave it back: its lock
    goes with the session, the row stays (the workflow's next drain finishes the work)."""
    shards, app, table, _ = drainer
    await one_row(engine, app)
    shard = shard_of(table)
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        assert await lock_shard_waiting(conn, shard, 5)
        assert await ownership.take(conn, app.table(table), shard)
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await sql(engine, "SELECT pg_terminate_backend(:pid)", pid=pid)
        with pytest.raises(DBAPIError):
            await ownership.release(conn, app.table(table), shard)
        await conn.invalidate()
    assert await lock_holders(engine, lock_key(shard)) == []
    assert await holder(engine, table) == HeldFor.WORKFLOW
    assert await count_rows(engine, app) == 1
    result = await shards.drain(DrainInput(shard))
    assert (result.rows_handled, result.released) == (1, True)
    assert await holder(engine, table) is None


# -- the workflow's drain -------------------------------------------------------------------------


async def test_a_drain_holds_the_shard_and_gives_it_back_once_empty(engine, drainer) -> None:
    shards, app, table, _ = drainer
    await one_row(engine, app)
    result = await shards.drain(DrainInput(shard_of(table)))
    assert (result.rows_handled, result.released) == (1, True)
    assert await holder(engine, table) is None
    assert await table_empty(engine, app)


async def test_a_drain_that_meets_a_failure_keeps_the_shard_held(engine, drainer) -> None:
    shards, app, table, recorder = drainer

    async def failing(message: OutboxMessage) -> None:
        raise ConnectionError("replica down")

    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    await one_row(engine, app)
    result = await shards.drain(DrainInput(shard_of(table)))
    assert result.failed is not None and not result.released
    assert await holder(engine, table) == HeldFor.WORKFLOW
    assert await count_rows(engine, app) == 1


async def test_a_drain_after_the_skip_was_recorded_handles_nothing(engine, drainer) -> None:
    shards, app, table, _ = drainer
    await one_row(engine, app)
    await shards.hold(HoldInput(shard_of(table), HeldFor.SKIPPED))
    result = await shards.drain(DrainInput(shard_of(table)))
    assert result.rows_handled == 0
    assert await holder(engine, table) == HeldFor.SKIPPED  # neither taken nor given back
    assert await count_rows(engine, app) == 1
    await shards.hold(HoldInput(shard_of(table), HeldFor.WORKFLOW))  # resumed
    result = await shards.drain(DrainInput(shard_of(table)))
    assert (result.rows_handled, result.released) == (1, True)
    assert await holder(engine, table) is None


# -- a crash between a hold and the workflow's start: the sweep repairs it -------------------------


@pytest.mark.parametrize("held_for", [HeldFor.FAILED, HeldFor.DEFERRED, HeldFor.WORKFLOW])
async def test_a_shard_held_with_no_workflow_is_drained_by_a_workflow_the_sweep_starts(
    servers, engine, held_for: HeldFor
) -> None:
    """A partition recorded the hold and died before its handover reached Temporal (or a flush
    started the workflow, which was lost): the table says a workflow holds the shard, and the
    next sweep makes Temporal match it."""
    recorder, table, app = await fresh_app(engine)
    await one_row(engine, app)
    await record_holder(engine, table, SHARD_ID, held_for.value)
    async with running_worker(servers, app):
        await wait_until(lambda: table_empty(engine, app), what="the held shard drained")
        await wait_until(
            lambda: _given_back(engine, table), what="the shard given back to its partition"
        )
    assert [c.object_identifier for c in recorder.calls] == [1]


async def _given_back(engine: AsyncEngine, table: str) -> bool:
    return await holder(engine, table) is None


async def test_a_skip_recorded_with_no_workflow_comes_back_skipped(servers, engine, client) -> None:
    recorder, table, app = await fresh_app(engine)
    await one_row(engine, app)
    await record_holder(engine, table, SHARD_ID, "skipped")
    shard = shard_of(table)

    async def skipped() -> bool:
        try:
            return (await shard_status(client, shard)).state == ShardState.SKIPPED
        except Exception:  # no workflow yet
            return False

    async with running_worker(servers, app):
        await wait_until(skipped, what="the shard's workflow started skipped")
        status = await shard_status(client, shard)
    assert status.skip is not None and "owner table" in status.skip.reason
    assert recorder.calls == []
    assert await count_rows(engine, app) == 1
    assert await holder(engine, table) == HeldFor.SKIPPED


# -- workflows left on another task queue ---------------------------------------------------------


async def test_partitions_and_shards_left_on_a_task_queue_nobody_polls_are_taken_over(
    servers, engine, client, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker on a renamed task queue, against a server that kept the table's workflows from
    the earlier setup: it takes them over (with a warning) instead of handling nothing."""
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings()
    gone = f"renamed-{table}"
    for ref in (PartitionRef(table, n, settings.partitions) for n in range(settings.partitions)):
        await client.start_workflow(
            "OutboxPartition", PartitionInput(ref), id=ref.workflow_id, task_queue=gone
        )
    await record_holder(engine, table, SHARD_ID, "failed")
    await client.start_workflow(
        WORKFLOW, ShardInput(shard_of(table)), id=shard_of(table).workflow_id, task_queue=gone
    )
    await one_row(engine, app)  # held: its workflow drains it
    await write_rows(  # healthy: a partition drains it
        engine,
        app,
        [{"category": Category.PROJECT_UPDATE, "shard_identifier": 52, "object_identifier": 2}],
    )
    with caplog.at_level("WARNING", logger="outbox_bridge"):
        async with running_worker(servers, app, settings):
            await wait_until(lambda: table_empty(engine, app), what="both shards drained")
    assert sorted(c.object_identifier for c in recorder.calls) == [1, 2]
    taken = [r.getMessage() for r in caplog.records if "which no worker polls" in r.getMessage()]
    assert any("partition" in m for m in taken) and any("shard workflow" in m for m in taken)
