"""The producer API and the table schema against a real PostgreSQL (the design contract: its
vocabulary, and the producer API of its shape; docs/explanation/contract.md).

A row is written in the caller's transaction and never committed by outbox-bridge; a refused row
raises InvalidRowError before anything reaches the database, so the caller's transaction stays
usable.
"""

from __future__ import annotations

import asyncio
import json
import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox_bridge import (
    InvalidRowError,
    OutboxApp,
    OutboxTable,
    RegistryError,
    create_outbox_tables,
)
from outbox_bridge.config import libpq_url, sqlalchemy_url
from outbox_bridge.db.schema import notify_channel
from outbox_bridge.producer import BIGINT_MAX, BIGINT_MIN
from tests.harness import SCOPES, Category, Scope, create_tables, unique_table

CORE: dict[str, Any] = dict(
    category=Category.PROJECT_UPDATE, shard_identifier=7, object_identifier=5
)


def nested(depth: int) -> list[Any]:
    """A list nested ``depth`` deep."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def new_app(*, regional: bool = False) -> OutboxApp:
    return OutboxApp(
        scopes=SCOPES,
        categories=[Category],
        tables=[OutboxTable(unique_table(), regional=regional)],
    )


@pytest.fixture
async def app(engine: AsyncEngine) -> OutboxApp:
    created = new_app()
    await create_tables(engine, created)
    return created


@pytest.fixture
async def regional_app(engine: AsyncEngine) -> OutboxApp:
    created = new_app(regional=True)
    await create_tables(engine, created)
    return created


async def rows_of(engine: AsyncEngine, app: OutboxApp) -> list[Any]:
    """Every row of the app's table, as seen from a separate connection (committed rows only)."""
    async with engine.connect() as conn:
        result = await conn.execute(text(f"SELECT * FROM {app.table().name} ORDER BY id"))
        return list(result.mappings().all())


async def model_table(engine: AsyncEngine) -> str:
    """A table standing for the application's own model."""
    name = f"model_{unique_table()}"
    async with engine.begin() as conn:
        await conn.execute(text(f"CREATE TABLE {name} (id int PRIMARY KEY, name text)"))
    return name


async def count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


# -- sync sessions and connections --------------------------------------------------------------


async def test_sync_session_rollback_leaves_no_row(engine, sync_engine, app) -> None:
    model = await model_table(engine)
    with Session(sync_engine) as session:
        session.execute(text(f"INSERT INTO {model} VALUES (1, 'acme')"))
        new_id = app.write(session, **CORE, payload={"name": "acme"})
        assert isinstance(new_id, int) and new_id > 0
        assert session.in_transaction()
        session.rollback()
    assert await rows_of(engine, app) == []
    assert await count(engine, model) == 0


async def test_sync_session_commit_leaves_exactly_the_row(engine, sync_engine, app) -> None:
    model = await model_table(engine)
    with Session(sync_engine) as session:
        before = datetime.now(UTC)
        session.execute(text(f"INSERT INTO {model} VALUES (1, 'acme')"))
        new_id = app.write(session, **CORE, payload={"name": "acme", "n": [1, 2.5, None]})
        # Not committed by write(): another connection sees nothing yet.
        assert await rows_of(engine, app) == []
        session.commit()
    rows = await rows_of(engine, app)
    assert len(rows) == 1
    row = rows[0]
    assert row["id"] == new_id
    assert row["shard_scope"] == Scope.ORGANIZATION  # derived from the category
    assert row["shard_identifier"] == 7
    assert row["category"] == Category.PROJECT_UPDATE
    assert row["object_identifier"] == 5
    assert row["payload"] == {"name": "acme", "n": [1, 2.5, None]}
    # Not deferred: due at once; the dates are the database's now() (the transaction start).
    assert row["scheduled_for"] == row["scheduled_from"] == row["date_added"]
    slack = timedelta(seconds=5)
    assert before - slack < row["date_added"] < datetime.now(UTC) + slack
    assert await count(engine, model) == 1


async def test_sync_connection_write(engine, sync_engine, app) -> None:
    with sync_engine.connect() as conn:
        first = app.write(
            conn, category=Category.USER_UPDATE, shard_identifier=3, object_identifier=3
        )
        conn.rollback()
        with conn.begin():
            second = app.write(
                conn, category=Category.USER_UPDATE, shard_identifier=3, object_identifier=3
            )
            third = app.write(
                conn,
                category=Category.USER_UPDATE,
                shard_identifier=3,
                object_identifier=4,
                shard_scope=Scope.USER,
            )
    assert first < second < third
    rows = await rows_of(engine, app)
    assert [(r["id"], r["shard_scope"], r["object_identifier"]) for r in rows] == [
        (second, Scope.USER, 3),
        (third, Scope.USER, 4),
    ]
    assert rows[0]["payload"] is None


