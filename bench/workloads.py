"""The throughput workloads: a backlog is inserted, then drained by the baseline and by the
bridge (on each Temporal server mode), and both are reported side by side.

| workload | rows | what it measures |
|---|---|---|
| ``backlog`` | 100,000 over 1,000 shards, 5 categories, 20% coalescible | the general drain rate |
| ``hot-shard`` | 20,000 in one shard, each row its own group | one shard in series (1 thread) |
| ``coalesce`` | 50,000 in 10 groups of one shard | coalescing: exactly 10 handler calls |
| ``many-shards`` | 20,000 shards × 3 rows | a workflow per shard: start-up cost, closing, memory |

``--scale`` multiplies the row and shard counts (not the 10 groups of ``coalesce``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.context import Context, scaled
from bench.progress import say
from bench.rows import RowSet, backlog_rows, distinct_rows, grouped_rows
from bench.sides import SideResult, baseline_side, bridge_side

RESERVE = 60.0  # seconds kept for closing workflows, counting events and stopping servers


@dataclass(frozen=True)
class ThroughputWorkload:
    name: str
    summary: str
    make_rows: Callable[[float], RowSet]
    threads: int = 4  # baseline threads
    share: float = 120.0  # seconds a drain (per side and server mode) may take before its cap


def _many_shards(scale: float) -> RowSet:
    shards = scaled(20_000, scale)
    return distinct_rows(3 * shards, shards)


THROUGHPUT: dict[str, ThroughputWorkload] = {
    w.name: w
    for w in [
        ThroughputWorkload(
            "backlog",
            "100,000 rows over 1,000 shards, 5 categories, 20% coalescible, no-op handlers",
            lambda s: backlog_rows(scaled(100_000, s), scaled(1_000, s), 0.2),
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
            "20,000 shards × 3 rows: a shard workflow each; all must close after idling",
            _many_shards,
            share=600.0,  # in practice: whatever the invocation's budget has left
        ),
    ]
}


async def run_throughput(workload: ThroughputWorkload, ctx: Context) -> dict[str, Any]:
    """Measure the baseline once, then the bridge on each server mode, on identical rows."""
    rowset = workload.make_rows(ctx.config.scale)
    say(
        workload.name,
        f"{len(rowset.rows):,} rows, {rowset.shards:,} shards, {rowset.groups:,} coalescing groups",
    )
    share = min(workload.share, (ctx.left() - RESERVE) / 3)
    baseline = await baseline_side(
        ctx, f"{workload.name}/baseline", rowset, threads=workload.threads, share=share
    )
    say(workload.name, f"baseline: {baseline.rows_per_s:,.0f} rows/s")
    entries = []
    modes = ctx.modes("both")
    for index, mode in enumerate(modes):
        # Later phases need their part of what is left of the invocation's budget.
        share = min(workload.share, (ctx.left() - RESERVE) / (len(modes) - index))
        async with ctx.temporal(mode) as server:
            bridge = await bridge_side(
                ctx, f"{workload.name}/bridge-{server.mode}", rowset, server, share=share
            )
        say(workload.name, f"bridge ({server.mode}): {bridge.rows_per_s:,.0f} rows/s")
        entries.append(throughput_entry(server.mode, rowset, baseline, bridge))
    return {
        "workload": workload.name,
        "kind": "throughput",
        "description": workload.summary,
        "scale": ctx.config.scale,
        "idle_timeout": ctx.config.idle_timeout,
        "entries": entries,
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
        "bridge_completed": bridge.completed,
        **bridge.extra,
    }
