"""``python -m outbox_bridge`` / ``outbox-bridge``: the command line of outbox-bridge."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import getpass
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge import __version__, demo
from outbox_bridge.cli.apps import app_from_settings
from outbox_bridge.cli.flags import build_settings, settings_options
from outbox_bridge.config import OutboxSettings, SettingGroup, safe_url, sqlalchemy_url
from outbox_bridge.db.schema import prepare_database
from outbox_bridge.db.store import read_shard_depths, read_shard_max_id
from outbox_bridge.errors import ConfigurationError, OutboxError
from outbox_bridge.flush import Flusher
from outbox_bridge.observability.logs import configure_logging, quiet_sdk_loggers
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.embedded import EmbeddedPostgres
from outbox_bridge.runtime.replayer import HistoryReplayer
from outbox_bridge.runtime.shards import WORKFLOW, parse_shard, shard_status, start_arguments
from outbox_bridge.runtime.temporal import connect, task_queue_polled, temporal_address
from outbox_bridge.runtime.worker import run as run_worker
from outbox_bridge.workflows.models import (
    FlushOutcome,
    FlushResult,
    ResumeInput,
    ShardRef,
    ShardState,
    ShardStatus,
    SkipInput,
)

# The state `shards` shows for a shard with no workflow of its own (its partition drains it).
NO_WORKFLOW = "none"
# What `flush` says of a shard with nothing pending: handled, there is nothing to wait for.
NO_PENDING_ROWS = "no pending rows"


def run() -> None:
    """Entry point: run the command line, then leave without interpreter teardown.

    A process that used a Temporal client can crash while the interpreter finalizes (the SDK's
    runtime threads), turning a success into a failure exit code: flush and exit explicitly.
    """
    code = 0
    try:
        main.main(prog_name="outbox-bridge")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="outbox-bridge", message="%(prog)s %(version)s")
def main() -> None:
    """outbox-bridge: a transactional outbox executed by Temporal.

    Run the worker with `outbox-bridge worker` (see its --help).
    """


@main.command(
    "worker", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@settings_options()
def worker(**overrides: Any) -> None:
    """Run the worker: the bridge that finds shards with rows, and the Temporal worker that
    drains them and runs their handlers.

    Every option is also an environment variable (shown with each). With no database URL and
    no Temporal address, embedded servers are started under --data-dir.
    """
    code = 0
    try:
        settings = build_settings(overrides)
        handler = configure_logging(settings.log_level, settings.log_format)
        if settings.demo:
            handler.addFilter(demo.IntendedFailures())
        quiet_sdk_loggers()
        app = app_from_settings(settings.demo, settings.app)
        asyncio.run(run_worker(settings, app))
    except OutboxError as exc:
        print(f"outbox-bridge: error: {exc}", file=sys.stderr)
        code = 2
    except Exception:
        logging.getLogger("outbox_bridge").exception("outbox-bridge stopped on an unexpected error")
        code = 1
    # A process that ran a Temporal worker can crash in interpreter teardown after the work is
    # done: flush and leave explicitly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _app(settings: OutboxSettings) -> OutboxApp:
    return app_from_settings(settings.demo, settings.app, allow_none=True)


@contextlib.asynccontextmanager
async def _database(settings: OutboxSettings) -> AsyncIterator[AsyncEngine]:
    """The configured database, or the embedded one under --data-dir (stopped afterwards)."""
    postgres = None
    if settings.database_url is not None:
        url = settings.database_url.get_secret_value()
    else:
        postgres = EmbeddedPostgres(settings.data_dir / "postgres")
        url = postgres.start()
    engine = create_async_engine(sqlalchemy_url(url))
    try:
        yield engine
    finally:
        await engine.dispose()
        if postgres is not None:
            postgres.stop()


async def _init_db(settings: OutboxSettings) -> list[str]:
    app = _app(settings)
    async with _database(settings) as engine:
        await prepare_database(engine, app.metadata)
        click.echo(f"database: {safe_url(engine.url)}")
    return list(app.tables)


@main.command("init-db")
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def init_db(**overrides: Any) -> None:
    """Create the outbox tables, indexes and NOTIFY triggers that are missing (idempotent)."""
    try:
        tables = asyncio.run(_init_db(build_settings(overrides)))
    except OutboxError as exc:
        click.echo(f"outbox-bridge: error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"tables ready: {', '.join(tables)}")


# -- steering one shard -----------------------------------------------------------------------


def _shard_command(*groups: SettingGroup) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """SHARD, --table, and the settings of ``groups`` (Temporal and the app when none given)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option("--table", help="The outbox table (default: the app's first table).")(fn)
        fn = click.argument("shard")(fn)
        return settings_options(*(groups or (SettingGroup.TEMPORAL, SettingGroup.APP)))(fn)

    return decorate


