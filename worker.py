"""Run outbox-bridge: the bridge and the Temporal worker for an OutboxApp.

With nothing configured, starts an embedded PostgreSQL and a Temporal dev server under
``--data-dir``. Shuts down gracefully on SIGINT/SIGTERM. Wiring only: the behaviour lives in
``outbox_bridge``, ``workflows`` and ``activities``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import click
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from temporalio.client import Client
from temporalio.worker import Interceptor, UnsandboxedWorkflowRunner, Worker

from activities import OutboxActivities
from outbox_bridge import demo
from outbox_bridge.bridge import Bridge, BridgeOptions
from outbox_bridge.config import OutboxSettings, libpq_url, safe_url, sqlalchemy_url
from outbox_bridge.drain import ShardDrainer
from outbox_bridge.embedded import EmbeddedPostgres, EmbeddedTemporal
from outbox_bridge.errors import OutboxError
from outbox_bridge.flags import build_settings, settings_options
from outbox_bridge.health import HealthServer
from outbox_bridge.hub import ShardHub
from outbox_bridge.logs import configure_logging
from outbox_bridge.metrics import setup_metrics, temporal_runtime
from outbox_bridge.registry import OutboxApp, app_from_settings
from outbox_bridge.schema import prepare_database
from outbox_bridge.shards import static_skips
from outbox_bridge.shutdown import ShutdownGrace
from outbox_bridge.telemetry import setup_tracing, tracing_interceptor
from outbox_bridge.temporal import connect, ensure_search_attributes
from outbox_bridge.timestamps import load_infinite_timestamps
from workflows.shard import OutboxShard

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


def build_worker(
    client: Client,
    settings: OutboxSettings,
    drainer: ShardDrainer,
    *,
    interceptors: Sequence[Interceptor] = (),
) -> Worker:
    return Worker(
        client,
        task_queue=settings.task_queue,
        interceptors=interceptors,
        workflows=[OutboxShard],
        activities=OutboxActivities(drainer).all(),
        # The shard workflow is this library's code, never the user's, and the replay tests
        # run it under the sandbox too. Unsandboxed, a new shard run costs no module re-import
        # (a third of the worker's CPU on a backlog of new shards).
        workflow_runner=UnsandboxedWorkflowRunner(),
        # Lingering drains mostly wait; leave room for them beside the busy ones.
        max_concurrent_activities=settings.max_concurrent_activities + settings.linger_max_shards,
        max_concurrent_local_activities=settings.max_concurrent_activities,
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace),
    )


async def serve(
    settings: OutboxSettings,
    app: OutboxApp,
    *,
    stop: asyncio.Event,
    database_url: str,
    temporal_address: str,
    ready: asyncio.Event | None = None,
) -> None:
    """Create missing tables, then run the bridge and the worker until ``stop`` is set."""
    app.check_handlers()
    engine = build_engine(database_url, settings)
    hub = ShardHub()
    drainer = ShardDrainer(
        engine,
        app,
        redact_errors=settings.redact_errors,
        handler_threads=settings.handler_threads,
        hub=hub,
        max_lingering=settings.linger_max_shards,
    )
    health = HealthServer(settings, database_url=database_url, stop=stop)
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
        grace = ShutdownGrace(settings.shutdown_grace)
        worker = build_worker(client, settings, drainer, interceptors=[grace])
        bridge = Bridge(
            app=app,
            engine=engine,
            client=client,
            listen_url=libpq_url(sqlalchemy_url(database_url)),
            options=BridgeOptions(
                task_queue=settings.task_queue,
                shard_options=settings.shard_options(),
                poll_interval=settings.poll_interval,
                sweep_interval=settings.sweep_interval,
                listen=settings.listen,
                regions=settings.regions,
                skip_shards=static_skips(app, settings.skip_shards),
            ),
            hub=hub,
        )
        health.attach(client=client, worker=worker, bridge=bridge)
        tasks = [
            asyncio.create_task(worker.run(), name="worker"),
            asyncio.create_task(bridge.run(stop), name="bridge"),
        ]
        if settings.demo:
            tasks.append(asyncio.create_task(demo.write_traffic(engine, stop), name="demo"))
        announcer = asyncio.create_task(_announce(bridge.ready, ready))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        announcer.cancel()
        stop.set()
        hub.close()
        await grace.stop(worker)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await health.close()
        drainer.close()
        await engine.dispose()


async def _announce(bridge_ready: asyncio.Event, ready: asyncio.Event | None) -> None:
    await bridge_ready.wait()
    if ready is not None:
        ready.set()


def print_banner(
    settings: OutboxSettings, database_url: str, temporal_address: str, ui: str | None
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
        lines.append("  Demo traffic: about 20 rows/s over 25 organizations and 50 users; one")
        lines.append("  PROJECT_UPDATE in ten fails once, so some shards block and retry.")
    print("\n".join(lines), flush=True)


async def run(settings: OutboxSettings) -> None:
    app = app_from_settings(settings.demo, settings.app)
    app.check_handlers()
    tracing = setup_tracing(settings.otel_exporter)
    metrics = setup_metrics(
        settings.metrics_exporter, host=settings.metrics_host, port=settings.metrics_port
    )
    postgres: EmbeddedPostgres | None = None
    temporal: EmbeddedTemporal | None = None
    try:
        if settings.database_url is not None:
            database_url = settings.database_url.get_secret_value()
        else:
            postgres = EmbeddedPostgres(settings.data_dir / "postgres")
            database_url = await asyncio.to_thread(postgres.start)
        ui = None
        if settings.temporal_address is not None:
            address = settings.temporal_address
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
        banner = asyncio.create_task(_banner_when_ready(ready, settings, database_url, address, ui))
        await serve(
            settings,
            app,
            stop=stop,
            database_url=database_url,
            temporal_address=address,
            ready=ready,
        )
        banner.cancel()
        log.info("outbox-bridge stopped")
    finally:
        if temporal is not None:
            temporal.stop()
        if postgres is not None:
            postgres.stop()
        # The process leaves with os._exit: export what the providers still hold.
        for provider in (tracing, metrics):
            if provider is not None:
                provider.shutdown()


async def _banner_when_ready(ready: asyncio.Event, *args: Any) -> None:
    await ready.wait()
    print_banner(*args)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@settings_options
def main(**overrides: Any) -> None:
    """Run the outbox-bridge worker: the bridge that starts a workflow per active shard, and
    the Temporal worker that runs the shard workflows and their handlers.

    Every option is also an environment variable (shown with each). With no database URL and
    no Temporal address, embedded servers are started under --data-dir.
    """
    code = 0
    try:
        settings = build_settings(overrides)
        configure_logging(settings.log_level, settings.log_format)
        logging.getLogger("temporalio").setLevel(logging.WARNING)
        # Handler failures are logged by the drain with shard and category; the SDK's own line
        # for each failed attempt would repeat them.
        logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
        asyncio.run(run(settings))
    except OutboxError as exc:
        print(f"outbox-bridge: error: {exc}", file=sys.stderr)
        code = 2
    except Exception:
        logging.getLogger("outbox_bridge").exception("outbox-bridge stopped on an unexpected error")
        code = 1
    # A process that ran a Temporal worker can crash in interpreter teardown after the work is
    # done: flush and leave explicitly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli(argv: Sequence[str] | None = None) -> None:
    main.main(args=list(argv) if argv is not None else None, prog_name="worker.py")


if __name__ == "__main__":
    cli()
