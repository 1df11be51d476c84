"""``python -m bench.round_steps [bench arguments]``: where a lone row's wait for its handler
goes, step by step, under light traffic.

It runs what ``python -m bench`` runs with the given arguments (``latency --latency-seconds 20
--temporal memory``, say) and times each partition round that drains one shard named by a
notification: from the notification to the round's start, the connection, the shard's lock,
the head read (its two statements apart) and the handler calls' start. Every 500 such rounds,
and once more at the end, it appends each step's p50, p90 and p99 to ``--steps FILE``
(default ``round-steps.txt`` in the working directory), the last report last.

The timing wraps functions of the worker by name (``ShardHub.offer_to_partition``,
``PartitionDrain._round``, ``try_lock_shards``, ``read_shard_heads``, ``read_windows``,
``read_rows``, ``HandlerCalls.run``): a figure of the bench, never of a running deployment.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import outbox_bridge.runtime.calls as calls
import outbox_bridge.runtime.heads as heads
import outbox_bridge.runtime.hub as hub
import outbox_bridge.runtime.partition_drain as partition_drain
import outbox_bridge.runtime.rounds as rounds
from bench.__main__ import main as bench_main

STEPS = ["notified", "round", "connected", "locked", "heads read", "calls"]
REPORT_EVERY = 500


class Steps:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.notified: dict[Any, float] = {}
        self.open: dict[Any, dict[str, float]] = {}
        self.done: list[dict[str, float]] = []
        self.statements: dict[str, list[float]] = {}

    def mark(self, shards: Any, step: str) -> None:
        now = time.perf_counter()
        for shard in shards:
            if shard in self.open:
                self.open[shard][step] = now

    def finish(self, shard: Any) -> None:
        steps = self.open.pop(shard, None)
        if steps is None:
            return
        steps["calls"] = time.perf_counter()
        self.done.append(steps)
        if len(self.done) % REPORT_EVERY == 0:
            self.report()

    def report(self) -> None:
        complete = [d for d in self.done if all(step in d for step in STEPS)]
        lines = [f"{len(complete):,} rounds of one notified shard"]
        for before, after in itertools.pairwise(STEPS):
            lines.append(_line(f"{before} -> {after}", [d[after] - d[before] for d in complete]))
        lines.append(_line("notified -> calls", [d["calls"] - d["notified"] for d in complete]))
        for name, seconds in self.statements.items():
            lines.append(_line(f"statement {name}", seconds[-len(complete) or None :]))
        with self.out.open("a") as file:
            file.write("\n".join(lines) + "\n\n")


def _line(name: str, seconds: list[float]) -> str:
    if not seconds:
        return f"{name:<28} -"
    ms = sorted(s * 1000 for s in seconds)
    p90, p99 = ms[int(len(ms) * 0.9)], ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"{name:<28} p50 {statistics.median(ms):.3f} ms  p90 {p90:.3f}  p99 {p99:.3f}"


def _wrap(steps: Steps) -> None:
    offer = hub.ShardHub.offer_to_partition

    def offered(self: Any, key: Any, max_id: int) -> bool:
        steps.notified.setdefault(key, time.perf_counter())
        return offer(self, key, max_id)

    round_ = partition_drain.PartitionDrain._round

    async def one_round(self: Any, shards: list[Any]) -> None:
        if len(shards) == 1 and shards[0] in steps.notified:
            when = steps.notified.pop(shards[0])
            steps.open[shards[0]] = {"notified": when, "round": time.perf_counter()}
        await round_(self, shards)

    lock = getattr(rounds, "try_lock_shards")  # the names rounds calls them by  # noqa: B009

    async def locked(conn: Any, shards: Any) -> Any:
        steps.mark(shards, "connected")
        taken = await lock(conn, shards)
        steps.mark(shards, "locked")
        return taken

    read = heads.read_shard_heads

    async def read_heads(execute: Any, table: Any, shards: Any, **options: Any) -> Any:
        found = await read(execute, table, shards, **options)
        steps.mark(shards, "heads read")
        return found

    run = calls.HandlerCalls.run

    async def calls_run(self: Any, shard: Any, *args: Any, **options: Any) -> Any:
        steps.finish(shard)
        return await run(self, shard, *args, **options)

    hub.ShardHub.offer_to_partition = offered  # type: ignore[method-assign]
    partition_drain.PartitionDrain._round = one_round  # type: ignore[method-assign]
    setattr(rounds, "try_lock_shards", locked)  # noqa: B010
    setattr(rounds, "read_shard_heads", read_heads)  # noqa: B010
    calls.HandlerCalls.run = calls_run  # type: ignore[method-assign]
    for name in ("read_windows", "read_rows"):
        setattr(heads, name, _timed(getattr(heads, name), steps.statements.setdefault(name, [])))


def _timed(statement: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    @functools.wraps(statement)
    async def timed(*args: Any, **options: Any) -> Any:
        began = time.perf_counter()
        try:
            return await statement(*args, **options)
        finally:
            seconds.append(time.perf_counter() - began)

    return timed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.round_steps", add_help=False)
    parser.add_argument("--steps", type=Path, default=Path("round-steps.txt"))
    known, rest = parser.parse_known_args(argv)
    steps = Steps(known.steps)
    _wrap(steps)
    try:
        return bench_main(rest)
    finally:
        steps.report()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # As python -m bench: a process that ran a Temporal worker can crash in teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
