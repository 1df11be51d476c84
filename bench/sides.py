"""One drain of a backlog by each side: the baseline and the bridge, on a fresh table each.

Rows are inserted before the clock starts. The baseline's clock runs from the start of its
threads until they found their partitions empty; the bridge's from the call of ``serve`` (so
its start-up and first sweep are included) until the table is observed empty.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.app import HandlerProbe, make_app
from bench.baseline import DirectDrain
from bench.bridge_run import bench_settings, running_bridge, settings_summary
from bench.context import Context
from bench.corelog import COUNTER
from bench.progress import say, watch_drain
from bench.rows import RowSet, connect, copy_rows, count_rows, create_table, drop_table, table_name
from bench.servers import TemporalServer

CLOSE_MARGIN = 30.0


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


async def prepared_table(ctx: Context, label: str, rowset: RowSet, probe: HandlerProbe) -> Any:
    """A fresh table holding ``rowset`` (insertion is not measured); returns the app."""
    app = make_app(table_name(label), probe)
    await create_table(ctx.database_url, app)
    began = time.monotonic()
    await asyncio.to_thread(copy_rows, ctx.database_url, app.table().name, rowset.rows)
    say(label, f"inserted {len(rowset.rows):,} rows in {time.monotonic() - began:.1f} s "
               "(not measured)")
    return app


def remaining_rows(ctx: Context, table: str) -> int:
    with connect(ctx.database_url) as conn:
        return count_rows(conn, table)


async def baseline_side(
    ctx: Context, label: str, rowset: RowSet, *, threads: int, share: float
) -> SideResult:
    """Drain ``rowset`` with :class:`DirectDrain` and ``threads`` threads."""
    probe = HandlerProbe()
    app = await prepared_table(ctx, label, rowset, probe)
    table = app.table().name
    drain = DirectDrain(ctx.database_url, app, threads=threads)

    def timed() -> float:
        drain.run()
        return time.monotonic()

    started = time.monotonic()
    task = asyncio.create_task(asyncio.to_thread(timed))
    watch = await watch_drain(
        ctx.database_url, table, label=label, total=len(rowset.rows), started=started,
        deadline=ctx.phase_deadline(share), stopped=task.done,
    )
    if not task.done():
        drain.stop()
    finished = await task
    left = 0 if remaining_rows(ctx, table) == 0 else max(watch.remaining, 1)
    seconds = (finished if left == 0 else watch.ended) - started
    await asyncio.to_thread(drop_table, ctx.database_url, table)
    return SideResult(len(rowset.rows), len(rowset.rows) - left, seconds, probe.calls,
                      {"threads": threads})


async def bridge_side(
    ctx: Context, label: str, rowset: RowSet, server: TemporalServer, *, share: float
) -> SideResult:
    """Drain ``rowset`` with ``worker.serve`` in-process; then wait for the shard workflows to
    close and count their history events."""
    probe = HandlerProbe()
    app = await prepared_table(ctx, label, rowset, probe)
    table = app.table().name
    settings = bench_settings(ctx.config.idle_timeout)
    rss_before = psutil.Process().memory_info().rss / 2**20
    warnings_mark = COUNTER.count
    async with running_bridge(settings, app, ctx.database_url, server.address) as run:
        watch = await watch_drain(
            ctx.database_url, table, label=label, total=len(rowset.rows), started=run.started,
            deadline=ctx.phase_deadline(share), stopped=run.task.done,
        )
        seconds = watch.ended - run.started
        close_timeout = 0.0
        if watch.completed:
            close_timeout = min(ctx.config.idle_timeout + CLOSE_MARGIN, max(ctx.left() - 20, 0))
        running, close_wait = await run.close_stats(close_timeout=close_timeout)
        server_rss = server.rss_mb()
    history = await run.history()
    left = watch.remaining
    await asyncio.to_thread(drop_table, ctx.database_url, table)
    rows_done = len(rowset.rows) - left
    extra = {
        "ready_s": round(run.ready_after, 3),
        "history_events": history.events,
        "workflow_executions": history.executions,
        "history_events_per_row": history.events / rows_done if rows_done else None,
        "history_complete": history.running == 0,
        "running_after_idle": running,
        "close_wait_s": round(close_wait, 2),
        "rss_before_mb": round(rss_before, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "temporal_server_rss_mb": round(server_rss, 1) if server_rss is not None else None,
        "settings": settings_summary(settings),
        **COUNTER.since(warnings_mark),
    }
    return SideResult(len(rowset.rows), rows_done, seconds, probe.calls, extra)
