"""What sweeps, the shard workflows and operators read of whole shards: first rows, id ranges,
depths, ages, and the partition a shard belongs to."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    exists,
    func,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, BIT
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.pauses import due_at, not_due
from outbox_bridge.db.reads import by_id, visible
from outbox_bridge.db.schema import shard_columns, shard_where
from outbox_bridge.workflows.models import ShardRef


@dataclass(frozen=True, slots=True)
class ShardRange:
    """A shard with pending rows, as seen by a sweep."""

    region: str | None
    scope: int
    shard_identifier: int
    min_id: int
    max_id: int
    rows: int = 0


async def read_pending_up_to(
    conn: AsyncConnection, table: Table, shard: ShardRef, up_to_id: int
) -> tuple[bool, datetime | None]:
    """Whether rows of the shard up to ``up_to_id`` are pending, and if the first of them not
    yet due (scheduled later, or paused) is among them, when it is due (the shard waits for it).
    Parked rows are not waited for, except row ``up_to_id`` itself."""
    where = and_(shard_where(table, shard), table.c.id <= up_to_id)
    barrier = (
        select(due_at(table))
        .where(where, visible(table), not_due(table))
        .order_by(table.c.id)
        .limit(1)
        .scalar_subquery()
    )
    waited = exists().where(where, or_(visible(table), table.c.id == up_to_id))
    pending, deferred_until = (await conn.execute(select(waited, barrier))).one()
    return bool(pending), deferred_until


@dataclass(frozen=True)
class FirstRow:
    """A shard's first pending row, and whether it may run now (by the database's clock)."""

    id: int
    category: int
    object_identifier: int
    due: bool

    def heads(self, category: int, object_identifier: int) -> bool:
        """Whether this row belongs to the group ``(category, object_identifier)``."""
        return (self.category, self.object_identifier) == (category, object_identifier)


def first_row_columns(table: Table) -> list[Any]:
    return [table.c.id, table.c.category, table.c.object_identifier, ~not_due(table)]


async def read_first_row(conn: AsyncConnection, table: Table, shard: ShardRef) -> FirstRow | None:
    """The shard's first pending row not parked, if it has any (one index lookup)."""
    first = select(*first_row_columns(table)).where(shard_where(table, shard), visible(table))
    row = (await conn.execute(first.order_by(table.c.id).limit(1))).one_or_none()
    return None if row is None else FirstRow(row[0], row[1], row[2], bool(row[3]))


async def read_shard_max_id(conn: AsyncConnection, table: Table, shard: ShardRef) -> int | None:
    """The shard's highest pending id not parked, if it has such rows."""
    highest = select(func.max(table.c.id)).where(shard_where(table, shard), visible(table))
    value: int | None = (await conn.execute(highest)).scalar_one()
    return value


@dataclass(frozen=True)
class ShardPending:
    """A shard's pending rows that are not parked: how many, in how many groups, its lowest id
    and when its oldest was written."""

    rows: int
    groups: int
    lowest_id: int
    oldest: datetime


async def read_shard_pending(
    conn: AsyncConnection, table: Table, shard: ShardRef
) -> ShardPending | None:
    """:class:`ShardPending` of ``shard``, if it has such rows (one aggregate on its index)."""
    groups = func.count(func.distinct(func.row(table.c.category, table.c.object_identifier)))
    query = select(func.count(), groups, func.min(table.c.id), func.min(table.c.date_added))
    found = (await conn.execute(query.where(shard_where(table, shard), visible(table)))).one()
    return None if not found[0] else ShardPending(*found)


async def read_row_ages(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, float]:
    """The age in seconds (by the database's clock) of each of ``ids`` still there."""
    age = func.extract("epoch", func.now() - table.c.date_added)
    return {row_id: float(age) for row_id, age in (await by_id(conn, table, age, ids)).items()}


def shard_key_columns(table: Table) -> list[Any]:
    return [table.c[name] for name in shard_columns("region" in table.c)]


def with_region(table: Table, row: Sequence[Any]) -> tuple[Any, ...]:
    """``row``'s values, led by its region: None in a table without one."""
    values: tuple[Any, ...] = tuple(row)
    return values if "region" in table.c else (None, *values)


# -- partitions -------------------------------------------------------------------------------
# A shard's partition is the first 32 bits of the MD5 of "<region>:<scope>:<identifier>", modulo
# the number of partitions: the same in Python and in SQL, so that a partition's scan returns
# only its own shards.


def partition_number(region: str | None, scope: int, identifier: int, partitions: int) -> int:
    """The partition (of ``partitions``) that drains the shard while it is healthy."""
    digest = hashlib.md5(f"{region or ''}:{scope}:{identifier}".encode(), usedforsecurity=False)
    return int.from_bytes(digest.digest()[:4], "big") % partitions


def _partition_sql(table: Table, partitions: int) -> ColumnElement[Any]:
    """:func:`partition_number` of each row's shard, in SQL."""
    region: Any = func.coalesce(table.c.region, "") if "region" in table.c else ""
    key = func.concat(region, ":", table.c.shard_scope, ":", table.c.shard_identifier)
    first_bits = cast(func.concat("x", func.left(func.md5(key), 8)), BIT(32))
    return cast(first_bits, BigInteger).op("%")(partitions)


async def read_shard_ranges(
    conn: AsyncConnection,
    table: Table,
    *,
    after_id: int | None = None,
    regions: Sequence[str] | None = None,
    partition: tuple[int, int] | None = None,
    limit: int | None = None,
) -> list[ShardRange]:
    """Shards with rows (above ``after_id``, if given) and their id range; with ``partition``
    (number, partitions) only its shards, with ``limit`` that many with the oldest rows."""
    keys = shard_key_columns(table)
    first = func.min(table.c.id)
    query = select(*keys, first, func.max(table.c.id), func.count()).group_by(*keys)
    if after_id is not None:
        query = query.where(table.c.id > after_id)
    if regions is not None and "region" in table.c:
        query = query.where(
            table.c.region == any_(bindparam("regions", list(regions), type_=ARRAY(Text)))
        )
    if partition is not None:
        number, partitions = partition
        query = query.having(_partition_sql(table, partitions) == number)
    if limit is not None:
        query = query.order_by(first).limit(limit)
    return [ShardRange(*with_region(table, row)) for row in await conn.execute(query)]


@dataclass(frozen=True)
class ShardDepth:
    """A shard's backlog: pending rows, coalescing groups, and its oldest row."""

    region: str | None
    scope: int
    shard_identifier: int
    rows: int
    groups: int
    oldest: datetime


async def read_shard_depths(
    conn: AsyncConnection,
    table: Table,
    *,
    scope: int | None = None,
    shard_identifier: int | None = None,
    oldest_first: bool = False,
    limit: int = 20,
    offset: int = 0,
) -> list[ShardDepth]:
    """The deepest shards (or those with the oldest pending row), one aggregate query; a page
    of them from ``offset`` (ties in shard order)."""
    keys = shard_key_columns(table)
    rows = func.count().label("rows")
    oldest = func.min(table.c.date_added).label("oldest")
    groups = func.count(func.distinct(func.row(table.c.category, table.c.object_identifier)))
    query = select(*keys, rows, groups.label("groups"), oldest).group_by(*keys)
    if scope is not None:
        query = query.where(table.c.shard_scope == scope)
    if shard_identifier is not None:
        query = query.where(table.c.shard_identifier == shard_identifier)
    query = query.order_by(oldest.asc() if oldest_first else rows.desc(), *keys)
    query = query.limit(limit).offset(offset)
    return [ShardDepth(*with_region(table, row)) for row in await conn.execute(query)]
