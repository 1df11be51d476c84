"""Hostile conditions at the edges of reading and writing rows, against a real PostgreSQL (and
Temporal where a worker runs):

- a deep shard's head is read from its first rows, never by aggregating the whole shard;
- a deferred row committed while a round reads its head never runs early, and nothing passes it;
- PostgreSQL's clock behind Temporal's never makes a deferred shard spin, nor run early;
- a handler's huge exception message blocks its shard, and Temporal keeps a bounded part of it;
- a round whose unlock failed never leaves its shard locked for good.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import Table, text
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.db import reads
from outbox_bridge.db.locks import lock_key
from outbox_bridge.runtime import heads as heads_module
from outbox_bridge.runtime.calls import MAX_ERROR_MESSAGE, HandlerCalls
from outbox_bridge.runtime.round_writes import Round
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.runtime.shards import parse_shard, shard_status
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    lock_holders,
    running_worker,
    sql,
    table_empty,
    wait_until,
    write_rows,
)


def row(category: Category, shard: int, obj: int, **extra: object) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


def shard_of(table: str, shard: int) -> ShardRef:
    return ShardRef(table, 1, "ORGANIZATION", shard)


@pytest.fixture
def drains(engine: Any) -> Iterator[Callable[[OutboxApp], DrainEngine]]:
    """Makes a drain engine for an app, as a worker's drains share one."""
    made: list[HandlerCalls] = []

    def make(app: OutboxApp) -> DrainEngine:
        made.append(HandlerCalls(app, redact_errors=False, threads=2))
        return DrainEngine(engine, app, calls=made[-1])

    yield make
    for calls in made:
        calls.close()


# -- a deep shard's head ---------------------------------------------------------------------------

DEEP = 20_000


async def tuples_read(conn: AsyncConnection, table: str) -> int:
    """Heap and index tuples this transaction has read of ``table`` (its own statistics,
    counted before they are reported)."""
    result = await conn.execute(
        text(
            "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(c.oid) "
            "+ pg_stat_get_xact_tuples_fetched(c.oid)), 0) FROM pg_class c "
            "WHERE c.oid = CAST(:t AS regclass) "
            "OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = CAST(:t AS regclass))"
        ),
        {"t": table},
    )
    return int(result.scalar_one())


async def test_a_deep_shard_s_head_is_read_from_its_first_rows(engine, drains) -> None:
    """20,000 pending rows in one shard, each a group of its own: reading the head of the
    shard for a round touches about as many rows as the round takes, not the whole shard."""
    _, table, app = await fresh_app(engine)
    await sql(
        engine,
        f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier) "
        "SELECT 1, 7, :category, g FROM generate_series(1, :n) g",
        category=int(Category.PROJECT_UPDATE),
        n=DEEP,
    )
    await sql(engine, f"ANALYZE {table}")
    drain = drains(app)
    async with engine.connect() as conn:  # one transaction: its statistics count only this
        round_ = Round(conn, app.table(), [shard_of(table, 7)])
        [head] = await drain.read_heads(round_, max_groups=10, skip_held=True)
        read = await tuples_read(conn, table)
    assert [g.object_identifier for g in head.groups] == list(range(1, 11))
    assert head.more
    assert 10 <= read <= 200, f"{read} tuples read for a head of 10 groups"


# -- a deferred row committed during a round's read ---------------------------------------------------


