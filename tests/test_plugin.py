"""OutboxPlugin: the outbox in a team's own Temporal worker, beside the team's workflow and
activity (tests/user_workflows.py), against the real PostgreSQL and Temporal dev server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.converter import DataConverter, PayloadCodec
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

from outbox_bridge import (
    ConfigurationError,
    MissingHandlerError,
    OutboxApp,
    OutboxPlugin,
    OutboxSettings,
)
from outbox_bridge.runtime.assembly import RunningOutbox
from outbox_bridge.workflows.models import PartitionRef
from tests.harness import (
    Category,
    Recorder,
    Servers,
    fresh_app,
    make_app,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.support import clear_settings, with_password
from tests.user_workflows import PLACE_ORDER, OrderPlaced, OrderWorkflow

# Short timers, by the settings' own names, as a team would pass them.
FAST: dict[str, Any] = {"poll_interval": 0.2, "sweep_interval": 1.5}


class Orders:
    """The team's activity: places an order, writing its outbox row in the same transaction."""

    def __init__(self, engine: AsyncEngine, app: OutboxApp) -> None:
        self.engine = engine
        self.app = app

    @activity.defn(name=PLACE_ORDER)
    async def place_order(self, order_id: int) -> int:
        async with self.engine.begin() as conn:
            return await self.app.write_async(
                conn,
                category=Category.ORGANIZATION_UPDATE,
                shard_identifier=order_id,
                object_identifier=order_id,
            )


class SeenActivities(Interceptor):
    """The team's worker interceptor: records the type of every activity it wraps."""

    def __init__(self) -> None:
        self.types: list[str] = []

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Seen(next, self.types)


class _Seen(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, types: list[str]) -> None:
        super().__init__(next)
        self._types = types

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        self._types.append(activity.info().activity_type)
        return await super().execute_activity(input)


WRAPPED = b"binary/team-wrapped"


class WrappingCodec(PayloadCodec):
    """The team's payload codec (as an encrypting one would): every payload wrapped in one of
    its own encoding, which Temporal's default converter cannot read."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [
            Payload(metadata={"encoding": WRAPPED}, data=p.SerializeToString()) for p in payloads
        ]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        decoded = []
        for payload in payloads:
            inner = Payload()
            inner.ParseFromString(payload.data)
            decoded.append(inner)
        return decoded


def named_url(database_url: str, name: str) -> str:
    """``database_url`` with PostgreSQL's application_name ``name``: the outbox's connections
    can then be counted in pg_stat_activity."""
    url = make_url(database_url).update_query_dict({"application_name": name})
    return url.render_as_string(hide_password=False)


async def connections_named(engine: AsyncEngine, name: str) -> int:
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"),
            {"name": name},
        )
        return int(found.scalar_one())


async def start_order(client: Client, queue: str, order_id: int) -> OrderPlaced:
    return await client.execute_workflow(
        OrderWorkflow.run, order_id, id=f"order-{uuid.uuid4().hex[:8]}", task_queue=queue
    )


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` until the block ends; then shut it down and raise what its run raised."""
    run = asyncio.create_task(worker.run())
    try:
        yield run
    finally:
        await asyncio.wait_for(worker.shutdown(), 60)
        assert run.done(), "shutdown() returned before the outbox had stopped"
        await run


async def terminate_queue(client: Client, queue: str) -> None:
    """End what the outbox left running on its task queue (its partition workflows)."""
    async for execution in client.list_workflows(
        f"ExecutionStatus = 'Running' AND TaskQueue = '{queue}'"
    ):
        with contextlib.suppress(Exception):
            await client.get_workflow_handle(execution.id).terminate("the test is over")


