"""Fleet-wide slots: a handler's ``fleet_max_concurrency`` of ``M`` as ``M`` PostgreSQL session
advisory locks, slot ``n`` the lock of ``outbox-fleet:<table>:<handler>:<n>``. A worker holds its
slots on one connection of its own: a crashed worker's closed connection frees them, so no slot
leaks, and no table is needed. A slot freed while calls of the same worker wait passes to
the first of them; else it is unlocked, and goes to whichever worker asks first: workers share
no queue. A worker that finds none free asks again after 20 ms, then up to every 200 ms.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox_bridge.db.locks import try_slots, unlock_keys
from outbox_bridge.runtime.waiters import RoundShards, await_turn

log = logging.getLogger(__name__)

FIRST_POLL = 0.02  # seconds before a worker asks again for a slot none was free of
LAST_POLL = 0.2  # the longest it waits between two asks
RECONNECT = 2.0  # the longest it waits between two attempts to connect again


class FleetLimit:
    """The slots of one handler's fleet limit that this worker holds or waits for, taken like
    :class:`~outbox_bridge.runtime.call_slots.Slots`: at once if one is free and no call of
    this worker waits, else in turn."""

    def __init__(self, locks: FleetLocks, prefix: str, size: int) -> None:
        self.prefix = prefix
        self.size = size
        self.held: list[int] = []  # slots locked on the current connection
        self.stale = 0  # calls holding slots of a lost connection (already freed)
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.tries: list[asyncio.Future[bool]] = []
        self._locks = locks

    async def take(self, deadline: float = math.inf, round_: RoundShards | None = None) -> bool:
        if not self.queued() and await self.try_take():
            return True
        if round_ is not None and round_.idle:
            return False
        return await await_turn(self.queue(), deadline, round_, self.give)

    def queued(self) -> bool:
        """Whether a call of this worker waits for a slot (it goes first)."""
        while self.waiters and self.waiters[0].done():
            self.waiters.popleft()
        return bool(self.waiters)

    async def try_take(self) -> bool:
        """Take a free slot at once (in the worker's next statement), or False."""
        tried: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.tries.append(tried)
        self._locks.wake()
        try:
            return await tried
        except asyncio.CancelledError:
            if tried.done() and not tried.cancelled() and tried.result():
                self.give()
            raise

    def queue(self) -> asyncio.Future[None]:
        """A place in the queue, done when a slot was taken for it."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self._locks.wake()
        return waiter

    def give(self) -> None:
        """Pass the slot to a call of this worker that waits, else free it in the database."""
        if self.stale:
            self.stale -= 1  # a lost connection freed it
        elif self.queued():
            self.waiters.popleft().set_result(None)  # the slot passes on: ``held`` stays
        else:
            self._locks.unlock(f"{self.prefix}{self.held.pop()}")

    def wanted(self) -> int:
        return len(self.tries) + sum(not waiter.done() for waiter in self.waiters)

    def hand_out(self, slots: list[int], tried: int) -> None:
        """Pass ``slots``, just taken, to the waiters, then the first ``tried`` tries (those the
        statement asked for); any left over are freed. Those tries that got none fail."""
        tries, self.tries = self.tries[:tried], self.tries[tried:]
        for slot in slots:
            self.held.append(slot)
            if self.queued():
                self.waiters.popleft().set_result(None)
            elif (taker := next((f for f in tries if not f.done()), None)) is not None:
                taker.set_result(True)
            else:
                self.give()  # its taker was cancelled or timed out meanwhile
        for taker in tries:
            if not taker.done():
                taker.set_result(False)

    def lost(self) -> None:
        """The connection is gone, and with it every slot held: the tries fail, the waiters wait."""
        self.stale += len(self.held)
        self.held.clear()
        self.hand_out([], len(self.tries))


class FleetLocks:
    """One worker's connection for the fleet slots of every handler, and the task that takes and
    frees them: every statement serves all the calls that asked meanwhile."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._limits: dict[str, FleetLimit] = {}
        self._unlock: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._down = False  # the connection was lost and is not back yet

    def limit(self, prefix: str, size: int) -> FleetLimit:
        limit = self._limits.get(prefix)
        if limit is None:
            limit = self._limits[prefix] = FleetLimit(self, prefix, size)
        return limit

    def wake(self) -> None:
        task = self._task
        if task is None or (task.done() and not task.cancelled()):  # not closed: (re)start
            self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-slots")
        self._wake.set()

    def unlock(self, key: str) -> None:
        self._unlock.append(key)
        self.wake()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """Stop, and close the connection (freeing every slot)."""
        self.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        conn: AsyncConnection | None = None
        poll = FIRST_POLL
        try:
            while True:
                waiting = any(limit.wanted() for limit in self._limits.values())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), poll if waiting else None)
                self._wake.clear()
                try:
                    if conn is None:
                        conn = await self._connect()
                    got = await self._exchange(conn)
                except Exception as exc:  # any failure: the slots are taken as lost
                    await self._lose(conn, exc)
                    conn = None
                    poll = min(max(poll, LAST_POLL) * 2, RECONNECT) * random.uniform(0.8, 1)
                    continue
                # Ask again soon after a slot came, else less and less often.
                poll = FIRST_POLL if got else min(poll * 2, LAST_POLL) * random.uniform(0.8, 1)
        finally:
            if conn is not None:
                await conn.invalidate()  # never back to the pool with a lock held
                await conn.close()

    async def _connect(self) -> AsyncConnection:
        conn = await self._engine.connect()
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        if self._down:
            self._down = False
            log.info("the connection of the fleet-wide handler limits is back")
        return conn

    async def _exchange(self, conn: AsyncConnection) -> bool:
        """Free what was given back, then take what is wanted; whether any slot was taken."""
        freed, self._unlock = self._unlock, []
        await unlock_keys(conn, freed)
        limits = [limit for limit in self._limits.values() if limit.wanted()]
        tried = [len(limit.tries) for limit in limits]
        held = [f"{limit.prefix}{slot}" for limit in limits for slot in limit.held]
        taken = await try_slots(
            conn, [(limit.prefix, limit.size, limit.wanted()) for limit in limits], held
        )
        for index, limit in enumerate(limits):
            limit.hand_out([slot for n, slot in taken if n == index], tried[index])
        return bool(taken)

    async def _lose(self, conn: AsyncConnection | None, exc: Exception) -> None:
        if not self._down:
            self._down = True
            log.warning(
                "the connection of the fleet-wide handler limits failed (%s): its slots are "
                "free for other workers; calls waiting for one wait on while it connects again",
                type(exc).__name__,
            )
        self._unlock.clear()
        for limit in self._limits.values():
            limit.lost()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()
                await conn.close()
