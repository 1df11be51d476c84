"""outbox_context(session, flush=True): wait until the rows a transaction wrote are handled.

Every outcome against a real worker: handled (sync and async sessions), blocked, skipped,
deferred, timed out; nesting, rollback, rows not committed in the block; flush across
continue-as-new; malformed flush updates refused by the validator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowUpdateFailedError,
    WorkflowUpdateStage,
)
from temporalio.common import WorkflowIDConflictPolicy

from outbox_bridge import OutboxApp, OutboxMessage, outbox_context
from outbox_bridge.config import OutboxSettings
from outbox_bridge.runtime.worker import build_drains, build_flush_worker, build_worker
from outbox_bridge.workflows.models import (
    FlushInput,
    FlushResult,
    ShardInput,
    ShardRecord,
    ShardRef,
)
from outbox_bridge.workflows.shard import OutboxShard
from tests.harness import (
    Category,
    Recorder,
    Scope,
    Servers,
    create_tables,
    fast_settings,
    make_app,
    refusal,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)


def flush_settings(servers: Servers, settings: OutboxSettings) -> OutboxSettings:
    return settings.model_copy(update={"temporal_address": servers.temporal_address})


def write(app: OutboxApp, session: Session, shard: int, obj: int, **extra: object) -> int:
    return app.write(
        session,
        category=Category.PROJECT_UPDATE,
        shard_identifier=shard,
        object_identifier=obj,
        payload={"n": obj},
        **extra,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def flushing(
    servers: Servers, engine: AsyncEngine, **overrides: Any
) -> AsyncIterator[tuple[Recorder, OutboxApp, OutboxSettings]]:
    """A recording app on its own table, a running worker, and flushes configured for it."""
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    settings = fast_settings(**overrides)
    async with running_worker(servers, app, settings):
        app.configure_flush(flush_settings(servers, settings))
        yield recorder, app, settings


async def write_async(app: OutboxApp, session: AsyncSession, shard: int, **extra: object) -> int:
    return await app.write_async(
        session,
        category=Category.PROJECT_UPDATE,
        shard_identifier=shard,
        object_identifier=1,
        **extra,  # type: ignore[arg-type]
    )


async def test_flush_waits_until_the_rows_are_handled_sync_session(
    servers, engine, sync_engine
) -> None:
    async with flushing(servers, engine) as (recorder, app, _):

        def produce() -> tuple[list[int], object]:
            with Session(sync_engine) as session:
                with outbox_context(session, flush=True) as outbox:
                    ids = [write(app, session, 1, 1), write(app, session, 2, 5)]
                    session.commit()
                return ids, outbox.report

        ids, report = await asyncio.to_thread(produce)
        # Handled means handled: the handler has run before the context returned.
        assert sorted(c.id for c in recorder.calls) == sorted(ids)
        assert report.handled  # type: ignore[attr-defined]
        assert {r.shard: r.outcome for r in report} == {  # type: ignore[attr-defined]
            "ORGANIZATION:1": "handled",
            "ORGANIZATION:2": "handled",
        }


async def test_flush_with_an_async_session_and_nested_contexts(servers, engine) -> None:
    async with flushing(servers, engine) as (recorder, app, _):
        async with AsyncSession(engine) as session:
            async with outbox_context(session, flush=True) as outer:
                await write_async(app, session, 3)
                async with outbox_context(session, flush=False) as inner:
                    await write_async(app, session, 4)
                await session.commit()
        # The inner flush=False rows are not waited for; the outer ones are.
        assert [r.shard for r in outer.report] == ["ORGANIZATION:3"]
        assert outer.report.handled
        assert len(inner.report) == 0
        assert any(c.shard == "1:3" for c in recorder.calls)
        await wait_until(lambda: table_empty(engine, app), what="the inner rows, asynchronously")


async def test_rolled_back_and_uncommitted_rows_are_not_waited_for(servers, engine) -> None:
    async with flushing(servers, engine) as (recorder, app, _):
        async with AsyncSession(engine) as session:
            async with outbox_context(session, flush=True) as rolled_back:
                await write_async(app, session, 5)
                await session.rollback()
            assert len(rolled_back.report) == 0 and rolled_back.report.handled

            async with outbox_context(session, flush=True) as uncommitted:
                await write_async(app, session, 6)
            assert uncommitted.report.not_committed == ["ORGANIZATION:6"]
            assert not uncommitted.report.handled
            await session.commit()  # the caller commits later: handled asynchronously
        await wait_until(lambda: table_empty(engine, app), what="the late-committed row")
        assert [c.shard for c in recorder.calls] == ["1:6"]


async def test_an_exception_in_the_block_waits_for_nothing(servers, engine) -> None:
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    async with AsyncSession(engine) as session:
        with pytest.raises(RuntimeError, match="request failed"):
            async with outbox_context(session, flush=True) as outbox:
                await write_async(app, session, 7)
                await session.commit()
                raise RuntimeError("request failed")
    assert len(outbox.report) == 0


async def flush_one(
    app: OutboxApp, engine: AsyncEngine, shard: int, timeout: float = 10.0, **extra: object
) -> FlushResult:
    async with AsyncSession(engine) as session:
        async with outbox_context(session, flush=True, timeout=timeout) as outbox:
            await write_async(app, session, shard, **extra)
            await session.commit()
    [result] = outbox.report.results
    return result


async def test_flush_of_a_blocked_shard_says_behind_what_and_since_when(servers, engine) -> None:
    async def fail(message: OutboxMessage) -> None:
        raise ValueError("downstream said no")

    async with flushing(servers, engine) as (recorder, app, _):
        recorder.behaviour[int(Category.PROJECT_UPDATE)] = fail
        result = await flush_one(app, engine, 8)
        assert result.outcome == "blocked"
        assert result.head is not None and result.head.category_name == "PROJECT_UPDATE"
        assert result.error is not None and result.error.error_type == "ValueError"
        assert result.blocked_since is not None
        # Nothing is lost: the row stays until its handler succeeds.
        del recorder.behaviour[int(Category.PROJECT_UPDATE)]
        await wait_until(lambda: table_empty(engine, app), what="the unblocked row")


async def test_flush_of_a_skipped_shard(servers, engine, client: Client) -> None:
    async with flushing(servers, engine, skip_shards=["ORGANIZATION:9"]) as (
        recorder,
        app,
        _,
    ):
        result = await flush_one(app, engine, 9)
        assert result.outcome == "skipped"
        assert result.skip is not None and "skip_shards" in result.skip.reason
        assert recorder.calls == []


async def test_flush_of_a_deferred_row(servers, engine) -> None:
    async with flushing(servers, engine) as (recorder, app, _):
        result = await flush_one(app, engine, 10, scheduled_for=timedelta(hours=1))
        assert result.outcome == "deferred"
        assert result.deferred_until is not None
        assert recorder.calls == []


async def test_flush_that_times_out_leaves_the_rows_for_later(servers, engine) -> None:
    async def slow(message: OutboxMessage) -> None:
        await asyncio.sleep(3)

    async with flushing(servers, engine) as (recorder, app, _):
        recorder.behaviour[int(Category.PROJECT_UPDATE)] = slow
        result = await flush_one(app, engine, 11, timeout=1.0)
        assert result.outcome == "timed_out"
        await wait_until(lambda: table_empty(engine, app), what="the slow row")
        assert len(recorder.calls) == 1


async def test_flush_across_continue_as_new(servers, engine, client: Client) -> None:
    """A flush waits while the run is due for continue-as-new: the run keeps draining (it does
    not wait for the flush with draining stopped, which would deadlock), answers, and then
    continues as new. The worker runs without its bridge here, so that the test alone starts
    the shard's workflow, with a history limit far below what the settings allow."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)

    async def slowish(message: OutboxMessage) -> None:
        await asyncio.sleep(0.25)

    recorder.behaviour[int(Category.PROJECT_UPDATE)] = slowish
    ids = await write_rows(
        engine,
        app,
        [
            {"category": Category.PROJECT_UPDATE, "shard_identifier": 12, "object_identifier": n}
            for n in range(1, 41)
        ],
    )
    settings = fast_settings(drain_max_groups=1)
    shard = ShardRef(table, int(Scope.ORGANIZATION), "ORGANIZATION", 12)
    options = dataclasses.replace(settings.shard_options(), max_history_events=10)
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        "OutboxShard",
        ShardInput(shard=shard, options=options, record=ShardRecord(max_known_id=max(ids))),
        id=shard.workflow_id,
        task_queue=settings.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    drains = build_drains(engine, app, settings)
    flushes = build_flush_worker(client, settings, drains)
    async with build_worker(client, settings, drains), flushes:
        handle = await client.start_update_with_start_workflow(
            "flush",
            FlushInput(up_to_id=max(ids), timeout_seconds=60),
            start_workflow_operation=start,
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            result_type=FlushResult,
        )
        result = await handle.result()
        assert result.outcome == "handled"
        assert len(recorder.calls) == 40
        first_run = client.get_workflow_handle(shard.workflow_id, run_id=handle.workflow_run_id)
        history = await first_run.fetch_history()
    drains.close()
    kinds = [e.event_type for e in history.events]
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED in kinds
    assert kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    # It was due long before the flush was answered, and kept draining meanwhile.
    assert len(kinds) > 3 * options.max_history_events


