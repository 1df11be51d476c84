"""How the commands show parked groups (``parked``, ``status``, ``shards``)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from rich.table import Table
from sqlalchemy import Table as SqlTable
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.cli.connections import connected, shard_app
from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.parked import ParkedGroup, read_parked
from outbox_bridge.db.schema import parked_of
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardRef


def group_text(group: ParkedGroup, app: OutboxApp | None) -> str:
    category = app.category_name(group.category) if app is not None else str(group.category)
    return f"{category} object={group.object_identifier}"


def shard_key(group: ParkedGroup, app: OutboxApp | None) -> str:
    scope = app.scope_name(group.scope) if app is not None else str(group.scope)
    return f"{group.region + ':' if group.region else ''}{scope}:{group.shard_identifier}"


def parked_table(
    groups: list[ParkedGroup], app: OutboxApp | None, *, title: str, one_shard: bool = False
) -> Table:
    """Parked groups as a table: with a shard column unless they are ``one_shard``'s (as
    ``status`` shows them), with an unparked column if one was put back."""
    columns = ["group", "rows", "parked", "by", "reason"]
    if not one_shard:
        columns.insert(0, "shard")
    if any(group.unparked_at is not None for group in groups):
        columns.append("unparked")
    view = Table(title=title)
    for column in columns:
        view.add_column(column, justify="right" if column == "rows" else "left")
    for group in groups:
        unparked = ""
        if group.unparked_at is not None:
            unparked = f"{_utc(group.unparked_at)} by {group.unparked_by}"
        values = {
            "shard": shard_key(group, app),
            "group": group_text(group, app),
            "rows": str(group.rows),
            "parked": _utc(group.parked_at),
            "by": group.parked_by,
            "reason": group.reason,
            "unparked": unparked,
        }
        view.add_row(*(values[column] for column in columns))
    return view


def _utc(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


async def shard_parked(settings: OutboxSettings, shard: ShardRef) -> list[ParkedGroup] | str:
    """The parked groups of ``shard``, or why they cannot be read (no database configured,
    tables not created): ``status`` shows the workflow whatever the database says."""
    try:
        async with connected(settings, shard.table) as conn:
            return await read_parked(conn, shard_app(settings, shard).table(shard.table), shard)
    except ConfigurationError as exc:
        return str(exc)


async def parked_per_shard(
    conn: AsyncConnection, table: SqlTable
) -> Counter[tuple[str | None, int, int]]:
    """How many groups each shard has parked (none before a worker of this version created
    the table's parked-group table)."""
    found = await conn.execute(
        text("SELECT to_regclass(:name) IS NOT NULL"), {"name": parked_of(table).name}
    )
    if not found.scalar():
        return Counter()
    return Counter(group.shard for group in await read_parked(conn, table))
