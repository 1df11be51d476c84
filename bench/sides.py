"""One drain of a backlog by each side: the baseline and the bridge, on a fresh table each.

Rows are inserted before the clock starts. The baseline's clock runs from the start of its
threads until they found their partitions empty; the bridge's from the call of ``serve`` (so
its start-up is included: connecting, starting the partition workflows, or with a workflow for
every shard the first sweep, which already starts shard workflows) until the table is observed
empty. ``bridge_rows_per_s_from_ready`` is the rate after ``ready`` alone.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.app import HandlerProbe, make_app
from bench.baseline import DirectDrain
from bench.bridge_run import running_bridge, settings_summary
from bench.context import Context
from bench.corelog import COUNTER
from bench.progress import DrainWatch, say, watch_drain
from bench.rows import RowSet, connect, copy_rows, count_rows, create_table, drop_table, table_name
from bench.servers import TemporalServer
from bench.temporal_stats import HistoryStats
from bench.worker_process import WorkerSpec
from outbox_bridge import OutboxApp


@dataclass
class SideResult:
    rows: int
    rows_done: int
    seconds: float
    handler_calls: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.rows_done == self.rows

    @property
    def rows_per_s(self) -> float:
        return self.rows_done / self.seconds if self.seconds > 0 else 0.0


class RssSampler:
    """Resident memory of this process before and at its peak during a block (sampled twice a
    second), in MB. ``peak_rss_mb`` (getrusage) is the peak of the whole process so far."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.before = self.peak = self._mb()
        self._task: asyncio.Task[None] | None = None

    def _mb(self) -> float:
        return float(self._process.memory_info().rss) / 2**20

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._mb())
            await asyncio.sleep(0.5)

    async def __aenter__(self) -> RssSampler:
        self.before = self.peak = self._mb()
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.peak = max(self.peak, self._mb())


async def prepared_table(
    ctx: Context, label: str, rowset: RowSet, probe: HandlerProbe
) -> OutboxApp:
    """A fresh table holding ``rowset`` (insertion is not measured); returns the app."""
    app = make_app(table_name(label), probe)
    await create_table(ctx.database_url, app)
    began = time.monotonic()
    await asyncio.to_thread(copy_rows, ctx.database_url, app.table().name, rowset.rows)
    say(
        label,
        f"inserted {len(rowset.rows):,} rows in {time.monotonic() - began:.1f} s (not measured)",
    )
    return app


def remaining_rows(ctx: Context, table: str) -> int:
    with connect(ctx.database_url) as conn:
        return count_rows(conn, table)


async def baseline_side(
    ctx: Context,
    label: str,
    rowset: RowSet,
    *,
    threads: int,
    share: float,
    probe: HandlerProbe | None = None,
) -> SideResult:
    """Drain ``rowset`` with :class:`DirectDrain` and ``threads`` threads; a failing head is
    retried after the bridge's ``initial_retry_interval``."""
    probe = probe if probe is not None else HandlerProbe()
    app = await prepared_table(ctx, label, rowset, probe)
    table = app.table().name
    retry = ctx.settings().initial_retry_interval
    drain = DirectDrain(ctx.database_url, app, threads=threads, retry_interval=retry)

    def timed() -> float:
        drain.run()
        return time.monotonic()

    meter = ctx.cpu_meter(None).start()
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    task = asyncio.create_task(asyncio.to_thread(timed))
    await watch_drain(
        ctx.database_url,
        table,
        label=label,
        total=len(rowset.rows),
        started=started,
        deadline=ctx.phase_deadline(share),
        stopped=task.done,
    )
    if not task.done():
        drain.stop()
    seconds = await task - started  # the threads stop at once when capped
    cpu = meter.stop()
    left = await asyncio.to_thread(remaining_rows, ctx, table)
    await asyncio.to_thread(drop_table, ctx.database_url, table)
    extra: dict[str, Any] = {
        "threads": threads,
        "retry_interval_s": retry,
        "failed_calls": probe.failed,
        "cpu_s": cpu,
        "load_average": _load(load_before),
        "peak_concurrent_calls": probe.peak,
    }
    return SideResult(len(rowset.rows), len(rowset.rows) - left, seconds, probe.calls, extra)


