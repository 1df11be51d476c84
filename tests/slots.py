"""A machine-wide limit on how many of this project's tests run at once.

Each test process (every pytest-xdist process of every session of this user) holds one of
``N`` slots while it runs a test that needs one: a lock (``flock``) on one of ``N`` files in a
folder every session agrees on, under the system's temporary directory. Two suites at once then
share the cores instead of running twice the tests a lone suite runs. The kernel drops a lock
when its process ends, however it ends, so a killed session frees its slots.

A process that waits holds the folder's gate while it does: one that frees a slot and at once
wants another queues behind the others for the gate, so that waiting sessions take turns.
``N`` is twice the cores, the tests a lone ``pytest -n 4`` runs at once on two cores; the
environment variable ``OUTBOX_TEST_SLOTS`` sets it (``0``: no limit).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

if sys.platform != "win32":
    import fcntl

SLOTS_ENV = "OUTBOX_TEST_SLOTS"
GATE_FILE = "gate"
# How often the process at the gate looks for a freed slot (seconds).
POLL_INTERVAL = 0.05


class SlotSettingError(ValueError):
    """``OUTBOX_TEST_SLOTS`` holds something other than a whole number of slots."""


def slot_count(environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int:
    """The number of slots: ``OUTBOX_TEST_SLOTS``, or twice the cores this process may use
    (0, no limit, where file locks are not available)."""
    value = environ.get(SLOTS_ENV, "").strip()
    if value:
        try:
            count = int(value)
        except ValueError:
            count = -1
        if count < 0:
            raise SlotSettingError(
                f"{SLOTS_ENV}={value!r}: expected a whole number of test slots "
                "(0 runs every test without one)"
            )
        return count
    if sys.platform == "win32":
        return 0
    return 2 * (cores or len(os.sched_getaffinity(0)))


def slot_folder() -> Path:
    """The folder of the slots' lock files, the same for every session of this user."""
    return Path(tempfile.gettempdir()) / f"outbox-bridge-test-slots-{os.getuid()}"


@dataclass
class Slot:
    """A slot held: ``index`` of ``count``, after ``waited`` seconds."""

    index: int
    waited: float
    _file: IO[bytes]

    def release(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


class Slots:
    """``count`` slots, lock files in ``folder`` (made if missing; it must be this user's)."""

    def __init__(self, count: int, folder: Path) -> None:
        self.count = count
        self.folder = folder
        folder.mkdir(mode=0o700, exist_ok=True)
        owner = folder.lstat()
        if folder.is_symlink() or owner.st_uid != os.getuid():
            raise PermissionError(f"{folder} is not a folder of this user's own")

    def take(self) -> Slot:
        """Wait for a free slot, and hold it until :meth:`Slot.release`."""
        started = time.monotonic()
        with self._locked(GATE_FILE):
            while (slot := self.try_take()) is None:
                time.sleep(POLL_INTERVAL)
        slot.waited = time.monotonic() - started
        return slot

    @contextlib.contextmanager
    def held(self) -> Iterator[Slot]:
        slot = self.take()
        try:
            yield slot
        finally:
            slot.release()

    def try_take(self) -> Slot | None:
        """A free slot, held, or None if every slot is held (without waiting)."""
        for index in range(self.count):
            file = self._open(f"slot-{index}")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                continue
            return Slot(index, 0.0, file)
        return None

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        with self._open(name) as file:
            fcntl.flock(file, fcntl.LOCK_EX)  # closing the file drops the lock
            yield

    def _open(self, name: str) -> IO[bytes]:
        descriptor = os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        return os.fdopen(descriptor, "r+b")


# -- the pytest plugin (tests/conftest.py loads it) ------------------------------------------------

# Unit tests that run a tool over the whole tree: ruff and mypy; the site's build.
SLOTTED_UNIT_FILES = frozenset({"test_lint.py", "test_docs.py"})
SLOT_WAIT = "slot_wait"


def needs_slot(item: pytest.Item) -> bool:
    """Every test but a unit test (tests/conftest.py marks each with its tier) needs a slot."""
    return item.get_closest_marker("unit") is None or Path(item.path).name in SLOTTED_UNIT_FILES


def pytest_configure(config: pytest.Config) -> None:
    try:
        count = slot_count()
    except SlotSettingError as error:
        raise pytest.UsageError(str(error)) from None
    slots = Slots(count, slot_folder()) if count else None
    config.pluginmanager.register(SlotPlugin(slots), "outbox-bridge-test-slots")


class SlotPlugin:
    """Runs each test that needs one in a slot, and reports how long tests waited for theirs."""

    def __init__(self, slots: Slots | None) -> None:
        self.slots = slots
        # (seconds waited, test id) of the tests that held a slot, in the process that reports
        # (the main one under pytest-xdist): the setup reports carry the wait.
        self.waits: list[tuple[float, str]] = []

    def pytest_report_header(self) -> str:
        if self.slots is None:
            return f"test slots: none, every test runs at once ({SLOTS_ENV}=0)"
        return (
            f"test slots: {self.slots.count} for the machine, in {self.slots.folder} "
            f"({SLOTS_ENV} sets how many)"
        )

    # Outermost, before pytest-timeout's wrapper starts the test's clock: the wait is not counted.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        if self.slots is None or not needs_slot(item):
            return (yield)
        with self.slots.held() as slot:
            item.user_properties.append((SLOT_WAIT, slot.waited))
            return (yield)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "setup":
            self.waits.extend(
                (value, report.nodeid)
                for name, value in report.user_properties
                if name == SLOT_WAIT and isinstance(value, float)
            )

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.slots is None or not self.waits:
            return
        line = f"test slots: {self.slots.count} for the machine ({SLOTS_ENV}); "
        waited = [(seconds, test) for seconds, test in self.waits if seconds >= 1.0]
        if not waited:
            line += "no test waited for one"
        else:
            longest, test = max(waited)
            line += (
                f"{len(waited)} of {len(self.waits)} tests waited "
                f"{sum(s for s, _ in waited):.0f} s in all for one, "
                f"the longest {longest:.0f} s ({test})"
            )
        terminalreporter.write_sep("-", line)
