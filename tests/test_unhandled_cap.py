"""Rows no handler of the app can take (a category it does not register, or registers in another
scope) spread over many shard ids: at most ``max_unhandled_shards`` of those shards get a shard
workflow; the others wait with their rows, out of the drains' way, and get theirs when an
operator skips one. Ordinary shards keep draining. Real PostgreSQL and Temporal."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import text
from temporalio.client import Client

from outbox_bridge.workflows.models import SkipInput
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    running_worker,
    sql,
    wait_until,
    write_rows,
)

CAP = 3
UNKNOWN_SHARDS = range(100, 108)  # eight shards whose rows have category 99, unregistered


async def _shard_workflows(client: Client, task_queue: str) -> set[str]:
    return {
        w.id
        async for w in client.list_workflows(
            f"WorkflowType = 'OutboxShard' AND TaskQueue = '{task_queue}' "
            "AND ExecutionStatus = 'Running'"
        )
    }


async def _held(engine, table: str) -> int:
    async with engine.connect() as conn:
        count = await conn.scalar(text(f"SELECT count(*) FROM {table}_owners"))
    return int(count or 0)


def _attempted(caplog: pytest.LogCaptureFixture) -> set[str]:
    """The unknown shards whose row a round tried (each logs its failure)."""
    return {
        str(r.args[0])  # type: ignore[index]
        for r in caplog.records
        if r.msg.startswith("handler failed") and "UnknownCategoryError" in r.getMessage()
    }


async def test_shards_of_rows_the_app_cannot_handle_get_at_most_the_cap_of_workflows(
    servers, engine, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings(max_unhandled_shards=CAP, max_retry_interval=0.5)
    values = ", ".join(f"(1, {shard}, 99, 1)" for shard in UNKNOWN_SHARDS)
    with caplog.at_level(logging.INFO, logger="outbox_bridge"):
        async with running_worker(servers, app, settings):
            await sql(
                engine,
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                f"object_identifier) VALUES {values}",
            )
            ordinary = await write_rows(
                engine,
                app,
                [
                    {
                        "category": Category.PROJECT_UPDATE,
                        "shard_identifier": n,
                        "object_identifier": 1,
                    }
                    for n in range(1, 6)
                ],
            )
            await wait_until(
                lambda: set(ordinary) <= set(recorder.ids()), what="the ordinary shards drained"
            )
            await wait_until(
                lambda: len(_attempted(caplog)) == len(UNKNOWN_SHARDS),
                what="every unknown shard tried",
            )
            await wait_until(
                lambda: _count_is(client, settings.task_queue, CAP), what="the cap's workflows"
            )
            # Every shard was tried and decided: only the cap's were held for a workflow.
            assert await _held(engine, table) == CAP
            held_back = [m for m in _messages(caplog) if m.startswith("held back ")]
            assert (
                held_back and f" of {table} whose head row this app cannot handle" in held_back[0]
            )
            assert len(held_back) == 1  # at most one a minute

            # An operator skips one: its place goes to a waiting shard.
            [first, *_] = sorted(await _shard_workflows(client, settings.task_queue))
            await client.get_workflow_handle(first).execute_update(
                "skip", SkipInput(reason="parked", by="test")
            )
            await wait_until(
                lambda: _count_is(client, settings.task_queue, CAP + 1),
                what="a waiting shard's workflow",
            )
            for workflow_id in await _shard_workflows(client, settings.task_queue):
                await client.get_workflow_handle(workflow_id).signal(
                    "skip", SkipInput(reason="test over")
                )
    # Nothing was lost: every row of the unknown category is still in the table.
    async with engine.connect() as conn:
        left = await conn.scalar(text(f"SELECT count(*) FROM {table} WHERE category = 99"))
    assert left == len(UNKNOWN_SHARDS)


async def _count_is(client: Client, task_queue: str, expected: int) -> bool:
    return len(await _shard_workflows(client, task_queue)) == expected


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("outbox_bridge")]
