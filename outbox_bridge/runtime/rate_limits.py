"""Rate limits per category in one worker: a call of a limited category takes a token first,
from the table's bucket that every worker shares (:mod:`outbox_bridge.db.limits`).

A worker takes tokens in small batches, and only while it has calls waiting for one. A wait
ends like a wait for a call slot (:class:`~outbox_bridge.runtime.call_slots.Slots`): with a
token, at the round's deadline, or once every other shard of the round is done (after
:data:`IDLE_ROUND_GRACE` more); the shard then goes back to its queue with its rows, and other
categories never wait.

Waiters are served in turn by *tenant*, the shard (its scope and identifier, and region): a
shard that had a token goes behind every shard already waiting, so one shard with a flood of
rows takes no more than its share.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

from sqlalchemy import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.db.grants import Role, privilege_advice
from outbox_bridge.db.limits import Grant, RateLimit, read_limits, take_tokens
from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.call_slots import Held, Limit
from outbox_bridge.runtime.waiters import RoundShards, await_turn, granted
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger(__name__)

# A take asks for this many seconds of the rate, or for as long as the last take took when that
# was longer (up to the bucket's one second): small batches share the rate between workers, and
# a worker holds few tokens it may not use, while a slow round trip (a busy database or worker)
# still brings the tokens due meanwhile.
BATCH_SECONDS = 0.05
# An empty bucket is asked again after a batch's time, within these bounds (seconds).
MIN_PAUSE, MAX_PAUSE = 0.01, 2.0
# How old the rates an operator set may be when a call is checked (seconds).
REFRESH_SECONDS = 2.0
# After a failed take, the bucket is asked again after this long (seconds).
RETRY_SECONDS = 1.0
# A tenant that asked for a token within this many seconds shares the rate (seconds).
RECENT_SECONDS = 5.0
# The waits of this many calls that had their token last are what the details show.
WAITS_SHOWN = 100
# A call waiting for a token when the other shards of its round are done waits this much
# longer (seconds) before its shard goes back to the queue: unlike a call slot, a token is
# due at a known pace, and a round given up for nothing re-reads its shards while the tokens
# go untaken (a bucket holds one second of them).
IDLE_ROUND_GRACE = 0.25


class Bucket:
    """One category's waiters in this worker, and the tokens taken for them."""

    def __init__(self, limits: RateLimits, table: Table, category: int) -> None:
        self._limits = limits
        self._table = table
        self.category = category
        self.per_second = 0.0
        self.tokens = 0  # taken from the table, not handed out yet
        self.waiting = 0
        self.waits: collections.deque[float] = collections.deque(maxlen=WAITS_SHOWN)
        self._turns: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = (
            collections.OrderedDict()
        )
        self.filler: asyncio.Task[None] | None = None
        self._asked: dict[str, float] = {}  # tenant: when it last asked for a token
        self._take_seconds = 0.0  # how long the last take took

    def tenants(self) -> int:
        """How many tenants asked for a token within :data:`RECENT_SECONDS` (at least 1)."""
        since = time.monotonic() - RECENT_SECONDS
        for tenant in [t for t, at in self._asked.items() if at < since]:
            del self._asked[tenant]
        return max(1, len(self._asked))

    async def take(self, tenant: str, deadline: float, round_: RoundShards | None) -> bool:
        """A token for a call of ``tenant``, waiting until ``deadline`` (``time.monotonic``)
        at most, or until the other shards of ``round_`` are done; False if none came."""
        self._asked[tenant] = time.monotonic()
        if self.tokens and not self.waiting:
            self.tokens -= 1
            self._limits.waited(self, 0.0)
            return True
        started = time.monotonic()
        if round_ is not None and round_.idle:
            deadline, round_ = min(deadline, started + IDLE_ROUND_GRACE), None
        if not await self._wait(tenant, deadline, round_):
            return False
        self._limits.waited(self, time.monotonic() - started)
        return True

    async def _wait(self, tenant: str, deadline: float, round_: RoundShards | None) -> bool:
        """Queue behind ``tenant``'s turn for the next token handed out; when the round gives
        its waiters up, this one waits :data:`IDLE_ROUND_GRACE` more (its token may be due)."""
        waiter = asyncio.get_running_loop().create_future()
        self._turns.setdefault(tenant, collections.deque()).append(waiter)
        self.waiting += 1
        if self.filler is None or self.filler.done():
            self.filler = asyncio.create_task(self._fill())
        try:
            return await await_turn(waiter, deadline, round_, self._pass_on, IDLE_ROUND_GRACE)
        finally:
            if not granted(waiter):  # a token handed out to it was counted then
                self.waiting -= 1

    def _pass_on(self) -> None:
        """A token handed out to a call that was then cancelled goes to the next waiter."""
        self.tokens += 1
        self._hand_out()

    async def _fill(self) -> None:
        """Take tokens for the waiters, in batches, until none waits."""
        while self.waiting > self.tokens:
            want = max(1, min(self.waiting - self.tokens, self._batch()))
            started = time.monotonic()
            grant = await self._limits.take(self._table, self.category, want)
            self._take_seconds = time.monotonic() - started
            if grant is None:
                await asyncio.sleep(RETRY_SECONDS)
                continue
            self.tokens += grant.tokens
            if grant.per_second is None:
                self.lift()
                return
            self.per_second = grant.per_second
            self._hand_out()
            if grant.tokens < want:
                await asyncio.sleep(min(max(want / grant.per_second, MIN_PAUSE), MAX_PAUSE))

    def _batch(self) -> int:
        per_second = self.per_second or self._limits.per_second(self._table.name, self.category)
        seconds = min(max(BATCH_SECONDS, self._take_seconds), 1.0)
        return math.ceil((per_second or 1.0) * seconds)

    def lift(self) -> None:
        """The limit was lifted: every waiter goes."""
        self.tokens += self.waiting
        self._hand_out()

    def _hand_out(self) -> None:
        """Hand the tokens to the waiters, one per tenant in turn."""
        turns = self._turns
        while self.tokens and turns:
            tenant, queue = next(iter(turns.items()))
            while queue and queue[0].done():  # expired or cancelled
                queue.popleft()
            if not queue:
                del turns[tenant]
                continue
            queue.popleft().set_result(None)
            self.tokens -= 1
            self.waiting -= 1
            turns.move_to_end(tenant)
            if not queue:
                del turns[tenant]


