"""How many handler calls one worker runs at once: in all (``max_concurrent_calls``), and per
handler that declared a ``max_concurrency``. A call takes a slot of each limit before it starts,
first come first served; a wait ends at the round's deadline, or once every other shard of the
round is done (:class:`RoundShards`), and the shard goes back to its queue with its rows.
"""

from __future__ import annotations

import asyncio
import collections
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

    async def take(self, deadline: float = math.inf, round_: RoundShards | None = None) -> bool:
        """Take a slot, waiting until ``deadline`` (``time.monotonic``) at most, or until the
        other shards of ``round_`` are done; False if none came free by then."""
        if self._free():
            self.taken += 1
            return True
        if round_ is not None and round_.idle:
            return False
        return await self._wait(deadline, round_)

    def _free(self) -> bool:
        """Whether a slot is free and nobody waits for one."""
        waiters = self._waiters
        while waiters and waiters[0].done():  # expired: left for here or give() to drop
            waiters.popleft()
        return self.taken < self.size and not waiters

    async def _wait(self, deadline: float, round_: RoundShards | None) -> bool:
        """Queue for the next slot given back, until ``deadline`` or ``round_`` is idle."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        # The loop's clock is time.monotonic() on every platform asyncio supports.
        timer = None if deadline == math.inf else loop.call_at(deadline, _expire, waiter)
        if round_ is not None:
            round_.waiting(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            # Handed a slot, then cancelled: it goes on. (exception() marks an expiry as seen.)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give()
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


class RoundShards:
    """The shards of one round that are busy: neither done nor waiting for a slot. Once none
    is and one was done, its waiting shards give up (they run in a later round) rather than
    keep the round's place while other shards queue."""

    def __init__(self, shards: int) -> None:
        self._busy = shards
        self._done = False
        self._waiters: set[asyncio.Future[None]] = set()
        self.idle = False

    def done(self) -> None:
        """A shard of the round is done."""
        self._busy -= 1
        self._done = True
        self._check()

    def waiting(self, waiter: asyncio.Future[None]) -> None:
        self._busy -= 1
        self._waiters.add(waiter)
        self._check()

    def woken(self, waiter: asyncio.Future[None]) -> None:
        self._busy += 1
        self._waiters.discard(waiter)

    def _check(self) -> None:
        if not self._busy and self._done:
            self.idle = True
            for waiter in list(self._waiters):
                _expire(waiter)


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


class Held:
    """A slot of each of ``limits`` for an ``async with`` block, which gets True, or False
    (holding none) if one did not come free by ``deadline`` or before ``round_`` gave up. A
    class, not a generator: it runs once per handler call."""

    __slots__ = ("_deadline", "_limits", "_round", "_taken")

    def __init__(
        self, limits: list[Slots], deadline: float, round_: RoundShards | None = None
    ) -> None:
        self._limits = limits
        self._deadline = deadline
        self._round = round_
        self._taken = 0

    async def __aenter__(self) -> bool:
        try:
            for slots in self._limits:
                if not await slots.take(self._deadline, self._round):
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
