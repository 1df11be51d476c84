"""``outbox-bridge upgrade-check``: find the shard workflow runs of an older generation of the
workflow code, and end them on request (no row or ownership is lost: :data:`TERMINATE_REASON`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any

import click
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.cli.commands import main
from outbox_bridge.cli.connections import temporal_client
from outbox_bridge.cli.failures import fail
from outbox_bridge.cli.flags import build_settings, settings_options
from outbox_bridge.config import SettingGroup
from outbox_bridge.errors import OutboxError
from outbox_bridge.runtime.shards import WORKFLOW
from outbox_bridge.workflows.models import MEMO_CODE_KEY, WORKFLOW_CODE

TERMINATE_REASON = (
    "outbox-bridge upgrade: a run of older workflow code; the owner table keeps the shard, and "
    "the next sweep starts its workflow again on the current code"
)


@dataclass
class OlderRun:
    """A running shard workflow started by an older generation of the workflow code."""

    workflow_id: str
    run_id: str
    task_queue: str
    code: int  # its generation (0: before generations were recorded)


async def older_runs(client: Client) -> list[OlderRun]:
    """Every running OutboxShard workflow of the client's namespace whose memo names another
    generation of the workflow code than this one's (:data:`WORKFLOW_CODE`)."""
    found = []
    query = f"WorkflowType = '{WORKFLOW}' AND ExecutionStatus = 'Running'"
    async for execution in client.list_workflows(query):
        memo = await execution.memo()
        code = memo.get(MEMO_CODE_KEY, 0)
        if code != WORKFLOW_CODE:
            found.append(
                OlderRun(execution.id, execution.run_id, execution.task_queue, int(code or 0))
            )
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
    """Find shard workflows started by an older generation of the workflow code, which this
    version cannot run; exits 1 while any is left (after --terminate: 0), 2 when it cannot
    look.

    Run it after the old workers stopped and before the new ones start (docs: Upgrade safely).
    """
    try:
        runs = asyncio.run(_check(overrides, terminate))
    except (OutboxError, RPCError) as exc:
        # 2, not 1: a script tells "older runs left" from "could not look".
        fail(f"cannot check the shard workflows: {exc}", code=2)
    if as_json:
        click.echo(json.dumps({"terminated": terminate, "runs": [asdict(r) for r in runs]}))
    elif not runs:
        click.echo(
            f"no shard workflow of older code is running (this code: generation {WORKFLOW_CODE})"
        )
    else:
        verb = "ended" if terminate else "running"
        for run in runs:
            click.echo(f"{verb}: {run.workflow_id} (task queue {run.task_queue}, code {run.code})")
        if not terminate:
            click.echo(
                f"{len(runs)} shard workflow(s) of older code are running; end them with "
                "`outbox-bridge upgrade-check --terminate` once no worker of the older version "
                "runs (their rows and ownership stay in the table)"
            )
    if runs and not terminate:
        raise SystemExit(1)