async def test_a_deferred_row_committed_while_a_round_reads_the_head_never_runs_early(
    engine, drains, monkeypatch
) -> None:
    """A round reads a shard's first rows, then the rest of its head groups. In between, a row
    of the head group, deferred for an hour, commits, and after it a due row of the same group:
    the round runs the head group with the row it had (the due row behind the deferred one
    does not pass it), and the deferred row stays until it is due."""
    recorder, table, app = await fresh_app(engine)
    # The head group, then enough other groups to fill the round's window: the head group may
    # go on past the window, so the round looks for the rest of it.
    [head, *others] = await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 8, obj) for obj in range(1, 40)]
    )
    committed: list[int] = []
    real_tails = reads.read_group_tails

    async def tails_after_a_commit(conn: AsyncConnection, table_: Table, tails: Any) -> Any:
        if not committed:
            committed.extend(
                await write_rows(
                    engine,
                    app,
                    [
                        row(
                            Category.PROJECT_UPDATE,
                            8,
                            1,
                            scheduled_for=datetime.now(UTC) + timedelta(hours=1),
                        ),
                        row(Category.PROJECT_UPDATE, 8, 1),
                    ],
                )
            )
        return await real_tails(conn, table_, tails)

    monkeypatch.setattr(heads_module, "read_group_tails", tails_after_a_commit)
    drain = drains(app)
    async with drain.locked(app.table(), [shard_of(table, 8)]) as round_:
        heads = await drain.read_heads(round_, max_groups=1, skip_held=True)
        await drain.run(round_, heads, deadline=math.inf)
    deferred, behind = committed
    assert recorder.ids() == [head]  # with its own row, not the one behind the deferred row
    async with engine.connect() as conn:
        left = await conn.execute(text(f"SELECT id FROM {table} ORDER BY id"))
        assert list(left.scalars()) == [*others, deferred, behind]


# -- PostgreSQL's clock behind Temporal's ------------------------------------------------------------

SKEW = 8.0  # seconds PostgreSQL's clock is behind Temporal's, as the worker sees it


async def clock_behind_url(engine: Any, url: str) -> str:
    """``url`` for a session whose ``now()`` is SKEW seconds behind: a schema ahead of
    pg_catalog in the search path shadows the function."""
    await sql(engine, "CREATE SCHEMA IF NOT EXISTS clock_behind")
    await sql(
        engine,
        "CREATE OR REPLACE FUNCTION clock_behind.now() RETURNS timestamptz LANGUAGE sql STABLE "
        f"AS $$ SELECT pg_catalog.now() - interval '{SKEW} seconds' $$",
    )
    options = quote("-csearch_path=clock_behind,pg_catalog,public")  # no space: "+" in a URL
    return f"{url}{'&' if '?' in url else '?'}options={options}"


async def test_a_database_clock_behind_temporal_s_never_makes_a_deferred_shard_spin(
    servers, engine, client: Client
) -> None:
    """A row is due in 2 s by Temporal's clock, in 2 + 8 s by the database's (which decides):
    the shard waits once for what the database says, instead of draining again and again
    while Temporal's clock says the row is due, and the row runs no earlier than that."""
    recorder, _, app = await fresh_app(engine)
    handled_at: list[float] = []

    async def stamped(message: OutboxMessage) -> None:
        handled_at.append(time.time())

    recorder.behaviour[Category.PROJECT_UPDATE] = stamped
    skewed = replace(servers, database_url=await clock_behind_url(engine, servers.database_url))
    settings = fast_settings()
    due = datetime.now(UTC) + timedelta(seconds=2)
    async with running_worker(skewed, app, settings):
        await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 9, 1, scheduled_for=due)])
        await wait_until(lambda: table_empty(engine, app), timeout=40, what="the deferred row")
    assert handled_at and handled_at[0] >= due.timestamp() + SKEW - 0.5
    shard = parse_shard("ORGANIZATION:9", app)
    history = await client.get_workflow_handle(shard.workflow_id).fetch_history()
    drains = [
        e
        for e in history.events
        if e.event_type
        in (
            EventType.EVENT_TYPE_MARKER_RECORDED,  # a local drain
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
        )
    ]
    assert len(drains) <= 4, f"{len(drains)} drains for one deferred row"


# -- a huge exception message -------------------------------------------------------------------------

HUGE = 200_000


