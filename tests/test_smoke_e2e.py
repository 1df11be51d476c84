from __future__ import annotations

import gc

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
    async with running_worker(servers, app):
        assert gc.get_freeze_count() > 0
        ids = await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 2, "object_identifier": 7}],
        )
        await wait_until(lambda: table_empty(engine, app), what="empty table")
    assert recorder.ids() == ids
    assert gc.get_freeze_count() == 0
