"""The outbox inside a Temporal worker of the application's own: :class:`OutboxPlugin`."""

from __future__ import annotations

import asyncio
import difflib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import temporalio.worker
from temporalio.client import Client, WorkflowHistory
from temporalio.worker import Replayer, ReplayerConfig, Worker, WorkerConfig, WorkflowReplayResult

from outbox_bridge.config import OutboxSettings, sqlalchemy_url
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.assembly import RunningOutbox, run_outbox
from outbox_bridge.runtime.loop_thread import settle_native_threads_at_exit
from outbox_bridge.workflows.models import flush_queue

log = logging.getLogger(__name__)

# Settings of the `outbox-bridge worker` command that mean nothing in a worker of your own,
# and what stands in for them there.
_COMMAND_ONLY = {
    "the outbox uses the Temporal connection and namespace of your worker's client": (
        "temporal_address temporal_namespace temporal_api_key temporal_tls temporal_tls_cert "
        "temporal_tls_key temporal_tls_ca temporal_profile temporal_config_file"
    ),
    "the command starts embedded servers; give the plugin a database_url": (
        "data_dir temporal_port temporal_ui_port"
    ),
    "the demo is the command's": "demo demo_outage",
    "the summary lines it applies to are the command's": "log_failures",
    "the outbox reports through your process's OpenTelemetry providers and logging "
    "configuration, as your own code does": (
        "otel_exporter metrics_exporter metrics_port metrics_host otel_sdk_disabled log_level "
        "log_format"
    ),
    "the health endpoints are the command's; probe your worker as you do now": (
        "health_port health_host"
    ),
}
COMMAND_SETTINGS = {name: why for why, names in _COMMAND_ONLY.items() for name in names.split()}


def plugin_settings(fields: dict[str, Any]) -> OutboxSettings:
    """:class:`OutboxSettings` from the plugin's keyword arguments (and the ``OUTBOX_*``
    environment for the rest), refusing a name that is no setting or one the plugin has no
    use for."""
    known = OutboxSettings.model_fields
    for name in fields:
        if name in COMMAND_SETTINGS:
            raise ConfigurationError(f"OutboxPlugin takes no {name}: {COMMAND_SETTINGS[name]}")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(f"OutboxPlugin got an unknown setting {name!r}{hint}")
    return OutboxSettings(**fields)


