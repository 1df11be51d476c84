"""End-to-end processing against a real PostgreSQL and a real Temporal dev server (the
invariants of the design contract: docs/explanation/contract.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
from sqlalchemy import func, select, text
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from outbox_bridge import MissingHandlerError, OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.db.locks import lock_key
from outbox_bridge.dev.embedded import temporal_cli as temporal_binary
from outbox_bridge.flush import Flusher
from outbox_bridge.runtime.hub import partition_of
from outbox_bridge.runtime.shards import parse_shard, shard_status
from outbox_bridge.workflows.models import (
    FlushResult,
    ResumeInput,
    ShardRef,
    ShardStatus,
    ShardSummary,
    SkipInput,
)
from tests.harness import (
    SCOPES,
    Category,
    Recorder,
    Scope,
    coalesced_calls,
    count_rows,
    create_tables,
    fast_settings,
    fresh_app,
    make_app,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)


def row(category: Category, shard: int, obj: int, **extra: object) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


def workflow_id(table: str, scope: Scope, shard: int) -> str:
    return f"outbox:{table}:{scope.name}:{shard}"


async def status_of(client: Client, wid: str) -> ShardStatus:
    status: ShardStatus = await client.get_workflow_handle(wid).query(
        "status", result_type=ShardStatus
    )
    return status


async def shard_rows(engine, app, shard: int) -> int:
    table = app.table()
    async with engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.shard_identifier == shard)
        return int((await conn.execute(query)).scalar_one())


async def temporal_cli(servers, command: str, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        temporal_binary(),
        "workflow",
        command,
        "--address",
        servers.temporal_address,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


async def gated_app(engine) -> tuple[Recorder, str, OutboxApp, Gate]:
    """An app on a fresh table whose PROJECT_UPDATE handler fails until its gate opens."""
    recorder, table, app = await fresh_app(engine)
    gate = Gate()
    recorder.behaviour[Category.PROJECT_UPDATE] = gate
    return recorder, table, app, gate


class Gate:
    """Makes a category fail while closed."""

    def __init__(self) -> None:
        self.open = False
        self.failures = 0

    async def __call__(self, message: OutboxMessage) -> None:
        if not self.open:
            self.failures += 1
            raise ConnectionError(f"downstream unavailable (attempt {self.failures})")


# Per shard, the coalescing groups (category, object) of its rows in id order: groups whose
# lowest and highest ids order differently (in shard 1, object 1's group has ids 1 and 5 of the
# shard, object 2's id 3, so it is handled first by its lowest id, second by its highest).
ORDER_WORKLOAD = {
    1: [(2, 1), (3, 1), (2, 2), (1, 1), (2, 1), (3, 1), (2, 2), (1, 1), (2, 1)],
    2: [(1, 5), (1, 6), (1, 7), (1, 5), (1, 6), (1, 5), (3, 9), (1, 7), (3, 9)],
    3: [(2, 1), (2, 1), (2, 1), (3, 4), (2, 2), (3, 4), (2, 1), (2, 3), (2, 2)],
}


def order_workload() -> list[tuple[int, Category, int]]:
    """The rows of ORDER_WORKLOAD (shard, category, object), the shards interleaved."""
    rows = []
    for position in range(max(len(groups) for groups in ORDER_WORKLOAD.values())):
        for shard, groups in ORDER_WORKLOAD.items():
            if position < len(groups):
                category, obj = groups[position]
                rows.append((shard, Category(category), obj))
    return rows


def test_the_order_workload_coalesces_and_its_groups_order_differently_by_highest_id() -> None:
    """The order test below proves nothing unless groups coalesce and ordering them by their
    highest id (or not coalescing) gives another sequence of calls."""
    written = [
        (n + 1, shard, int(category), obj)
        for n, (shard, category, obj) in enumerate(order_workload())
    ]
    expected = coalesced_calls(written)
    for calls in expected.values():
        assert any(coalesced > 1 for _, coalesced in calls)
        assert [new_id for new_id, _ in calls] != sorted(new_id for new_id, _ in calls)


async def test_per_shard_order_follows_lowest_pending_id_of_each_group(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    rows = order_workload()
    ids = await write_rows(
        engine, app, [row(category, shard, obj) for shard, category, obj in rows]
    )
    written = [
        (new_id, shard, int(category), obj)
        for new_id, (shard, category, obj) in zip(ids, rows, strict=True)
    ]

    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: table_empty(engine, app), what="all rows handled")

    # Every row was pending when the worker started: per shard, the groups in ascending order
    # of their lowest id, each handled once with its highest id and the count of its rows.
    handled: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for call in recorder.calls:
        handled[int(call.shard.split(":")[1])].append((call.id, call.coalesced))
    assert dict(handled) == coalesced_calls(written)


async def test_shards_run_in_parallel_and_never_wait_for_each_other(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    organization_waiting, user_handled = asyncio.Event(), asyncio.Event()

    async def organization_waits_for_user(message: OutboxMessage) -> None:
        organization_waiting.set()
        await asyncio.wait_for(user_handled.wait(), timeout=60)

    async def user(message: OutboxMessage) -> None:
        user_handled.set()

    recorder.behaviour[Category.ORGANIZATION_UPDATE] = organization_waits_for_user
    recorder.behaviour[Category.USER_UPDATE] = user
    async with running_worker(servers, app):
        await write_rows(engine, app, [row(Category.ORGANIZATION_UPDATE, 1, 1)])
        # The user row only once the organization's call waits for it (written at once, its
        # round could start first, and nothing would wait).
        await asyncio.wait_for(organization_waiting.wait(), timeout=30)
        await write_rows(engine, app, [row(Category.USER_UPDATE, 7, 7)])
        await wait_until(lambda: table_empty(engine, app), what="both shards handled")
    organization, user_call = sorted(recorder.calls, key=lambda c: c.category)
    # The organization handler was still running when the user shard's handler ran.
    assert organization.started < user_call.finished <= organization.finished


async def test_a_thousand_rows_of_one_group_are_handled_once_with_the_newest(
    servers, engine
) -> None:
    recorder, _, app = await fresh_app(engine)
    ids = await write_rows(
        engine,
        app,
        [row(Category.PROJECT_UPDATE, 3, 42, payload={"version": v}) for v in range(1000)],
    )
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: table_empty(engine, app), what="the group handled")
    [call] = recorder.calls
    assert (call.id, call.coalesced, call.payload) == (ids[-1], 1000, {"version": 999})


async def test_rows_written_while_the_handler_runs_are_kept_for_the_next_round(
    servers, engine
) -> None:
    recorder, _, app = await fresh_app(engine)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_first_call(message: OutboxMessage) -> None:
        if not entered.is_set():
            entered.set()
            await asyncio.wait_for(release.wait(), timeout=20)

    recorder.behaviour[Category.PROJECT_UPDATE] = slow_first_call
    first = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 3, 42)] * 5)
    async with running_worker(servers, app, fast_settings()):
        await asyncio.wait_for(entered.wait(), timeout=20)
        late = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 3, 42)] * 2)
        release.set()
        await wait_until(lambda: table_empty(engine, app), what="both rounds handled")
    assert [(c.id, c.coalesced) for c in recorder.calls] == [(first[-1], 5), (late[-1], 2)]


async def partition_histories(client: Client, table: str, partitions: int) -> list[int]:
    """The history length of each partition workflow of ``table``; 0 for one whose drain
    activity is not pending yet."""
    lengths = []
    for n in range(partitions):
        try:
            description = await client.get_workflow_handle(
                f"outbox:{table}:partition:{n}"
            ).describe()
        except RPCError:
            lengths.append(0)
            continue
        raw = description.raw_description
        draining = any(a.activity_type.name == "drain_partition" for a in raw.pending_activities)
        lengths.append(raw.workflow_execution_info.history_length if draining else 0)
    return lengths


async def test_steady_traffic_on_healthy_shards_costs_no_history_event_per_row(
    servers, engine, client
) -> None:
    """Rows that come one by one, to shards of every partition, are drained by the partitions'
    running drain activities: no partition's history grows (no signal, activity or workflow
    task per row), and no shard gets a workflow of its own."""
    recorder, _, app = await fresh_app(engine)
    settings = fast_settings()
    table = app.table().name
    async with running_worker(servers, app, settings):

        async def all_draining() -> bool:
            return all(await partition_histories(client, table, settings.partitions))

        await wait_until(all_draining, what="every partition's drain activity")
        before = await partition_histories(client, table, settings.partitions)
        written: list[int] = []

        def handled(row_id: int) -> bool:
            return row_id in recorder.ids()

        for n in range(1, 31):
            [new] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, n, n)])
            written.append(new)
            await wait_until(partial(handled, new), what=f"row {n}")
        after = await partition_histories(client, table, settings.partitions)
        shard_runs = [
            w.id
            async for w in client.list_workflows(
                f"WorkflowType = 'OutboxShard' AND TaskQueue = '{settings.task_queue}'"
            )
        ]
    partitions = {
        partition_of(parse_shard(f"ORGANIZATION:{n}", app), settings.partitions)
        for n in range(1, 31)
    }
    assert partitions == set(range(settings.partitions))  # the rows reached every partition
    assert after == before, (before, after)
    assert recorder.ids() == written
    assert shard_runs == []


async def test_a_failing_handler_blocks_only_its_shard_and_loses_nothing(
    servers, engine, client
) -> None:
    recorder, table, app, gate = await gated_app(engine)
    blocked = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.ORGANIZATION_UPDATE, 1, 1),
        ],
    )
    others = await write_rows(
        engine, app, [row(Category.ORGANIZATION_UPDATE, s, s) for s in (2, 3, 4)]
    )
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: gate.failures >= 3, what="three failed attempts")
        await wait_until(lambda: {c.id for c in recorder.calls} >= set(others), what="other shards")
        # Nothing of the blocked shard was handled or deleted, not even the row behind the head.
        assert await shard_rows(engine, app, 1) == 2
        assert not {c.id for c in recorder.calls} & set(blocked)
        status = await status_of(client, workflow_id(table, Scope.ORGANIZATION, 1))
        assert status.state == "blocked"
        assert status.head is not None and status.head.category_name == "PROJECT_UPDATE"
        assert status.last_error is not None and status.last_error.error_type == "ConnectionError"
        gate.open = True
        await wait_until(lambda: table_empty(engine, app), what="the shard unblocked")
    shard_one = [c.id for c in recorder.calls if c.shard == "1:1"]
    assert shard_one == blocked  # the head first, then the row behind it


async def test_a_handler_that_always_fails_is_retried_forever_with_its_rows_kept(
    servers, engine, client
) -> None:
    _, table, app, gate = await gated_app(engine)
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 5, 50)])
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 5))
    async with running_worker(servers, app):
        await wait_until(lambda: gate.failures >= 6, what="six attempts")

        async def pending_attempts() -> int:
            description = await handle.describe()
            pending = description.raw_description.pending_activities
            return pending[0].attempt if pending else 0

        await wait_until(lambda: _at_least(pending_attempts(), 4), what="server-side retries")
        description = await handle.describe()
        [pending] = description.raw_description.pending_activities
        assert pending.activity_type.name == "PROJECT_UPDATE"
        assert "downstream unavailable" in pending.last_failure.message
        assert description.status == WorkflowExecutionStatus.RUNNING
        status = await shard_status(client, parse_shard("ORGANIZATION:5", app))
        assert status.state == "blocked" and status.attempts >= 4
        assert status.last_error is not None
        assert status.last_error.error_type == "ConnectionError"
        assert "downstream unavailable" in status.last_error.message
        assert await count_rows(engine, app) == 1
        await handle.signal("skip", SkipInput(reason="test over"))


async def _at_least(value, minimum: int) -> bool:
    return bool((await value) >= minimum)


async def test_deferred_row_holds_its_shard_until_due(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    due = datetime.now(UTC) + timedelta(seconds=3)
    [deferred] = await write_rows(
        engine, app, [row(Category.ORGANIZATION_UPDATE, 1, 1, scheduled_for=due)]
    )
    [behind] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 2)])
    [elsewhere] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 2, 2)])
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: elsewhere in recorder.ids(), what="the other shard")
        assert deferred not in recorder.ids() and behind not in recorder.ids()
        await wait_until(lambda: table_empty(engine, app), what="the deferred shard")
    assert [c.id for c in recorder.calls if c.shard == "1:1"] == [deferred, behind]
    first = next(c for c in recorder.calls if c.id == deferred)
    assert first.at >= due


async def test_skip_pauses_a_blocked_shard_and_resume_delivers(servers, engine, client) -> None:
    recorder, table, app, gate = await gated_app(engine)
    ids = await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 8, 80), row(Category.MEMBER_UPDATE, 8, 81)]
    )
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 8))
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: gate.failures >= 2, what="a blocked head")
        await handle.signal("skip", SkipInput(reason=""))  # no reason: ignored
        # Operators use the temporal CLI, with plain JSON input.
        await temporal_cli(
            servers,
            "signal",
            "--workflow-id",
            handle.id,
            "--name",
            "skip",
            "--input",
            '{"reason": "deploying a fix", "by": "ops"}',
        )

        async def skipped() -> bool:
            return (await status_of(client, handle.id)).state == "skipped"

        await wait_until(skipped, what="the skipped state")

        async def no_pending_activity() -> bool:
            return not (await handle.describe()).raw_description.pending_activities

        await wait_until(no_pending_activity, what="the retrying attempt to be cancelled")
        failures = gate.failures
        await asyncio.sleep(2.5)  # several retry intervals: a skipped shard must not retry
        assert gate.failures == failures
        status = json.loads(
            await temporal_cli(
                servers, "query", "--workflow-id", handle.id, "--type", "status", "--output", "json"
            )
        )
        assert status["queryResult"][0]["state"] == "skipped"
        assert status["queryResult"][0]["skip"]["reason"] == "deploying a fix"
        assert await count_rows(engine, app) == 2
        gate.open = True
        await temporal_cli(servers, "signal", "--workflow-id", handle.id, "--name", "resume")
        await wait_until(lambda: table_empty(engine, app), what="delivery after resume")
    assert [c.id for c in recorder.calls] == ids


async def test_a_terminated_shard_workflow_is_rebuilt_by_the_bridge(
    servers, engine, client
) -> None:
    recorder, table, app, gate = await gated_app(engine)
    ids = await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 4, 1), row(Category.PROJECT_UPDATE, 4, 2)]
    )
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 4))
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: gate.failures >= 1, what="a blocked head")

        async def owned() -> bool:
            # On demand, the partition hands the failing head over: the shard's workflow may
            # start a moment after the first failure.
            try:
                return bool((await handle.describe()).status == WorkflowExecutionStatus.RUNNING)
            except RPCError:
                return False

        await wait_until(owned, what="the blocked shard's workflow")
        await handle.terminate(reason="an operator terminated it by hand")
        gate.open = True
        await wait_until(lambda: table_empty(engine, app), timeout=40, what="the bridge to rebuild")
    assert [c.id for c in recorder.calls] == ids


async def test_a_skipped_shard_stays_skipped_after_its_workflow_is_terminated(
    servers, engine, client
) -> None:
    """The skip is in the table (the design contract, section 1: nothing depends on Temporal
    keeping a workflow), so the run the sweep starts after a terminate is skipped too."""
    recorder, table, app, gate = await gated_app(engine)
    await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 6, 1), row(Category.MEMBER_UPDATE, 6, 2)]
    )
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 6))
    async with running_worker(servers, app, fast_settings()):
        await wait_until(lambda: gate.failures >= 1, what="a blocked head")

        async def blocked() -> bool:  # on demand, once the partition has handed it over
            try:
                return (await status_of(client, handle.id)).state == "blocked"
            except RPCError:
                return False

        await wait_until(blocked, what="the shard's own workflow, blocked")
        await handle.execute_update(
            "skip", SkipInput(reason="under investigation", by="ops"), result_type=ShardStatus
        )
        terminated = (await handle.describe()).run_id
        await handle.terminate(reason="an operator terminated it by hand")
        gate.open = True  # a restarted run that forgot the skip would handle the rows now

        async def restarted() -> bool:
            return bool((await handle.describe()).run_id != terminated)

        await wait_until(restarted, timeout=30, what="the sweep to start the workflow again")
        await asyncio.sleep(3)  # two sweeps
        assert await count_rows(engine, app) == 2
        assert not [c for c in recorder.calls if c.category == Category.MEMBER_UPDATE]
        status = await status_of(client, handle.id)
        assert status.state == "skipped", status
        assert status.skip is not None and "resume" in status.skip.reason, status
        await handle.execute_update("resume", ResumeInput(by="ops"), result_type=ShardStatus)
        await wait_until(lambda: table_empty(engine, app), what="delivery after resume")


async def test_plain_sql_rows_are_processed(servers, engine) -> None:
    recorder, table, app = await fresh_app(engine)
    async with running_worker(servers, app):
        await sql(
            engine,
            f"INSERT INTO {table} "
            "(shard_scope, shard_identifier, category, object_identifier, payload) "
            'VALUES (2, 77, 10, 77, \'{"email": "a@example.com"}\'), (1, 5, 1, 5, NULL)',
        )
        await wait_until(lambda: table_empty(engine, app), what="plain SQL rows")
    assert sorted((c.shard, c.category, c.payload) for c in recorder.calls) == [
        ("1:5", 1, None),
        ("2:77", 10, {"email": "a@example.com"}),
    ]


async def test_rolled_back_rows_are_never_seen(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    async with running_worker(servers, app):
        async with engine.connect() as conn:
            transaction = await conn.begin()
            await app.write_async(
                conn, category=Category.PROJECT_UPDATE, shard_identifier=9, object_identifier=1
            )
            await transaction.rollback()
        [committed] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 9, 2)])
        await wait_until(lambda: table_empty(engine, app), what="the committed row")
    assert recorder.ids() == [committed]


async def test_a_late_commit_with_a_lower_id_is_not_deleted_unhandled(servers, engine) -> None:
    recorder, _, app = await fresh_app(engine)
    async with running_worker(servers, app, fast_settings()):
        async with engine.connect() as slow:
            transaction = await slow.begin()
            late_id = await app.write_async(
                slow, category=Category.PROJECT_UPDATE, shard_identifier=6, object_identifier=1
            )
            [early_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 6, 1)])
            assert late_id < early_id
            await wait_until(lambda: early_id in recorder.ids(), what="the higher id first")
            await transaction.commit()
        await wait_until(lambda: table_empty(engine, app), what="the late row")
    assert recorder.ids() == [early_id, late_id]


async def test_regional_table_is_drained_per_region(servers, engine, client) -> None:
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder, regional=True)
    await create_tables(engine, app)
    await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 1, region="us"),
            row(Category.PROJECT_UPDATE, 1, 1, region="eu"),
        ],
    )
    async with running_worker(servers, app, fast_settings(regions=["us"])):
        await wait_until(lambda: len(recorder.calls) == 1, what="the us row")
        await wait_until(lambda: _rows_left(engine, table, 1), what="the us row deleted")
    assert recorder.calls[0].shard == "us:1:1"
    async with engine.connect() as conn:
        regions = (await conn.execute(text(f"SELECT region FROM {table}"))).scalars().all()
    assert regions == ["eu"]


async def test_one_worker_drains_a_plain_and_a_regional_table(servers, engine, client) -> None:
    recorder = Recorder()
    plain, regional = unique_table(), unique_table()
    app = OutboxApp(
        scopes=SCOPES,
        tables=[OutboxTable(plain), OutboxTable(regional, regional=True)],
    )
    app.handler(*Category)(recorder.handle)
    await create_tables(engine, app)
    async with running_worker(servers, app, fast_settings()):
        async with engine.begin() as conn:
            await app.write_async(
                conn, category=Category.USER_UPDATE, shard_identifier=3, object_identifier=3
            )
            for region in ("us", "eu"):
                await app.write_async(
                    conn,
                    category=Category.USER_UPDATE,
                    shard_identifier=3,
                    object_identifier=3,
                    region=region,
                    table=regional,
                )
        await wait_until(lambda: len(recorder.calls) == 3, what="three shards")
        for table in (plain, regional):
            await wait_until(partial(_rows_left, engine, table, 0), what=f"{table} drained")
    assert sorted(c.shard for c in recorder.calls) == ["2:3", "eu:2:3", "us:2:3"]


async def _rows_left(engine, table: str, expected: int) -> bool:
    async with engine.connect() as conn:
        count = (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one()
        return bool(count == expected)


async def test_a_row_of_an_unknown_category_blocks_its_shard_with_a_clear_error(
    servers, engine, client
) -> None:
    recorder, table, app = await fresh_app(engine)
    async with running_worker(servers, app):
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier) "
            "VALUES (1, 11, 99, 1), (1, 12, 1, 1), (2, 13, 1, 1)",
        )
        await wait_until(lambda: len(recorder.calls) == 1, what="the healthy shard")

        async def blocked(wid: str, error: str) -> bool:
            try:
                status = await status_of(client, wid)
            except Exception:
                return False
            return (
                status.state == "blocked"
                and status.last_error is not None
                and status.last_error.error_type == error
            )

        await wait_until(
            lambda: blocked(workflow_id(table, Scope.ORGANIZATION, 11), "UnknownCategoryError"),
            what="unknown category blocked",
        )
        await wait_until(
            lambda: blocked(workflow_id(table, Scope.USER, 13), "CategoryScopeError"),
            what="category outside its scope blocked",
        )
        assert await count_rows(engine, app) == 2
        for wid in (workflow_id(table, Scope.ORGANIZATION, 11), workflow_id(table, Scope.USER, 13)):
            await client.get_workflow_handle(wid).signal("skip", SkipInput(reason="test over"))


async def test_the_worker_refuses_a_category_without_handler(servers, engine) -> None:
    app = make_app(unique_table(), Recorder(), handle_all=False)
    app.handler(Category.PROJECT_UPDATE)(Recorder().handle)
    with pytest.raises(MissingHandlerError, match="ORGANIZATION_UPDATE"):
        async with running_worker(servers, app):
            pass


async def test_continue_as_new_keeps_counting_and_loses_nothing(servers, engine, client) -> None:
    """The first call of every group fails: the shard goes to its own workflow and stays there
    (each group is a head to retry, then a drain that fails on the next). Its history grows
    past --max-history-events, so the run continues as new, counting on across runs, and
    every row is handled once, in order."""
    recorder, table, app = await fresh_app(engine)
    failed: set[int] = set()

    async def fails_first_call(message: OutboxMessage) -> None:
        if message.object_identifier not in failed:
            failed.add(message.object_identifier)
            raise ConnectionError("the first call of each group fails")

    recorder.behaviour[Category.PROJECT_UPDATE] = fails_first_call
    ids = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 2, i) for i in range(30)])
    handle = client.get_workflow_handle(
        workflow_id(table, Scope.ORGANIZATION, 2), result_type=ShardSummary
    )
    async with running_worker(servers, app, fast_settings(max_history_events=100)):
        await wait_until(lambda: table_empty(engine, app), timeout=120, what="every row")
        summary = await handle.result()  # of the last run
        runs = [w async for w in client.list_workflows(f'WorkflowId = "{handle.id}"')]
    assert len(runs) >= 2
    first_run = min(runs, key=lambda w: w.start_time)
    history = await client.get_workflow_handle(handle.id, run_id=first_run.run_id).fetch_history()
    assert history.events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    assert recorder.ids() == ids  # every row handled once, in order
    # The count goes on across runs. A call whose result never reached the workflow may have
    # handled its group all the same, and that group goes uncounted: a call the run cancelled
    # (to continue as new, or because its head changed), an activity attempt the server
    # retried (timed out on a loaded machine: the retry finds the group gone), or a workflow
    # task that failed or timed out (its local activity runs again). At most one group each.
    # A cancel can leave no event: a signal (recheck) and the result of the call it cancels
    # can reach the run in one workflow task, and the SDK applies the signal first, so the run
    # cancels a call that has returned (its result is dropped, the head is tried again and
    # found gone). Such a call shows as a group handled whose head is scheduled again.
    lost = 0
    local_retries = 0  # not in the bound: shown to tell the cause of a count short of it
    for run in runs:
        events = await client.get_workflow_handle(handle.id, run_id=run.run_id).fetch_history()
        heads: dict[int, int] = {}  # a category activity's scheduled event -> its object
        handled: set[int] = set()  # objects whose category activity returned handled
        for event in events.events:
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                scheduled = event.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == Category.PROJECT_UPDATE.name:
                    head = json.loads(scheduled.input.payloads[0].data)["object_identifier"]
                    heads[event.event_id] = head
                    lost += head in handled
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                completed = event.activity_task_completed_event_attributes
                head = heads.get(completed.scheduled_event_id)
                if head is not None and json.loads(completed.result.payloads[0].data)["handled"]:
                    handled.add(head)
            elif event.event_type in (
                EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED,
                EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
                EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
            ):
                lost += 1
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                lost += event.activity_task_started_event_attributes.attempt - 1
            elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
                data = event.marker_recorded_event_attributes.details.get("data")
                if data is not None and data.payloads:  # a local activity's marker
                    local_retries += json.loads(data.payloads[0].data).get("attempt", 1) - 1
    assert summary.rows_handled == summary.groups_handled
    executions = len({run.raw_info.first_run_id for run in runs})  # each counts on its own
    shown = (summary, lost, f"{len(runs)} runs", f"{executions} executions", local_retries)
    assert len(ids) - lost <= summary.rows_handled <= len(ids), shown


@pytest.mark.parametrize("late_outcome", ["raises", "returns"])
async def test_a_timed_out_attempt_never_overlaps_its_retry(
    servers, engine, late_outcome: str
) -> None:
    """A plain-def handler cannot be interrupted: the retry waits on the shard lock. A late
    success still counts (its rows are deleted, not handled twice); a late failure is retried."""
    table = unique_table()
    app = make_app(table, Recorder(), handle_all=False)
    calls: list[tuple[int, float, float]] = []

    def slow_once(message: OutboxMessage) -> None:
        started = time.monotonic()
        first = not calls
        if first:
            time.sleep(5)  # past the 2 s handler timeout
        calls.append((message.object_identifier, started, time.monotonic()))
        if first and late_outcome == "raises":
            raise RuntimeError("late and failing")

    app.handler(*Category)(slow_once)
    await create_tables(engine, app)
    await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 1, 1), row(Category.PROJECT_UPDATE, 1, 2)]
    )
    async with running_worker(servers, app, fast_settings(handler_timeout=2.0)):
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="the retry")
    objects = [obj for obj, _, _ in calls]
    if late_outcome == "raises":
        assert objects[:2] == [1, 1] and objects[-1] == 2
    else:
        assert objects == [1, 2]
    for (_, _, first_end), (_, second_start, _) in itertools.pairwise(calls):
        assert second_start >= first_end


async def test_shards_in_the_static_skip_list_start_skipped(servers, engine, client) -> None:
    recorder, table, app = await fresh_app(engine)
    [listed] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 3, 1)])
    [other] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 4, 1)])
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 3))
    async with running_worker(servers, app, fast_settings(skip_shards=["ORGANIZATION:3"])):
        await wait_until(lambda: other in recorder.ids(), what="the other shard")

        async def skipped() -> bool:
            try:
                return (await status_of(client, handle.id)).state == "skipped"
            except Exception:
                return False

        await wait_until(skipped, what="the listed shard skipped")
        status = await status_of(client, handle.id)
        assert status.skip is not None and status.skip.by == "configuration"
        assert listed not in recorder.ids()
        await handle.signal("resume", ResumeInput())
        await wait_until(lambda: table_empty(engine, app), what="the listed shard resumed")
    assert recorder.ids() == [other, listed]


async def test_a_listed_shard_restarted_by_the_sweep_is_still_skipped_by_configuration(
    servers, engine, client
) -> None:
    """The sweep restarts a held, skipped shard that has no workflow (here terminated by hand;
    also a partition's handover not started yet): a shard the skip_shards setting lists says
    so, rather than an anonymous skip kept in the owner table."""
    recorder, table, app = await fresh_app(engine)
    [listed] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 3, 1)])
    handle = client.get_workflow_handle(workflow_id(table, Scope.ORGANIZATION, 3))
    settings = fast_settings(skip_shards=["ORGANIZATION:3"])
    async with running_worker(servers, app, settings):

        async def skipped() -> bool:
            try:
                return (await status_of(client, handle.id)).state == "skipped"
            except RPCError:
                return False

        await wait_until(skipped, what="the listed shard skipped")
        terminated = (await handle.describe()).run_id
        await handle.terminate(reason="an operator terminated it by hand")

        async def restarted() -> bool:
            return bool((await handle.describe()).run_id != terminated) and await skipped()

        await wait_until(restarted, timeout=30, what="the sweep to start the workflow again")
        status = await status_of(client, handle.id)
        assert status.skip is not None and status.skip.by == "configuration", status
        assert listed not in recorder.ids()


def test_a_static_skip_naming_no_shard_is_refused() -> None:
    from outbox_bridge import ConfigurationError, RegistryError
    from outbox_bridge.runtime.shards import static_skips

    app = make_app("outbox", Recorder())
    assert static_skips(app, ["organization:42"]) == frozenset({"outbox:outbox:ORGANIZATION:42"})
    with pytest.raises(ConfigurationError, match="eu:USER:7"):
        static_skips(app, ["eu:USER:7"])
    with pytest.raises(RegistryError, match="unknown scope"):
        static_skips(app, ["TEAM:1"])


async def drain_past_a_held_lock(
    servers, engine, client: Client, app: OutboxApp, shard: ShardRef
) -> tuple[WorkflowHandle[Any, Any], FlushResult]:
    """Write a row to ``shard`` while another session holds its lock and flush it: the flush
    starts the shard's workflow, whose local drain keeps failing, so it falls back to a normal
    drain_shard activity (pending in the UI, retried by the server); then the lock is let go.
    Returns the workflow and the flush's answer, once the run completed."""
    settings = fast_settings()
    handle = client.get_workflow_handle(shard.workflow_id)
    async with engine.connect() as holder:
        await holder.execute(
            text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), {"key": lock_key(shard)}
        )
        await holder.commit()
        async with running_worker(servers, app, settings):
            [row_id] = await write_rows(
                engine, app, [row(Category.PROJECT_UPDATE, shard.shard_identifier, 1)]
            )
            flusher = Flusher(app, settings, client=client)
            flush = asyncio.create_task(flusher.flush({shard: row_id}, timeout=90))

            async def drain_pending() -> bool:
                try:
                    description = await handle.describe()
                except RPCError:
                    return False
                pending = description.raw_description.pending_activities
                return any(a.activity_type.name == "drain_shard" for a in pending)

            await wait_until(drain_pending, timeout=60, what="the fallback drain_shard activity")
            assert await count_rows(engine, app) == 1  # nothing ran meanwhile
            await holder.execute(
                text("SELECT pg_advisory_unlock(hashtextextended(:key, 0))"),
                {"key": lock_key(shard)},
            )
            await holder.commit()
            [result] = await flush
            await handle.result()  # the run completes: it did not fail
    return handle, result


