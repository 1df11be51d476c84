"""The throughput workloads: a backlog is inserted, then drained by the baseline and by the
bridge (on each Temporal server mode, and for each shard workflow mode asked for), and both are
reported side by side.

| workload | rows | what it measures |
|---|---|---|
| ``backlog`` | 100,000 over 1,000 shards, 5 categories, 20% coalescible | the general drain rate |
| ``hot-shard`` | 20,000 in one shard, each row its own group | one shard in series (1 thread) |
| ``coalesce`` | 50,000 in 10 groups of one shard | coalescing: exactly 10 handler calls |
| ``many-shards`` | 20,000 shards × 3 rows | many small shards: start-up cost, closing, memory |
| ``flaky`` | the backlog's rows; 2% of the groups fail 3 times, then succeed | failures |
| ``wide`` | 200,000 shards × 1 row | a very wide outbox: rate over the whole drain, memory |
| ``io`` | 8,000 shards × 10 rows, each call waits 50 ms: ``io-async``, ``io-plain`` | concurrency |
| ``io-remote`` | ``io``, the worker's database 2 ms away each way | a database in another zone |

``--scale`` multiplies the row and shard counts (not the 10 groups of ``coalesce``).

``wide`` runs on the file server only, its worker in a process of its own
(:mod:`bench.worker_process`): ``worker_peak_rss_mb`` is that process's peak resident memory
over its whole life (the kernel's high-water mark), the worker's alone: none of the bench's rows or
leftovers.

``io-remote`` drains each ``io`` variant twice on the file server, the worker connected to
PostgreSQL directly, then through :mod:`bench.proxy` (every chunk 2 ms late each way, in a
process of its own), and reports the second rate as a share of the first (``remote_ratio``).
Its direct drain stays local: ``ratio`` is the remote rate against it.

``io`` runs twice, with an ``async def`` handler that awaits ``asyncio.sleep(0.05)`` and a plain
``def`` one that calls ``time.sleep(0.05)`` (the worker runs it in its handler threads), on the
file server only. Each reports the most calls seen under way at once. Its baseline (4 threads,
one call at a time each: 80 rows/s at most) is capped after ``baseline_share`` seconds: its rate
until then is its rate.

``flaky``: which groups fail is decided per coalescing group by a CRC-32 of its columns (2% of
them, :func:`bench.app.fails`), so it is the same on both sides and in every run, and each of
those groups fails on its first 3 calls, whichever drain, attempt or workflow makes them. The
baseline retries a failing shard's head after the bridge's ``initial_retry_interval`` (1 s),
at the first shard boundary after that, and goes on with its other shards meanwhile (see
:mod:`bench.baseline`): a group that fails 3 times waits 3 s in all on both sides (the bridge
retries at once, then after 1 s and 2 s). The bridge's partitions make those retries themselves
(``handover_after``, 5 s): no shard should get an ``OutboxShard`` workflow, unless the
setting is lowered so that a group fails more often than its partition tries it, when exactly
the shards with a failing group should: the entry compares the counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.app import HandlerProbe
from bench.context import Context, scaled
from bench.progress import say
from bench.proxy import proxied_database
from bench.rows import RowSet, backlog_rows, distinct_rows, grouped_rows
from bench.sides import SideResult, baseline_side, bridge_side
from outbox_bridge.runtime.local_retries import attempt_offsets
from outbox_bridge.workflows.models import ShardOptions

RESERVE = 60.0  # seconds kept for closing workflows, counting events and stopping servers
FLAKY_SHARE = 0.02  # of the coalescing groups
FLAKY_FAILURES = 3  # calls that fail before the one that succeeds


@dataclass(frozen=True)
class Target:
    """A figure of an entry and the bound it should reach (``at_least``) or stay under."""

    figure: str
    bound: float
    at_least: bool = True

    def verdict(self, entry: dict[str, Any]) -> dict[str, Any]:
        value = entry.get(self.figure)
        met = None
        if value is not None:
            met = value >= self.bound if self.at_least else value <= self.bound
        sign = ">=" if self.at_least else "<="
        target = f"{sign} {self.bound:g}"
        return {"figure": self.figure, "target": target, "value": value, "met": met}


@dataclass(frozen=True)
class ThroughputWorkload:
    name: str
    summary: str
    make_rows: Callable[[float], RowSet]
    threads: int = 4  # baseline threads
    share: float = 120.0  # seconds a drain (per side and server mode) may take before its cap
    failing_share: float = 0.0  # of the groups, whose handler fails ``failures`` times
    failures: int = FLAKY_FAILURES
    wait_seconds: float = 0.0  # every handler call waits this long (I/O)
    plain: bool = False  # a plain-def handler instead of an async one
    temporal: str = "both"  # the server modes measured unless --temporal says otherwise
    baseline_share: float | None = None  # the baseline's cap, if shorter than ``share``
    db_delay_ms: float = 0.0  # > 0: drain again with the worker's database this far each way
    own_process: bool = False  # the worker in a process of its own (its memory alone)
    targets: tuple[Target, ...] = ()


def _many_shards(scale: float) -> RowSet:
    shards = scaled(20_000, scale)
    return distinct_rows(3 * shards, shards)


def _backlog(scale: float) -> RowSet:
    return backlog_rows(scaled(100_000, scale), scaled(1_000, scale), 0.2)


def io_rows(scale: float) -> RowSet:
    shards = scaled(8_000, scale)
    return distinct_rows(10 * shards, shards)


def _wide(scale: float) -> RowSet:
    shards = scaled(200_000, scale)
    return distinct_rows(shards, shards)


IO_WAIT_SECONDS = 0.05
REMOTE_DELAY_MS = 2.0


def _io_workload(name: str, handler: str, *, plain: bool, remote: bool) -> ThroughputWorkload:
    where = (
        f", the worker's database {REMOTE_DELAY_MS:g} ms away each way (the direct drain's local)"
        if remote
        else ""
    )
    return ThroughputWorkload(
        name,
        f"8,000 shards × 10 rows, {handler} handlers waiting 50 ms per call{where}",
        io_rows,
        share=240.0,
        wait_seconds=IO_WAIT_SECONDS,
        plain=plain,
        temporal="file",
        baseline_share=20.0,
        db_delay_ms=REMOTE_DELAY_MS if remote else 0.0,
        targets=(Target("remote_ratio", 0.7),) if remote else (),
    )


THROUGHPUT: dict[str, ThroughputWorkload] = {
    w.name: w
    for w in [
        ThroughputWorkload(
            "backlog",
            "100,000 rows over 1,000 shards, 5 categories, 20% coalescible, no-op handlers",
            _backlog,
            share=180.0,
        ),
        ThroughputWorkload(
            "hot-shard",
            "20,000 rows in one shard, every row its own group (baseline with 1 thread)",
            lambda s: distinct_rows(scaled(20_000, s), 1),
            threads=1,
            share=90.0,
        ),
        ThroughputWorkload(
            "coalesce",
            "50,000 rows in 10 groups of one shard: 10 handler calls expected",
            lambda s: grouped_rows(scaled(50_000, s, minimum=10), 10),
            share=60.0,
        ),
        ThroughputWorkload(
            "many-shards",
            "20,000 shards × 3 rows; every shard workflow (if any) must close",
            _many_shards,
            share=600.0,  # in practice: whatever the invocation's budget has left
        ),
        ThroughputWorkload(
            "flaky",
            "the backlog's rows; 2% of the coalescing groups fail 3 times, then succeed",
            _backlog,
            share=180.0,
            failing_share=FLAKY_SHARE,
        ),
        ThroughputWorkload(
            "wide",
            "200,000 shards × 1 row, no-op handlers, one worker",
            _wide,
            share=420.0,
            temporal="file",
            own_process=True,
            targets=(Target("ratio", 5.0), Target("worker_peak_rss_mb", 200.0, at_least=False)),
        ),
        *(
            _io_workload(f"io-{kind}{suffix}", handler, plain=kind == "plain", remote=bool(suffix))
            for suffix in ("", "-remote")
            for kind, handler in (("async", "async def"), ("plain", "plain def"))
        ),
    ]
}


def workload_probe(ctx: Context, workload: ThroughputWorkload, rowset: RowSet) -> HandlerProbe:
    """The handler of ``workload``'s rows (failing where the workload says so)."""
    failing = rowset.failing_groups(workload.failing_share) if workload.failing_share else ()
    return HandlerProbe(
        failing=failing,
        failures=workload.failures,
        yield_once=ctx.config.handler_yield,
        wait_seconds=workload.wait_seconds,
        plain=workload.plain,
    )


