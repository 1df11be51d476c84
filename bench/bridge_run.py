"""Running the bridge side: ``worker.serve`` in-process, exactly as ``worker.py`` runs it.

Nothing in the core is tuned: settings are :class:`OutboxSettings` defaults except a unique task
queue, ``idle_timeout`` (short, so shard workflows close and their histories can be counted)
and ``listen`` for the poll-only latency run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from temporalio.client import Client

from bench.temporal_stats import HistoryStats, history_stats, wait_all_closed
from outbox_bridge import OutboxApp, OutboxSettings
from worker import serve

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


def bench_settings(idle_timeout: float, **overrides: Any) -> OutboxSettings:
    return OutboxSettings(
        task_queue=f"bench-{uuid.uuid4().hex[:10]}",
        idle_timeout=idle_timeout,
        log_level="WARNING",
        **overrides,
    )


def settings_summary(settings: OutboxSettings) -> dict[str, Any]:
    """The processing settings of a run, for the JSON results."""
    fields = (
        "task_queue idle_timeout poll_interval sweep_interval listen drain_max_groups "
        "drain_time_budget max_concurrent_activities database_pool_size max_history_events"
    ).split()
    return {name: getattr(settings, name) for name in fields}


@dataclass
class BridgeRun:
    """A running bridge + worker. ``started`` is when ``serve`` was called (monotonic)."""

    settings: OutboxSettings
    client: Client
    started: float
    ready_after: float
    task: asyncio.Task[None]

    async def close_stats(self, *, close_timeout: float) -> tuple[int, float]:
        """Wait (with the worker still running) until every shard workflow completed its idle
        period; return the workflows still running at the timeout and the seconds waited."""
        began = time.monotonic()
        running = await wait_all_closed(
            self.client, self.settings.task_queue, timeout=close_timeout
        )
        return running, time.monotonic() - began

    async def history(self) -> HistoryStats:
        return await history_stats(self.client, self.settings.task_queue)


@contextlib.asynccontextmanager
async def running_bridge(
    settings: OutboxSettings, app: OutboxApp, database_url: str, temporal_address: str
) -> AsyncIterator[BridgeRun]:
    """Run ``serve(...)`` in this event loop until the block ends; ``started`` is taken just
    before ``serve`` is called (rows already inserted are its backlog)."""
    client = await Client.connect(temporal_address, namespace=settings.temporal_namespace)
    stop, ready = asyncio.Event(), asyncio.Event()
    started = time.monotonic()
    task = asyncio.create_task(
        serve(
            settings,
            app,
            stop=stop,
            database_url=database_url,
            temporal_address=temporal_address,
            ready=ready,
        ),
        name=f"serve-{settings.task_queue}",
    )
    try:
        await _wait_ready(task, ready)
        yield BridgeRun(settings, client, started, time.monotonic() - started, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=STOP_TIMEOUT)


async def _wait_ready(task: asyncio.Task[None], ready: asyncio.Event) -> None:
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait([task, waiter], timeout=READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    if not waiter.done():
        waiter.cancel()
    if task.done():
        task.result()
        raise RuntimeError("serve() returned before the worker was ready")
    if not ready.is_set():
        raise RuntimeError(f"the worker was not ready within {READY_TIMEOUT:.0f} s")
