"""Parked coalescing groups (set aside by an operator so that their shard goes on): every
statement about them.

A parked group's rows, later ones of the same object included, stay in the outbox table; every
read that picks what a drain handles next leaves them out (:func:`not_parked`). Unparked, with
their ids unchanged, they head the shard again; the ``<table>_parked`` row stays as the audit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, func, literal, null, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.locks import lock_shard_waiting, unlock_shards
from outbox_bridge.db.schema import (
    PARKED_ROLE,
    SESSION_USER,
    UNPARKED_ROLE,
    notify_channel,
    parked_of,
    shard_columns,
    shard_where,
)
from outbox_bridge.errors import NothingToParkError, ShardLockedError
from outbox_bridge.workflows.models import ShardRef

# The columns that name a coalescing group, after the shard's.
GROUP_COLUMNS = ("category", "object_identifier")
# How long a park waits for a drain of the shard (a handler call under way) to end.
PARK_LOCK_WAIT_SECONDS = 30.0


def not_parked(table: Table, alias: str) -> str:
    """SQL, true when the row ``alias`` of ``table`` is in no parked group: for the WHERE of
    each read that picks the rows a drain handles next."""
    parked = parked_of(table).name
    columns = [*shard_columns("region" in table.c), *GROUP_COLUMNS]
    same = " AND ".join(f"pk.{c} = {alias}.{c}" for c in columns)
    # The first test runs once per statement (an uncorrelated subquery): while nothing is
    # parked, no row pays for the lookup of its group.
    return (
        f"((SELECT NOT EXISTS (SELECT 1 FROM {parked} WHERE unparked_at IS NULL)) "
        f"OR NOT EXISTS (SELECT 1 FROM {parked} pk WHERE {same} AND pk.unparked_at IS NULL))"
    )


@dataclass(frozen=True)
class ParkedGroup:
    """A parked group's audit record, and how many of its rows are in the table now."""

    region: str | None
    scope: int
    shard_identifier: int
    category: int
    object_identifier: int
    first_id: int
    reason: str
    parked_by: str
    parked_at: datetime
    unparked_by: str | None
    unparked_at: datetime | None
    parked_role: str  # the role PostgreSQL authenticated, beside the declared parked_by
    unparked_role: str | None
    rows: int

    @property
    def shard(self) -> tuple[str | None, int, int]:
        return (self.region, self.scope, self.shard_identifier)


def _record(table: Table) -> list[Any]:
    """A parked group's columns, led by its region (NULL in a table without one), and its rows
    in the outbox table."""
    parked = parked_of(table)
    same_group = [*shard_columns("region" in table.c), *GROUP_COLUMNS]
    rows = select(func.count()).where(*(table.c[c] == parked.c[c] for c in same_group))
    region = parked.c.region if "region" in parked.c else null()
    return [
        region,
        *(parked.c[c] for c in ("shard_scope", "shard_identifier", *GROUP_COLUMNS, "first_id")),
        *(parked.c[c] for c in ("reason", "parked_by", "parked_at", "unparked_by", "unparked_at")),
        *(parked.c[c] for c in (PARKED_ROLE, UNPARKED_ROLE)),
        rows.scalar_subquery(),
    ]


async def park_head(
    conn: AsyncConnection, table: Table, shard: ShardRef, *, reason: str, by: str
) -> ParkedGroup | None:
    """Park the group that heads ``shard`` (its first row not parked), in one statement; None
    if there is none. Run it under the shard's lock: no drain is handling the group."""
    parked = parked_of(table)
    keys = [*shard_columns("region" in table.c), *GROUP_COLUMNS]
    head = (
        select(*(table.c[c] for c in keys), table.c.id, literal(reason), literal(by))
        .where(shard_where(table, shard), text(not_parked(table, table.name)))
        .order_by(table.c.id)
        .limit(1)
    )
    statement = (
        pg_insert(parked)
        .from_select([*keys, "first_id", "reason", "parked_by"], head)
        .returning(parked.c.id)
    )
    new_id = (await conn.execute(statement)).scalar_one_or_none()
    if new_id is None:
        return None
    [group] = await _read(conn, table, parked.c.id == new_id)
    return group


async def park_head_locked(
    conn: AsyncConnection, table: Table, shard: ShardRef, *, reason: str, by: str
) -> ParkedGroup:
    """:func:`park_head` under the shard's lock, waited for :data:`PARK_LOCK_WAIT_SECONDS` at
    most (a drain under way ends first), committed; raises if there is no group to park."""
    if not await lock_shard_waiting(conn, shard, PARK_LOCK_WAIT_SECONDS):
        raise ShardLockedError(
            f"shard {shard.key} is being drained (a handler call has run for over "
            f"{PARK_LOCK_WAIT_SECONDS:.0f} s); nothing was parked, try again"
        )
    try:
        parked = await park_head(conn, table, shard, reason=reason, by=by)
        await conn.commit()
    finally:
        await conn.rollback()  # what a failed statement left: the unlock needs a transaction
        await unlock_shards(conn, [shard])
        await conn.commit()
    if parked is None:
        raise NothingToParkError(
            f"shard {shard.key} has no row to park in table {table.name} (no pending rows, or "
            "all of them are parked: see `outbox-bridge parked`)"
        )
    return parked


async def unpark(
    conn: AsyncConnection,
    table: Table,
    shard: ShardRef,
    *,
    by: str,
    group: tuple[int, int] | None = None,
) -> list[ParkedGroup]:
    """Put ``shard``'s parked groups (only ``group``, a (category, object identifier), if
    given) back and return them, recording who and when; at commit, a notification wakes the
    bridge."""
    parked = parked_of(table)
    where = [shard_where(parked, shard), parked.c.unparked_at.is_(None)]
    if group is not None:
        where += [parked.c.category == group[0], parked.c.object_identifier == group[1]]
    statement = (
        update(parked)
        .where(*where)
        .values(unparked_at=func.now(), unparked_by=by, **{UNPARKED_ROLE: SESSION_USER})
        .returning(parked.c.id)
    )
    ids = list((await conn.execute(statement)).scalars())
    if not ids:
        return []
    groups = await _read(conn, table, parked.c.id.in_(ids))
    first = min(g.first_id for g in groups)
    entry = [*([shard.region] if "region" in table.c else []), shard.scope, shard.shard_identifier]
    await conn.execute(
        text("SELECT pg_notify(:channel, :message)"),
        {"channel": notify_channel(table.name), "message": json.dumps([[*entry, first]])},
    )
    return groups


async def read_parked(
    conn: AsyncConnection,
    table: Table,
    shard: ShardRef | None = None,
    *,
    with_unparked: bool = False,
) -> list[ParkedGroup]:
    """The parked groups of ``table`` (of ``shard`` only, if given), oldest first; with
    ``with_unparked``, the records of groups put back too."""
    parked = parked_of(table)
    where: list[Any] = [] if shard is None else [shard_where(parked, shard)]
    if not with_unparked:
        where.append(parked.c.unparked_at.is_(None))
    return await _read(conn, table, *where)


async def _read(conn: AsyncConnection, table: Table, *where: Any) -> list[ParkedGroup]:
    parked = parked_of(table)
    query = select(*_record(table)).where(*where).order_by(parked.c.parked_at, parked.c.id)
    return [ParkedGroup(*row) for row in await conn.execute(query)]
