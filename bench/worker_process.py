"""The bridge's worker in a process of its own, for a figure of the worker alone (``wide``'s
peak RSS): nothing of the bench (its rows, its direct drain, what earlier workloads left) is in
that process.

The bench starts ``python -m bench.worker_process`` and writes a :class:`WorkerSpec` to its
stdin as JSON. The process runs ``worker.serve`` with the bench's no-op handler until SIGTERM;
it prints ``serving`` once imported, as it calls ``serve`` (the bench's clock starts there, as
it does in-process), ``ready`` once the worker is ready, and at the end one JSON
line: its handler calls, its own peak RSS (the kernel's high-water mark over the whole life of
the process, not samples) and its CPU seconds.

With ``BENCH_TRACEMALLOC=FILE`` in its environment, the process traces its Python allocations
and writes to ``FILE`` the largest of them at the moment it held the most (looked at twice a
second): what a worker holds per shard. Tracing slows the worker and adds to its RSS.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import corelog
from bench.app import HandlerProbe, make_app
from bench.tuning import Tuning, applied
from outbox_bridge import OutboxSettings
from outbox_bridge.runtime.worker import serve

ROOT = Path(__file__).resolve().parents[1]
SERVING, READY = "serving", "ready"
# The longest line read from the process: its last one carries every row's start when asked.
LINE_LIMIT = 64 * 1024 * 1024


@dataclass
class WorkerSpec:
    """What the worker process needs: its table, settings and servers, and the handler's
    behaviour (the keyword arguments of :class:`~bench.app.HandlerProbe`)."""

    table: str
    settings: dict[str, Any]
    database_url: str
    temporal_address: str
    probe: dict[str, Any] = field(default_factory=dict)
    partition_options: dict[str, Any] = field(default_factory=dict)
    rate_limits: dict[str, str] = field(default_factory=dict)  # category value: "100/s"


async def run_worker_process(
    spec: WorkerSpec, stop: asyncio.Event, ready: asyncio.Event, outcome: dict[str, Any]
) -> None:
    """Run the worker process until ``stop`` is set (then SIGTERM); set ``ready`` when it says
    so, and fill ``outcome`` with what it reports at its end."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.worker_process",
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        limit=LINE_LIMIT,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    stdout = process.stdout
    outcome["pid"] = process.pid

    async def read() -> None:
        async for line in stdout:
            text = line.decode().strip()
            if text == SERVING:  # imported and about to serve: where an in-process run starts
                outcome["started"] = time.monotonic()
            elif text == READY:
                ready.set()
            elif text.startswith("{"):
                outcome.update(json.loads(text))

    process.stdin.write(json.dumps(asdict(spec)).encode())
    process.stdin.close()
    reading = asyncio.create_task(read())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
        if process.returncode is None:
            process.terminate()
        await reading
        code = await process.wait()
    finally:
        stopping.cancel()
        reading.cancel()
        if process.returncode is None:
            process.kill()
            await process.wait()
    if code != 0 or "handler_calls" not in outcome:
        raise RuntimeError(f"the worker process exited with {code} and reported {outcome}")


async def _serve(spec: WorkerSpec) -> dict[str, Any]:
    options = dict(spec.probe)
    failing = [(a, b, c, d) for a, b, c, d in options.pop("failing", [])]  # JSON made them lists
    probe = HandlerProbe(failing=failing, **options)
    stop, ready = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    async def announce() -> None:
        await ready.wait()
        print(READY, flush=True)

    announcing = asyncio.create_task(announce())
    print(SERVING, flush=True)
    traced = os.environ.get("BENCH_TRACEMALLOC")
    with applied(Tuning(partition_options=spec.partition_options)):
        async with traced_peak(Path(traced)) if traced else nullcontext():
            await serve(
                OutboxSettings(**spec.settings),
                make_app(spec.table, probe, {int(c): r for c, r in spec.rate_limits.items()}),
                stop=stop,
                database_url=spec.database_url,
                temporal_address=spec.temporal_address,
                ready=ready,
            )
    announcing.cancel()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "handler_calls": probe.calls,
        "failed_calls": probe.failed,
        "peak_concurrent_calls": probe.peak,
        "worker_peak_rss_mb": peak_rss_mb(),
        "worker_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        **({"starts": probe.starts} if probe.record_starts else {}),
    }


@asynccontextmanager
async def traced_peak(out: Path, *, top: int = 30) -> AsyncIterator[None]:
    """Trace the block's Python allocations; write the largest, by line, of the snapshot taken
    when they were the most, to ``out``."""
    tracemalloc.start()
    most: list[Any] = [0, None]  # traced bytes, snapshot

    async def look() -> None:
        while True:
            await asyncio.sleep(0.5)
            if (size := tracemalloc.get_traced_memory()[0]) > most[0]:
                most[:] = [size, tracemalloc.take_snapshot()]

    looking = asyncio.create_task(look())
    try:
        yield
    finally:
        looking.cancel()
        tracemalloc.stop()
        if most[1] is not None:
            lines = [str(stat) for stat in most[1].statistics("lineno")[:top]]
            out.write_text(f"most traced: {most[0] / 2**20:.1f} MiB\n" + "\n".join(lines) + "\n")


def peak_rss_mb() -> float | None:
    """This process's peak resident memory in MiB (Linux's ``VmHWM``), None elsewhere. Not
    ``getrusage``'s ``ru_maxrss``: a process started by another keeps its parent's peak there."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == "VmHWM":
            return round(int(value.split()[0]) / 1024, 1)  # in kB
    return None


def main() -> None:
    from bench.runner import quiet_logs  # not at the top: the runner imports this module

    spec = WorkerSpec(**json.loads(sys.stdin.read()))
    quiet_logs()
    corelog.install()
    outcome = asyncio.run(_serve(spec))
    print(json.dumps({**outcome, **corelog.COUNTER.since(0)}), flush=True)


if __name__ == "__main__":
    main()
    # As python -m bench: a process that ran a Temporal worker can crash in its teardown.
    sys.stdout.flush()
    os._exit(0)
