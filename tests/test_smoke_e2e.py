from __future__ import annotations

import gc
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.service import RPCError

from outbox_bridge.runtime.worker import YOUNG_THRESHOLD
from tests.harness import (
    Category,
    fresh_app,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)


async def test_rows_are_handled(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    async with running_worker(servers, app):
        ids = await write_rows(
            engine,
            app,
            [
                {
                    "category": Category.PROJECT_UPDATE,
                    "shard_identifier": 1,
                    "object_identifier": 5,
                    "payload": {"n": i},
                }
                for i in range(3)
            ],
        )
        await wait_until(lambda: len(recorder.calls) >= 1, what="a handler call")
        await wait_until(lambda: table_empty(engine, app), what="empty table")
    assert recorder.ids() == [ids[-1]]
    assert recorder.calls[0].coalesced == 3


async def test_the_worker_leaves_its_startup_objects_out_of_collections(servers, engine) -> None:
    """While the worker runs, what it started with is frozen (the collector scans only what the
    drains allocate); once it stops, the process is as it was."""
    recorder, _, app = await fresh_app(engine)
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    async with running_worker(servers, app):
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] >= YOUNG_THRESHOLD
        ids = await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 2, "object_identifier": 7}],
        )
        await wait_until(lambda: table_empty(engine, app), what="empty table")
    assert recorder.ids() == ids
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


async def test_the_workers_report_their_workflow_code_as_build_id(servers, engine, client) -> None:
    """The build id in each workflow task is the package version and a digest of the
    workflow code, given to the SDK (which otherwise digests every module the process has
    loaded, about a fifth of a second of each start)."""
    from outbox_bridge import __version__
    from outbox_bridge.runtime.assembly import build_id

    _, table, app = await fresh_app(engine)
    async with running_worker(servers, app):
        handle = client.get_workflow_handle(f"outbox:{table}:partition:0")

        async def completed_task() -> bool:
            try:
                return bool(await _build_ids(handle))
            except RPCError:
                return False  # not started yet

        await wait_until(completed_task, what="a workflow task of the partition")
        assert set(await _build_ids(handle)) == {build_id()}
    assert build_id().startswith(f"outbox-bridge-{__version__}-")


async def _build_ids(handle: WorkflowHandle[Any, Any]) -> list[str]:
    return [
        event.workflow_task_completed_event_attributes.worker_version.build_id
        async for event in handle.fetch_history_events()
        if event.HasField("workflow_task_completed_event_attributes")
    ]
