"""The handler body every system runs, and the log of its calls.

Every worker process of every system calls :func:`handle` (or :func:`handle_async` where the
system runs coroutines) with the row it was given. The body waits as the workload says, fails
where it says (a failing coalescing group fails on its first ``FAILURES`` calls, counted across
processes), and appends one line per call to a file of its own process under the run's log
directory, after the call: key, row sequence, category, object, start and end wall times, pid,
and whether the call succeeded. :mod:`bench.peers.checker` reads them all.

Only the standard library: this module runs in every worker process of every system.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

LOG_DIR = "BENCH_PEERS_LOG_DIR"  # the environment variable naming the run's log directory
WAIT = "BENCH_PEERS_WAIT"  # seconds every call waits (as a call to another service would)
FAILING_FILE = "failing.json"  # [[key, category, object], ...] of the failing groups
FAILURES = 3  # calls of a failing group that fail before the one that succeeds


class FlakyFailure(Exception):
    """What a failing group's handler raises until it has failed ``FAILURES`` times."""


@dataclass(frozen=True)
class Call:
    """One handler call, as logged."""

    key: int
    seq: int
    category: int
    obj: int
    start: float
    end: float
    pid: int
    ok: bool

    def line(self) -> str:
        fields = (self.key, self.seq, self.category, self.obj, self.start, self.end, self.pid)
        return "\t".join(map(str, fields)) + ("\t1\n" if self.ok else "\t0\n")

    @classmethod
    def parse(cls, line: str) -> Call:
        key, seq, category, obj, start, end, pid, ok = line.split("\t")
        return cls(
            int(key), int(seq), int(category), int(obj), float(start), float(end), int(pid),
            ok.strip() == "1",
        )  # fmt: skip


class _Log:
    """The calls file of this process (reopened after a fork: one file per pid)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._file: TextIO | None = None
        self.directory = Path(os.environ.get(LOG_DIR, "."))
        self.wait = float(os.environ.get(WAIT, "0") or 0)
        self._failing: frozenset[tuple[int, int, int]] | None = None

    def failing(self) -> frozenset[tuple[int, int, int]]:
        if self._failing is None:
            path = self.directory / FAILING_FILE
            groups = json.loads(path.read_text()) if path.exists() else []
            self._failing = frozenset((k, c, o) for k, c, o in groups)
        return self._failing

    def write(self, call: Call) -> None:
        with self._lock:
            if self._pid != call.pid or self._file is None:
                self._pid = call.pid
                # Open for the life of the process, line-buffered: a line per call, whole.
                self._file = (self.directory / f"calls-{call.pid}.tsv").open("a", buffering=1)
            self._file.write(call.line())


_LOG = _Log()


def configure(directory: Path, wait_seconds: float) -> None:
    """Log this process's calls under ``directory``; every call waits ``wait_seconds``."""
    os.environ[LOG_DIR], os.environ[WAIT] = str(directory), str(wait_seconds)
    _LOG.directory, _LOG.wait = directory, wait_seconds


def _fails_now(key: int, category: int, obj: int) -> bool:
    """Whether this call of a failing group fails: it takes the next of the group's
    ``FAILURES`` attempt markers (created exclusively, so processes never share one)."""
    if (key, category, obj) not in _LOG.failing():
        return False
    for attempt in range(1, FAILURES + 1):
        marker = _LOG.directory / f"fail-{key}-{category}-{obj}-{attempt}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return True
    return False


def _finish(key: int, seq: int, category: int, obj: int, start: float, fail: bool) -> None:
    _LOG.write(Call(key, seq, category, obj, start, time.time(), os.getpid(), not fail))
    if fail:
        raise FlakyFailure(f"group {key}/{category}/{obj} fails (row {seq})")


def handle(key: int, seq: int, category: int, obj: int) -> None:
    """The handler body as a plain function (waits with ``time.sleep``)."""
    start = time.time()
    fail = _fails_now(key, category, obj)
    if _LOG.wait:
        time.sleep(_LOG.wait)
    _finish(key, seq, category, obj, start, fail)


async def handle_async(key: int, seq: int, category: int, obj: int) -> None:
    """The same body as a coroutine (waits with ``asyncio.sleep``)."""
    start = time.time()
    fail = _fails_now(key, category, obj)
    if _LOG.wait:
        await asyncio.sleep(_LOG.wait)
    _finish(key, seq, category, obj, start, fail)


class CallReader:
    """Reads the calls logged under a directory, each file from where the last read stopped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}

    def new_calls(self) -> list[Call]:
        calls: list[Call] = []
        for path in sorted(self.directory.glob("calls-*.tsv")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as file:
                file.seek(offset)
                data = file.read()
            complete = data.rfind(b"\n") + 1  # a line still being written waits for next time
            self._offsets[path] = offset + complete
            calls += [Call.parse(line) for line in data[:complete].decode().splitlines()]
        return calls
