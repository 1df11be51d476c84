"""Upgrading from an older generation of the workflow code: `outbox-bridge upgrade-check` finds
the shard workflows this code cannot run, `--terminate` ends them, and the sweep starts each
held shard's workflow again on the current code, losing nothing."""

from __future__ import annotations

import json

from temporalio.client import WorkflowExecutionStatus

from outbox_bridge.runtime.shards import WORKFLOW
from outbox_bridge.workflows.models import MEMO_CODE_KEY, WORKFLOW_CODE, ShardInput, ShardRef
from tests.harness import (
    Category,
    fresh_app,
    record_holder,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli


async def test_runs_of_older_code_are_found_ended_and_started_again(
    servers, engine, client
) -> None:
    recorder, table, app = await fresh_app(engine)
    await write_rows(
        engine,
        app,
        [{"category": Category.PROJECT_UPDATE, "shard_identifier": 31, "object_identifier": 1}],
    )
    # A shard its workflow holds, as an older worker left it: held in the table, its run
    # started without the code generation in its memo, on a task queue nobody polls now.
    await record_holder(engine, table, 31, "failed")
    shard = ShardRef(table, 1, "ORGANIZATION", 31)
    old = await client.start_workflow(
        WORKFLOW, ShardInput(shard), id=shard.workflow_id, task_queue=f"gone-{table}"
    )

    code, out, err = await cli(servers, table, "upgrade-check", "--json")
    # Exit 1 with nothing printed is not "runs left" but an unexpected exception (its traceback).
    assert code == 1 and out, f"exit {code}: {err}"
    found = json.loads(out)["runs"]
    assert [
        (r["workflow_id"], r["code"]) for r in found if r["workflow_id"] == shard.workflow_id
    ] == [(shard.workflow_id, 0)]
    code, out, err = await cli(servers, table, "upgrade-check", "--terminate")
    assert code == 0, err
    assert f"ended: {shard.workflow_id}" in out
    assert (await old.describe()).status == WorkflowExecutionStatus.TERMINATED

    async with running_worker(servers, app):
        await wait_until(lambda: table_empty(engine, app), what="the held shard drained")
    assert [c.object_identifier for c in recorder.calls] == [1]
    restarted = client.get_workflow_handle(shard.workflow_id)
    assert await (await restarted.describe()).memo() == {MEMO_CODE_KEY: WORKFLOW_CODE}
    code, out, err = await cli(servers, table, "upgrade-check")
    assert code == 0, err
    assert "no shard workflow of older code is running" in out
