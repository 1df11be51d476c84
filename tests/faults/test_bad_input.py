"""Bad input, run through a real worker process: rows written with plain SQL that the registry
would have refused, handlers that misbehave, and malformed signals and updates.

Each one is either refused when it is written (the INSERT fails, nothing is stored), or held
with a specific error in the worker's log and on the shard's workflow (its status, as the UI
shows it), while the worker keeps running and every row stays in the table until it is
handled. Nothing is dropped silently. The "Bad input" table of docs/explanation/guarantees.md
lists the decisions.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError

from outbox_bridge.db.install import create_outbox_tables
from outbox_bridge.runtime.shards import shard_status
from outbox_bridge.workflows.models import ShardRef, ShardStatus, SkipInput
from tests.faults.bad_input_app import make_app
from tests.faults.harness import (
    WorkerProcess,
    command,
    histories_containing,
    new_table,
    new_task_queue,
    outbox_count,
    temporal_command,
    worker_env,
)
from tests.faults.history import LOG_DDL, set_control
from tests.harness import refusal, wait_until

ORG, USER = 1, 2
BIG_CANARY = "big-payload-canary-77d0"


class JsonText(str):
    """A payload given as JSON text, stored as written (Python could not encode it)."""


def ref(table: str, scope: int, shard: int, scope_name: str | None = None) -> ShardRef:
    name = scope_name or {ORG: "ORGANIZATION", USER: "USER"}[scope]
    return ShardRef(table, scope, name, shard)


async def insert(
    conn,
    table: str,
    scope: int | None,
    shard: int | None,
    category: int | None,
    obj: int | None,
    **extra,
):
    columns = ["shard_scope", "shard_identifier", "category", "object_identifier"]
    values = [":scope", ":shard", ":category", ":obj"]
    params = {"scope": scope, "shard": shard, "category": category, "obj": obj}
    for name, value in extra.items():
        columns.append(name)
        if name == "payload":
            values.append("CAST(:payload AS jsonb)")
            value = value if isinstance(value, JsonText) else json.dumps(value)
        elif name == "scheduled_for":
            values.append("CAST(:scheduled_for AS timestamptz)")
        else:
            values.append(f":{name}")
        params[name] = value
    statement = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(values)}) RETURNING id"
    )
    return (await conn.execute(text(statement), params)).scalar_one()


async def start_worker(
    database_url: str, temporal_address: str, table: str, logs: Path, **settings: str
) -> WorkerProcess:
    """A worker process of the bad-input app on ``table``, started and ready."""
    env = worker_env(
        database_url,
        temporal_address,
        table,
        new_task_queue(),
        OUTBOX_APP="tests.faults.bad_input_app:app",
        **settings,
    )
    worker = WorkerProcess(env, logs)
    worker.start()
    await worker.ready()
    return worker


async def status(client: Client, shard: ShardRef) -> ShardStatus | None:
    try:
        return await shard_status(client, shard)
    except Exception:
        return None


async def in_state(client: Client, shard: ShardRef, state: str, error: str | None = None) -> bool:
    current = await status(client, shard)
    if current is None or current.state != state:
        return False
    return error is None or (
        current.last_error is not None and current.last_error.error_type == error
    )


HELD_ERRORS = {
    "unknown category": "UnknownCategoryError",
    "other scope": "CategoryScopeError",
    "unknown scope": "CategoryScopeError",
    "SystemExit": "SystemExit",
    "KeyboardInterrupt": "KeyboardInterrupt",
    "GeneratorExit": "GeneratorExit",
    "HandlerExit": "HandlerExit",
    "async CancelledError": "CancelledError",
    "async SystemExit": "SystemExit",
    "nested 10,000 deep": "PayloadDecodeError",
    "a 5,000-digit integer": "PayloadDecodeError",
    "5 MB": "PayloadTooLargeError",  # over the 1 MiB limit: never read
}
RAISING = {113: "SystemExit", 114: "KeyboardInterrupt", 115: "GeneratorExit", 116: "HandlerExit"}


async def prepare(engine, table: str) -> None:
    app = make_app(table)
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('faults', 0))"))
        for statement in LOG_DDL:
            await conn.execute(text(statement))
        await create_outbox_tables(conn, app.metadata)
        await conn.execute(
            text("INSERT INTO fault_control (outbox_table, poison_shards) VALUES (:t, :p)"),
            {"t": table, "p": [*RAISING, 117, 118]},
        )


async def write_bad_rows(engine, table: str) -> dict[str, tuple[ShardRef, list[int]]]:
    """One shard per kind of bad input; returns each kind's shard and row ids."""
    regional = f"{table}_r"
    rows: dict[str, tuple[ShardRef, list[int]]] = {}
    async with engine.begin() as conn:

        async def add(kind: str, shard: ShardRef, *specs: tuple[int, int, dict[str, object]]):
            target = regional if shard.region else table
            ids = [
                await insert(
                    conn, target, shard.scope, shard.shard_identifier, category, obj, **extra
                )
                for category, obj, extra in specs
            ]
            rows[kind] = (shard, ids)

        await add("unknown category", ref(table, ORG, 101), (99, 1, {}))
        await add("other scope", ref(table, USER, 102), (1, 1, {}))
        await add("unknown scope", ref(table, 7, 103, "7"), (1, 1, {}))
        payloads = [[1, 2, 3], "text", 42, None, True]
        await add(
            "not objects",
            ref(table, ORG, 104),
            *((2, n, {"payload": p}) for n, p in enumerate(payloads)),
        )
        big = {"blob": "x" * (5 * 1024 * 1024), "canary": BIG_CANARY}
        await add("5 MB", ref(table, ORG, 105), (2, 1, {"payload": big}))
        await add("negative", ref(table, ORG, -106), (2, -7, {}))
        await add(
            "year 9999",
            ref(table, ORG, 107),
            (2, 1, {"scheduled_for": "9999-12-31T00:00:00Z"}),
            (1, 2, {}),
        )
        await add(
            "infinity", ref(table, ORG, 108), (2, 1, {"scheduled_for": "infinity"}), (1, 2, {})
        )
        await add("1970", ref(table, ORG, 109), (2, 1, {"scheduled_for": "1970-01-01T00:00:00Z"}))
        await add("-infinity", ref(table, ORG, 110), (2, 1, {"scheduled_for": "-infinity"}))
        await add("returns", ref(table, ORG, 112), (2, 1, {"payload": {"return": 42}}))
        for shard, name in RAISING.items():
            await add(name, ref(table, ORG, shard), (2, 1, {"payload": {"raise": name}}))
        await add(
            "async CancelledError",
            ref(table, USER, 117),
            (10, 1, {"payload": {"raise": "CancelledError"}}),
        )
        await add(
            "async SystemExit", ref(table, USER, 118), (10, 1, {"payload": {"raise": "SystemExit"}})
        )
        # PostgreSQL stores these; Python's JSON decoder cannot read them back.
        deep = JsonText("[" * 10_000 + "]" * 10_000)
        await add("nested 10,000 deep", ref(table, ORG, 119), (2, 1, {"payload": deep}))
        digits = JsonText('{"n": ' + "7" * 5_000 + "}")
        await add("a 5,000-digit integer", ref(table, ORG, 120), (2, 1, {"payload": digits}))
        region = ShardRef(regional, USER, "USER", 111, "eu")
        await add("eu", region, (10, 1, {"region": "eu"}))
        await add(
            "mars", ShardRef(regional, USER, "USER", 111, "mars"), (10, 1, {"region": "mars"})
        )
    return rows


