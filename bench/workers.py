"""The ``workers`` workload: the ``io`` plain-def rows drained by 1, 2 and 3 workers on one
task queue, each a worker process of its own (:mod:`bench.worker_process`), with default
settings.

For each count, the workers start on an empty table and the run waits until the partitions'
drains have spread over them (each worker runs one at least and none two more than another,
or a minute has passed); then the
rows are inserted in one transaction and the clock runs from its commit until the table is
empty. Each entry gives the rate, its ratio to one worker's (targets: 1.8 with 2 workers, 2.6
with 3), the drains each worker ran, and the CPU seconds of every worker, of PostgreSQL and of
the Temporal server over the drain, so that a reader sees what bounded it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client
from temporalio.service import RPCError

from bench.app import HandlerProbe, make_app
from bench.bridge_run import settings_summary
from bench.context import Context
from bench.cpu import tree_seconds
from bench.progress import say, watch_drain
from bench.rows import RowSet, copy_rows, create_table, drop_table, table_name
from bench.servers import TemporalServer
from bench.worker_process import WorkerSpec, run_worker_process
from bench.workloads import IO_WAIT_SECONDS, Target, io_rows

WORKER_COUNTS = (1, 2, 3)
TARGETS = {2: 1.8, 3: 2.6}  # the rate with N workers over the rate with one
READY_SECONDS = 90.0
SPREAD_SECONDS = 60.0
SHARE = 240.0  # seconds one drain may take before its cap


async def run_workers(ctx: Context) -> list[dict[str, Any]]:
    rowset = io_rows(ctx.config.scale)
    say("workers", f"{len(rowset.rows):,} rows, {rowset.shards:,} shards, plain-def handlers")
    entries: list[dict[str, Any]] = []
    async with ctx.temporal("file") as server:
        for index, count in enumerate(WORKER_COUNTS):
            share = min(SHARE, (ctx.left() - 60.0) / (len(WORKER_COUNTS) - index))
            entry = await _drain_with(ctx, server, rowset, count, share)
            say(
                "workers",
                f"{count} worker(s): {entry['rows_per_s']:,.0f} rows/s, drains per worker "
                f"{entry['drains_per_worker']}, CPU s per worker {entry['worker_cpu_s']}, "
                f"PostgreSQL {entry['postgres_cpu_s']}, Temporal {entry['temporal_cpu_s']}",
            )
            entries.append(entry)
    one = entries[0]["rows_per_s"]
    for entry in entries:
        entry["ratio_to_one_worker"] = round(entry["rows_per_s"] / one, 2) if one else None
        if entry["workers"] in TARGETS:
            target = Target("ratio_to_one_worker", TARGETS[entry["workers"]])
            entry["targets"] = [target.verdict(entry)]
    return [
        {
            "workload": "workers",
            "kind": "workers",
            "description": "the io plain-def rows (8,000 shards × 10, 50 ms calls) drained by "
            "1, 2 and 3 worker processes on one task queue",
            "scale": ctx.config.scale,
            "entries": entries,
        }
    ]


async def _drain_with(
    ctx: Context, server: TemporalServer, rowset: RowSet, count: int, share: float
) -> dict[str, Any]:
    app = make_app(table_name(f"workers{count}"), HandlerProbe(plain=True))
    await create_table(ctx.database_url, app)
    table = app.table().name
    settings = ctx.settings()  # one task queue for all the workers
    spec = WorkerSpec(
        table,
        settings.model_dump(mode="json", exclude={"database_url"}),
        ctx.database_url,
        server.address,
        probe={"plain": True, "wait_seconds": IO_WAIT_SECONDS},
        partition_options=dict(ctx.config.tuning.partition_options),
    )
    try:
        async with worker_processes(spec, count) as outcomes:
            pids = [int(outcome["pid"]) for outcome in outcomes]
            spread_began = time.monotonic()
            drains = await spread(server.address, table, pids)
            spread_s = time.monotonic() - spread_began
            processes = [psutil.Process(pid) for pid in pids]
            meter = ctx.cpu_meter(server)
            await asyncio.to_thread(copy_rows, ctx.database_url, table, rowset.rows)
            load_before = os.getloadavg()[0]
            before = [tree_seconds(process) for process in processes]
            meter.start()
            started = time.monotonic()
            watch = await watch_drain(
                ctx.database_url,
                table,
                label=f"workers/{count}",
                total=len(rowset.rows),
                started=started,
                deadline=ctx.phase_deadline(share),
            )
            seconds = watch.ended - started
            cpu = [round(tree_seconds(p) - b, 2) for p, b in zip(processes, before, strict=True)]
            servers_cpu = meter.stop()
    finally:
        await asyncio.to_thread(drop_table, ctx.database_url, table)
    rows_done = len(rowset.rows) - watch.remaining
    return {
        "temporal": server.mode,
        "workers": count,
        "rows": len(rowset.rows),
        "rows_done": rows_done,
        "completed": watch.remaining == 0,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows_done / seconds, 1) if seconds > 0 else 0.0,
        "spread_s": round(spread_s, 1),
        "drains_per_worker": drains,
        "handler_calls_per_worker": [outcome.get("handler_calls") for outcome in outcomes],
        "worker_cpu_s": cpu,
        "worker_cpu_percent": [round(100 * c / seconds, 1) if seconds else None for c in cpu],
        "postgres_cpu_s": servers_cpu.get("postgres"),
        "temporal_cpu_s": servers_cpu.get("temporal"),
        "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "settings": settings_summary(settings),
    }


@contextlib.asynccontextmanager
async def worker_processes(spec: WorkerSpec, count: int) -> AsyncIterator[list[dict[str, Any]]]:
    """``count`` worker processes of ``spec``, ready for the block; what each reports (its
    ``pid`` at once, the rest at its end). A worker process that failed fails the block."""
    stop = asyncio.Event()
    readies = [asyncio.Event() for _ in range(count)]
    outcomes: list[dict[str, Any]] = [{} for _ in range(count)]
    running = [
        asyncio.create_task(run_worker_process(spec, stop, ready, outcome))
        for ready, outcome in zip(readies, outcomes, strict=True)
    ]
    try:
        await all_ready(readies, running)
        yield outcomes
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
    for task in running:
        task.result()


async def all_ready(readies: list[asyncio.Event], running: list[asyncio.Task[None]]) -> None:
    """Wait until every worker process is ready; one that ends first fails the run."""
    deadline = time.monotonic() + READY_SECONDS
    while not all(ready.is_set() for ready in readies):
        for task in running:
            if task.done():
                task.result()
                raise RuntimeError("a worker process ended before it was ready")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the workers are not ready after {READY_SECONDS:.0f} s")
        await asyncio.sleep(0.2)


async def spread(address: str, table: str, pids: list[int]) -> list[int]:
    """Wait until every worker runs a partition drain and none two more than another (or
    ``SPREAD_SECONDS``); the drains each worker runs then."""
    client = await Client.connect(address)
    deadline = time.monotonic() + SPREAD_SECONDS
    while True:
        running = await _drains_by_pid(client, table)
        drains = [running.get(pid, 0) for pid in pids]
        spread = min(drains) >= 1 and max(drains) - min(drains) <= 1
        if spread or time.monotonic() >= deadline:
            return drains
        await asyncio.sleep(0.5)


async def _drains_by_pid(client: Client, table: str) -> dict[int, int]:
    """The partition drains of ``table`` running now, by worker process id."""
    running: dict[int, int] = {}
    partition = 0
    while True:
        handle = client.get_workflow_handle(f"outbox:{table}:partition:{partition}")
        try:
            described = await handle.describe()
        except RPCError:
            return running  # past the last partition (or none started yet)
        for pending in described.raw_description.pending_activities:
            if pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
                pid = int(pending.last_worker_identity.split("@")[0])
                running[pid] = running.get(pid, 0) + 1
        partition += 1
