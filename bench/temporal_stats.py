"""What the workflows of one benchmark run cost in Temporal (the shard workflows, and the
partition workflows that drain healthy shards), read from visibility.

Workflow executions of a run are found by their task queue (unique per run). Visibility lags
behind the workflows, so counts are read until they are stable.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from temporalio.client import Client


def shard_query(task_queue: str, status: str | None = None) -> str:
    query = f'WorkflowType = "OutboxShard" AND TaskQueue = "{task_queue}"'
    if status is not None:
        query += f' AND ExecutionStatus = "{status}"'
    return query


async def count(client: Client, query: str) -> int:
    return (await client.count_workflows(query)).count


async def wait_all_closed(client: Client, task_queue: str, *, timeout: float) -> int:
    """Wait until no shard workflow of the run is running (they complete after their idle
    timeout); return how many still run when ``timeout`` passes (0 when all closed)."""
    deadline = time.monotonic() + timeout
    running = await count(client, shard_query(task_queue, "Running"))
    while running and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        running = await count(client, shard_query(task_queue, "Running"))
    return running


@dataclass
class HistoryStats:
    events: int
    executions: int
    running: int


async def history_stats(
    client: Client, task_queue: str, *, all_closed: bool, settle: float = 30.0
) -> HistoryStats:
    """Sum ``history_length`` over every execution (each continue-as-new run counts) once the
    number of closed executions has stopped changing (at once when visibility already showed
    every execution closed: then no more can appear)."""
    deadline = time.monotonic() + (0.0 if all_closed else settle)
    closed_query = shard_query(task_queue) + ' AND ExecutionStatus != "Running"'
    previous = -1
    closed = await count(client, closed_query)
    while closed != previous and time.monotonic() < deadline:
        previous = closed
        await asyncio.sleep(0.5)
        closed = await count(client, closed_query)
    events = executions = running = 0
    async for execution in client.list_workflows(f'TaskQueue = "{task_queue}"', page_size=1000):
        executions += 1
        if execution.close_time is None:
            # Visibility records a history's length when the run closes: ask the run itself
            # (the partitions, which keep running, and shard workflows still open).
            described = await client.get_workflow_handle(
                execution.id, run_id=execution.run_id
            ).describe()
            events += described.raw_description.workflow_execution_info.history_length
            running += int(execution.workflow_type == "OutboxShard")
        else:
            events += execution.history_length
    return HistoryStats(events, executions, running)
