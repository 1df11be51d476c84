"""Stand-ins for the activities of the OutboxShard and OutboxPartition workflows, registered under
the real activity names, and a worker that runs the real workflows with them on the
time-skipping test server.

Each stand-in records its calls (with the attempt, the task queue and the server's time of the
attempt) and answers what the test scripted: a list of answers taken in order, then a default.
An answer that is an exception is raised; an answer that is :data:`WAIT` waits until the test
ends (the workflow cancels it, or never needs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.api.testservice.v1 import LockTimeSkippingRequest, UnlockTimeSkippingRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from outbox_bridge.workflows.models import (
    DrainInput,
    DrainResult,
    FlushCheck,
    FlushCheckInput,
    HandleHeadInput,
    HandleHeadResult,
    HandlerFailure,
    HeadGroup,
    HoldInput,
    PartitionDrainInput,
    PartitionRound,
    ShardOptions,
    ShardRef,
    flush_queue,
)
from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

T = TypeVar("T")


class _Wait:
    """The answer that waits until the test ends."""


WAIT = _Wait()

PROJECT_UPDATE = HeadGroup(
    category=2,
    category_name="PROJECT_UPDATE",
    object_identifier=5,
    first_id=11,
    last_id=13,
    rows=3,
)
REPLICA_DOWN = HandlerFailure("ReplicaUnavailable", "replica down")


def failing(failure: HandlerFailure = REPLICA_DOWN) -> ApplicationError:
    """What a category activity raises when the handler failed (as the real one does)."""
    return ApplicationError(failure.message, type=failure.error_type)


def options(**overrides: Any) -> ShardOptions:
    """Shard options with round figures, so that each test can tell its timers apart."""
    values: dict[str, Any] = {
        "initial_retry_seconds": 10.0,
        "max_retry_interval_seconds": 60.0,
        "handler_timeout_seconds": 300.0,
        "heartbeat_timeout_seconds": 30.0,
    }
    values.update(overrides)
    return ShardOptions(**values)


@dataclass
class Call(Generic[T]):
    """One attempt of an activity: its input, attempt number, task queue, and when it started
    (by the test server's clock: skipped time included)."""

    input: T
    attempt: int
    task_queue: str
    started: datetime
    name: str = ""


@dataclass
class Script(Generic[T]):
    """Answers of one activity: ``answers`` in order, then ``default`` for ever."""

    default: object
    answers: list[object] = field(default_factory=list)
    calls: list[Call[Any]] = field(default_factory=list)

    def next(self) -> object:
        return self.answers.pop(0) if self.answers else self.default


class Doubles:
    """The activities of both workflows, scripted per test."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.order: list[str] = []  # activity types, in the order their attempts started
        self.drains: Script[DrainInput] = Script(DrainResult())
        self.holds: Script[HoldInput] = Script(None)
        self.flush_checks: Script[FlushCheckInput] = Script(FlushCheck(handled=True))
        self.categories: Script[HandleHeadInput] = Script(HandleHeadResult(True, 1))
        self.rounds: Script[PartitionDrainInput] = Script(PartitionRound())

    async def _answer(self, script: Script[Any], request: object) -> Any:
        info = activity.info()
        self.order.append(info.activity_type)
        script.calls.append(
            Call(
                request,
                info.attempt,
                info.task_queue,
                info.started_time,
                info.activity_type,
            )
        )
        answer = script.next()
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, _Wait):
            await self.released.wait()
            raise ApplicationError("the test ended", non_retryable=True)
        return answer

    @activity.defn(name="drain_shard")
    async def drain_shard(self, request: DrainInput) -> DrainResult:
        result: DrainResult = await self._answer(self.drains, request)
        return result

    @activity.defn(name="hold_shard")
    async def hold_shard(self, request: HoldInput) -> None:
        await self._answer(self.holds, request)

    @activity.defn(name="flush_check")
    async def flush_check(self, request: FlushCheckInput) -> FlushCheck:
        result: FlushCheck = await self._answer(self.flush_checks, request)
        return result

    @activity.defn(dynamic=True)
    async def handle_category(self, args: Sequence[RawValue]) -> HandleHeadResult:
        request = activity.payload_converter().from_payload(args[0].payload, HandleHeadInput)
        result: HandleHeadResult = await self._answer(self.categories, request)
        return result

    @activity.defn(name="drain_partition")
    async def drain_partition(self, request: PartitionDrainInput) -> PartitionRound:
        result: PartitionRound = await self._answer(self.rounds, request)
        return result

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.drain_shard,
            self.hold_shard,
            self.flush_check,
            self.handle_category,
            self.drain_partition,
        ]


@dataclass
class Bench:
    """The real workflows on a task queue of the test's own, with the stand-ins."""

    env: WorkflowEnvironment
    task_queue: str
    doubles: Doubles
    handles: list[WorkflowHandle[Any, Any]] = field(default_factory=list)
    # A table of the test's own: no workflow id is shared with another test.
    shard: ShardRef = field(
        default_factory=lambda: ShardRef(f"t_{uuid.uuid4().hex[:10]}", 1, "ORGANIZATION", 7)
    )

    @property
    def client(self) -> Client:
        return self.env.client

    async def result(
        self, handle: WorkflowHandle[Any, Any], result_type: type[T], *, run_id: str | None = None
    ) -> T:
        """The workflow's result (following its continue-as-new runs, from ``run_id`` if given),
        time skipping while the test waits for it."""
        typed = self.client.get_workflow_handle(handle.id, run_id=run_id, result_type=result_type)
        service = self.client.test_service
        await service.unlock_time_skipping(UnlockTimeSkippingRequest())
        try:
            result: T = await typed.result()
        finally:
            await service.lock_time_skipping(LockTimeSkippingRequest())
        return result

    async def skip_time(self, seconds: float) -> None:
        """Let ``seconds`` of the server's time pass at once (timers and retries due meanwhile
        fire)."""
        await self.env.sleep(seconds)

    def track(self, workflow_id: str) -> WorkflowHandle[Any, Any]:
        """The workflow's handle; terminated when the test ends if it still runs."""
        handle = self.client.get_workflow_handle(workflow_id)
        self.handles.append(handle)
        return handle


@contextlib.asynccontextmanager
async def bench(env: WorkflowEnvironment) -> AsyncIterator[Bench]:
    """Run workers of the shard and partition workflows (and of the flush queue) until the
    block ends; then release waiting stand-ins and terminate what still runs, so that the next
    test starts on a quiet server."""
    doubles = Doubles()
    task_queue = f"wf-{uuid.uuid4().hex[:8]}"
    running = Bench(env, task_queue, doubles)
    workflows = Worker(
        env.client,
        task_queue=task_queue,
        workflows=[OutboxShard, OutboxPartition],
        activities=doubles.all(),
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    flushes = Worker(
        env.client, task_queue=flush_queue(task_queue), activities=[doubles.flush_check]
    )
    try:
        async with workflows, flushes:
            try:
                yield running
            finally:
                doubles.released.set()
                for handle in running.handles:
                    with contextlib.suppress(RPCError):
                        await handle.terminate("the test ended")
    finally:
        doubles.released.set()


async def events(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [event async for event in handle.fetch_history_events()]


def of_type(history: list[HistoryEvent], kind: EventType.ValueType) -> list[HistoryEvent]:
    return [event for event in history if event.event_type == kind]


async def current_details(handle: WorkflowHandle[Any, Any]) -> str:
    """The run's current details: what the UI shows on the workflow's first view."""
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return str(metadata.current_details)


async def summaries(
    client: Client, history: list[HistoryEvent], kind: EventType.ValueType
) -> list[str]:
    """The summaries the run gave its events of ``kind`` (what the UI labels them with)."""
    found = [e.user_metadata.summary for e in of_type(history, kind) if e.HasField("user_metadata")]
    return [str(s) for s in await client.data_converter.decode(found, [str] * len(found))]


def timers(history: list[HistoryEvent]) -> list[float]:
    """The durations of the timers the run started, in seconds."""
    return [
        event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for event in of_type(history, EventType.EVENT_TYPE_TIMER_STARTED)
    ]


def intervals(calls: list[Call[Any]]) -> list[float]:
    """Seconds between consecutive attempts, by the server's clock."""
    return [
        round((later.started - earlier.started).total_seconds())
        for earlier, later in itertools.pairwise(calls)
    ]
