"""A flush never raises once the transaction committed: when Temporal cannot be reached (on
first use, or after the client connected once) and when no worker polls the flusher's task
queue, every shard is answered ``unavailable`` with a detail, and the rows are handled
asynchronously. Against a Temporal dev server of the test's own, which it stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox_bridge import OutboxApp, outbox_context
from outbox_bridge import flush as flush_module
from outbox_bridge.config import OutboxSettings
from outbox_bridge.dev.embedded import EmbeddedTemporal, free_port
from outbox_bridge.flush import FlushReport
from tests.harness import (
    Category,
    Recorder,
    Servers,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
)


@pytest.fixture
async def own_temporal(tmp_path: Path) -> AsyncIterator[EmbeddedTemporal]:
    """A Temporal dev server of this test alone (it may stop it)."""
    temporal = EmbeddedTemporal(tmp_path / "temporal", port=free_port(), ui_port=None)
    await temporal.start(timeout=60)
    try:
        yield temporal
    finally:
        temporal.kill()


async def fresh(engine: AsyncEngine) -> tuple[Recorder, OutboxApp]:
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    return recorder, app


async def flush_async(
    app: OutboxApp, engine: AsyncEngine, shard: int, timeout: float
) -> FlushReport:
    async with AsyncSession(engine) as session:
        async with outbox_context(session, flush=True, timeout=timeout) as outbox:
            await app.write_async(
                session,
                category=Category.PROJECT_UPDATE,
                shard_identifier=shard,
                object_identifier=1,
            )
            await session.commit()
    return outbox.report


def flush_sync(app: OutboxApp, database_url: str, shard: int, timeout: float) -> FlushReport:
    engine = create_engine(database_url)
    try:
        with Session(engine) as session:
            with outbox_context(session, flush=True, timeout=timeout) as outbox:
                app.write(
                    session,
                    category=Category.PROJECT_UPDATE,
                    shard_identifier=shard,
                    object_identifier=1,
                )
                session.commit()
        return outbox.report
    finally:
        engine.dispose()


def unavailable(report: FlushReport, shard: str) -> str:
    """The detail of ``shard``'s ``unavailable`` answer."""
    result = report[shard]
    assert result.outcome == "unavailable", result
    assert result.detail, result
    assert not report.handled
    return result.detail


def settings_for(address: str, **overrides: object) -> OutboxSettings:
    return fast_settings(temporal_address=address, **overrides)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_flush_on_first_use_with_temporal_down_reports_unavailable(
    servers: Servers, engine: AsyncEngine, own_temporal: EmbeddedTemporal, kind: str
) -> None:
    """The flusher's client never connected: the server is gone before the first flush."""
    recorder, app = await fresh(engine)
    own_temporal.stop()
    app.configure_flush(settings_for(own_temporal.address))
    if kind == "async":
        report = await flush_async(app, engine, 1, timeout=3)
    else:
        report = await asyncio.to_thread(flush_sync, app, servers.database_url, 1, 3)
    detail = unavailable(report, "ORGANIZATION:1")
    assert own_temporal.address in detail and "cannot connect to Temporal" in detail
    assert recorder.calls == []  # nothing handled, nothing lost: the row is in the table
    assert not await table_empty(engine, app)