async def test_sync_write_refuses_an_async_session(engine, app) -> None:
    async with AsyncSession(engine) as session:
        with pytest.raises(TypeError, match="write_async"):
            app.write(session, **CORE)
        await session.commit()
    assert await rows_of(engine, app) == []


# -- async sessions and connections -------------------------------------------------------------


async def test_async_session_rollback_and_commit(engine, app) -> None:
    model = await model_table(engine)
    async with AsyncSession(engine) as session:
        await session.execute(text(f"INSERT INTO {model} VALUES (1, 'acme')"))
        rolled_back = await app.write_async(session, **CORE, payload={"v": 1})
        assert await rows_of(engine, app) == []
        await session.rollback()
    assert await rows_of(engine, app) == []
    assert await count(engine, model) == 0

    async with AsyncSession(engine) as session:
        await session.execute(text(f"INSERT INTO {model} VALUES (2, 'globex')"))
        committed = await app.write_async(session, **CORE, payload={"v": 2})
        assert await rows_of(engine, app) == []
        await session.commit()
    assert committed > rolled_back
    rows = await rows_of(engine, app)
    assert [(r["id"], r["shard_scope"], r["category"], r["payload"]) for r in rows] == [
        (committed, Scope.ORGANIZATION, Category.PROJECT_UPDATE, {"v": 2})
    ]
    assert await count(engine, model) == 1


async def test_async_connection_rollback_and_commit(engine, app) -> None:
    async with engine.connect() as conn:
        await app.write_async(conn, **CORE)
        # Leaving without commit rolls back.
    assert await rows_of(engine, app) == []
    async with engine.begin() as conn:
        ids = [
            await app.write_async(
                conn, category=Category.MEMBER_UPDATE, shard_identifier=1, object_identifier=obj
            )
            for obj in (30, 10, 20)
        ]
    assert ids == sorted(ids)
    rows = await rows_of(engine, app)
    assert [(r["id"], r["object_identifier"]) for r in rows] == [
        (ids[0], 30),
        (ids[1], 10),
        (ids[2], 20),
    ]
    assert {r["shard_scope"] for r in rows} == {Scope.ORGANIZATION}


# -- validation -----------------------------------------------------------------------------------


class Measurement(BaseModel):
    value: float


INVALID_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("category 99 is not registered", {**CORE, "category": 99}),
    ("category -1", {**CORE, "category": -1}),
    ("category as a string", {**CORE, "category": "PROJECT_UPDATE"}),
    ("category True", {**CORE, "category": True}),
    ("scope mismatch", {**CORE, "shard_scope": Scope.USER}),
    ("scope mismatch as an int", {**CORE, "shard_scope": 2}),
    ("unknown scope", {**CORE, "shard_scope": 42}),
    ("scope as a string", {**CORE, "shard_scope": "1"}),
    ("shard_identifier str", {**CORE, "shard_identifier": "7"}),
    ("shard_identifier float", {**CORE, "shard_identifier": 7.0}),
    ("shard_identifier None", {**CORE, "shard_identifier": None}),
    ("shard_identifier bool", {**CORE, "shard_identifier": True}),
    ("shard_identifier too large", {**CORE, "shard_identifier": BIGINT_MAX + 1}),
    ("shard_identifier too small", {**CORE, "shard_identifier": BIGINT_MIN - 1}),
    ("object_identifier str", {**CORE, "object_identifier": "5"}),
    ("object_identifier bool", {**CORE, "object_identifier": False}),
    ("object_identifier Decimal", {**CORE, "object_identifier": Decimal(5)}),
    ("object_identifier too large", {**CORE, "object_identifier": 2**64}),
    ("payload set", {**CORE, "payload": {1, 2}}),
    ("payload NaN", {**CORE, "payload": math.nan}),
    ("payload nested infinity", {**CORE, "payload": {"x": [math.inf]}}),
    ("payload object", {**CORE, "payload": object()}),
    ("payload bytes", {**CORE, "payload": b"raw"}),
    ("payload datetime", {**CORE, "payload": {"at": datetime.now(UTC)}}),
    ("payload tuple key", {**CORE, "payload": {(1, 2): "x"}}),
    ("payload NUL in a value", {**CORE, "payload": {"name": "a\x00b"}}),
    ("payload NUL in a key", {**CORE, "payload": {"a\x00": 1}}),
    ("payload NUL after a backslash", {**CORE, "payload": "\\\x00"}),
    ("payload lone surrogate", {**CORE, "payload": ["\ud800"]}),
    ("payload model with NaN", {**CORE, "payload": Measurement(value=math.nan)}),
    (
        "payload too deep",
        {**CORE, "payload": nested(100_000)},
    ),
    ("naive scheduled_for", {**CORE, "scheduled_for": datetime.now()}),
    ("scheduled_for string", {**CORE, "scheduled_for": "2030-01-01T00:00:00Z"}),
    ("scheduled_for epoch seconds", {**CORE, "scheduled_for": 1_900_000_000}),
    ("scheduled_for delay overflows", {**CORE, "scheduled_for": timedelta(days=999_999_999)}),
    ("region on a normal table", {**CORE, "region": "eu"}),
    ("region empty on a normal table", {**CORE, "region": ""}),
]


