"""Record shard workflow histories from real runs into tests/histories/.

    python -m tests.record_histories v7 [FOLDER]
    python -m tests.record_histories v7 --control [FOLDER]

Starts its own PostgreSQL and Temporal dev server, runs each scenario through the real worker,
and writes every run's history as ``<version>-<scenario>.json``, and the history of the
partition that handed the shard over as ``<version>-<scenario>_partition.json``. A shard gets
its workflow only when it needs attention, so each scenario makes it need some: a failing
handler, a deferred head, a skip or a flush. Record a new version after a deliberate change to
the workflow and keep the old files: replaying them is what proves the change is safe.
``--control`` records the OutboxControl workflow alone: a pause and an unpause update, and a
``refresh`` after a pause made from the command line; it never completes (it runs as long as
the worker), so its history is written while it waits. Existing files are never overwritten. ``FOLDER`` (tests/histories/ by default) lets a trial
recording go elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from outbox_bridge import OutboxApp, OutboxMessage, outbox_context
from outbox_bridge.db.pauses import add_pause
from outbox_bridge.flush import Flusher
from outbox_bridge.runtime.hub import partition_of
from outbox_bridge.runtime.shards import parse_shard
from outbox_bridge.workflows.models import (
    PartitionRef,
    PauseChange,
    PauseKind,
    PausesView,
    ResumeInput,
    ShardRef,
    ShardStatus,
    SkipInput,
)
from tests.harness import (
    Category,
    Recorder,
    Scope,
    Servers,
    create_tables,
    fast_settings,
    make_app,
    new_engine,
    running_worker,
    start_servers,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)

HISTORIES = Path(__file__).parent / "histories"
ROOT = Path(__file__).resolve().parents[1]


def row(category: Category, shard: int, obj: int, **extra: object) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


class Failing:
    """Fails the first ``times`` calls of its category."""

    def __init__(self, times: int) -> None:
        self.times = times

    async def __call__(self, message: OutboxMessage) -> None:
        if self.times > 0:
            self.times -= 1
            raise ConnectionError("replica unavailable")


class FailingFirstCall:
    """Fails the first call of each object: every group of its category is handed over, or
    becomes the head its shard's workflow retries."""

    def __init__(self) -> None:
        self.failed: set[int] = set()

    async def __call__(self, message: OutboxMessage) -> None:
        if message.object_identifier not in self.failed:
            self.failed.add(message.object_identifier)
            raise ConnectionError("replica unavailable")


async def scenario_drain(
    app: OutboxApp, recorder: Recorder, client: Client, engine, settings
) -> None:
    """The head fails once, so the partition hands the shard over; its workflow retries the
    head, then drains the groups behind it a few at a time and gives the shard back."""
    recorder.behaviour[Category.PROJECT_UPDATE] = Failing(1)
    await write_rows(
        engine,
        app,
        [row(Category.PROJECT_UPDATE, 1, 0)]
        + [row(Category.MEMBER_UPDATE, 1, i % 4) for i in range(8)]
        + [row(Category.ORGANIZATION_UPDATE, 1, 1)],
    )
    await wait_until(lambda: table_empty(engine, app))


async def scenario_failing_then_succeeding(app, recorder, client, engine, settings) -> None:
    recorder.behaviour[Category.PROJECT_UPDATE] = Failing(4)
    await write_rows(
        engine, app, [row(Category.PROJECT_UPDATE, 1, 1), row(Category.MEMBER_UPDATE, 1, 2)]
    )
    await wait_until(lambda: table_empty(engine, app))


async def scenario_skip_resume(app, recorder, client, engine, settings) -> None:
    failing = Failing(10_000)
    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
    handle = client.get_workflow_handle(f"outbox:{app.table().name}:ORGANIZATION:1")

    async def state_is(state: str) -> bool:
        try:
            shown: ShardStatus = await handle.query("status", result_type=ShardStatus)
            return shown.state == state
        except RPCError:
            return False

    await wait_until(lambda: state_is("blocked"))
    await asyncio.sleep(1)
    await handle.signal("skip", SkipInput(reason="deploying a fix", by="recorder"))
    await wait_until(lambda: state_is("skipped"))
    failing.times = 0
    await handle.signal("resume", ResumeInput(by="recorder"))
    await wait_until(lambda: table_empty(engine, app))


async def scenario_deferred(app, recorder, client, engine, settings) -> None:
    """The head fails once (a handover); after it, the workflow's drain finds a deferred row,
    waits for it on a timer, and drains the rest."""
    from datetime import timedelta

    recorder.behaviour[Category.PROJECT_UPDATE] = Failing(1)
    await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 1),
            row(Category.ORGANIZATION_UPDATE, 1, 1, scheduled_for=timedelta(seconds=4)),
            row(Category.MEMBER_UPDATE, 1, 2),
        ],
    )
    await wait_until(lambda: table_empty(engine, app))