class RateLimits:
    """The rate limits of one worker's handler calls: the declared ones, and those an operator
    set in ``<table>_limits``, read again at most :data:`REFRESH_SECONDS` after calls asked."""

    def __init__(self, app: OutboxApp, engine: AsyncEngine) -> None:
        self._app = app
        self._engine = engine
        self._buckets: dict[tuple[str, int], Bucket] = {}
        self._set: dict[str, dict[int, float]] = {}  # table: category: rate set by an operator
        self._read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None

    def per_second(self, table: str, category: int) -> float | None:
        """The rate of ``category`` in ``table`` as this worker knows it (None: no limit)."""
        rate = self._set.get(table, {}).get(category)
        if rate is not None:
            return rate
        declared = self._app.rate_limit(category)
        return None if declared is None else declared.per_second

    def limited(self, table: str, category: int) -> bool:
        """Whether calls of ``category`` in ``table`` take a token (the rates operators set
        are read again, in the background, once they are old)."""
        self._refresh()
        return self.per_second(table, category) is not None

    async def take(self, table: Table, category: int, want: int) -> Grant | None:
        """Up to ``want`` tokens of ``category``'s bucket; None if the database refused."""
        declared = self._app.rate_limit(category)
        try:
            async with self._engine.begin() as conn:
                return await take_tokens(
                    conn, table, category, None if declared is None else declared.per_second, want
                )
        except (SQLAlchemyError, OSError) as exc:
            cause = getattr(exc, "orig", None) or exc
            advice = privilege_advice(cause, Role.WORKER)
            log.warning(
                "cannot take tokens of category %s's rate limit in %s (calls of it wait): %s: %s%s",
                self._app.category_name(category),
                table.name,
                type(cause).__qualname__,
                cause,
                advice,
            )
            return None

    async def token(
        self, shard: ShardRef, category: int, deadline: float, round_: RoundShards | None
    ) -> bool:
        """A token for a call of ``category`` in ``shard`` (at once when it has no limit);
        False if none came by ``deadline`` or before ``round_`` gave up."""
        if not self.limited(shard.table, category):
            return True
        key = (shard.table, category)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(self, self._app.table(shard.table), category)
        return await bucket.take(shard.key, deadline, round_)

    def round_groups(self, table: str, seconds: float) -> Callable[[int], int | None]:
        """The groups of a category of ``table`` a round of ``seconds`` reads from one shard
        at most: its share of the tokens due meanwhile, split between the tenants that ask
        for them (None: no limit). More would be read again, round after round, while their
        calls wait: work that slows the other categories down."""

        @functools.cache
        def groups(category: int) -> int | None:
            per_second = self.per_second(table, category)
            if per_second is None:
                return None
            bucket = self._buckets.get((table, category))
            tenants = 1 if bucket is None else bucket.tenants()
            return max(1, math.ceil(per_second * seconds / tenants))

        return groups

    def waiting_lines(self, table: str) -> list[str]:
        """The categories of ``table`` that calls of this worker wait for now, one line each
        (see :func:`waiting_line`)."""
        lines = []
        for (name, category), bucket in self._buckets.items():
            rate = bucket.per_second or self.per_second(name, category)
            if name == table and bucket.waiting and rate:
                category_name = self._app.category_name(category)
                lines.append(waiting_line(category_name, rate, bucket.waiting, bucket.waits))
        return lines

    def waited(self, bucket: Bucket, seconds: float) -> None:
        bucket.waits.append(seconds)
        metrics = active_metrics()
        if metrics is not None:
            name = self._app.category_name(bucket.category)
            metrics.rate_limit_wait.record(seconds, {"outbox.category": name})

    def _refresh(self) -> None:
        """Read the rates operators set again, in the background, once they are old."""
        now = time.monotonic()
        if now - self._read_at < REFRESH_SECONDS:
            return
        self._read_at = now
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        found: dict[str, dict[int, float]] = {}
        try:
            async with self._engine.connect() as conn:
                for name in self._app.tables:
                    records = await read_limits(conn, self._app.table(name))
                    found[name] = {
                        r.category: r.per_second for r in records if r.per_second is not None
                    }
        except (SQLAlchemyError, OSError) as exc:
            log.warning("cannot read the rate limits set at run time (kept as they were): %s", exc)
            return
        self._set = found
        for (table, category), bucket in self._buckets.items():
            if bucket.waiting and not self.limited(table, category):
                bucket.lift()

    def close(self) -> None:
        """Stop taking tokens (the worker stops)."""
        for task in [self._reading, *(bucket.filler for bucket in self._buckets.values())]:
            if task is not None:
                task.cancel()


def waiting_line(category: str, per_second: float, waiting: int, waits: Sequence[float]) -> str:
    """``ORGANIZATION_UPDATE 100/s: 3 waiting; the last 100 calls waited 0.4 s at the median,
    1.9 s at most`` (the second part once a call had its token)."""
    line = f"{category} {RateLimit(per_second)}: {waiting} waiting"
    if not waits:
        return line
    ordered = sorted(waits)
    median, longest = ordered[len(ordered) // 2], ordered[-1]
    calls = "the last call" if len(ordered) == 1 else f"the last {len(ordered)} calls"
    return f"{line}; {calls} waited {median:.1f} s at the median, {longest:.1f} s at most"


def turn(
    rates: RateLimits | None,
    shard: ShardRef,
    category: int,
    limits: list[Limit],
    deadline: float,
    round_: RoundShards | None,
) -> Held:
    """A slot of each of ``limits``, after a token when ``category`` is rate limited."""
    if rates is None or not rates.limited(shard.table, category):
        return Held(limits, deadline, round_)
    token = functools.partial(rates.token, shard, category, deadline, round_)
    return Held(limits, deadline, round_, token)
