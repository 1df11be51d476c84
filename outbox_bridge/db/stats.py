"""The outbox tables' statistics: the rows inserted and deleted (for the worker's summary), and
whether the planner has what it needs.

The row counts are read from ``pg_stat_user_tables``, never the tables: backends report these
cumulative counts at most once a second (within about ten seconds when idle), so they lag; good
for a rate over a few seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import BigInteger, Table, column, func, select, table, text
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


# A table with at least this many rows and no planner statistics gets analyzed: below it, the
# plans that statistics would change cost little either way.
STATISTICS_MIN_ROWS = 1_000


async def lacks_statistics(conn: AsyncConnection, table: Table) -> bool:
    """Whether ``table`` holds :data:`STATISTICS_MIN_ROWS` rows or more and no statistics on
    its shard columns. Without them the planner may range-scan a deep shard once per group of
    every round (a 20,000-row shard drained at 420 rows/s instead of 11,000)."""
    result = await conn.execute(
        text(
            f"""
            SELECT NOT EXISTS (
                SELECT 1 FROM pg_stats s
                JOIN pg_namespace n ON n.nspname = s.schemaname
                JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = s.tablename
                WHERE c.oid = to_regclass(:table) AND s.attname = 'shard_identifier'
            ) AND (SELECT count(*) FROM (SELECT 1 FROM {table.name} LIMIT :rows) r) >= :rows
            """
        ),
        {"table": table.name, "rows": STATISTICS_MIN_ROWS},
    )
    return bool(result.scalar())


async def analyze(conn: AsyncConnection, table: Table) -> None:
    """Gather ``table``'s planner statistics (needs the table's owner, or the MAINTAIN
    privilege from PostgreSQL 17)."""
    await conn.execute(text(f"ANALYZE {table.name}"))