async def test_the_outbox_and_a_team_s_workflow_run_side_by_side_and_stop_cleanly(
    servers: Servers, engine: AsyncEngine, client: Client
) -> None:
    recorder, _table, app = await fresh_app(engine)
    name = f"plugin-{uuid.uuid4().hex[:8]}"
    team_queue, outbox_queue = f"orders-{name}", f"outbox-{name}"
    plugin = OutboxPlugin(
        app, database_url=named_url(servers.database_url, name), task_queue=outbox_queue, **FAST
    )
    worker = Worker(
        client,
        task_queue=team_queue,
        workflows=[OrderWorkflow],
        activities=[Orders(engine, app).place_order],
        plugins=[plugin],
    )
    try:
        async with running(worker):
            [written] = await write_rows(
                engine,
                app,
                [
                    {
                        "category": Category.PROJECT_UPDATE,
                        "shard_identifier": 1,
                        "object_identifier": 2,
                    }
                ],
            )
            placed = await asyncio.wait_for(start_order(client, team_queue, 42), 60)
            assert placed.sandboxed, "the team's workflow left Temporal's sandbox"
            await wait_until(
                lambda: {written, placed.row_id} <= set(recorder.ids()),
                what="the outbox to handle the row written directly and the activity's row",
            )
            await wait_until(lambda: table_empty(engine, app), what="the handled rows deleted")
            assert await connections_named(engine, name) > 0
        assert worker.is_shutdown
        # The bridge and the drains closed every connection they had.
        await wait_until(
            lambda: _none_left(engine, name), timeout=15, what="the outbox's connections closed"
        )
    finally:
        await terminate_queue(client, outbox_queue)


async def _none_left(engine: AsyncEngine, name: str) -> bool:
    return await connections_named(engine, name) == 0


async def test_the_team_s_converter_interceptors_and_sandbox_stay_on_the_team_s_side(
    servers: Servers, engine: AsyncEngine, client: Client
) -> None:
    recorder, table, app = await fresh_app(engine)
    suffix = uuid.uuid4().hex[:8]
    team_queue, outbox_queue = f"orders-{suffix}", f"outbox-{suffix}"
    team_client = Client(
        client.service_client,
        namespace=client.namespace,
        data_converter=dataclasses.replace(DataConverter.default, payload_codec=WrappingCodec()),
    )
    seen = SeenActivities()
    worker = Worker(
        team_client,
        task_queue=team_queue,
        workflows=[OrderWorkflow],
        activities=[Orders(engine, app).place_order],
        interceptors=[seen],
        plugins=[
            OutboxPlugin(
                app,
                database_url=servers.database_url,
                task_queue=outbox_queue,
                partitions=1,
                **FAST,
            )
        ],
    )
    try:
        async with running(worker):
            placed = await asyncio.wait_for(start_order(team_client, team_queue, 7), 60)
            await wait_until(lambda: placed.row_id in recorder.ids(), what="the row handled")
        assert placed.sandboxed
        # The team's interceptor wrapped the team's activity, none of the outbox's drains.
        assert seen.types == [PLACE_ORDER]
        # The team's workflows carry the team's encoding; the outbox's its own (Temporal's
        # default), which producers' flushes and the command line read.
        partition = PartitionRef(table, 0, 1).workflow_id
        assert await first_input_encoding(client, partition) == b"json/plain"
        description = await client.get_workflow_handle(partition).describe()
        assert description.task_queue == outbox_queue
        team_workflows = [e async for e in client.list_workflows(f"TaskQueue = '{team_queue}'")]
        assert [e.workflow_type for e in team_workflows] == ["OrderWorkflow"]
        assert await first_input_encoding(client, team_workflows[0].id) == WRAPPED
    finally:
        await terminate_queue(client, outbox_queue)


async def first_input_encoding(client: Client, workflow_id: str) -> bytes:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    return bytes(started.input.payloads[0].metadata["encoding"])


async def test_a_database_the_outbox_cannot_reach_stops_the_worker_and_says_why(
    servers: Servers, client: Client
) -> None:
    unreachable, password = with_password("postgresql://team@127.0.0.1:1/orders", "s3cret-pw")
    app = make_app(unique_table(), Recorder())
    worker = Worker(
        client,
        task_queue=f"orders-{uuid.uuid4().hex[:8]}",
        workflows=[OrderWorkflow],
        plugins=[OutboxPlugin(app, database_url=unreachable)],
    )
    with pytest.raises(
        ConfigurationError, match=r"cannot read the outbox tables. catalog"
    ) as raised:
        await asyncio.wait_for(worker.run(), 60)
    assert password not in str(raised.value)
    assert worker.is_shutdown  # a shutdown() after this returns at once, never hangs
    await asyncio.wait_for(worker.shutdown(), 5)


async def test_a_worker_on_the_outbox_s_task_queue_is_refused(client: Client) -> None:
    plugin = OutboxPlugin(
        make_app(unique_table(), Recorder()), database_url="postgresql://u@h/db", task_queue="ob"
    )
    for queue in ("ob", "ob.flush"):
        with pytest.raises(ConfigurationError, match=f"polls task queue '{queue}'"):
            Worker(client, task_queue=queue, workflows=[OrderWorkflow], plugins=[plugin])