async def test_a_huge_error_message_blocks_its_shard_and_temporal_keeps_it_bounded(
    servers, engine, client: Client
) -> None:
    """A handler raises an exception whose message is 200,000 characters: its shard blocks
    like on any failure, the status shows the error's class and the start of its message, and
    no event of any workflow of the worker holds more than MAX_ERROR_MESSAGE characters of it
    (without --redact-errors). Once the handler succeeds, the shard goes on."""
    recorder, _, app = await fresh_app(engine)
    failing = True

    async def huge(message: OutboxMessage) -> None:
        if failing:
            raise ValueError("x" * HUGE)

    recorder.behaviour[Category.PROJECT_UPDATE] = huge
    settings = fast_settings(max_retry_interval=0.5)
    ids = await write_rows(
        engine,
        app,
        [row(Category.PROJECT_UPDATE, 10, 1), row(Category.ORGANIZATION_UPDATE, 10, 2)],
    )
    shard = parse_shard("ORGANIZATION:10", app)

    async def blocked_a_while() -> bool:
        try:
            status = await shard_status(client, shard)
        except Exception:
            return False
        return status.state == "blocked" and status.attempts >= 3

    async with running_worker(servers, app, settings):
        await wait_until(blocked_a_while, what="the blocked shard, retried")
        status = await shard_status(client, shard)
        assert recorder.calls == []
        assert status.last_error is not None and status.last_error.error_type == "ValueError"
        assert status.last_error.message.startswith("x" * 100)
        assert MAX_ERROR_MESSAGE <= len(status.last_error.message) < MAX_ERROR_MESSAGE + 100
        too_long = b"x" * (MAX_ERROR_MESSAGE + 1)
        workflows = [
            w.id async for w in client.list_workflows(f"TaskQueue = '{settings.task_queue}'")
        ]
        assert shard.workflow_id in workflows
        for workflow_id in workflows:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
            for event in history.events:
                assert too_long not in event.SerializeToString(), (workflow_id, event.event_id)
        failing = False
        await wait_until(lambda: table_empty(engine, app), timeout=30, what="the unblocked shard")
    assert recorder.ids() == ids


# -- an unlock that failed ------------------------------------------------------------------------------


async def test_a_round_whose_delete_failed_holds_the_shard_and_leaves_no_lock_behind(
    engine, drains
) -> None:
    """A round's last writes (delete the handled rows, then unlock) and the delete fails: here
    another transaction holds the handled row and the round's lock_timeout gives up. The
    round does not fail: the shard is held for its workflow with why, its lock is released
    (no connection holds it afterwards), and its workflow's next drain handles the row again
    (at least once)."""
    recorder, table, app = await fresh_app(engine)
    [row_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 11, 1)])
    shard = shard_of(table, 11)
    drain = drains(app)
    async with engine.connect() as holder:
        await holder.execute(
            text(f"SELECT id FROM {table} WHERE id = :id FOR UPDATE"), {"id": row_id}
        )
        async with drain.locked(app.table(), [shard]) as round_:
            await round_.execute(lambda c: c.execute(text("SET lock_timeout = '200ms'")))
            heads = await drain.read_heads(round_, max_groups=10, skip_held=True)
            [outcome] = await drain.run(round_, heads, deadline=math.inf)
        await holder.rollback()
    assert recorder.ids() == [row_id]
    assert outcome.failure is not None and outcome.failure.error_type == "ShardFaultError"
    assert "its handled rows cannot be deleted: LockNotAvailable" in outcome.failure.message
    assert outcome.failed is not None and outcome.failed.last_id == row_id
    assert round_.held == {shard}
    assert await lock_holders(engine, lock_key(shard)) == []
    async with drain.locked(app.table(), [shard]) as round_:
        assert list(round_.locked) == [shard]
        heads = await drain.read_heads(round_, max_groups=10, skip_held=False)
        await drain.run(round_, heads, deadline=math.inf)
    assert recorder.ids() == [row_id, row_id]
    assert await table_empty(engine, app)
