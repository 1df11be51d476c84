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
| ``io`` | 8,000 shards × 10 rows, each call waits 50 ms: ``io-async``, ``io-plain`` | concurrency |

``--scale`` multiplies the row and shard counts (not the 10 groups of ``coalesce``).

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
retries at once, then after 1 s and 2 s). On demand, exactly the shards with a failing group
should get an ``OutboxShard`` workflow: the entry compares the two counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.app import HandlerProbe
from bench.context import Context, scaled
from bench.progress import say
from bench.rows import RowSet, backlog_rows, distinct_rows, grouped_rows
from bench.sides import SideResult, baseline_side, bridge_side

RESERVE = 60.0  # seconds kept for closing workflows, counting events and stopping servers
FLAKY_SHARE = 0.02  # of the coalescing groups
FLAKY_FAILURES = 3  # calls that fail before the one that succeeds


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


def _many_shards(scale: float) -> RowSet:
    shards = scaled(20_000, scale)
    return distinct_rows(3 * shards, shards)


def _backlog(scale: float) -> RowSet:
    return backlog_rows(scaled(100_000, scale), scaled(1_000, scale), 0.2)


def _io(scale: float) -> RowSet:
    shards = scaled(8_000, scale)
    return distinct_rows(10 * shards, shards)


IO_WAIT_SECONDS = 0.05


def _io_workload(name: str, handler: str, *, plain: bool) -> ThroughputWorkload:
    return ThroughputWorkload(
        name,
        f"8,000 shards × 10 rows, {handler} handlers waiting 50 ms per call",
        _io,
        share=240.0,
        wait_seconds=IO_WAIT_SECONDS,
        plain=plain,
        temporal="file",
        baseline_share=20.0,
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
        _io_workload("io-async", "async def", plain=False),
        _io_workload("io-plain", "plain def", plain=True),
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
    share = min(workload.share, (ctx.left() - RESERVE) / (len(phases) + 1))
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
    for index, mode in enumerate(phases):
        # Later phases need their part of what is left of the invocation's budget.
        share = min(workload.share, (ctx.left() - RESERVE) / (len(phases) - index))
        async with ctx.temporal(mode) as server:
            bridge = await bridge_side(
                ctx,
                f"{workload.name}/bridge-{server.mode}",
                rowset,
                server,
                share=share,
                probe=workload_probe(ctx, workload, rowset),
            )
        done = "" if bridge.completed else f" (capped after {bridge.rows_done:,} rows)"
        say(workload.name, f"bridge ({server.mode}): {bridge.rows_per_s:,.0f} rows/s{done}")
        entry = throughput_entry(server.mode, rowset, baseline, bridge)
        if failing:
            entry.update(_flaky_entry(workload, failing, failing_shards, entry))
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


def _flaky_entry(
    workload: ThroughputWorkload,
    failing: set[tuple[int, int, int, int]],
    failing_shards: set[tuple[int, int]],
    entry: dict[str, Any],
) -> dict[str, Any]:
    """Failures: how many groups and shards, and whether exactly the shards with a failing
    group got a workflow of their own (on demand)."""
    expected_calls = entry["groups"] + workload.failures * len(failing)
    return {
        "failing_groups": len(failing),
        "failures_per_group": workload.failures,
        "shards_with_failing_group": len(failing_shards),
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
