"""The OutboxPartition workflow: a few per table, each keeping one ``drain_partition`` activity
running (``round_seconds`` long, heartbeating, retried forever) over the healthy shards that
hash to it. A healthy row costs it no history event.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from outbox_bridge.workflows.inputs import (
        InvalidInput,
        check_partition_options,
        decoded,
        refused,
    )
    from outbox_bridge.workflows.models import (
        SHARDS_COUNTED,
        PartitionCarry,
        PartitionDrainInput,
        PartitionInput,
        PartitionOptions,
        PartitionRound,
        PartitionStatus,
    )

# How long a drain activity may outlast its round (its rounds in flight end first).
ROUND_GRACE = timedelta(minutes=10)


def _at_least(shards: int) -> str:
    """``shards`` drained, as a drain counts them (up to ``SHARDS_COUNTED``)."""
    return f"at least {shards} shards" if shards >= SHARDS_COUNTED else f"{shards} shards"


@workflow.defn(name="OutboxPartition")
class OutboxPartition:
    @workflow.init
    def __init__(self, input: PartitionInput) -> None:
        self._partition = input.partition
        self._carry = input.carry or PartitionCarry()
        self._last: PartitionRound | None = None
        self._retired = False
        self._reconfigured = False
        self._options = input.options
        try:
            check_partition_options(input.options)
        except InvalidInput as exc:  # a start by hand: the bridge's next sweep reconfigures it
            self._options = PartitionOptions()
            refused(self._carry.refused, "start options (defaults used)", exc)

    @workflow.run
    async def run(self, input: PartitionInput) -> PartitionCarry:
        self._publish()
        while not self._retired:
            if self._history_long():
                workflow.continue_as_new(
                    PartitionInput(self._partition, self._options, self._carry)
                )
            round_ = await self._drain()
            if round_ is not None:
                self._count(round_)
            self._publish()
        return self._carry

    def _history_long(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._options.max_history_events
        )

    async def _drain(self) -> PartitionRound | None:
        options = self._options
        handle = workflow.start_activity(
            "drain_partition",
            PartitionDrainInput(self._partition, options),
            result_type=PartitionRound,
            start_to_close_timeout=timedelta(seconds=options.round_seconds) + ROUND_GRACE,
            heartbeat_timeout=timedelta(seconds=options.heartbeat_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=1),
                maximum_interval=timedelta(seconds=10),
                maximum_attempts=0,
            ),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
            summary=f"drain {self._partition.workflow_id}",
        )
        self._reconfigured = False
        await workflow.wait_condition(lambda: handle.done() or self._retired or self._reconfigured)
        if not handle.done():
            handle.cancel()  # retired, or new options: the next round uses them
        try:
            round_: PartitionRound = await handle
        except (ActivityError, asyncio.CancelledError):
            if not (self._retired or self._reconfigured):
                raise
            return None
        return round_

    def _count(self, round_: PartitionRound) -> None:
        carry = self._carry
        carry.rows_handled += round_.rows_handled
        carry.groups_handled += round_.groups_handled
        carry.handed_over += round_.handed_over
        carry.rounds += 1
        self._last = round_

    # -- signals and queries ------------------------------------------------------------------

    # Signal handlers take their arguments undecoded (``*args``): an input of any shape is
    # refused here and shown, never a failed workflow task.

    @workflow.signal
    def reconfigure(self, *args: Any) -> None:
        """New :class:`PartitionOptions`: the running drain stops and the next one uses them.
        Options outside their bounds (``workflows/inputs.py``) are refused and shown."""
        refusals = self._carry.refused
        options = decoded("reconfigure", args, PartitionOptions, check_partition_options, refusals)
        if options is None:
            self._publish()
        elif options != self._options:
            self._options = options
            self._reconfigured = True

    @workflow.signal
    def retire(self, *args: Any) -> None:
        """The table has fewer partitions now: stop draining and complete."""
        self._retired = True

    @workflow.query
    def status(self) -> PartitionStatus:
        partition = self._partition.workflow_id
        return PartitionStatus(
            **vars(self._carry), partition=partition, last_round=self._last, options=self._options
        )

    # -- what the UI shows ----------------------------------------------------------------------

    def _publish(self) -> None:
        partition, carry = self._partition, self._carry
        lines = [
            f"**Partition** {partition.partition + 1} of {partition.partitions} of table "
            f"`{partition.table}`: drains its healthy shards; a shard that needs attention "
            "gets its own OutboxShard workflow",
            f"**Rows handled** {carry.rows_handled} in {carry.groups_handled} groups; "
            f"{carry.handed_over} shards handed to their own workflow",
        ]
        last = self._last
        if last is not None:
            rate = last.rows_handled / last.seconds if last.seconds else 0.0
            lines.append(
                f"**Last round** {last.rows_handled} rows from {_at_least(last.shards_drained)} in "
                f"{last.seconds:.0f} s ({rate:.0f} rows/s); {last.queued} shards waiting"
            )
            if last.deepest:
                deepest = ", ".join(f"`{b.shard}` {b.rows} rows" for b in last.deepest)
                lines.append(f"**Deepest shards** {deepest}")
            if last.oldest:
                oldest = ", ".join(f"`{b.shard}` {b.age_seconds:.0f} s" for b in last.oldest)
                lines.append(f"**Oldest rows** {oldest}")
            if last.rate_limited:
                lines.append(f"**Rate limited** {'; '.join(last.rate_limited)}")
        refused = carry.refused.summary
        if refused is not None:
            lines.append(f"**{refused}**")
        lines.append("Live figures: the pending drain_partition activity's heartbeat details.")
        workflow.set_current_details("\n\n".join(lines))