class OutboxPlugin(temporalio.worker.Plugin):
    """Runs the outbox of ``app`` in a Temporal worker of yours, for as long as it runs:

    ```python
    worker = Worker(
        client,
        task_queue="orders",
        workflows=[OrderWorkflow],
        activities=[charge],
        plugins=[OutboxPlugin(app, database_url="postgresql://...")],
    )
    ```

    When the worker starts, the plugin checks the app's outbox tables against PostgreSQL's
    catalog (it changes no schema: ``outbox-bridge init-db`` or your migrations create them; a
    difference, or a privilege the role lacks, stops it with the fix), creates the shard
    workflows' missing search attributes, then runs the outbox's own Temporal workers, on the
    outbox's task queue (``task_queue``, ``outbox`` by default) and its flush queue, and the
    bridge, in the same process and on the same connection and namespace as your worker. Your
    worker's workflows, activities, task queue, interceptors, data converter and sandbox are
    left as they are. When your worker has stopped, the outbox stops too: the bridge at once,
    then its workers, giving handler calls in flight ``shutdown_grace`` seconds; every database
    connection is closed. ``worker.shutdown()`` returns once the outbox has stopped as well,
    with nothing of it left running (``worker.run()`` has returned too). If a part of the
    outbox stops on its own (a fatal worker error), the plugin stops your worker too, and its
    ``run()`` raises why.

    Args:
        app: The outbox app whose rows are handled; every category needs a handler.
        settings: All the settings at once, instead of keyword arguments.
        **fields: Settings by the names of :class:`~outbox_bridge.OutboxSettings`, with its
            defaults; ``OUTBOX_*`` environment variables fill in the ones not given.
            ``database_url`` is required. The Temporal connection is your client's, so the
            ``temporal_*`` settings are refused, as are the command's own (embedded servers,
            demo, telemetry exporters, logs, health endpoints).

    Raises:
        ConfigurationError: no database URL, a setting of the command's, or (when the
            worker is created) a worker on the outbox's own task queue.
        MissingHandlerError: a category of ``app`` has no handler.
        TypeError: a name that is no setting.
    """

    def __init__(
        self, app: OutboxApp, *, settings: OutboxSettings | None = None, **fields: Any
    ) -> None:
        if settings is not None and fields:
            raise TypeError("OutboxPlugin takes settings= or settings by name, not both")
        self.settings = settings if settings is not None else plugin_settings(fields)
        url = self.settings.database_url
        if url is None:
            raise ConfigurationError(
                "OutboxPlugin needs the database of the outbox tables: "
                "database_url='postgresql://...' (or OUTBOX_DATABASE_URL)"
            )
        sqlalchemy_url(url.get_secret_value())  # a URL that is not PostgreSQL's fails now
        app.check_handlers()
        self.app = app

    def name(self) -> str:
        return "outbox_bridge.OutboxPlugin"

    def running(self, client: Client) -> AbstractAsyncContextManager[RunningOutbox]:
        """The outbox alone on ``client``'s connection until the block ends, with no worker
        of yours beside it: what ``outbox-bridge worker`` runs."""
        return run_outbox(self.app, self.settings, client)

    # -- the worker's hooks ------------------------------------------------------------------

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        queue = config.get("task_queue")
        outbox_queues = (self.settings.task_queue, flush_queue(self.settings.task_queue))
        if queue in outbox_queues:
            raise ConfigurationError(
                f"this worker polls task queue {queue!r}, which the outbox's own workers poll "
                "with the outbox's workflows and activities only: give your worker another "
                "task queue, or the outbox another with task_queue=... (OUTBOX_TASK_QUEUE, "
                "the same for every worker and producer of the app)"
            )
        return config

    async def run_worker(self, worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
        # The SDK's threads of the outbox's workers may still call into Python when your
        # program returns; one that does so while the interpreter finalizes aborts it.
        settle_native_threads_at_exit()
        stop_worker = worker.shutdown
        worker_stopped = asyncio.Event()
        outbox = asyncio.create_task(
            self._run_beside(worker.client, stop_worker, worker_stopped), name="outbox"
        )

        async def shutdown() -> None:
            # The SDK's returns once your worker has stopped, the outbox's stop still to come:
            # a program that went on to cancel what is left, or returned, would cut it short.
            await stop_worker()
            await asyncio.wait([outbox])

        worker.shutdown = shutdown  # type: ignore[method-assign]
        try:
            await next(worker)
        finally:
            worker_stopped.set()
            failure = await _finished(outbox)
        if failure is not None:
            raise failure

    async def _run_beside(
        self, client: Client, stop_worker: Callable[[], Awaitable[None]], stopped: asyncio.Event
    ) -> None:
        """Run the outbox until the worker has ``stopped``; stop the worker if the outbox
        could not start or stopped on its own."""
        try:
            async with self.running(client) as outbox:
                if await outbox.until(stopped):
                    log.error("the outbox stopped (%s); stopping the worker", outbox.failure())
        except BaseException:
            if not stopped.is_set():
                await stop_worker()
            raise

    # The outbox's workflows are replayed from their own histories (outbox_bridge.testing);
    # a replayer of yours is left as it is.

    def configure_replayer(self, config: ReplayerConfig) -> ReplayerConfig:
        return config

    def run_replayer(
        self,
        replayer: Replayer,
        histories: AsyncIterator[WorkflowHistory],
        next: Callable[
            [Replayer, AsyncIterator[WorkflowHistory]],
            AbstractAsyncContextManager[AsyncIterator[WorkflowReplayResult]],
        ],
    ) -> AbstractAsyncContextManager[AsyncIterator[WorkflowReplayResult]]:
        return next(replayer, histories)


async def _finished(task: asyncio.Task[None]) -> BaseException | None:
    """Wait for ``task`` (if this wait is cancelled, cancel it and still wait: its stop is
    bounded, and nothing of the outbox outlives the worker's run); what it raised, if any."""
    try:
        await asyncio.wait([task])
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait([task])  # it raises the cancel (run_outbox re-raises it)
        raise
    return None if task.cancelled() else task.exception()