async def test_flush_after_temporal_went_away_reports_unavailable(
    servers: Servers,
    engine: AsyncEngine,
    own_temporal: EmbeddedTemporal,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flusher's client connected and flushed once; then the server went away. The
    update-with-start is retried until the timeout, and every failed attempt's start
    operation has its exception retrieved (asyncio logs the others at ERROR when they are
    collected: "Future exception was never retrieved")."""
    # The task queue's pollers, seen by the first flush, stay trusted: the second flush goes
    # straight to the update-with-start (else the pollers check would find the server gone).
    monkeypatch.setattr(flush_module, "POLLERS_TRUSTED_FOR", 3600.0)
    recorder, app = await fresh(engine)
    settings = settings_for(own_temporal.address)
    on_own = dataclasses.replace(servers, temporal_address=own_temporal.address)
    async with running_worker(on_own, app, settings):
        app.configure_flush(settings)
        first = await flush_async(app, engine, 2, timeout=10)
        assert first.handled, first.results
    own_temporal.kill()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        report = await flush_async(app, engine, 3, timeout=3)
        detail = unavailable(report, "ORGANIZATION:3")
        gc.collect()
        await asyncio.sleep(0.1)  # done-callbacks run on the next loop iterations
        gc.collect()
    assert "Temporal" in detail, detail
    never_retrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never_retrieved, never_retrieved[0].getMessage()
    assert [c.shard for c in recorder.calls] == ["1:2"]


async def test_flush_to_a_task_queue_nobody_polls_starts_nothing(
    servers: Servers, engine: AsyncEngine, client
) -> None:
    """A producer configured with another task queue than the worker's: the flush does not
    start the shard's workflow on its own task queue (nobody would ever run it there); it
    answers ``unavailable`` naming the task queue, and the worker's partitions handle the rows."""
    recorder, app = await fresh(engine)
    worker_settings = fast_settings()
    producer_queue = f"tq-producer-{uuid.uuid4().hex[:8]}"
    async with running_worker(servers, app, worker_settings):
        app.configure_flush(
            worker_settings.model_copy(
                update={"temporal_address": servers.temporal_address, "task_queue": producer_queue}
            )
        )
        report = await flush_async(app, engine, 4, timeout=3)
        detail = unavailable(report, "ORGANIZATION:4")
        assert producer_queue in detail and "OUTBOX_TASK_QUEUE" in detail
        await wait_until(lambda: table_empty(engine, app), what="the row, by the bridge")
    assert [c.shard for c in recorder.calls] == ["1:4"]
    # No shard workflow of the table ever ran on the producer's task queue.
    found = [
        w
        async for w in client.list_workflows(f'TaskQueue="{producer_queue}"')
        if app.table().name in w.id
    ]
    assert found == []


async def test_a_flush_to_a_task_queue_nobody_polls_answers_at_once_and_logs_it_once(
    servers: Servers, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker polls the flusher's task queue: each flush answers ``unavailable`` without
    waiting for its timeout, and the absence is logged once, not per flush. A worker that
    appears later is seen by the next flush.

    "At once" is checked as less than half the timeout, not tightly: the answer takes one
    describe_task_queue round trip plus a second of patience for a worker that is starting;
    a flush that waited for its timeout, as before, takes the whole 10 s."""
    recorder, app = await fresh(engine)
    queue = f"tq-nobody-{uuid.uuid4().hex[:8]}"
    settings = settings_for(servers.temporal_address, task_queue=queue)
    app.configure_flush(settings)
    timeout = 10.0
    with caplog.at_level(logging.DEBUG, logger="outbox_bridge.flush"):
        started = time.monotonic()
        first = await flush_async(app, engine, 5, timeout=timeout)
        elapsed = time.monotonic() - started
        second = await flush_async(app, engine, 6, timeout=timeout)
    for report, shard in ((first, "ORGANIZATION:5"), (second, "ORGANIZATION:6")):
        assert queue in unavailable(report, shard)
    assert elapsed < timeout / 2, elapsed
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "outbox_bridge.flush" and r.levelno >= logging.WARNING
    ]
    assert len(warned) == 1, warned
    assert queue in warned[0] and "logged once" in warned[0]
    assert recorder.calls == []
    async with running_worker(servers, app, settings):
        third = await flush_async(app, engine, 7, timeout=timeout)
        assert third.handled, third.results
        await wait_until(lambda: table_empty(engine, app), what="every row, by the worker")
    assert sorted(c.shard for c in recorder.calls) == ["1:5", "1:6", "1:7"]
