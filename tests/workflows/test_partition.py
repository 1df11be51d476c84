"""The OutboxPartition workflow on the time-skipping test server, its drain_partition activity
stood in for."""

from __future__ import annotations

from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError

from outbox_bridge.workflows.models import (
    PartitionCarry,
    PartitionInput,
    PartitionOptions,
    PartitionRef,
    PartitionRound,
    PartitionStatus,
)
from tests.harness import wait_until
from tests.workflows.doubles import WAIT, Bench, events, of_type

ROUND = PartitionRound(
    rows_handled=40, groups_handled=30, shards_drained=5, handed_over=1, seconds=60.0
)
INSTANT_ROUNDS = 24


async def start(wf: Bench, **options: Any) -> WorkflowHandle[Any, Any]:
    partition = PartitionRef(wf.shard.table, 0, 2)
    handle = await wf.client.start_workflow(
        "OutboxPartition",
        PartitionInput(partition, PartitionOptions(**options)),
        id=partition.workflow_id,
        task_queue=wf.task_queue,
    )
    wf.track(partition.workflow_id)
    return wf.client.get_workflow_handle(
        partition.workflow_id, first_execution_run_id=handle.result_run_id
    )


async def status(handle: WorkflowHandle[Any, Any]) -> PartitionStatus:
    result: PartitionStatus = await handle.query("status", result_type=PartitionStatus)
    return result


async def rounds_reach(handle: WorkflowHandle[Any, Any], rounds: int) -> PartitionStatus:
    """The status once the partition has counted ``rounds``. A query may time out while the
    worker is busy with the partition's tasks (a loaded machine): it is asked again."""
    seen: list[PartitionStatus] = []

    async def enough() -> bool:
        try:
            seen.append(await status(handle))
        except RPCError:
            return False
        return seen[-1].rounds >= rounds

    await wait_until(enough, timeout=10, interval=0.01, what=f"{rounds} rounds")
    return seen[-1]


async def test_rounds_are_counted_and_retiring_completes_the_partition(wf) -> None:
    wf.doubles.rounds.answers = [ROUND, ROUND]
    wf.doubles.rounds.default = WAIT  # the third round lingers until the partition retires
    handle = await start(wf, round_seconds=60)
    counted = await rounds_reach(handle, 2)
    assert (counted.rows_handled, counted.groups_handled, counted.handed_over) == (80, 60, 2)
    assert counted.last_round == ROUND
    await handle.signal("retire")
    assert await wf.result(handle, PartitionCarry) == PartitionCarry(80, 60, 2, 2)
    history = await events(handle)
    assert of_type(history, EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED)
    assert {c.input.partition.workflow_id for c in wf.doubles.rounds.calls} == {handle.id}


async def test_new_options_stop_the_round_and_the_next_one_uses_them(wf) -> None:
    wf.doubles.rounds.answers = [WAIT]
    handle = await start(wf, round_seconds=60)
    await wait_until(lambda: len(wf.doubles.rounds.calls) == 1, what="the first round")
    await handle.signal("reconfigure", PartitionOptions(round_seconds=30, max_shards=7))
    await wait_until(lambda: len(wf.doubles.rounds.calls) >= 2, what="a round on new options")
    second = wf.doubles.rounds.calls[1].input.options
    assert (second.round_seconds, second.max_shards) == (30, 7)
    assert (await status(handle)).rounds >= 0
    await handle.signal("retire")
    await wf.result(handle, PartitionCarry)


async def test_a_long_history_continues_as_new_carrying_the_totals(wf) -> None:
    # A bounded number of instant rounds (a few runs' worth), then a lingering one: a partition
    # continuing as new without pause keeps the server busy, and queries sent to it time out.
    wf.doubles.rounds.answers = [ROUND] * INSTANT_ROUNDS
    wf.doubles.rounds.default = WAIT
    handle = await start(wf, max_history_events=30)
    first = await handle.describe()

    async def continued() -> bool:
        return (await handle.describe()).run_id != first.run_id

    await wait_until(continued, timeout=10, interval=0.01, what="a continue-as-new")
    first_run = wf.client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
    [event] = of_type(
        await events(first_run), EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    )
    attributes = event.workflow_execution_continued_as_new_event_attributes
    [carried] = await wf.client.data_converter.decode(attributes.input.payloads, [PartitionInput])
    assert isinstance(carried, PartitionInput) and carried.carry is not None
    rounds = carried.carry.rounds
    assert 0 < rounds < INSTANT_ROUNDS
    assert carried.carry == PartitionCarry(40 * rounds, 30 * rounds, rounds, rounds)
    assert carried.options.max_history_events == 30
    # The next run goes on from the totals.
    assert (await rounds_reach(handle, rounds + 1)).rows_handled >= 40 * (rounds + 1)
    await handle.signal("retire")
    await wf.result(handle, PartitionCarry)