@pytest.mark.parametrize(
    "kwargs", [kw for _, kw in INVALID_ROWS], ids=[name for name, _ in INVALID_ROWS]
)
async def test_invalid_rows_are_refused_and_write_nothing(engine, app, kwargs) -> None:
    async with engine.begin() as conn:
        with pytest.raises(InvalidRowError):
            await app.write_async(conn, **kwargs)
        # Nothing reached the database: the caller's transaction is intact and goes on.
        valid = await app.write_async(conn, **CORE)
    rows = await rows_of(engine, app)
    assert [r["id"] for r in rows] == [valid]


async def test_invalid_row_sync(engine, sync_engine, app) -> None:
    with Session(sync_engine) as session:
        with pytest.raises(InvalidRowError, match="not registered"):
            app.write(session, **{**CORE, "category": 99})
        with pytest.raises(InvalidRowError, match="belongs to scope ORGANIZATION, not USER"):
            app.write(session, **CORE, shard_scope=Scope.USER)
        valid = app.write(session, **CORE)
        session.commit()
    assert [r["id"] for r in await rows_of(engine, app)] == [valid]


async def test_invalid_row_messages(app) -> None:
    with pytest.raises(InvalidRowError, match="shard_identifier must be an integer, got str"):
        await app.write_async(None, **{**CORE, "shard_identifier": "7"})
    with pytest.raises(InvalidRowError, match="does not fit a bigint"):
        await app.write_async(None, **{**CORE, "object_identifier": 2**63})
    with pytest.raises(InvalidRowError, match="not JSON-serialisable"):
        await app.write_async(None, **CORE, payload={1})
    with pytest.raises(InvalidRowError, match="timezone-aware"):
        await app.write_async(None, **CORE, scheduled_for=datetime(2030, 1, 1))
    with pytest.raises(InvalidRowError, match="not regional"):
        await app.write_async(None, **CORE, region="eu")
    # InvalidRowError is a ValueError too, for callers that catch those.
    with pytest.raises(ValueError):
        await app.write_async(None, **{**CORE, "category": 99})


async def test_unknown_table_is_a_registry_error(app) -> None:
    with pytest.raises(RegistryError, match="not part of this app"):
        await app.write_async(None, **CORE, table="some_other_table")


async def test_bigint_bounds_round_trip(engine, app) -> None:
    async with engine.begin() as conn:
        await app.write_async(
            conn,
            category=Category.USER_UPDATE,
            shard_identifier=BIGINT_MAX,
            object_identifier=BIGINT_MIN,
        )
        await app.write_async(
            conn, category=Category.USER_UPDATE, shard_identifier=BIGINT_MIN, object_identifier=0
        )
    rows = await rows_of(engine, app)
    assert [(r["shard_identifier"], r["object_identifier"]) for r in rows] == [
        (BIGINT_MAX, BIGINT_MIN),
        (BIGINT_MIN, 0),
    ]


async def test_plain_ints_are_accepted_for_categories_and_scopes(engine, app) -> None:
    async with engine.begin() as conn:
        await app.write_async(
            conn, category=10, shard_identifier=1, object_identifier=1, shard_scope=2
        )
    rows = await rows_of(engine, app)
    assert [(r["shard_scope"], r["category"]) for r in rows] == [(2, 10)]