async def _shard_handle(
    settings: OutboxSettings, name: str, table: str | None
) -> tuple[Client, ShardRef]:
    shard = parse_shard(name, _app(settings), table=table)
    address = temporal_address(settings)
    return await connect(settings, address), shard


def _run_or_exit(work: Awaitable[Any], shard: str) -> Any:
    try:
        return asyncio.run(work)  # type: ignore[arg-type]
    except OutboxError as exc:
        click.echo(f"outbox-bridge: error: {exc}", err=True)
        sys.exit(2)
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        click.echo(
            f"outbox-bridge: shard {shard} refused: {getattr(cause, 'message', cause)}", err=True
        )
        sys.exit(1)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            click.echo(
                f"outbox-bridge: shard {shard} has no workflow of its own: a partition drains "
                "it when it has rows (see `outbox-bridge shards`), and it gets one when it "
                "needs attention (a failing handler, a skip, a deferred row, a flush)",
                err=True,
            )
        else:
            click.echo(f"outbox-bridge: error: Temporal answered {exc.message}", err=True)
        sys.exit(1)


def _status_table(status: ShardStatus) -> Table:
    table = Table(title=f"shard {status.shard}", show_header=False)
    rows: list[tuple[str, str]] = [
        ("state", status.state),
        ("rows handled", f"{status.rows_handled} in {status.groups_handled} groups"),
        ("highest id known / seen", f"{status.max_known_id} / {status.highest_seen_id}"),
    ]
    if status.head is not None:
        rows.append(
            (
                "head group",
                f"{status.head.summary}, ids {status.head.first_id}-{status.head.last_id}",
            )
        )
    if status.last_error is not None:
        rows.append(("attempts", str(status.attempts)))
        error = status.last_error
        rows.append(("last error", f"{error.error_type}: {error.message}".rstrip(": ")))
    if status.blocked_since:
        rows.append(("blocked since", status.blocked_since))
    if status.deferred_until:
        rows.append(("deferred until", status.deferred_until))
    if status.skip is not None:
        rows.append(
            (
                "skipped",
                f"by {status.skip.by or 'an operator'} at {status.skip.at}: {status.skip.reason}",
            )
        )
    for key, value in rows:
        table.add_row(key, value)
    return table


@main.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_shard_command()
def status(shard: str, table: str | None, as_json: bool, **overrides: Any) -> None:
    """Show a shard's state: SHARD is SCOPE:ID (REGION:SCOPE:ID for a regional table)."""

    async def work() -> ShardStatus:
        client, ref = await _shard_handle(build_settings(overrides), shard, table)
        return await shard_status(client, ref)

    result: ShardStatus = _run_or_exit(work(), shard)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        Console().print(_status_table(result))


# How long skip waits for a worker to poll the task queue it would start the workflow on.
POLLERS_WAIT = 5.0


