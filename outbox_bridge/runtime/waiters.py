"""Coroutines waiting for room under a limit (undeleted groups, payload bytes), woken in the
order they came. Used on the event loop only."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable


class Waiters:
    """Waiters for room; ``room()`` says how many of them may go on when they are woken."""

    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def until(self, free: Callable[[], bool]) -> None:
        """Return once ``free()`` holds, waiting for a wake-up between looks."""
        while not free():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.wake()  # woken, then cancelled: the room goes to the next waiter
                raise

    def wake(self) -> None:
        """Wake as many waiters as there is room for, the first come first."""
        room = self._room()
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1