# Each malformed flush, and the message of what actually refuses it: the data converter
# refuses what it cannot convert to FlushInput's field types, before the validator runs; the
# validator refuses converted values out of range.
MALFORMED_FLUSHES = [
    ({"up_to_id": "x", "timeout_seconds": 1}, "Failed converting field up_to_id"),
    ({"up_to_id": None, "timeout_seconds": 1}, "Failed converting field up_to_id"),
    ({"up_to_id": 5, "timeout_seconds": "soon"}, "Failed converting field timeout_seconds"),
    ({"up_to_id": 0, "timeout_seconds": 1}, "flush needs up_to_id, a positive integer row id"),
    ({"up_to_id": -3, "timeout_seconds": 1}, "flush needs up_to_id, a positive integer row id"),
    ({"up_to_id": 5, "timeout_seconds": -1}, "flush needs timeout_seconds between 0 and 3600"),
    ({"up_to_id": 5, "timeout_seconds": 10_000}, "flush needs timeout_seconds between 0 and"),
]


@pytest.mark.parametrize(("bad", "refused_by"), MALFORMED_FLUSHES)
async def test_malformed_flush_is_rejected_without_touching_the_shard(
    servers, engine, client: Client, bad: dict[str, object], refused_by: str
) -> None:
    async with flushing(servers, engine, skip_shards=["ORGANIZATION:13"]) as (_, app, _):
        assert (await flush_one(app, engine, 13)).outcome == "skipped"  # a running workflow
        handle = client.get_workflow_handle(f"outbox:{app.table().name}:ORGANIZATION:13")
        before = await handle.fetch_history()
        with pytest.raises(WorkflowUpdateFailedError) as failed:
            await handle.execute_update("flush", bad)
        assert refused_by in refusal(failed.value)
        after = await handle.fetch_history()
    # A rejected update leaves no trace in history (beyond the workflow task it needed).
    kinds = {e.event_type for e in after.events[len(before.events) :]}
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED not in kinds


