"""``limit`` and ``limits``: change a category's rate limit at run time in every worker of a
table, and list the limits (kept in ``<table>_limits``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from sqlalchemy import Table as SqlTable
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.cli import flags
from outbox_bridge.cli.connections import command_app, connected, shard_app, tables_of
from outbox_bridge.cli.failures import exits_on_failure, run_or_exit
from outbox_bridge.cli.flags import build_settings, settings_options, tool_command
from outbox_bridge.cli.scope_directory import NO_APP_HINT
from outbox_bridge.config import OutboxSettings, SettingGroup
from outbox_bridge.db.limits import LimitRecord, RateLimit, parse_rate, read_limits, set_limit
from outbox_bridge.db.scans import read_first_row
from outbox_bridge.db.schema import limits_of
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.pause_control import member_name, member_number
from outbox_bridge.workflows.models import PauseKind, ShardRef

# What `limit CATEGORY off` takes: back to the limit the handler declares.
OFF = "off"


@dataclasses.dataclass(frozen=True)
class LimitView:
    """A category's limit as the commands show it."""

    category: str
    number: int
    declared: str | None
    override: str | None
    set_by: str | None
    set_role: str | None
    set_at: str | None
    waiting: bool  # calls of it waited for a token in the last few seconds


def limit_views(app: OutboxApp | None, records: list[LimitRecord]) -> list[LimitView]:
    """Every category with a declared limit or a row in the table, by number."""
    by_number = {record.category: record for record in records}
    declared = {int(c) for c in app.categories if app.rate_limit(c)} if app is not None else set()
    return [_view(app, n, by_number.get(n)) for n in sorted(declared | set(by_number))]


def _view(app: OutboxApp | None, number: int, record: LimitRecord | None) -> LimitView:
    """The app's declared rate, else the one the workers declare (without the app)."""
    own = app.rate_limit(number) if app is not None else None
    if own is None and record is not None and record.declared is not None:
        own = RateLimit(record.declared)
    set_rate = None if record is None else record.per_second
    set_at = None if record is None else record.set_at
    return LimitView(
        category=member_name(app, PauseKind.CATEGORY, number),
        number=number,
        declared=None if own is None else str(own),
        override=None if set_rate is None else str(RateLimit(set_rate)),
        set_by=None if record is None else record.set_by,
        set_role=None if record is None else record.set_role,
        set_at=None if set_at is None else set_at.isoformat(timespec="seconds"),
        waiting=record is not None and record.waiting,
    )


def effective(view: LimitView) -> str | None:
    """The limit that holds: the operator's, else the declared one."""
    return view.override or view.declared


async def read_limit_views(
    conn: AsyncConnection, app: OutboxApp | None, table: SqlTable
) -> dict[int, LimitView]:
    """The limits of ``table`` by category number (the declared ones alone before
    ``init-db`` created the table's rate-limit table)."""
    found = await conn.execute(
        text("SELECT to_regclass(:name) IS NOT NULL"), {"name": limits_of(table).name}
    )
    records = await read_limits(conn, table) if found.scalar() else []
    return {view.number: view for view in limit_views(app, records)}


async def shard_rate_limit(
    conn: AsyncConnection, table: SqlTable, views: dict[int, LimitView], shard: ShardRef
) -> str | None:
    """The rate limit the shard's first row waits under, in one line, if its category has
    one: ``ORGANIZATION_UPDATE 100/s (declared), calls wait for tokens``."""
    first = await read_first_row(conn, table, shard)
    view = None if first is None else views.get(first.category)
    if view is None or effective(view) is None:
        return None
    source = f"set by {view.set_by}" if view.override else "declared"
    waits = "calls wait for tokens" if view.waiting else "no call waits"
    return f"{view.category} {effective(view)} ({source}), {waits}"


async def table_limits(
    settings: OutboxSettings, table_name: str | None, app: OutboxApp | None
) -> list[LimitView]:
    """The limits of the table, read in a read-only transaction."""
    table = tables_of(app, table_name).table(table_name)
    async with connected(settings, limits_of(table).name, read_only=True) as conn:
        return limit_views(app, await read_limits(conn, table))


async def shard_rate_limits(
    conn: AsyncConnection, app: OutboxApp | None, table: SqlTable, shards: list[ShardRef]
) -> list[str | None]:
    """:func:`shard_rate_limit` of each of ``shards`` (none read when no category is
    limited)."""
    views = await read_limit_views(conn, app, table)
    if not any(effective(view) for view in views.values()):
        return [None] * len(shards)
    return [await shard_rate_limit(conn, table, views, shard) for shard in shards]


async def shard_limit(settings: OutboxSettings, ref: ShardRef) -> str | None:
    """:func:`shard_rate_limit` of ``ref``; None when the database cannot be read (``status``
    shows the workflow's state whatever the database says)."""
    try:
        async with connected(settings, ref.table, read_only=True) as conn:
            table = shard_app(settings, ref).table(ref.table)
            [limited] = await shard_rate_limits(conn, command_app(settings), table, [ref])
            return limited
    except (ConfigurationError, SQLAlchemyError):
        return None


@tool_command("limit")
@click.argument("category")
@click.argument("rate")
@flags.table_option
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def limit(category: str, rate: str, table: str | None, **overrides: Any) -> None:
    """Set the rate limit of CATEGORY (a name or a number) in every worker of the table at run
    time: RATE is calls per second, minute or hour (50/s, 300/m, 1000/h), or `off` to go back
    to the limit its handler declares. Every worker applies it within seconds; it is kept in
    the database, with who set it and when."""
    settings = build_settings(overrides)
    with exits_on_failure():
        app = command_app(settings)
        where = "the demo app" if settings.demo else f"app {settings.app}"
        number = member_number(
            app, PauseKind.CATEGORY, category, where if app is not None else NO_APP_HINT
        )
        new = None if rate.strip().lower() == OFF else parse_rate(rate, "RATE", ConfigurationError)
        outbox = tables_of(app, table).table(table)

    async def change() -> None:
        async with connected(settings, limits_of(outbox).name, begin=True) as conn:
            await set_limit(conn, outbox, number, new, flags.who())

    run_or_exit(change())
    name = member_name(app, PauseKind.CATEGORY, number)
    if new is not None:
        click.echo(f"category {name} ({number}) limited to {new} in every worker")
        return
    own = app.rate_limit(number) if app is not None else None
    back = f"its declared {own}" if own is not None else "no limit (none is declared)"
    click.echo(f"category {name} ({number}) back to {back}")


@tool_command("limits")
@flags.table_option
@flags.json_option
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def limits(table: str | None, as_json: bool, **overrides: Any) -> None:
    """The rate limits of a table's categories: the declared one, the one set at run time
    (which holds while it is set), and who set it and when."""
    settings = build_settings(overrides)
    with exits_on_failure():
        app = command_app(settings)
    views: list[LimitView] = run_or_exit(table_limits(settings, table, app))
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(v) for v in views], indent=2))
        return
    shown = Table(title="rate limits")
    for column in ("category", "number", "declared", "override", "by", "role", "at", "waiting"):
        shown.add_column(column)
    for v in views:
        cells = (v.declared, v.override, v.set_by, v.set_role, v.set_at)
        waiting = "yes" if v.waiting else "no"
        shown.add_row(v.category, str(v.number), *(cell or "-" for cell in cells), waiting)
    Console().print(shown)
