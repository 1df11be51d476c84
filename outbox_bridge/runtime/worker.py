"""``outbox-bridge worker``: the outbox as :class:`OutboxPlugin` runs it, with what only the
command adds (embedded servers, telemetry, health endpoints, the demo, the banner and summary
lines, a graceful stop on SIGINT/SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from pydantic import SecretStr

from outbox_bridge import demo
from outbox_bridge.config import OutboxSettings, retired_variables, safe_url, sqlalchemy_url
from outbox_bridge.dev.embedded import check_embedded, start_missing_servers
from outbox_bridge.observability.health import HealthServer
from outbox_bridge.observability.sdk import setup_telemetry, temporal_runtime
from outbox_bridge.observability.summary import (
    LEGEND,
    SUMMARY_INTERVAL,
    FailureTally,
    WorkerSummary,
    failures_tallied,
)
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.assembly import RunningOutbox
from outbox_bridge.runtime.outbox_plugin import OutboxPlugin
from outbox_bridge.runtime.temporal import connect, embedded_temporal

log = logging.getLogger("outbox_bridge.worker")


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
    """Run the outbox of ``app`` until ``stop`` is set, with the health endpoints; with
    ``summary``, a summary line every few seconds."""
    plugin = OutboxPlugin(
        app, settings=settings.model_copy(update={"database_url": SecretStr(database_url)})
    )
    health = HealthServer(settings, database_url=database_url, stop=stop)
    try:
        await health.start()
        client = await connect(
            settings,
            temporal_address,
            runtime=temporal_runtime(),  # the SDK's metrics, when metrics are on
        )
        tallied = (
            failures_tallied(show=settings.log_failures) if summary else contextlib.nullcontext()
        )
        with tallied as tally:
            async with plugin.running(client) as outbox:
                health.attach(client=outbox.client, worker=outbox.worker, bridge=outbox.bridge)
                with startup_objects_frozen():
                    await _run_until_stopped(settings, app, outbox, stop, ready, tally)
    finally:
        await health.close()


async def _run_until_stopped(
    settings: OutboxSettings,
    app: OutboxApp,
    outbox: RunningOutbox,
    stop: asyncio.Event,
    ready: asyncio.Event | None,
    tally: FailureTally | None,
) -> None:
    tasks = []
    if settings.demo:
        traffic = demo.write_traffic(outbox.engine, stop, outage_seconds=settings.demo_outage)
        tasks.append(asyncio.create_task(traffic, name="demo"))
    if tally is not None:
        view = WorkerSummary(app, outbox.engine, outbox.client, settings.task_queue, tally=tally)
        tasks.append(asyncio.create_task(view.run(stop), name="summary"))
    for task in tasks:  # the demo or the summary ending stops the worker too
        task.add_done_callback(lambda _: stop.set())
    announcer = asyncio.create_task(_announce(outbox.bridge.ready, ready))
    await outbox.until(stop)
    announcer.cancel()
    stop.set()
    for task in tasks:
        await task


# The collector's first threshold while the worker runs (Python's default: 700). A round's rows
# and calls live until it ends: collected every 700 allocations, they were scanned and promoted
# again and again, and full collections followed (a fifth of the CPU of a plain-def drain).
YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Leave the objects that exist once the worker is up out of the garbage collector's scans
    (1.2 of 9 CPU seconds in a backlog profile), and collect the young ones less often, unless
    the process froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)  # not a full collection: a tenth of a second for little garbage
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
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
        lines += [
            f"  Temporal UI  {ui}/namespaces/{settings.temporal_namespace}/workflows?query={query}",
            "  Look at the OutboxShard workflows: one per active shard, named",
            "  outbox:<table>:<SCOPE>:<id>. Open one to see its state, the category activity",
            "  of a blocked head, and its rows handled; its `skip` update sets it aside until",
            "  `resume`.",
        ]
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
    for name in retired_variables(os.environ):
        log.warning("%s is set, but 1.0 retired that setting: it is ignored (remove it)", name)
    # Before anything starts: a server to start here whose extra is not installed.
    check_embedded(postgres=settings.database_url is None, temporal=embedded_temporal(settings))
    with contextlib.ExitStack() as stopped_at_exit:
        # The process leaves with os._exit: telemetry exports what it holds first.
        stopped_at_exit.callback(setup_telemetry(settings).shutdown)
        database_url, address, ui = await start_missing_servers(settings, app, stopped_at_exit)
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


async def _banner_when_ready(ready: asyncio.Event, *args: Any) -> None:
    await ready.wait()
    print_banner(*args)