async def pending_ids(engine, table: str) -> set[int]:
    async with engine.connect() as conn:
        return set((await conn.execute(text(f"SELECT id FROM {table}"))).scalars())


async def test_bad_input_is_refused_or_held_with_a_clear_error_and_nothing_is_lost(
    engine, fault_database, fault_temporal, fault_client, logs
) -> None:
    url, password = fault_database
    table = new_table()
    await prepare(engine, table)

    # Refused at write time: a NULL in any core column (NOT NULL constraints).
    for position in range(4):
        values: list[int | None] = [1, 1, 1, 1]
        values[position] = None
        with pytest.raises(IntegrityError, match="not-null"):
            async with engine.begin() as conn:
                await insert(conn, table, *values)
    assert await outbox_count(engine, table) == 0

    rows = await write_bad_rows(engine, table)
    worker = await start_worker(url, fault_temporal.address, table, logs, OUTBOX_REGIONS="eu")
    env = worker.env
    try:
        await check_held_and_handled(engine, fault_client, table, rows)
        await check_malformed_messages(
            fault_temporal.address, fault_client, worker, rows["SystemExit"][0]
        )
        assert worker.running

        # Once the handlers are fixed, their shards drain on the next retry.
        await set_control(engine, table, poison_shards=[])
        kept = {
            "unknown category",
            "other scope",
            "unknown scope",
            "year 9999",
            "infinity",
            "nested 10,000 deep",
            "a 5,000-digit integer",
            "5 MB",
        }
        expected = {i for kind in kept for i in rows[kind][1]}
        await wait_until(
            lambda: _equals(pending_ids(engine, table), expected),
            timeout=60,
            what="the fixed shards",
        )
        # A region this worker does not drain: kept for its own region's worker, and listed.
        assert await pending_ids(engine, f"{table}_r") == set(rows["mars"][1])
        listing = await command(env, "shards", "--table", f"{table}_r")
        assert "mars" in listing and password not in listing
        assert worker.running
    finally:
        code = await worker.stop()
    output = worker.output()
    assert code == 0, output[-5000:]
    for error in {*HELD_ERRORS.values()}:
        assert f": {error}" in output, f"{error} not logged"
    assert "returned 'int'; handlers should return None" in output
    for name in ("skip", "resume", "notify"):  # refused by the workflow, which says why
        assert f"refused: {name} at " in output
    assert password not in output
    nested = "[" * 50
    found = await histories_containing(fault_client, [BIG_CANARY, nested])
    assert not found[BIG_CANARY] and not found[nested]


