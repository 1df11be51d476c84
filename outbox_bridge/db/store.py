"""Which shards their own workflow holds (the partitions leave those alone).

All statements are SQLAlchemy Core constructs with bound parameters; table names come from the
registry, which accepts only plain identifiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Table, delete, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.reads import SKIPPED_HOLD
from outbox_bridge.db.reads import visible as _visible
from outbox_bridge.db.scans import FirstRow
from outbox_bridge.db.scans import first_row_columns as _first_row_columns
from outbox_bridge.db.scans import shard_key_columns as _shard_key_columns
from outbox_bridge.db.scans import with_region as _with_region
from outbox_bridge.db.schema import owners_of, shard_values, shard_where
from outbox_bridge.workflows.models import ShardRef

# -- shard ownership ------------------------------------------------------------------------------


async def hold_shard(
    conn: AsyncConnection, table: Table, shard: ShardRef, held_for: str, *, over_skip: bool = False
) -> None:
    """Record that ``shard``'s own workflow holds it, and why (partitions leave it alone until
    :func:`release_shard`). Call it under the shard's lock. A skip is replaced only by another
    skip, or with ``over_skip`` (the workflow's own skip and resume): a drain that started
    before the skip never undoes it."""
    owners = owners_of(table)
    insert = pg_insert(owners).values(**shard_values(table, shard), held_for=held_for)
    keeps_skip = held_for != SKIPPED_HOLD and not over_skip
    await conn.execute(
        insert.on_conflict_do_update(
            index_elements=list(owners.primary_key.columns),
            set_={"held_for": insert.excluded.held_for},
            where=owners.c.held_for != SKIPPED_HOLD if keeps_skip else None,
        )
    )


async def hold_free_shards(
    conn: AsyncConnection, table: Table, shards: Sequence[ShardRef], held_for: str
) -> list[ShardRef]:
    """Hold those of ``shards`` no workflow holds yet, in one statement, and return them (the
    others keep their reason). Call it under the shards' locks."""
    if not shards:
        return []
    owners = owners_of(table)
    insert = (
        pg_insert(owners)
        .values([{**shard_values(table, shard), "held_for": held_for} for shard in shards])
        .on_conflict_do_nothing(index_elements=list(owners.primary_key.columns))
        .returning(*_shard_key_columns(owners))
    )
    held = {tuple(row) for row in await conn.execute(insert)}
    return [s for s in shards if tuple(shard_values(table, s).values()) in held]


async def release_shard(conn: AsyncConnection, table: Table, shard: ShardRef) -> bool:
    """Give ``shard`` back to its partition (under the shard's lock). False if it was not
    held, or held because it is skipped (only a resume ends a skip)."""
    owners = owners_of(table)
    result = await conn.execute(
        delete(owners).where(shard_where(owners, shard), owners.c.held_for != SKIPPED_HOLD)
    )
    return bool(result.rowcount)


@dataclass(frozen=True)
class HeldShard:
    """A shard its own workflow holds, as the sweep sees it."""

    region: str | None
    scope: int
    shard_identifier: int
    held_for: str
    since: datetime
    head: FirstRow | None  # its first row, if it has any


async def read_held_shards(conn: AsyncConnection, table: Table) -> list[HeldShard]:
    """Every shard of ``table`` a workflow holds, with its head row (one index lookup each)."""
    owners = owners_of(table)
    head = (
        select(*_first_row_columns(table))
        .where(*(table.c[c.name] == c for c in _shard_key_columns(owners)))
        .where(_visible(table))
        .order_by(table.c.id)
        .limit(1)
        .lateral("head")
    )
    query = select(
        *_shard_key_columns(owners),
        owners.c.held_for,
        owners.c.since,
        *head.c,
    ).select_from(owners.outerjoin(head, text("true")))
    held = []
    for row in await conn.execute(query):
        region, scope, ident, held_for, since, head_id, category, obj, due = _with_region(
            table, row
        )
        first = None if head_id is None else FirstRow(head_id, category, obj, bool(due))
        held.append(HeldShard(region, scope, ident, held_for, since, first))
    return held
