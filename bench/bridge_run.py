"""Running the bridge side: ``worker.serve`` in-process, exactly as ``worker.py`` runs it.

Nothing in the core is tuned: settings are :class:`OutboxSettings` defaults except a unique task
queue and ``listen`` for the poll-only latency run. (``--max-undeleted-groups`` and the like
change constants of the runtime for an A/B run: see :mod:`bench.tuning`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client
from temporalio.service import RPCError

from bench.temporal_stats import HistoryStats, history_stats, wait_all_closed
from bench.worker_process import WorkerSpec, run_worker_process
from outbox_bridge import OutboxApp, OutboxSettings
from outbox_bridge.runtime.worker import serve

log = logging.getLogger("bench.bridge_run")

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


def bench_settings(**overrides: Any) -> OutboxSettings:
    return OutboxSettings(
        task_queue=f"bench-{uuid.uuid4().hex[:10]}",
        log_level="WARNING",
        health_port=0,  # no endpoints: two benches (or a bench beside a worker) never collide
        **overrides,
    )


SECRET_OR_LOCAL = {"database_url", "temporal_api_key", "temporal_address", "data_dir", "app"}


def settings_summary(settings: OutboxSettings) -> dict[str, Any]:
    """The settings of a run (secrets and local paths left out), for the JSON results."""
    values = settings.model_dump(mode="json")
    return {
        name: value
        for name, value in values.items()
        if name not in SECRET_OR_LOCAL and not name.startswith("temporal_tls")
    }


@dataclass
class BridgeRun:
    """A running bridge + worker. ``started`` is when ``serve`` was called (monotonic)."""

    settings: OutboxSettings
    client: Client
    started: float
    task: asyncio.Task[None]
    ready_at: float | None = None  # monotonic; None while the first sweep still runs
    # What a worker in a process of its own reported at its end (see bench.worker_process).
    outcome: dict[str, Any] = field(default_factory=dict)

    @property
    def ready_after(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started

    async def close_stats(self, *, close_timeout: float) -> tuple[int, float]:
        """Wait (with the worker still running) until every shard workflow completed; return
        the workflows still running at the timeout and the seconds waited."""
        began = time.monotonic()
        running = await wait_all_closed(
            self.client, self.settings.task_queue, timeout=close_timeout
        )
        return running, time.monotonic() - began

    async def history(self, *, all_closed: bool) -> HistoryStats:
        return await history_stats(self.client, self.settings.task_queue, all_closed=all_closed)

    async def partitions_draining(self, tables: list[str], *, timeout: float) -> float | None:
        """Wait until the drain activity of every partition of ``tables`` runs in the worker
        and has heartbeated (it then listens for its shards' news); returns the seconds since
        ``serve`` was called, or None if that did not happen within ``timeout``."""
        ids = [
            f"outbox:{table}:partition:{n}"
            for table in tables
            for n in range(self.settings.partitions)
        ]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all([await self._draining(workflow_id) for workflow_id in ids]):
                return time.monotonic() - self.started
            await asyncio.sleep(0.1)
        return None

    async def _draining(self, workflow_id: str) -> bool:
        try:
            described = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError:
            return False  # not started yet
        return any(
            activity.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
            and activity.HasField("last_heartbeat_time")
            for activity in described.raw_description.pending_activities
        )


@contextlib.asynccontextmanager
async def running_bridge(
    settings: OutboxSettings,
    app: OutboxApp,
    database_url: str,
    temporal_address: str,
    *,
    own_process: WorkerSpec | None = None,
) -> AsyncIterator[BridgeRun]:
    """Run ``serve(...)`` in this event loop (or, with ``own_process``, in a worker process
    of its own) until the block ends; ``started`` is taken just before the worker is started
    (rows already inserted are its backlog)."""
    client = await Client.connect(temporal_address, namespace=settings.temporal_namespace)
    stop, ready = asyncio.Event(), asyncio.Event()
    outcome: dict[str, Any] = {}
    started = time.monotonic()
    worker = (
        serve(
            settings,
            app,
            stop=stop,
            database_url=database_url,
            temporal_address=temporal_address,
            ready=ready,
        )
        if own_process is None
        else run_worker_process(own_process, stop, ready, outcome)
    )
    task = asyncio.create_task(worker, name=f"serve-{settings.task_queue}")
    run = BridgeRun(settings, client, started, task, outcome=outcome)
    marker = asyncio.create_task(_mark_ready(run, ready))
    try:
        await _wait_ready(task, ready)
        run.started = outcome.pop("started", started)  # a worker process: once it serves
        yield run
    finally:
        marker.cancel()
        stop.set()
        await _stopped(task)


async def _mark_ready(run: BridgeRun, ready: asyncio.Event) -> None:
    await ready.wait()
    run.ready_at = time.monotonic()


async def _stopped(task: asyncio.Task[None]) -> None:
    """Wait for ``serve`` to return; cancel it if it does not within ``STOP_TIMEOUT``."""
    done, _ = await asyncio.wait([task], timeout=STOP_TIMEOUT)
    if not done:
        log.warning("serve() did not stop within %.0f s; cancelling it", STOP_TIMEOUT)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return
    task.result()


async def _wait_ready(task: asyncio.Task[None], ready: asyncio.Event) -> None:
    """Wait for ``ready``, or for ``READY_TIMEOUT`` at most: ``ready`` is set after the
    bridge's first sweep, which already signals every shard with rows (many shards: minutes).
    Only a ``serve`` that ended is an error."""
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait([task, waiter], timeout=READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    if not waiter.done():
        waiter.cancel()
    if task.done():
        task.result()
        raise RuntimeError("serve() returned before the worker was ready")
    if not ready.is_set():
        log.warning(
            "the bridge is not ready after %.0f s (its first sweep is still starting "
            "shard workflows); measuring anyway",
            READY_TIMEOUT,
        )
