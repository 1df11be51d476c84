"""The ``limits`` workload: a rate limit of 100 calls/s on one category, shared by three worker
processes on one task queue (:mod:`bench.worker_process`), each with default settings.

- **rate**: a backlog of the limited category (``ITEM_CREATED``) and of an unlimited one
  (``ITEM_UPDATED``), each over shards of its own, drained once with the limit and once
  without. It reports the limited category's rate over a ``60 s × scale`` window that starts
  5 s after the rows' commit, while the unlimited category drains beside it, and over one that
  starts once the unlimited category is done (target for both: 100/s ± 5 %), and the
  unlimited category's rate in both runs (its rows over the time until the last of them is
  handled), side by side, and their ratio (target: at least 0.95). Its backlog
  (:data:`OTHER_ROWS`) lasts well past the first seconds, in which the three workers take up
  the four partition drains (one may start seconds after the others, in either run).
- **flood**: 20 quiet tenants (shards) with 15 rows each of the limited category, drained alone,
  then beside one tenant that floods it with 3,000 rows. A row's wait is from the commit of the
  rows to its handler's start; the figure is the quiet tenants' p99 wait with the flood over
  the one without (target: at most 2).

The load average before each drain is in its entry: the machine is shared.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from bench.app import Category, HandlerProbe, make_app
from bench.context import Context, scaled
from bench.progress import say, watch_drain
from bench.rows import SCOPE, Row, connect, copy_rows, create_table, drop_table, table_name
from bench.servers import TemporalServer
from bench.worker_process import WorkerSpec
from bench.workers import spread, worker_processes
from bench.workloads import Target

WORKERS = 3
RATE = 100
LIMITED, OTHER = int(Category.ITEM_CREATED), int(Category.ITEM_UPDATED)
WARM_UP = 5.0  # seconds after the commit before the rate's window opens
OTHER_ROWS = 100_000  # of the unlimited category (× scale): many seconds of drain
QUIET_TENANTS, QUIET_ROWS, FLOOD_ROWS = 20, 15, 3000
FLOOD_SHARD = 10_000
SAMPLE_EVERY = 0.5
# What the samples count apart: the limited category (the quiet tenants' in the flood runs),
# the unlimited one, and the flooding tenant's rows.
LIMITED_PART, OTHER_PART, FLOOD_PART = "limited", "other", "flood"


@dataclass(frozen=True)
class Drain:
    """What one run of the three workers saw."""

    counts: list[tuple[float, dict[str, int]]]  # (seconds since commit, rows left per part)
    starts: dict[int, float]  # row id: wall time its handler started
    committed: float  # wall time of the rows' commit
    load: float


async def run_limits(ctx: Context) -> list[dict[str, Any]]:
    window = 60.0 * min(ctx.config.scale, 1.0)
    limited_rows = _rows(LIMITED, int(RATE * (WARM_UP + window + 60)), 100, first_shard=1)
    other_rows = _rows(OTHER, scaled(OTHER_ROWS, ctx.config.scale), 100, first_shard=1001)
    rows = limited_rows + other_rows
    quiet = _rows(LIMITED, QUIET_TENANTS * QUIET_ROWS, QUIET_TENANTS, first_shard=1)
    flood = [(SCOPE, FLOOD_SHARD, LIMITED, n + 1) for n in range(FLOOD_ROWS)]
    async with ctx.temporal("file") as server:
        limit = {LIMITED: f"{RATE}/s"}
        limited = await _drain(ctx, server, "limited", rows, limit, window)
        free = await _drain(ctx, server, "unlimited", rows, {}, window)
        alone = await _drain(ctx, server, "quiet", quiet, limit, window, record_starts=True)
        both = quiet + flood
        flooded = await _drain(ctx, server, "flood", both, limit, window, record_starts=True)
    rate = _window_rate(limited.counts, WARM_UP, window)
    other_done = _done_at(limited)
    rate_alone = None if other_done is None else _window_rate(limited.counts, other_done, window)
    quiet_ids = range(1, len(quiet) + 1)  # inserted first: ids 1..n
    p99_alone, p99_flooded = _p99(alone, quiet_ids), _p99(flooded, quiet_ids)
    entry = {
        "temporal": "file",
        "workers": WORKERS,
        "limit_per_s": RATE,
        "window_s": window,
        "limited_rate_per_s": rate,
        "limited_rate_error": None if rate is None else round(rate / RATE - 1, 4),
        "limited_rate_per_s_after_other": rate_alone,
        "other_done_s": other_done,
        "other_rate_per_s_with_limit": (with_limit := _drain_rate(limited, len(other_rows))),
        "other_rate_per_s_without_limit": (without_limit := _drain_rate(free, len(other_rows))),
        "other_rate_ratio": (
            round(with_limit / without_limit, 3) if with_limit and without_limit else None
        ),
        "other_done_s_without_limit": _done_at(free),
        "quiet_p99_wait_s": p99_alone,
        "quiet_p99_wait_s_with_flood": p99_flooded,
        "flood_p99_ratio": round(p99_flooded / p99_alone, 3) if p99_alone and p99_flooded else None,
        # Rows left of the limited category (seconds after the commit, rows), each second.
        "limited_left": _series(limited, LIMITED_PART),
        "load_average": {
            name: run.load
            for name, run in (("limited", limited), ("unlimited", free), ("quiet", alone))
        }
        | {"flood": flooded.load, "after": round(os.getloadavg()[0], 2)},
    }
    for name, value in (("", rate), ("_after_other", rate_alone)):
        entry[f"limited_rate_abs_error{name}"] = (
            None if value is None else round(abs(value / RATE - 1), 4)
        )
    entry["targets"] = [
        Target("limited_rate_abs_error", 0.05, at_least=False).verdict(entry),
        Target("limited_rate_abs_error_after_other", 0.05, at_least=False).verdict(entry),
        Target("other_rate_ratio", 0.95).verdict(entry),
        Target("flood_p99_ratio", 2.0, at_least=False).verdict(entry),
    ]
    say("limits", f"{entry}")
    return [
        {
            "workload": "limits",
            "kind": "limits",
            "description": f"a {RATE}/s limit on one category shared by {WORKERS} workers; a "
            "flooding tenant beside quiet ones",
            "scale": ctx.config.scale,
            "entries": [entry],
        }
    ]


def _rows(category: int, count: int, shards: int, *, first_shard: int) -> list[Row]:
    """``count`` rows of ``category``, each its own group, dealt round-robin over ``shards``."""
    return [(SCOPE, first_shard + n % shards, category, n + 1) for n in range(count)]


async def _drain(
    ctx: Context,
    server: TemporalServer,
    label: str,
    rows: list[Row],
    rate_limits: dict[int, str],
    window: float,
    *,
    record_starts: bool = False,
) -> Drain:
    """Start the workers, commit ``rows``, and sample what is left until the table is empty
    (or the window and a margin have passed)."""
    app = make_app(table_name(f"limits_{label}"), HandlerProbe())
    await create_table(ctx.database_url, app)
    table = app.table().name
    spec = WorkerSpec(
        table,
        ctx.settings().model_dump(mode="json", exclude={"database_url"}),
        ctx.database_url,
        server.address,
        probe={"record_starts": record_starts},
        partition_options=dict(ctx.config.tuning.partition_options),
        rate_limits={str(category): rate for category, rate in rate_limits.items()},
    )
    try:
        async with worker_processes(spec, WORKERS) as outcomes:
            await spread(server.address, table, [int(o["pid"]) for o in outcomes])
            load = round(os.getloadavg()[0], 2)
            await asyncio.to_thread(copy_rows, ctx.database_url, table, rows)
            committed = time.time()
            counts = await _sample(ctx, table, label, len(rows), window)
    finally:
        await asyncio.to_thread(drop_table, ctx.database_url, table)
    starts: dict[int, float] = {}
    for outcome in outcomes:
        for row_id, at in outcome.get("starts", {}).items():
            starts[int(row_id)] = min(at, starts.get(int(row_id), at))
    return Drain(counts, starts, committed, load)


async def _sample(
    ctx: Context, table: str, label: str, total: int, window: float
) -> list[tuple[float, dict[str, int]]]:
    """Rows left of each part (:data:`PARTS`) every :data:`SAMPLE_EVERY` seconds, until the
    table is empty, or the window has closed and only the limited backlog or the flood is
    left."""
    began = time.monotonic()
    counts: list[tuple[float, dict[str, int]]] = []

    def stopped() -> bool:
        other_done = next((t for t, left in counts if not left.get(OTHER_PART)), None)
        if other_done is None:
            return False
        at, left = counts[-1]
        return not left.get(LIMITED_PART) or at >= max(WARM_UP, other_done) + window

    watching = asyncio.create_task(
        watch_drain(
            ctx.database_url,
            table,
            label=f"limits/{label}",
            total=total,
            started=began,
            deadline=ctx.phase_deadline(WARM_UP + window + 120.0),
            stopped=stopped,
        )
    )
    query = (
        f"SELECT CASE WHEN shard_identifier = {FLOOD_SHARD} THEN '{FLOOD_PART}' "
        f"WHEN category = {LIMITED} THEN '{LIMITED_PART}' ELSE '{OTHER_PART}' END, count(*) "
        f"FROM {table} GROUP BY 1"
    )
    with connect(ctx.database_url, autocommit=True) as conn:
        while not watching.done():
            found = await asyncio.to_thread(conn.execute(query).fetchall)
            counts.append((time.monotonic() - began, {str(p): int(n) for p, n in found}))
            await asyncio.sleep(SAMPLE_EVERY)
    if watching.result().completed:
        counts.append((watching.result().ended - began, {}))
    return counts


def _window_rate(
    counts: list[tuple[float, dict[str, int]]], start: float, window: float
) -> float | None:
    """Limited rows handled per second between the samples nearest the window's ends."""
    opened = next(((t, c) for t, c in counts if t >= start), None)
    closed = next(((t, c) for t, c in counts if t >= start + window), None)
    if opened is None or closed is None or not closed[1].get(LIMITED_PART):
        return None  # the backlog ran out before the window closed
    handled = opened[1].get(LIMITED_PART, 0) - closed[1][LIMITED_PART]
    return round(handled / (closed[0] - opened[0]), 2)


def _done_at(run: Drain) -> float | None:
    """When the last row of the unlimited category was handled (seconds after the commit)."""
    return next((t for t, c in run.counts if not c.get(OTHER_PART)), None)


def _drain_rate(run: Drain, rows: int) -> float | None:
    """The unlimited category's ``rows`` over the time until the last of them was handled."""
    done = _done_at(run)
    return round(rows / done, 1) if done else None


def _series(run: Drain, part: str) -> list[tuple[float, int]]:
    """Rows left of ``part`` about once a second."""
    shown: list[tuple[float, int]] = []
    for at, left in run.counts:
        if not shown or at >= shown[-1][0] + 1.0:
            shown.append((round(at, 1), left.get(part, 0)))
    return shown


def _p99(run: Drain, ids: range) -> float | None:
    waits = sorted(run.starts[i] - run.committed for i in ids if i in run.starts)
    if len(waits) < len(ids):
        return None  # not every quiet row was handled
    return round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3)
