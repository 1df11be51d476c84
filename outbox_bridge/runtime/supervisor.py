"""What the active bridge repairs at every sweep, making Temporal match the table: every table
has its ``OutboxPartition`` workflows running on this worker's task queue with this worker's
options (reasserted at every sweep: options changed by a signal from elsewhere last one sweep at
most), and every shard held in ``<table>_owners`` that has rows has its ``OutboxShard``
workflow running, woken when its deferred or blocked head changed in the table.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.ownership import HeldShard, read_held_shards
from outbox_bridge.db.timestamps import iso_utc
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.hub import ShardHub, in_regions, shard_of
from outbox_bridge.runtime.shards import (
    STATUS_QUERY_TIMEOUT,
    WORKFLOW,
    ShardStarter,
    blocked_on_another_head,
    checked,
    static_skip,
    workflow_code_memo,
)
from outbox_bridge.runtime.temporal import task_queue_polled
from outbox_bridge.workflows.inputs import check_partition_options
from outbox_bridge.workflows.models import (
    STATE_ATTRIBUTE,
    HeldFor,
    PartitionInput,
    PartitionRef,
    PartitionStatus,
    ShardRef,
    ShardState,
    ShardStatus,
    SkipInfo,
)

log = logging.getLogger(__name__)

PARTITION_WORKFLOW = "OutboxPartition"
# Held shards a sweep checks at once (visibility, describe, start, status query).
CHECK_CONCURRENCY = 16


class PartitionSupervisor:
    def __init__(
        self,
        *,
        app: OutboxApp,
        engine: AsyncEngine,
        client: Client,
        starter: ShardStarter,
        settings: OutboxSettings,
        hub: ShardHub,
    ) -> None:
        self._app = app
        self._hub = hub
        self._engine = engine
        self.client = client
        self._starter = starter
        self._task_queue = settings.task_queue
        self._partitions = settings.partitions
        self._options = checked(
            check_partition_options,
            settings.partition_options(starter.skip_shards),
            "the partition options from the settings",
        )
        self._regions = tuple(sorted(settings.regions)) if settings.regions else None
        self._configured = False
        self.restarted = 0  # held shards whose workflow the sweep started again

    def partition_refs(self, table: str) -> list[PartitionRef]:
        return [
            PartitionRef(table, n, self._partitions, self._regions) for n in range(self._partitions)
        ]

    # -- partitions ----------------------------------------------------------------------------

    async def ensure_partitions(self) -> None:
        """Start the partition workflows that are not running, all at once, and give every
        one whose options differ from this worker's (its ``status`` says) these options. The
        first time, also retire those beyond the number."""
        for table in self._app.tables:
            refs = self.partition_refs(table)
            started = await asyncio.gather(
                *(self._start(ref) for ref in refs if not self._here(ref))
            )
            if not all(started):
                return
            await asyncio.gather(*(self._reassert(ref) for ref in refs))
            if not self._configured:
                await self._retire_extra(table)
        self._configured = True

    async def _reassert(self, ref: PartitionRef) -> None:
        """Signal ``reconfigure`` to the partition if it runs with other options than this
        worker's: a query (no history event) when they match, as they do but after a change
        made elsewhere (a signal by hand, a worker with other settings)."""
        handle = self.client.get_workflow_handle(ref.workflow_id)
        try:
            status: PartitionStatus = await handle.query(
                "status", result_type=PartitionStatus, rpc_timeout=STATUS_QUERY_TIMEOUT
            )
            if status.options == self._options:
                return
            log.warning(
                "partition %s runs with options other than this worker's (changed by a "
                "reconfigure signal from elsewhere, or a worker with other settings): "
                "reconfiguring it",
                ref.workflow_id,
            )
            await handle.signal("reconfigure", self._options)
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
            log.warning("cannot check the options of partition %s: %s", ref.workflow_id, exc)

    def _here(self, ref: PartitionRef) -> bool:
        """True once configured if this worker runs the drain of ``ref``: its workflow runs
        (were it gone, the drain's next heartbeat would end the drain, and the next sweep start
        it), so the sweep does not start it; it still checks its options."""
        return self._configured and self._hub.drains_partition(ref)

    async def _start(self, ref: PartitionRef) -> bool:
        try:
            await self.client.start_workflow(
                PARTITION_WORKFLOW,
                PartitionInput(ref, self._options),
                id=ref.workflow_id,
                task_queue=self._task_queue,
                memo=workflow_code_memo(),
                request_eager_start=True,  # its first task comes back with the answer
            )
        except WorkflowAlreadyStartedError:
            ours = await self._on_this_queue(ref.workflow_id, what="partition")
            if ours is None:
                return await self._start(ref)  # it runs no more: start it here
            return ours  # running: the sweep checks its options next
        except RPCError as exc:
            log.warning("cannot start partition %s: %s", ref.workflow_id, exc.message)
            return False
        return True

    async def _on_this_queue(self, workflow_id: str, *, what: str) -> bool | None:
        """True if ``workflow_id`` runs on this worker's task queue, False if that cannot be told
        now, None if it runs no more (one left on a queue that no worker polls is terminated).
        One that workers of another queue poll raises :class:`ConfigurationError`."""
        handle = self.client.get_workflow_handle(workflow_id)
        try:
            description = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            log.warning("cannot describe %s %s: %s", what, workflow_id, exc.message)
            return False
        queue = description.task_queue
        if description.status != WorkflowExecutionStatus.RUNNING:
            return None
        if queue == self._task_queue:
            return True
        try:
            polled = await task_queue_polled(self.client, queue, time.monotonic())
        except (RPCError, TimeoutError):
            polled = None
        if polled is not False:
            raise ConfigurationError(
                f"{what} {workflow_id} runs on task queue {queue!r}, which other workers poll, "
                f"and this worker's task queue is {self._task_queue!r}: two worker fleets with "
                "different task queues serve one table. Give every worker of this table the "
                "same OUTBOX_TASK_QUEUE (--task-queue), or stop the other fleet: this worker "
                "takes the table's workflows over once nobody polls that queue"
            )
        log.warning(
            "%s %s was left running on task queue %r, which no worker polls: ending it and "
            "starting it again on %r (a renamed task queue, or a server kept from an earlier "
            "setup)",
            what,
            workflow_id,
            queue,
            self._task_queue,
        )
        try:
            await handle.terminate(reason=f"taken over by task queue {self._task_queue}")
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning("cannot end %s %s: %s", what, workflow_id, exc.message)
                return False
        return None

    async def _retire_extra(self, table: str) -> None:
        wanted = {ref.workflow_id for ref in self.partition_refs(table)}
        prefix = f"outbox:{table}:partition:"
        try:
            async for execution in self.client.list_workflows(self._running(PARTITION_WORKFLOW)):
                if execution.id.startswith(prefix) and execution.id not in wanted:
                    log.info(
                        "retiring partition %s (partitions: %s)", execution.id, self._partitions
                    )
                    await self.client.get_workflow_handle(execution.id).signal("retire")
        except RPCError as exc:
            log.warning("cannot list the partitions of %s: %s", table, exc.message)

    # -- held shards ------------------------------------------------------------------------------

    async def check_held(self) -> None:
        """Start the workflow of every held shard that has rows and none running, and wake a
        deferred or blocked one whose head changed."""
        running = await self._running_shard_states()
        if running is None:
            return
        checks: list[tuple[ShardRef, HeldShard]] = []
        for table in self._app.tables:
            try:
                async with self._engine.connect() as conn:
                    held = await read_held_shards(conn, self._app.table(table))
            except SQLAlchemyError as exc:
                log.warning("cannot read the held shards of %s: %s", table, exc)
                continue
            for shard in held:
                if shard.head is not None and in_regions(shard.region, self._regions):
                    ref = shard_of(
                        self._app, table, shard.region, shard.scope, shard.shard_identifier
                    )
                    checks.append((ref, shard))
        # A few at a time (a status query may wait out its timeout); shards nobody drains first.
        checks.sort(key=lambda check: check[0].workflow_id in running)
        room = asyncio.Semaphore(CHECK_CONCURRENCY)

        async def check(ref: ShardRef, shard: HeldShard) -> None:
            async with room:
                await self._check(ref, shard, running)

        await asyncio.gather(*(check(ref, shard) for ref, shard in checks))

    async def _check(self, ref: ShardRef, shard: HeldShard, running: dict[str, str]) -> None:
        state = running.get(ref.workflow_id)
        if state is None:
            try:
                if await self._on_this_queue(ref.workflow_id, what="shard workflow") is not None:
                    return  # running here (visibility lags behind), or cannot tell now
            except ConfigurationError:
                return  # another fleet's: its partitions' check reports it
            log.info(
                "shard %s is held for its workflow (%s since %s) but none runs; starting it",
                ref.key,
                shard.held_for,
                iso_utc(shard.since),
            )
            self.restarted += 1
            skip = None
            if shard.held_for == HeldFor.SKIPPED:  # the table keeps the skip, not who or why
                skip = static_skip(ref, self._starter.skip_shards) or SkipInfo(
                    reason="skipped before its workflow ended (the skip is kept in the "
                    "owner table); resume the shard to drain it",
                    by="outbox-bridge",
                    at=iso_utc(shard.since),
                )
            await self._starter.notify(ref, 0, late=True, skip=skip)
        elif state == ShardState.DEFERRED and shard.head is not None and shard.head.due:
            log.info("shard %s waits for a deferred row, but its head is due: waking it", ref.key)
            await self._starter.notify(ref, 0, late=True)
        elif state == ShardState.BLOCKED and await self._head_changed(ref, shard):
            log.info("shard %s is blocked on a group that no longer heads it: waking it", ref.key)
            await self._starter.recheck(ref, "its head changed")

    async def _head_changed(self, ref: ShardRef, shard: HeldShard) -> bool:
        try:
            status = await self.client.get_workflow_handle(ref.workflow_id).query(
                "status", result_type=ShardStatus, rpc_timeout=STATUS_QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
            log.warning("cannot query shard %s: %s", ref.key, exc)  # the next sweep asks again
            return False
        return blocked_on_another_head(status, shard.head)

    async def _running_shard_states(self) -> dict[str, str] | None:
        """Workflow id → OutboxState of every running shard workflow of this task queue."""
        states: dict[str, str] = {}
        try:
            async for execution in self.client.list_workflows(self._running(WORKFLOW)):
                state = execution.typed_search_attributes.get(STATE_ATTRIBUTE)
                states[execution.id] = state or ShardState.DRAINING
        except RPCError as exc:
            log.warning("cannot list the running shard workflows: %s", exc.message)
            return None
        return states

    def _running(self, workflow_type: str) -> str:
        """The visibility query of the running workflows of ``workflow_type`` on this queue."""
        queue = self._task_queue.replace("\\", "\\\\").replace("'", "\\'")
        return (
            f"WorkflowType = '{workflow_type}' AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = '{queue}'"
        )