# -- the plugin's arguments (no server) -------------------------------------------------------


@pytest.fixture
def no_settings_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


@pytest.mark.usefixtures("no_settings_in_env")
def test_settings_are_the_worker_s_by_name_with_its_defaults() -> None:
    plugin = OutboxPlugin(
        make_app(unique_table(), Recorder()),
        database_url="postgresql://u:pw@h/db",
        partitions=2,
        shutdown_grace=3,
    )
    defaults = OutboxSettings()
    assert plugin.settings.partitions == 2
    assert plugin.settings.shutdown_grace == 3
    assert plugin.settings.task_queue == defaults.task_queue == "outbox"
    assert plugin.settings.sweep_interval == defaults.sweep_interval
    assert plugin.name() == "outbox_bridge.OutboxPlugin"


@pytest.mark.usefixtures("no_settings_in_env")
def test_the_plugin_refuses_what_it_cannot_use() -> None:
    app = make_app(unique_table(), Recorder())
    url = "postgresql://u@h/db"
    with pytest.raises(ConfigurationError, match="database_url"):
        OutboxPlugin(app)
    with pytest.raises(TypeError, match=r"'partitons' .*did you mean partitions"):
        OutboxPlugin(app, database_url=url, partitons=2)
    with pytest.raises(ConfigurationError, match=r"temporal_namespace: .*your worker's client"):
        OutboxPlugin(app, database_url=url, temporal_namespace="orders")
    with pytest.raises(ConfigurationError, match="health_port: the health endpoints"):
        OutboxPlugin(app, database_url=url, health_port=8081)
    with pytest.raises(ConfigurationError, match="only PostgreSQL"):
        OutboxPlugin(app, database_url="mysql://u@h/db")
    with pytest.raises(TypeError, match="not both"):
        OutboxPlugin(app, settings=OutboxSettings(database_url=url), partitions=2)
    with pytest.raises(MissingHandlerError):
        OutboxPlugin(make_app(unique_table(), Recorder(), handle_all=False), database_url=url)


@pytest.mark.usefixtures("no_settings_in_env")
def test_the_environment_fills_in_what_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u@h/db")
    monkeypatch.setenv("OUTBOX_TASK_QUEUE", "outbox-orders")
    plugin = OutboxPlugin(make_app(unique_table(), Recorder()), task_queue="given")
    assert plugin.settings.task_queue == "given"
    assert plugin.settings.database_url is not None
    assert plugin.settings.database_url.get_secret_value() == "postgresql://u@h/db"


class CapturingPlugin(OutboxPlugin):
    """The plugin, handing the test the outbox it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: asyncio.Future[RunningOutbox] = asyncio.get_running_loop().create_future()

    @contextlib.asynccontextmanager
    async def running(self, client: Client) -> AsyncIterator[RunningOutbox]:
        async with super().running(client) as outbox:
            self.started.set_result(outbox)
            yield outbox


@pytest.mark.logs_errors  # the plugin logs why it stops the team's worker
@pytest.mark.parametrize("form", ["run", "async with"])
async def test_an_outbox_that_stops_on_its_own_stops_the_worker_and_says_why(
    servers: Servers, engine: AsyncEngine, client: Client, form: str
) -> None:
    _recorder, _table, app = await fresh_app(engine)
    outbox_queue = f"outbox-{uuid.uuid4().hex[:8]}"
    plugin = CapturingPlugin(
        app, database_url=servers.database_url, task_queue=outbox_queue, **FAST
    )
    worker = Worker(
        client,
        task_queue=f"orders-{uuid.uuid4().hex[:8]}",
        workflows=[OrderWorkflow],
        plugins=[plugin],
    )

    async def outbox_worker_ends() -> None:
        outbox = await asyncio.wait_for(plugin.started, 60)
        await outbox.worker.shutdown()  # as a fatal error ends it

    try:
        with pytest.raises(RuntimeError, match="the outbox worker stopped"):
            if form == "run":
                run = asyncio.create_task(worker.run())
                await outbox_worker_ends()
                await asyncio.wait_for(run, 60)
            else:
                async with worker:
                    await outbox_worker_ends()
                    await asyncio.sleep(60)  # cancelled when the worker stops
        assert worker.is_shutdown
    finally:
        await terminate_queue(client, outbox_queue)
