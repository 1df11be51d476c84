"""The outbox's parts (drains, its two Temporal workers, the bridge) assembled on a Temporal
client, and their lifetime: :func:`run_outbox`, which :class:`OutboxPlugin` runs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Interceptor, UnsandboxedWorkflowRunner, Worker

import outbox_bridge
from outbox_bridge.activities.control import ControlActivities
from outbox_bridge.activities.outbox import OutboxActivities
from outbox_bridge.config import OutboxSettings, libpq_url, sqlalchemy_url
from outbox_bridge.db.disconnects import ping_idle_connections
from outbox_bridge.db.grants import Role, check_database
from outbox_bridge.db.timestamps import load_infinite_timestamps
from outbox_bridge.db.tls import refuse_tls_failures
from outbox_bridge.observability.sdk import tracing_interceptor
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.bridge import Bridge
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.local_retries import LocalRetries
from outbox_bridge.runtime.partition_drain import PartitionDrain, carried_round
from outbox_bridge.runtime.pause_control import PauseControl
from outbox_bridge.runtime.rate_limits import RateLimits
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.runtime.shard_drain import ShardDrainer
from outbox_bridge.runtime.shards import ShardStarter, static_skips
from outbox_bridge.runtime.share import PartitionShare
from outbox_bridge.runtime.shutdown import ShutdownGrace
from outbox_bridge.runtime.supervisor import PartitionSupervisor
from outbox_bridge.runtime.temporal import ensure_search_attributes, outbox_data_converter
from outbox_bridge.runtime.unhandled import UnhandledShards
from outbox_bridge.workflows import control as control_workflow
from outbox_bridge.workflows import models as workflow_models
from outbox_bridge.workflows import partition as partition_workflow
from outbox_bridge.workflows import shard as shard_workflow
from outbox_bridge.workflows.control import OutboxControl
from outbox_bridge.workflows.models import PartitionDrainInput, PartitionRound, flush_queue
from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

log = logging.getLogger(__name__)

# Seconds a worker whose run was cancelled from outside gets to end before it is cancelled again.
LET_GO_SECONDS = 5.0


def build_engine(url: str, settings: OutboxSettings) -> AsyncEngine:
    engine = create_async_engine(
        sqlalchemy_url(url),
        pool_size=settings.database_pool_size,
        max_overflow=5,
    )
    ping_idle_connections(engine)
    load_infinite_timestamps(engine)  # a plain-SQL scheduled_for = 'infinity' must not fail drains
    refuse_tls_failures(engine)
    return engine


@dataclass
class Drains:
    """One worker's drain engine, its shard workflows' drainer and the hub of the bridge's news."""

    engine: DrainEngine
    shards: ShardDrainer
    hub: ShardHub

    def close(self) -> None:
        self.engine.calls.close()


def build_drains(engine: AsyncEngine, app: OutboxApp, settings: OutboxSettings) -> Drains:
    calls = HandlerCalls(
        app,
        redact_errors=settings.redact_errors,
        threads=settings.handler_threads,
        timeout=settings.handler_timeout,
        max_calls=settings.max_concurrent_calls,
        max_payload_bytes=settings.max_payload_bytes,
        engine=engine,
        rates=RateLimits(app, engine),
    )
    drain_engine = DrainEngine(
        engine,
        app,
        calls=calls,
        max_undeleted_groups=settings.max_undeleted_groups,
    )
    return Drains(drain_engine, ShardDrainer(drain_engine), ShardHub())


@functools.cache
def build_id() -> str:
    """The package version and a digest of the workflow code. Without one, the SDK digests
    every module loaded (a fifth of a second of each worker's start)."""
    digest = hashlib.sha256()
    for module in (workflow_models, partition_workflow, shard_workflow, control_workflow):
        try:
            digest.update(inspect.getsource(module).encode())
        except (OSError, TypeError):  # no source shipped: the version alone tells
            digest.update(module.__name__.encode())
    return f"outbox-bridge-{outbox_bridge.__version__}-{digest.hexdigest()[:12]}"


def _starter(client: Client, settings: OutboxSettings, skip_shards: frozenset[str]) -> ShardStarter:
    return ShardStarter(
        client,
        task_queue=settings.task_queue,
        options=settings.shard_options(),
        skip_shards=skip_shards,
    )


