"""How many handler calls one worker runs at once: in all (``max_concurrent_calls``), and per
handler that declared a ``max_concurrency``.

A call takes a slot of each limit before it starts, first come first served, and gives it back
when it returns. Only the shard whose call waits is held: the other shards of its round go on,
and a wait ends at the round's deadline (the shard then goes back to its queue with its rows),
so a round that holds a waiting shard still ends within its time budget.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math

from outbox_bridge.registry import CallLimit, OutboxApp

# The default of the worker's max_concurrent_calls setting.
MAX_CONCURRENT_CALLS = 1000


class Slots:
    """At most ``size`` holders at once; waiters are let in first come, first served. Used on
    the event loop only (a plain-def call's slot is taken and given back there too)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a limit of concurrent calls must be at least 1, not {size}")
        self.size = size
        self.taken = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self, deadline: float = math.inf) -> bool:
        """Take a slot, waiting until ``deadline`` (``time.monotonic``) at most; False if none
        came free by then."""
        if self.taken < self.size and not self._waiters:
            self.taken += 1
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        # The loop's clock is time.monotonic() on every platform asyncio supports.
        timer = None if deadline == math.inf else loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed a slot, then cancelled: it goes to the next waiter
            raise
        except TimeoutError:
            return False
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return True

    def give(self) -> None:
        """Give a slot back: to the first waiter still waiting, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``taken`` stays
                return
        self.taken -= 1


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class CallSlots:
    """The limits a worker's handler calls run under: the worker's and each declared one."""

    def __init__(self, app: OutboxApp, total: int = MAX_CONCURRENT_CALLS) -> None:
        self._app = app
        self.total = Slots(total)
        self._declared: dict[CallLimit, Slots] = {}
        self._of_category: dict[int, list[Slots]] = {}

    def limits(self, category: int) -> list[Slots]:
        """The limits a call of ``category`` takes a slot of, in the order it takes them."""
        known = self._of_category.get(category)
        if known is not None:
            return known
        limit = self._app.call_limit(category)
        if limit is None:
            known = [self.total]
        else:
            slots = self._declared.get(limit)
            if slots is None:
                slots = self._declared[limit] = Slots(limit.calls)
            # The declared limit first: a call waiting for it holds none of the worker's slots.
            known = [slots, self.total]
        self._of_category[category] = known
        return known

    def held(self, limits: list[Slots], deadline: float = math.inf) -> Held:
        """A slot of each of ``limits`` for an ``async with`` block, which gets True, or False
        (holding none) if one did not come free by ``deadline``."""
        return Held(limits, deadline)


class Held:
    """Slots held for one ``async with`` block (a class, not a generator: it runs once per
    handler call)."""

    __slots__ = ("_deadline", "_limits", "_taken")

    def __init__(self, limits: list[Slots], deadline: float) -> None:
        self._limits = limits
        self._deadline = deadline
        self._taken = 0

    async def __aenter__(self) -> bool:
        try:
            for slots in self._limits:
                if not await slots.take(self._deadline):
                    self._give_back()
                    return False
                self._taken += 1
        except BaseException:  # cancelled while waiting: no __aexit__ gives back the others
            self._give_back()
            raise
        return True

    async def __aexit__(self, *exc: object) -> None:
        self._give_back()

    def _give_back(self) -> None:
        while self._taken:
            self._taken -= 1
            self._limits[self._taken].give()
