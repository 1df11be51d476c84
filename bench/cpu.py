"""CPU time of the processes a measurement involves: this one (the bench, and the worker it
runs in-process), the embedded PostgreSQL server (every backend included) and the embedded
Temporal dev server. A measurement records how many CPU seconds each used while it ran, which
says what bounded it on a machine with few cores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def _own(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def tree_seconds(root: psutil.Process) -> float:
    """CPU seconds of ``root`` and of its children: those alive, and those it has reaped (the
    PostgreSQL backends of closed connections)."""
    try:
        times = root.cpu_times()
        total = float(times.user + times.system + times.children_user + times.children_system)
        children = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    for child in children:
        with contextlib.suppress(psutil.Error):
            total += _own(child)
    return total


def postgres_root(data_dir: Path) -> psutil.Process | None:
    """The postmaster whose command line names ``data_dir``, if it runs."""
    wanted = str(data_dir.resolve())
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if cmdline and "postgres" in Path(cmdline[0]).name and wanted in cmdline:
            return process
    return None


def pid_process(pid_file: Path) -> psutil.Process | None:
    try:
        return psutil.Process(int(pid_file.read_text()))
    except (OSError, ValueError, psutil.Error):
        return None


@dataclass
class CpuMeter:
    """CPU seconds used by each named process tree between :meth:`start` and :meth:`stop`."""

    roots: dict[str, psutil.Process | None]
    used: dict[str, float | None] = field(default_factory=dict)
    _before: dict[str, float] = field(default_factory=dict)

    def _read(self) -> dict[str, float]:
        return {
            name: (_own(root) if root.pid == psutil.Process().pid else tree_seconds(root))
            for name, root in self.roots.items()
            if root is not None
        }

    def start(self) -> CpuMeter:
        self._before = self._read()
        return self

    def stop(self) -> dict[str, float | None]:
        after = self._read()
        self.used = {
            name: round(after[name] - self._before[name], 2) if name in after else None
            for name in self.roots
        }
        return self.used

    @contextlib.contextmanager
    def measuring(self) -> Iterator[CpuMeter]:
        self.start()
        try:
            yield self
        finally:
            self.stop()
