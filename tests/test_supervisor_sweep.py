"""The sweep (``PartitionSupervisor``) with Temporal stood in for: a status query of a held
shard that waits out its timeout holds up no other shard's check, least of all the restart of a
held shard whose workflow is gone (the end-to-end case, a workflow terminated by hand, is in
tests/faults/test_handovers.py); and the partitions whose drains run in this worker are not
asked about."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge import OutboxApp, OutboxTable
from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.store import FirstRow, HeldShard
from outbox_bridge.runtime import supervisor as supervisor_module
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.supervisor import CHECK_CONCURRENCY, PartitionSupervisor
from outbox_bridge.workflows.models import (
    STATE_ATTRIBUTE,
    HeldFor,
    PartitionRef,
    ShardRef,
    ShardState,
)
from tests.harness import SCOPES, Category, Scope

TABLE = "sweep_outbox"


def held(shard: int) -> HeldShard:
    return HeldShard(
        region=None,
        scope=int(Scope.ORGANIZATION),
        shard_identifier=shard,
        held_for=HeldFor.FAILED,
        since=datetime(2026, 1, 1, tzinfo=UTC),
        head=FirstRow(
            id=shard, category=int(Category.PROJECT_UPDATE), object_identifier=1, due=True
        ),
    )


def workflow_id(shard: int) -> str:
    return ShardRef(TABLE, int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, shard).workflow_id


class Handle:
    def __init__(self, client: Client, workflow_id: str) -> None:
        self.client = client
        self.id = workflow_id

    async def describe(self) -> Any:
        if self.id in self.client.running:
            return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING)
        raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")

    async def query(self, *args: Any, **kwargs: Any) -> Any:
        # A workflow whose task stays open answers no query until the query times out.
        self.client.queried.append(self.id)
        await asyncio.Event().wait()


class Client:
    """Visibility lists the ``running`` workflows, blocked."""

    def __init__(self, running: list[str]) -> None:
        self.running = set(running)
        self.queried: list[str] = []
        self.started: list[str] = []

    async def list_workflows(self, query: str) -> AsyncIterator[Any]:
        for running in sorted(self.running):
            attributes = {STATE_ATTRIBUTE: ShardState.BLOCKED}
            yield SimpleNamespace(id=running, typed_search_attributes=attributes)

    def get_workflow_handle(self, workflow_id: str) -> Handle:
        return Handle(self, workflow_id)

    async def start_workflow(self, workflow: str, arg: Any, *, id: str, **options: Any) -> None:
        self.started.append(id)


class Starter:
    skip_shards: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.started: list[str] = []
        self.any_started = asyncio.Event()

    async def notify(self, ref: ShardRef, max_id: int, **kwargs: Any) -> None:
        self.started.append(ref.workflow_id)
        self.any_started.set()


class Engine:
    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[None]:
        yield None


async def test_a_status_query_that_waits_out_its_timeout_holds_up_no_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocked = [300 + n for n in range(3)]  # their workflows run; visibility says blocked
    gone = 400  # held for its workflow, which an operator terminated
    shards = [held(shard) for shard in [*blocked, gone]]

    async def read_held_shards(conn: Any, table: Any) -> list[HeldShard]:
        return shards

    monkeypatch.setattr(supervisor_module, "read_held_shards", read_held_shards)
    client = Client([workflow_id(shard) for shard in blocked])
    starter = Starter()
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(TABLE)])
    supervisor = PartitionSupervisor(
        app=app,
        engine=Engine(),  # type: ignore[arg-type]
        client=client,  # type: ignore[arg-type]
        starter=starter,  # type: ignore[arg-type]
        settings=OutboxSettings(task_queue="sweep", partitions=1),
        hub=ShardHub(),
    )
    sweep = asyncio.create_task(supervisor.check_held())
    try:
        await asyncio.wait_for(starter.any_started.wait(), timeout=5)
        # Every blocked shard's query is under way at once, none waited for the others.
        await asyncio.sleep(0.1)
        assert sorted(client.queried) == sorted(workflow_id(s) for s in blocked)
        assert len(blocked) < CHECK_CONCURRENCY
    finally:
        sweep.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweep
    assert starter.started == [workflow_id(gone)]
    assert supervisor.restarted == 1


async def test_the_sweep_asks_temporal_nothing_of_the_partitions_this_worker_drains() -> None:
    """Once the partitions are configured, a sweep starts (or finds running) only those whose
    drain does not run in this worker: a drain that runs here shows its workflow runs."""
    client = Client([])
    hub = ShardHub()
    supervisor = PartitionSupervisor(
        app=OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(TABLE)]),
        engine=Engine(),  # type: ignore[arg-type]
        client=client,  # type: ignore[arg-type]
        starter=Starter(),  # type: ignore[arg-type]
        settings=OutboxSettings(task_queue="sweep", partitions=3),
        hub=hub,
    )
    ids = [PartitionRef(TABLE, n, 3).workflow_id for n in range(3)]
    drain = hub.open_partition(TABLE, 1, 3)
    hub.open_partition(TABLE, 2, 5)  # a drain of another partition count: not partition 2 of 3
    await supervisor.ensure_partitions()  # the first sweep configures every partition
    assert client.started == ids
    client.started.clear()
    await supervisor.ensure_partitions()
    assert client.started == [ids[0], ids[2]]
    client.started.clear()
    hub.close_partition(drain)  # the drain ended (its workflow may be gone): checked again
    await supervisor.ensure_partitions()
    assert client.started == ids
