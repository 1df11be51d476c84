"""How many partition drains this worker should run, beside the other workers of its task queue.

Left alone, the task queue may give every drain to one worker while the others idle. So each
worker looks at the task queue now and then (its pollers, and the worker each partition's
pending drain activity names). A worker takes a new drain only while it runs no more drains than
the least busy other worker, and gives one back when it runs two more than that one: drains
spread evenly as workers join, and a worker that leaves hands its drains on (at once when it
stops gracefully, after the heartbeat timeout when it is killed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta

from temporalio.api.enums.v1 import PendingActivityState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.workflows.models import PartitionRef

log = logging.getLogger(__name__)

# How long a view of the task queue serves before it is read again.
VIEW_SECONDS = 5.0
# A worker that runs no drain counts while it polled this recently: a worker that joined, or
# that just took a task. One that stopped gracefully drops out of the view this soon (the task
# queue lists its pollers for minutes); one that runs a drain counts as long as its drain runs.
POLLER_SECONDS = 10.0
# A refused drain is retried by the server (after 1, 2, 4 s); after this many refusals a worker
# takes it whatever it runs already, so that no partition waits long on a view that is wrong.
MAX_REFUSALS = 3
# A drain waits no longer than this for a view of the task queue.
ANSWER_SECONDS = 2.0


class PartitionShare:
    """This worker's view of the partition drains of its task queue (read at most every few
    seconds, shared by its drains)."""

    def __init__(self, client: Client, task_queue: str, tables: list[str]) -> None:
        self._client = client
        self._task_queue = task_queue
        self._tables = tables
        self.identity = client.identity
        self._view: dict[str, int] = {}  # the other workers, and the drains each runs
        self._read_at = -VIEW_SECONDS
        self._given_back_at = -VIEW_SECONDS
        self._lock = asyncio.Lock()

    async def refusal(
        self, ref: PartitionRef, running: int, attempt: int, *, ran_before: bool
    ) -> str | None:
        """Why this worker, running ``running`` drains, leaves the drain of ``ref`` to another
        worker (None: it takes it). ``attempt`` is the drain activity's; ``ran_before`` says
        whether an earlier attempt of it ran and heartbeated (then it is never refused: it
        waited for its heartbeat timeout already)."""
        if ran_before or attempt > MAX_REFUSALS:
            return None
        least = await self._least(ref)
        if least is None or running <= least:
            return None
        return (
            f"this worker runs {running} partition drains and another worker {least}: "
            "the task queue gives the drain to another worker"
        )

    async def give_back(self, ref: PartitionRef, running: int) -> str | None:
        """Why this worker, running ``running`` drains, ends the drain of ``ref`` early so
        that a less busy worker takes it (None: it keeps it). One drain at a time, at most
        once a view: the next view shows where the last one went."""
        least = await self._least(ref)
        if least is None or running < least + 2:
            return None
        if time.monotonic() - self._given_back_at < VIEW_SECONDS:
            return None
        self._given_back_at = time.monotonic()
        return f"this worker runs {running} partition drains and another worker {least}"

    async def _least(self, ref: PartitionRef) -> int | None:
        """The least busy other worker's drains; None when alone, or when Temporal does not
        answer soon (a drain goes on as if this worker were alone)."""
        try:
            view = await asyncio.wait_for(self.view(self._partition_ids(ref)), ANSWER_SECONDS)
        except TimeoutError:
            return None
        return min(view.values(), default=None)

    def _partition_ids(self, ref: PartitionRef) -> list[str]:
        return [
            PartitionRef(table, number, ref.partitions, ref.regions).workflow_id
            for table in self._tables
            for number in range(ref.partitions)
        ]

    async def view(self, partitions: list[str]) -> dict[str, int]:
        """The other workers and the drains each runs, read again if older than
        ``VIEW_SECONDS``; ``partitions`` are the workflow ids of the partitions to count."""
        async with self._lock:
            if time.monotonic() - self._read_at >= VIEW_SECONDS:
                self._read_at = time.monotonic()
                try:
                    self._view = await self._read(partitions)
                except RPCError as exc:  # the last view serves until Temporal answers again
                    log.debug("cannot read the task queue's workers: %s", exc)
            return self._view

    async def _read(self, partitions: list[str]) -> dict[str, int]:
        service = self._client.workflow_service
        answer = await service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self._client.namespace,
                task_queue=TaskQueue(name=self._task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        if all(poller.identity == self.identity for poller in answer.pollers):
            # No other worker polled in minutes (the task queue lists a poller that long), and a
            # worker polls while it has a free activity slot: no other runs a drain, and the
            # partitions need not be read.
            return {}
        seen_since = datetime.now(UTC) - timedelta(seconds=POLLER_SECONDS)
        others = {
            poller.identity: 0
            for poller in answer.pollers
            if poller.identity != self.identity
            and poller.last_access_time.ToDatetime(UTC) >= seen_since
        }
        for workflow_id in partitions:
            try:
                described = await self._client.get_workflow_handle(workflow_id).describe()
            except RPCError:
                continue  # not started yet, or gone: it runs no drain
            for pending in described.raw_description.pending_activities:
                runner = pending.last_worker_identity
                if (
                    pending.activity_type.name == "drain_partition"
                    and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                    and runner != self.identity
                ):
                    others[runner] = others.get(runner, 0) + 1
        return others