# -- payloads -------------------------------------------------------------------------------------


class Address(BaseModel):
    city: str
    since: datetime


class Customer(BaseModel):
    name: str
    balance: Decimal
    address: Address
    tags: set[str] = set()


async def test_pydantic_payload_is_stored_as_its_json_dump(engine, app) -> None:
    customer = Customer(
        name="Zoë",
        balance=Decimal("12.50"),
        address=Address(city="Lyon", since=datetime(2024, 5, 1, 12, tzinfo=UTC)),
        tags={"vip"},
    )
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE, payload=customer)
    [row] = await rows_of(engine, app)
    assert row["payload"] == customer.model_dump(mode="json")
    assert row["payload"] == {
        "name": "Zoë",
        "balance": "12.50",
        "address": {"city": "Lyon", "since": "2024-05-01T12:00:00Z"},
        "tags": ["vip"],
    }


@pytest.mark.parametrize(
    "payload",
    [
        None,
        0,
        "text",
        "literal backslash-u0000: \\u0000",  # escaped, not a NUL: jsonb stores it
        "emoji 😀 and accents é",
        [1, "two", 3.0, True, None],
        {"nested": {"list": [{"deep": [1]}]}, "big": 2**80},
    ],
)
async def test_json_payloads_round_trip(engine, app, payload) -> None:
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE, payload=payload)
    [row] = await rows_of(engine, app)
    assert row["payload"] == payload
    async with engine.connect() as conn:
        is_sql_null = (
            await conn.execute(text(f"SELECT payload IS NULL FROM {app.table().name}"))
        ).scalar_one()
    assert is_sql_null is (payload is None)  # None is SQL NULL, not JSON null


# -- scheduling -----------------------------------------------------------------------------------


async def test_scheduled_for_delay_lands_in_the_future(engine, app) -> None:
    before = datetime.now(UTC)
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE, scheduled_for=timedelta(hours=1))
    after = datetime.now(UTC)
    [row] = await rows_of(engine, app)
    assert before + timedelta(hours=1) <= row["scheduled_for"] <= after + timedelta(hours=1)
    assert row["scheduled_from"] <= after + timedelta(seconds=1)
    assert row["scheduled_for"] - row["date_added"] > timedelta(minutes=59)


async def test_scheduled_for_aware_datetime_is_stored_exactly(engine, app) -> None:
    paris = timezone(timedelta(hours=2))
    when = datetime(2031, 3, 4, 5, 6, 7, 891011, tzinfo=paris)
    past = datetime(2001, 1, 1, tzinfo=UTC)
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE, scheduled_for=when)
        await app.write_async(conn, **CORE, scheduled_for=past)  # in the past: due at once
    rows = await rows_of(engine, app)
    assert [r["scheduled_for"] for r in rows] == [when, past]


# -- regional tables ------------------------------------------------------------------------------


async def test_regional_table_requires_a_region(engine, regional_app) -> None:
    for region in (None, "", 5, "e\x00u"):
        async with engine.begin() as conn:
            with pytest.raises(InvalidRowError):
                await regional_app.write_async(conn, **CORE, region=region)
    async with engine.begin() as conn:
        eu = await regional_app.write_async(conn, **CORE, region="eu-west-1")
        us = await regional_app.write_async(conn, **CORE, region="us-east-1")
    rows = await rows_of(engine, regional_app)
    assert [(r["id"], r["region"], r["shard_scope"]) for r in rows] == [
        (eu, "eu-west-1", Scope.ORGANIZATION),
        (us, "us-east-1", Scope.ORGANIZATION),
    ]


async def test_app_with_a_regional_and_a_normal_table(engine) -> None:
    normal, regional = unique_table(), unique_table()
    app = OutboxApp(
        scopes=SCOPES, tables=[OutboxTable(normal), OutboxTable(regional, regional=True)]
    )
    await create_tables(engine, app)
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE)  # the first table is the default
        await app.write_async(conn, **CORE, table=regional, region="eu")
        with pytest.raises(InvalidRowError, match="regional"):
            await app.write_async(conn, **CORE, table=regional)
    assert await count(engine, normal) == 1
    assert await count(engine, regional) == 1


# -- plain SQL producers and the schema -----------------------------------------------------------


