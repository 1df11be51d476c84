"""The OutboxShard workflow on the time-skipping test server, with its activities stood in for:
timers, idle waits and retry backoff pass in skipped time."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError

from outbox_bridge.runtime.shards import WORKFLOW, ShardStarter, start_arguments
from outbox_bridge.workflows.models import (
    MEMO_CODE_KEY,
    WORKFLOW_CODE,
    Draining,
    DrainResult,
    FlushCheck,
    FlushInput,
    FlushOutcome,
    FlushResult,
    HandleHeadResult,
    HandoverInput,
    HeldFor,
    NotifyInput,
    ParkedNote,
    PauseInfo,
    PauseKind,
    ResumeInput,
    ShardInput,
    ShardOptions,
    ShardState,
    ShardStatus,
    ShardSummary,
    SkipInfo,
    SkipInput,
    flush_queue,
)
from tests.harness import refusal, wait_until
from tests.workflows.doubles import (
    PROJECT_UPDATE,
    REPLICA_DOWN,
    Bench,
    current_details,
    events,
    failing,
    intervals,
    of_type,
    options,
    summaries,
    timers,
)


def starter(wf: Bench, opts: ShardOptions) -> ShardStarter:
    return ShardStarter(wf.client, task_queue=wf.task_queue, options=opts)


async def start(
    wf: Bench, opts: ShardOptions, max_id: int = 10, *, skip: SkipInfo | None = None
) -> WorkflowHandle[Any, Any]:
    """Start the shard's workflow as the sweep does; a handle on its latest run that knows its
    first."""
    arguments = start_arguments(wf.shard, opts, wf.task_queue, max_id=max_id, skip=skip)
    started = await wf.client.start_workflow(WORKFLOW, **arguments)
    wf.track(wf.shard.workflow_id)
    return wf.client.get_workflow_handle(
        wf.shard.workflow_id, first_execution_run_id=started.result_run_id
    )


async def status(handle: WorkflowHandle[Any, Any]) -> ShardStatus:
    result: ShardStatus = await handle.query("status", result_type=ShardStatus)
    return result


async def reaches(handle: WorkflowHandle[Any, Any], state: ShardState) -> ShardStatus:
    """Wait (in real time: a few milliseconds) until the workflow is in ``state``."""

    async def there() -> bool:
        return (await status(handle)).state == state

    await wait_until(there, timeout=10, interval=0.01, what=f"state {state}")
    return await status(handle)


async def summary(wf: Bench, handle: WorkflowHandle[Any, Any]) -> ShardSummary:
    return await wf.result(handle, ShardSummary)


# -- draining and completing -------------------------------------------------------------------


async def test_an_emptied_shard_completes_at_once(wf) -> None:
    wf.doubles.drains.answers = [
        DrainResult(groups_handled=2, rows_handled=3, highest_seen_id=10, released=True)
    ]
    handle = await start(wf, options())
    assert await summary(wf, handle) == ShardSummary(wf.shard.key, 3, 2)
    [drain] = wf.doubles.drains.calls
    assert drain.input.shard == wf.shard
    assert timers(await events(handle)) == []  # no idle wait
    # Started by this code: a run that upgrade-check does not report.
    assert await (await handle.describe()).memo() == {MEMO_CODE_KEY: WORKFLOW_CODE}


async def test_more_rows_drain_again_before_going_idle(wf) -> None:
    wf.doubles.drains.answers = [
        DrainResult(groups_handled=1000, rows_handled=1000, highest_seen_id=1000, more=True),
        DrainResult(groups_handled=1, rows_handled=1, highest_seen_id=1001),
    ]
    handle = await start(wf, options(), max_id=1001)
    assert await summary(wf, handle) == ShardSummary(wf.shard.key, 1001, 1001)
    assert len(wf.doubles.drains.calls) == 2


async def test_a_failing_local_drain_falls_back_to_a_server_retried_one(wf) -> None:
    wf.doubles.drains.answers = [RuntimeError("database down")] * 3
    # Local retries wait in the worker, in real time: a short interval.
    handle = await start(wf, options(initial_retry_seconds=0.01))
    await summary(wf, handle)
    calls = wf.doubles.drains.calls
    assert len(calls) == 4  # three local attempts, then a normal activity
    history = await events(handle)
    [scheduled] = of_type(history, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    assert scheduled.activity_task_scheduled_event_attributes.activity_type.name == "drain_shard"


# -- deferred heads ----------------------------------------------------------------------------


async def test_a_deferred_head_waits_on_a_timer_by_the_database_clock(wf) -> None:
    wf.doubles.drains.answers = [
        DrainResult(deferred_until="2030-01-01T00:00:00+00:00", deferred_seconds=3600.0),
        DrainResult(groups_handled=1, rows_handled=1, highest_seen_id=10),
    ]
    handle = await start(wf, options())
    deferred = await reaches(handle, ShardState.DEFERRED)
    assert deferred.deferred_until == "2030-01-01T00:00:00+00:00"
    assert await summary(wf, handle) == ShardSummary(wf.shard.key, 1, 1)
    history = await events(handle)
    assert timers(history) == [3600]  # the seconds the database counted
    # What the UI labels the timer with on the workflow's first view.
    assert await summaries(wf.client, history, EventType.EVENT_TYPE_TIMER_STARTED) == [
        "deferred until 2030-01-01 00:00:00 UTC"
    ]
    assert len(wf.doubles.drains.calls) == 2


async def test_rows_arriving_during_a_deferral_wake_the_shard(wf) -> None:
    wf.doubles.drains.answers = [
        DrainResult(deferred_until="2030-01-01T00:00:00+00:00", deferred_seconds=3600.0)
    ]
    handle = await start(wf, options())
    await reaches(handle, ShardState.DEFERRED)
    await handle.signal("notify", NotifyInput(max_id=11))
    await summary(wf, handle)
    history = await events(handle)
    assert len(of_type(history, EventType.EVENT_TYPE_TIMER_CANCELED)) == 1
    assert of_type(history, EventType.EVENT_TYPE_TIMER_FIRED) == []
    assert len(wf.doubles.drains.calls) == 2


# -- blocked heads and the backoff of the category activity ------------------------------------


async def test_a_failed_head_is_retried_with_capped_exponential_backoff(wf) -> None:
    wf.doubles.drains.answers = [
        DrainResult(
            groups_handled=1,
            rows_handled=1,
            highest_seen_id=13,
            failed=PROJECT_UPDATE,
            failure=REPLICA_DOWN,
        )
    ]
    wf.doubles.categories.answers = [failing()] * 6
    wf.doubles.categories.default = HandleHeadResult(True, 3, 13)
    handle = await start(wf, options(initial_retry_seconds=10, max_retry_interval_seconds=60))
    blocked = await reaches(handle, ShardState.BLOCKED)
    assert blocked.head == PROJECT_UPDATE
    assert blocked.last_error == REPLICA_DOWN
    assert blocked.attempts == 1
    assert await summary(wf, handle) == ShardSummary(wf.shard.key, 4, 2)
    calls = wf.doubles.categories.calls
    assert [c.name for c in calls] == ["PROJECT_UPDATE"] * 7  # the category's own activity
    assert [c.attempt for c in calls] == list(range(1, 8))
    assert {(c.input.category, c.input.object_identifier) for c in calls} == {(2, 5)}
    assert intervals(calls) == [10, 20, 40, 60, 60, 60]
    assert len(wf.doubles.drains.calls) == 2  # and the rows after the head, once it passed


def blocking_drain(**extra: Any) -> DrainResult:
    """A drain that handled one group, then met a failing head."""
    return DrainResult(
        groups_handled=1,
        rows_handled=1,
        highest_seen_id=13,
        failed=PROJECT_UPDATE,
        failure=REPLICA_DOWN,
        **extra,
    )


async def blocked_shard(
    wf: Bench, **overrides: Any
) -> tuple[WorkflowHandle[Any, Any], ShardStatus]:
    """A shard whose head keeps failing (until the test scripts otherwise)."""
    wf.doubles.drains.answers = [blocking_drain()]
    wf.doubles.categories.default = failing()
    handle = await start(wf, options(**overrides))
    return handle, await reaches(handle, ShardState.BLOCKED)


def shown(iso: str | None) -> str:
    """A timestamp as a summary shows it."""
    assert iso is not None
    return datetime.fromisoformat(iso).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


async def test_a_blocked_heads_activity_says_what_it_is_blocked_on_since_when(wf) -> None:
    handle, blocked = await blocked_shard(wf)
    history = await events(handle)
    # The label of the pending category activity on the workflow's first view in the UI.
    assert await summaries(wf.client, history, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED) == [
        f"blocked on {PROJECT_UPDATE.summary} since {shown(blocked.blocked_since)}"
    ]


async def carried_input(wf: Bench, handle: WorkflowHandle[Any, Any]) -> ShardInput:
    """What the previous run carried into the current one (the current run's input)."""
    current = wf.client.get_workflow_handle(handle.id, run_id=(await handle.describe()).run_id)
    started = (await events(current))[0]
    attributes = started.workflow_execution_started_event_attributes
    assert attributes.continued_execution_run_id, "the current run was not continued as new"
    [carried] = await wf.client.data_converter.decode(attributes.input.payloads, [ShardInput])
    assert isinstance(carried, ShardInput)
    return carried


PENDING = (
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
)


async def settled(handle: WorkflowHandle[Any, Any]) -> None:
    """Wait until the workflow has taken in what it was sent (its last workflow task is
    complete)."""

    async def done() -> bool:
        return (await events(handle))[-1].event_type not in PENDING

    await wait_until(done, timeout=10, interval=0.01, what="the workflow task to complete")


async def continue_as_new(wf: Bench, handle: WorkflowHandle[Any, Any], signal: NotifyInput) -> str:
    """Send ``signal``, one at a time, until the history is long enough and the run continues as
    new; the new run's id."""
    first = (await handle.describe()).run_id
    for _ in range(50):
        await handle.signal("notify", signal)
        await settled(handle)
        current = (await handle.describe()).run_id
        if current != first:
            return current
    raise AssertionError("the run never continued as new")


# -- continue-as-new ---------------------------------------------------------------------------


async def test_a_busy_shard_continues_as_new_carrying_its_record(wf) -> None:
    wf.doubles.drains.default = DrainResult(groups_handled=1, rows_handled=2, more=True)
    handle = await start(wf, options(max_history_events=40), max_id=10)
    first = handle.first_execution_run_id

    async def continued() -> bool:
        return (await handle.describe()).run_id != first

    await wait_until(continued, timeout=10, interval=0.01, what="a continue-as-new")
    carried = await carried_input(wf, handle)
    assert carried.shard == wf.shard and carried.options.max_history_events == 40
    assert carried.record is not None
    assert carried.record.groups_handled > 0
    assert carried.record.rows_handled == 2 * carried.record.groups_handled
    assert carried.record.max_known_id == 10
    assert isinstance(carried.record.phase, Draining)  # it was draining: the next run drains on
    assert await (await handle.describe()).memo() == {MEMO_CODE_KEY: WORKFLOW_CODE}
    wf.doubles.drains.default = DrainResult(released=True)
    # The counts go on from the carried ones: the last run reports them all.
    total = await summary(wf, handle)
    drained = len(wf.doubles.drains.calls) - 1
    assert total == ShardSummary(wf.shard.key, 2 * drained, drained)


# -- skip and resume ---------------------------------------------------------------------------


async def deferred_shard(wf: Bench) -> WorkflowHandle[Any, Any]:
    """A shard whose head is due in an hour: its workflow runs until then."""
    wf.doubles.drains.answers = [
        DrainResult(
            groups_handled=1,
            rows_handled=1,
            highest_seen_id=10,
            deferred_until="2030-01-01T00:00:00+00:00",
            deferred_seconds=3600.0,
        )
    ]
    wf.doubles.drains.default = DrainResult(released=True)
    handle = await start(wf, options(), max_id=10)
    await reaches(handle, ShardState.DEFERRED)
    return handle


async def test_a_run_carried_over_by_older_code_starts_in_the_state_its_record_says(wf) -> None:
    """Older code carried one flat record (here: blocked, then skipped, the skip recorded in
    the owner table): the run it continued as new starts skipped on that head, records nothing
    again, and on resume takes the shard back before it drains."""
    flat: dict[str, Any] = {
        **{"max_known_id": 13, "highest_seen_id": 13, "rows_handled": 2, "groups_handled": 1},
        **{"pending": False, "skip_held": True, "attempts": 4, "retry_interval_seconds": 40.0},
        "skip": {"reason": "replica down", "by": "ops", "at": "2026-11-29T07:00:00+00:00"},
        "head": dataclasses.asdict(PROJECT_UPDATE),
        "last_error": {"error_type": "ConnectionError", "message": "refused"},
        "blocked_since": "2026-11-29T06:00:00+00:00",
        **{"deferred_until": None, "paused": None, "parked": [], "refused": {"count": 0}},
    }
    shard = dataclasses.asdict(wf.shard)
    arg = {"shard": shard, "options": dataclasses.asdict(options()), "record": flat}
    handle = await wf.client.start_workflow(
        WORKFLOW, arg, id=wf.shard.workflow_id, task_queue=wf.task_queue
    )
    wf.track(wf.shard.workflow_id)
    skipped = await reaches(handle, ShardState.SKIPPED)
    assert (skipped.head, skipped.attempts, skipped.rows_handled) == (PROJECT_UPDATE, 4, 2)
    assert skipped.skip is not None and skipped.skip.reason == "replica down"
    wf.doubles.drains.default = DrainResult(released=True)
    await handle.execute_update("resume", ResumeInput(), result_type=ShardStatus)
    await summary(wf, handle)
    assert wf.doubles.order == ["hold_shard", "drain_shard"]
    assert wf.doubles.holds.calls[0].input.held_for == HeldFor.WORKFLOW


async def test_skip_and_resume_updates_are_refused_when_malformed_or_pointless(wf) -> None:
    handle = await deferred_shard(wf)
    with pytest.raises(WorkflowUpdateFailedError) as no_reason:
        await handle.execute_update("skip", SkipInput(reason="  "))
    assert "skip needs a reason" in refusal(no_reason.value)
    with pytest.raises(WorkflowUpdateFailedError) as not_skipped:
        await handle.execute_update("resume", ResumeInput())
    assert f"shard {wf.shard.key} is not skipped" in refusal(not_skipped.value)
    assert (await status(handle)).state == ShardState.DEFERRED
    assert wf.doubles.holds.calls == []


# -- handovers from a partition ----------------------------------------------------------------


async def hand_over(
    wf: Bench, opts: ShardOptions, handover: HandoverInput
) -> WorkflowHandle[Any, Any]:
    assert await starter(wf, opts).hand_over(wf.shard, handover)
    return wf.track(wf.shard.workflow_id)


async def test_a_handed_over_skip_keeps_the_shard_skipped(wf) -> None:
    skip = SkipInfo(reason="listed in the skip_shards setting", by="configuration")
    handle = await hand_over(
        wf, options(), HandoverInput(max_id=13, held_for=HeldFor.SKIPPED, skip=skip)
    )
    skipped = await reaches(handle, ShardState.SKIPPED)
    assert skipped.skip is not None and skipped.skip.reason == skip.reason
    assert wf.doubles.drains.calls == []
    wf.doubles.drains.default = DrainResult(released=True)
    await handle.execute_update("resume", ResumeInput(), result_type=ShardStatus)
    await summary(wf, handle)
    # The partition recorded the skip: the workflow only takes the shard back, then drains.
    assert wf.doubles.order == ["hold_shard", "drain_shard"]
    assert wf.doubles.holds.calls[0].input.held_for == HeldFor.WORKFLOW


async def test_a_skipped_shard_waits_on_a_timer_that_says_who_skipped_it_and_why(wf) -> None:
    skip = SkipInfo(reason="replica down", by="ops")
    handle = await hand_over(
        wf, options(), HandoverInput(max_id=13, held_for=HeldFor.SKIPPED, skip=skip)
    )
    skipped = await reaches(handle, ShardState.SKIPPED)
    assert skipped.skip is not None

    async def waiting() -> bool:
        return bool(of_type(await events(handle), EventType.EVENT_TYPE_TIMER_STARTED))

    await wait_until(waiting, timeout=10, interval=0.01, what="the skipped shard's timer")
    history = await events(handle)
    # What the UI shows first: who, when and why, on the timer the shard waits on.
    assert await summaries(wf.client, history, EventType.EVENT_TYPE_TIMER_STARTED) == [
        f"skipped by ops at {shown(skipped.skip.at)}: replica down"
    ]
    # A week later the shard is still skipped, waiting on the next such timer: nothing else ran.
    await wf.skip_time(8 * 24 * 3600)
    await settled(handle)
    assert (await status(handle)).state == ShardState.SKIPPED
    assert timers(await events(handle)) == [7 * 24 * 3600] * 2
    assert wf.doubles.drains.calls == [] and wf.doubles.holds.calls == []


async def test_a_handed_over_failure_is_retried_without_repeating_the_partitions_call(wf) -> None:
    wf.doubles.categories.answers = [failing()]
    wf.doubles.categories.default = HandleHeadResult(True, 3, 13)
    wf.doubles.drains.default = DrainResult(released=True)
    handle = await hand_over(
        wf,
        options(initial_retry_seconds=10),
        HandoverInput(
            max_id=13, held_for=HeldFor.FAILED, head=PROJECT_UPDATE, failure=REPLICA_DOWN
        ),
    )
    blocked = await reaches(handle, ShardState.BLOCKED)
    assert (blocked.head, blocked.last_error, blocked.attempts) == (
        PROJECT_UPDATE,
        REPLICA_DOWN,
        1,
    )
    assert await summary(wf, handle) == ShardSummary(wf.shard.key, 3, 1)
    calls = wf.doubles.categories.calls
    assert wf.doubles.order[0] == "PROJECT_UPDATE"  # no drain first: the head is known
    # The partition made the first call: the activity's attempts come after it.
    assert [(c.attempt, c.input.prior_attempts) for c in calls] == [(1, 1), (2, 1)]
    assert len(wf.doubles.drains.calls) == 1  # the rest of the shard, once the head passed


async def test_a_handed_over_deferral_drains_once_to_say_why_then_waits(wf) -> None:
    paused = PauseInfo(
        PauseKind.CATEGORY, 2, "PROJECT_UPDATE", "search down", "ann", "2030-01-01T00:00:00+00:00"
    )
    parked = ParkedNote("MEMBER_UPDATE", 5, "bad payload", "bob", "2030-01-01T00:00:00+00:00", 2)
    wf.doubles.drains.answers = [
        DrainResult(
            deferred_until="2030-01-01T00:05:00+00:00",
            deferred_seconds=300.0,
            paused=paused,
            parked=[parked],
        )
    ]
    wf.doubles.drains.default = DrainResult(groups_handled=1, rows_handled=1, released=True)
    handle = await hand_over(
        wf,
        options(),
        HandoverInput(
            max_id=13,
            held_for=HeldFor.DEFERRED,
            deferred_until="2030-01-01T00:05:00+00:00",
            deferred_seconds=300.0,
        ),
    )
    await reaches(handle, ShardState.DEFERRED)  # its search attribute stays "deferred"
    details = await current_details(handle)
    assert "**Paused** category PROJECT_UPDATE (search down, by ann, since 2030-01-01" in details
    assert "- MEMBER_UPDATE object=5, 2 rows: parked by bob at 2030-01-01" in details
    assert "bad payload" in details and "**Deferred until**" not in details
    await wf.skip_time(301)
    await summary(wf, handle)
    history = await events(handle)
    assert timers(history) == [300]
    assert await summaries(wf.client, history, EventType.EVENT_TYPE_TIMER_STARTED) == [
        "paused: category PROJECT_UPDATE (search down, by ann, since 2030-01-01 00:00:00 UTC)"
    ]
    assert len(wf.doubles.drains.calls) == 2  # the one that says why, and the one after


# -- flush ---------------------------------------------------------------------------------------


async def flush(
    handle: WorkflowHandle[Any, Any], up_to_id: int, timeout: float = 30
) -> FlushResult:
    result: FlushResult = await handle.execute_update(
        "flush", FlushInput(up_to_id=up_to_id, timeout_seconds=timeout), result_type=FlushResult
    )
    return result


@pytest.mark.parametrize(
    ("check", "outcome"),
    [
        (FlushCheck(handled=True), FlushOutcome.HANDLED),
        (
            FlushCheck(handled=False, deferred_until="2030-01-01T00:00:00+00:00"),
            FlushOutcome.DEFERRED,
        ),
        (FlushCheck(handled=False), FlushOutcome.TIMED_OUT),
        (RuntimeError("the table could not be read"), FlushOutcome.TIMED_OUT),
    ],
    ids=["handled", "deferred", "timed-out", "check-failed"],
)
async def test_flush_answers_what_the_table_says(wf, check: object, outcome: FlushOutcome) -> None:
    handle = await deferred_shard(wf)
    wf.doubles.flush_checks.answers = [check]
    answer = await flush(handle, 10, timeout=30)
    assert answer.outcome == outcome and answer.shard == wf.shard.key
    if outcome == FlushOutcome.DEFERRED:
        assert answer.deferred_until == "2030-01-01T00:00:00+00:00"
    [call] = wf.doubles.flush_checks.calls
    assert call.task_queue == flush_queue(wf.task_queue)  # slots of its own
    assert (call.input.up_to_id, call.input.timeout_seconds) == (10, 30)
    assert call.attempt == 1  # never retried: the flush answers within its timeout


async def test_flush_of_a_blocked_or_skipped_shard_answers_at_once(wf) -> None:
    handle, blocked = await blocked_shard(wf)
    answer = await flush(handle, 13)
    assert answer.outcome == FlushOutcome.BLOCKED
    assert (answer.head, answer.error, answer.blocked_since) == (
        PROJECT_UPDATE,
        REPLICA_DOWN,
        blocked.blocked_since,
    )
    assert (await flush(handle, 10)).outcome == FlushOutcome.HANDLED  # rows before the head
    await handle.execute_update("skip", SkipInput(reason="bad deploy"), result_type=ShardStatus)
    skipped = await flush(handle, 13)
    assert skipped.outcome == FlushOutcome.SKIPPED
    assert skipped.skip is not None and skipped.skip.reason == "bad deploy"
    assert len(wf.doubles.flush_checks.calls) == 1


@pytest.mark.parametrize(
    ("bad", "refused_by"),
    [
        (FlushInput(up_to_id=0, timeout_seconds=10), "flush needs up_to_id"),
        (FlushInput(up_to_id=10, timeout_seconds=0), "flush needs timeout_seconds"),
        (FlushInput(up_to_id=10, timeout_seconds=7200), "flush needs timeout_seconds"),
    ],
    ids=["no-id", "no-timeout", "timeout-too-long"],
)
async def test_malformed_flushes_are_refused(wf, bad: FlushInput, refused_by: str) -> None:
    handle = await deferred_shard(wf)
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update("flush", bad)
    assert refused_by in refusal(refused.value)
    assert wf.doubles.flush_checks.calls == []
