"""Hostile conditions at the core of processing, against a real PostgreSQL and Temporal:

- a shard blocked, skipped or deferred for a long time while producers keep flushing rows to it
  continues as new under the history cap, carrying where it stands;
- an operator's edits to pending rows (a deferred head deleted or moved earlier, a blocked head's
  category changed) take effect within a sweep;
- the connection that holds a round's shard locks is killed while a handler runs (the design
  contract's invariant 5: docs/explanation/contract.md).
"""

from __future__ import annotations

import asyncio
import itertools
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from outbox_bridge import OutboxMessage
from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.locks import lock_key
from outbox_bridge.flush import Flusher
from outbox_bridge.runtime.round_writes import Round
from outbox_bridge.runtime.shards import parse_shard
from outbox_bridge.workflows.models import Deferred, ShardInput, ShardRef, ShardStatus, SkipInput
from tests.harness import (
    Category,
    Recorder,
    count_rows,
    create_tables,
    fast_settings,
    fresh_app,
    lock_holders,
    make_app,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)

CONTINUED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
# What a run may add past the cap: the task that notices it, a flush under way (its update,
# its check activity and their tasks: up to 17 events seen), the cancel of the waiting
# activity, the continue-as-new itself.
HANDFUL = 24


def row(category: Category, shard: int, obj: int, **extra: object) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


@dataclass
class Gate:
    """Makes a category fail while closed, and records when each attempt began."""

    open: bool = False
    attempts: list[float] = field(default_factory=list)

    async def __call__(self, message: OutboxMessage) -> None:
        self.attempts.append(time.monotonic())
        if not self.open:
            raise ConnectionError(f"downstream unavailable (attempt {len(self.attempts)})")


async def status_of(handle: WorkflowHandle[Any, Any]) -> ShardStatus | None:
    try:
        status: ShardStatus = await handle.query("status", result_type=ShardStatus)
    except (RPCError, Exception):
        return None
    return status


async def in_state(handle: WorkflowHandle[Any, Any], state: str) -> bool:
    status = await status_of(handle)
    return status is not None and status.state == state


@dataclass
class Run:
    run_id: str
    events: list[HistoryEvent]

    @property
    def continued(self) -> bool:
        return self.events[-1].event_type == CONTINUED

    def scheduled(self, activity: str) -> list[HistoryEvent]:
        return [
            e
            for e in self.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == activity
        ]


async def runs_from(client: Client, workflow_id: str, first_run: str) -> list[Run]:
    """The chain of runs from ``first_run``, following each continue-as-new."""
    runs: list[Run] = []
    run_id: str | None = first_run
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        run = Run(run_id, list(history.events))
        runs.append(run)
        run_id = (
            run.events[-1].workflow_execution_continued_as_new_event_attributes.new_execution_run_id
            if run.continued
            else None
        )
    return runs


async def carried(client: Client, run: Run) -> ShardInput:
    """What ``run`` handed to the next run when it continued as new."""
    attributes = run.events[-1].workflow_execution_continued_as_new_event_attributes
    payloads = list(attributes.input.payloads)
    [shard_input] = await client.data_converter.decode(payloads, [ShardInput])
    assert isinstance(shard_input, ShardInput)
    return shard_input


async def keep_flushing(
    engine: Any,
    app: Any,
    flusher: Flusher,
    shard: ShardRef,
    client: Client,
    first_run: str,
    *,
    runs: int,
    seconds: float,
    every: float = 0.1,
    at_least: int = 3,
    until: Callable[[], bool] = lambda: True,
) -> tuple[list[int], set[str]]:
    """Write a row of its own group to ``shard`` and flush it, every ``every`` seconds, until
    the shard's workflow has continued as new ``runs`` times, or ``seconds`` passed and it has
    made ``at_least`` runs (on a loaded machine each flush takes longer, so the runs do: up to
    three times ``seconds`` are given for those): the rows written and the flushes' answers
    (each flush is an update in the workflow's history). It goes on, up to that last limit,
    until ``until()`` holds too."""
    written: list[int] = []
    answers: set[str] = set()
    end = time.monotonic() + seconds
    last = time.monotonic() + 3 * seconds
    for obj in itertools.count(1000):
        [new] = await write_rows(
            engine, app, [row(Category.ORGANIZATION_UPDATE, shard.shard_identifier, obj)]
        )
        written.append(new)
        answers |= {result.outcome for result in await flusher.flush({shard: new}, timeout=10)}
        await asyncio.sleep(every)
        if obj % 20 == 0:
            chain = await runs_from(client, shard.workflow_id, first_run)
            now = time.monotonic()
            enough = len(chain) > runs or (now > end and len(chain) >= at_least)
            if (enough and until()) or now > last:
                break
    return written, answers