async def test_a_boolean_or_fractional_flush_id_arrives_converted(
    servers, engine, client: Client
) -> None:
    """The data converter turns ``true`` into 1 and 7.9 into 7 before the validator sees the
    input, so the validator's own type checks cannot refuse them: such a flush is taken, as
    a flush up to the converted id."""
    async with flushing(servers, engine, skip_shards=["ORGANIZATION:14"]) as (_, app, _):
        assert (await flush_one(app, engine, 14)).outcome == "skipped"  # a running workflow
        handle = client.get_workflow_handle(f"outbox:{app.table().name}:ORGANIZATION:14")
        for odd in (
            {"up_to_id": True, "timeout_seconds": 1},
            {"up_to_id": 7.9, "timeout_seconds": True},
        ):
            answer = await handle.execute_update("flush", odd, result_type=FlushResult)
            assert answer.outcome == "skipped"


@pytest.mark.parametrize(
    ("odd", "message"),
    [
        (FlushInput(up_to_id=True, timeout_seconds=1), "positive integer row id; got True"),
        (FlushInput(up_to_id="7", timeout_seconds=1), "positive integer row id; got '7'"),  # type: ignore[arg-type]
        (FlushInput(up_to_id=7, timeout_seconds=True), "got True"),
        (FlushInput(up_to_id=7, timeout_seconds="1"), "got '1'"),  # type: ignore[arg-type]
    ],
)
def test_the_flush_validator_refuses_what_another_converter_might_pass(
    odd: FlushInput, message: str
) -> None:
    """The validator stays defensive: a data converter that passed values through without
    converting them (the default one converts, see above) still cannot get a bool or a string
    into the shard's flush."""
    with pytest.raises(ValueError, match="flush needs") as refused:
        OutboxShard._validate_flush(object.__new__(OutboxShard), odd)
    assert message in str(refused.value)


async def test_many_concurrent_flushes_never_starve_the_drains_they_wait_for(
    servers, engine
) -> None:
    """Three times as many flushes as the worker has activity slots, each waiting for a slow
    row of its own shard: the waits run on the flush task queue, in slots of their own, so the
    drains they wait for still get theirs, and every flush is answered ``handled``."""
    async with flushing(servers, engine, max_concurrent_activities=4) as (
        recorder,
        app,
        settings,
    ):

        async def slow(message: OutboxMessage) -> None:
            await asyncio.sleep(0.5)

        recorder.behaviour[Category.PROJECT_UPDATE] = slow
        shards = range(300, 300 + 3 * settings.max_concurrent_activities)
        results = await asyncio.gather(
            *(flush_one(app, engine, shard, timeout=20.0) for shard in shards)
        )
    assert [r.outcome for r in results] == ["handled"] * len(shards)
    assert sorted(int(c.shard.split(":")[1]) for c in recorder.calls) == list(shards)
