"""Statements run on psycopg's own connection, under a SQLAlchemy connection that holds it.

A round's few statements before its first handler call (lock, windows, rows) and its writes
are compiled once per table and sent straight to the driver: SQLAlchemy's share of a small
statement (a greenlet, the execution context, result rows) was about as large as the database's,
and under light traffic every row waits for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import RowFactory, tuple_row
from sqlalchemy import Select, TextClause
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

# What the statements run on the driver are compiled for (the worker's engines use psycopg).
_DIALECT: Dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]


def driver_of(conn: AsyncConnection) -> psycopg.AsyncConnection[Any] | None:
    """The psycopg connection under ``conn``, if it is checked out and usable as it is (no
    reconnect needed: that takes SQLAlchemy's own path, as does anything that only acts like
    an ``AsyncConnection``, such as the testing toolkit's sync drain)."""
    sync = conn.sync_connection if isinstance(conn, AsyncConnection) else None
    if sync is None or sync.closed or sync.invalidated:
        return None
    driver = sync.connection.driver_connection
    return driver if isinstance(driver, psycopg.AsyncConnection) else None


async def run(
    driver: psycopg.AsyncConnection[Any],
    statement: str,
    params: dict[str, Any],
    row_factory: RowFactory[Any] = tuple_row,
    *,
    generic_plan: bool = False,
) -> list[Any]:
    """``statement``'s rows; a driver error is raised as SQLAlchemy raises it (callers catch
    those). With ``generic_plan``, the statement is prepared and runs on its generic plan, in
    the same round trip (see :func:`_generic`)."""
    async with driver.cursor(row_factory=row_factory) as cursor:
        try:
            if generic_plan and driver.prepare_threshold is not None:
                await _generic(driver, cursor, statement, params)
            else:
                await cursor.execute(statement, params)
            return await cursor.fetchall()
        except psycopg.Error as exc:
            raise DBAPIError.instance(statement, None, exc, psycopg.Error) from exc


async def _generic(
    driver: psycopg.AsyncConnection[Any],
    cursor: psycopg.AsyncCursor[Any],
    statement: str,
    params: dict[str, Any],
) -> None:
    """Run ``statement`` prepared, on its generic plan: a round's head reads are planned anew
    at every execution otherwise (PostgreSQL keeps custom plans for them, whose estimates
    depend on the shards given), and planning took three times as long as running them for a
    lone shard. ``plan_cache_mode`` is set for this statement alone, in one pipeline: the three
    form one implicit transaction, so a failure rolls the setting back with it. A connection
    set not to prepare (a transaction pooler in front of PostgreSQL) runs it as it is."""
    async with driver.pipeline():
        await cursor.execute("SET plan_cache_mode = force_generic_plan")
        await cursor.execute(statement, params, prepare=True)
        await driver.execute("RESET plan_cache_mode")


@dataclass(frozen=True)
class Compiled:
    """A statement compiled once for psycopg, with SQLAlchemy's construct of it for a
    connection whose driver cannot be used as it is."""

    statement: TextClause | Select[Any]
    sql: str
    defaults: dict[str, Any]

    @classmethod
    def of(cls, statement: TextClause | Select[Any]) -> Compiled:
        compiled = statement.compile(dialect=_DIALECT)
        return cls(statement, str(compiled), dict(compiled.params))


async def rows_of(
    conn: AsyncConnection,
    compiled: Compiled,
    params: dict[str, Any],
    row_factory: RowFactory[Any] = tuple_row,
    *,
    generic_plan: bool = False,
) -> list[Any]:
    """``compiled``'s rows on ``conn``: on its psycopg connection when it can be used as it is,
    else through SQLAlchemy (which reconnects, or raises why it cannot)."""
    driver = driver_of(conn)
    if driver is None:
        return list(await conn.execute(compiled.statement, params))
    params = {**compiled.defaults, **params}
    return await run(driver, compiled.sql, params, row_factory, generic_plan=generic_plan)