@main.command("skip")
@click.option("--reason", required=True, help="Why the shard is paused (shown in the UI).")
@_shard_command(SettingGroup.TEMPORAL, SettingGroup.APP, SettingGroup.SHARDS)
def skip(shard: str, table: str | None, reason: str, **overrides: Any) -> None:
    """Pause a shard: its retrying attempt is cancelled, no handler runs, every row is kept.

    A shard without a workflow of its own (a partition drains it) gets one, started skipped:
    the skip is taken once no handler of the shard runs any more."""
    if not reason.strip():
        raise click.BadParameter("a skip needs a reason", param_hint="--reason")

    async def work() -> None:
        settings = build_settings(overrides)
        client, ref = await _shard_handle(settings, shard, table)
        skip = SkipInput(reason=reason.strip(), by=getpass.getuser())
        handle = client.get_workflow_handle(ref.workflow_id)
        with contextlib.suppress(RPCError):
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                await handle.execute_update("skip", skip, result_type=ShardStatus)
                return
        # No running workflow: start one, skipped, where the workers will run it.
        deadline = time.monotonic() + POLLERS_WAIT
        if await task_queue_polled(client, settings.task_queue, deadline) is False:
            raise ConfigurationError(
                f"no worker polls task queue {settings.task_queue!r}: set OUTBOX_TASK_QUEUE "
                "(--task-queue) to the workers' task queue; nothing was skipped"
            )
        start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            WORKFLOW,
            **start_arguments(ref, settings.shard_options(), settings.task_queue, max_id=0),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        await client.execute_update_with_start_workflow(
            "skip", skip, start_workflow_operation=start, result_type=ShardStatus
        )

    _run_or_exit(work(), shard)
    click.echo(f"shard {shard} skipped: {reason.strip()}")


@main.command("resume")
@_shard_command()
def resume(shard: str, table: str | None, **overrides: Any) -> None:
    """Resume a skipped shard: its head is retried at once."""

    async def work() -> None:
        client, ref = await _shard_handle(build_settings(overrides), shard, table)
        await client.get_workflow_handle(ref.workflow_id).execute_update(
            "resume", ResumeInput(by=getpass.getuser()), result_type=ShardStatus
        )

    _run_or_exit(work(), shard)
    click.echo(f"shard {shard} resumed")


@main.command("flush")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=3600),
    default=10.0,
    show_default=True,
    help="Seconds to wait.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_shard_command(SettingGroup.DATABASE, SettingGroup.TEMPORAL, SettingGroup.APP, SettingGroup.SHARDS)
def flush(shard: str, table: str | None, timeout: float, as_json: bool, **overrides: Any) -> None:
    """Wait until a shard has handled every row pending now (exit 0), or say why it cannot:
    blocked, skipped, deferred or timed out (exit 1). Starts the shard's workflow if needed."""

    async def work() -> FlushResult:
        settings = build_settings(overrides)
        app = _app(settings)
        ref = parse_shard(shard, app, table=table)
        async with _database(settings) as engine, engine.connect() as conn:
            up_to = await read_shard_max_id(conn, app.table(ref.table), ref)
        if up_to is None:
            return FlushResult(ref.key, FlushOutcome.HANDLED, detail=NO_PENDING_ROWS)
        [result] = await Flusher(app, settings).flush({ref: up_to}, timeout)
        return result

    result: FlushResult = _run_or_exit(work(), shard)
    if result.detail == NO_PENDING_ROWS and not as_json:
        click.echo(f"shard {shard} has no pending rows")
        return
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        Console().print(_flush_table(result))
    if not result.handled:
        sys.exit(1)


def _flush_table(result: FlushResult) -> Table:
    view = Table(title=f"flush of shard {result.shard}", show_header=False)
    view.add_row("outcome", result.outcome)
    if result.head is not None:
        view.add_row(
            "head group", f"{result.head.summary}, ids {result.head.first_id}-{result.head.last_id}"
        )
    if result.error is not None:
        view.add_row(
            "last error", f"{result.error.error_type}: {result.error.message}".rstrip(": ")
        )
    if result.blocked_since:
        view.add_row("blocked since", result.blocked_since)
    if result.skip is not None:
        view.add_row("skipped", f"by {result.skip.by or 'an operator'}: {result.skip.reason}")
    if result.deferred_until:
        view.add_row("deferred until", result.deferred_until)
    if result.detail:
        view.add_row("detail", result.detail)
    return view


@main.group("history")
def history() -> None:
    """Export shard workflow histories (to keep a replay corpus of your own)."""


@history.command("export")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the history (JSON).",
)
@_shard_command()
def history_export(shard: str, table: str | None, output: Path, **overrides: Any) -> None:
    """Write the history of SHARD's latest workflow run as JSON (ids and counts, no payloads)."""

    async def work() -> int:
        client, ref = await _shard_handle(build_settings(overrides), shard, table)
        recorded = await client.get_workflow_handle(ref.workflow_id).fetch_history()
        output.write_text(json.dumps(json.loads(recorded.to_json()), indent=1) + "\n")
        return len(recorded.events)

    events = _run_or_exit(work(), shard)
    click.echo(f"wrote {events} events of shard {shard} to {output}")


