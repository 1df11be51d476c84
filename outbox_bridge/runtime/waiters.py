"""Coroutines waiting for room under a limit (undeleted groups, payload bytes, a call slot, a
rate limit's token), woken in the order they came, and the round that gives its waiters up
once its other shards are done (:class:`RoundShards`). Used on the event loop only."""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from typing import Any


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


async def await_turn(
    waiter: asyncio.Future[Any],
    deadline: float,
    round_: RoundShards | None,
    give: Callable[[], None],
    grace: float = 0.0,
) -> bool:
    """Await ``waiter``, done when a slot (or a token) was taken for it, until ``deadline`` or
    until ``grace`` seconds after ``round_`` is idle (False then); a slot that came just
    before a cancellation is ``give``n back."""
    # The loop's clock is time.monotonic() on every platform asyncio supports.
    loop = asyncio.get_running_loop()
    timer = None if deadline == math.inf else loop.call_at(deadline, expire, waiter)
    if round_ is not None:
        round_.waiting(waiter, grace)
    try:
        await waiter
    except asyncio.CancelledError:
        # Handed a slot, then cancelled: it goes on. (exception() marks an expiry as seen.)
        if granted(waiter):
            give()
        raise
    except TimeoutError:
        return False
    finally:
        if timer is not None:
            timer.cancel()
        if round_ is not None:
            round_.woken(waiter)
        # One that expired or was cancelled stays queued until it reaches the front and is
        # skipped: removing it here would scan the whole queue (thousands) once per wait.
    return True


def expire(waiter: asyncio.Future[Any]) -> None:
    """A wait's deadline passed: its waiter gets a TimeoutError (unless it was served)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def granted(waiter: asyncio.Future[Any]) -> bool:
    """Whether ``waiter`` was served (not expired, not cancelled)."""
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None


class RoundShards:
    """The shards of one round that are busy: neither done nor waiting for a slot. Once none
    is and one was done, its waiting shards give up (they run in a later round) rather than
    keep the round's place while other shards queue."""

    def __init__(self, shards: int, went_idle: Callable[[], None] | None = None) -> None:
        self._busy = shards
        self._done = False
        self._waiters: dict[asyncio.Future[Any], float] = {}  # waiter: its grace (seconds)
        self.idle = False
        self._went_idle = went_idle  # told once, when the round goes idle

    def done(self) -> None:
        """A shard of the round is done."""
        self._busy -= 1
        self._done = True
        self._check()

    def waiting(self, waiter: asyncio.Future[Any], grace: float = 0.0) -> None:
        """A shard waits on ``waiter``; once the round is idle it gives up ``grace`` seconds
        later (a token is due at a known pace: a round given up for nothing re-reads its
        shards while the tokens go untaken)."""
        self._busy -= 1
        self._waiters[waiter] = grace
        self._check()

    def woken(self, waiter: asyncio.Future[Any]) -> None:
        self._busy += 1
        self._waiters.pop(waiter, None)

    def _check(self) -> None:
        if not self._busy and self._done:
            if not self.idle and self._went_idle is not None:
                self._went_idle()
            self.idle = True
            waiters, self._waiters = self._waiters, {}
            for waiter, grace in waiters.items():
                if grace:
                    asyncio.get_running_loop().call_later(grace, expire, waiter)
                else:
                    expire(waiter)
