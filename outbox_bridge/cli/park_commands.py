"""``park``, ``unpark`` and ``parked``: set a shard's head group aside so that the shard goes
on, put it back in its place in the shard's order, and list what is set aside (also shown by
``status`` and ``shards``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table as View
from sqlalchemy import Table, text
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.client import Client

from outbox_bridge.cli import flags
from outbox_bridge.cli.connections import command_app, connected, named_shard, shard_app, tables_of
from outbox_bridge.cli.failures import run_or_exit
from outbox_bridge.cli.flags import build_settings, settings_options, shard_options, tool_command
from outbox_bridge.config import OutboxSettings, SettingGroup
from outbox_bridge.db.parked import ParkedGroup, park_head_locked, read_parked, unpark
from outbox_bridge.db.schema import parked_of
from outbox_bridge.errors import ConfigurationError, NothingParkedError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import wake_shard
from outbox_bridge.workflows.models import ShardRef

PARK_GROUPS = (SettingGroup.DATABASE, SettingGroup.TEMPORAL, SettingGroup.APP)


@dataclasses.dataclass
class _Shard:
    """A named shard, its outbox table, and the connections to act on it."""

    client: Client
    ref: ShardRef
    table: Table
    conn: AsyncConnection


@contextlib.asynccontextmanager
async def _shard(settings: OutboxSettings, name: str, table: str | None) -> AsyncIterator[_Shard]:
    client, ref = await named_shard(settings, name, table)
    async with connected(settings, ref.table) as conn:
        yield _Shard(client, ref, shard_app(settings, ref).table(ref.table), conn)


@tool_command("park")
@click.option("--reason", required=True, help="Why the group is set aside (kept, and listed).")
@click.option("--by", help="Who parks it, for the record (default: the user running this).")
@shard_options(*PARK_GROUPS)
def park(shard: str, table: str | None, reason: str, by: str | None, **overrides: Any) -> None:
    """Set SHARD's head group aside, so that the shard goes on with its next group.

    The group's rows stay in the table, and so do rows of the same object written later: no
    handler gets them until `outbox-bridge unpark SHARD` puts them back, at the head of the
    shard again. Who, when and why are recorded (see `outbox-bridge parked`)."""
    reason = flags.required_reason(reason, "park")
    settings = build_settings(overrides)
    app = command_app(settings)

    async def work() -> ParkedGroup:
        async with _shard(settings, shard, table) as found:
            parked = await park_head_locked(
                found.conn, found.table, found.ref, reason=reason, by=flags.who(by)
            )
        why = f"parked {group_text(parked, app)} by {parked.parked_by}: {parked.reason}"
        await wake_shard(found.client, found.ref, why)
        return parked

    group = run_or_exit(work(), shard=shard)
    name = group_text(group, app)
    click.echo(
        f"shard {shard}: parked {name} ({group.rows} rows from id {group.first_id}): {reason}"
    )


@tool_command("unpark")
@click.option(
    "--group",
    metavar="CATEGORY:OBJECT",
    help="Put back only this group (a category name or number, and an object id); default: "
    "every parked group of the shard.",
)
@click.option("--by", help="Who puts it back, for the record (default: the user running this).")
@shard_options(*PARK_GROUPS)
def unpark_command(
    shard: str, table: str | None, group: str | None, by: str | None, **overrides: Any
) -> None:
    """Put SHARD's parked groups back: their rows keep their ids, so they head the shard again,
    and are handled at once, coalesced as usual. Their records stay, with who put them back
    and when."""
    settings = build_settings(overrides)
    app = command_app(settings)
    wanted = _parse_group(group, app)

    async def work() -> list[ParkedGroup]:
        async with _shard(settings, shard, table) as found:
            groups = await unpark(
                found.conn, found.table, found.ref, by=flags.who(by), group=wanted
            )
            await found.conn.commit()
        if not groups:
            which = f"group {group}" if group else "group"
            raise NothingParkedError(
                f"shard {found.ref.key} has no parked {which} in table {found.table.name}; "
                "`outbox-bridge parked` lists the parked groups"
            )
        names = ", ".join(group_text(g, app) for g in groups)
        await wake_shard(found.client, found.ref, f"unparked {names} by {groups[0].unparked_by}")
        return groups

    for unparked in run_or_exit(work(), shard=shard):
        click.echo(f"shard {shard}: unparked {group_text(unparked, app)} ({unparked.rows} rows)")


def _parse_group(text: str | None, app: OutboxApp | None) -> tuple[int, int] | None:
    if text is None:
        return None
    category, _, obj = text.rpartition(":")
    category = category.strip()
    names = {c.name.upper(): int(c) for c in app.categories} if app is not None else {}
    try:
        object_identifier = int(obj)
        number = int(category) if category.lstrip("-").isdigit() else names[category.upper()]
    except (ValueError, KeyError):
        known = ", ".join(names) or "none without the app (--app): give its number"
        raise click.BadParameter(
            f"{text!r} is not CATEGORY:OBJECT (category names: {known})", param_hint="--group"
        ) from None
    return number, object_identifier


@tool_command("parked")
@click.option("--all", "with_unparked", is_flag=True, help="Include groups put back since.")
@flags.table_option
@flags.json_option
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def parked(table: str | None, with_unparked: bool, as_json: bool, **overrides: Any) -> None:
    """The parked groups, oldest first, with who parked them, when and why."""
    settings = build_settings(overrides)
    app = command_app(settings)
    outbox = tables_of(app, table).table(table)

    async def work() -> list[ParkedGroup]:
        async with connected(settings, outbox.name, read_only=True) as conn:
            return await read_parked(conn, outbox, with_unparked=with_unparked)

    groups = run_or_exit(work())
    if as_json:
        shown = [dataclasses.asdict(g) | {"shard": shard_key(g, app)} for g in groups]
        click.echo(json.dumps(shown, indent=2, default=str))
        return
    Console().print(parked_table(groups, app, title=f"parked groups of {outbox.name}"))


def group_text(group: ParkedGroup, app: OutboxApp | None) -> str:
    category = app.category_name(group.category) if app is not None else str(group.category)
    return f"{category} object={group.object_identifier}"


def shard_key(group: ParkedGroup, app: OutboxApp | None) -> str:
    scope = app.scope_name(group.scope) if app is not None else str(group.scope)
    return f"{group.region + ':' if group.region else ''}{scope}:{group.shard_identifier}"


def parked_table(
    groups: list[ParkedGroup], app: OutboxApp | None, *, title: str, one_shard: bool = False
) -> View:
    """Parked groups as a table: with a shard column unless they are ``one_shard``'s (as
    ``status`` shows them), with an unparked column if one was put back."""
    columns = ["group", "rows", "parked", "by", "role", "reason"]
    if not one_shard:
        columns.insert(0, "shard")
    if any(group.unparked_at is not None for group in groups):
        columns.append("unparked")
    view = View(title=title)
    for column in columns:
        view.add_column(column, justify="right" if column == "rows" else "left")
    for group in groups:
        unparked = ""
        if group.unparked_at is not None:
            unparked = (
                f"{_utc(group.unparked_at)} by {group.unparked_by} (role {group.unparked_role})"
            )
        values = {
            "shard": shard_key(group, app),
            "group": group_text(group, app),
            "rows": str(group.rows),
            "parked": _utc(group.parked_at),
            "by": group.parked_by,
            "role": group.parked_role,  # as PostgreSQL authenticated it
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
        async with connected(settings, shard.table, read_only=True) as conn:
            return await read_parked(conn, shard_app(settings, shard).table(shard.table), shard)
    except ConfigurationError as exc:
        return str(exc)


async def parked_per_shard(
    conn: AsyncConnection, table: Table
) -> Counter[tuple[str | None, int, int]]:
    """How many groups each shard has parked (none before a worker of this version created
    the table's parked-group table)."""
    found = await conn.execute(
        text("SELECT to_regclass(:name) IS NOT NULL"), {"name": parked_of(table).name}
    )
    if not found.scalar():
        return Counter()
    return Counter(group.shard for group in await read_parked(conn, table))
