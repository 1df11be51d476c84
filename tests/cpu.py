"""Where the suite's CPU goes: with ``OUTBOX_TEST_CPU=<file>``, every test process appends a
line per test to ``<file>``: the CPU seconds (user + system) that the test's process, the
programs it ran and the session's servers used while the test ran (setup and teardown
included), and the test's id. The summary then lists the test files that used the most.

A server's CPU counts against the test that was running in the process that started it; the
servers of the other test processes are not counted against it.
"""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

CPU_ENV = "OUTBOX_TEST_CPU"
LISTED_FILES = 25


def used_cpu() -> float:
    """CPU seconds of this process, its finished children, its running descendants and the
    embedded PostgreSQL servers it started (which run detached: not its descendants)."""
    import psutil  # the embedded extra, which the servers need anyway

    seconds = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        seconds += usage.ru_utime + usage.ru_stime
    processes = psutil.Process().children(recursive=True)
    for postgres in _postgres_pids():
        try:
            main = psutil.Process(postgres)
            # Its backends that ended (a connection each) count in its children's times.
            times = main.cpu_times()
            seconds += times.children_user + times.children_system
            processes += [main, *main.children(recursive=True)]
        except psutil.Error:
            continue
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds += times.user + times.system
    return seconds


def _postgres_pids() -> list[int]:
    from tests.conftest import SESSION_SERVERS

    pids = []
    for servers in SESSION_SERVERS:
        pid = None if servers.postgres is None else servers.postgres._pid
        if pid is not None:
            pids.append(pid)
    return pids


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(CPU_ENV)
    if path:
        config.pluginmanager.register(CpuPlugin(Path(path)), "outbox-bridge-test-cpu")


class CpuPlugin:
    def __init__(self, path: Path) -> None:
        self.path = path

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        before = used_cpu()
        try:
            return (yield)
        finally:
            with self.path.open("a") as out:  # one short write: lines of processes never mix
                out.write(f"{used_cpu() - before:.3f}\t{item.nodeid}\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(terminalreporter.config, "workerinput") or not self.path.exists():
            return
        per_file: dict[str, float] = defaultdict(float)
        for line in self.path.read_text().splitlines():
            used, _, test = line.partition("\t")
            per_file[test.split("::", 1)[0]] += float(used)
        terminalreporter.write_sep("-", f"CPU per test file ({self.path})")
        ranked = sorted(per_file.items(), key=lambda item: -item[1])
        for name, seconds in ranked[:LISTED_FILES]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
        terminalreporter.write_line(f"{sum(per_file.values()):8.1f} s  in all")