async def bridge_side(
    ctx: Context,
    label: str,
    rowset: RowSet,
    server: TemporalServer,
    *,
    share: float,
    probe: HandlerProbe | None = None,
    worker_database_url: str | None = None,
    own_process: bool = False,
) -> SideResult:
    """Drain ``rowset`` with ``worker.serve`` in-process (or in a process of its own),
    connected to ``worker_database_url`` (by default the bench's own); then wait (worker still
    running) for the shard workflows to close, and count the history events of every workflow
    of the run, partitions included."""
    probe = probe if probe is not None else HandlerProbe()
    app = await prepared_table(ctx, label, rowset, probe)
    table = app.table().name
    settings = ctx.settings()
    rss = RssSampler()
    warnings_mark = COUNTER.count
    meter = ctx.cpu_meter(server).start()
    load_before = os.getloadavg()[0]
    worker_url = worker_database_url or ctx.database_url
    spec = None
    if own_process:
        spec = WorkerSpec(
            table,
            settings_summary(settings),
            worker_url,
            server.address,
            probe.options(),
            dict(ctx.config.tuning.partition_options),
        )
    async with (
        rss,
        running_bridge(settings, app, worker_url, server.address, own_process=spec) as run,
    ):
        ready_after = run.ready_after
        left_at_ready = await asyncio.to_thread(remaining_rows, ctx, table)
        watch = await watch_drain(
            ctx.database_url,
            table,
            label=label,
            total=len(rowset.rows),
            started=run.started,
            deadline=ctx.phase_deadline(share),
            stopped=run.task.done,
        )
        cpu = meter.stop()
        load = _load(load_before)
        # A capped run: count what still runs, do not wait.
        close_timeout = ctx.close_timeout() if watch.completed else 0.0
        running, close_wait = await run.close_stats(close_timeout=close_timeout)
        server_rss = server.rss_mb()
    history = await run.history(all_closed=running == 0)
    await asyncio.to_thread(drop_table, ctx.database_url, table)
    if own_process:
        probe.add_calls(run.outcome)
    rows_done = len(rowset.rows) - watch.remaining
    extra = {
        "ready_s": round(run.ready_after, 3) if run.ready_after is not None else None,
        **_from_ready(watch, run.started, ready_after, left_at_ready),
        **history_entry(history, rows_done),
        # Shard workflows only: partitions never close.
        "running_after_idle": running if watch.completed else None,
        # After a cap nothing is waited for: then only the count at the cap is known.
        "running_at_cap": None if watch.completed else running,
        "close_wait_s": round(close_wait, 2),
        "failed_calls": probe.failed,
        # Handlers that wait (io): the most calls seen under way at once.
        "peak_concurrent_calls": probe.peak,
        **_memory(rss, server_rss),
        # CPU seconds from the worker's start until the table was empty (or the cap).
        "cpu_s": cpu,
        # The 1-minute load average before and after: the machine is shared.
        "load_average": load,
        "settings": settings_summary(settings),
        **COUNTER.since(warnings_mark),
        # With a worker process of its own: its peak RSS and CPU seconds, its core's warnings.
        "worker_process": "own" if own_process else "bench",
        **{k: v for k, v in run.outcome.items() if k.startswith(("worker_", "sdk_core_"))},
    }
    return SideResult(len(rowset.rows), rows_done, watch.ended - run.started, probe.calls, extra)


def history_entry(history: HistoryStats, rows_done: int) -> dict[str, Any]:
    """What the run cost in Temporal history, partitions and shard workflows apart."""
    return {
        "history_events": history.events,
        "workflow_executions": history.executions,
        "history_events_per_row": round(history.events / rows_done, 4) if rows_done else None,
        "history_complete": history.running == 0,
        "shard_workflows_started": history.shard_workflows,
        "shard_workflow_runs": history.shard_runs,
        "shard_events": history.shard_events,
        "partition_workflows": history.partition_runs,
        "partitions_running": history.partitions_running,
        "partition_events": history.partition_events,
    }


def _from_ready(
    watch: DrainWatch, started: float, ready_after: float | None, left_at_ready: int
) -> dict[str, Any]:
    """The drain rate after the worker was ready (the bridge's first sweep excluded)."""
    if ready_after is None:  # not ready when the measurement began
        return {"rows_left_at_ready": None, "bridge_rows_per_s_from_ready": None}
    after_ready = watch.ended - started - ready_after
    rate = (left_at_ready - watch.remaining) / after_ready if after_ready > 0 else None
    return {
        "rows_left_at_ready": left_at_ready,
        "bridge_rows_per_s_from_ready": round(rate, 1) if rate is not None else None,
    }


def _load(before: float) -> dict[str, float]:
    return {"before": round(before, 2), "after": round(os.getloadavg()[0], 2)}


def _memory(rss: RssSampler, server_rss: float | None) -> dict[str, float | None]:
    return {
        "rss_before_mb": round(rss.before, 1),
        "bridge_peak_rss_mb": round(rss.peak, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "temporal_server_rss_mb": round(server_rss, 1) if server_rss is not None else None,
    }
