"""The statements a round sends straight to psycopg (``outbox_bridge/db/driver.py``) and the
pool's ping of idle connections (``outbox_bridge/db/disconnects.py``), against the real
PostgreSQL: a head read on its generic plan leaves the session as it found it, also when it
fails, and a connection lost while idle in the pool is replaced before anyone uses it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox_bridge.db.disconnects import connection_lost, ping_idle_connections
from outbox_bridge.db.driver import driver_of, run
from tests.harness import Servers

pytestmark = pytest.mark.asyncio


async def test_a_generic_plan_is_for_its_statement_alone_even_when_it_fails(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")  # as a round's connection
        driver = driver_of(conn)
        assert driver is not None
        rows = await run(driver, "SELECT %(n)s::int + 1", {"n": 41}, generic_plan=True)
        assert rows == [(42,)]
        shown = await run(driver, "SHOW plan_cache_mode", {})
        assert shown == [("auto",)]
        with pytest.raises(DBAPIError, match="division by zero"):
            await run(driver, "SELECT 1 / %(n)s::int", {"n": 0}, generic_plan=True)
        assert await run(driver, "SHOW plan_cache_mode", {}) == [("auto",)]
        # The connection is usable as it was: no transaction left open by the pipeline.
        assert (await conn.execute(text("SELECT 7"))).scalar_one() == 7


async def _backend(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def _terminate(engine: AsyncEngine, pid: int) -> None:
    """End backend ``pid`` and wait until it is gone."""
    async with engine.connect() as conn:
        # Each look in a transaction of its own: a transaction sees one snapshot of the stats.
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        for _ in range(100):
            alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"
            if not (await conn.execute(text(alive), {"pid": pid})).scalar_one():
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"backend {pid} did not end")


@contextlib.asynccontextmanager
async def _pooled(servers: Servers, after: float) -> AsyncIterator[AsyncEngine]:
    """An engine of one pooled connection, pinged when idle ``after`` seconds."""
    pooled = create_async_engine(servers.database_url, pool_size=1, max_overflow=0)
    ping_idle_connections(pooled, after=after)
    try:
        yield pooled
    finally:
        await pooled.dispose()


async def test_a_connection_lost_while_idle_is_replaced_before_it_is_used(
    servers: Servers, engine: AsyncEngine
) -> None:
    async with _pooled(servers, after=0.2) as pooled:
        first = await _backend(pooled)
        await _terminate(engine, first)
        await asyncio.sleep(0.4)  # idle past `after`: pinged at checkout, found lost
        assert await _backend(pooled) != first


async def test_a_connection_used_a_moment_ago_is_not_pinged(
    servers: Servers, engine: AsyncEngine
) -> None:
    # Without the ping, a connection lost right after its last use fails its next statement:
    # that is what tells the ping apart from no ping at all.
    async with _pooled(servers, after=60.0) as pooled:
        pid = await _backend(pooled)
        await _terminate(engine, pid)
        with pytest.raises(DBAPIError) as raised:
            await _backend(pooled)
        assert connection_lost(raised.value)
        assert await _backend(pooled) != pid  # the lost one was dropped: the next is new
