"""An event loop in a thread of its own, for sync code that runs async code, and a clean exit
for a process that used Temporal's client: the SDK's native threads abort the process if they
call into Python while the interpreter finalizes (``PyGILState_Release``), so at exit the loop
stops and :func:`settle_native_threads` waits until none runs Python code.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

CLOSE_TIMEOUT = 10.0
# How long a process at exit waits at most for native threads to leave Python, and how long none
# may have run Python code before it goes on.
SETTLE_TIMEOUT = 2.0
SETTLE_QUIET = 0.03
SETTLE_STEP = 0.01


class EventLoopThread:
    """An event loop in a daemon thread (a loop never closed does not keep the process up);
    :meth:`close` runs at interpreter exit at the latest, then :func:`settle_native_threads`."""

    def __init__(self, name: str = "outbox-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` in the loop and wait for its result."""
        return self.submit(coroutine).result(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel the loop's tasks (waiting up to ``timeout`` for them to end), stop the loop and
        its thread; :func:`settle_native_threads` still runs at exit. Idempotent."""
        atexit.unregister(self._close_at_exit)
        settle_native_threads_at_exit()
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):  # a task that ignores its cancellation
                self.run(_cancel_tasks(), timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def _close_at_exit(self) -> None:
        self.close()
        settle_native_threads()  # now: the hook close() registers may have run already


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def settle_native_threads(timeout: float = SETTLE_TIMEOUT) -> None:
    """Sleep (the GIL released) until no thread that Python did not start has run Python code
    for a moment, or ``timeout`` passed; what they hand back goes nowhere, harmlessly."""
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        if _native_threads_in_python():
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= SETTLE_QUIET:
            return
        time.sleep(SETTLE_STEP)


def _native_threads_in_python() -> bool:
    started_by_python = {thread.ident for thread in threading.enumerate()}
    return any(ident not in started_by_python for ident in sys._current_frames())


def settle_native_threads_at_exit() -> None:
    """Run :func:`settle_native_threads` when the interpreter exits (registered once)."""
    atexit.unregister(settle_native_threads)
    atexit.register(settle_native_threads)
