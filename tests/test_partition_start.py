"""How a worker starts its table's partition workflows, and hands its options to the ones an
earlier worker started."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.runtime.shards import parse_shard, shard_status
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    running_worker,
    wait_until,
    write_rows,
)


async def partition_events(client: Client, table: str) -> list[EventType.ValueType]:
    handle = client.get_workflow_handle(f"outbox:{table}:partition:0")
    return [event.event_type async for event in handle.fetch_history_events()]


async def test_a_partition_started_by_the_worker_is_not_signalled(servers, engine, client) -> None:
    """A partition the worker starts has its options from the start: no reconfigure signal
    (with the eagerly started first task, each cost a further workflow task)."""
    _, table, app = await fresh_app(engine)
    async with running_worker(servers, app):

        async def draining() -> bool:
            try:
                events = await partition_events(client, table)
            except RPCError:
                return False  # not started yet
            return EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED in events

        await wait_until(draining, what="partition 0 draining")
        events = await partition_events(client, table)
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED not in events


async def test_a_running_partition_gets_the_new_workers_options(servers, engine, client) -> None:
    """Partitions outlive the worker that started them: the next worker hands them its
    options. Here a skip list added at the restart reaches them and the listed shard ends
    skipped."""
    recorder, table, app = await fresh_app(engine)
    first = fast_settings()
    async with running_worker(servers, app, first):
        await wait_until(
            lambda: _partition_exists(client, table), what="the first worker's partitions"
        )
    name = "ORGANIZATION:9"
    second = fast_settings(skip_shards=[name], task_queue=first.task_queue)
    async with running_worker(servers, app, second):
        [row] = await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 9, "object_identifier": 1}],
        )
        shard = parse_shard(name, app, table=table)

        async def skipped() -> bool:
            try:
                return (await shard_status(client, shard)).state == "skipped"
            except RPCError:
                return False

        await wait_until(skipped, what="the listed shard skipped")

        async def signalled() -> bool:
            events = await partition_events(client, table)
            return EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED in events

        # The drains apply the worker's own skip list at once, so the shard may be skipped
        # before the new options reach the partition: they must reach it all the same.
        await wait_until(signalled, what="the new options in the partition's history")
    assert row not in recorder.ids()  # a listed shard never runs


async def _partition_exists(client: Client, table: str) -> bool:
    try:
        await client.get_workflow_handle(f"outbox:{table}:partition:0").describe()
    except RPCError:
        return False
    return True