async def run_throughput(workload: ThroughputWorkload, ctx: Context) -> list[dict[str, Any]]:
    """Measure the baseline once, then the bridge on each server mode for each shard workflow
    mode, on identical rows; one result per shard workflow mode."""
    rowset = workload.make_rows(ctx.config.scale)
    failing = rowset.failing_groups(workload.failing_share) if workload.failing_share else set()
    failing_shards = {group[:2] for group in failing}
    say(
        workload.name,
        f"{len(rowset.rows):,} rows, {rowset.shards:,} shards, {rowset.groups:,} coalescing groups"
        + (
            f", {len(failing):,} failing {workload.failures} times in {len(failing_shards):,} "
            "shards"
            if failing
            else ""
        ),
    )
    phases = ctx.modes(workload.temporal)
    routes = ["local", "remote"] if workload.db_delay_ms else ["local"]
    drains = len(phases) * len(routes)
    share = min(workload.share, (ctx.left() - RESERVE) / (drains + 1))
    baseline = await baseline_side(
        ctx,
        f"{workload.name}/baseline",
        rowset,
        threads=workload.threads,
        share=min(share, workload.baseline_share or share),
        probe=workload_probe(ctx, workload, rowset),
    )
    say(workload.name, f"baseline: {baseline.rows_per_s:,.0f} rows/s")
    entries: list[dict[str, Any]] = []
    for mode in phases:
        sides: dict[str, SideResult] = {}
        for route in routes:
            # Later drains need their part of what is left of the invocation's budget.
            share = min(workload.share, (ctx.left() - RESERVE) / drains)
            drains -= 1
            sides[route] = await _bridge_drain(
                ctx, workload, rowset, mode, share=share, remote=route == "remote"
            )
        bridge = sides[routes[-1]]
        entry = throughput_entry(bridge.extra["temporal"], rowset, baseline, bridge)
        if failing:
            entry.update(_flaky_entry(workload, failing, failing_shards, entry))
        if workload.db_delay_ms:
            entry.update(_remote_entry(sides["local"], bridge))
        if workload.targets:
            entry["targets"] = [target.verdict(entry) for target in workload.targets]
        entries.append(entry)
    return [
        {
            "workload": workload.name,
            "kind": "throughput",
            "description": workload.summary,
            "scale": ctx.config.scale,
            "entries": entries,
        }
    ]


