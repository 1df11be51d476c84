"""How many handler calls run at once: in one worker, in all (``max_concurrent_calls``) and per
handler that declared a ``max_concurrency``, and across the workers, per handler that declared a
``fleet_max_concurrency`` (:mod:`~outbox_bridge.runtime.fleet_slots`). A call takes a slot of each
limit before it starts, first come first served; a wait ends at the round's deadline, or once
every other shard of the round is done (:class:`RoundShards`), and the shard goes back to its
queue with its rows.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from typing import Any, TypeAlias

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.registry import CallLimit, OutboxApp
from outbox_bridge.runtime.fleet_slots import FleetLimit, FleetLocks

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
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await await_turn(waiter, deadline, round_, self.give)

    def give(self) -> None:
        """Give a slot back: to the first waiter still waiting, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``taken`` stays
                return
        self.taken -= 1


async def await_turn(
    waiter: asyncio.Future[Any],
    deadline: float,
    round_: RoundShards | None,
    give: Callable[[], None],
) -> bool:
    """Await ``waiter``, done when a slot was taken for it, until ``deadline`` or until
    ``round_`` is idle (False then); a slot that came just before a cancellation is ``give``n
    back."""
    # The loop's clock is time.monotonic() on every platform asyncio supports.
    loop = asyncio.get_running_loop()
    timer = None if deadline == math.inf else loop.call_at(deadline, expire, waiter)
    if round_ is not None:
        round_.waiting(waiter)
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


class FleetSlots:
    """A handler's slots across the workers (a :class:`FleetLimit`), taken like :class:`Slots`:
    at once if one is free and no call of this worker waits, else in turn."""

    def __init__(self, limit: FleetLimit) -> None:
        self._limit = limit

    async def take(self, deadline: float = math.inf, round_: RoundShards | None = None) -> bool:
        limit = self._limit
        if not limit.queued() and await limit.try_take():
            return True
        if round_ is not None and round_.idle:
            return False
        return await await_turn(limit.queue(), deadline, round_, limit.give)

    def give(self) -> None:
        self._limit.give()


# A limit a call takes a slot of.
Limit: TypeAlias = Slots | FleetSlots


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
        self._waiters: set[asyncio.Future[None]] = set()
        self.idle = False
        self._went_idle = went_idle  # told once, when the round goes idle

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
            if not self.idle and self._went_idle is not None:
                self._went_idle()
            self.idle = True
            for waiter in list(self._waiters):
                expire(waiter)


class CallSlots:
    """The limits a worker's handler calls run under: the worker's and each declared one. The
    fleet-wide limits hold across the workers on ``engine``'s database; without one (a single
    process, as in the testing toolkit's drain) they hold in this worker."""

    def __init__(
        self, app: OutboxApp, total: int = MAX_CONCURRENT_CALLS, engine: AsyncEngine | None = None
    ) -> None:
        self._app = app
        self.total = Slots(total)
        self.fleet = None if engine is None else FleetLocks(engine)
        self._declared: dict[CallLimit, list[Limit]] = {}
        self._of_category: dict[int, list[Limit]] = {}

    def limits(self, category: int) -> list[Limit]:
        """The limits a call of ``category`` takes a slot of, in the order it takes them."""
        known = self._of_category.get(category)
        if known is None:
            limit = self._app.call_limit(category)
            known = [self.total] if limit is None else self._declared_limits(limit)
            self._of_category[category] = known
        return known

    def _declared_limits(self, limit: CallLimit) -> list[Limit]:
        # The declared limits first: a call waiting for one holds none of the worker's slots
        # (a backlog of one handler never keeps the other categories' calls waiting).
        known = self._declared.get(limit)
        if known is None:
            known = [] if limit.calls is None else [Slots(limit.calls)]
            if limit.fleet_calls is not None:
                known.append(self._fleet_slots(limit, limit.fleet_calls))
            known.append(self.total)
            self._declared[limit] = known
        return known

    def _fleet_slots(self, limit: CallLimit, size: int) -> Limit:
        if self.fleet is None:
            return Slots(size)
        handler = "+".join(str(value) for value in sorted(map(int, limit.categories)))
        prefix = f"outbox-fleet:{self._app.table().name}:{handler}:"
        return FleetSlots(self.fleet.limit(prefix, size))

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()


class Held:
    """A slot of each of ``limits`` for an ``async with`` block, which gets True, or False
    (holding none) if one did not come free by ``deadline`` or before ``round_`` gave up. A
    class, not a generator: it runs once per handler call."""

    __slots__ = ("_deadline", "_limits", "_round", "_taken")

    def __init__(
        self, limits: list[Limit], deadline: float, round_: RoundShards | None = None
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
