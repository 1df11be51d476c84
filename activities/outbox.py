"""Activities of the OutboxPartition and OutboxShard workflows: ``drain_partition`` (the healthy
path), ``drain_shard``, ``hold_shard``, ``flush_check``, and the *category activity* of a blocked
shard, whose type is the category's name (for example ``PROJECT_UPDATE``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from temporalio import activity
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from outbox_bridge.observability.logs import log_context
from outbox_bridge.runtime.calls import HandlerFailed
from outbox_bridge.runtime.senders import skip_sender
from outbox_bridge.runtime.shard_drain import ShardDrainer
from outbox_bridge.workflows.models import (
    DrainInput,
    DrainResult,
    FlushCheck,
    FlushCheckInput,
    HandleHeadInput,
    HandleHeadResult,
    HoldInput,
    PartitionDrainInput,
    PartitionRound,
)

# Runs one partition's drain for a while, heartbeating what it does: request -> what it did.
PartitionDrainer = Callable[[PartitionDrainInput], Awaitable[PartitionRound]]


class OutboxActivities:
    """Activity implementations bound to one :class:`ShardDrainer` and, for
    ``drain_partition``, one ``PartitionDrainer`` (none in the flush queue's worker)."""

    def __init__(self, drainer: ShardDrainer, partitions: PartitionDrainer | None = None) -> None:
        self._drainer = drainer
        self._partitions = partitions

    @activity.defn(name="drain_partition")
    async def drain_partition(self, request: PartitionDrainInput) -> PartitionRound:
        """Drain the partition's healthy shards for ``round_seconds``, heartbeating what it
        does (the Temporal UI shows it as the pending activity's details)."""
        assert self._partitions is not None, "the flush task queue drains no partition"
        with log_context(shard=request.partition.workflow_id):
            return await self._partitions(request)

    @activity.defn(name="drain_shard")
    async def drain_shard(self, request: DrainInput) -> DrainResult:
        """Hold the shard for its workflow, handle head groups in order, give it back if empty."""
        with log_context(shard=request.shard.key):
            return await self._drainer.drain(request)

    @activity.defn(name="hold_shard")
    async def hold_shard(self, request: HoldInput) -> str | None:
        """Skip the shard in the owner table, or take it back from a skip. Held for a skip: the
        skip's sender as Temporal recorded it (``temporal:<identity>``), if found."""
        with log_context(shard=request.shard.key):
            await self._drainer.hold(request)
            return None if request.skip is None else await skip_sender(request.skip)

    @activity.defn(name="flush_check")
    async def flush_check(self, request: FlushCheckInput) -> FlushCheck:
        """Run by the ``flush`` update: wait until no row up to ``up_to_id`` is pending, or
        the head of those rows is deferred, for at most ``timeout_seconds``."""
        with log_context(shard=request.shard.key):
            return await self._drainer.wait_handled(request)

    @activity.defn(dynamic=True)
    async def handle_category(self, args: Sequence[RawValue]) -> HandleHeadResult:
        """Any activity type not registered otherwise is a category activity."""
        if len(args) != 1:
            raise ApplicationError(
                f"a category activity takes one HandleHeadInput, got {len(args)} arguments",
                type="InvalidActivityInput",
            )
        request = activity.payload_converter().from_payload(args[0].payload, HandleHeadInput)
        # The activity's type is the category's name.
        with log_context(shard=request.shard.key, category=activity.info().activity_type):
            async with _heartbeating():
                try:
                    return await self._drainer.handle_head(request, attempt=activity.info().attempt)
                except HandlerFailed as failed:
                    raise ApplicationError(
                        failed.failure.message or failed.failure.error_type,
                        type=failed.failure.error_type,
                    ) from None

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.drain_partition,
            self.drain_shard,
            self.hold_shard,
            self.flush_check,
            self.handle_category,
        ]


@contextlib.asynccontextmanager
async def _heartbeating() -> AsyncIterator[None]:
    """Heartbeat while a handler runs: the attempt learns of a skip, the server of a dead worker."""
    info = activity.info()
    timeout = info.heartbeat_timeout.total_seconds() if info.heartbeat_timeout else 30.0
    interval = max(0.5, timeout / 3)

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(interval)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
