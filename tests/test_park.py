"""`outbox-bridge park|unpark|parked` against a real worker: a blocked shard's head group set
aside, the shard going on, the group kept and put back in its place."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from sqlalchemy import text

from outbox_bridge.db.parked import park_head, read_parked, unpark
from outbox_bridge.db.scans import read_pending_up_to
from outbox_bridge.testing import drain_outbox_async
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    COMMAND_POLL_INTERVAL,
    Category,
    Recorder,
    create_tables,
    fast_settings,
    fresh_app,
    make_app,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli
from tests.test_pauses import shows

SHARD = "ORGANIZATION:8"


def row(category: Category, obj: int) -> dict[str, Any]:
    return {"category": category, "shard_identifier": 8, "object_identifier": obj}


async def test_a_parked_group_lets_its_shard_go_on_and_comes_back_when_unparked(
    servers, engine
) -> None:
    recorder, table, app = await fresh_app(engine)
    fixed = recorder.fail_until_fixed(Category.PROJECT_UPDATE)
    stuck, member, org = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 80),
            row(Category.MEMBER_UPDATE, 81),
            row(Category.ORGANIZATION_UPDATE, 82),
        ],
    )

    async def run(*args: str) -> dict[str, Any] | list[Any]:
        code, out, err = await cli(servers, table, *args, "--json")
        assert code == 0, err
        shown: dict[str, Any] | list[Any] = json.loads(out)
        return shown

    async def state_is(state: str) -> bool:
        code, out, _ = await cli(servers, table, "status", SHARD, "--json")
        return code == 0 and json.loads(out)["state"] == state

    async def remaining() -> list[int]:
        async with engine.connect() as conn:
            ids = await conn.execute(text(f"SELECT id FROM {table} ORDER BY id"))
            return list(ids.scalars())

    async def rows_are(expected: list[int]) -> bool:
        return await remaining() == expected

    # A blocked head is tried again, and the sweep looks at held shards, every two minutes:
    # only the wake-ups of park and unpark let the shard go on within the test's timeouts.
    settings = fast_settings(
        initial_retry_interval=120.0, max_retry_interval=120.0, sweep_interval=120.0
    )
    async with running_worker(servers, app, settings):
        await wait_until(
            lambda: state_is("blocked"), interval=COMMAND_POLL_INTERVAL, what="a blocked shard"
        )
        code, out, err = await cli(servers, table, "park", SHARD, "--reason", "replica down")
        assert code == 0, err
        assert "parked PROJECT_UPDATE object=80" in out, out
        await wait_until(lambda: org in recorder.ids(), what="the shard's later groups")
        assert recorder.ids() == [member, org]  # in order, the parked group left out

        # A row of the parked object waits with it; other rows of the shard go on.
        later, other = await write_rows(
            engine, app, [row(Category.PROJECT_UPDATE, 80), row(Category.MEMBER_UPDATE, 83)]
        )
        await wait_until(lambda: other in recorder.ids(), what="a row written after the park")
        assert later not in recorder.ids()
        # The handler's call is recorded before its round deletes the row: wait for the delete.
        await wait_until(lambda: rows_are([stuck, later]), what="the handled rows deleted")

        status = await run("status", SHARD)
        assert isinstance(status, dict)
        [shown] = status["parked_groups"]
        assert (shown["category"], shown["object_identifier"]) == (Category.PROJECT_UPDATE, 80)
        assert (shown["reason"], shown["rows"], shown["first_id"]) == ("replica down", 2, stuck)
        listed = await run("shards")
        assert isinstance(listed, list)
        assert [(s["shard"], s["parked_groups"]) for s in listed] == [(SHARD, 1)]
        code, out, err = await cli(servers, table, "shards", env={"COLUMNS": "200"})
        assert code == 0 and "parked groups" in out, err

    # The park is in the table: a new worker leaves the group alone too.
    async with running_worker(servers, app, settings):
        [after_restart] = await write_rows(engine, app, [row(Category.MEMBER_UPDATE, 84)])
        await wait_until(lambda: after_restart in recorder.ids(), what="a row after a restart")
        await wait_until(lambda: rows_are([stuck, later]), what="the handled row deleted")
        parked = await run("parked")
        assert isinstance(parked, list)
        assert [(p["shard"], p["reason"], p["unparked_at"]) for p in parked] == [
            (SHARD, "replica down", None)
        ]

        fixed.set()
        code, out, err = await cli(servers, table, "unpark", SHARD)
        assert code == 0, err
        assert "unparked PROJECT_UPDATE object=80 (2 rows)" in out, out
        await wait_until(lambda: table_empty(engine, app), what="the unparked group handled")

    # Handled once, coalesced, with its newest row; nothing lost, nothing handled twice.
    assert recorder.ids() == [member, org, other, after_restart, later]
    assert recorder.calls[-1].coalesced == 2
    history = await run("parked", "--all")
    assert isinstance(history, list)
    [record] = history
    assert record["unparked_at"] is not None and record["unparked_by"]
    assert await run("parked") == []


async def test_park_and_unpark_say_when_there_is_nothing_to_do(servers, engine) -> None:
    _, table, _ = await fresh_app(engine)
    code, _, err = await cli(servers, table, "park", SHARD, "--reason", "why")
    assert code == 2
    assert f"shard {SHARD} has no row to park" in err, err
    code, _, err = await cli(servers, table, "unpark", SHARD)
    assert code == 2
    assert f"shard {SHARD} has no parked group" in err, err
    code, _, err = await cli(servers, table, "unpark", SHARD, "--group", "NOPE:1")
    assert code == 2 and "category names: ORGANIZATION_UPDATE" in err, err
    code, _, err = await cli(servers, table, "park", "TEAM:1", "--reason", "why")
    assert code == 2 and "unknown scope 'TEAM'" in err, err
    code, _, err = await cli(servers, table, "park", SHARD, "--reason", " ")
    assert code == 2 and "reason" in err, err


async def test_unpark_of_one_group_keeps_the_others_parked(servers, engine) -> None:
    recorder, table, app = await fresh_app(engine)
    first, second = await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 1), row(Category.ORGANIZATION_UPDATE, 2)]
    )
    for _ in range(2):
        code, _, err = await cli(servers, table, "park", SHARD, "--reason", "later", "--by", "ops")
        assert code == 0, err
    code, _, err = await cli(servers, table, "park", SHARD, "--reason", "again")
    assert code == 2 and "all of them are parked" in err, err
    code, out, err = await cli(servers, table, "unpark", SHARD, "--group", "organization_update:2")
    assert code == 0 and "unparked ORGANIZATION_UPDATE object=2" in out, err
    async with running_worker(servers, app):
        await wait_until(lambda: second in recorder.ids(), what="the group put back")
        assert first not in recorder.ids()
    code, out, err = await cli(servers, table, "parked", "--json")
    assert code == 0, err
    [still] = json.loads(out)
    assert (still["first_id"], still["parked_by"]) == (first, "ops")


async def test_status_of_a_shard_without_workflow_lists_its_parked_groups(servers, engine) -> None:
    _, table, app = await fresh_app(engine)
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 5)])
    code, _, err = await cli(servers, table, "park", SHARD, "--reason", "bad payload")
    assert code == 0, err
    code, out, err = await cli(servers, table, "status", SHARD, env={"COLUMNS": "200"})
    assert code == 0, err
    assert "no workflow of its own" in out and "bad payload" in out, out
    code, _, err = await cli(servers, unique_table(), "status", SHARD)
    assert code == 1 and "has no workflow of its own" in err, err


async def test_a_parked_group_of_a_regional_table_is_left_out_of_drains_and_flushes(
    engine,
) -> None:
    recorder = Recorder()
    app = make_app(unique_table(), recorder, regional=True)
    await create_tables(engine, app)
    table = app.table()
    eu = ShardRef(table.name, 1, "ORGANIZATION", 8, "eu")
    stuck, behind, elsewhere = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1) | {"region": "eu"},
            row(Category.MEMBER_UPDATE, 2) | {"region": "eu"},
            row(Category.PROJECT_UPDATE, 1) | {"region": "us"},  # the same group in another shard
        ],
    )
    async with engine.begin() as conn:
        parked = await park_head(conn, table, eu, reason="why", by="ops")
        assert parked is not None and (parked.region, parked.first_id) == ("eu", stuck)
        # A flush waits for the rows that are not parked, and for its own row.
        assert (await read_pending_up_to(conn, table, eu, behind))[0]
    await drain_outbox_async(app, engine)
    assert sorted(recorder.ids()) == [behind, elsewhere]
    async with engine.begin() as conn:
        assert not (await read_pending_up_to(conn, table, eu, behind))[0]
        assert (await read_pending_up_to(conn, table, eu, stuck))[0]
        [back] = await unpark(conn, table, eu, by="ops")
        assert (back.unparked_by, back.rows) == ("ops", 1)
        assert await read_parked(conn, table) == []
    await drain_outbox_async(app, engine)
    assert recorder.ids()[-1] == stuck


async def test_shards_lists_a_table_whose_parked_group_table_is_not_there_yet(
    servers, engine
) -> None:
    _, table, app = await fresh_app(engine)
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 5)])
    await sql(engine, f"DROP TABLE {table}_parked")  # as a worker of an older version left it
    code, out, err = await cli(servers, table, "shards", "--json")
    assert code == 0, err
    assert [(s["shard"], s["parked_groups"]) for s in json.loads(out)] == [(SHARD, 0)]
    code, _, err = await cli(servers, table, "park", SHARD, "--reason", "why")
    assert code == 2 and "init-db" in err, err


async def test_a_shard_workflow_lists_its_parked_groups_on_its_first_view(
    servers, engine, client
) -> None:
    recorder, table, app = await fresh_app(engine)
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 85)])
    code, _, err = await cli(
        servers, table, "park", SHARD, "--reason", "bad payload", "--by", "ann"
    )
    assert code == 0, err
    handle = client.get_workflow_handle(f"outbox:{table}:{SHARD}")
    async with running_worker(servers, app, fast_settings()):
        # Behind the parked group, a row scheduled later: the shard's workflow waits for it.
        [due, _] = await write_rows(
            engine,
            app,
            [
                row(Category.MEMBER_UPDATE, 86),
                row(Category.ORGANIZATION_UPDATE, 87) | {"scheduled_for": timedelta(hours=1)},
            ],
        )
        await wait_until(lambda: due in recorder.ids(), what="the group behind the parked one")
        listed = "- PROJECT_UPDATE object=85, 1 rows: parked by ann at "
        await wait_until(lambda: shows(handle, listed), what="the parked group in the details")
        assert await shows(handle, ": bad payload")
        assert await shows(handle, "**Deferred until**")
