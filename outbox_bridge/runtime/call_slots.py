"""How many handler calls run at once: in one worker, in all (``max_concurrent_calls``) and per
handler that declared a ``max_concurrency``, and across the workers, per handler that declared a
``fleet_max_concurrency`` (:mod:`~outbox_bridge.runtime.fleet_slots`). A call takes a slot of each
limit before it starts, first come first served; a wait ends at the round's deadline, or once
every other shard of the round is done (:class:`~outbox_bridge.runtime.waiters.RoundShards`),
and the shard goes back to its queue with its rows.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.registry import CallLimit, OutboxApp
from outbox_bridge.runtime.fleet_slots import FleetLimit, FleetLocks
from outbox_bridge.runtime.waiters import RoundShards, await_turn

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
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await await_turn(waiter, deadline, round_, self.give)

    def _free(self) -> bool:
        """Whether a slot is free and nobody waits for one."""
        waiters = self._waiters
        while waiters and waiters[0].done():  # expired: left for here or give() to drop
            waiters.popleft()
        return self.taken < self.size and not waiters

    def give(self) -> None:
        """Give a slot back: to the first waiter still waiting, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``taken`` stays
                return
        self.taken -= 1


# A limit a call takes a slot of.
Limit: TypeAlias = Slots | FleetLimit


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
        return self.fleet.limit(prefix, size)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()


class Held:
    """A slot of each of ``limits`` for an ``async with`` block, after ``token()`` when the
    call is rate limited (it waits for its token first, holding no slot meanwhile). The block
    gets True, or False (holding nothing) if the token or a slot did not come by ``deadline``
    or before ``round_`` gave up. A class, not a generator: it runs once per handler call."""

    __slots__ = ("_deadline", "_limits", "_round", "_taken", "_token")

    def __init__(
        self,
        limits: list[Limit],
        deadline: float,
        round_: RoundShards | None = None,
        token: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._limits = limits
        self._deadline = deadline
        self._round = round_
        self._token = token
        self._taken = 0

    async def __aenter__(self) -> bool:
        if self._token is not None and not await self._token():
            return False
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
