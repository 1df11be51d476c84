"""The commands that steer one shard (``SCOPE:ID``, ``REGION:SCOPE:ID``, as the worker names
it): ``status``, ``skip``, ``resume``, ``flush``, and ``history export``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.cli import flags
from outbox_bridge.cli.connections import command_app, connected, named_shard, shard_app
from outbox_bridge.cli.failures import run_or_exit
from outbox_bridge.cli.flags import build_settings, shard_options, tool_command
from outbox_bridge.cli.limit_commands import shard_limit
from outbox_bridge.cli.park_commands import parked_table, shard_parked
from outbox_bridge.cli.pause_commands import PAUSED, describe, shard_pause
from outbox_bridge.config import OutboxSettings, SettingGroup
from outbox_bridge.db.parked import ParkedGroup
from outbox_bridge.db.scans import ShardPending, read_shard_max_id, read_shard_pending
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.flush import Flusher
from outbox_bridge.runtime.shards import (
    WORKFLOW,
    ShardReport,
    checked,
    shard_report,
    start_arguments,
)
from outbox_bridge.runtime.temporal import task_queue_polled
from outbox_bridge.workflows.inputs import check_resume, check_skip
from outbox_bridge.workflows.models import (
    FlushOutcome,
    FlushResult,
    ResumeInput,
    ShardRef,
    ShardStatus,
    SkipInput,
    via_text,
)

# What `flush` says of a shard with nothing pending: handled, there is nothing to wait for.
NO_PENDING_ROWS = "no pending rows"
# How long skip waits for Temporal to say whether a worker polls the task queue.
POLLERS_WAIT = 5.0


# What `status` shows: the shard's workflow (None: it has none), its parked groups (or why they
# could not be read), the pause it waits for, its rate limit, and its pending rows (read only
# when it has no workflow).
StatusParts = tuple[
    ShardReport | None, list[ParkedGroup] | str, str | None, str | None, ShardPending | None
]


@tool_command("status")
@flags.json_option
@shard_options(SettingGroup.DATABASE, SettingGroup.TEMPORAL, SettingGroup.APP)
def status(shard: str, table: str | None, as_json: bool, **overrides: Any) -> None:
    """Show the workflow of SHARD: its state, what it handled, its head group and error, its
    skip, its parked groups, the pause it waits for, and the rate limit of its first row's
    category. SHARD is SCOPE:ID (REGION:SCOPE:ID in a
    regional table), SCOPE a name or a number."""
    settings = build_settings(overrides)

    async def work() -> StatusParts:
        client, ref = await named_shard(settings, shard, table)
        parked = await shard_parked(settings, ref)
        pause = await shard_pause(settings, ref)
        paused = None if pause is None else describe(command_app(settings), pause)
        limited = await shard_limit(settings, ref)
        try:
            return await shard_report(client, ref), parked, paused, limited, None
        except RPCError as exc:
            # No workflow of its own: what the database says of the shard is shown, if anything.
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            pending = await shard_pending(settings, ref)
            if not (parked_list(parked) or limited or pending):
                raise
            return None, parked, paused, limited, pending

    report, parked, paused, limited, pending = run_or_exit(work(), shard=shard)
    if as_json:
        shown: dict[str, Any] = (
            # As `shards` shows a shard without a running workflow of its own.
            {"shard": shard, "state": "none", "workflow_running": False}
            | {"pending": _pending_json(pending)}
            if report is None
            else _status_json(report, paused)
        )
        shown["rate_limited"] = limited
        groups = [dataclasses.asdict(g) for g in parked] if isinstance(parked, list) else parked
        click.echo(json.dumps(shown | {"parked_groups": groups}, indent=2, default=str))
        return
    if report is not None:
        view = _status_table(report, paused)
        if limited is not None:
            view.add_row("rate limited", limited)
        Console().print(view)
    else:
        click.echo(f"shard {shard} has no workflow of its own: a partition drains it")
        if pending is not None:
            click.echo(
                f"pending: {plural(pending.rows, 'row')} in {plural(pending.groups, 'group')}, "
                f"lowest id "
                f"{pending.lowest_id}, the oldest written at {_iso(pending.oldest)}; a handler "
                "that fails is retried by the partition first, and the shard gets a workflow of "
                "its own if it still fails after OUTBOX_HANDOVER_AFTER seconds"
            )
        if limited is not None:
            click.echo(f"rate limited: {limited}")
    if isinstance(parked, str):
        click.echo(f"parked groups: unknown ({parked})", err=True)
    elif parked:
        app = command_app(settings)
        title = f"parked groups of shard {shard}"
        Console().print(parked_table(parked, app, title=title, one_shard=True))


async def shard_pending(settings: OutboxSettings, ref: ShardRef) -> ShardPending | None:
    """:func:`read_shard_pending` of ``ref``; None when the database cannot be read (``status``
    then says what Temporal says alone)."""
    try:
        async with connected(settings, ref.table, read_only=True) as conn:
            table = shard_app(settings, ref).table(ref.table)
            return await read_shard_pending(conn, table, ref)
    except (ConfigurationError, SQLAlchemyError):
        return None


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _pending_json(pending: ShardPending | None) -> dict[str, Any] | None:
    if pending is None:
        return None
    return dataclasses.asdict(pending) | {"oldest": _iso(pending.oldest)}


def parked_list(parked: list[ParkedGroup] | str) -> list[ParkedGroup]:
    """The parked groups, or none when they could not be read (``parked`` says why)."""
    return parked if isinstance(parked, list) else []


def _status_json(report: ShardReport, paused: str | None) -> dict[str, Any]:
    return dataclasses.asdict(report.status) | {
        # Its workflow waits for a paused row as for one scheduled later.
        "state": report.status.state if paused is None else PAUSED,
        "paused": paused,
        "workflow_running": report.running,
        "workflow_started": _iso(report.started),
        "workflow_closed": _iso(report.closed),
    }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat(timespec="seconds") if moment is not None else None


def _status_table(report: ShardReport, paused: str | None = None) -> Table:
    status = report.status
    view = Table(title=f"shard {status.shard}", show_header=False)
    if report.running:
        workflow = f"running since {_iso(report.started)}"
    else:
        workflow = f"closed at {_iso(report.closed)}; the partition drains the shard"
    view.add_row("state", status.state if paused is None else PAUSED)
    view.add_row("workflow", workflow)
    view.add_row(
        "handled by the workflow",
        f"{status.rows_handled} rows in {status.groups_handled} groups (rows its partition "
        "drained are not counted)",
    )
    view.add_row("highest id known / seen", f"{status.max_known_id} / {status.highest_seen_id}")
    if status.head is not None:
        head = status.head
        view.add_row("head group", f"{head.summary}, ids {head.first_id}-{head.last_id}")
    if status.last_error is not None:
        view.add_row("attempts", str(status.attempts))
        error = status.last_error
        view.add_row("last error", f"{error.error_type}: {error.message}".rstrip(": "))
    if status.blocked_since:
        view.add_row("blocked since", status.blocked_since)
    if status.deferred_until:
        view.add_row("deferred until", status.deferred_until)
    if status.skip is not None:
        skip = status.skip
        view.add_row("skipped", f"by {skip.who} at {skip.at}: {skip.reason}")
    if status.refused is not None and status.refused.summary is not None:
        view.add_row("refused", status.refused.summary)
    if paused is not None:
        view.add_row("paused", paused)
    return view


@tool_command("skip")
@click.option("--reason", required=True, help="Why the shard is paused (shown in the UI).")
@shard_options(SettingGroup.TEMPORAL, SettingGroup.APP, SettingGroup.SHARDS)
def skip(shard: str, table: str | None, reason: str, **overrides: Any) -> None:
    """Skip SHARD: its retrying attempt is cancelled, no handler runs, every row is kept (to
    stop a whole category or scope instead, see `outbox-bridge pause`).

    A shard without a workflow of its own (a partition drains it) gets one, started skipped on
    --task-queue, which must be the workers': the skip is taken once no handler of the shard
    runs any more."""
    reason = flags.required_reason(reason, "skip")

    async def work() -> None:
        settings = build_settings(overrides)
        client, ref = await named_shard(settings, shard, table)
        request = checked(check_skip, SkipInput(reason=reason, by=flags.who()), "skip")
        handle = client.get_workflow_handle(ref.workflow_id)
        with contextlib.suppress(RPCError):
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                await handle.execute_update("skip", request, result_type=ShardStatus)
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
            "skip", request, start_workflow_operation=start, result_type=ShardStatus
        )

    run_or_exit(work(), shard=shard)
    click.echo(f"shard {shard} skipped: {reason}")


@tool_command("resume")
@shard_options()
def resume(shard: str, table: str | None, **overrides: Any) -> None:
    """Resume a skipped SHARD: its head is retried at once."""

    async def work() -> None:
        client, ref = await named_shard(build_settings(overrides), shard, table)
        await client.get_workflow_handle(ref.workflow_id).execute_update(
            "resume",
            checked(check_resume, ResumeInput(by=flags.who()), "resume"),
            result_type=ShardStatus,
        )

    run_or_exit(work(), shard=shard)
    click.echo(f"shard {shard} resumed")


@tool_command("flush")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=3600),
    default=10.0,
    show_default=True,
    help="Seconds to wait.",
)
@flags.json_option
@shard_options(SettingGroup.DATABASE, SettingGroup.TEMPORAL, SettingGroup.APP, SettingGroup.SHARDS)
def flush(shard: str, table: str | None, timeout: float, as_json: bool, **overrides: Any) -> None:
    """Wait until SHARD has handled every row pending now (exit 0), or say why it cannot:
    blocked, skipped, deferred, timed out or unavailable (exit 1). Starts the shard's workflow
    on --task-queue if needed."""

    async def work() -> FlushResult:
        settings = build_settings(overrides)
        client, ref = await named_shard(settings, shard, table)
        app = shard_app(settings, ref)
        async with connected(settings, ref.table, read_only=True) as conn:
            up_to = await read_shard_max_id(conn, app.table(ref.table), ref)
        if up_to is None:
            return FlushResult(ref.key, FlushOutcome.HANDLED, detail=NO_PENDING_ROWS)
        [result] = await Flusher(app, settings, client=client).flush({ref: up_to}, timeout)
        return result

    result = run_or_exit(work(), shard=shard)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result), indent=2))
    elif result.detail == NO_PENDING_ROWS:
        click.echo(f"shard {shard} has no pending rows")
    else:
        Console().print(_flush_table(result))
    if not result.handled:
        raise SystemExit(1)


def _flush_table(result: FlushResult) -> Table:
    view = Table(title=f"flush of shard {result.shard}", show_header=False)
    view.add_row("outcome", result.outcome)
    if result.head is not None:
        head = result.head
        view.add_row("head group", f"{head.summary}, ids {head.first_id}-{head.last_id}")
    if result.error is not None:
        error = result.error
        view.add_row("last error", f"{error.error_type}: {error.message}".rstrip(": "))
    if result.blocked_since:
        view.add_row("blocked since", result.blocked_since)
    if result.skip is not None:
        view.add_row("skipped", f"by {result.skip.who}: {result.skip.reason}")
    if result.deferred_until:
        view.add_row("deferred until", result.deferred_until)
    if result.paused is not None:
        pause = result.paused
        view.add_row(
            "paused",
            f"{pause.kind} {pause.name} by {pause.paused_by}{via_text(pause.paused_via)} since "
            f"{pause.since}: {pause.reason}",
        )
    if result.detail:
        view.add_row("detail", result.detail)
    return view


@tool_command("export")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the history (JSON).",
)
@shard_options()
def history_export(shard: str, table: str | None, output: Path, **overrides: Any) -> None:
    """Write the history of SHARD's latest workflow run as JSON (ids and counts, no payloads)."""

    async def work() -> int:
        client, ref = await named_shard(build_settings(overrides), shard, table)
        recorded = await client.get_workflow_handle(ref.workflow_id).fetch_history()
        output.write_text(json.dumps(json.loads(recorded.to_json()), indent=1) + "\n")
        return len(recorded.events)

    events = run_or_exit(work(), shard=shard)
    click.echo(f"wrote {events} events of shard {shard} to {output}")
