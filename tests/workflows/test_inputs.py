"""Signals and updates from outside, on the time-skipping test server: what is out of bounds or of
another shape is refused (an update rejected, a signal counted and shown), nothing of it is
applied, and no workflow task fails."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError

from outbox_bridge.workflows.models import (
    PartitionCarry,
    PartitionOptions,
    Refusals,
    ShardState,
    ShardStatus,
    SkipInput,
)
from tests.harness import refusal, wait_until
from tests.workflows.doubles import WAIT, Bench, current_details, events, of_type
from tests.workflows.test_partition import start as start_partition
from tests.workflows.test_partition import status as partition_status
from tests.workflows.test_shard import deferred_shard
from tests.workflows.test_shard import status as shard_status

LONG = "x" * 1001


async def refused(handle: WorkflowHandle[Any, Any], count: int, *, shard: bool = False) -> str:
    """Wait until the workflow counted ``count`` refused signals; its last one."""

    async def counted() -> bool:
        status = await (shard_status(handle) if shard else partition_status(handle))
        return status.refused is not None and status.refused.count >= count

    await wait_until(counted, timeout=10, interval=0.01, what=f"{count} refused signals")
    status = await (shard_status(handle) if shard else partition_status(handle))
    assert status.refused is not None and status.refused.count == count
    assert status.refused.last is not None
    return status.refused.last


async def no_failed_task(handle: WorkflowHandle[Any, Any]) -> None:
    history = await events(handle)
    assert not of_type(history, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)


async def test_a_reconfigure_out_of_bounds_is_refused_and_shown(wf: Bench) -> None:
    wf.doubles.rounds.default = WAIT
    handle = await start_partition(wf, round_seconds=60)
    await wait_until(lambda: len(wf.doubles.rounds.calls) == 1, what="the first round")
    await handle.signal("reconfigure", PartitionOptions(max_shards=0))
    last = await refused(handle, 1)
    assert last.startswith("reconfigure at ") and "max_shards 0 is outside 1..10,000" in last
    status = await partition_status(handle)
    assert status.options == PartitionOptions(round_seconds=60)  # unchanged
    assert len(wf.doubles.rounds.calls) == 1  # the round goes on: nothing was applied
    details = await current_details(handle)
    assert "**Refused 1 signal; last: reconfigure at " in details
    # Options within bounds are still taken.
    await handle.signal("reconfigure", PartitionOptions(round_seconds=30, max_shards=7))
    await wait_until(lambda: len(wf.doubles.rounds.calls) == 2, what="a round on new options")
    assert wf.doubles.rounds.calls[1].input.options.max_shards == 7
    await handle.signal("retire")
    await wf.result(handle, PartitionCarry)
    await no_failed_task(handle)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["nonsense"], "is not a PartitionOptions"),
        ([[1, 2]], "is not a PartitionOptions"),
        ([{"max_shards": "many"}], "is not a PartitionOptions"),
        ([{"max_shards": 5}, {"max_shards": 6}], "takes one PartitionOptions argument, got 2"),
        ([], "takes one PartitionOptions argument, got 0"),
        ([{"skip_shards": "outbox:t:ORGANIZATION:1"}], "not a shard workflow id"),
        ([{"round_seconds": 1e9}], "round_seconds 1000000000.0 is outside 1..3,600"),
        ([{"max_shards": True}], "max_shards must be a number, got True"),
        ([{"max_shards": 1.5}], "max_shards must be an integer, got 1.5"),
        ([{"poll_interval_seconds": -1}], "poll_interval_seconds -1.0 is outside > 0 and ≤ 86,400"),
    ],
    ids=[
        "text",
        "list",
        "wrong-type",
        "two",
        "none",
        "string-for-tuple",
        "huge",
        "bool",
        "fraction",
        "neg",
    ],
)
async def test_a_malformed_reconfigure_is_dropped_and_shown_never_failing_a_task(
    wf: Bench, args: list[Any], why: str
) -> None:
    wf.doubles.rounds.default = WAIT
    handle = await start_partition(wf, round_seconds=60)
    await handle.signal("reconfigure", args=args)
    assert why in await refused(handle, 1)
    assert (await partition_status(handle)).options == PartitionOptions(round_seconds=60)
    await handle.signal("retire")
    await wf.result(handle, PartitionCarry)
    await no_failed_task(handle)


async def test_a_partition_started_with_options_out_of_bounds_runs_on_the_defaults(wf) -> None:
    wf.doubles.rounds.default = WAIT
    handle = await start_partition(wf, max_shards=0, round_seconds=60)
    assert "start options (defaults used)" in await refused(handle, 1)
    assert (await partition_status(handle)).options == PartitionOptions()
    await wait_until(lambda: len(wf.doubles.rounds.calls) == 1, what="the first round")
    assert wf.doubles.rounds.calls[0].input.options.max_shards == PartitionOptions().max_shards
    await handle.signal("retire")
    await wf.result(handle, PartitionCarry)


async def test_forged_shard_signals_are_refused_and_change_nothing(wf: Bench) -> None:
    handle = await deferred_shard(wf)
    before = await shard_status(handle)
    await handle.signal("handover", {"max_id": -1, "held_for": "failed"})
    await handle.signal("handover", {"max_id": 5, "held_for": "everything"})
    await handle.signal("notify", {"max_id": 2**63})
    await handle.signal("skip", {"reason": LONG, "by": "mallory"})
    await handle.signal("recheck", args=[1, 2, 3])
    await handle.signal("resume", "now")
    last = await refused(handle, 6, shard=True)
    assert last.startswith("resume at ") and "is not a ResumeInput" in last
    after = await shard_status(handle)
    assert after.state == ShardState.DEFERRED and after.skip is None
    assert (after.max_known_id, after.head) == (before.max_known_id, before.head)
    assert wf.doubles.holds.calls == []
    assert "**Refused 6 signals; last: resume at " in await current_details(handle)
    await no_failed_task(handle)


async def test_a_skip_update_out_of_bounds_is_rejected_without_a_history_event(wf) -> None:
    handle = await deferred_shard(wf)
    with pytest.raises(WorkflowUpdateFailedError) as rejected:
        await handle.execute_update("skip", SkipInput(reason=LONG, by="mallory"))
    assert "reason is 1,001 characters long, at most 1,000" in refusal(rejected.value)
    with pytest.raises(WorkflowUpdateFailedError) as rejected:
        await handle.execute_update("skip", SkipInput(reason="ok", by=LONG))
    assert "by is 1,001 characters long" in refusal(rejected.value)
    history = await events(handle)
    assert not of_type(history, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    assert (await shard_status(handle)).state == ShardState.DEFERRED


@pytest.mark.parametrize("args", [[], [None]], ids=["no-input", "null"])
async def test_resume_without_input_is_taken(wf: Bench, args: list[Any]) -> None:
    handle = await deferred_shard(wf)
    await handle.execute_update("skip", SkipInput(reason="bad deploy"), result_type=ShardStatus)
    await handle.signal("resume", args=args)

    async def resumed() -> bool:
        return (await shard_status(handle)).skip is None

    await wait_until(resumed, timeout=10, interval=0.01, what="the shard resumed")
    assert (await shard_status(handle)).refused == Refusals()
