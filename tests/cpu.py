"""Where the suite's CPU goes: with ``OUTBOX_TEST_CPU=<file>``, every test process appends a
line per test to ``<file>``: the CPU seconds (user + system) that the test's process, the
programs it ran and the session's servers used while the test ran (setup and teardown
included), the test's id, and when it started and ended (seconds since the epoch). The summary
then lists the test files that used the most, and for how long fewer test processes were busy
than the machine has cores (the run's tail, and its waits).

A server's CPU counts against the test that was running in the process that started it; the
servers of the other test processes are not counted against it.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator, Mapping
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
        before, started = used_cpu(), time.time()
        try:
            return (yield)
        finally:
            used, ended = used_cpu() - before, time.time()
            with self.path.open("a") as out:  # one short write: lines of processes never mix
                out.write(f"{used:.3f}\t{item.nodeid}\t{started:.3f}\t{ended:.3f}\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(terminalreporter.config, "workerinput") or not self.path.exists():
            return
        per_file, spans, _ = read_lines(self.path)
        terminalreporter.write_sep("-", f"CPU per test file ({self.path})")
        ranked = sorted(per_file.items(), key=lambda item: -item[1])
        for name, seconds in ranked[:LISTED_FILES]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
        terminalreporter.write_line(f"{sum(per_file.values()):8.1f} s  in all")
        cores = os.cpu_count() or 1
        for busy, seconds in enumerate(underused(spans, cores)):
            terminalreporter.write_line(f"{seconds:8.1f} s  with {busy} of {cores} cores' tests")


def read_lines(
    path: Path,
) -> tuple[dict[str, float], list[tuple[float, float]], dict[str, float]]:
    """The CPU seconds of each test file, each test's span, and the seconds each file's tests
    took, from a file of such lines."""
    per_file: dict[str, float] = defaultdict(float)
    took: dict[str, float] = defaultdict(float)
    spans: list[tuple[float, float]] = []
    for line in path.read_text().splitlines():
        used, test, started, ended = line.split("\t")
        name = test.split("::", 1)[0]
        per_file[name] += float(used)
        took[name] += float(ended) - float(started)
        spans.append((float(started), float(ended)))
    return per_file, spans, took


# -- the order files are handed out in ------------------------------------------------------------
#
# pytest-xdist hands a test process a file at a time (``--dist loadfile``), in the order of the
# collection (``--no-loadscope-reorder``; by default it would put the files with the most tests
# first, and the longest, with one or two tests each, last). The collection puts the files whose
# tests took longest first (tests/file_costs.txt: seconds of wall time, not CPU, as a file that
# mostly waits holds the end of a run as long as one that computes), so that the run ends on
# short files instead of one long file running alone. Refresh it after a run with
# OUTBOX_TEST_CPU set:
#
#     python -m tests.cpu /tmp/cpu.txt > tests/file_costs.txt

COSTS_FILE = Path(__file__).with_name("file_costs.txt")


def file_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    """The seconds each test file's tests took in the run that wrote ``path`` (none if
    absent)."""
    if not path.exists():
        return {}
    costs = {}
    for line in path.read_text().splitlines():
        seconds, _, name = line.strip().partition(" ")
        if name:
            costs[name.strip()] = float(seconds)
    return costs


def longest_files_first(items: list[pytest.Item], costs: Mapping[str, float]) -> None:
    """Order ``items`` by the cost of their file, longest first, keeping each file's tests
    together and in their order (files of no known cost last, in their order)."""
    position: dict[str, int] = {}
    for item in items:
        position.setdefault(item.nodeid.split("::", 1)[0], len(position))

    def key(item: pytest.Item) -> tuple[float, int]:
        name = item.nodeid.split("::", 1)[0]
        return (-costs.get(name, 0.0), position[name])

    items.sort(key=key)


@pytest.hookimpl(trylast=True)  # after pytest-django's own order (its database tests first)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    longest_files_first(items, file_costs())


def underused(spans: list[tuple[float, float]], cores: int) -> list[float]:
    """How long 0, 1, ... ``cores - 1`` tests were running at once, from their spans."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    seconds = [0.0] * cores
    running, last = 0, events[0][0] if events else 0.0
    for moment, change in events:
        if running < cores:
            seconds[running] += moment - last
        running, last = running + change, moment
    return seconds


def main(argv: list[str]) -> int:
    """Print the seconds each test file's tests took in a run, longest first:
    tests/file_costs.txt."""
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python -m tests.cpu <file written by OUTBOX_TEST_CPU>", file=sys.stderr)
        return 2
    _, _, took = read_lines(Path(argv[0]))
    for name, seconds in sorted(took.items(), key=lambda item: -item[1]):
        print(f"{max(seconds, 0.0):.1f} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