def check_runs(chain: list[Run], cap: int, *, at_least: int) -> None:
    assert len(chain) > at_least, f"only {len(chain)} run(s)"
    assert all(run.continued for run in chain[:-1])
    assert not chain[-1].continued
    lengths = [len(run.events) for run in chain]
    assert max(lengths) <= cap + HANDFUL, lengths


async def through_runs(
    engine: Any,
    app: Any,
    client: Client,
    settings: OutboxSettings,
    shard: ShardRef,
    *,
    runs: int,
    cap: int,
    answer: str,
    at_least: int = 2,
    every: float = 0.1,
) -> tuple[list[int], list[Run], ShardStatus]:
    """Producers keep flushing rows to ``shard`` until its workflow has continued as new
    ``runs`` times, each run under the cap, every flush answered ``answer``: the rows written,
    the chain of runs, and the status at the end."""
    handle = client.get_workflow_handle(shard.workflow_id)
    first_run = (await handle.describe()).run_id
    assert first_run is not None
    written, answers = await keep_flushing(
        engine,
        app,
        Flusher(app, settings, client=client),
        shard,
        client,
        first_run,
        runs=runs,
        seconds=45,
        every=every,
        at_least=at_least + 1,
    )
    assert answers == {answer}
    chain = await runs_from(client, shard.workflow_id, first_run)
    check_runs(chain, cap, at_least=at_least)
    after = await status_of(handle)
    assert after is not None
    return written, chain, after


# -- 1. long blocks continue as new ---------------------------------------------------------------


async def test_a_long_blocked_shard_continues_as_new_carrying_its_block(
    servers, engine, client: Client
) -> None:
    """A shard blocked behind a failing head while producers keep flushing rows to it (each
    flush an update of its workflow, answered ``blocked``) continues as new under
    --max-history-events, and each run carries the block: the same head, since when, the
    attempts so far, the last error, and where the retry backoff stood (no run starts again
    from the initial interval)."""
    recorder, _, app = await fresh_app(engine)
    gate = Gate()
    recorder.behaviour[Category.PROJECT_UPDATE] = gate
    # The least cap the settings take: a run continues as new after a dozen or so flushes.
    cap = 100
    settings = fast_settings(
        max_history_events=cap, initial_retry_interval=0.2, max_retry_interval=2.0
    )
    shard = parse_shard("ORGANIZATION:31", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    [head_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 31, 1)])
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "blocked"), what="the blocked shard")
        before = await status_of(handle)
        assert before is not None and before.head is not None
        written, chain, after = await through_runs(
            engine, app, client, settings, shard, runs=3, cap=cap, answer="blocked"
        )
        assert after.state == "blocked"
        assert after.head == before.head
        assert after.blocked_since == before.blocked_since
        assert after.last_error == before.last_error
        assert after.attempts >= before.attempts
        # The record, run by run: the attempts grow, and the backoff goes on where it stood.
        records = [(await carried(client, run)).carried().blocked for run in chain[:-1]]
        attempts = [r.attempts for r in records if r is not None]
        assert attempts == sorted(attempts) and attempts[-1] > before.attempts
        # A run that retried (one may continue as new again before its attempt is due).
        retried = [
            scheduled.activity_task_scheduled_event_attributes.retry_policy.initial_interval
            for run in chain[1:]
            for scheduled in run.scheduled("PROJECT_UPDATE")
        ]
        intervals = [interval.ToTimedelta().total_seconds() for interval in retried]
        assert intervals
        assert all(interval > settings.initial_retry_interval for interval in intervals)
        assert intervals[-1] == settings.max_retry_interval  # blocked long enough: capped
        for r in records:
            assert r is not None and r.head == before.head
            assert r.blocked_since == before.blocked_since
            assert r.retry_interval_seconds is not None
            assert r.next_attempt_at is not None  # the next run waits for it
        assert await count_rows(engine, app) == len(written) + 1
        assert recorder.calls == []  # nothing passed the blocked head
        gate.open = True
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="the shard unblocked")
    assert recorder.ids() == [head_id, *written]


