"""Rate limits per category, shared by every worker of a table: the statements of
``<table>_limits``, one token bucket per category, and the rate an operator set at run time.

A bucket refills by the time elapsed since it was last taken from, at the category's rate (the
operator's if one is set, else the declared one), up to :data:`BURST_SECONDS` of it; a worker
takes up to N tokens at once with one guarded statement (:func:`take_tokens`), which the row's
lock serializes between workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Table, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.schema import LIMIT_ROLE, MAX_PER_SECOND, SESSION_USER, limits_of
from outbox_bridge.errors import OutboxError, RegistryError

# A bucket holds at most this many seconds of its rate (one token at least): an idle category
# starts with a burst this big, no bigger.
BURST_SECONDS = 1.0
# A bucket taken from this recently has calls waiting for it: workers take only then, at
# least every two seconds.
WAITING_SECONDS = 5.0

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*/\s*([smh])")


@dataclass(frozen=True)
class RateLimit:
    """Calls per second of a category, in every worker together."""

    per_second: float

    def __str__(self) -> str:
        for unit, seconds in _UNITS.items():
            calls = self.per_second * seconds
            if round(calls, 6) == round(calls) and round(calls) >= 1:
                return f"{round(calls)}/{unit}"
        return f"{self.per_second:g}/s"


def parse_rate(
    value: object, what: str = "rate_limit", error: type[OutboxError] = RegistryError
) -> RateLimit:
    """The rate limit ``value`` names: calls per second, minute or hour (``"50/s"``,
    ``"300/m"``, ``"1000/h"``). Raises ``error`` for anything else."""
    match = _RATE.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if match is None:
        raise error(
            f"{what} {value!r} is not a rate: give calls per second, minute or hour, such as "
            "'50/s', '300/m' or '1000/h'"
        )
    per_second = float(match[1]) / _UNITS[match[2]]
    if not 0 < per_second <= MAX_PER_SECOND:
        raise error(
            f"{what} {value!r} must be above 0 and at most {MAX_PER_SECOND:,.0f}/s; "
            "leave the limit out for none"
        )
    return RateLimit(per_second)


@dataclass(frozen=True)
class Grant:
    """What one take got: ``tokens`` (0 to the number asked), and the rate the bucket has now
    (None: the category has no limit, neither declared nor set)."""

    tokens: int
    per_second: float | None


@dataclass(frozen=True)
class LimitRecord:
    """A category's row in ``<table>_limits``: the rate an operator set (None: the declared
    one), who changed it last, as declared and as PostgreSQL authenticated them, the rate the
    workers declare, and whether calls wait for its tokens (a worker took some in the last
    :data:`WAITING_SECONDS`)."""

    category: int
    per_second: float | None
    set_by: str | None
    set_role: str | None
    set_at: datetime | None
    declared: float | None = None  # as the worker that last took tokens declared it
    waiting: bool = False


def _take_sql(limits: str) -> str:
    # The sub-select locks the row (a concurrent take waits, then reads its result), so that the
    # refill and the take are computed from the row as the last take left it.
    return f"""
        UPDATE {limits} l SET tokens = b.avail - b.granted, refilled_at = b.at,
                              declared = CAST(:declared AS float8)
        FROM (
            SELECT category, at, rate, avail, least(floor(avail), :want)::int AS granted
            FROM (
                SELECT category, at, rate,
                       least(greatest(rate * {BURST_SECONDS}, 1),
                             tokens + rate * greatest(0, extract(epoch FROM at - refilled_at)))
                           AS avail
                FROM (SELECT category, tokens, refilled_at, clock_timestamp() AS at,
                             coalesce(per_second, CAST(:declared AS float8)) AS rate
                      FROM {limits} WHERE category = :category FOR UPDATE) locked
            ) filled
        ) b
        WHERE l.category = b.category AND b.rate IS NOT NULL
        RETURNING b.granted, b.rate
    """


async def take_tokens(
    conn: AsyncConnection, table: Table, category: int, declared: float | None, want: int
) -> Grant:
    """Take up to ``want`` tokens of ``category``'s bucket (created at its first take), at the
    operator's rate, else ``declared`` (calls per second), which the row records. Run it in a
    transaction of its own: the row stays locked until the transaction ends."""
    limits = limits_of(table)
    params = {"category": category, "declared": declared, "want": want}
    statement = text(_take_sql(limits.name))
    row = (await conn.execute(statement, params)).one_or_none()
    if row is None:
        insert = pg_insert(limits).values(category=category).on_conflict_do_nothing()
        await conn.execute(insert)
        row = (await conn.execute(statement, params)).one_or_none()
    if row is None:
        return Grant(0, None)
    return Grant(int(row.granted), float(row.rate))


async def set_limit(
    conn: AsyncConnection, table: Table, category: int, limit: RateLimit | None, by: str
) -> None:
    """Set ``category``'s rate in every worker of ``table`` (None: back to the declared one),
    recording who did it and when."""
    limits = limits_of(table)
    values = {
        "per_second": None if limit is None else limit.per_second,
        "set_by": by,
        "set_at": func.now(),
        LIMIT_ROLE: SESSION_USER,
    }
    insert = pg_insert(limits).values(category=category, **values)
    upsert = insert.on_conflict_do_update(index_elements=[limits.c.category], set_=values)
    await conn.execute(upsert)


async def read_limits(conn: AsyncConnection, table: Table) -> list[LimitRecord]:
    """Every category of ``table`` with a bucket or a record of a change, by category."""
    limits = limits_of(table)
    names = ("category", "per_second", "set_by", LIMIT_ROLE, "set_at", "declared")
    since = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, WAITING_SECONDS)
    waiting = limits.c.refilled_at > since
    statement = select(*(limits.c[n] for n in names), waiting).order_by(limits.c.category)
    return [LimitRecord(*row[:6], waiting=bool(row[6])) for row in await conn.execute(statement)]
