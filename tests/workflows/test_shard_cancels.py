"""The OutboxShard workflow when it stops an activity under way (a skip, a changed head, a
continue-as-new while blocked), on a time-skipping server of this module's own: the test server
may count a cancelled activity as running for a while, which holds its clock still for the
tests after it."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType

from outbox_bridge.workflows.models import (
    Blocked,
    DrainResult,
    HandleHeadResult,
    HeldFor,
    NotifyInput,
    RecheckInput,
    ResumeInput,
    ShardState,
    ShardStatus,
    ShardSummary,
    SkipInput,
)
from tests.harness import wait_until
from tests.workflows.doubles import PROJECT_UPDATE, events, of_type
from tests.workflows.test_shard import blocked_shard, carried_input, continue_as_new, summary


async def test_a_blocked_shard_continues_as_new_on_its_backoff_schedule(wf) -> None:
    handle, _ = await blocked_shard(
        wf, initial_retry_seconds=10, max_retry_interval_seconds=60, max_history_events=100
    )
    # Each retry of a normal activity adds no history: the run continues as new only when
    # something else fills it. Signals do.
    await wf.skip_time(35)  # attempts at +0, +10, +30 of this run's activity
    new_run = await continue_as_new(wf, handle, NotifyInput(max_id=13, late=False))
    carried = await carried_input(wf, handle)
    assert carried.record is not None
    record = carried.record.phase
    assert isinstance(record, Blocked) and record.head == PROJECT_UPDATE
    assert record.attempts == 1 + 3  # the partition's or drain's call, then three attempts
    assert record.retry_interval_seconds == 40  # the next interval of 10, 20, 40
    assert record.next_attempt_at is not None
    wf.doubles.categories.default = HandleHeadResult(True, 3, 13)
    before = len(wf.doubles.categories.calls)
    # (From the new run: the test server leaves a run that continued as new while cancelling
    # an activity without its last event.)
    await wf.result(handle, ShardSummary, run_id=new_run)
    later = wf.doubles.categories.calls[before:]
    assert later[0].input.prior_attempts == 4  # numbered on across the runs
    assert new_run != handle.first_execution_run_id


async def test_a_skip_stops_a_blocked_head_and_resume_retries_it_from_scratch(wf) -> None:
    handle, _ = await blocked_shard(wf)
    skipped = await handle.execute_update(
        "skip", SkipInput(reason="replica down", by="ops"), result_type=ShardStatus
    )
    # Answered once the skip is in the table: the attempt under way is cancelled.
    assert skipped.state == ShardState.SKIPPED and skipped.head == PROJECT_UPDATE
    [hold] = wf.doubles.holds.calls
    assert hold.input.held_for == HeldFor.SKIPPED
    history = await events(handle)
    assert of_type(history, EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED)
    wf.doubles.drains.default = DrainResult(groups_handled=1, rows_handled=3, released=True)
    resumed = await handle.execute_update("resume", ResumeInput(), result_type=ShardStatus)
    assert resumed.skip is None and resumed.head is None and resumed.attempts == 0
    await summary(wf, handle)
    # Taken back from the skip in the table, then drained from the head.
    assert [c.input.held_for for c in wf.doubles.holds.calls] == [
        HeldFor.SKIPPED,
        HeldFor.WORKFLOW,
    ]
    assert wf.doubles.order[-2:] == ["hold_shard", "drain_shard"]


async def test_a_changed_head_is_tried_again_at_once(wf) -> None:
    handle, _ = await blocked_shard(wf, initial_retry_seconds=600)
    await wait_until(
        lambda: len(wf.doubles.categories.calls) == 1, timeout=10, interval=0.01, what="a call"
    )
    wf.doubles.categories.default = HandleHeadResult(False)  # no longer the head
    wf.doubles.drains.default = DrainResult(released=True)
    await handle.signal("recheck", RecheckInput(reason="its head changed"))
    await summary(wf, handle)
    first, second = wf.doubles.categories.calls
    assert (second.started - first.started).total_seconds() < 600  # not at the next retry
