"""What the workflows of one benchmark run cost in Temporal, read from visibility: the shard
workflows (``OutboxShard``) and the partition workflows (``OutboxPartition``) that drain
healthy shards by default.

Workflow executions of a run are found by their task queue (unique per run). Visibility lags
behind the workflows, so counts are read until they are stable. Partition workflows never
close while their table exists: the check that every workflow of a run closed looks at shard
workflows only, and a partition's history is counted as far as it goes (its length comes from
describe, as for any execution still open).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from temporalio.client import Client

SHARD_WORKFLOW = "OutboxShard"
PARTITION_WORKFLOW = "OutboxPartition"


def shard_query(task_queue: str, status: str | None = None) -> str:
    return workflow_query(SHARD_WORKFLOW, task_queue, status)


def workflow_query(workflow_type: str, task_queue: str, status: str | None = None) -> str:
    query = f'WorkflowType = "{workflow_type}" AND TaskQueue = "{task_queue}"'
    if status is not None:
        query += f' AND ExecutionStatus = "{status}"'
    return query


async def count(client: Client, query: str) -> int:
    return (await client.count_workflows(query)).count


async def wait_all_closed(client: Client, task_queue: str, *, timeout: float) -> int:
    """Wait until no shard workflow of the run is running (they complete once their shard is
    empty, or after their idle timeout); return how many still run when ``timeout`` passes (0
    when all closed). Partition workflows are not waited for: they never close."""
    deadline = time.monotonic() + timeout
    running = await count(client, shard_query(task_queue, "Running"))
    while running and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        running = await count(client, shard_query(task_queue, "Running"))
    return running


@dataclass
class HistoryStats:
    """History events and executions of a run, by workflow type."""

    events: int = 0  # every execution of the run
    executions: int = 0
    running: int = 0  # shard workflow executions still running
    shard_events: int = 0
    shard_runs: int = 0  # executions, each continue-as-new counted
    shard_workflows: int = 0  # distinct workflow ids: shards that got a workflow of their own
    partition_events: int = 0
    partition_runs: int = 0
    partitions_running: int = 0


async def history_stats(
    client: Client, task_queue: str, *, all_closed: bool, settle: float = 30.0
) -> HistoryStats:
    """Sum ``history_length`` over every execution (each continue-as-new run counts) once the
    number of closed shard executions has stopped changing (at once when visibility already
    showed every shard workflow closed: then no more can appear)."""
    deadline = time.monotonic() + (0.0 if all_closed else settle)
    closed_query = shard_query(task_queue) + ' AND ExecutionStatus != "Running"'
    previous = -1
    closed = await count(client, closed_query)
    while closed != previous and time.monotonic() < deadline:
        previous = closed
        await asyncio.sleep(0.5)
        closed = await count(client, closed_query)
    stats = HistoryStats()
    shard_ids: set[str] = set()
    async for execution in client.list_workflows(f'TaskQueue = "{task_queue}"', page_size=1000):
        stats.executions += 1
        is_shard = execution.workflow_type == SHARD_WORKFLOW
        if execution.close_time is None:
            # Visibility records a history's length when the run closes: ask the run itself
            # (the partitions, which keep running, and shard workflows still open).
            described = await client.get_workflow_handle(
                execution.id, run_id=execution.run_id
            ).describe()
            events = described.raw_description.workflow_execution_info.history_length
            stats.running += int(is_shard)
            stats.partitions_running += int(execution.workflow_type == PARTITION_WORKFLOW)
        else:
            events = execution.history_length
        stats.events += events
        if is_shard:
            stats.shard_events += events
            stats.shard_runs += 1
            shard_ids.add(execution.id)
        elif execution.workflow_type == PARTITION_WORKFLOW:
            stats.partition_events += events
            stats.partition_runs += 1
    stats.shard_workflows = len(shard_ids)
    return stats
