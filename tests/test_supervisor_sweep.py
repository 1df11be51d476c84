"""The sweep (``PartitionSupervisor``) with Temporal stood in for: a status query of a held
shard that waits out its timeout holds up no other shard's check, least of all the restart of a
held shard whose workflow is gone (the end-to-end case, a workflow terminated by hand, is in
tests/faults/test_handovers.py); the partitions whose drains run in this worker are not started
again; and every partition running with other options than this worker's gets them again."""

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
from outbox_bridge.db.ownership import HeldShard
from outbox_bridge.db.scans import FirstRow
from outbox_bridge.runtime import supervisor as supervisor_module
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.supervisor import CHECK_CONCURRENCY, PartitionSupervisor
from outbox_bridge.workflows.models import (
    STATE_ATTRIBUTE,
    HeldFor,
    PartitionOptions,
    PartitionRef,
    PartitionStatus,
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
        self.client.queried.append(self.id)
        if self.client.options is not None:  # a partition's status: the options it runs with
            return PartitionStatus(partition=self.id, options=self.client.options.get(self.id))
        # A workflow whose task stays open answers no query until the query times out.
        await asyncio.Event().wait()

    async def signal(self, name: str, argument: Any) -> None:
        self.client.signalled.append((self.id, name, argument))


class Client:
    """Visibility lists the ``running`` workflows, blocked."""

    def __init__(self, running: list[str]) -> None:
        self.running = set(running)
        self.queried: list[str] = []
        self.started: list[str] = []
        self.signalled: list[tuple[str, str, Any]] = []
        # Partition workflow id -> the options its status query answers with.
        self.options: dict[str, PartitionOptions] | None = None

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


# The options a partition runs with, as this worker's settings give them.
WANTED = OutboxSettings(task_queue="sweep").partition_options()


def three_partitions() -> tuple[Client, list[str], ShardHub, PartitionSupervisor]:
    """A sweep of three partitions, each answering this worker's options to ``status``."""
    client = Client([])
    ids = [PartitionRef(TABLE, n, 3).workflow_id for n in range(3)]
    client.options = dict.fromkeys(ids, WANTED)
    hub = ShardHub()
    supervisor = PartitionSupervisor(
        app=OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(TABLE)]),
        engine=Engine(),  # type: ignore[arg-type]
        client=client,  # type: ignore[arg-type]
        starter=Starter(),  # type: ignore[arg-type]
        settings=OutboxSettings(task_queue="sweep", partitions=3),
        hub=hub,
    )
    return client, ids, hub, supervisor


async def test_the_sweep_starts_none_of_the_partitions_this_worker_drains() -> None:
    """Once the partitions are configured, a sweep starts (or finds running) only those whose
    drain does not run in this worker: a drain that runs here shows its workflow runs. Each
    answers the options it runs with, which are this worker's: nothing is signalled."""
    client, ids, hub, supervisor = three_partitions()
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
    assert client.queried == ids * 3 and client.signalled == []


async def test_a_partition_running_with_other_options_is_reconfigured_at_the_next_sweep() -> None:
    """A forged reconfigure lasts one sweep: the partition that answers other options than this
    worker's gets them again, the one whose drain runs here too; the others get no signal."""
    client, ids, hub, supervisor = three_partitions()
    hub.open_partition(TABLE, 1, 3)
    await supervisor.ensure_partitions()
    forged = PartitionOptions(max_shards=1, round_seconds=3600, poll_interval_seconds=86_400)
    client.options = {ids[0]: WANTED, ids[1]: forged, ids[2]: forged}
    await supervisor.ensure_partitions()
    assert client.signalled == [(ids[1], "reconfigure", WANTED), (ids[2], "reconfigure", WANTED)]
