"""The partition share's view of the task queue (outbox_bridge.runtime.share), with a fake
client: a worker alone on its task queue reads the task queue's pollers and nothing else; with
another worker's pollers listed, it reads every partition's pending drain and counts the drains
each other worker runs. No server."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.taskqueue.v1 import PollerInfo
from temporalio.api.workflow.v1 import PendingActivityInfo
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueResponse,
    DescribeWorkflowExecutionResponse,
)

from outbox_bridge.runtime.share import PartitionShare
from outbox_bridge.workflows.models import PartitionRef

ME = "1@here"


def poller(identity: str, seconds_ago: float = 1.0) -> PollerInfo:
    stamp = Timestamp()
    stamp.FromDatetime(datetime.now(UTC) - timedelta(seconds=seconds_ago))
    return PollerInfo(identity=identity, last_access_time=stamp)


def drain_by(identity: str) -> PendingActivityInfo:
    info = PendingActivityInfo(
        last_worker_identity=identity, state=PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    )
    info.activity_type.name = "drain_partition"
    return info


@dataclass
class FakeClient:
    """What PartitionShare asks of a client: the task queue's pollers, and each partition
    workflow's pending activities (its drain, and the worker running it)."""

    pollers: list[PollerInfo]
    drains: dict[str, str]  # partition workflow id -> identity of the worker running its drain
    identity: str = ME
    namespace: str = "default"
    described: list[str] = field(default_factory=list)

    @property
    def workflow_service(self) -> Any:
        async def describe_task_queue(request: Any) -> DescribeTaskQueueResponse:
            return DescribeTaskQueueResponse(pollers=self.pollers)

        return SimpleNamespace(describe_task_queue=describe_task_queue)

    def get_workflow_handle(self, workflow_id: str) -> Any:
        async def describe() -> Any:
            self.described.append(workflow_id)
            runner = self.drains.get(workflow_id)
            raw = DescribeWorkflowExecutionResponse(
                pending_activities=[] if runner is None else [drain_by(runner)]
            )
            return SimpleNamespace(raw_description=raw)

        return SimpleNamespace(describe=describe)


def partition_ids(partitions: int = 4) -> list[str]:
    return [PartitionRef("outbox", n, partitions).workflow_id for n in range(partitions)]


async def test_a_worker_alone_on_its_task_queue_reads_no_partition() -> None:
    ids = partition_ids()
    client = FakeClient(pollers=[poller(ME)], drains=dict.fromkeys(ids, ME))
    share = PartitionShare(client, "q", ["outbox"])  # type: ignore[arg-type]
    assert await share.view(ids) == {}
    assert client.described == []
    ref = PartitionRef("outbox", 0, 4)
    assert await share.refusal(ref, running=4, attempt=1, ran_before=False) is None


async def test_with_another_worker_listed_every_partition_is_read_and_its_drains_counted() -> None:
    ids = partition_ids()
    other, idle, gone = "2@there", "3@there", "4@gone"
    drains = {ids[0]: ME, ids[1]: other, ids[2]: other, ids[3]: ME}
    pollers = [poller(ME), poller(other), poller(idle), poller(gone, seconds_ago=120)]
    client = FakeClient(pollers=pollers, drains=drains)
    share = PartitionShare(client, "q", ["outbox"])  # type: ignore[arg-type]
    # A worker that stopped polling long ago counts only while it runs a drain.
    assert await share.view(ids) == {other: 2, idle: 0}
    assert client.described == ids
    ref = PartitionRef("outbox", 0, 4)
    refusal = await share.refusal(ref, running=1, attempt=1, ran_before=False)
    assert refusal is not None and "another worker 0" in refusal
