"""What the active bridge looks after when partitions drain the healthy shards (on demand):

- every table has its ``OutboxPartition`` workflows running, with the current options, and no
  partition beyond the configured number keeps running;
- every held shard with rows has its ``OutboxShard`` workflow running (a workflow terminated
  by hand, a lost start, a namespace that was reset: the sweep starts it again), and a held
  shard that waits for a deferred head notices when an operator deleted that row or made it
  due earlier.

It asks Temporal's visibility once per sweep for the running shard workflows, and describes
only the few held shards that visibility does not list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

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

from outbox_bridge.db.store import HeldShard, read_held_shards
from outbox_bridge.db.timestamps import iso_utc
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import (
    STATUS_QUERY_TIMEOUT,
    WORKFLOW,
    ShardStarter,
    blocked_on_another_head,
    static_skip,
)
from outbox_bridge.workflows.models import (
    STATE_ATTRIBUTE,
    HeldFor,
    PartitionInput,
    PartitionOptions,
    PartitionRef,
    ShardRef,
    ShardState,
    ShardStatus,
    SkipInfo,
)

log = logging.getLogger("outbox_bridge.runtime.supervisor")

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
        task_queue: str,
        partitions: int,
        options: PartitionOptions,
        regions: Sequence[str] | None = None,
    ) -> None:
        self._app = app
        self._engine = engine
        self._client = client
        self._starter = starter
        self._task_queue = task_queue
        self._partitions = partitions
        self._options = options
        self._regions = tuple(sorted(regions)) if regions else None
        self._configured = False
        self.restarted = 0  # held shards whose workflow the sweep started again

    def partition_refs(self, table: str) -> list[PartitionRef]:
        return [
            PartitionRef(table, n, self._partitions, self._regions) for n in range(self._partitions)
        ]

    # -- partitions ----------------------------------------------------------------------------

    async def ensure_partitions(self) -> None:
        """Start the partition workflows that are not running (one idempotent RPC each, all at
        once: a worker's first rows wait for their partition's start). The first time, also
        hand the running ones the current options and retire the partitions beyond the
        configured number."""
        for table in self._app.tables:
            started = await asyncio.gather(
                *(self._start(ref) for ref in self.partition_refs(table))
            )
            if not all(started):
                return
            if not self._configured:
                await self._retire_extra(table)
        self._configured = True

    async def _start(self, ref: PartitionRef) -> bool:
        try:
            await self._client.start_workflow(
                PARTITION_WORKFLOW,
                PartitionInput(ref, self._options),
                id=ref.workflow_id,
                task_queue=self._task_queue,
                # The workflow's first task comes back with the answer when this process's
                # worker has room for it: about a tenth of a second sooner at start-up.
                request_eager_start=True,
            )
        except WorkflowAlreadyStartedError:
            if self._configured:
                return True
            # Running since an earlier worker: it gets this worker's options. (A partition
            # started here has them already; a signal would cost it a workflow task.)
            try:
                await self._client.get_workflow_handle(ref.workflow_id).signal(
                    "reconfigure", self._options
                )
            except RPCError as exc:
                log.warning("cannot reconfigure partition %s: %s", ref.workflow_id, exc.message)
                return False
        except RPCError as exc:
            log.warning("cannot start partition %s: %s", ref.workflow_id, exc.message)
            return False
        return True

    async def _retire_extra(self, table: str) -> None:
        wanted = {ref.workflow_id for ref in self.partition_refs(table)}
        prefix = f"outbox:{table}:partition:"
        query = (
            f"WorkflowType = '{PARTITION_WORKFLOW}' AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = '{_escaped(self._task_queue)}'"
        )
        try:
            async for execution in self._client.list_workflows(query):
                if execution.id.startswith(prefix) and execution.id not in wanted:
                    log.info(
                        "retiring partition %s (partitions: %s)", execution.id, self._partitions
                    )
                    await self._client.get_workflow_handle(execution.id).signal("retire")
        except RPCError as exc:
            log.warning("cannot list the partitions of %s: %s", table, exc.message)

    # -- held shards ------------------------------------------------------------------------------

    async def check_held(self, *, skipped_only: bool = False) -> None:
        """Start the workflow of every held shard that has rows and no running workflow (a
        skipped one skipped again), and wake a deferred one whose head is due now. With
        ``skipped_only`` (every shard with rows has its own workflow: the bridge's sweep
        starts the rest), only the skipped shards."""
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
            checks += [
                (self._ref(table, shard), shard)
                for shard in held
                if (not skipped_only or shard.held_for == HeldFor.SKIPPED)
                and shard.head is not None
                and self._wanted(shard)
            ]
        # At once, a few at a time: a status query may wait out its timeout (a workflow whose
        # task stays open while it drains answers no query), and one after another those held
        # up the restart of every shard after them. Shards with no running workflow first: they
        # are the ones nobody drains.
        checks.sort(key=lambda check: check[0].workflow_id in running)
        room = asyncio.Semaphore(CHECK_CONCURRENCY)

        async def check(ref: ShardRef, shard: HeldShard) -> None:
            async with room:
                await self._check(ref, shard, running)

        await asyncio.gather(*(check(ref, shard) for ref, shard in checks))

    def _wanted(self, shard: HeldShard) -> bool:
        return shard.region is None or self._regions is None or shard.region in self._regions

    async def _check(self, ref: ShardRef, shard: HeldShard, running: dict[str, str]) -> None:
        state = running.get(ref.workflow_id)
        if state is None:
            if await self._is_running(ref):
                return  # visibility lags behind: it has just started
            log.info(
                "shard %s is held for its workflow (%s since %s) but none runs; starting it",
                ref.key,
                shard.held_for,
                iso_utc(shard.since),
            )
            self.restarted += 1
            skip = None
            if shard.held_for == HeldFor.SKIPPED:
                # The table keeps the skip, not who took it or why: that was the workflow's,
                # unless the skip_shards setting lists the shard (a partition may hold a listed
                # shard and this sweep see it before the partition's handover starts it).
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
            status = await self._client.get_workflow_handle(ref.workflow_id).query(
                "status", result_type=ShardStatus, rpc_timeout=STATUS_QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
            log.warning("cannot query shard %s: %s", ref.key, exc)  # the next sweep asks again
            return False
        return blocked_on_another_head(status, shard.head)

    async def _is_running(self, ref: ShardRef) -> bool:
        try:
            description = await self._client.get_workflow_handle(ref.workflow_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning("cannot describe shard %s: %s", ref.key, exc.message)
                return True  # ask again next sweep
            return False
        return description.status == WorkflowExecutionStatus.RUNNING

    async def _running_shard_states(self) -> dict[str, str] | None:
        """Workflow id → OutboxState of every running shard workflow of this task queue."""
        query = (
            f"WorkflowType = '{WORKFLOW}' AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = '{_escaped(self._task_queue)}'"
        )
        states: dict[str, str] = {}
        try:
            async for execution in self._client.list_workflows(query):
                state = execution.typed_search_attributes.get(STATE_ATTRIBUTE)
                states[execution.id] = state or ShardState.DRAINING
        except RPCError as exc:
            log.warning("cannot list the running shard workflows: %s", exc.message)
            return None
        return states

    def _ref(self, table: str, shard: HeldShard) -> ShardRef:
        return ShardRef(
            table=table,
            scope=shard.scope,
            scope_name=self._app.scope_name(shard.scope),
            shard_identifier=shard.shard_identifier,
            region=shard.region,
        )


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")