async def test_a_drain_that_keeps_failing_falls_back_to_a_visible_server_retried_drain(
    servers, engine, client
) -> None:
    """The local drain of a shard's workflow fails while another session holds the shard's
    lock: the workflow falls back to a normal drain activity, and the run neither fails nor
    loses the row; the flush that waited on it is answered ``handled``."""
    recorder, _, app = await fresh_app(engine)
    _, result = await drain_past_a_held_lock(
        servers, engine, client, app, parse_shard("ORGANIZATION:61", app)
    )
    assert result.outcome == "handled", result
    assert [c.object_identifier for c in recorder.calls] == [1]


# -- paths proven alone: no sweep, no timing to cover for them ----------------------------------


async def test_a_late_commit_is_delivered_by_its_notification_alone(servers, engine) -> None:
    """A row whose lower id commits after a higher one was handled: with sweeps an hour apart
    (a scan looks only above the highest id seen), only its notification can deliver it."""
    recorder, _, app = await fresh_app(engine)
    settings = fast_settings(sweep_interval=3600.0)
    async with running_worker(servers, app, settings):
        async with engine.connect() as slow:
            transaction = await slow.begin()
            late_id = await app.write_async(
                slow, category=Category.PROJECT_UPDATE, shard_identifier=6, object_identifier=1
            )
            [early_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 6, 2)])
            assert late_id < early_id
            await wait_until(lambda: early_id in recorder.ids(), what="the higher id first")
            await wait_until(lambda: table_empty(engine, app), what="the higher id deleted")
            await transaction.commit()
        await wait_until(lambda: table_empty(engine, app), timeout=15, what="the late row")
    assert recorder.ids() == [early_id, late_id]


