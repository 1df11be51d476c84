"""Rows inserted into and deleted from the outbox tables, for the worker's summary.

Read from ``pg_stat_user_tables``, never the tables: backends report these cumulative counts at
most once a second (within about ten seconds when idle), so they lag; good for a rate over a
few seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import BigInteger, Table, column, func, select, table
from sqlalchemy.ext.asyncio import AsyncConnection

_PG_STAT_USER_TABLES = table(
    "pg_stat_user_tables",
    column("relid"),
    column("n_tup_ins", BigInteger),
    column("n_tup_del", BigInteger),
)


@dataclass(frozen=True)
class RowCounters:
    """Rows inserted into and deleted from some tables since the statistics were reset."""

    inserted: int
    deleted: int


async def read_row_counters(conn: AsyncConnection, tables: Sequence[Table]) -> RowCounters:
    """The rows ever inserted into and deleted from ``tables``, as far as the statistics
    know (deleted rows are handled ones, unless an operator deleted some by hand)."""
    stats = _PG_STAT_USER_TABLES.c
    query = select(
        func.coalesce(func.sum(stats.n_tup_ins), 0), func.coalesce(func.sum(stats.n_tup_del), 0)
    ).where(stats.relid.in_([func.to_regclass(t.name) for t in tables]))
    inserted, deleted = (await conn.execute(query)).one()
    return RowCounters(int(inserted), int(deleted))
