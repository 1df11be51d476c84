"""What the outbox admin reads and changes: the command line's statements (``db/``), on a
connection of the admin's own, and the shard workflows told of a park or an unpark as the
command line tells them. Every change records ``by``, the admin user, never a typed name."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy import Table, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from outbox_bridge.config import OutboxSettings, safe_url, sqlalchemy_url
from outbox_bridge.db.ownership import read_held_shards
from outbox_bridge.db.parked import ParkedGroup, park_head_locked, read_parked, unpark
from outbox_bridge.db.pauses import Pause, PauseEnd, add_pause, read_pauses, read_shard_pause
from outbox_bridge.db.pauses import remove_pause as remove_pause_row
from outbox_bridge.db.scans import read_shard_depths
from outbox_bridge.errors import ConfigurationError, NothingParkedError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.pause_control import member_name
from outbox_bridge.runtime.shards import wake_shard
from outbox_bridge.runtime.temporal import connect, temporal_address
from outbox_bridge.workflows.models import PauseKind, ShardRef

FREE = "free"


@dataclass(frozen=True)
class ShardLine:
    """A shard with pending rows as the admin lists it (no payload: rows are counted)."""

    ref: ShardRef
    rows: int
    groups: int
    oldest_age_seconds: float
    owner: str  # free, held (failed|deferred|workflow), skipped
    paused: str  # the pause its first row not due waits for, if any: kind, name, who, why
    parked_groups: int


@contextlib.asynccontextmanager
async def connected(settings: OutboxSettings, table: Table) -> AsyncIterator[AsyncConnection]:
    """A connection to the outbox's database, closed after; a database error in the block
    becomes a :class:`ConfigurationError` that names the table and the database, never the
    password."""
    if settings.database_url is None:
        raise ConfigurationError("no outbox database: set OUTBOX_BRIDGE['DATABASE'] or DATABASES")
    engine = create_async_engine(sqlalchemy_url(settings.database_url.get_secret_value()))
    try:
        async with engine.connect() as conn:
            yield conn
    except SQLAlchemyError as exc:
        reason = " ".join(str(getattr(exc, "orig", None) or exc).split())
        raise ConfigurationError(
            f"cannot use table {table.name} in {safe_url(engine.url)}: {reason}. Check that "
            "its migration ran (CreateOutbox) and the database role's grants"
        ) from None
    finally:
        await engine.dispose()


def shard_ref(
    app: OutboxApp, table: Table, scope: int, identifier: int, region: str | None
) -> ShardRef:
    return ShardRef(table.name, scope, app.scope_name(scope), identifier, region)


async def read_shards(
    settings: OutboxSettings,
    app: OutboxApp,
    table: Table,
    *,
    shard_identifier: int | None,
    offset: int,
    limit: int,
) -> list[ShardLine]:
    """The shards with pending rows, deepest first, from ``offset``: what ``outbox-bridge
    shards`` reads in the table, with each shard's owner state."""
    async with connected(settings, table) as conn:
        depths = await read_shard_depths(
            conn, table, shard_identifier=shard_identifier, offset=offset, limit=limit
        )
        now = (await conn.execute(select(func.now()))).scalar_one()
        held = {
            (h.region, h.scope, h.shard_identifier): h for h in await read_held_shards(conn, table)
        }
        parked = Counter(group.shard for group in await read_parked(conn, table))
        lines = []
        for depth in depths:
            key = (depth.region, depth.scope, depth.shard_identifier)
            ref = shard_ref(app, table, depth.scope, depth.shard_identifier, depth.region)
            owner = held[key].held_for if key in held else FREE
            lines.append(
                ShardLine(
                    ref,
                    depth.rows,
                    depth.groups,
                    (now - depth.oldest).total_seconds(),
                    owner if owner in (FREE, "skipped") else f"held ({owner})",
                    _paused(app, await read_shard_pause(conn, table, ref)),
                    parked[key],
                )
            )
    return lines


def _paused(app: OutboxApp, pause: Pause | None) -> str:
    if pause is None:
        return ""
    name = member_name(app, pause.kind, pause.number)
    return f"{pause.kind} {name} by {pause.paused_by}: {pause.reason}"


async def read_table_pauses(settings: OutboxSettings, table: Table) -> list[Pause]:
    async with connected(settings, table) as conn:
        return await read_pauses(conn, table)


async def read_table_parked(settings: OutboxSettings, table: Table) -> list[ParkedGroup]:
    async with connected(settings, table) as conn:
        return await read_parked(conn, table)


async def pause(
    settings: OutboxSettings,
    table: Table,
    target: tuple[PauseKind, int],
    *,
    reason: str,
    by: str,
    end: PauseEnd | None,
) -> Pause:
    """Pause a category or a scope, as ``outbox-bridge pause`` does."""
    async with connected(settings, table) as conn, conn.begin():
        return await add_pause(conn, table, *target, reason, by, end=end)


async def unpause(
    settings: OutboxSettings, table: Table, target: tuple[PauseKind, int]
) -> Pause | None:
    """Resume a category or a scope, as ``outbox-bridge unpause`` does (None: not paused)."""
    async with connected(settings, table) as conn, conn.begin():
        return await remove_pause_row(conn, table, *target)


async def park(
    settings: OutboxSettings, app: OutboxApp, table: Table, shard: ShardRef, *, reason: str, by: str
) -> ParkedGroup:
    """Park ``shard``'s head group under the shard's lock, then wake its workflow, as
    ``outbox-bridge park`` does (Temporal first: nothing is parked when it cannot be told)."""
    client = await connect(settings, temporal_address(settings))
    async with connected(settings, table) as conn:
        parked = await park_head_locked(conn, table, shard, reason=reason, by=by)
    await wake_shard(client, shard, f"parked {group_text(app, parked)} by {by}: {reason}")
    return parked


async def put_back(
    settings: OutboxSettings,
    app: OutboxApp,
    table: Table,
    shard: ShardRef,
    *,
    group: tuple[int, int],
    by: str,
) -> list[ParkedGroup]:
    """Unpark one parked group of ``shard`` and wake its workflow, as ``outbox-bridge unpark
    --group`` does."""
    client = await connect(settings, temporal_address(settings))
    async with connected(settings, table) as conn, conn.begin():
        groups = await unpark(conn, table, shard, by=by, group=group)
    if not groups:
        raise NothingParkedError(
            f"shard {shard.key} has no parked group {group[0]}:{group[1]} in table {table.name}"
        )
    await wake_shard(client, shard, f"unparked {group_text(app, groups[0])} by {by}")
    return groups


def group_text(app: OutboxApp, group: ParkedGroup) -> str:
    return f"{app.category_name(group.category)} object={group.object_identifier}"
