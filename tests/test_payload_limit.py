"""The payload limit (max_payload_bytes): a larger payload is refused at write, and a row written
past the producer (plain SQL) is never read whole by the worker: its shard blocks on it with
PayloadTooLargeError while the others drain, until the limit is raised (or the group parked).

Sizes are the UTF-8 bytes of the payload's JSON text: ``{"b": "<n characters>"}`` takes n + 9.
The worker's peak memory beside 100 MB rows is in tests/faults/test_memory.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import Row, Table, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.orm import Session

from outbox_bridge import InvalidRowError, OutboxApp, OutboxSettings, PayloadTooLargeError
from outbox_bridge.config import DEFAULT_MAX_PAYLOAD_BYTES
from outbox_bridge.db.reads import read_rows as store_read_rows
from outbox_bridge.producer import RowSpec
from outbox_bridge.registry import OutboxTable
from outbox_bridge.runtime import heads as heads_module
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.payload_budget import PayloadBudget
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    SCOPES,
    Category,
    Recorder,
    count_rows,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    unique_table,
    wait_until,
)
from tests.test_cli_shards import cli

LIMIT = 4096
OVERHEAD = len(json.dumps({"b": ""}))  # 9


def blob(size: int) -> dict[str, str]:
    """A payload whose JSON text takes ``size`` bytes."""
    return {"b": "x" * (size - OVERHEAD)}


def small_app(limit: int = LIMIT) -> OutboxApp:
    return OutboxApp(
        scopes=SCOPES,
        categories=[Category],
        tables=[OutboxTable(unique_table())],
        max_payload_bytes=limit,
    )


def spec(payload: Any) -> RowSpec:
    return RowSpec(Category.PROJECT_UPDATE, 7, 5, payload)


# -- the limit --------------------------------------------------------------------------------------


def test_the_limit_is_1_mib_by_default_and_bounded() -> None:
    assert OutboxApp(scopes=SCOPES).max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 2**20
    for wrong in (1023, 2**28 + 1, True, 1.5, "1MB"):
        with pytest.raises(Exception, match="max_payload_bytes must be"):
            OutboxApp(scopes=SCOPES, max_payload_bytes=wrong)  # type: ignore[arg-type]
    assert OutboxSettings(max_payload_bytes=2**28).max_payload_bytes == 2**28
    assert OutboxSettings().max_payload_bytes is None  # the app's
    for wrong in (1023, 2**28 + 1):
        with pytest.raises(ValidationError, match="max_payload_bytes"):
            OutboxSettings(max_payload_bytes=wrong)


def test_a_payload_at_the_limit_is_written_and_one_byte_over_is_refused() -> None:
    app = small_app()
    assert app.prepare(spec(blob(LIMIT))).statement is not None
    with pytest.raises(PayloadTooLargeError) as refused:
        app.prepare(spec(blob(LIMIT + 1)))
    assert isinstance(refused.value, InvalidRowError)
    message = str(refused.value)
    assert "the payload of PROJECT_UPDATE for object 5 is 4 KiB (4,097 bytes)" in message
    assert "over the limit of 4 KiB (4,096 bytes) (max_payload_bytes)" in message
    assert "put its key in the payload" in message and "xxxx" not in message


def test_the_size_is_the_utf8_bytes_of_the_json_text() -> None:
    app = small_app()
    two_bytes = {"b": "é" * ((LIMIT - OVERHEAD) // 2)}  # 2 bytes each in UTF-8: 4,095 in all
    app.prepare(spec(two_bytes))
    with pytest.raises(PayloadTooLargeError, match="4,097 bytes"):
        app.prepare(spec({"b": "é" * ((LIMIT - OVERHEAD) // 2 + 1)}))


async def test_sync_and_async_writes_refuse_it_and_write_nothing(engine, sync_engine) -> None:
    app = small_app()
    await create_tables(engine, app)
    with Session(sync_engine) as session:
        with pytest.raises(PayloadTooLargeError):
            app.write(session, **vars(spec(blob(LIMIT + 1))))
        app.write(session, **vars(spec(blob(LIMIT))))  # the transaction goes on
        session.commit()
    async with engine.begin() as conn:
        with pytest.raises(PayloadTooLargeError):
            await app.write_async(conn, **vars(spec(blob(10 * LIMIT))))
        await app.write_async(conn, **vars(spec(None)))
    assert await count_rows(engine, app) == 2


# -- the worker's budget of payload bytes -------------------------------------------------------------


async def test_rounds_wait_for_room_in_the_payload_budget() -> None:
    budget = PayloadBudget(30)
    await budget.take(20)
    second = asyncio.create_task(budget.take(20))
    await asyncio.sleep(0)
    assert not second.done() and budget.used == 20  # 40 would be over 30: it waits
    budget.add(-5)  # the first round read less than it took
    await asyncio.sleep(0)
    assert not second.done()
    budget.give(15)
    await asyncio.wait_for(second, timeout=5)
    assert budget.used == 20
    budget.give(20)
    await budget.take(100)  # alone, a round may go over the budget
    assert budget.used == 100


# -- the worker --------------------------------------------------------------------------------------


async def insert_sql(engine: AsyncEngine, table: str, shard: int, size: int, obj: int = 1) -> int:
    """A row written past the producer, its payload built in SQL: ``size`` bytes of JSON text."""
    async with engine.begin() as conn:
        return int(
            (
                await conn.execute(
                    text(
                        f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                        "object_identifier, payload) VALUES (1, :shard, :category, :obj, "
                        "jsonb_build_object('b', repeat('x', :chars))) RETURNING id"
                    ),
                    {
                        "shard": shard,
                        "category": int(Category.PROJECT_UPDATE),
                        "obj": obj,
                        "chars": size - OVERHEAD,
                    },
                )
            ).scalar_one()
        )


async def test_a_row_just_over_the_limit_blocks_its_shard_unread(engine, monkeypatch) -> None:
    """In one round: the shard whose head is one byte over the limit fails with
    PayloadTooLargeError and keeps its rows; the row at the limit and a small one in other
    shards are handled; no payload over the limit is ever sent to the worker. Alone (a shard
    workflow's call: one group, no sizing statement) it fails the same way; a worker with a
    higher limit handles it."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    at_limit = await insert_sql(engine, table, 1, LIMIT)
    over = await insert_sql(engine, table, 2, LIMIT + 1)
    after_over = await insert_sql(engine, table, 2, 20, obj=2)
    small = await insert_sql(engine, table, 3, 20)
    sent: list[int] = []

    async def read_rows(
        conn: AsyncConnection, table: Table, ids: list[int], **options: Any
    ) -> dict[int, Row[Any]]:
        found = await store_read_rows(conn, table, ids, **options)
        sent.extend(len(row.payload) for row in found.values() if row.payload is not None)
        return found

    monkeypatch.setattr(heads_module, "read_rows", read_rows)
    shards = [ShardRef(table, 1, "ORGANIZATION", n) for n in (1, 2, 3)]

    async def one_round(limit: int, of: list[ShardRef], max_groups: int = 100) -> dict[int, Any]:
        calls = HandlerCalls(app, redact_errors=False, threads=1, max_payload_bytes=limit)
        drains = DrainEngine(engine, app, calls=calls)
        try:
            async with drains.locked(app.table(), of) as locked:
                heads = await drains.read_heads(locked, max_groups=max_groups, skip_held=True)
                outcomes = await drains.run(locked, heads, deadline=math.inf)
        finally:
            calls.close()
        return {outcome.shard.shard_identifier: outcome for outcome in outcomes}

    outcomes = await one_round(LIMIT, shards)
    assert sorted(recorder.ids()) == [at_limit, small]
    assert sent and max(sent) == LIMIT
    failed = outcomes[2]
    assert failed.failure is not None and failed.failed is not None
    assert failed.failure.error_type == "PayloadTooLargeError"
    assert failed.failed.last_id == over and failed.groups_handled == 0
    message = failed.failure.message
    assert f"row {over}'s payload is 4 KiB (4,097 bytes), over the limit of 4 KiB" in message
    assert "(max_payload_bytes), so it is not read" in message
    assert "outbox-bridge park ORGANIZATION:2 --reason" in message
    assert "OUTBOX_MAX_PAYLOAD_BYTES" in message

    sent.clear()
    alone = await one_round(LIMIT, [shards[1]], max_groups=1)
    failure = alone[2].failure
    assert failure is not None and failure.error_type == "PayloadTooLargeError"
    assert sent == [] and await count_rows(engine, app) == 2

    await one_round(2 * LIMIT, [shards[1]])
    assert recorder.ids()[-2:] == [over, after_over]
    assert await count_rows(engine, app) == 0


async def test_the_worker_shows_why_and_a_worker_with_a_higher_limit_handles_it(
    servers, engine
) -> None:
    """Through a real worker: the shard is blocked with the reason that ``status`` and
    ``shards`` show while another shard drains; restarted with OUTBOX_MAX_PAYLOAD_BYTES above
    the row's size, the worker handles it on the shard workflow's next retry."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    big = 2**20 + 1
    async with running_worker(servers, app, fast_settings(max_retry_interval=1.0)) as settings:
        over = await insert_sql(engine, table, 20, big)
        healthy = await insert_sql(engine, table, 21, 100)
        await wait_until(lambda: healthy in recorder.ids(), timeout=60, what="the healthy shard")
        shown: dict[str, Any] = {}

        async def shown_blocked() -> bool:
            code, out, _ = await cli(servers, table, "status", "ORGANIZATION:20", "--json")
            if code == 0:
                shown.update(json.loads(out))
            return code == 0 and shown["state"] == "blocked" and bool(shown["last_error"])

        await wait_until(shown_blocked, timeout=60, interval=0.5, what="the shard blocked")
        error = shown["last_error"]
        assert error["error_type"] == "PayloadTooLargeError"
        assert f"row {over}'s payload is 1 MiB (1,048,577 bytes)" in error["message"]
        code, out, err = await cli(servers, table, "shards", "--json")
        assert code == 0, err
        listed = {entry["shard"]: entry for entry in json.loads(out)}
        assert listed["ORGANIZATION:20"]["state"] == "blocked"
    assert over not in recorder.ids()
    raised = settings.model_copy(update={"max_payload_bytes": 2 * big})  # same task queue
    async with running_worker(servers, app, raised):
        await wait_until(lambda: over in recorder.ids(), timeout=60, what="the raised limit")
    assert await count_rows(engine, app) == 0
