"""Run outbox-bridge: the bridge and the Temporal worker for an OutboxApp.

With nothing configured, starts an embedded PostgreSQL and a Temporal dev server under
``--data-dir``. Shuts down gracefully on SIGINT/SIGTERM. Wiring only: the behaviour lives in
``outbox_bridge``, ``workflows`` and ``activities``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import inspect
import logging
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from temporalio.client import Client
from temporalio.worker import Interceptor, UnsandboxedWorkflowRunner, Worker

import outbox_bridge
from outbox_bridge import demo
from outbox_bridge.activities import OutboxActivities
from outbox_bridge.config import OutboxSettings, libpq_url, safe_url, sqlalchemy_url
from outbox_bridge.db.schema import prepare_database
from outbox_bridge.db.timestamps import load_infinite_timestamps
from outbox_bridge.observability.health import HealthServer
from outbox_bridge.observability.sdk import setup_telemetry, temporal_runtime, tracing_interceptor
from outbox_bridge.observability.summary import LEGEND, SUMMARY_INTERVAL, WorkerSummary
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.bridge import Bridge, BridgeOptions
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.embedded import EmbeddedPostgres, EmbeddedTemporal, check_embedded
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.partition_drain import PartitionDrain
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.runtime.shard_drain import ShardDrainer
from outbox_bridge.runtime.shards import ShardStarter, static_skips
from outbox_bridge.runtime.shutdown import ShutdownGrace
from outbox_bridge.runtime.supervisor import PartitionSupervisor
from outbox_bridge.runtime.temporal import (
    connect,
    embedded_temporal,
    ensure_search_attributes,
    temporal_address,
)
from outbox_bridge.workflows import models as workflow_models
from outbox_bridge.workflows import partition as partition_workflow
from outbox_bridge.workflows import shard as shard_workflow
from outbox_bridge.workflows.models import PartitionDrainInput, PartitionRound, flush_queue
from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

log = logging.getLogger("outbox_bridge.worker")


def build_engine(url: str, settings: OutboxSettings) -> AsyncEngine:
    engine = create_async_engine(
        sqlalchemy_url(url),
        pool_size=settings.database_pool_size,
        max_overflow=5,
        pool_pre_ping=True,
    )
    load_infinite_timestamps(engine)  # a plain-SQL scheduled_for = 'infinity' must not fail drains
    return engine


@dataclass
class Drains:
    """The drains of one worker: its shard workflows' and its partitions', sharing one drain
    engine (and its knowledge of running handler calls) and one hub for the bridge's news."""

    engine: DrainEngine
    shards: ShardDrainer
    hub: ShardHub

    def close(self) -> None:
        self.shards.close()


def build_drains(engine: AsyncEngine, app: OutboxApp, settings: OutboxSettings) -> Drains:
    calls = HandlerCalls(
        app,
        redact_errors=settings.redact_errors,
        threads=settings.handler_threads,
        timeout=settings.handler_timeout,
    )
    drain_engine = DrainEngine(
        engine,
        app,
        calls=calls,
        redact_errors=settings.redact_errors,
        max_undeleted_groups=settings.max_undeleted_groups,
    )
    return Drains(drain_engine, ShardDrainer(drain_engine), ShardHub())


@functools.cache
def build_id() -> str:
    """The build id the workers report to Temporal: the package version and a digest of the
    workflow code (the only code the workers' workflow tasks run).

    Without one, the SDK computes a digest of every module loaded in the process, over a
    thousand in a worker: about a fifth of a second of each worker's start, before its first
    row could run.
    """
    digest = hashlib.sha256()
    for module in (workflow_models, partition_workflow, shard_workflow):
        try:
            digest.update(inspect.getsource(module).encode())
        except (OSError, TypeError):  # no source shipped: the version alone tells
            digest.update(module.__name__.encode())
    return f"outbox-bridge-{outbox_bridge.__version__}-{digest.hexdigest()[:12]}"


