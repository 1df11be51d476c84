"""The deletes of handled rows, and the statements a round runs on the driver's connection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy import Table, delete, func, select
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.driver import run
from outbox_bridge.db.locks import UNLOCK_SHARDS, lock_key
from outbox_bridge.db.reads import any_id
from outbox_bridge.workflows.models import ShardRef


async def delete_handled(conn: AsyncConnection, table: Table, ids: Sequence[int]) -> list[int]:
    """Delete exactly the rows ``ids`` a handler covered (rows committed meanwhile survive,
    even with a lower id: a late commit runs next round); returns the ids deleted."""
    if not ids:
        return []
    result = await conn.execute(_delete_statement(table, ids))
    return list(result.scalars())


def _delete_statement(table: Table, ids: Sequence[int]) -> Any:
    return delete(table).where(table.c.id == any_id(ids)).returning(table.c.id)


class DriverWrites:
    """:func:`delete_handled` and :func:`unlock_shards` of one table, compiled once and run on
    the psycopg connection: SQLAlchemy's share (compiling, a greenlet, result rows) was most
    of their cost.

    Each delete commits asynchronously (no WAL flush, about 40% of its time): only a crash of
    PostgreSQL within the WAL writer's delay undoes it, and its rows run again, as
    at-least-once allows. Ownership changes commit synchronously, making earlier deletes
    durable too.
    """

    def __init__(self, table: Table, dialect: Dialect) -> None:
        asynchronous = select(func.set_config("synchronous_commit", "off", True)).scalar_subquery()
        statement = _delete_statement(table, []).where(asynchronous.is_not(None))
        delete_ = statement.compile(dialect=dialect)
        self._delete = str(delete_)
        self._delete_params = dict(delete_.params)
        self._unlock = str(UNLOCK_SHARDS.compile(dialect=dialect))

    async def delete_handled(
        self, driver: psycopg.AsyncConnection[Any], ids: Sequence[int]
    ) -> list[int]:
        if not ids:
            return []
        params = {**self._delete_params, "ids": list(ids)}
        return [row[0] for row in await run(driver, self._delete, params)]

    async def unlock_shards(
        self, driver: psycopg.AsyncConnection[Any], shards: Sequence[ShardRef]
    ) -> None:
        if shards:
            await run(driver, self._unlock, {"keys": [lock_key(s) for s in shards]})


_DRIVER_WRITES: dict[tuple[Table, str], DriverWrites] = {}


def driver_writes(table: Table, dialect: Dialect) -> DriverWrites:
    """The :class:`DriverWrites` of ``table`` (made once per table and dialect)."""
    key = (table, dialect.name)
    if key not in _DRIVER_WRITES:
        _DRIVER_WRITES[key] = DriverWrites(table, dialect)
    return _DRIVER_WRITES[key]