async def _equals(value, expected) -> bool:
    return bool((await value) == expected)


async def check_held_and_handled(engine, client: Client, table: str, rows) -> None:
    """Every kind of bad row is either handled or held, as the table in
    docs/explanation/guarantees.md says."""
    for kind, error in HELD_ERRORS.items():
        shard = rows[kind][0]
        await wait_until(
            partial(in_state, client, shard, "blocked", error),
            timeout=60,
            what=f"{kind} blocked with {error}",
        )
    for kind, until in (
        ("year 9999", "9999-12-31T00:00:00+00:00"),
        ("infinity", "9999-12-31T23:59:59.999999+00:00"),
    ):
        await wait_until(
            partial(in_state, client, rows[kind][0], "deferred"), timeout=60, what=kind
        )
        current = await status(client, rows[kind][0])
        assert current is not None and current.deferred_until == until
    handled = [rows[k][1] for k in ("not objects", "negative", "1970", "-infinity", "returns")]
    handled_ids = {i for ids in handled for i in ids}
    await wait_until(
        lambda: _disjoint(pending_ids(engine, table), handled_ids),
        timeout=60,
        what="the handled rows",
    )
    await wait_until(
        lambda: _disjoint(pending_ids(engine, f"{table}_r"), set(rows["eu"][1])),
        timeout=60,
        what="eu",
    )
    async with engine.connect() as conn:
        calls = (
            await conn.execute(
                text(
                    "SELECT shard_identifier, payload_type, payload_bytes, outcome FROM fault_calls "
                    "WHERE outbox_table = :t AND shard_identifier IN (104, 105) ORDER BY row_id"
                ),
                {"t": table},
            )
        ).all()
    # Payloads are delivered as stored: any JSON value, up to the payload limit.
    assert [(c.payload_type, c.outcome) for c in calls if c.shard_identifier == 104] == [
        ("list", "ok"),
        ("str", "ok"),
        ("int", "ok"),
        ("NoneType", "ok"),
        ("bool", "ok"),
    ]
    assert not [c for c in calls if c.shard_identifier == 105]  # over the limit: no call


async def _disjoint(value, ids: set[int]) -> bool:
    return not ((await value) & ids)


async def check_malformed_messages(address: str, client: Client, worker, shard: ShardRef) -> None:
    """Signals and updates with bad arguments leave the shard as it was."""
    handle = client.get_workflow_handle(shard.workflow_id)
    before = await status(client, shard)
    assert before is not None and before.state == "blocked"
    signals = [
        ("skip", "{}"),  # no reason: refused, counted and shown, with a warning
        ("skip", '{"reason": "   "}'),
        ("skip", '{"reason": 5}'),  # not text: refused the same way
        ("resume", "[1]"),
        ("notify", '{"max_id": "x"}'),
    ]
    for name, payload in signals:
        await temporal_command(
            address,
            "workflow",
            "signal",
            "--workflow-id",
            shard.workflow_id,
            "--name",
            name,
            "--input",
            payload,
        )
    await handle.signal("skip", SkipInput(reason=""))
    for bad, refused_by in (
        # The data converter refuses what it cannot convert, before the validator runs.
        ({"up_to_id": "x", "timeout_seconds": 1}, "Failed converting field up_to_id"),
        ({"up_to_id": -3, "timeout_seconds": 1}, "flush needs up_to_id, a positive integer"),
    ):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("flush", bad)
        assert refused_by in refusal(refused.value)

    async def all_refused() -> bool:
        shown = await status(client, shard)
        return shown is not None and shown.refused is not None and shown.refused.count == 6

    await wait_until(all_refused, timeout=30, what="six refused signals")
    assert "refused: skip at " in worker.output()
    after = await status(client, shard)
    assert after is not None and after.state == "blocked" and after.skip is None
    assert after.head == before.head
    description = await handle.describe()
    assert description.status is not None and description.status.name == "RUNNING"
    history = await handle.fetch_history()
    kinds = {e.event_type for e in history.events}
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED not in kinds
