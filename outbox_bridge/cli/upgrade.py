"""``outbox-bridge upgrade-check``: find the shard and partition workflow runs of older workflow
code, by what their histories record (the generation of the code that started them, in their
memo, and the patches they asked for), and end them on request (no row or ownership is lost:
:data:`TERMINATE_REASON`)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import click
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from outbox_bridge.cli.commands import main
from outbox_bridge.cli.connections import temporal_client
from outbox_bridge.cli.failures import fail
from outbox_bridge.cli.flags import build_settings, settings_options
from outbox_bridge.config import SettingGroup
from outbox_bridge.errors import OutboxError
from outbox_bridge.runtime.shards import WORKFLOW
from outbox_bridge.runtime.supervisor import PARTITION_WORKFLOW
from outbox_bridge.workflows.models import MEMO_CODE_KEY, WORKFLOW_CODE
from outbox_bridge.workflows.shard import CARRY_BACKOFF_FROM_NOW, DRAIN_HANDED_DEFERRED

log = logging.getLogger(__name__)

TERMINATE_REASON = (
    "outbox-bridge upgrade: a run of older workflow code; rows and shard ownership stay in the "
    "table, and the next sweep starts the workflow again on the current code"
)
# Every patch the workflow code asks for (workflow.patched or workflow.deprecate_patch). A run
# whose history records another one took a branch this code no longer has.
PATCHES = frozenset({CARRY_BACKOFF_FROM_NOW, DRAIN_HANDED_DEFERRED})
# The marker the SDK records for a patch, its id and whether it is deprecated in its details.
PATCH_MARKER, PATCH_DETAILS = "core_patch", "patch-data"


@dataclass
class OlderRun:
    """A running shard workflow started by an older generation of the workflow code."""

    workflow_id: str
    run_id: str
    task_queue: str
    code: int  # its generation (0: before generations were recorded)
    patches: list[str]  # the patches its history asked for that this code does not know


async def unknown_patches(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """The patches a run's history asked for (not deprecated) that this code does not know:
    replaying it needs their branch. A marker that cannot be read counts as unknown."""
    found = []
    async for event in handle.fetch_history_events():
        marker = event.marker_recorded_event_attributes
        if marker.marker_name != PATCH_MARKER:
            continue
        for payload in marker.details[PATCH_DETAILS].payloads:
            try:
                patch = json.loads(payload.data)
                name, deprecated = str(patch["id"]), bool(patch.get("deprecated"))
            except (ValueError, KeyError, TypeError):
                name, deprecated = "(unreadable patch marker)", False
            if not deprecated and name not in PATCHES:
                found.append(name)
    return found


async def older_runs(client: Client) -> list[OlderRun]:
    """Every running shard or partition workflow of the client's namespace that this code
    cannot run: its memo names another generation of the workflow code than this one's
    (:data:`WORKFLOW_CODE`), or its history asked for a patch this code does not know."""
    found = []
    types = " OR ".join(f"WorkflowType = '{name}'" for name in (WORKFLOW, PARTITION_WORKFLOW))
    async for execution in client.list_workflows(f"({types}) AND ExecutionStatus = 'Running'"):
        try:
            code = (await execution.memo()).get(MEMO_CODE_KEY, 0)
        except Exception as exc:  # a payload codec this process lacks (another app's, say)
            log.warning("cannot read the memo of %s (%s): left alone", execution.id, exc)
            continue
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        patches = await unknown_patches(handle) if code == WORKFLOW_CODE else []
        if code != WORKFLOW_CODE or patches:
            run = OlderRun(
                execution.id, execution.run_id, execution.task_queue, int(code or 0), patches
            )
            found.append(run)
    return found


async def _check(overrides: dict[str, Any], terminate: bool) -> list[OlderRun]:
    settings = build_settings(overrides)
    client = await temporal_client(settings)
    runs = await older_runs(client)
    if terminate:
        await asyncio.gather(
            *(
                client.get_workflow_handle(run.workflow_id, run_id=run.run_id).terminate(
                    reason=TERMINATE_REASON
                )
                for run in runs
            )
        )
    return runs


@main.command("upgrade-check")
@click.option(
    "--terminate",
    is_flag=True,
    help="End the runs found (no row is lost: the next sweep starts them again on this code).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@settings_options(SettingGroup.TEMPORAL)
def upgrade_check(terminate: bool, as_json: bool, **overrides: Any) -> None:
    """Find shard and partition workflows of older workflow code, which this version cannot
    run (by their memo's code generation and the patches their histories asked for); exits 1
    while any is left (after --terminate: 0), 2 when it cannot look.

    Run it after the old workers stopped and before the new ones start (docs: Upgrade safely).
    """
    try:
        runs = asyncio.run(_check(overrides, terminate))
    except (OutboxError, RPCError) as exc:
        # 2, not 1: a script tells "older runs left" from "could not look".
        fail(f"cannot check the shard and partition workflows: {exc}", code=2)
    if as_json:
        click.echo(json.dumps({"terminated": terminate, "runs": [asdict(r) for r in runs]}))
    elif not runs:
        click.echo(
            "no shard or partition workflow of older code is running "
            f"(this code: generation {WORKFLOW_CODE})"
        )
    else:
        verb = "ended" if terminate else "running"
        for run in runs:
            patches = f", patches {', '.join(run.patches)}" if run.patches else ""
            click.echo(
                f"{verb}: {run.workflow_id} (task queue {run.task_queue}, code {run.code}{patches})"
            )
        if not terminate:
            click.echo(
                f"{len(runs)} workflow(s) of older code are running; end them with "
                "`outbox-bridge upgrade-check --terminate` once no worker of the older version "
                "runs (their rows and ownership stay in the table)"
            )
    if runs and not terminate:
        raise SystemExit(1)