@main.command("replay")
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def replay(files: tuple[Path, ...]) -> None:
    """Replay exported histories against the current workflow code, as the worker runs it and
    under the sandbox; exit 1 on nondeterminism, naming the first event that differs."""
    failed = asyncio.run(_replay(files))
    click.echo(f"{len(files) - failed} replayed, {failed} failed")
    sys.exit(1 if failed else 0)


async def _replay(files: tuple[Path, ...]) -> int:
    replayer = HistoryReplayer()
    failed = 0
    for path in files:
        failure = await replayer.replay_file(path)
        if failure is None:
            click.echo(f"ok   {path}")
        else:
            click.echo(f"FAIL {failure}")
            failed += 1
    return failed


@main.command("shards")
@click.option("--top", default=20, show_default=True, help="How many shards to list.")
@click.option("--scope", "scope_name", help="Only shards of this scope.")
@click.option(
    "--state",
    type=click.Choice([*(state.value for state in ShardState), NO_WORKFLOW]),
    help="Only shards whose workflow is in this state (none: no running workflow).",
)
@click.option("--oldest", is_flag=True, help="Order by the age of the oldest row, not by depth.")
@click.option("--table", help="The outbox table (default: the app's first table).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
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
    """The shards with pending rows, deepest (or oldest) first, with their workflow's state."""
    listed = _run_or_exit(
        _shards(build_settings(overrides), top, scope_name, state, oldest, table), "-"
    )
    if as_json:
        click.echo(json.dumps(listed, indent=2, default=str))
        return
    view = Table(title="shards with pending rows")
    for column in ("shard", "rows", "groups", "oldest row age", "state", "blocked on"):
        view.add_column(column, justify="right" if column in ("rows", "groups") else "left")
    for entry in listed:
        view.add_row(
            entry["shard"],
            str(entry["rows"]),
            str(entry["groups"]),
            f"{entry['oldest_age_seconds']:.0f} s",
            entry["state"],
            entry["blocked_category"] or "",
        )
    Console().print(view)


async def _shards(
    settings: OutboxSettings,
    top: int,
    scope_name: str | None,
    state: str | None,
    oldest_first: bool,
    table_name: str | None,
) -> list[dict[str, Any]]:
    app = _app(settings)
    table = app.table(table_name)
    scope = int(app.scope_by_name(scope_name)) if scope_name else None
    async with _database(settings) as engine, engine.connect() as conn:
        # With a state filter, look further down the list for matches.
        depths = await read_shard_depths(
            conn,
            table,
            scope=scope,
            oldest_first=oldest_first,
            limit=top if state is None else top * 20,
        )
        now = (await conn.execute(select(func.now()))).scalar_one()
    address = temporal_address(settings)
    client = await connect(settings, address)
    listed: list[dict[str, Any]] = []
    for depth in depths:
        ref = ShardRef(
            table.name,
            depth.scope,
            app.scope_name(depth.scope),
            depth.shard_identifier,
            depth.region,
        )
        found = await _workflow_state(client, ref)
        if state is not None and found[0] != state:
            continue
        listed.append(
            {
                "shard": ref.key,
                "workflow_id": ref.workflow_id,
                "rows": depth.rows,
                "groups": depth.groups,
                "oldest": depth.oldest.isoformat(),
                "oldest_age_seconds": (now - depth.oldest).total_seconds(),
                "state": found[0],
                "blocked_category": found[1],
            }
        )
        if len(listed) >= top:
            break
    return listed


async def _workflow_state(client: Client, shard: ShardRef) -> tuple[str, str | None]:
    try:
        status = await client.get_workflow_handle(shard.workflow_id).query(
            "status", result_type=ShardStatus
        )
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        click.echo(
            f"outbox-bridge: shard {shard} refused: {getattr(cause, 'message', cause)}", err=True
        )
        sys.exit(1)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return NO_WORKFLOW, None
        raise
    except Exception:  # a closed run cannot answer queries on some servers
        return NO_WORKFLOW, None
    blocked = (
        status.head.category_name if status.head and status.state == ShardState.BLOCKED else None
    )
    return status.state, blocked
