"""Upgrading from older workflow code: `outbox-bridge upgrade-check` finds the shard and
partition workflows this code cannot run, by their memo's code generation and by the patches
their histories asked for; `--terminate` ends them, and the sweep starts each held shard's
workflow (and each partition) again on the current code, losing nothing."""

from __future__ import annotations

import ast
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.worker import Worker

from outbox_bridge.cli.upgrade import PATCHES
from outbox_bridge.runtime.shards import WORKFLOW
from outbox_bridge.runtime.supervisor import PARTITION_WORKFLOW
from outbox_bridge.workflows import shard as shard_workflow
from outbox_bridge.workflows.models import (
    MEMO_CODE_KEY,
    WORKFLOW_CODE,
    PartitionRef,
    ShardInput,
    ShardRef,
)
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    record_holder,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli
from tests.test_error_text import ReversingCodec


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
    assert "no shard or partition workflow of older code is running" in out


def test_upgrade_check_knows_every_patch_the_workflow_code_asks_for() -> None:
    """A patch the code asks for is never taken for one of older code."""
    asked = set()
    for path in Path(shard_workflow.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("patched", "deprecate_patch")
            ):
                [argument] = node.args
                assert isinstance(argument, ast.Name), ast.unparse(node)
                asked.add(getattr(shard_workflow, argument.id))
    assert asked == PATCHES


# A patch of the 0.x shard workflow, which 1.0 no longer asks for.
OLD_PATCH = "recheck-blocked-head"


@workflow.defn(name=WORKFLOW, sandboxed=False)
class OlderShard:
    """An OutboxShard run of older code that took a patched branch 1.0 does not have."""

    @workflow.run
    async def run(self, _input: ShardInput) -> None:
        workflow.patched(OLD_PATCH)
        await workflow.wait_condition(lambda: False)


async def has_marker(handle: WorkflowHandle[Any, Any]) -> bool:
    history = await handle.fetch_history()
    return any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED for e in history.events)


async def start_older_shard(client: Client, shard: ShardRef) -> WorkflowHandle[Any, Any]:
    """A run with this code's generation in its memo, whose history records OLD_PATCH."""
    queue = f"older-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[OlderShard]):
        handle = await client.start_workflow(
            OlderShard.run,
            ShardInput(shard),
            id=shard.workflow_id,
            task_queue=queue,
            memo={MEMO_CODE_KEY: WORKFLOW_CODE},
        )
        await wait_until(lambda: has_marker(handle), what="the old patch marker recorded")
    return handle


async def test_runs_found_by_their_patch_markers_and_partitions_by_their_memo(
    servers, engine, client
) -> None:
    _recorder, table, app = await fresh_app(engine)
    shard = ShardRef(table, 1, "ORGANIZATION", 32)
    older_shard = await start_older_shard(client, shard)
    # A partition of 0.x: no code generation in its memo.
    partition = PartitionRef(table, 0, fast_settings().partitions)
    older_partition = await client.start_workflow(
        PARTITION_WORKFLOW, table, id=partition.workflow_id, task_queue=f"gone-{table}"
    )

    code, out, err = await cli(servers, table, "upgrade-check", "--json")
    assert code == 1, err
    found = {r["workflow_id"]: (r["code"], r["patches"]) for r in json.loads(out)["runs"]}
    assert found[shard.workflow_id] == (WORKFLOW_CODE, [OLD_PATCH])
    assert found[partition.workflow_id] == (0, [])
    code, out, err = await cli(servers, table, "upgrade-check")
    assert code == 1, err
    assert f"running: {shard.workflow_id} (task queue older-" in out
    assert f"code {WORKFLOW_CODE}, patches {OLD_PATCH})" in out
    code, out, err = await cli(servers, table, "upgrade-check", "--terminate")
    assert code == 0, err
    for handle in (older_shard, older_partition):
        assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED

    # The sweep starts the partition again, on this code.
    async def partition_restarted() -> bool:
        description = await client.get_workflow_handle(partition.workflow_id).describe()
        running = description.status == WorkflowExecutionStatus.RUNNING
        return running and bool(await description.memo() == {MEMO_CODE_KEY: WORKFLOW_CODE})

    async with running_worker(servers, app):
        await wait_until(partition_restarted, what="the partition started again")


async def test_a_run_whose_memo_this_process_cannot_decode_is_left_alone(
    servers, engine, client
) -> None:
    """Another app's runs on the same namespace may carry a payload codec this command lacks:
    each such run is named on stderr and left alone (never ended), and the check goes on."""
    table = unique_table()
    shard = ShardRef(table, 1, "ORGANIZATION", 32)
    converter = dataclasses.replace(client.data_converter, payload_codec=ReversingCodec())
    other_app = Client(client.service_client, namespace=client.namespace, data_converter=converter)
    run = await other_app.start_workflow(
        WORKFLOW,
        ShardInput(shard),
        id=shard.workflow_id,
        task_queue=f"other-app-{table}",
        memo={MEMO_CODE_KEY: 0},
    )
    try:
        code, out, err = await cli(servers, table, "upgrade-check", "--json")
        assert code in (0, 1) and out, f"exit {code}: {err}"
        assert shard.workflow_id not in {r["workflow_id"] for r in json.loads(out)["runs"]}
        assert f"cannot read the memo of {shard.workflow_id}" in err
        code, out, err = await cli(servers, table, "upgrade-check", "--terminate")
        assert code == 0, err
        assert (await run.describe()).status == WorkflowExecutionStatus.RUNNING
    finally:
        await run.terminate()
