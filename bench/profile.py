"""``python -m bench.profile``: where the worker's CPU goes while it drains a workload.

It inserts a throughput workload's rows (``backlog`` by default), then samples this process
with ``py-spy record`` (installed separately: ``pip install py-spy``) while the bridge drains
them, exactly as ``python -m bench`` measures the bridge side. It writes, under ``--out``:

- ``profile-<workload>.txt``: the CPU seconds of the worker, PostgreSQL and Temporal during the
  drain, the share of the worker's samples by library (where the innermost Python frame is),
  and the functions with the most samples, inclusive and self;
- ``profile-<workload>.svg``: py-spy's flame graph of the same run (a second, non-blocking
  sampler);
- ``profile-<workload>.collapsed``: the folded stacks, for other tools (not kept in git).

Only Python frames are sampled: time in the Temporal SDK's Rust core or in libpq shows as the
Python call that waits for it, or not at all when no Python frame is running.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

from bench import corelog, tuning
from bench.context import DEFAULT_OUT, BenchConfig, Context
from bench.progress import say
from bench.runner import quiet_logs
from bench.servers import database
from bench.sides import bridge_side
from bench.tuning import applied
from bench.workloads import THROUGHPUT, workload_probe

# The library a frame belongs to, by the path py-spy shows for it (first match wins).
LIBRARIES = [
    ("outbox_bridge/runtime/rounds", "outbox_bridge: drain rounds"),
    ("outbox_bridge/runtime/heads", "outbox_bridge: drain rounds"),
    ("outbox_bridge/runtime/fence", "outbox_bridge: drain rounds"),
    ("outbox_bridge/runtime/round_writes", "outbox_bridge: drain rounds"),
    ("outbox_bridge/runtime/calls", "outbox_bridge: handler calls (calls.py)"),
    ("outbox_bridge/runtime/partition_drain", "outbox_bridge: partition drain"),
    ("outbox_bridge/db/", "outbox_bridge: SQL statements (db/)"),
    ("outbox_bridge/observability", "outbox_bridge: observability"),
    ("outbox_bridge", "outbox_bridge: other"),
    ("workflows/", "outbox_bridge: workflows"),
    ("bench/", "bench (handler probe, progress watcher)"),
    ("sqlalchemy/", "SQLAlchemy"),
    ("psycopg", "psycopg"),
    ("temporalio/", "Temporal SDK (Python side)"),
    ("asyncio/", "asyncio event loop"),
    ("selectors", "asyncio event loop"),
    ("concurrent/", "threads"),
    ("threading", "threads"),
]


def library(frame: str) -> str:
    for needle, name in LIBRARIES:
        if needle in frame:
            return name
    return "other"


def summarize(collapsed: Path, *, top: int = 30) -> tuple[int, str]:
    """The number of samples and a text summary of py-spy's folded stacks."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    libraries: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames and frames[0].startswith(("process ", "thread ")):
            frames = frames[1:]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        libraries[library(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return 0, "no samples\n"

    def pct(count: int) -> str:
        return f"{100 * count / total:5.1f}%"

    lines = [f"{total:,} samples of Python stacks that were not idle", ""]
    lines.append("Self samples by library (where the innermost frame is):")
    lines += [f"  {pct(c)}  {name}" for name, c in libraries.most_common()]
    lines += ["", f"Inclusive, top {top} (a frame counted once per sample):"]
    lines += [f"  {pct(c)}  {frame}" for frame, c in inclusive.most_common(top)]
    lines += ["", f"Self, top {top}:"]
    lines += [f"  {pct(c)}  {frame}" for frame, c in own.most_common(top)]
    return total, "\n".join(lines) + "\n"


class StatementCounter:
    """SQL statements run by every engine of this process while installed, by kind (the
    statement's first words)."""

    def __init__(self) -> None:
        self.kinds: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> StatementCounter:
        event.listen(Engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._count)

    def _count(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        words = " ".join(statement.split())
        self.kinds[_kind(words)] += 1

    def summary(self) -> str:
        total = sum(self.kinds.values())
        lines = [
            f"SQL statements through SQLAlchemy: {total:,} (the drains' deletes and unlocks go "
            "straight to psycopg and are not counted)"
        ]
        lines += [f"  {count:8,}  {kind}" for kind, count in self.kinds.most_common(12)]
        return "\n".join(lines) + "\n"


def _kind(statement: str) -> str:
    upper = statement.upper()
    for needle, name in [
        ("PG_TRY_ADVISORY_LOCK", "lock shards"),
        ("PG_ADVISORY_UNLOCK", "unlock shards"),
        ("CROSS JOIN LATERAL", "read windows"),
        ("WITH S AS", "read group tails"),
        ("DELETE FROM", "delete handled rows"),
        ("INSERT INTO", "hold shard"),
    ]:
        if needle in upper:
            return name
    return statement[:60]


class GcTimer:
    """Time spent in the garbage collector, per generation, while installed."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]  # CPU seconds of the collecting thread
        self.collections = [0, 0, 0]
        self._began = 0.0

    def __enter__(self) -> GcTimer:
        self.tracked = len(gc.get_objects())
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.thread_time()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.thread_time() - self._began
            self.collections[generation] += 1

    def summary(self) -> str:
        parts = [
            f"generation {g}: {self.collections[g]:,} collections, {self.seconds[g]:.2f} CPU s"
            for g in range(3)
        ]
        return (
            f"Garbage collector: {sum(self.seconds):.2f} CPU s ({'; '.join(parts)}); "
            f"{self.tracked:,} objects tracked before the drain\n"
        )


def _sampler(pid: int, output: Path, fmt: str, rate: int, *, gil: bool) -> subprocess.Popen[bytes]:
    # This environment's scripts first: py-spy installed in a venv that is not activated.
    spy = shutil.which("py-spy", path=sysconfig.get_path("scripts")) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    command = [spy, "record", "--pid", str(pid), "--format", fmt, "--output", str(output)]
    command += ["--rate", str(rate), "--nonblocking", "--function", *(["--gil"] if gil else [])]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stop(sampler: subprocess.Popen[bytes]) -> None:
    sampler.send_signal(signal.SIGINT)
    try:
        _, err = sampler.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        sampler.kill()
        return
    if sampler.returncode not in (0, -signal.SIGINT):
        print(err.decode(errors="replace")[-2000:], file=sys.stderr)


async def profile(args: argparse.Namespace) -> None:
    config = BenchConfig.from_environment(
        scale=args.scale,
        out=args.out,
        temporal=args.temporal,
        budget=args.budget,
        tuning=args.tuning,
    )
    workload = THROUGHPUT[args.workload]
    args.load_before = os.getloadavg()
    rowset = workload.make_rows(config.scale)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile-{args.workload}"
    with tempfile.TemporaryDirectory(prefix="outbox-profile-") as tmp:
        base = Path(tmp)
        async with database(base, config.database_url) as url:
            ctx = Context(config, url, base, time.monotonic() + config.budget)
            async with ctx.temporal(args.temporal) as server:
                raw = out / f"{name}.collapsed"
                raw.unlink(missing_ok=True)
                samplers = []
                if args.rate > 0:
                    samplers = [
                        _sampler(os.getpid(), raw, "raw", args.rate, gil=args.gil),
                        _sampler(
                            os.getpid(), out / f"{name}.svg", "flamegraph", args.rate, gil=args.gil
                        ),
                    ]
                try:
                    with (
                        GcTimer() as gc_timer,
                        StatementCounter() as statements,
                        applied(args.tuning),
                    ):
                        result = await bridge_side(
                            ctx,
                            f"{args.workload}/profile-{server.mode}",
                            rowset,
                            server,
                            share=args.seconds,
                            probe=workload_probe(ctx, workload, rowset),
                        )
                finally:
                    for sampler in samplers:
                        await asyncio.to_thread(_stop, sampler)
    samples, text = summarize(raw) if raw.exists() else (0, "py-spy wrote no stacks\n")
    header = _header(args, rowset.rows, result.rows_done, result.seconds, result.extra)
    header += gc_timer.summary() + statements.summary()
    (out / f"{name}.txt").write_text(header + "\n" + text)
    say("profile", f"{samples:,} samples; summary {out / f'{name}.txt'}")
    print(header + "\n" + text)


def _header(
    args: argparse.Namespace, rows: list[Any], done: int, seconds: float, extra: dict[str, Any]
) -> str:
    cpu = extra.get("cpu_s") or {}
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in cpu.items() if v is not None)
    tuned = "".join(f" --partition-option {o}" for o in args.partition_option)
    if args.max_undeleted_groups is not None:
        tuned += f" --max-undeleted-groups {args.max_undeleted_groups}"
    if args.gil:
        tuned += " --gil"
    return (
        f"python -m bench.profile {args.workload} --scale {args.scale} --temporal "
        f"{args.temporal}{tuned}\n"
        f"{done:,} of {len(rows):,} rows in {seconds:.1f} s ({done / seconds:,.0f} rows/s) "
        f"while sampled at {args.rate} Hz; load average before: "
        f"{' '.join(f'{x:.2f}' for x in args.load_before)}, after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
        f"CPU during the drain: {parts} (wall {seconds:.1f} s; {os.cpu_count()} cores)\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    # The remote io variants are left out: the profile's worker connects to the database directly.
    local = sorted(name for name, workload in THROUGHPUT.items() if not workload.db_delay_ms)
    parser.add_argument("workload", nargs="?", default="backlog", choices=local)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--temporal", choices=["file", "memory"], default="memory")
    parser.add_argument(
        "--rate", type=int, default=100, help="samples per second (0: measure without sampling)"
    )
    parser.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread holding the interpreter lock: where the worker's Python "
        "spends its CPU, without the threads that wait (a handler's sleep, the lock itself)",
    )
    parser.add_argument("--seconds", type=float, default=300.0, help="cap of the drain")
    parser.add_argument("--budget", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    tuning.add_arguments(parser)
    args = parser.parse_args(argv)
    args.tuning = tuning.from_arguments(parser, args)
    quiet_logs()
    corelog.install()
    asyncio.run(profile(args))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