async def _bridge_drain(
    ctx: Context,
    workload: ThroughputWorkload,
    rowset: RowSet,
    mode: str,
    *,
    share: float,
    remote: bool,
) -> SideResult:
    """One drain by the bridge on a fresh Temporal server, the worker connected to the
    database directly or, when ``remote``, through a proxy that delays it."""
    async with ctx.temporal(mode) as server, contextlib.AsyncExitStack() as stack:
        label = f"{workload.name}/bridge-{server.mode}" + ("-remote" if remote else "")
        proxy = None
        if remote:
            proxy = await stack.enter_async_context(
                proxied_database(ctx.database_url, workload.db_delay_ms)
            )
        bridge = await bridge_side(
            ctx,
            label,
            rowset,
            server,
            share=share,
            probe=workload_probe(ctx, workload, rowset),
            worker_database_url=proxy.url if proxy else None,
            own_process=workload.own_process,
        )
    bridge.extra["temporal"] = server.mode
    if proxy is not None:
        bridge.extra["db_delay_ms"] = proxy.delay_ms
        bridge.extra["db_proxy_connections"] = proxy.connections
    done = "" if bridge.completed else f" (capped after {bridge.rows_done:,} rows)"
    say(workload.name, f"{label}: {bridge.rows_per_s:,.0f} rows/s{done}")
    return bridge


