"""Running real worker processes against real servers, injecting faults, and recording the
figures of each scenario."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.api.history.v1 import History as HistoryProto
from temporalio.client import Client

from outbox_bridge.dev.embedded import EmbeddedTemporal, temporal_cli
from tests.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
FAULT_APP = "tests.faults.fault_app:app"
# The database password given to every worker: it must never appear in what they print.
PASSWORD_CANARY = "pg-pass-canary-41c7"
READY_LINE = "outbox-bridge is running"
# What a worker logs when the bridge or the worker itself met an unexpected exception. The
# bridge restarts and its sweeps repair what it left behind, so a scenario would pass unless
# it looks for these lines.
FAILURE_LINES = ("bridge failed", "outbox-bridge stopped on an unexpected error")


def clean_env(**extra: str) -> dict[str, str]:
    """A subprocess environment with no OUTBOX_*/TEMPORAL_*/FAULT_* settings of ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("OUTBOX_", "TEMPORAL_", "FAULT_", "SAMPLE_OUTBOX"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def with_password(database_url: str) -> tuple[str, str]:
    """``database_url`` with a password the test can look for (the embedded PostgreSQL
    trusts any password), and that password; an external database keeps its own."""
    url = make_url(database_url)
    if url.password:
        return database_url, str(url.password)
    return url.set(password=PASSWORD_CANARY).render_as_string(hide_password=False), PASSWORD_CANARY


def worker_env(
    database_url: str, temporal_address: str, table: str, task_queue: str, **extra: str
) -> dict[str, str]:
    """Settings for a fault worker: short timers, so that retries and sweeps come quickly."""
    settings = {
        "OUTBOX_APP": FAULT_APP,
        "FAULT_OUTBOX_TABLE": table,
        "OUTBOX_DATABASE_URL": database_url,
        "TEMPORAL_ADDRESS": temporal_address,
        "OUTBOX_TASK_QUEUE": task_queue,
        "OUTBOX_HEALTH_PORT": "0",
        "OUTBOX_POLL_INTERVAL": "0.5",
        "OUTBOX_SWEEP_INTERVAL": "3",
        "OUTBOX_INITIAL_RETRY_INTERVAL": "0.2",
        "OUTBOX_MAX_RETRY_INTERVAL": "1",
        # A failing shard gets its workflow at its first failure, as in the testing toolkit:
        # the scenarios that watch, terminate or reset it find it at once.
        "OUTBOX_HANDOVER_AFTER": "0",
        "OUTBOX_HANDLER_TIMEOUT": "20",
        "OUTBOX_HEARTBEAT_TIMEOUT": "3",
        "OUTBOX_SHUTDOWN_GRACE": "2",
    }
    settings.update(extra)
    return clean_env(**settings)


class WorkerProcess:
    """``python worker.py`` as a subprocess; its output goes to files under ``logs``, kept
    across restarts."""

    started: ClassVar[list[WorkerProcess]] = []  # killed after each test (see conftest)

    def __init__(self, env: dict[str, str], logs: Path, name: str = "worker") -> None:
        WorkerProcess.started.append(self)
        self.env = env
        self.name = name
        self.stdout_path = logs / f"{name}.stdout"
        self.stderr_path = logs / f"{name}.stderr"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0
        self.pids: list[int] = []  # of every start, in order
        self.started_at: list[float] = []  # time.monotonic() before each start, in order
        self.killed_pids: list[int] = []
        self.output_checked = False
        self._ready_offset = 0

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None
        self._ready_offset = self.stdout_path.stat().st_size if self.stdout_path.exists() else 0
        self.started_at.append(time.monotonic())
        with open(self.stdout_path, "ab") as out, open(self.stderr_path, "ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "worker.py"],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        self.starts += 1
        self.pids.append(self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def ready(self, timeout: float = 90) -> None:
        """Wait for this start's banner (printed once the bridge runs)."""

        def banner() -> bool:
            if not self.running:
                raise AssertionError(f"{self.name} exited early\n{self.output()[-5000:]}")
            with open(self.stdout_path, "rb") as out:
                out.seek(self._ready_offset)
                return READY_LINE.encode() in out.read()

        await wait_until(banner, timeout=timeout, interval=0.1, what=f"{self.name} ready")

    def kill(self) -> None:
        """kill -9: no shutdown, no cleanup, connections dropped by the kernel."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.kills += 1
        self.killed_pids.append(self.process.pid)

    def freeze(self) -> None:
        """SIGSTOP: the process stops where it is (a paused VM, a long stall), its connections
        open and its locks held; it misses its heartbeats."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: a frozen process runs on from where it stopped."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM without waiting: the worker stops polling at once and exits once what it
        runs has returned (:meth:`stop` collects its exit code)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    async def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"{self.name} did not stop within {timeout:.0f}s") from None
        return int(self.process.returncode)

    @classmethod
    def kill_leftovers(cls) -> None:
        """Kill the workers that a failed test left running."""
        for worker in cls.started:
            if worker.running:
                worker.kill()
        cls.started.clear()

    def output(self) -> str:
        parts = []
        for path in (self.stdout_path, self.stderr_path):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def check_output(self) -> None:
        """Fail if any start of this worker logged an unexpected exception (see
        :data:`FAILURE_LINES`)."""
        self.output_checked = True
        output = self.output()
        for line in FAILURE_LINES:
            at = output.find(line)
            if at >= 0:
                raise AssertionError(
                    f"{self.name} logged {line!r}:\n{output[max(0, at - 300) : at + 3000]}"
                )

    @classmethod
    def check_outputs(cls) -> None:
        """:meth:`check_output` for every worker started since the last call whose output
        was not checked yet (conftest calls it after each test)."""
        unchecked = [worker for worker in cls.started if not worker.output_checked]
        for worker in unchecked:
            worker.check_output()


def new_table() -> str:
    return f"f_{uuid.uuid4().hex[:10]}"


def new_task_queue() -> str:
    return f"tq-fault-{uuid.uuid4().hex[:8]}"


async def outbox_count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


async def wait_drained(engine: AsyncEngine, table: str, *, timeout: float, left: int = 0) -> None:
    async def drained() -> bool:
        try:
            return await outbox_count(engine, table) <= left
        except Exception:  # the database may be restarting
            return False

    await wait_until(drained, timeout=timeout, interval=0.25, what=f"{table} drained")


async def calls_of_shard(engine: AsyncEngine, table: str, shard: int) -> list[str]:
    """The outcomes of the handler calls of a shard, in order."""
    async with engine.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT outcome FROM fault_calls WHERE outbox_table = :t AND "
                "shard_identifier = :s ORDER BY seq"
            ),
            {"t": table, "s": shard},
        )
        return list(result.scalars())


