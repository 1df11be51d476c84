"""Every SQL statement outbox-bridge runs against an outbox table, named and kept in one place.

All statements are SQLAlchemy Core constructs with bound parameters; table names come from the
registry, which accepts only plain identifiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Row,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    delete,
    exists,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN
from outbox_bridge.workflows.models import ShardRef


@dataclass(frozen=True)
class GroupRows:
    """A coalescing group as read at the head of a shard: every visible id, ascending."""

    category: int
    object_identifier: int
    ids: list[int]

    @property
    def first_id(self) -> int:
        return self.ids[0]

    @property
    def last_id(self) -> int:
        return self.ids[-1]


@dataclass(frozen=True)
class ShardHeadInfo:
    highest_id: int | None
    barrier_id: int | None
    deferred_until: datetime | None


@dataclass(frozen=True)
class ShardRange:
    """A shard with pending rows, as seen by a sweep."""

    region: str | None
    scope: int
    shard_identifier: int
    min_id: int
    max_id: int
    rows: int = 0


def _any_id(ids: Sequence[int]) -> ColumnElement[Any]:
    # One array parameter, not one parameter per id: groups can hold many thousand rows.
    return any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger)))


def shard_where(table: Table, shard: ShardRef) -> ColumnElement[bool]:
    clauses = [
        table.c.shard_scope == shard.scope,
        table.c.shard_identifier == shard.shard_identifier,
    ]
    if "region" in table.c:
        clauses.insert(0, table.c.region == shard.region)
    return and_(*clauses)


def lock_key(shard: ShardRef) -> str:
    return f"outbox:{shard.table}:{shard.region or ''}:{shard.scope}:{shard.shard_identifier}"


async def try_lock_shard(conn: AsyncConnection, shard: ShardRef) -> bool:
    """Take the session-level advisory lock of ``shard`` if it is free.

    It is held by the connection, not a transaction, so no transaction stays open while a
    handler runs; it is released on unlock or when the connection closes (a crashed worker).
    """
    result = await conn.execute(
        text("SELECT pg_try_advisory_lock(hashtextextended(:key, 0))"), {"key": lock_key(shard)}
    )
    return bool(result.scalar_one())


async def unlock_shard(conn: AsyncConnection, shard: ShardRef) -> bool:
    result = await conn.execute(
        text("SELECT pg_advisory_unlock(hashtextextended(:key, 0))"), {"key": lock_key(shard)}
    )
    return bool(result.scalar_one())


async def read_shard_head_info(
    conn: AsyncConnection, table: Table, shard: ShardRef
) -> ShardHeadInfo:
    """The shard's highest id, and its first row not yet due (the barrier that keeps order)."""
    where = shard_where(table, shard)
    stats = (
        await conn.execute(
            select(
                func.max(table.c.id),
                func.min(table.c.id).filter(table.c.scheduled_for > func.now()),
            ).where(where)
        )
    ).one()
    highest, barrier = stats
    deferred_until = None
    if barrier is not None:
        deferred_until = (
            await conn.execute(select(table.c.scheduled_for).where(table.c.id == barrier))
        ).scalar_one_or_none()
    return ShardHeadInfo(highest_id=highest, barrier_id=barrier, deferred_until=deferred_until)


async def read_pending_up_to(
    conn: AsyncConnection, table: Table, shard: ShardRef, up_to_id: int
) -> tuple[bool, datetime | None]:
    """Whether rows of the shard up to ``up_to_id`` are pending, and if the first of them not
    yet due is among them, when it is due (the shard waits for it)."""
    where = and_(shard_where(table, shard), table.c.id <= up_to_id)
    barrier = (
        select(table.c.scheduled_for)
        .where(where, table.c.scheduled_for > func.now())
        .order_by(table.c.id)
        .limit(1)
        .scalar_subquery()
    )
    pending, deferred_until = (await conn.execute(select(exists().where(where), barrier))).one()
    return bool(pending), deferred_until


async def read_shard_max_id(conn: AsyncConnection, table: Table, shard: ShardRef) -> int | None:
    """The shard's highest pending id, if it has rows."""
    result = await conn.execute(select(func.max(table.c.id)).where(shard_where(table, shard)))
    value = result.scalar_one()
    return int(value) if value is not None else None