async def scenario_continue_as_new(app, recorder, client, engine, settings) -> None:
    """A blocked shard keeps receiving flushed rows (each flush an update, answered
    ``blocked``) and continues as new while blocked, carrying its head and backoff; then the
    head succeeds and the workflow drains everything."""
    failing = Failing(10_000)
    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
    shard = parse_shard("ORGANIZATION:1", app)
    handle = client.get_workflow_handle(shard.workflow_id)

    async def blocked() -> bool:
        try:
            shown: ShardStatus = await handle.query("status", result_type=ShardStatus)
        except RPCError:
            return False
        return shown.state == "blocked"

    async def runs() -> int:
        return len([w async for w in client.list_workflows(f'WorkflowId = "{handle.id}"')])

    await wait_until(blocked)
    flusher = Flusher(app, settings, client=client)
    for i in range(200):
        [new] = await write_rows(engine, app, [row(Category.MEMBER_UPDATE, 1, 100 + i)])
        [answer] = await flusher.flush({shard: new}, timeout=10)
        assert answer.outcome == "blocked", answer
        if i % 10 == 9 and await runs() >= 3:
            break
    await wait_until(lambda: _at_least(runs(), 3), what="continues-as-new while blocked")
    failing.times = 0
    await wait_until(lambda: table_empty(engine, app))


async def scenario_flush(app, recorder, client, engine, settings) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    async def slow(message: OutboxMessage) -> None:
        await asyncio.sleep(0.5)

    recorder.behaviour[Category.PROJECT_UPDATE] = slow
    app.configure_flush(settings)
    async with AsyncSession(engine) as session:
        async with outbox_context(session, flush=True) as outbox:
            for i in range(3):
                await app.write_async(
                    session,
                    category=Category.PROJECT_UPDATE,
                    shard_identifier=1,
                    object_identifier=i,
                )
            await session.commit()
    assert outbox.report.handled, outbox.report


async def scenario_handover_failed(app, recorder, client, engine, settings) -> None:
    """A partition hands the failing shard over; its workflow retries the head, then its own
    drain fails on the next group, which it retries in turn, drains the rest and gives the
    shard back."""
    recorder.behaviour[Category.PROJECT_UPDATE] = FailingFirstCall()
    await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 1),
            row(Category.PROJECT_UPDATE, 1, 2),
            row(Category.MEMBER_UPDATE, 1, 3),
        ],
    )
    await wait_until(lambda: table_empty(engine, app))


async def scenario_handover_deferred(app, recorder, client, engine, settings) -> None:
    from datetime import timedelta

    await write_rows(
        engine,
        app,
        [
            row(Category.ORGANIZATION_UPDATE, 1, 1, scheduled_for=timedelta(seconds=2)),
            row(Category.PROJECT_UPDATE, 1, 2),
        ],
    )
    await wait_until(lambda: table_empty(engine, app))


async def scenario_skip_healthy(app, recorder, client, engine, settings) -> None:
    """An operator skips a shard a partition drains (update-with-start), rows
    arrive and stay, the shard is resumed and drained by its workflow, which gives it back."""
    from temporalio.client import WithStartWorkflowOperation
    from temporalio.common import WorkflowIDConflictPolicy

    from outbox_bridge.runtime.shards import WORKFLOW, start_arguments

    shard = parse_shard("ORGANIZATION:1", app)
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        WORKFLOW,
        **start_arguments(shard, settings.shard_options(), settings.task_queue, max_id=0),
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    await client.execute_update_with_start_workflow(
        "skip",
        SkipInput(reason="deploying a fix", by="recorder"),
        start_workflow_operation=start,
        result_type=ShardStatus,
    )
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 1, 1)])
    await asyncio.sleep(1.0)
    await client.get_workflow_handle(shard.workflow_id).execute_update(
        "resume", ResumeInput(by="recorder"), result_type=ShardStatus
    )
    await wait_until(lambda: table_empty(engine, app))


async def _at_least(value: Awaitable[int], minimum: int) -> bool:
    return (await value) >= minimum


Scenario = Callable[..., Awaitable[None]]
SCENARIOS: dict[str, tuple[Scenario, dict[str, object]]] = {
    "drain": (scenario_drain, {"drain_max_groups": 2}),
    "failing_then_succeeding": (scenario_failing_then_succeeding, {}),
    "skip_resume": (scenario_skip_resume, {}),
    "deferred": (scenario_deferred, {}),
    "continue_as_new": (scenario_continue_as_new, {"max_history_events": 100}),
    "flush": (scenario_flush, {}),
    "handover_failed": (scenario_handover_failed, {}),
    "handover_deferred": (scenario_handover_deferred, {}),
    "skip_healthy": (scenario_skip_healthy, {}),
}


