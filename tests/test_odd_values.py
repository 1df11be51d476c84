"""Odd values written by plain SQL: the NOTIFY trigger, the bridge, the command line and the
backlog gauges keep working, or the write is refused with a clear error.

- regions of multi-byte characters: the trigger's payload limit counts bytes (a multi-shard
  INSERT whose JSON is short in characters but long in bytes asks for a sweep with ``*``);
- regions containing ``:``, the separator of the command line's ``REGION:SCOPE:ID``: the
  shard name is read from the right (scope names and ids hold no ``:``);
- explicit ids near the top of bigint;
- ``scheduled_for`` at ±infinity (held deferred for ever, or due at once) and ``date_added``
  at ±infinity (refused by a CHECK constraint: ages are computed from it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp
from outbox_bridge.config import libpq_url, sqlalchemy_url
from outbox_bridge.db.install import create_outbox_tables
from outbox_bridge.db.schema import NOTIFY_PAYLOAD_LIMIT, SWEEP_NOTIFICATION, notify_channel
from tests.harness import (
    Recorder,
    Servers,
    count_rows,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
)
from tests.otel import metric_reader, points
from tests.support import clean_env, run_cli

ORG = 1  # Scope.ORGANIZATION
PROJECT_UPDATE = 2
TOP_IDS = [9_223_372_036_854_775_000, 9_223_372_036_854_775_001, 9_223_372_036_854_775_807]
# 4 bytes in UTF-8 each: a region of 20 is 20 characters, 80 bytes.
WIDE = "\U0001f30d" * 20


async def cli(servers: Servers, table: str, *args: str, regional: bool) -> tuple[int, str, str]:
    env = clean_env(
        TEMPORAL_ADDRESS=servers.temporal_address,
        OUTBOX_DATABASE_URL=servers.database_url,
        OUTBOX_APP="tests.sample_app:" + ("regional_app" if regional else "app"),
        SAMPLE_OUTBOX_TABLE=table,
        COLUMNS="250",
    )
    result = await run_cli(*args, env=env)
    return result.code, result.stdout, result.stderr


async def listed_shards(
    servers: Servers, table: str, *, regional: bool
) -> dict[str, dict[str, Any]]:
    code, out, err = await cli(servers, table, "shards", "--json", regional=regional)
    assert code == 0, err
    return {entry["shard"]: entry for entry in json.loads(out)}


async def new_app(engine: AsyncEngine, *, regional: bool) -> tuple[Recorder, OutboxApp, str]:
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder, regional=regional)
    await create_tables(engine, app)
    return recorder, app, table


def insert_shards_sql(table: str, shards: int, region: str | None) -> tuple[str, dict[str, object]]:
    """One INSERT of a row in each of ``shards`` shards (one statement: one notification)."""
    columns = "shard_scope, shard_identifier, category, object_identifier"
    values = f"{ORG}, n, {PROJECT_UPDATE}, n"
    if region is not None:
        columns = "region, " + columns
        values = ":region, " + values
    statement = (
        f"INSERT INTO {table} ({columns}) SELECT {values} FROM generate_series(1, :shards) AS n"
    )
    return statement, {"region": region, "shards": shards}


@pytest.fixture
async def listener(servers: Servers) -> AsyncIterator[psycopg.AsyncConnection]:
    url = libpq_url(sqlalchemy_url(servers.database_url))
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def notifications(conn: psycopg.AsyncConnection, timeout: float = 5.0) -> list[str]:
    """The payloads delivered to ``conn`` until none came for a moment."""
    received = []
    async for notification in conn.notifies(timeout=timeout, stop_after=1):
        received.append(notification.payload)
    async for notification in conn.notifies(timeout=0.5):
        received.append(notification.payload)
    return received


# -- the NOTIFY trigger ---------------------------------------------------------------------------


async def test_a_multi_shard_insert_of_multibyte_regions_asks_for_a_sweep(
    engine: AsyncEngine, listener: psycopg.AsyncConnection
) -> None:
    """150 shards of a 20-character region: about 6,700 characters of JSON, under the limit,
    but 15,600 bytes, past the 8,000 bytes PostgreSQL takes in a notification. Counted in
    characters, pg_notify refused the payload and the INSERT failed."""
    _, app, table = await new_app(engine, regional=True)
    await listener.execute(f'LISTEN "{notify_channel(table)}"')
    statement, params = insert_shards_sql(table, 150, WIDE)
    async with engine.begin() as conn:
        length = await conn.execute(
            text(
                f"SELECT length(j), octet_length(j) FROM (SELECT json_agg(json_build_array("
                f"r, {ORG}, n, n))::text AS j FROM (SELECT :region AS r, "
                f"generate_series(1, 150) AS n) AS s) AS x"
            ),
            {"region": WIDE},
        )
        characters, octets = length.one()
        assert characters < NOTIFY_PAYLOAD_LIMIT < 8000 < octets  # the case under test
        await conn.execute(text(statement), params)
    assert await notifications(listener) == [SWEEP_NOTIFICATION]
    assert await count_rows(engine, app) == 150


async def test_a_multi_shard_insert_past_the_limit_asks_for_a_sweep(
    engine: AsyncEngine, listener: psycopg.AsyncConnection
) -> None:
    _, _, table = await new_app(engine, regional=False)
    await listener.execute(f'LISTEN "{notify_channel(table)}"')
    statement, params = insert_shards_sql(table, 600, None)  # ~600 x 17 characters
    await sql(engine, statement, **params)
    assert await notifications(listener) == [SWEEP_NOTIFICATION]
    statement, params = insert_shards_sql(table, 3, None)
    await sql(engine, statement, **params)
    [small] = await notifications(listener)
    assert sorted(tuple(e[:2]) for e in json.loads(small)) == [(ORG, 1), (ORG, 2), (ORG, 3)]


async def test_a_notification_carries_multibyte_regions_and_top_ids_exactly(
    engine: AsyncEngine, listener: psycopg.AsyncConnection
) -> None:
    _, _, table = await new_app(engine, regional=True)
    await listener.execute(f'LISTEN "{notify_channel(table)}"')
    region = "z\u00fcrich-\u6771\u4eac:\U0001f30d"
    await sql(
        engine,
        f"INSERT INTO {table} (id, region, shard_scope, shard_identifier, category, "
        "object_identifier) VALUES (:id, :region, 1, 9, 2, 9)",
        id=TOP_IDS[-1],
        region=region,
    )
    [payload] = await notifications(listener)
    assert json.loads(payload) == [[region, ORG, 9, TOP_IDS[-1]]]


async def test_the_bridge_handles_a_large_multibyte_insert_through_the_sweep_notification(
    servers: Servers, engine: AsyncEngine
) -> None:
    """With scans and sweeps an hour apart, only the ``*`` notification can bring the rows
    of a large multi-shard INSERT to the bridge."""
    recorder, app, table = await new_app(engine, regional=True)
    settings = fast_settings(poll_interval=3600, sweep_interval=3600)
    async with running_worker(servers, app, settings):
        statement, params = insert_shards_sql(table, 150, WIDE)
        await sql(engine, statement, **params)
        await wait_until(lambda: table_empty(engine, app), timeout=120, what="150 shards")
    assert len(recorder.calls) == 150
    assert {c.shard.split(":", 1)[0] for c in recorder.calls} == {WIDE}


# -- regions with ':' and multi-byte characters --------------------------------------------------


async def test_regions_with_a_colon_or_multibyte_characters_through_the_command_line(
    servers: Servers, engine: AsyncEngine
) -> None:
    """Shard names are read from the right: ``eu:west:ORGANIZATION:5`` is region ``eu:west``.
    Both shards start skipped (the skip setting names them), are listed, show their status,
    and drain once resumed from the command line."""
    recorder, app, table = await new_app(engine, regional=True)
    regions = ["eu:west", "z\u00fcrich-\u6771\u4eac"]
    names = [f"{region}:ORGANIZATION:5" for region in regions]
    for region in regions:
        await sql(
            engine,
            f"INSERT INTO {table} (region, shard_scope, shard_identifier, category, "
            "object_identifier) VALUES (:region, 1, 5, 2, 1)",
            region=region,
        )
    listed = await listed_shards(servers, table, regional=True)
    assert set(listed) == set(names)
    settings = fast_settings(skip_shards=names)
    async with running_worker(servers, app, settings):
        for name in names:

            async def skipped(name: str = name) -> bool:
                code, out, err = await cli(servers, table, "status", name, regional=True)
                assert code in (0, 1), err
                return code == 0 and "skipped" in out

            await wait_until(skipped, what=f"{name} skipped")
        listed = await listed_shards(servers, table, regional=True)
        assert {name: entry["state"] for name, entry in listed.items()} == dict.fromkeys(
            names, "skipped"
        )
        for name in names:
            code, _, err = await cli(servers, table, "resume", name, regional=True)
            assert code == 0, err
        await wait_until(lambda: table_empty(engine, app), what="the resumed shards")
    assert sorted(c.shard for c in recorder.calls) == sorted(f"{r}:1:5" for r in regions)


# -- ids near the top of bigint ------------------------------------------------------------------


async def test_ids_near_the_top_of_bigint(servers: Servers, engine: AsyncEngine) -> None:
    recorder, app, table = await new_app(engine, regional=False)
    for n, row_id in enumerate(TOP_IDS):
        await sql(
            engine,
            f"INSERT INTO {table} (id, shard_scope, shard_identifier, category, "
            "object_identifier) VALUES (:id, 1, 7, 2, :obj)",
            id=row_id,
            obj=n,
        )
    listed = await listed_shards(servers, table, regional=False)
    assert listed["ORGANIZATION:7"]["rows"] == 3
    async with running_worker(servers, app):
        await wait_until(lambda: table_empty(engine, app), what="the top ids")
        # Rows from the sequence, far below: handled too (late commits, as far as the bridge
        # can tell).
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
            "object_identifier) VALUES (1, 7, 2, 9)",
        )
        await wait_until(lambda: table_empty(engine, app), what="a low id after the top ids")
    assert recorder.ids()[:3] == TOP_IDS
    assert len(recorder.ids()) == 4


# -- infinite dates ------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["infinity", "-infinity"])
async def test_an_infinite_date_added_is_refused_with_a_clear_error(
    engine: AsyncEngine, when: str
) -> None:
    _, _, table = await new_app(engine, regional=False)
    with pytest.raises(IntegrityError, match=f"{table}_date_added_finite"):
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
            "object_identifier, date_added) VALUES (1, 1, 2, 1, CAST(:when AS timestamptz))",
            when=when,
        )


async def test_the_date_added_check_is_added_to_a_table_created_before_it(
    engine: AsyncEngine,
) -> None:
    _, app, table = await new_app(engine, regional=False)
    await sql(engine, f"ALTER TABLE {table} DROP CONSTRAINT {table}_date_added_finite")
    async with engine.begin() as conn:
        await create_outbox_tables(conn, app.metadata)
        await create_outbox_tables(conn, app.metadata)  # idempotent
    with pytest.raises(IntegrityError, match=f"{table}_date_added_finite"):
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
            "object_identifier, date_added) VALUES (1, 1, 2, 1, 'infinity')",
        )


async def test_infinite_schedules_in_the_command_line_and_the_backlog_gauges(
    servers: Servers, engine: AsyncEngine
) -> None:
    """A row scheduled for +infinity is held deferred for ever (its shard with it), one at
    -infinity is due at once; the backlog gauges count the held rows with a finite age, and
    the shards command lists the held shard."""
    with metric_reader() as reader:
        recorder, app, table = await new_app(engine, regional=False)
        for shard, when in ((1, "infinity"), (2, "-infinity"), (3, "infinity")):
            await sql(
                engine,
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                "object_identifier, scheduled_for) VALUES "
                "(1, :shard, 2, 1, CAST(:when AS timestamptz))",
                shard=shard,
                when=when,
            )
        await sql(
            engine,
            f"INSERT INTO {table} (id, shard_scope, shard_identifier, category, "
            "object_identifier, scheduled_for) VALUES (:id, 1, 3, 2, 2, 'infinity')",
            id=TOP_IDS[0],
        )
        async with running_worker(servers, app, fast_settings(sweep_interval=0.5)):
            await wait_until(lambda: bool(recorder.calls), what="the -infinity row")

            def gauge(name: str) -> float | None:
                found = [
                    p.value
                    for p in points(reader.get_metrics_data(), name)
                    if p.attributes.get("outbox.table") == table
                    and p.attributes.get("outbox.scope") == "ORGANIZATION"
                ]
                return found[-1] if found else None

            await wait_until(
                lambda: gauge("outbox.backlog.rows") == 3, what="the backlog of held rows"
            )
            age = gauge("outbox.backlog.oldest_age_seconds")
            assert age is not None and 0 <= age < 600
            listed = await listed_shards(servers, table, regional=False)
            assert {k: (v["rows"], v["state"]) for k, v in listed.items()} == {
                "ORGANIZATION:1": (1, "deferred"),
                "ORGANIZATION:3": (2, "deferred"),
            }
            code, out, err = await cli(servers, table, "status", "ORGANIZATION:3", regional=False)
            assert code == 0, err
            assert "deferred" in out and "9999-12-31" in out
        assert [c.shard for c in recorder.calls] == ["1:2"]