def build_worker(
    client: Client,
    settings: OutboxSettings,
    drains: Drains,
    *,
    skip_shards: frozenset[str] = frozenset(),
    interceptors: Sequence[Interceptor] = (),
) -> Worker:
    starter = ShardStarter(
        client,
        task_queue=settings.task_queue,
        options=settings.shard_options(),
        skip_shards=skip_shards,
    )

    async def drain_partition(
        request: PartitionDrainInput, heartbeat: Callable[[PartitionRound], None]
    ) -> PartitionRound:
        drain = PartitionDrain(drains.engine, starter, drains.hub, request, heartbeat=heartbeat)
        return await drain.run()

    tables = len(drains.engine.app.tables)
    return Worker(
        client,
        task_queue=settings.task_queue,
        interceptors=interceptors,
        workflows=[OutboxShard, OutboxPartition],
        build_id=build_id(),
        activities=OutboxActivities(drains.shards, drain_partition).all(),
        # The workflows are this library's code, never the user's, and the replay tests run
        # them under the sandbox too. Unsandboxed, a new shard run costs no module re-import
        # (a third of the worker's CPU on a backlog of new shards).
        workflow_runner=UnsandboxedWorkflowRunner(),
        # The partitions' lingering drains mostly wait: room for them beside the busy ones.
        max_concurrent_activities=settings.max_concurrent_activities + settings.partitions * tables,
        max_concurrent_local_activities=settings.max_concurrent_activities,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


def build_flush_worker(
    client: Client,
    settings: OutboxSettings,
    drains: Drains,
    *,
    interceptors: Sequence[Interceptor] = (),
) -> Worker:
    """The worker of the flush task queue: the activities that wait for a flush's rows, in
    slots of their own (a thousand waiting flushes never keep a drain from starting)."""
    activities = OutboxActivities(drains.shards, _no_partitions)
    return Worker(
        client,
        task_queue=flush_queue(settings.task_queue),
        interceptors=interceptors,
        activities=activities.flush(),
        build_id=build_id(),
        max_concurrent_activities=settings.max_concurrent_flushes,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


async def _no_partitions(
    request: PartitionDrainInput, heartbeat: Callable[[PartitionRound], None]
) -> PartitionRound:
    raise RuntimeError("the flush task queue drains no partition")


async def serve(
    settings: OutboxSettings,
    app: OutboxApp,
    *,
    stop: asyncio.Event,
    database_url: str,
    temporal_address: str,
    ready: asyncio.Event | None = None,
    summary: bool = False,
) -> None:
    """Create missing tables, then run the bridge and the worker until ``stop`` is set; with
    ``summary``, print a summary line every few seconds (:class:`WorkerSummary`)."""
    app.check_handlers()
    engine = build_engine(database_url, settings)
    drains = build_drains(engine, app, settings)
    hub = drains.hub
    health = HealthServer(settings, database_url=database_url, stop=stop)
    stack = contextlib.ExitStack()
    try:
        await health.start()
        await prepare_database(engine, app.metadata)
        client = await connect(
            settings,
            temporal_address,
            interceptors=[tracing_interceptor()],
            runtime=temporal_runtime(),  # the SDK's metrics, when metrics are on
        )
        await ensure_search_attributes(client)
        grace = ShutdownGrace(
            settings.shutdown_grace, calls_in_flight=drains.engine.calls_in_flight
        )
        skip_shards = static_skips(app, settings.skip_shards)
        worker = build_worker(
            client, settings, drains, skip_shards=skip_shards, interceptors=[grace]
        )
        starter = ShardStarter(
            client,
            task_queue=settings.task_queue,
            options=settings.shard_options(),
            skip_shards=skip_shards,
        )
        supervisor = PartitionSupervisor(
            app=app,
            engine=engine,
            client=client,
            starter=starter,
            task_queue=settings.task_queue,
            partitions=settings.partitions,
            options=settings.partition_options(skip_shards),
            regions=settings.regions,
        )
        bridge = Bridge(
            app=app,
            engine=engine,
            listen_url=libpq_url(sqlalchemy_url(database_url)),
            options=BridgeOptions(
                task_queue=settings.task_queue,
                sweep_interval=settings.sweep_interval,
                listen=settings.listen,
                regions=settings.regions,
            ),
            supervisor=supervisor,
            hub=hub,
        )
        flush_worker = build_flush_worker(client, settings, drains)
        health.attach(client=client, worker=worker, bridge=bridge)
        stack.enter_context(startup_objects_frozen())
        bridge_task = asyncio.create_task(bridge.run(stop), name="bridge")
        tasks = [
            asyncio.create_task(worker.run(), name="worker"),
            asyncio.create_task(flush_worker.run(), name="flush worker"),
            bridge_task,
        ]
        if settings.demo:
            traffic = demo.write_traffic(engine, stop, outage_seconds=settings.demo_outage)
            tasks.append(asyncio.create_task(traffic, name="demo"))
        if summary:
            view = WorkerSummary(
                app, engine, client, settings.task_queue, log_failures=settings.log_failures
            )
            tasks.append(asyncio.create_task(view.run(stop), name="summary"))
        announcer = asyncio.create_task(_announce(bridge.ready, ready))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        announcer.cancel()
        stop.set()
        hub.close()
        # The bridge only finds rows and starts or signals workflows: it stops now, not after
        # the sweep under way, whose status queries would time out one after another (seconds
        # each) once this worker stops answering them.
        bridge_task.cancel()
        await asyncio.gather(grace.stop(worker), flush_worker.shutdown())
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        stack.close()
        await health.close()
        drains.close()
        await engine.dispose()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Leave the objects that exist once the worker is up (modules, classes, the SDK's and
    SQLAlchemy's caches) out of the garbage collector's scans while the worker runs.

    They live as long as the worker, and a drain allocates fast (rows, messages, calls): each
    full collection scanned them all again, 1.2 of the worker's 9 CPU seconds in a backlog
    profile (0.4 with them frozen). Objects created later are collected as usual. A process
    that froze objects of its own before is left as it is (thawing at the end would thaw those
    too).
    """
    if gc.get_freeze_count():
        yield
        return
    # Not a full collection first: it would scan every object once more (a tenth of a second
    # in a process that holds a few hundred thousand), and what little garbage the old
    # generation holds at start is not worth it.
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _announce(bridge_ready: asyncio.Event, ready: asyncio.Event | None) -> None:
    await bridge_ready.wait()
    if ready is not None:
        ready.set()


def print_banner(
    settings: OutboxSettings,
    database_url: str,
    temporal_address: str,
    ui: str | None,
    summary: bool,
) -> None:
    lines = [
        "outbox-bridge is running (Ctrl-C to stop)",
        f"  database     {safe_url(sqlalchemy_url(database_url))}",
        f"  temporal     {temporal_address}, namespace {settings.temporal_namespace}, "
        f"task queue {settings.task_queue}",
    ]
    if ui:
        query = quote('WorkflowType="OutboxShard"')
        lines.append(
            f"  Temporal UI  {ui}/namespaces/{settings.temporal_namespace}/workflows?query={query}"
        )
        lines.append("  Look at the OutboxShard workflows: one per active shard, named")
        lines.append(
            "  outbox:<table>:<SCOPE>:<id>. Open one to see its state, the category activity"
        )
        lines.append("  of a blocked head, and its rows handled; signal `skip` to pause it.")
    if settings.demo:
        for line in demo.banner(settings, ui):
            lines.append(
                textwrap.fill(
                    line,
                    80,
                    initial_indent="  ",
                    subsequent_indent="    ",
                    break_long_words=False,  # a link stays whole
                    break_on_hyphens=False,
                )
            )
    if summary:
        legend = f"Every {SUMMARY_INTERVAL:g} s a line follows: {LEGEND}."
        lines.append(textwrap.fill(legend, 80, initial_indent="  ", subsequent_indent="  "))
    print("\n".join(lines), flush=True)


async def run(settings: OutboxSettings, app: OutboxApp) -> None:
    """Run ``app`` until SIGINT or SIGTERM, with embedded servers for what is not configured."""
    app.check_handlers()
    embedded = embedded_temporal(settings)  # no address, neither set nor in a Temporal profile
    check_embedded(postgres=settings.database_url is None, temporal=embedded)
    telemetry = setup_telemetry(settings)
    postgres: EmbeddedPostgres | None = None
    temporal: EmbeddedTemporal | None = None
    try:
        if settings.database_url is not None:
            database_url = settings.database_url.get_secret_value()
        else:
            postgres = EmbeddedPostgres(settings.data_dir / "postgres")
            database_url = await asyncio.to_thread(postgres.start)
        ui = None
        if not embedded:
            address = temporal_address(settings)
        else:
            temporal = EmbeddedTemporal(
                settings.data_dir / "temporal",
                port=settings.temporal_port,
                ui_port=settings.temporal_ui_port,
                namespace=settings.temporal_namespace,
            )
            address = await temporal.start()
            ui = f"http://localhost:{settings.temporal_ui_port}"
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        ready = asyncio.Event()
        # A person is watching: a terminal, or the demo.
        summary = settings.demo or sys.stdout.isatty()
        banner = asyncio.create_task(
            _banner_when_ready(ready, settings, database_url, address, ui, summary)
        )
        await serve(
            settings,
            app,
            stop=stop,
            database_url=database_url,
            temporal_address=address,
            ready=ready,
            summary=summary,
        )
        banner.cancel()
        log.info("outbox-bridge stopped")
    finally:
        if temporal is not None:
            temporal.stop()
        if postgres is not None:
            postgres.stop()
        telemetry.shutdown()  # the process leaves with os._exit: export what is held


async def _banner_when_ready(ready: asyncio.Event, *args: Any) -> None:
    await ready.wait()
    print_banner(*args)
