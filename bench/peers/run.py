"""Running ``python -m bench peers``: for every workload, every system in turn on the same
PostgreSQL (a database of its own each run), its worker in a process of its own, bounded in
time; the calls checked, the figures measured, the results written after each run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.cpu import CpuMeter, pid_process
from bench.peers import load
from bench.peers.base import Peer, RunSpec
from bench.peers.calls import FAILING_FILE, Call, CallReader
from bench.peers.checker import Row, Verdict, check
from bench.peers.database import Statements, create_database, drop_database
from bench.peers.progress import Coverage
from bench.peers.worker import read_commits, write_rows
from bench.peers.workloads import PeerWorkload
from bench.progress import say
from bench.servers import temporal

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT = 600.0  # schema or backlog enqueue
STOP_TIMEOUT = 30.0  # SIGTERM → SIGKILL
POLL = 0.2
FIRST_CALL_TIMEOUT = 120.0  # a worker that calls no handler by then hangs


@dataclass
class Options:
    scale: float
    concurrency: int
    base_dir: Path
    admin_url: str
    postgres: psutil.Process | None = None  # the postmaster, for its CPU
    cap: float | None = None  # seconds a drain may take (None: the workload's own)
    interpreters: dict[str, str] = field(default_factory=dict)  # system → its Python
    temporal_address: str | None = None  # a Temporal server to use (else an embedded one)
    keep_databases: bool = False


@dataclass
class Drain:
    """What one worker run saw."""

    status: str = "completed"  # completed | capped | hung | crashed
    calls: list[Call] = field(default_factory=list)
    first_start: float | None = None
    last_end: float | None = None
    cpu: dict[str, float | None] = field(default_factory=dict)
    stderr: str = ""
    writer: subprocess.Popen[str] | None = None  # the latency writer, once started


def _command(peer: Peer, log_dir: Path, *args: str) -> list[str]:
    return [peer.interpreter, "-m", "bench.peers.worker", peer.name, str(log_dir), *args]


def _step(peer: Peer, log_dir: Path, *args: str, timeout: float = STEP_TIMEOUT) -> float:
    """Run one step of a system to its end; returns its seconds."""
    began = time.monotonic()
    done = subprocess.run(
        _command(peer, log_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise StepFailed(
            f"{peer.name} {args[0]} exited with {done.returncode}: {done.stderr[-2000:]}"
        )
    return time.monotonic() - began


class StepFailed(RuntimeError):
    pass


@contextlib.contextmanager
def _process(peer: Peer, log_dir: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A process of the system's (in a session of its own), stopped at the end: SIGTERM to
    its group, SIGKILL after ``STOP_TIMEOUT``."""
    stderr = (log_dir / f"{'-'.join(args[:2])}.stderr").open("w")
    process = subprocess.Popen(
        _command(peer, log_dir, *args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stderr.close()


@contextlib.asynccontextmanager
async def _temporal(peer: Peer, options: Options) -> AsyncIterator[tuple[str | None, Any]]:
    """The Temporal server of a system that needs one: the given one, or a fresh dev server on
    its SQLite file (its CPU then counted)."""
    if not peer.needs_temporal:
        yield None, None
        return
    async with temporal("file", options.base_dir, options.temporal_address) as server:
        yield server.address, server.embedded


async def measure(name: str, workload: PeerWorkload, options: Options) -> dict[str, Any]:
    """One system on one workload: its result entry."""
    peer = load(name, options.interpreters.get(name))
    entry: dict[str, Any] = {"peer": name, **peer.describe()}
    reason = peer.missing()
    if reason:
        return {**entry, "status": "missing", "reason": reason}
    entry["versions"] = peer.versions()
    database = f"peers_{name.replace('-', '_')}_{workload.name.replace('-', '_')}"
    url, has_statements = await asyncio.to_thread(create_database, options.admin_url, database)
    log_dir = options.base_dir / database
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = workload.rows(options.scale)
    failing = workload.failing(rows)
    write_rows(log_dir, rows)
    (log_dir / FAILING_FILE).write_text(json.dumps(failing))
    async with _temporal(peer, options) as (address, embedded):
        spec = RunSpec(url, str(log_dir), database, workload.wait_seconds, options.concurrency,
                       address)  # fmt: skip
        spec.save()
        try:
            roots = {
                "postgres": options.postgres,
                "temporal": pid_process(embedded.pid_file) if embedded else None,
            }
            if options.cap is not None:
                workload = dataclasses.replace(workload, share=options.cap)
            entry.update(await _run(peer, workload, spec, rows, has_statements, roots))
        except (StepFailed, subprocess.TimeoutExpired) as exc:
            entry.update(status="crashed", reason=str(exc)[-2000:])
    entry["failing_groups"] = len(failing)
    if not options.keep_databases:
        await asyncio.to_thread(drop_database, options.admin_url, database)
    return entry


async def _run(
    peer: Peer,
    workload: PeerWorkload,
    spec: RunSpec,
    rows: list[Row],
    has_statements: bool,
    roots: dict[str, psutil.Process | None],
) -> dict[str, Any]:
    log_dir = Path(spec.log_dir)
    figures: dict[str, Any] = {}
    figures["schema_s"] = round(await asyncio.to_thread(_step, peer, log_dir, "schema"), 2)
    committed: float | None = None
    if workload.rate is None:
        figures["enqueue_s"] = round(await asyncio.to_thread(_step, peer, log_dir, "enqueue"), 2)
        committed = time.time()
    statements = Statements(spec.database_url, statements=has_statements)
    await asyncio.to_thread(statements.reset)
    drain = await _drain(peer, workload, spec, rows, roots)
    await asyncio.sleep(1.5)  # pg_stat_database: every backend has flushed its counts
    counts = await asyncio.to_thread(statements.read)
    verdict = check(rows, drain.calls, coalescing=peer.coalescing)
    commits = read_commits(log_dir) if committed is None else {}
    commits.pop(rows[0].seq, None)  # written alone, to know the workers were up: not timed
    figures.update(_figures(rows, drain, verdict, commits, committed, counts))
    if drain.status != "completed":  # rows not handled when the run stopped are not lost
        figures["check"]["unhandled_at_stop"] = figures["check"].pop("lost")
    return figures


def _stopped(
    workers: Iterable[subprocess.Popen[str]], drain: Drain, elapsed: float, overdue: bool
) -> str | None:
    """Why a drain stops before its rows are done, if it must."""
    if any(worker.poll() is not None for worker in workers):
        return "crashed"
    if not drain.calls and elapsed > FIRST_CALL_TIMEOUT:
        return "hung"
    if overdue:
        return "capped"
    return None


def _figures(
    rows: list[Row],
    drain: Drain,
    verdict: Verdict,
    commits: dict[int, float],
    committed: float | None,
    counts: dict[str, int | None],
) -> dict[str, Any]:
    """A run's figures: rows/s from the first call's start to the last row's end, latency from
    each row's commit (the backlog's: when its one transaction returned) to the start of the
    call that covered it, CPU and statements per row."""
    latencies = sorted(
        (start - (committed if committed is not None else commits[seq])) * 1000
        for seq, start in verdict.covered_at.items()
        if committed is not None or seq in commits
    )
    done = len(verdict.covered_at)
    seconds = (drain.last_end or 0.0) - (drain.first_start or 0.0)
    statements, transactions = counts.get("statements"), counts.get("transactions")
    return {
        "status": drain.status,
        "rows": len(rows),
        "rows_done": done,
        "seconds": round(seconds, 2),
        "rows_per_s": round(done / seconds, 1) if seconds > 0 else None,
        "p50_ms": round(_percentile(latencies, 50), 1) if latencies else None,
        "p99_ms": round(_percentile(latencies, 99), 1) if latencies else None,
        "check": verdict.figures(),
        "cpu_s": drain.cpu,
        "cpu_s_per_1000_rows": {
            k: round(v * 1000 / done, 3) if v is not None and done else None
            for k, v in drain.cpu.items()
        },
        "database": counts,
        "statements_per_row": round(statements / done, 2) if statements and done else None,
        "transactions_per_row": round(transactions / done, 3) if transactions and done else None,
        "stderr_tail": drain.stderr,
    }


def _percentile(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(p) - 1))]