async def test_a_region_filter_leaves_the_other_regions_alone_through_a_sweep(
    servers, engine, client
) -> None:
    """A worker draining region us only: once its row is handled and a whole sweep has run
    after that, the eu rows are still there, no handler saw them and no workflow of theirs
    was started."""
    from temporalio.service import RPCError

    from tests.otel import span_exporter

    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder, regional=True)
    await create_tables(engine, app)
    await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 1, region="us"),
            row(Category.PROJECT_UPDATE, 1, 1, region="eu"),
            row(Category.PROJECT_UPDATE, 2, 1, region="eu"),
        ],
    )
    with span_exporter() as spans:

        def sweeps() -> int:
            return sum(1 for s in spans.get_finished_spans() if s.name == "outbox.bridge.sweep")

        async with running_worker(servers, app, fast_settings(regions=["us"], sweep_interval=0.5)):
            await wait_until(lambda: _rows_left(engine, table, 2), what="the us row deleted")
            after = sweeps()
            await wait_until(lambda: sweeps() >= after + 2, what="a whole sweep after it")
    assert [c.shard for c in recorder.calls] == ["us:1:1"]
    async with engine.connect() as conn:
        left = (await conn.execute(text(f"SELECT region FROM {table}"))).scalars().all()
    assert sorted(left) == ["eu", "eu"]
    for shard in (1, 2):
        with pytest.raises(RPCError, match="not found"):
            await client.get_workflow_handle(f"outbox:{table}:eu:ORGANIZATION:{shard}").describe()