async def record(
    servers: Servers,
    folder: Path,
    version: str,
    name: str,
    scenario: Scenario,
    overrides: dict[str, object],
) -> list[Path]:
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    engine = new_engine(servers)
    client = await Client.connect(servers.temporal_address)
    await create_tables(engine, app)
    settings = fast_settings(temporal_address=servers.temporal_address, **overrides)
    workflow_id = f"outbox:{app.table().name}:{Scope.ORGANIZATION.name}:1"
    key = ShardRef(app.table().name, int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, 1)
    partition = PartitionRef(
        app.table().name, partition_of(key, settings.partitions), settings.partitions
    )
    async with running_worker(servers, app, settings):
        await scenario(app, recorder, client, engine, settings)
        await wait_until(lambda: _completed(client, workflow_id), what=f"{name} to complete")
        # The partition that handed the shard over: retired, so that its history is complete
        # (the bridge's next sweep starts a new run of it, which is not recorded).
        handle = client.get_workflow_handle(partition.workflow_id)
        run = (await handle.describe()).run_id
        await handle.signal("retire")
        await wait_until(
            lambda: _completed(client, partition.workflow_id, run),
            what="the partition to retire",
        )
    await engine.dispose()
    written = await _write_runs(client, workflow_id, folder / f"{version}-{name}")
    written += await _write_runs(
        client, partition.workflow_id, folder / f"{version}-{name}_partition"
    )
    return written


async def record_control(servers: Servers, folder: Path, version: str) -> Path:
    """The history of a table's OutboxControl workflow: started by the bridge, a pause and an
    unpause update, and a refresh after a pause written straight to the table."""
    app = make_app(unique_table(), Recorder())
    engine = new_engine(servers)
    client = await Client.connect(servers.temporal_address)
    await create_tables(engine, app)
    settings = fast_settings(temporal_address=servers.temporal_address)
    handle = client.get_workflow_handle(f"outbox:{app.table().name}:control")

    async def shows(count: int) -> bool:
        try:
            view = await handle.query("pauses", result_type=PausesView)
        except RPCError:
            return False
        return len(view.pauses) == count

    async with running_worker(servers, app, settings):
        await wait_until(lambda: shows(0), what="the control workflow")
        change = PauseChange(category="PROJECT_UPDATE", reason="search is down", by="ann")
        await handle.execute_update("pause", change, result_type=PausesView)
        async with engine.begin() as conn:
            await add_pause(conn, app.table(), PauseKind.SCOPE, int(Scope.USER), "gdpr", "bob")
        await wait_until(lambda: shows(2), what="the refresh")
        await handle.execute_update(
            "unpause", PauseChange(category="PROJECT_UPDATE"), result_type=PausesView
        )
        await wait_until(lambda: shows(1), what="the unpause")
        history = await handle.fetch_history()
    await engine.dispose()
    path = folder / f"{version}-control_pauses.json"
    if path.exists():
        raise SystemExit(f"{path} exists: record under a new version instead")
    path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
    return path


async def _completed(client: Client, workflow_id: str, run_id: str | None = None) -> bool:
    description = await client.get_workflow_handle(workflow_id, run_id=run_id).describe()
    return description.status == WorkflowExecutionStatus.COMPLETED


async def _write_runs(client: Client, workflow_id: str, stem: Path) -> list[Path]:
    runs = sorted(
        [
            w
            async for w in client.list_workflows(f'WorkflowId = "{workflow_id}"')
            if w.status != WorkflowExecutionStatus.RUNNING
        ],
        key=lambda w: w.start_time,
    )
    written = []
    for index, run in enumerate(runs):
        history = await client.get_workflow_handle(workflow_id, run_id=run.run_id).fetch_history()
        suffix = f"_run{index + 1}" if len(runs) > 1 else ""
        path = stem.with_name(f"{stem.name}{suffix}.json")
        if path.exists():
            raise SystemExit(f"{path} exists: record under a new version instead")
        text = json.dumps(json.loads(history.to_json()), indent=1) + "\n"
        # Failure stack traces name this machine's paths: keep them relative to the project.
        path.write_text(text.replace(f"{ROOT}/", "").replace(f"{sys.prefix}/", ""))
        written.append(path)
    return written


async def main(version: str, folder: Path = HISTORIES, *, control: bool = False) -> None:
    folder.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as base:
        servers = await start_servers(Path(base))
        try:
            if control:
                print(f"recorded {await record_control(servers, folder, version)}")
                return
            for name, (scenario, overrides) in SCENARIOS.items():
                for path in await record(servers, folder, version, name, scenario, overrides):
                    print(f"recorded {path}")
        finally:
            servers.temporal.stop()
            if servers.postgres is not None:
                servers.postgres.stop()


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--control"]
    if len(arguments) not in (1, 2):
        raise SystemExit(
            "usage: python -m tests.record_histories VERSION [--control] [FOLDER]  (e.g. v7)"
        )
    folders = [Path(folder) for folder in arguments[1:]]
    asyncio.run(main(arguments[0], *folders, control="--control" in sys.argv))