async def test_a_long_blocked_shard_retries_no_faster_than_the_cap_across_runs(
    servers, engine, client: Client
) -> None:
    """Flushed rows keep a blocked shard continuing as new every few seconds: once the backoff
    has reached --max-retry-interval, attempts stay that far apart, also across runs."""
    recorder, _, app = await fresh_app(engine)
    gate = Gate()
    recorder.behaviour[Category.PROJECT_UPDATE] = gate
    # A cap four times the initial interval: a run that began its backoff again (1 or 2 s)
    # shows as a gap far below it. The least history cap: a run lasts a dozen or so flushes.
    cap_seconds = 4.0
    settings = fast_settings(
        max_history_events=100, initial_retry_interval=1.0, max_retry_interval=cap_seconds
    )
    shard = parse_shard("ORGANIZATION:32", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 32, 1)])
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "blocked"), what="the blocked shard")
        first_run = (await handle.describe()).run_id
        assert first_run is not None
        # 1 + 2 s of backoff: the interval is at its cap from then on.
        await asyncio.sleep(3.5)
        capped_from = time.monotonic()
        flusher = Flusher(app, settings, client=client)
        # On a quiet machine several runs can pass within one capped interval: flushing goes on
        # until the capped attempts show two gaps.
        await keep_flushing(
            engine,
            app,
            flusher,
            shard,
            client,
            first_run,
            runs=6,
            seconds=30,
            every=0.1,
            until=lambda: sum(at >= capped_from for at in gate.attempts) >= 3,
        )
        chain = await runs_from(client, shard.workflow_id, first_run)
        await handle.signal("skip", SkipInput(reason="test over"))
    assert len(chain) >= 3
    late = [at for at in gate.attempts if at >= capped_from]
    gaps = [b - a for a, b in itertools.pairwise(late)]
    assert gaps and min(gaps) >= 0.8 * cap_seconds, [round(g, 1) for g in gaps]


async def test_a_long_skipped_shard_continues_as_new_carrying_its_skip(
    servers, engine, client: Client
) -> None:
    """A blocked shard that an operator skipped keeps receiving flushed rows (each answered
    ``skipped``). Its runs continue as new under the cap, each carrying the skip (reason, by
    whom, when) and the block it paused; no handler runs until it is resumed."""
    recorder, _, app = await fresh_app(engine)
    gate = Gate()
    recorder.behaviour[Category.PROJECT_UPDATE] = gate
    cap = 100  # the least the settings take: fewer flushes make the runs
    settings = fast_settings(max_history_events=cap)
    shard = parse_shard("ORGANIZATION:33", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    [head_id] = await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 33, 1)])
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "blocked"), what="the blocked shard")
        await handle.execute_update("skip", SkipInput(reason="downstream migration", by="ops"))
        before = await status_of(handle)
        assert before is not None and before.skip is not None and before.head is not None
        attempts = len(gate.attempts)
        written, chain, after = await through_runs(
            engine, app, client, settings, shard, runs=2, cap=cap, answer="skipped"
        )
        assert after.state == "skipped"
        assert after.skip == before.skip
        assert (after.head, after.blocked_since, after.last_error) == (
            before.head,
            before.blocked_since,
            before.last_error,
        )
        for run in chain[1:]:
            assert run.scheduled("PROJECT_UPDATE") == []  # no attempt while skipped
        assert len(gate.attempts) == attempts
        assert recorder.calls == []
        gate.open = True
        await handle.execute_update("resume", {})
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="the resumed shard")
    assert recorder.ids() == [head_id, *written]


async def test_a_long_deferred_shard_continues_as_new_carrying_its_deferral(
    servers, engine, client: Client
) -> None:
    """A shard whose head is deferred for an hour keeps receiving flushed rows (each answered
    ``deferred``). Its runs continue as new under the cap, each still deferred until the same
    time, and nothing behind the head runs; once the head is moved to now, everything runs in
    order."""
    recorder, table, app = await fresh_app(engine)
    cap = 100  # the least the settings take: fewer flushes make the runs
    settings = fast_settings(max_history_events=cap)
    shard = parse_shard("ORGANIZATION:34", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    due = datetime.now(UTC) + timedelta(hours=1)
    [head_id] = await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 34, 1, scheduled_for=due)]
    )
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "deferred"), what="the deferred shard")
        before = await status_of(handle)
        assert before is not None and before.deferred_until is not None
        written, chain, after = await through_runs(
            engine, app, client, settings, shard, runs=2, cap=cap, answer="deferred"
        )
        assert after.state == "deferred"
        assert after.deferred_until == before.deferred_until
        assert datetime.fromisoformat(after.deferred_until or "") == due
        for run in chain[:-1]:
            record = (await carried(client, run)).carried().current
            assert isinstance(record, Deferred) and record.deferred_until == before.deferred_until
        assert recorder.calls == []
        await sql(engine, f"UPDATE {table} SET scheduled_for = now() WHERE id = :id", id=head_id)
        await wait_until(lambda: table_empty(engine, app), timeout=30, what="the due shard")
    assert recorder.ids() == [head_id, *written]