async def test_plain_sql_insert_gets_defaults(engine, app) -> None:
    table = app.table().name
    async with engine.begin() as conn:
        before = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
        result = await conn.execute(
            text(
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier, "
                'payload) VALUES (1, 42, 2, 9, \'{"from": "sql"}\'), (2, 43, 10, 8, NULL) '
                "RETURNING id"
            )
        )
        ids = [r[0] for r in result]
    after = datetime.now(UTC)
    rows = await rows_of(engine, app)
    assert [r["id"] for r in rows] == ids
    assert ids[0] < ids[1]
    for row in rows:
        assert row["scheduled_from"] == row["scheduled_for"] == row["date_added"]
        assert before - timedelta(seconds=1) <= row["date_added"] <= after + timedelta(seconds=1)
    assert rows[0]["payload"] == {"from": "sql"}
    assert rows[1]["payload"] is None
    # A producer-written row takes the next id of the same sequence.
    async with engine.begin() as conn:
        later = await app.write_async(conn, **CORE)
    assert later > ids[1]


async def test_create_outbox_tables_is_idempotent(engine) -> None:
    app = OutboxApp(
        scopes=SCOPES,
        tables=[OutboxTable(unique_table()), OutboxTable(unique_table(), regional=True)],
    )
    names = list(app.tables)
    async with engine.begin() as conn:
        await create_outbox_tables(conn, app.metadata)
    async with engine.begin() as conn:
        await app.write_async(conn, **CORE)
    for _ in range(2):
        async with engine.begin() as conn:
            await create_outbox_tables(conn, app.metadata)
    assert await count(engine, names[0]) == 1  # nothing dropped or recreated
    async with engine.connect() as conn:
        triggers = (
            (
                await conn.execute(
                    text(
                        "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgrelid::regclass::text "
                        "= ANY(:names) ORDER BY tgname"
                    ),
                    {"names": names},
                )
            )
            .scalars()
            .all()
        )
        indexes = (
            (
                await conn.execute(
                    text(
                        "SELECT indexname FROM pg_indexes WHERE tablename = ANY(:names) ORDER BY indexname"
                    ),
                    {"names": names},
                )
            )
            .scalars()
            .all()
        )
        region_columns = (
            (
                await conn.execute(
                    text(
                        "SELECT table_name FROM information_schema.columns WHERE column_name = 'region' "
                        "AND table_name = ANY(:names)"
                    ),
                    {"names": names},
                )
            )
            .scalars()
            .all()
        )
    assert triggers == sorted(f"{n}_notify" for n in names)
    assert indexes == sorted(
        [f"{n}_pkey" for n in names]
        + [f"{n}_shard_idx" for n in names]
        + [f"{n}_group_idx" for n in names]
    )
    assert region_columns == [names[1]]


async def test_concurrent_create_outbox_tables(engine) -> None:
    app = OutboxApp(scopes=SCOPES, tables=[OutboxTable(unique_table())])

    async def create() -> None:
        async with engine.begin() as conn:
            await create_outbox_tables(conn, app.metadata)

    await asyncio.gather(*(create() for _ in range(3)))
    assert await count(engine, app.table().name) == 0


async def test_notification_only_for_committed_rows(servers, engine, app) -> None:
    """The NOTIFY trigger announces a committed row (shard and highest id), never a rolled-back
    one."""
    table = app.table().name
    url = libpq_url(sqlalchemy_url(servers.database_url))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {notify_channel(table)}")
        async with engine.connect() as conn:
            await app.write_async(conn, **CORE)
            await conn.rollback()
        async with engine.begin() as conn:
            first = await app.write_async(conn, **CORE)
            second = await app.write_async(
                conn, category=Category.USER_UPDATE, shard_identifier=3, object_identifier=1
            )
        received = [n.payload async for n in listener.notifies(timeout=5, stop_after=2)]
    assert len(received) == 2  # one per INSERT statement, none for the rolled-back one
    assert json.loads(received[0]) == [[int(Scope.ORGANIZATION), 7, first]]
    assert json.loads(received[1]) == [[int(Scope.USER), 3, second]]


async def test_reserved_words_are_refused_as_table_names(engine) -> None:
    """Every word PostgreSQL reserves for table names is refused when the table is declared,
    not when its DDL fails."""
    async with engine.connect() as conn:
        words = (
            (
                await conn.execute(
                    text("SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')")
                )
            )
            .scalars()
            .all()
        )
    assert "user" in words and "select" in words
    for word in words:
        with pytest.raises(RegistryError):
            OutboxTable(word)
