"""Where a test session's embedded servers keep their data: a folder of the session's own under
the system's temporary directory. Not under pytest's: every new pytest session of the same user
resets ``pytest-of-<user>`` to mode 0700, and an embedded PostgreSQL started by root runs as a
system user of its own, which then cannot reach its files any more.

A session holds a lock on its folder while it runs; the next session removes the folder of one
that died, after stopping its servers.
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

from outbox_bridge.runtime.embedded import stop_left_over

if sys.platform != "win32":
    import fcntl

log = logging.getLogger(__name__)

PREFIX = "outbox-bridge-servers-"
# Holds the owning session's process id, written once the session holds the file's lock.
OWNER_FILE = ".owner"
# A folder whose owner file is missing or empty after this long was never claimed (seconds).
UNCLAIMED_AFTER = 3600.0


class ServerFolder:
    """A folder for one test session's servers, made with :func:`tempfile.mkdtemp` under
    ``parent`` (the system's temporary directory), removed by :meth:`remove`. Making one first
    removes the folders of sessions that died (see the module)."""

    def __init__(self, parent: Path | None = None) -> None:
        parent = Path(parent or tempfile.gettempdir())
        for stale in stale_folders(parent):
            remove_stale(stale)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._owner: IO[str] | None = _claim(self.path / OWNER_FILE)

    def new(self, name: str) -> Path:
        """A new empty folder in this one, for one server (``name`` and a unique suffix)."""
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.path))

    def remove(self) -> None:
        """Remove the folder, stopping first whatever server still runs in it."""
        stop_servers(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
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
    try:
        owner = open(folder / OWNER_FILE)  # closed below, and its lock with it
    except FileNotFoundError:
        return time.time() - folder.stat().st_mtime > UNCLAIMED_AFTER
    with owner:
        try:
            fcntl.flock(owner, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its session runs
        # Unlocked and empty: being claimed right now, or never claimed.
        return bool(owner.read().strip()) or (
            time.time() - folder.stat().st_mtime > UNCLAIMED_AFTER
        )


def remove_stale(folder: Path) -> None:
    """Stop the servers a dead session left running in ``folder``, and remove it."""
    log.info("removing %s, left by a test session that ended without removing it", folder)
    stop_servers(folder)
    shutil.rmtree(folder, ignore_errors=True)


def stop_servers(folder: Path) -> None:
    """Stop the embedded servers still running with their data in ``folder``."""
    for pid_file in folder.glob("**/postmaster.pid"):
        stop_left_over(pid_file, signal.SIGINT, str(pid_file.parent.resolve()))  # fast shutdown
    for pid_file in folder.glob("**/temporal.pid"):
        stop_left_over(pid_file, signal.SIGTERM, "temporal")
