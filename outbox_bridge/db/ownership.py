"""Who may drain a shard: one state machine, kept in ``<table>_owners`` (docs: How processing
works, Ownership).

A shard is *free* (no row: its partition drains it), *held* (``held_for`` failed, deferred or
workflow: its own ``OutboxShard`` workflow drains it) or *skipped* (``held_for`` skipped: nothing
runs until its workflow resumes it). Each transition below is one statement that moves the row
only from the states it may leave and returns what it moved; a shard in any other state is left
as it is. Every transition runs under the shard's advisory lock, so ownership never changes in
the middle of a drain of the shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, delete, select, text, true, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.reads import visible
from outbox_bridge.db.scans import FirstRow, first_row_columns, shard_key_columns, with_region
from outbox_bridge.db.schema import owners_of, shard_values, shard_where
from outbox_bridge.workflows.models import HeldFor, ShardRef

_SKIPPED = HeldFor.SKIPPED.value


def _upsert(table: Table, shards: Sequence[ShardRef], held_for: HeldFor) -> Any:
    owners = owners_of(table)
    rows = [{**shard_values(table, shard), "held_for": held_for.value} for shard in shards]
    return pg_insert(owners).values(rows)


async def hand_over(
    conn: AsyncConnection, table: Table, shards: Sequence[ShardRef], held_for: HeldFor
) -> list[ShardRef]:
    """free → held for ``held_for`` (or skipped), in one statement: returns the shards moved.
    One held or skipped already keeps its row (its workflow has it, or an operator resumed it)."""
    if not shards:
        return []
    owners = owners_of(table)
    insert = _upsert(table, shards, held_for).on_conflict_do_nothing(
        index_elements=list(owners.primary_key.columns)
    )
    moved = {tuple(row) for row in await conn.execute(insert.returning(*shard_key_columns(owners)))}
    return [s for s in shards if tuple(shard_values(table, s).values()) in moved]


async def take(conn: AsyncConnection, table: Table, shard: ShardRef) -> bool:
    """free or held → held by the workflow, for its drain. False when the shard is skipped:
    the row stays, and the drain must handle nothing."""
    owners = owners_of(table)
    return await _moved(conn, _held(table, shard, HeldFor.WORKFLOW, owners.c.held_for != _SKIPPED))


async def skip(conn: AsyncConnection, table: Table, shard: ShardRef) -> bool:
    """any → skipped: from now on no drain takes the shard, its workflow's included."""
    return await _moved(conn, _held(table, shard, HeldFor.SKIPPED))


async def resume(conn: AsyncConnection, table: Table, shard: ShardRef) -> bool:
    """skipped → held by the workflow. False when the shard was not skipped (left as it is)."""
    owners = owners_of(table)
    row = update(owners).where(shard_where(owners, shard), owners.c.held_for == _SKIPPED)
    return await _moved(conn, row.values(held_for=HeldFor.WORKFLOW.value))


async def release(conn: AsyncConnection, table: Table, shard: ShardRef) -> bool:
    """held → free: the shard goes back to its partition. False when it was free, or skipped
    (only a resume ends a skip)."""
    owners = owners_of(table)
    return await _moved(
        conn, delete(owners).where(shard_where(owners, shard), owners.c.held_for != _SKIPPED)
    )


def _held(table: Table, shard: ShardRef, held_for: HeldFor, *where: Any) -> Any:
    """Insert ``shard``'s row held for ``held_for``, or move its row there (if ``where``)."""
    insert = _upsert(table, [shard], held_for)
    return insert.on_conflict_do_update(
        index_elements=list(owners_of(table).primary_key.columns),
        set_={"held_for": insert.excluded.held_for},
        where=and_(true(), *where),
    )


async def _moved(conn: AsyncConnection, statement: Any) -> bool:
    """Run a transition; whether it moved the row."""
    owners = statement.table
    return (await conn.execute(statement.returning(owners.c.held_for))).first() is not None


@dataclass(frozen=True)
class HeldShard:
    """A shard held or skipped, as the sweep sees it."""

    region: str | None
    scope: int
    shard_identifier: int
    held_for: str
    since: datetime
    head: FirstRow | None  # its first row, if it has any


async def read_held_shards(conn: AsyncConnection, table: Table) -> list[HeldShard]:
    """Every shard of ``table`` held or skipped, with its head row (one index lookup each)."""
    owners = owners_of(table)
    head = (
        select(*first_row_columns(table))
        .where(*(table.c[c.name] == c for c in shard_key_columns(owners)))
        .where(visible(table))
        .order_by(table.c.id)
        .limit(1)
        .lateral("head")
    )
    query = select(*shard_key_columns(owners), owners.c.held_for, owners.c.since, *head.c)
    held = []
    for row in await conn.execute(query.select_from(owners.outerjoin(head, text("true")))):
        region, scope, ident, held_for, since, head_id, category, obj, due = with_region(
            owners, row
        )
        first = None if head_id is None else FirstRow(head_id, category, obj, bool(due))
        held.append(HeldShard(region, scope, ident, held_for, since, first))
    return held