def _remote_entry(local: SideResult, remote: SideResult) -> dict[str, Any]:
    """The remote drain against the local one of the same run (the direct drain stays local)."""
    return {
        "local_bridge_rows_per_s": round(local.rows_per_s, 1),
        "local_bridge_completed": local.completed,
        "local_peak_concurrent_calls": local.extra["peak_concurrent_calls"],
        "remote_ratio": round(remote.rows_per_s / local.rows_per_s, 4)
        if local.rows_per_s
        else None,
        "baseline_database": "local",
    }


def _flaky_entry(
    workload: ThroughputWorkload,
    failing: set[tuple[int, int, int, int]],
    failing_shards: set[tuple[int, int]],
    entry: dict[str, Any],
) -> dict[str, Any]:
    """Failures: how many groups and shards, and how many shards should get a workflow of
    their own: those with a failing group if it fails more often than its partition tries it
    (``handover_after``), none otherwise."""
    expected_calls = entry["groups"] + workload.failures * len(failing)
    settings = entry["settings"]
    options = ShardOptions(
        initial_retry_seconds=settings["initial_retry_interval"],
        max_retry_interval_seconds=settings["max_retry_interval"],
    )
    tries = 1 + len(attempt_offsets(options, settings["handover_after"]))
    return {
        "failing_groups": len(failing),
        "failures_per_group": workload.failures,
        "shards_with_failing_group": len(failing_shards),
        "partition_attempts": tries,
        "expected_shard_workflows": len(failing_shards) if workload.failures >= tries else 0,
        "expected_handler_calls": expected_calls,
        "duplicate_handler_calls": max(0, entry["handler_calls"] - expected_calls)
        if entry["bridge_completed"]
        else None,
    }


def throughput_entry(
    mode: str, rowset: RowSet, baseline: SideResult, bridge: SideResult
) -> dict[str, Any]:
    return {
        "temporal": mode,
        "rows": len(rowset.rows),
        "shards": rowset.shards,
        "groups": rowset.groups,
        "completed": baseline.completed and bridge.completed,
        "bridge_rows_per_s": round(bridge.rows_per_s, 1),
        "baseline_rows_per_s": round(baseline.rows_per_s, 1),
        "ratio": round(bridge.rows_per_s / baseline.rows_per_s, 4) if baseline.rows_per_s else None,
        "seconds": round(bridge.seconds, 3),
        "rows_done": bridge.rows_done,
        "handler_calls": bridge.handler_calls,
        # At least once: a drain retried after a workflow task timeout calls handlers again.
        "duplicate_handler_calls": max(0, bridge.handler_calls - rowset.groups)
        if bridge.completed
        else None,
        "baseline_seconds": round(baseline.seconds, 3),
        "baseline_rows_done": baseline.rows_done,
        "baseline_handler_calls": baseline.handler_calls,
        "baseline_completed": baseline.completed,
        "baseline_threads": baseline.extra["threads"],
        "baseline_retry_interval_s": baseline.extra["retry_interval_s"],
        "baseline_failed_calls": baseline.extra["failed_calls"],
        "baseline_cpu_s": baseline.extra["cpu_s"],
        "baseline_peak_concurrent_calls": baseline.extra["peak_concurrent_calls"],
        "bridge_completed": bridge.completed,
        **bridge.extra,
    }