async def command(
    env: dict[str, str],
    *args: str,
    ok: tuple[int, ...] = (0,),
    module: str | None = "outbox_bridge",
    timeout: float = 60.0,
) -> str:
    """``python -m outbox_bridge ARGS`` (``python worker.py ARGS`` without a module); its
    output. Its exit code must be one of ``ok``; it is given ``timeout`` seconds (more than
    a timeout of its own, such as a flush's ``--timeout``)."""
    argv = ["-m", module, *args] if module else ["worker.py", *args]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=ROOT,
        env={**env, "COLUMNS": "200"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    output = out.decode() + err.decode()
    assert process.returncode in ok, output
    return output


# -- Temporal ---------------------------------------------------------------------------------


async def wipe_temporal(temporal: EmbeddedTemporal) -> None:
    """Lose every workflow: stop the dev server, delete its database file, start it again."""
    temporal.kill()
    for path in temporal.data_dir.glob("temporal.db*"):
        path.unlink()
    await temporal.start(timeout=60)


async def temporal_command(address: str, *args: str) -> str:
    """Run the ``temporal`` CLI against ``address``; returns its output, raises on failure."""
    process = await asyncio.create_subprocess_exec(
        temporal_cli(),
        *args,
        "--address",
        address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise AssertionError(f"temporal {' '.join(args)} failed: {err.decode()}")
    return out.decode()


async def histories_containing(client: Client, needles: Iterable[str]) -> dict[str, list[str]]:
    """For each needle, the workflow runs whose history contains it, scanning every run of
    every workflow in the namespace: the serialized events (payloads are raw bytes there, not
    base64) and their JSON export."""
    wanted = {needle: needle.encode() for needle in needles}
    found: dict[str, list[str]] = {needle: [] for needle in wanted}
    runs = [(w.id, w.run_id) async for w in client.list_workflows()]
    semaphore = asyncio.Semaphore(20)

    async def scan(workflow_id: str, run_id: str) -> None:
        async with semaphore:
            history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        raw = HistoryProto(events=history.events).SerializeToString()
        exported = history.to_json()
        for needle, encoded in wanted.items():
            if encoded in raw or needle in exported:
                found[needle].append(f"{workflow_id}/{run_id}")

    await asyncio.gather(*(scan(w, r) for w, r in runs))
    assert runs, "no workflow history to scan"
    return found


# -- figures ----------------------------------------------------------------------------------


@dataclass
class Figures:
    """One line of the fault summary table."""

    scenario: str
    rows: int
    faults: str
    lost: int
    order_violations: int
    overlaps: int
    duplicates: int
    recovery_seconds: float


# The figures of the scenarios that ran in this process (see tests/conftest.py).
FIGURES = pytest.StashKey[list[Figures]]()


def summary_lines(figures: list[Figures]) -> list[str]:
    """The fault summary table, a line per scenario."""
    header = (
        "scenario",
        "rows",
        "faults injected",
        "rows lost",
        "order violations",
        "overlaps",
        "duplicate calls",
        "recovery",
    )
    lines = [
        (
            f.scenario,
            f"{f.rows:,}",
            f.faults,
            str(f.lost),
            str(f.order_violations),
            str(f.overlaps),
            f"{f.duplicates:,}",
            f"{f.recovery_seconds:.1f} s",
        )
        for f in figures
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return [
        " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))
        for row in [header, tuple("-" * w for w in widths), *lines]
    ]


class Clock:
    """Seconds since the last fault: the recovery time once the table is drained."""

    def __init__(self) -> None:
        self.last_fault = time.monotonic()

    def fault(self) -> None:
        self.last_fault = time.monotonic()

    def since_fault(self) -> float:
        return time.monotonic() - self.last_fault