# -- 2. edits to pending rows take effect within a sweep ---------------------------------------------

SWEEP = 2.0
# The sweep wakes a held shard whose head changed. The waits below are far shorter than what
# would release the rows without the sweep (an hour's deferral, a retry 20 s away), and far
# longer than two sweeps.
DEFERRED_EDITS = ["deferred head deleted", "deferred head due now"]
BLOCKED_EDITS = ["blocked head's category changed", "blocked head deleted"]


@pytest.mark.parametrize("edit", DEFERRED_EDITS)
async def test_an_edit_to_a_deferred_head_takes_effect_within_a_sweep(
    servers, engine, client: Client, edit: str
) -> None:
    recorder, table, app = await fresh_app(engine)
    shard = parse_shard("ORGANIZATION:41", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    later = datetime.now(UTC) + timedelta(hours=1)
    [head, *behind] = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 41, 1, scheduled_for=later),
            row(Category.ORGANIZATION_UPDATE, 41, 2),
            row(Category.MEMBER_UPDATE, 41, 3),
        ],
    )
    settings = fast_settings(sweep_interval=SWEEP)
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "deferred"), what="the deferred shard")
        await asyncio.sleep(2 * SWEEP)  # the sweeps have seen the shard as it is
        if edit == "deferred head deleted":
            await sql(engine, f"DELETE FROM {table} WHERE id = :id", id=head)
        else:
            await sql(engine, f"UPDATE {table} SET scheduled_for = now() WHERE id = :id", id=head)
        await wait_until(lambda: table_empty(engine, app), timeout=15, what="the rows behind")
    expected = behind if edit == "deferred head deleted" else [head, *behind]
    assert recorder.ids() == expected


@pytest.mark.parametrize("edit", BLOCKED_EDITS)
async def test_an_edit_to_a_blocked_head_takes_effect_within_a_sweep(
    servers, engine, client: Client, edit: str
) -> None:
    """An operator fixes a poison head (its category, or deletes it) while the backoff waits
    20 s before the next attempt: the rows behind it run within about a sweep."""
    recorder, table, app = await fresh_app(engine)
    gate = Gate()
    recorder.behaviour[Category.PROJECT_UPDATE] = gate
    shard = parse_shard("ORGANIZATION:42", app)
    handle = client.get_workflow_handle(shard.workflow_id)
    [head, *behind] = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 42, 1),
            row(Category.ORGANIZATION_UPDATE, 42, 2),
            row(Category.MEMBER_UPDATE, 42, 3),
        ],
    )
    settings = fast_settings(
        sweep_interval=SWEEP,
        initial_retry_interval=20.0,
        max_retry_interval=60.0,
    )
    async with running_worker(servers, app, settings):
        await wait_until(lambda: in_state(handle, "blocked"), what="the blocked shard")
        # The drain's attempt and the category activity's first: the next is 20 s away.
        await wait_until(lambda: len(gate.attempts) >= 2, what="the first retry")
        if edit == "blocked head deleted":
            await sql(engine, f"DELETE FROM {table} WHERE id = :id", id=head)
        else:
            category = int(Category.ORGANIZATION_UPDATE)
            await sql(
                engine, f"UPDATE {table} SET category = :c WHERE id = :id", c=category, id=head
            )
        await wait_until(lambda: table_empty(engine, app), timeout=15, what="the rows behind")
    expected = behind if edit == "blocked head deleted" else [head, *behind]
    assert recorder.ids() == expected
    assert len(gate.attempts) == 2  # not released by a retry of the old head


# -- 4. lost locks ------------------------------------------------------------------------------------


