"""The ``latency`` workload: commit→handler latency under steady traffic.

A writer thread commits one row per transaction at 100 rows/s over 200 shards for 60 s (× scale,
at least 3 s). Latency = handler start wall time minus the wall time at which the writer's COMMIT
returned, per row id. Measured on fresh tables: the baseline direct drain running continuously
(4 threads, each polling its partition every 100 ms when idle), then for each shard workflow
mode the bridge with LISTEN/NOTIFY (default settings) and, for the first mode, the bridge
polling only (``listen=False``). Reports p50/p99 over the whole run and from ``WARM_AFTER``
seconds on, history events per row (the partitions' and every shard workflow's), and
``backlog_end``: rows still pending 5 s after the writer stopped (0 when the side keeps up).

The writer starts once the worker is ready: on demand, once every partition's drain activity
runs and has heartbeated (``partitions_ready_s`` after ``serve`` was called), so the first
rows are not handled by a worker still starting; with a workflow for every shard, once the
bridge's first sweep is done. The first seconds of traffic are in the figures either way.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from bench.app import HandlerProbe, make_app
from bench.baseline import DirectDrain
from bench.bridge_run import running_bridge, settings_summary
from bench.context import Context
from bench.corelog import COUNTER
from bench.progress import PROGRESS_EVERY, say, watch_drain
from bench.rows import connect, count_rows, create_table, drop_table, table_name
from bench.servers import TemporalServer
from bench.writer import SteadyWriter
from outbox_bridge import OutboxApp

BASELINE_POLL = 0.1
# Seconds after which every shard of the latency workload has had its first row.
WARM_AFTER = 15.0
PARTITIONS_READY_TIMEOUT = 60.0
DRAIN_AFTER_GRACE = 30.0


@dataclass
class Phase:
    """One measurement: who drained, what the writer wrote, and what the handler saw."""

    name: str
    rows: int
    seconds: float
    backlog_end: int
    remaining: int
    handler_calls: int
    latencies: list[tuple[float, float]]  # (seconds since the writer started, latency ms)
    extra: dict[str, Any]  # history events, settings, writer lag

    @property
    def rows_per_s(self) -> float:
        return (self.rows - self.remaining) / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, p: float, *, after: float = 0.0, before: float = math.inf) -> float | None:
        """The p-th percentile of the rows written from ``after`` seconds into the run until
        ``before``."""
        values = sorted(ms for at, ms in self.latencies if after <= at < before)
        if not values:
            return None
        return round(values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))], 2)


def duration(ctx: Context, phases: int = 3) -> float:
    """The writer's duration: 60 s × scale (at least 3 s) or ``latency_seconds`` when given,
    shortened to fit the phases into what is left of the invocation's budget (to 3 s at
    least, or to a shorter duration that was asked for)."""
    wanted = ctx.config.latency_seconds or max(3.0, 60.0 * ctx.config.scale)
    floor = min(3.0, wanted) if wanted > 0 else 3.0
    return max(floor, min(wanted, (ctx.left() - 120.0) / phases - 20.0))


async def _write_and_settle(
    ctx: Context, writer: SteadyWriter, table: str, label: str
) -> tuple[float, int, int]:
    """Run the writer, then wait the grace period; returns (seconds from the writer's start
    until the table was empty or the wait ended, backlog at the end of the grace, rows left)."""
    started = time.monotonic()
    task = asyncio.create_task(asyncio.to_thread(writer.run))
    while not task.done():
        await asyncio.wait([task], timeout=PROGRESS_EVERY)
        if not task.done():
            say(
                label,
                f"{writer.written:,}/{writer.total:,} rows written, "
                f"{await asyncio.to_thread(_count, ctx, table):,} pending",
            )
    await task
    grace = await watch_drain(
        ctx.database_url,
        table,
        label=label,
        total=writer.total,
        started=started,
        deadline=time.monotonic() + ctx.config.latency_grace,
    )
    if grace.completed:
        return grace.ended - started, 0, 0
    backlog_end = await asyncio.to_thread(_count, ctx, table)
    say(
        label,
        f"{backlog_end:,} rows pending {ctx.config.latency_grace:.0f} s after the writer "
        "stopped; waiting for them",
    )
    rest = await watch_drain(
        ctx.database_url,
        table,
        label=label,
        total=writer.total,
        started=started,
        deadline=ctx.phase_deadline(DRAIN_AFTER_GRACE),
    )
    return rest.ended - started, backlog_end, rest.remaining


def _count(ctx: Context, table: str) -> int:
    with connect(ctx.database_url) as conn:
        return count_rows(conn, table)


def _latencies(writer: SteadyWriter, probe: HandlerProbe) -> list[tuple[float, float]]:
    since = writer.started_wall
    return [
        (round(committed - since, 3), round((probe.starts[id_] - committed) * 1000, 2))
        for id_, committed in sorted(writer.commits.items())
        if id_ in probe.starts
    ]


async def run_phase(
    ctx: Context,
    name: str,
    server: TemporalServer | None,
    writer_seconds: float,
) -> Phase:
    """One latency measurement: ``baseline`` (server None), ``listen`` or ``poll_only``."""
    label = f"latency/{name}" + (f"-{server.mode}" if server else "")
    probe = HandlerProbe(record_starts=True)
    app = make_app(table_name(f"latency_{name}"), probe)
    await create_table(ctx.database_url, app)
    writer = SteadyWriter(
        ctx.database_url,
        app.table().name,
        rate=ctx.config.latency_rate,
        shards=ctx.config.latency_shards,
        seconds=writer_seconds,
    )
    extra: dict[str, Any] = {}
    if server is None:
        outcome = await _with_baseline(ctx, app, writer, label)
    else:
        outcome, extra = await _with_bridge(
            ctx, app, writer, label, server, listen=name == "listen"
        )
    await asyncio.to_thread(drop_table, ctx.database_url, app.table().name)
    extra["writer_max_lag_ms"] = round(writer.max_lag * 1000, 1)
    phase = Phase(name, writer.written, *outcome, probe.calls, _latencies(writer, probe), extra)
    say(
        label,
        f"p50 {phase.percentile(50)} ms, p99 {phase.percentile(99)} ms, "
        f"backlog at the end {phase.backlog_end}",
    )
    return phase


async def _with_baseline(
    ctx: Context, app: OutboxApp, writer: SteadyWriter, label: str
) -> tuple[float, int, int]:
    drain = DirectDrain(
        ctx.database_url, app, threads=4, until_empty=False, poll_interval=BASELINE_POLL
    )
    task = asyncio.create_task(asyncio.to_thread(drain.run))
    try:
        return await _write_and_settle(ctx, writer, app.table().name, label)
    finally:
        drain.stop()
        await task


async def _with_bridge(
    ctx: Context,
    app: OutboxApp,
    writer: SteadyWriter,
    label: str,
    server: TemporalServer,
    *,
    listen: bool,
) -> tuple[tuple[float, int, int], dict[str, Any]]:
    settings = ctx.settings(listen=listen)
    warnings_mark = COUNTER.count
    async with running_bridge(settings, app, ctx.database_url, server.address) as run:
        ready = await run.partitions_draining([app.table().name], timeout=PARTITIONS_READY_TIMEOUT)
        if ready is None:
            say(label, "the partitions' drains did not all start in time; writing anyway")
        outcome = await _write_and_settle(ctx, writer, app.table().name, label)
        running, _ = await run.close_stats(close_timeout=ctx.close_timeout())
    stats = await run.history(all_closed=running == 0)
    return outcome, {
        "ready_s": round(run.ready_after, 3) if run.ready_after is not None else None,
        "partitions_ready_s": round(ready, 3) if ready is not None else None,
        "history_events": stats.events,
        "workflow_executions": stats.executions,
        "shard_workflows_started": stats.shard_workflows,
        "shard_workflow_runs": stats.shard_runs,
        "shard_events": stats.shard_events,
        "partition_workflows": stats.partition_runs,
        "partitions_running": stats.partitions_running,
        "partition_events": stats.partition_events,
        # Shard workflows only: partitions never close.
        "running_after_idle": running,
        "settings": settings_summary(settings),
        **COUNTER.since(warnings_mark),
    }


def _events_per_row(phase: Phase) -> float | None:
    events = phase.extra.get("history_events")
    handled = phase.rows - phase.remaining
    return round(events / handled, 3) if events is not None and handled else None


def latency_entry(
    ctx: Context, mode: str, listen: Phase, poll: Phase | None, baseline: Phase
) -> dict[str, Any]:
    events_per_row = _events_per_row(listen)
    entry = {
        "temporal": mode,
        "rows": listen.rows,
        "shards": ctx.config.latency_shards,
        "rate": ctx.config.latency_rate,
        "completed": listen.remaining == 0
        and (poll is None or poll.remaining == 0)
        and baseline.remaining == 0,
        "seconds": round(listen.seconds, 3),
        "bridge_rows_per_s": round(listen.rows_per_s, 1),
        "baseline_rows_per_s": round(baseline.rows_per_s, 1),
        "ratio": round(listen.rows_per_s / baseline.rows_per_s, 4) if baseline.rows_per_s else None,
        "handler_calls": listen.handler_calls,
        "duplicate_handler_calls": listen.handler_calls - len(listen.latencies),
        # Over the whole run, its first seconds included.
        "p50_ms": listen.percentile(50),
        "p99_ms": listen.percentile(99),
        # From WARM_AFTER seconds on (with a workflow for every shard: once every shard's
        # workflow has started).
        "warm_after_s": WARM_AFTER,
        "warm_p50_ms": listen.percentile(50, after=WARM_AFTER),
        "warm_p99_ms": listen.percentile(99, after=WARM_AFTER),
        "first_seconds_p99_ms": listen.percentile(99, before=WARM_AFTER),
        "max_ms": listen.percentile(100),
        "backlog_end": listen.backlog_end,
        "events_per_row": events_per_row,
        "history_events_per_row": events_per_row,
        **listen.extra,
        "baseline_p50_ms": baseline.percentile(50),
        "baseline_p99_ms": baseline.percentile(99),
        "baseline_backlog_end": baseline.backlog_end,
        "baseline_rows": baseline.rows,
        "baseline_handler_calls": baseline.handler_calls,
        "samples": {p.name: p.latencies for p in (listen, poll, baseline) if p is not None},
    }
    if poll is not None:
        entry.update(
            {
                "poll_only_p50_ms": poll.percentile(50),
                "poll_only_p99_ms": poll.percentile(99),
                "poll_only_warm_p99_ms": poll.percentile(99, after=WARM_AFTER),
                "poll_only_max_ms": poll.percentile(100),
                "poll_only_backlog_end": poll.backlog_end,
                "poll_only_events_per_row": _events_per_row(poll),
                "poll_only_rows": poll.rows,
                "poll_only_handler_calls": poll.handler_calls,
                "poll_only_rows_per_s": round(poll.rows_per_s, 1),
            }
        )
    return entry


async def run_latency(ctx: Context) -> list[dict[str, Any]]:
    rate, shards = ctx.config.latency_rate, ctx.config.latency_shards
    seconds = duration(ctx, 3)  # the baseline, listen and poll-only
    say("latency", f"{rate:.0f} rows/s over {shards} shards for {seconds:.0f} s per side")
    baseline = await run_phase(ctx, "baseline", None, seconds)
    entries = []
    for mode in ctx.modes("file"):
        async with ctx.temporal(mode) as server:  # a fresh server for each phase
            listen = await run_phase(ctx, "listen", server, seconds)
        async with ctx.temporal(mode) as server:
            poll = await run_phase(ctx, "poll_only", server, seconds)
        entries.append(latency_entry(ctx, server.mode, listen, poll, baseline))
    return [
        {
            "workload": "latency",
            "kind": "latency",
            "description": f"steady {rate:.0f} rows/s over {shards} shards, one row per "
            "transaction: commit→handler latency",
            "scale": ctx.config.scale,
            "duration_s": seconds,
            "baseline_poll_interval_s": BASELINE_POLL,
            "entries": entries,
        }
    ]
