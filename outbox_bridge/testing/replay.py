"""Replaying exported histories in a test: :func:`assert_replays`."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from temporalio.client import WorkflowHistory

from outbox_bridge.dev.replayer import HistoryReplayer

T = TypeVar("T")

History = str | os.PathLike[str] | WorkflowHistory


def _files(source: str | os.PathLike[str]) -> list[Path]:
    """The files ``source`` names: a file, a folder (its ``*.json``) or a glob pattern."""
    text = os.fspath(source)
    if Path(text).is_dir():
        text = os.path.join(text, "*.json")
    found = sorted(Path(p) for p in glob.glob(text, recursive=True))
    if not found:
        raise FileNotFoundError(f"no history file matches {text}")
    return found


def _apart(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on an event loop in a thread of its own (a test may run its own)."""
    with ThreadPoolExecutor(1, thread_name_prefix="outbox-replay") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def assert_replays(*histories: History, sandboxed: bool = True) -> None:
    """Replay exported workflow histories against the installed workflow code (``OutboxShard``
    and ``OutboxPartition``), as the worker runs it and, with ``sandboxed``, under Temporal's
    sandbox too; fail the test naming every history that does not replay and the first event
    the code disagrees with.

    Each argument is a history file (``outbox-bridge history export``'s JSON, or the Temporal
    SDK's, CLI's or UI's), a folder of them (``*.json``), a glob pattern
    (``"histories/**/*.json"``), or a ``WorkflowHistory``. A name that matches no file raises
    ``FileNotFoundError``: a corpus that went missing must not pass.
    """
    __tracebackhide__ = True
    if not histories:
        raise TypeError("assert_replays() needs at least one history, file, folder or pattern")
    found: list[Path | WorkflowHistory] = []
    for history in histories:
        found += [history] if isinstance(history, WorkflowHistory) else _files(history)
    replayed = _apart(HistoryReplayer(sandboxed=sandboxed).replay_all(found))
    failures = [failure for failure in replayed if failure is not None]
    if failures:
        lines = "\n".join(f"  {failure}" for failure in failures)
        raise AssertionError(
            f"{len(failures)} of {len(found)} histories do not replay against the installed "
            f"workflow code:\n{lines}"
        )
