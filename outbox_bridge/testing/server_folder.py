"""Where a test session's embedded servers keep their data: a folder of the session's own under
the system's temporary directory, not pytest's (see the testing page). A session holds a lock on
its folder while it runs; the next session stops the servers of one that died and removes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from outbox_bridge.dev.embedded import stop_left_over

if sys.platform != "win32":
    import fcntl

log = logging.getLogger(__name__)

PREFIX = "outbox-bridge-servers-"
OWNER_FILE = ".owner"  # the owning session's pid, written once it holds the file's lock
# A folder whose owner file is missing or empty after this long was never claimed (seconds).
UNCLAIMED_AFTER = 3600.0


class ServerFolder:
    """A folder for one test session's servers under ``parent`` (the system's temporary
    directory), removed by :meth:`remove`; making one first removes those of dead sessions."""

    def __init__(self, parent: Path | None = None) -> None:
        parent = Path(parent or tempfile.gettempdir())
        for stale in stale_folders(parent):
            log.info("removing %s, left by a test session that ended without removing it", stale)
            _remove(stale)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._owner: IO[str] | None = _claim(self.path / OWNER_FILE)

    def new(self, name: str) -> Path:
        """A new empty folder in this one, for one server (``name`` and a unique suffix)."""
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.path))

    def remove(self) -> None:
        """Remove the folder, stopping first whatever server still runs in it."""
        _remove(self.path)
        if self._owner is not None:
            self._owner.close()
            self._owner = None


def _claim(path: Path) -> IO[str]:
    owner = open(path, "w")  # held open, and locked, while the session runs
    if sys.platform != "win32":
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    owner.write(str(os.getpid()))
    owner.flush()
    return owner


def stale_folders(parent: Path) -> list[Path]:
    """This user's server folders under ``parent`` whose session is gone (none on Windows,
    where nothing tells)."""
    if sys.platform == "win32":
        return []
    found = []
    for folder in parent.glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if folder.is_dir() and folder.stat().st_uid == os.getuid() and _abandoned(folder):
                found.append(folder)
    return found


def _abandoned(folder: Path) -> bool:
    never_claimed = time.time() - folder.stat().st_mtime > UNCLAIMED_AFTER
    try:
        owner = open(folder / OWNER_FILE)  # closed below, and its lock with it
    except FileNotFoundError:
        return never_claimed
    with owner:
        try:
            fcntl.flock(owner, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its session runs
        # Unlocked and empty: being claimed right now, or never claimed.
        return bool(owner.read().strip()) or never_claimed


def _remove(folder: Path) -> None:
    """Stop the embedded servers still running with their data in ``folder``, and remove it."""
    for pid_file in folder.glob("**/postmaster.pid"):
        stop_left_over(pid_file, signal.SIGINT, str(pid_file.parent.resolve()))  # fast shutdown
    for pid_file in folder.glob("**/temporal.pid"):
        stop_left_over(pid_file, signal.SIGTERM, "temporal")
    shutil.rmtree(folder, ignore_errors=True)