@dataclass
class HangingHandler:
    """A plain-def handler (it runs in a thread, which nothing can interrupt): the first call
    for object 1 hangs until released; every call is recorded with its start and end."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[int, float, float]] = field(default_factory=list)
    running: int = 0
    overlaps: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, message: OutboxMessage) -> None:
        with self._lock:
            self.running += 1
            if self.running > 1:
                self.overlaps += 1
        started = time.monotonic()
        try:
            if message.object_identifier == 1 and not self.entered.is_set():
                self.entered.set()
                self.release.wait(60)
        finally:
            with self._lock:
                self.running -= 1
            self.calls.append((message.object_identifier, started, time.monotonic()))

    def objects(self) -> list[int]:
        return [obj for obj, _, _ in self.calls]


@pytest.mark.parametrize(
    "closed",
    [
        "while idle",
        pytest.param(
            "under a statement",
            marks=pytest.mark.skipif(
                not hasattr(select, "POLLRDHUP"), reason="only Linux tells a peer's hang-up"
            ),
        ),
    ],
)
async def test_a_statement_under_way_does_not_hide_a_closed_connection(engine, closed: str) -> None:
    """The server closed a round's connection while it was idle, or while a statement of the
    round was under way (its answer not read yet). A handler thread asking, while that
    statement runs, whether the round may take a further group is told no: the round looked
    at the idle socket before the statement made it unreadable for others, and a socket the
    server hung up says so even under a statement."""
    _, table, app = await fresh_app(engine)
    conn = await engine.connect()
    try:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        round_ = Round(conn, app.table(table), [])
        await round_.attach()
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        asked: list[bool] = []

        async def terminate() -> None:
            await sql(engine, "SELECT pg_terminate_backend(:pid)", pid=pid)
            await asyncio.sleep(0.5)  # the server's goodbye reaches the socket, unread

        async def statement(c: Any) -> None:
            if closed == "under a statement":
                await terminate()
            asked.append(await asyncio.to_thread(round_.alive))  # as a handler thread asks
            await c.execute(text("SELECT 1"))

        if closed == "while idle":
            await terminate()
        with pytest.raises(DBAPIError):
            await round_.execute(statement)
        assert asked == [False]
    finally:
        await conn.invalidate()
        await conn.close()


async def test_a_lost_lock_stops_the_round_and_its_rows_run_again(
    servers, engine, client: Client
) -> None:
    """A handler hangs past --handler-timeout; meanwhile the connection holding its shard's
    lock is terminated (an idle timeout, a pooler, a network cut): the connection of a
    partition's round.

    The round notices: it takes no further group on the dead connection, and deletes nothing
    under the lost lock. No second call of the shard starts in this worker while the first
    still runs, although PostgreSQL no longer holds the lock. Once the hung call returned, a
    new connection takes the shard's lock again and deletes the group it handled, so it does
    not run again. And the shard is not blocked for good: all its rows are handled."""
    hanging = HangingHandler()
    table = unique_table()
    app = make_app(table, Recorder(), handle_all=False)
    app.handler(*Category)(hanging)
    await create_tables(engine, app)
    shard = parse_shard("ORGANIZATION:51", app)
    await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 51, 1),
            row(Category.ORGANIZATION_UPDATE, 51, 2),
            row(Category.MEMBER_UPDATE, 51, 3),
        ],
    )
    # The round's time budget outlasts the hung call: only the lost connection stops it.
    settings = fast_settings(handler_timeout=2.0, drain_time_budget=30.0)
    async with running_worker(servers, app, settings):
        await asyncio.wait_for(asyncio.to_thread(hanging.entered.wait, 30), timeout=35)
        [pid] = await lock_holders(engine, lock_key(shard))
        await sql(engine, "SELECT pg_terminate_backend(:pid)", pid=pid)
        # Past the handler timeout: whatever retries there are come and go.
        await asyncio.sleep(3 * settings.handler_timeout + 1)
        assert hanging.objects() == []  # nothing else of the shard started meanwhile
        hanging.release.set()
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="every row")
    objects = hanging.objects()
    # The hung group returned on a dead connection; its rows were deleted under the lock taken
    # again. The groups behind it ran once each, on a live connection, in order.
    assert objects == [1, 2, 3]
    assert hanging.overlaps == 0
    for (_, _, first_end), (_, second_start, _) in itertools.pairwise(hanging.calls):
        assert second_start >= first_end
    async with engine.connect() as conn:
        owners = await conn.execute(text(f"SELECT count(*) FROM {table}_owners"))
        assert owners.scalar_one() == 0  # given back: not held for good
