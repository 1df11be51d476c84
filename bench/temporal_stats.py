"""What the shard workflows of one benchmark run cost in Temporal, read from visibility.

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
    async for execution in client.list_workflows(shard_query(task_queue), page_size=1000):
        executions += 1
        events += execution.history_length
        running += int(execution.close_time is None)
    return HistoryStats(events, executions, running)
