"""Generating workload rows, and creating, filling, counting and dropping benchmark tables.

Rows are ``(shard_scope, shard_identifier, category, object_identifier)`` tuples, generated
deterministically and bulk-inserted with ``COPY`` in list order, so ids follow that order and
both sides of a comparison see identical rows.
"""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from sqlalchemy.pool import NullPool

from bench.app import CATEGORIES, GroupKey, Scope, fails
from outbox_bridge import OutboxApp
from outbox_bridge.config import libpq_url, sqlalchemy_url
from outbox_bridge.db.install import create_outbox_tables

Row = tuple[int, int, int, int]
SCOPE = int(Scope.TENANT)


@dataclass(frozen=True)
class RowSet:
    """Rows in insertion order, and how many coalescing groups (= handler calls) they make."""

    rows: list[Row]
    shards: int

    @property
    def groups(self) -> int:
        return len(self.group_keys())

    def group_keys(self) -> set[GroupKey]:
        return {(r[0], r[1], r[2], r[3]) for r in self.rows}

    def failing_groups(self, share: float) -> set[GroupKey]:
        """The groups whose handler fails (see :func:`bench.app.fails`)."""
        return {group for group in self.group_keys() if fails(group, share)}


def backlog_rows(count: int, shards: int, coalescible: float, seed: int = 1) -> RowSet:
    """``count`` rows spread at random over ``shards``; a ``coalescible`` fraction of them
    reuses the category and object of an earlier row of the same shard."""
    rng = random.Random(seed)
    seen: dict[int, list[tuple[int, int]]] = defaultdict(list)
    rows: list[Row] = []
    for index in range(count):
        shard = rng.randrange(shards) + 1
        earlier = seen[shard]
        if earlier and rng.random() < coalescible:
            category, obj = rng.choice(earlier)
        else:
            category, obj = rng.choice(CATEGORIES), index + 1
            earlier.append((category, obj))
        rows.append((SCOPE, shard, category, obj))
    return RowSet(rows, shards)


def distinct_rows(count: int, shards: int) -> RowSet:
    """``count`` rows, each its own coalescing group, dealt round-robin over ``shards``."""
    rows = [
        (SCOPE, index % shards + 1, CATEGORIES[index % len(CATEGORIES)], index + 1)
        for index in range(count)
    ]
    return RowSet(rows, shards)


def grouped_rows(count: int, groups: int) -> RowSet:
    """``count`` rows of one shard, interleaved over ``groups`` coalescing groups."""
    rows = [
        (SCOPE, 1, CATEGORIES[index % groups % len(CATEGORIES)], index % groups + 1)
        for index in range(count)
    ]
    return RowSet(rows, 1)


def table_name(label: str) -> str:
    clean = "".join(c if c.isalnum() else "_" for c in label.lower())[:24]
    return f"bench_{clean}_{uuid.uuid4().hex[:8]}"


def connect(database_url: str, *, autocommit: bool = False) -> psycopg.Connection:
    return psycopg.connect(libpq_url(sqlalchemy_url(database_url)), autocommit=autocommit)


async def create_table(database_url: str, app: OutboxApp) -> None:
    """Create the app's table with its indexes and NOTIFY trigger, as `init-db` would."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await create_outbox_tables(conn, app.metadata)
    finally:
        await engine.dispose()


def copy_rows(database_url: str, table: str, rows: Sequence[Row]) -> None:
    """Bulk-insert ``rows`` in one transaction with COPY (ids follow the list order)."""
    columns = "shard_scope, shard_identifier, category, object_identifier"
    with connect(database_url) as conn, conn.cursor() as cur:
        with cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cur.execute(f"ANALYZE {table}")


def count_rows(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def drop_table(database_url: str, table: str) -> None:
    with connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"DROP FUNCTION IF EXISTS {table}_notify()")