def build_worker(
    client: Client,
    settings: OutboxSettings,
    drains: Drains,
    *,
    skip_shards: frozenset[str] = frozenset(),
    interceptors: Sequence[Interceptor] = (),
) -> Worker:
    starter = _starter(client, settings, skip_shards)
    share = PartitionShare(client, settings.task_queue, list(drains.engine.app.tables))
    unhandled = UnhandledShards(
        drains.engine.app, settings.max_unhandled_shards, drains.engine.engine, drains.hub
    )

    async def drain_partition(request: PartitionDrainInput) -> PartitionRound:
        info = activity.info()
        drain = PartitionDrain(
            drains.engine,
            starter,
            drains.hub,
            request,
            heartbeat=activity.heartbeat,
            share=share,
            attempt=info.attempt,
            carried=carried_round(info.heartbeat_details),
            unhandled=unhandled,
            retries=LocalRetries(starter.options, settings.handover_after),
        )
        return await drain.run()

    tables = len(drains.engine.app.tables)
    return Worker(
        client,
        task_queue=settings.task_queue,
        interceptors=interceptors,
        workflows=[OutboxShard, OutboxPartition, OutboxControl],
        build_id=build_id(),
        activities=OutboxActivities(drains.shards, drain_partition).all()
        + ControlActivities(PauseControl(drains.engine.app, drains.engine.engine)).all(),
        # The replay tests run the workflows sandboxed; unsandboxed, a new run re-imports nothing.
        workflow_runner=UnsandboxedWorkflowRunner(),
        # The partitions' lingering drains mostly wait: room for them beside the busy ones.
        max_concurrent_activities=settings.max_concurrent_activities + settings.partitions * tables,
        max_concurrent_local_activities=settings.max_concurrent_activities,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


def build_flush_worker(client: Client, settings: OutboxSettings, drains: Drains) -> Worker:
    """The worker of the flush queue: waiting flushes in slots of their own, never a drain's."""
    return Worker(
        client,
        task_queue=flush_queue(settings.task_queue),
        activities=[OutboxActivities(drains.shards).flush_check],
        build_id=build_id(),
        max_concurrent_activities=settings.max_concurrent_flushes,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


class RunningOutbox:
    """The outbox's workers and bridge, running from its creation (see :func:`run_outbox`)."""

    def __init__(self, settings: OutboxSettings, drains: Drains, client: Client) -> None:
        app, engine = drains.engine.app, drains.engine.engine
        self.engine = engine
        self.client = client
        self._drains = drains
        self._grace = ShutdownGrace(
            settings.shutdown_grace, calls_in_flight=drains.engine.calls_in_flight
        )
        skip_shards = static_skips(app, settings.skip_shards)
        self.worker = build_worker(
            client, settings, drains, skip_shards=skip_shards, interceptors=[self._grace]
        )
        self._flush_worker = build_flush_worker(client, settings, drains)
        supervisor = PartitionSupervisor(
            app=app,
            engine=engine,
            client=client,
            starter=_starter(client, settings, skip_shards),
            settings=settings,
            hub=drains.hub,
        )
        self.bridge = Bridge(
            app=app,
            engine=engine,
            listen_url=libpq_url(engine.url),
            settings=settings,
            supervisor=supervisor,
            hub=drains.hub,
        )
        self._stop = asyncio.Event()
        self._bridge_task = asyncio.create_task(self.bridge.run(self._stop), name="outbox bridge")
        self._tasks = [
            asyncio.create_task(self.worker.run(), name="outbox worker"),
            asyncio.create_task(self._flush_worker.run(), name="outbox flush worker"),
            self._bridge_task,
        ]

    async def until(self, stop: asyncio.Event) -> bool:
        """Return once ``stop`` is set or a worker or the bridge has stopped on its own;
        whether one has (:meth:`failure` says why)."""
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        return not stop.is_set()

    def failure(self) -> BaseException | None:
        """Why a part of the outbox stopped before it was asked to, if one did."""
        for task in self._tasks:
            if not task.done() or task.cancelled():  # cancelled: stopped, not failed
                continue
            error = task.exception()
            if error is not None:
                return error
            if not self._stop.is_set():
                return RuntimeError(f"the {task.get_name()} stopped")
        return None

    async def stop(self) -> BaseException | None:
        """Stop the bridge at once and the workers within the shutdown grace; returns
        :meth:`failure` as it was before stopping."""
        failure = self.failure()
        self._stop.set()
        self._drains.hub.close()
        # Now: its sweep's status queries would time out once this worker stops.
        self._bridge_task.cancel()
        workers = [task for task in self._tasks if task is not self._bridge_task]
        try:
            if any(task.cancelling() or task.cancelled() for task in workers):
                await self._let_go()
            else:
                await asyncio.gather(self._grace.stop(self.worker), self._flush_worker.shutdown())
                await asyncio.gather(*self._tasks, return_exceptions=True)
        except asyncio.CancelledError:
            await self._let_go()
            raise
        return failure

    async def _let_go(self) -> None:
        """The workers' runs were cancelled from outside (the SDK's shutdown may then wait
        forever): a few seconds each, then a second cancel."""
        _done, pending = await asyncio.wait(self._tasks, timeout=LET_GO_SECONDS)
        for task in pending:
            log.warning(
                "the %s had not stopped %g s after its cancel", task.get_name(), LET_GO_SECONDS
            )
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=LET_GO_SECONDS)
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: asyncio would report it again at exit


@contextlib.asynccontextmanager
async def run_outbox(
    app: OutboxApp, settings: OutboxSettings, client: Client
) -> AsyncIterator[RunningOutbox]:
    """Check the outbox tables (the schema is this version's, the role may change their rows:
    the worker runs no DDL), create the missing search attributes, then run the outbox's
    workers and bridge on ``client``'s connection until the block ends. Leaving stops them (with the
    shutdown grace) and raises what stopped a part early, if the block itself raised nothing."""
    database_url = settings.database_url
    assert database_url is not None, "the settings name no database"
    engine = build_engine(database_url.get_secret_value(), settings)
    drains = build_drains(engine, app, settings)
    try:
        await check_database(engine, app.metadata, Role.WORKER)
        # The client's connection and namespace with the outbox's own data converter (with the
        # payload_codec setting's codec) and interceptors: an application's converter, codec
        # and plugins stay on its own client.
        own = Client(
            client.service_client,
            namespace=client.namespace,
            data_converter=outbox_data_converter(settings),
            interceptors=[tracing_interceptor()],
        )
        await ensure_search_attributes(own)
        outbox = RunningOutbox(settings, drains, own)
        try:
            yield outbox
        except BaseException:
            failure = await outbox.stop()
            if failure is not None:
                log.error("the outbox had stopped before: %s", failure, exc_info=failure)
            raise
        failure = await outbox.stop()
        if failure is not None:
            raise failure
    finally:
        drains.close()
        await engine.dispose()
