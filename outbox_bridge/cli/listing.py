"""``outbox-bridge shards``: the shards with pending rows and the state of their workflows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import click
from rich.console import Console, JustifyMethod
from rich.table import Table
from sqlalchemy import func, select
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.cli import flags
from outbox_bridge.cli.connections import command_app, connected, tables_of, temporal_client
from outbox_bridge.cli.failures import run_or_exit
from outbox_bridge.cli.flags import build_settings, settings_options, tool_command
from outbox_bridge.cli.limit_commands import shard_rate_limits
from outbox_bridge.cli.park_commands import parked_per_shard
from outbox_bridge.cli.pause_commands import PAUSED, describe
from outbox_bridge.cli.scope_directory import NO_APP_HINT, ScopeDirectory
from outbox_bridge.config import OutboxSettings, SettingGroup
from outbox_bridge.db.pauses import read_shard_pause
from outbox_bridge.db.scans import read_shard_depths
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import scope_number
from outbox_bridge.workflows.models import ShardRef, ShardState, ShardStatus

# The state `shards` shows for a shard with no running workflow (its partition drains it).
NO_WORKFLOW = "none"
# ... and for a running workflow that did not answer its status query (no worker runs it).
NO_ANSWER = "no answer"
QUERY_TIMEOUT = timedelta(seconds=5)


@tool_command("shards")
@click.option("--top", default=20, show_default=True, help="How many shards to list.")
@click.option("--scope", "scope_name", help="Only shards of this scope (a name or a number).")
@click.option(
    "--state",
    type=click.Choice([*(state.value for state in ShardState), NO_WORKFLOW, PAUSED]),
    help="Only shards whose workflow is in this state (none: no running workflow).",
)
@click.option("--oldest", is_flag=True, help="Order by the age of the oldest row, not by depth.")
@flags.table_option
@flags.json_option
@settings_options(SettingGroup.DATABASE, SettingGroup.TEMPORAL, SettingGroup.APP)
def shards(
    top: int,
    scope_name: str | None,
    state: str | None,
    oldest: bool,
    table: str | None,
    as_json: bool,
    **overrides: Any,
) -> None:
    """The shards with pending rows, deepest (or oldest) first, with their workflow's state.

    Without the app (--app, --demo), scope names are learned from the shard workflows, and a
    scope none of whose shards has had one is shown by its number."""
    settings = build_settings(overrides)
    listed, unnamed = run_or_exit(_list(settings, top, scope_name, state, oldest, table))
    if as_json:
        click.echo(json.dumps(listed, indent=2, default=str))
    else:
        Console().print(_table(listed))
    if unnamed:
        click.echo(_unnamed_note(sorted(unnamed)), err=True)


def _unnamed_note(numbers: list[int]) -> str:
    listed = ", ".join(str(n) for n in numbers)
    one = len(numbers) == 1
    which = f"Scope {listed} is shown by its" if one else f"Scopes {listed} are shown by their"
    return (
        f"{which} number: no app was given, and no shard of {'it' if one else 'them'} has had "
        f"a workflow to learn the name from; {NO_APP_HINT}."
    )


# Columns shown only when a listed shard has a value in them: parked groups (`outbox-bridge
# parked` lists them), and the rate limit of its first row's category.
OPTIONAL_COLUMNS: tuple[tuple[str, str, JustifyMethod], ...] = (
    ("parked_groups", "parked groups", "right"),
    ("rate_limited", "rate limited", "left"),
)


def _optional_columns(listed: list[dict[str, Any]]) -> list[tuple[str, str, JustifyMethod]]:
    return [c for c in OPTIONAL_COLUMNS if any(entry[c[0]] for entry in listed)]


def _table(listed: list[dict[str, Any]]) -> Table:
    view = Table(title="shards with pending rows")
    optional = _optional_columns(listed)
    for column in ("shard", "rows", "groups", "oldest row age", "state", "blocked on"):
        view.add_column(column, justify="right" if column in ("rows", "groups") else "left")
    for _, title, justify in optional:
        view.add_column(title, justify=justify)
    for entry in listed:
        view.add_row(
            entry["shard"],
            str(entry["rows"]),
            str(entry["groups"]),
            f"{entry['oldest_age_seconds']:.0f} s",
            entry["state"],
            entry["blocked_category"] or "",
            *(str(entry[key] or "") for key, _, _ in optional),
        )
    return view


async def _list(
    settings: OutboxSettings,
    top: int,
    scope_name: str | None,
    state: str | None,
    oldest_first: bool,
    table_name: str | None,
) -> tuple[list[dict[str, Any]], set[int]]:
    app = command_app(settings)
    client = await temporal_client(settings)
    table = tables_of(app, table_name).table(table_name)
    names = _ScopeNames(app, ScopeDirectory(client, table.name))
    scope = await names.number(scope_name) if scope_name else None
    async with connected(settings, table.name, read_only=True) as conn:
        # With a state filter, look further down the list for matches.
        limit = top if state is None else top * 20
        depths = await read_shard_depths(
            conn, table, scope=scope, oldest_first=oldest_first, limit=limit
        )
        now = (await conn.execute(select(func.now()))).scalar_one()
        refs = [
            ShardRef(table.name, d.scope, str(d.scope), d.shard_identifier, d.region)
            for d in depths
        ]
        pauses = [await read_shard_pause(conn, table, ref) for ref in refs]
        limited = await shard_rate_limits(conn, app, table, refs)
        parked = await parked_per_shard(conn, table)
    listed: list[dict[str, Any]] = []
    for depth, pause, rate_limited in zip(depths, pauses, limited, strict=True):
        scope_name = await names.name(depth.scope)
        ref = ShardRef(table.name, depth.scope, scope_name, depth.shard_identifier, depth.region)
        found, blocked = await _workflow_state(client, ref)
        if pause is not None:  # its workflow waits for the paused row as for a deferred one
            found, blocked = PAUSED, describe(app, pause)
        if state is not None and found != state:
            continue
        listed.append(
            {
                "shard": ref.key,
                "workflow_id": ref.workflow_id,
                "rows": depth.rows,
                "groups": depth.groups,
                "oldest": depth.oldest.isoformat(),
                "oldest_age_seconds": (now - depth.oldest).total_seconds(),
                "state": found,
                "blocked_category": blocked,
                "parked_groups": parked[(depth.region, depth.scope, depth.shard_identifier)],
                "rate_limited": rate_limited,
            }
        )
        if len(listed) >= top:
            break
    return listed, names.unnamed


@dataclass
class _ScopeNames:
    """Scope names and numbers from the app, or without it from the shard workflows (a scope
    none of whose shards had a workflow is shown by its number, and kept in ``unnamed``)."""

    app: OutboxApp | None
    directory: ScopeDirectory
    unnamed: set[int] = field(default_factory=set)

    async def number(self, text: str) -> int:
        number = scope_number(text)
        if number is not None:
            return number
        if self.app is not None:
            return int(self.app.scope_by_name(text))  # refused naming the app's scopes
        found = await self.directory.number(text)
        if found is not None:
            return found[1]
        raise ConfigurationError(
            f"--scope {text}: no shard workflow of the table says which number scope {text!r} "
            f"has (scopes seen: {await self.directory.seen()}); give it by number, or "
            f"{NO_APP_HINT}"
        )

    async def name(self, number: int) -> str:
        if self.app is not None:
            return self.app.scope_name(number)
        name = await self.directory.name(number)
        if name is None:
            self.unnamed.add(number)
        return name or str(number)


async def _workflow_state(client: Client, shard: ShardRef) -> tuple[str, str | None]:
    """The state of the shard's running workflow, and its blocked category; ``none`` when no
    workflow of the shard runs (describe needs no worker: a closed run is not queried)."""
    handle = client.get_workflow_handle(shard.workflow_id)
    try:
        description = await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return NO_WORKFLOW, None
        raise
    if description.status != WorkflowExecutionStatus.RUNNING:
        return NO_WORKFLOW, None
    try:
        status = await handle.query("status", result_type=ShardStatus, rpc_timeout=QUERY_TIMEOUT)
    except (RPCError, WorkflowQueryFailedError):
        return NO_ANSWER, None
    blocked = (
        status.head.category_name if status.head and status.state == ShardState.BLOCKED else None
    )
    return status.state, blocked
