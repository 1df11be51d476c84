"""The machine's test slots (tests/slots.py): processes take turns for them, a killed holder
frees its slot, ``OUTBOX_TEST_SLOTS`` sets how many, and a test's wait for one is reported and
not counted in its timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slots import (
    GATE_FILE,
    SLOTS_ENV,
    Slot,
    Slots,
    SlotSettingError,
    slot_count,
    slot_folder,
)
from tests.support import ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the slots are POSIX file locks")

# A process that holds one of the slots in the folder argv[1] until its stdin has a line, then
# takes one again once it has freed it, and says so at each step.
HOLDER = """
import sys
from pathlib import Path
from tests.slots import Slots

slots = Slots(int(sys.argv[2]), Path(sys.argv[1]))
slot = slots.take()
print("held", slot.index, flush=True)
sys.stdin.readline()
slot.release()
again = slots.take()
print("again", again.index, flush=True)
sys.stdin.readline()
"""


class Holder:
    def __init__(self, folder: Path, count: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder), str(count)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout

    def said(self) -> str:
        line = self.stdout.readline()
        assert line, f"the holder exited with {self.process.wait(60)}"
        return line.strip()

    def go_on(self) -> None:
        self.stdin.write("\n")
        self.stdin.flush()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(60)
        self.stdin.close()
        self.stdout.close()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "slots"


@pytest.fixture
def holders(folder: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def waiting_at_the_gate(slots: Slots) -> bool:
    import fcntl

    gate_file = slots.folder / GATE_FILE
    if not gate_file.exists():
        return False
    with open(gate_file, "rb") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def wait_for(predicate: object, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def take_in_thread(slots: Slots) -> tuple[threading.Thread, list[Slot]]:
    taken: list[Slot] = []
    thread = threading.Thread(target=lambda: taken.append(slots.take()), daemon=True)
    thread.start()
    return thread, taken


def test_no_more_processes_hold_a_slot_than_there_are_slots(
    folder: Path, holders: list[Holder]
) -> None:
    slots = Slots(2, folder)
    holders.extend(Holder(folder, 2) for _ in range(2))
    assert sorted(h.said() for h in holders) == ["held 0", "held 1"]
    assert slots.try_take() is None


def test_a_waiting_process_gets_the_slot_its_holder_frees_before_the_holder_again(
    folder: Path, holders: list[Holder]
) -> None:
    """A process that frees its slot and at once wants one queues behind the waiting ones: two
    sessions take turns instead of one keeping its slots for its whole run."""
    slots = Slots(1, folder)
    holder = Holder(folder, 1)
    holders.append(holder)
    assert holder.said() == "held 0"
    thread, taken = take_in_thread(slots)
    wait_for(lambda: waiting_at_the_gate(slots), "this process to wait for the slot")
    assert not taken
    holder.go_on()  # the holder frees its slot and asks for one again at once
    thread.join(60)
    [slot] = taken
    assert slot.index == 0 and slot.waited > 0
    wait_for(lambda: waiting_at_the_gate(slots), "the holder to wait for the slot again")
    slot.release()
    assert holder.said() == "again 0"


def test_a_killed_holder_frees_its_slot(folder: Path, holders: list[Holder]) -> None:
    slots = Slots(1, folder)
    holder = Holder(folder, 1)
    holders.append(holder)
    assert holder.said() == "held 0"
    assert slots.try_take() is None
    holder.process.send_signal(signal.SIGKILL)
    holder.process.wait(60)
    slot = slots.try_take()
    assert slot is not None
    slot.release()


def test_the_count_is_twice_the_cores_unless_the_environment_says() -> None:
    assert slot_count({}, cores=2) == 4  # a lone `pytest -n 4` on two cores never waits
    assert slot_count({SLOTS_ENV: "0"}, cores=2) == 0
    assert slot_count({SLOTS_ENV: " 7 "}, cores=2) == 7
    for wrong in ("-1", "four", "1.5"):
        with pytest.raises(SlotSettingError, match=f"{SLOTS_ENV}='{re.escape(wrong)}'"):
            slot_count({SLOTS_ENV: wrong})


def test_the_folder_is_the_same_for_every_session_and_must_be_the_users(tmp_path: Path) -> None:
    assert slot_folder() == slot_folder()
    assert str(os.getuid()) in slot_folder().name
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="not a folder of this user's own"):
        Slots(1, link)


# -- in a pytest session ---------------------------------------------------------------------------

QUICK_TEST = """
def test_quick():
    pass
"""


# Plugins the session needs not: xdist, and those that want settings of this project's.
OFF = ["-p", "no:xdist", "-p", "no:asyncio", "-p", "no:django"]


def run_pytest(project: Path, tmp: Path, slots: str) -> subprocess.Popen[str]:
    """A pytest session of ``project`` with this plugin, a timeout of 2 s per test, and a
    temporary directory (hence a slot folder) of its own."""
    (project / "pytest.ini").write_text("[pytest]\ntimeout = 2\n")
    (project / "test_quick.py").write_text(QUICK_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **{SLOTS_ENV: slots})
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "tests.slots", "-p", "no:cacheprovider", *OFF],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_test_waits_for_a_slot_outside_its_timeout_and_the_summary_says_so(
    tmp_path: Path,
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    slots = Slots(1, tmp / slot_folder().name)
    slot = slots.try_take()
    assert slot is not None
    try:
        session = run_pytest(project, tmp, "1")
        wait_for(lambda: waiting_at_the_gate(slots), "the session to wait for the slot")
        time.sleep(3)  # longer than the test's timeout
    finally:
        slot.release()
    out, _ = session.communicate(timeout=120)
    assert session.returncode == 0, out
    assert f"test slots: 1 for the machine, in {slots.folder}" in out
    waited = r"test slots: 1 for the machine \(OUTBOX_TEST_SLOTS\); 1 of 1 tests waited [3-9] s"
    assert re.search(waited, out), out


def test_no_slots_with_the_environment_at_0_and_a_clear_refusal_of_nonsense(
    tmp_path: Path,
) -> None:
    (tmp_path / "p0").mkdir()
    out, _ = run_pytest(tmp_path / "p0", tmp_path, "0").communicate(timeout=120)
    assert "test slots: none, every test runs at once (OUTBOX_TEST_SLOTS=0)" in out
    assert "1 passed" in out
    assert not (tmp_path / slot_folder().name).exists()
    (tmp_path / "px").mkdir()
    session = run_pytest(tmp_path / "px", tmp_path, "many")
    out, _ = session.communicate(timeout=120)
    assert session.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "OUTBOX_TEST_SLOTS='many': expected a whole number of test slots" in out
