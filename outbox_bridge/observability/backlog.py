"""What the active bridge's sweep measures for the metrics: each scope's backlog (from the
sweep's own aggregate and one index lookup per shard), and how many shard workflows are blocked
or skipped (counted by their ``OutboxState`` search attribute: a workflow cannot record metrics,
its code replays and would count again).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.db.scans import ShardRange, read_row_ages
from outbox_bridge.observability.metrics import Attributes, OutboxMetrics
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import WORKFLOW
from outbox_bridge.workflows.models import STATE_ATTRIBUTE, ShardState

log = logging.getLogger("outbox_bridge.observability.backlog")


async def observe_backlog(
    metrics: OutboxMetrics,
    owner: object,
    conn: AsyncConnection,
    app: OutboxApp,
    table: Table,
    ranges: Iterable[ShardRange],
) -> None:
    """Report ``outbox.backlog.rows`` and ``outbox.backlog.oldest_age_seconds`` (of the oldest
    shard head, by the database's clock) for every scope of ``table``, 0 for an empty scope."""
    ranges = list(ranges)
    heads = await read_row_ages(conn, table, [shard.min_id for shard in ranges])
    rows = {int(scope): 0 for scope in app.scopes}
    ages: dict[int, float] = {}
    for shard in ranges:
        rows[shard.scope] = rows.get(shard.scope, 0) + shard.rows
        ages[shard.scope] = max(heads.get(shard.min_id, 0.0), ages.get(shard.scope, 0.0))
    counts: dict[Attributes, float] = {}
    oldest: dict[Attributes, float] = {}
    for scope, count in rows.items():
        attributes = (("outbox.table", table.name), ("outbox.scope", app.scope_name(scope)))
        counts[attributes] = float(count)
        oldest[attributes] = ages.get(scope, 0.0) if count else 0.0
    metrics.report(owner, "outbox.backlog.rows", counts)
    metrics.report(owner, "outbox.backlog.oldest_age_seconds", oldest)


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


async def count_shard_states(
    client: Client, task_queue: str, states: Iterable[str | None]
) -> dict[str | None, int | None]:
    """How many running shard workflows of ``task_queue`` are in each of ``states`` (None: in
    any state), from their ``OutboxState`` search attribute; None for a count Temporal did not
    answer (logged)."""
    counts: dict[str | None, int | None] = {}
    for state in states:
        query = (
            f"WorkflowType = {_quoted(WORKFLOW)} AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = {_quoted(task_queue)}"
        )
        if state is not None:
            query += f" AND {STATE_ATTRIBUTE.name} = {_quoted(state)}"
        try:
            counts[state] = (await client.count_workflows(query)).count
        except RPCError as exc:
            log.warning("cannot count %s shards: %s", state or "running", exc.message)
            counts[state] = None
    return counts


async def observe_shard_states(
    metrics: OutboxMetrics, owner: object, client: Client, task_queue: str
) -> None:
    """Report ``outbox.shards.blocked`` and ``outbox.shards.skipped``: the running shard
    workflows of ``task_queue`` in that state. A failed count keeps the previous value."""
    attributes: Attributes = (("outbox.task_queue", task_queue),)
    for state, count in (
        await count_shard_states(client, task_queue, (ShardState.BLOCKED, ShardState.SKIPPED))
    ).items():
        if count is not None:
            metrics.report(owner, f"outbox.shards.{state}", {attributes: float(count)})
