"""Hostile conditions that had no test: a skip that lands while the shard's own drain runs a
handler, two region-scoped bridges on one table, a flush whose run completes while the update
waits for delivery, a history with the local-drain fallback replayed, and slow handlers that
exhaust the worker's connection pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from outbox_bridge import OutboxMessage, outbox_context
from outbox_bridge.runtime.shards import parse_shard
from outbox_bridge.testing import assert_replays
from outbox_bridge.workflows.models import ShardStatus, SkipInput
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    fast_settings,
    fresh_app,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.test_processing import drain_past_a_held_lock


def row(category: Category, shard: int, obj: int, **extra: object) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


async def state_of(handle: WorkflowHandle[Any, Any]) -> str:
    status: ShardStatus = await handle.query("status", result_type=ShardStatus)
    return status.state


# -- a skip while the shard's drain runs ---------------------------------------------------------


async def test_a_skip_while_the_shard_s_drain_runs_stops_handlers_until_resumed(
    servers, engine, client: Client
) -> None:
    """A failing call hands the shard to its workflow, whose drain then runs a slow handler.
    A skip taken (the update answered) while that handler runs means no handler of the shard
    starts afterwards: a row written right after the answer is kept until the shard is
    resumed, and then handled once."""
    recorder, _, app = await fresh_app(engine)
    shard = parse_shard("ORGANIZATION:21", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    entered, release = asyncio.Event(), asyncio.Event()
    started: list[tuple[int, float]] = []

    async def behaviour(message: OutboxMessage) -> None:
        started.append((message.object_identifier, time.monotonic()))
        if message.object_identifier == 0 and len(started) == 1:
            raise ConnectionError("the first call fails: the shard goes to its workflow")
        if message.object_identifier == 1 and not entered.is_set():
            entered.set()
            await asyncio.wait_for(release.wait(), timeout=60)

    recorder.behaviour[Category.PROJECT_UPDATE] = behaviour
    await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 21, 0), row(Category.PROJECT_UPDATE, 21, 1)]
    )
    async with running_worker(servers, app, fast_settings(sweep_interval=3600.0)):
        await asyncio.wait_for(entered.wait(), timeout=60)  # in the workflow's drain
        skip = asyncio.create_task(
            handle.execute_update("skip", SkipInput(reason="investigating", by="ops"))
        )

        async def skipped() -> bool:
            return await state_of(handle) == "skipped"

        await wait_until(skipped, what="the skip, taken while the handler runs")
        release.set()  # the handler under way returns (or was cancelled by the skip)
        await skip
        answered = time.monotonic()
        [kept] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 21, 50)])
        await asyncio.sleep(3)  # several retry intervals: a skipped shard runs no handler
        assert [obj for obj, at in started if at >= answered] == [], started
        assert kept not in recorder.ids(), "a handler ran on a skipped shard"
        assert await state_of(handle) == "skipped"
        await handle.execute_update("resume", {})
        await wait_until(lambda: table_empty(engine, app), what="the kept row, once resumed")
    assert recorder.ids().count(kept) == 1


# -- two region-scoped bridges on one table ------------------------------------------------------


async def test_two_region_scoped_bridges_on_one_table(servers, engine, client: Client) -> None:
    """Workers of regions eu and us (each on its own task queue, as the README says) on one
    regional table: both bridges are active at once, each handles its region's rows only and
    runs its partitions on its own task queue; a third region's rows stay."""
    table = unique_table()
    eu, us = Recorder(), Recorder()
    eu_app, us_app = make_app(table, eu, regional=True), make_app(table, us, regional=True)
    await create_tables(engine, eu_app)
    eu_settings = fast_settings(regions=["eu"], task_queue=f"tq-eu-{table}")
    us_settings = fast_settings(regions=["us"], task_queue=f"tq-us-{table}")
    async with running_worker(servers, eu_app, eu_settings):
        async with running_worker(servers, us_app, us_settings):
            rows = [
                row(Category.PROJECT_UPDATE, shard, 1, region=region)
                for region in ("eu", "us", "ap")
                for shard in (1, 2, 3)
            ]
            await write_rows(engine, eu_app, rows)

            async def only_ap_left() -> bool:
                async with engine.connect() as conn:
                    left = await conn.execute(text(f"SELECT DISTINCT region FROM {table}"))
                    return set(left.scalars()) == {"ap"}

            await wait_until(only_ap_left, what="the eu and us rows")
    assert sorted(c.shard for c in eu.calls) == ["eu:1:1", "eu:1:2", "eu:1:3"]
    assert sorted(c.shard for c in us.calls) == ["us:1:1", "us:1:2", "us:1:3"]
    for region, settings in (("eu", eu_settings), ("us", us_settings)):
        # Each region's partitions on its task queue.
        for wid in [f"outbox:{table}:partition:{n}:{region}" for n in range(settings.partitions)]:
            description = await client.get_workflow_handle(wid).describe()
            assert description.task_queue == settings.task_queue, wid


# -- a flush whose run completes before it takes the update --------------------------------------


async def past_the_head(client: Client, workflow_id: str) -> bool:
    """The shard's run completed a workflow task after its category activity completed."""
    kinds = [
        e.event_type async for e in client.get_workflow_handle(workflow_id).fetch_history_events()
    ]
    done = EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    return (
        done in kinds and EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in kinds[kinds.index(done) :]
    )