async def _drain(
    peer: Peer,
    workload: PeerWorkload,
    spec: RunSpec,
    rows: list[Row],
    roots: dict[str, psutil.Process | None],
) -> Drain:
    """Run the system's worker processes until every row is covered or the run's time is up.
    With a rate, rows are written while they run: the first alone, once it is handled (the
    workers are up) the others at the rate."""
    log_dir = Path(spec.log_dir)
    drain = Drain()
    reader = CallReader(log_dir)
    coverage = Coverage(rows, coalescing=peer.coalescing)
    with contextlib.ExitStack() as stack:
        workers = {
            role: stack.enter_context(_process(peer, log_dir, "serve", role)) for role in peer.roles
        }
        # From the workers' start (their start-up included) to the last row.
        processes = {f"role:{role}": psutil.Process(p.pid) for role, p in workers.items()}
        meter = CpuMeter({**processes, **roots}).start()
        began = time.monotonic()
        deadline = began + workload.share
        if workload.rate is not None:
            await asyncio.to_thread(_step, peer, log_dir, "write", str(workload.rate), "0", "1")
            deadline = began + FIRST_CALL_TIMEOUT
        while True:
            new = reader.new_calls()
            drain.calls += new
            for call in new:
                drain.first_start = min(drain.first_start or call.start, call.start)
                if coverage.add(call):
                    drain.last_end = max(drain.last_end or call.end, call.end)
            if coverage.complete():
                break
            now = time.monotonic()
            if workload.rate is not None and coverage.covered and drain.writer is None:
                arguments = ("write", str(workload.rate), "1", str(len(rows)))
                drain.writer = stack.enter_context(_process(peer, log_dir, *arguments))
                deadline = now + (len(rows) - 1) / workload.rate + workload.share
            status = _stopped(workers.values(), drain, now - began, now > deadline)
            if status:
                drain.status = status
                break
            await asyncio.sleep(POLL)
        cpu = meter.stop()
        workers_cpu = [v for k, v in cpu.items() if k.startswith("role:") and v is not None]
        drain.cpu = {"workers": round(sum(workers_cpu), 2), **{k: cpu[k] for k in roots}}
        if drain.status == "capped" and drain.first_start is not None:
            drain.last_end = time.time()
    drain.calls += reader.new_calls()
    drain.stderr = "".join(
        (log_dir / f"serve-{role}.stderr").read_text()[-1500:] for role in peer.roles
    )
    say(peer.name, f"{workload.name}: {drain.status}, {coverage.covered:,} of {len(rows):,} rows")
    return drain