async def test_notified_rows_reach_fresh_and_just_drained_shards(servers, engine) -> None:
    """On demand, with the partitions' scans and the sweep an hour apart, only the in-process
    notification can bring a row to its partition: a row in a fresh shard, in a shard that was
    just drained (its round may still be writing), and rows of many shards written while
    rounds run are all handled, each shard in order and once."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    settings = fast_settings(poll_interval=3600.0, sweep_interval=3600.0)

    def handled(*ids: int) -> bool:
        return set(ids) <= set(recorder.ids())

    async with running_worker(servers, app, settings):
        [first] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
        await wait_until(partial(handled, first), what="a row in a fresh shard")
        again = first
        for obj in range(2, 7):  # each written as soon as the one before it was handled
            [again] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, obj)])
            await wait_until(partial(handled, again), what="a row in a just-drained shard")
        burst = [
            new_id
            for obj in range(3)
            for shard in range(10, 40)
            for new_id in await write_rows(
                engine, app, [row(Category.PROJECT_UPDATE, shard, 100 + obj)]
            )
        ]
        await wait_until(partial(handled, *burst), what="rows of many shards")
        await wait_until(lambda: table_empty(engine, app), what="every row deleted")
    by_shard: defaultdict[str, list[int]] = defaultdict(list)
    for call in recorder.calls:
        by_shard[call.shard].append(call.id)
    assert again in recorder.ids()
    assert all(ids == sorted(ids) for ids in by_shard.values())
    assert len(recorder.ids()) == len(set(recorder.ids()))