async def test_a_flush_is_sent_again_when_its_run_completes_before_taking_it(
    servers, engine, client: Client
) -> None:
    """A failing call hands the shard to its run, which retries it, drains the row behind it
    (a slow handler) and completes as soon as the shard is empty; a flush of that row sent
    meanwhile (a little later for each shard, so that one lands as its run completes) may
    reach that run, which completes without taking it. The flush is sent again, starts a new
    run, and answers ``handled`` from the table: not ``unavailable``."""
    recorder, _, app = await fresh_app(engine)
    failed: set[int] = set()

    async def fails_once_then_slow(message: OutboxMessage) -> None:
        if message.object_identifier == 0 and message.shard_identifier not in failed:
            failed.add(message.shard_identifier)
            raise ConnectionError("the first call fails: the shard goes to its workflow")
        if message.object_identifier == 1:
            await asyncio.sleep(1.0)

    recorder.behaviour[Category.PROJECT_UPDATE] = fails_once_then_slow

    def handled(row_id: int) -> bool:
        return row_id in recorder.ids()

    settings = fast_settings()
    outcomes: list[str] = []
    dropped_by_a_run = 0
    async with running_worker(servers, app, settings):
        app.configure_flush(
            settings.model_copy(update={"temporal_address": servers.temporal_address})
        )
        for n, shard in enumerate(range(31, 39)):
            [head] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, shard, 0)])
            async with AsyncSession(engine) as session:
                async with outbox_context(session, flush=True, timeout=15) as outbox:
                    await app.write_async(
                        session,
                        category=Category.PROJECT_UPDATE,
                        shard_identifier=shard,
                        object_identifier=1,
                    )
                    await session.commit()
                    # The shard's run has retried the head, and taken in the success (its
                    # state no longer blocked): it drains the slow row now.
                    await wait_until(partial(handled, head), what="the head's retry")
                    ref = parse_shard(f"ORGANIZATION:{shard}", app)
                    await wait_until(
                        partial(past_the_head, client, ref.workflow_id),
                        what="the run past its head",
                    )
                    await asyncio.sleep(0.2 * n)
            outcomes.append(outbox.report.results[0].outcome)
            runs = [
                w
                async for w in client.list_workflows(
                    f'WorkflowId = "{parse_shard(f"ORGANIZATION:{shard}", app).workflow_id}"'
                )
            ]
            if len(runs) > 1:
                dropped_by_a_run += 1
    assert outcomes == ["handled"] * len(outcomes), outcomes
    if not dropped_by_a_run:
        pytest.skip("no run completed before taking its flush: the case did not occur")


# -- the local-drain fallback, replayed ----------------------------------------------------------


async def test_a_history_with_the_local_drain_fallback_replays(servers, engine, client) -> None:
    """The local drain fails while another session holds the shard's lock, and the workflow
    falls back to a normal drain_shard activity; the run's history replays against the
    workflow code, sandboxed and not."""
    recorder, _, app = await fresh_app(engine)
    handle, result = await drain_past_a_held_lock(
        servers, engine, client, app, parse_shard("ORGANIZATION:62", app)
    )
    assert result.outcome == "handled", result
    history = await handle.fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    markers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert "drain_shard" in scheduled and markers  # failed local drains, then the fallback
    assert [c.object_identifier for c in recorder.calls] == [1]
    assert_replays(history)


# -- the connection pool exhausted by slow handlers ----------------------------------------------


@pytest.mark.slow
async def test_slow_handlers_that_exhaust_the_connection_pool_slow_the_worker_down(
    servers, engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain holds a connection (and its shard's lock) while its handlers run. With more
    concurrent drains than connections, and handlers slower than the pool's 30 s wait, drains
    wait for connections or fail and are retried: the worker slows down, the bridge keeps
    working (no 'bridge failed', no error logged), and every row is handled."""
    recorder, _, app = await fresh_app(engine)
    release = asyncio.Event()

    async def held(message: OutboxMessage) -> None:
        if message.shard_identifier <= 10:
            await release.wait()

    recorder.behaviour[Category.PROJECT_UPDATE] = held
    # 2 connections + 5 overflow; 10 drains may run at once.
    settings = fast_settings(database_pool_size=2, max_concurrent_activities=10)
    with caplog.at_level(logging.INFO, logger="outbox_bridge"):
        async with running_worker(servers, app, settings):
            rows = [row(Category.PROJECT_UPDATE, s, 1) for s in range(1, 11)]
            await write_rows(engine, app, rows)
            # Every connection is held by a blocked drain for longer than the pool's timeout;
            # meanwhile rows of other shards arrive and must be noticed.
            await asyncio.sleep(35)
            [late] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 11, 1)])
            release.set()
            await wait_until(lambda: table_empty(engine, app), timeout=120, what="every row")
    assert late in recorder.ids()
    assert {c.shard for c in recorder.calls} == {f"1:{s}" for s in range(1, 12)}
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("outbox_bridge")]
    assert not [m for m in messages if m.startswith(("bridge failed", "bridge lost"))]
    assert len([m for m in messages if m.startswith("bridge active")]) == 1  # never restarted
