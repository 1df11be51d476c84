"""``pause``, ``unpause`` and ``pauses``: pause a whole category or scope of a table at run
time, resume it, and list what is paused (kept in ``<table>_pauses``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from outbox_bridge.cli import flags
from outbox_bridge.cli.connections import command_app, connected, shard_app, tables_of
from outbox_bridge.cli.failures import exits_on_failure, run_or_exit
from outbox_bridge.cli.flags import build_settings, settings_options, tool_command
from outbox_bridge.cli.scope_directory import NO_APP_HINT
from outbox_bridge.config import OutboxSettings, SettingGroup
from outbox_bridge.db.pauses import Pause, add_pause, read_pauses, read_shard_pause, remove_pause
from outbox_bridge.db.schema import pauses_of
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.pause_control import member_name, member_number, timed_end, view_of
from outbox_bridge.workflows.models import PauseKind, ShardRef, via_text

# The state `shards` and `status` show of a shard whose workflow waits for a paused row.
PAUSED = "paused"


def _target_options(*, reason: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--category, --scope, (--reason,) --table and the database and app settings, in order."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = flags.table_option(settings_options(SettingGroup.DATABASE, SettingGroup.APP)(fn))
        if reason:
            why = "Why it is paused (shown by shards, status and the UI)."
            fn = click.option("--reason", required=True, help=why)(fn)
        scope = "A scope: every row of its shards (a name or a number)."
        fn = click.option("--scope", help=scope)(fn)
        category = "A category, in every scope (a name or a number)."
        return click.option("--category", help=category)(fn)

    return decorate


def _target(
    settings: OutboxSettings, category: str | None, scope: str | None
) -> tuple[PauseKind, int]:
    """The kind and number of the category or scope named: a number, or a name of the app."""
    if (category is None) == (scope is None):
        raise click.UsageError("give exactly one of --category and --scope")
    kind = PauseKind.CATEGORY if category is not None else PauseKind.SCOPE
    with exits_on_failure():
        app = command_app(settings)
        where = "the demo app" if settings.demo else f"app {settings.app}"
        return kind, member_number(
            app, kind, category or scope or "", where if app is not None else NO_APP_HINT
        )


async def _in_table(
    settings: OutboxSettings, table_name: str | None, change: Callable[[Any, Any], Any]
) -> Any:
    """``change(conn, table)`` in a transaction (a missing pause table is refused, naming
    ``init-db``: the command changes no schema)."""
    table = tables_of(command_app(settings), table_name).table(table_name)
    async with connected(settings, pauses_of(table).name, begin=True) as conn:
        return await change(conn, table)


async def _read_only(
    settings: OutboxSettings, table_name: str | None, read: Callable[[Any, Any], Any]
) -> Any:
    """``read(conn, table)`` in a read-only transaction."""
    table = tables_of(command_app(settings), table_name).table(table_name)
    async with connected(settings, pauses_of(table).name, read_only=True) as conn:
        return await read(conn, table)


@tool_command("pause")
@click.option(
    "--until",
    "until",
    metavar="TIME",
    help="End the pause by itself at this time (ISO 8601 with a zone: 2026-12-01T09:00:00Z).",
)
@click.option(
    "--for",
    "for_",
    metavar="DURATION",
    help="End the pause by itself after this long (90s, 30m, 2h, 1d, 1h30m; at most 366 days).",
)
@_target_options(reason=True)
def pause(
    category: str | None,
    scope: str | None,
    table: str | None,
    reason: str,
    for_: str | None,
    until: str | None,
    **overrides: Any,
) -> None:
    """Pause a whole category (in every scope) or a whole scope at run time, until `outbox-bridge
    unpause`, or for a time (`--for`, `--until`) after which it ends by itself. Its rows wait,
    kept, and so do the rows behind them in their shards (order is per shard); other shards go
    on. The pause is kept in the database (a restart keeps it, and a timed pause ends on time
    by the database's clock, whether or not a worker runs)."""
    settings = build_settings(overrides)
    kind, number = _target(settings, category, scope)
    reason = flags.required_reason(reason, "pause")
    with exits_on_failure():
        end = timed_end(None if for_ is None else duration_seconds(for_), until)

    async def change(conn: Any, outbox: Any) -> Pause:
        return await add_pause(conn, outbox, kind, number, reason, flags.who(), end=end)

    done: Pause = run_or_exit(_in_table(settings, table, change))
    name = member_name(command_app(settings), kind, number)
    click.echo(f"{kind} {name} ({number}) paused{ends_text(done.ends_at)}: {done.reason}")


@tool_command("unpause")
@_target_options(reason=False)
def unpause(category: str | None, scope: str | None, table: str | None, **overrides: Any) -> None:
    """Resume a category or a scope paused with `outbox-bridge pause`: the shards that waited
    for it go on at once, in order."""
    settings = build_settings(overrides)
    kind, number = _target(settings, category, scope)

    async def change(conn: Any, outbox: Any) -> Pause | None:
        return await remove_pause(conn, outbox, kind, number)

    done: Pause | None = run_or_exit(_in_table(settings, table, change))
    if done is None:
        click.echo(f"{kind} {category or scope} ({number}) was not paused")
    else:
        name = member_name(command_app(settings), kind, number)
        click.echo(f"{kind} {name} ({number}) resumed (paused since {done.since})")


@tool_command("pauses")
@flags.table_option
@flags.json_option
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def pauses(table: str | None, as_json: bool, **overrides: Any) -> None:
    """The paused categories and scopes of a table, oldest first."""
    settings = build_settings(overrides)
    paused = run_or_exit(_read_only(settings, table, read_pauses))
    found = view_of(command_app(settings), paused).pauses
    # The role PostgreSQL authenticated beside each declared ``by``.
    roles = [p.paused_role for p in paused]
    if as_json:
        rows = [
            {**dataclasses.asdict(p), "paused_role": role}
            for p, role in zip(found, roles, strict=True)
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    view = Table(title="paused categories and scopes")
    for column in ("kind", "name", "number", "reason", "by", "role", "via", "since", "ends"):
        view.add_column(column)
    for p, pause in zip(found, paused, strict=True):
        ends = ends_text(pause.ends_at).removeprefix(", ") or "when unpaused"
        view.add_row(
            p.kind,
            p.name,
            str(p.number),
            p.reason,
            p.paused_by,
            pause.paused_role,
            p.paused_via,
            p.since,
            ends,
        )
    Console().print(view)


async def shard_pause(settings: OutboxSettings, ref: ShardRef) -> Pause | None:
    """The pause ``ref`` waits for (its first row not due is paused), None when it waits for
    none, or when the database cannot be read (the command shows the workflow's state)."""
    try:
        async with connected(settings, ref.table, read_only=True) as conn:
            return await read_shard_pause(conn, shard_app(settings, ref).table(ref.table), ref)
    except (ConfigurationError, SQLAlchemyError):
        return None


def describe(app: OutboxApp | None, pause: Pause) -> str:
    """A pause in one line: ``category PROJECT_UPDATE by ann since ...: search is down``."""
    name = member_name(app, pause.kind, pause.number)
    since = pause.since.isoformat(timespec="seconds")
    by = f"{pause.paused_by}{via_text(pause.paused_via)}"
    return f"{pause.kind} {name} by {by} since {since}{ends_text(pause.ends_at)}: {pause.reason}"


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")


def duration_seconds(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``30m``, ``2h``, ``1d`` or ``1h30m`` (a bare
    number is seconds). Raises :class:`ConfigurationError` for anything else."""
    text = text.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ConfigurationError(
            f"--for {text!r} is not a duration: give one such as 90s, 30m, 2h, 1d or 1h30m"
        )
    days, hours, minutes, seconds = (float(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def ends_text(ends_at: datetime | None, now: datetime | None = None) -> str:
    """``, ends 2026-12-01T09:00:00+00:00 (in 29m 50s)`` for a timed pause, else nothing."""
    if ends_at is None:
        return ""
    left = max(0, int((ends_at - (now or datetime.now(UTC))).total_seconds()))
    return f", ends {ends_at.astimezone(UTC).isoformat(timespec='seconds')} (in {left_text(left)})"


def left_text(seconds: int) -> str:
    """``1d 2h``, ``29m 50s``, ``5s``: a time left, to its two largest units."""
    parts: list[str] = []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return " ".join(parts[:2])