async def read_head(
    conn: AsyncConnection, table: Table, shard: ShardRef, *, barrier_id: int | None, limit: int
) -> tuple[list[GroupRows], dict[int, Row[Any]]]:
    """The first ``limit`` coalescing groups of the shard, ordered by their lowest pending id,
    with every due id below the barrier, and the newest row of each (the one its handler gets),
    in one statement."""
    where = shard_where(table, shard)
    if barrier_id is not None:
        where = and_(where, table.c.id < barrier_id)
    first_id = func.min(table.c.id).label("first_id")
    head = (
        select(
            first_id,
            func.max(table.c.id).label("last_id"),
            func.array_agg(table.c.id).label("group_ids"),
        )
        .where(where)
        .group_by(table.c.category, table.c.object_identifier)
        .order_by(first_id)
        .limit(limit)
        .subquery("head")
    )
    query = (
        select(head.c.group_ids, table)
        .join_from(head, table, table.c.id == head.c.last_id)
        .order_by(head.c.first_id)
    )
    groups, rows = [], {}
    for row in await conn.execute(query):
        groups.append(GroupRows(row.category, row.object_identifier, sorted(row.group_ids)))
        rows[row.id] = row
    return groups, rows


async def read_trace_contexts(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, Any]:
    """The stored producer trace context of each of ``ids`` that has one (read only when
    tracing is on)."""
    if not ids:
        return {}
    column = table.c[TRACE_CONTEXT_COLUMN]
    result = await conn.execute(
        select(table.c.id, column).where(table.c.id == _any_id(ids), column.is_not(None))
    )
    return {row_id: carrier for row_id, carrier in result}


async def read_oldest_ages(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, float]:
    """Per scope, the age in seconds (by the database's clock) of the oldest of ``ids``: the
    sweep passes each shard's lowest pending id, so this costs one index lookup per shard
    rather than a scan of the table."""
    if not ids:
        return {}
    age = func.extract("epoch", func.max(func.now() - table.c.date_added))
    result = await conn.execute(
        select(table.c.shard_scope, age)
        .where(table.c.id == _any_id(ids))
        .group_by(table.c.shard_scope)
    )
    return {int(scope): float(seconds) for scope, seconds in result}


async def delete_rows(conn: AsyncConnection, table: Table, ids: Sequence[int]) -> int:
    """Delete exactly the rows a handler covered: rows committed meanwhile survive, even with a
    lower id (a late commit), and are handled next round."""
    if not ids:
        return 0
    result = await conn.execute(delete(table).where(table.c.id == _any_id(ids)))
    return int(result.rowcount)


def _shard_key_columns(table: Table) -> list[Any]:
    cols = [table.c.shard_scope, table.c.shard_identifier]
    if "region" in table.c:
        cols.insert(0, table.c.region)
    return cols


async def read_shard_ranges(
    conn: AsyncConnection,
    table: Table,
    *,
    after_id: int | None = None,
    regions: Sequence[str] | None = None,
) -> list[ShardRange]:
    """Shards with rows (with ``after_id``, only rows above it), with their id range."""
    keys = _shard_key_columns(table)
    query = select(*keys, func.min(table.c.id), func.max(table.c.id), func.count()).group_by(*keys)
    if after_id is not None:
        query = query.where(table.c.id > after_id)
    if regions is not None and "region" in table.c:
        query = query.where(
            table.c.region == any_(bindparam("regions", list(regions), type_=ARRAY(Text)))
        )
    ranges = []
    for row in await conn.execute(query):
        values = tuple(row)
        region = values[0] if "region" in table.c else None
        scope, ident, lo, hi, rows = values[-5:]
        ranges.append(ShardRange(region, scope, ident, lo, hi, rows))
    return ranges


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
    oldest_first: bool = False,
    limit: int = 20,
) -> list[ShardDepth]:
    """The deepest shards (or those with the oldest pending row), one aggregate query."""
    keys = _shard_key_columns(table)
    rows = func.count().label("rows")
    oldest = func.min(table.c.date_added).label("oldest")
    groups = func.count(func.distinct(func.row(table.c.category, table.c.object_identifier)))
    query = select(*keys, rows, groups.label("groups"), oldest).group_by(*keys)
    if scope is not None:
        query = query.where(table.c.shard_scope == scope)
    query = query.order_by(oldest.asc() if oldest_first else rows.desc()).limit(limit)
    depths = []
    for row in await conn.execute(query):
        region = row.region if "region" in table.c else None
        depths.append(
            ShardDepth(
                region, row.shard_scope, row.shard_identifier, row.rows, row.groups, row.oldest
            )
        )
    return depths
