"""Paused categories and scopes: the statements of ``<table>_pauses``, and the SQL clause with
which every read of a shard's head honours it.

A row of a paused category or scope is *not due*, like a row scheduled for later: its shard
stops at it (order is per shard). It reads as due :data:`PAUSE_RECHECK_SECONDS` from now at the
latest, or when the next timed pause ends if that is sooner; a resume wakes the waiting shards at
once (:data:`PAUSES_CHANGED` asks for a sweep).

A timed pause (``ends_at``) holds until then and no longer, by the database's clock: every read
below leaves an ended pause out, so it ends on time whether or not a worker runs; the active
bridge's sweep deletes it afterwards (:func:`end_timed_pauses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Table,
    case,
    delete,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.schema import (
    PAUSE_ENDS_AT,
    PAUSED_ROLE,
    SESSION_USER,
    notify_channel,
    pauses_of,
    shard_values,
)
from outbox_bridge.workflows.models import PauseKind, ShardRef

# A shard workflow waiting at a paused row reads the shard again after this long at most (in
# case it misses the resume's wake-up).
PAUSE_RECHECK_SECONDS = 300
# What a change of the pauses sends on the table's NOTIFY channel: the active bridge sweeps.
PAUSES_CHANGED = "pauses"


@dataclass(frozen=True)
class Pause:
    """An operator's pause of a category or a scope, as the table keeps it."""

    kind: PauseKind
    number: int
    reason: str
    paused_by: str
    since: datetime
    paused_via: str | None = None  # the Temporal sender of the pause update, if one made it
    paused_role: str = ""  # the role PostgreSQL authenticated, beside the declared paused_by
    ends_at: datetime | None = None  # when a timed pause ends by itself


@dataclass(frozen=True)
class PauseEnd:
    """When a pause ends by itself: ``at`` a time, or ``seconds`` after the database's now
    (neither: when unpaused)."""

    at: datetime | None = None
    seconds: float | None = None


# -- the clause every head read uses -------------------------------------------------------------


def _holds(alias: str = "") -> str:
    """SQL, true when the pause (``alias``: its table's alias) holds now: it has no end, or has
    not reached it."""
    ends_at = f"{alias}.{PAUSE_ENDS_AT}" if alias else PAUSE_ENDS_AT
    return f"({ends_at} IS NULL OR {ends_at} > now())"


def paused_sql(table: Table, row: str, scope: str | None = None) -> str:
    """SQL, true when the row ``row`` (an alias of ``table``) has a paused category or scope
    (``scope``, an SQL expression; ``row``'s own by default). Uncorrelated sub-selects: the
    pauses are read once per statement, not per row."""
    pauses = pauses_of(table).name
    scope = scope or f"{row}.shard_scope"
    held = f"SELECT number FROM {pauses} WHERE {_holds()} AND kind"
    return (
        f"({row}.category = ANY(ARRAY({held} = 'category')) "
        f"OR {scope} = ANY(ARRAY({held} = 'scope')))"
    )


def _recheck_at_sql(table: Table) -> str:
    """SQL: when a paused row is read again at the latest: in :data:`PAUSE_RECHECK_SECONDS`, or
    when the next timed pause ends if that is sooner (``least`` passes over a NULL)."""
    pauses = pauses_of(table).name
    next_end = f"(SELECT min({PAUSE_ENDS_AT}) FROM {pauses} WHERE {PAUSE_ENDS_AT} > now())"
    return f"least(now() + interval '{PAUSE_RECHECK_SECONDS} seconds', {next_end})"


def not_due_sql(table: Table, row: str, scope: str | None = None) -> str:
    """SQL that is true when the row ``row`` may not run now: scheduled later, or paused."""
    return f"({row}.scheduled_for > now() OR {paused_sql(table, row, scope)})"


def wait_seconds_sql(table: Table, row: str, scope: str | None = None) -> str:
    """SQL: for how many seconds the row ``row`` is not due (NULL when it is): until it is
    scheduled, and a paused row until it is read again (:func:`_recheck_at_sql`) at least."""
    return f"extract(epoch FROM ({due_at_sql(table, row, scope)}) - now())::float8"


def due_at_sql(table: Table, row: str, scope: str | None = None) -> str:
    """SQL: when the row ``row`` is due, if it is not now (see :func:`wait_seconds_sql`)."""
    return (
        f"CASE WHEN {paused_sql(table, row, scope)} "
        f"THEN greatest({row}.scheduled_for, {_recheck_at_sql(table)}) "
        f"WHEN {row}.scheduled_for > now() THEN {row}.scheduled_for END"
    )


def not_due(table: Table) -> ColumnElement[bool]:
    """:func:`not_due_sql` of ``table``'s own rows, for SQLAlchemy Core statements."""
    return literal_column(not_due_sql(table, table.name), Boolean)


def due_at(table: Table) -> ColumnElement[Any]:
    """:func:`due_at_sql` of ``table``'s own rows, for SQLAlchemy Core statements."""
    return literal_column(f"({due_at_sql(table, table.name)})")


# -- changing and reading the pauses --------------------------------------------------------------


async def add_pause(
    conn: AsyncConnection,
    table: Table,
    kind: PauseKind,
    number: int,
    reason: str,
    by: str,
    *,
    via: str | None = None,
    end: PauseEnd | None = None,
) -> Pause:
    """Pause a category or a scope of ``table`` and tell the bridge (pausing again records the
    new reason, who and end, and keeps when it began, unless the pause had ended). ``via``: the
    sender as Temporal recorded it; ``end``: when the pause ends by itself (never by default)."""
    pauses = pauses_of(table)
    ends_at: Any = None
    if end is not None and end.seconds is not None:
        ends_at = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, end.seconds)
    elif end is not None:
        ends_at = end.at
    insert = pg_insert(pauses).values(
        kind=kind, number=number, reason=reason, paused_by=by, paused_via=via, ends_at=ends_at
    )
    ended = pauses.c.ends_at.is_not(None) & (pauses.c.ends_at <= func.now())
    statement = insert.on_conflict_do_update(
        index_elements=[pauses.c.kind, pauses.c.number],
        set_={
            "reason": insert.excluded.reason,
            "paused_by": insert.excluded.paused_by,
            "paused_via": insert.excluded.paused_via,
            PAUSED_ROLE: SESSION_USER,
            PAUSE_ENDS_AT: insert.excluded.ends_at,
            "since": case((ended, func.now()), else_=pauses.c.since),
        },
    ).returning(*pauses.c)
    row = (await conn.execute(statement)).one()
    await _announce(conn, table)
    return _pause(row)


async def remove_pause(
    conn: AsyncConnection, table: Table, kind: PauseKind, number: int
) -> Pause | None:
    """Resume a paused category or scope of ``table`` (None if it was not paused), and tell the
    bridge, whose sweep wakes the waiting shards."""
    pauses = pauses_of(table)
    statement = (
        delete(pauses).where(pauses.c.kind == kind, pauses.c.number == number).returning(*pauses.c)
    )
    row = (await conn.execute(statement)).one_or_none()
    await _announce(conn, table)
    return None if row is None else _pause(row)


async def read_pauses(conn: AsyncConnection, table: Table) -> list[Pause]:
    """Every pause of ``table`` that holds now, oldest first."""
    pauses = pauses_of(table)
    statement = select(*pauses.c).where(text(_holds())).order_by(pauses.c.since, pauses.c.number)
    return [_pause(row) for row in await conn.execute(statement)]


async def end_timed_pauses(conn: AsyncConnection, table: Table) -> list[Pause]:
    """Delete the timed pauses of ``table`` that have ended (they hold nothing since their end:
    every read leaves them out) and return them; tells the bridge when there were any."""
    pauses = pauses_of(table)
    statement = (
        delete(pauses)
        .where(pauses.c.ends_at.is_not(None), pauses.c.ends_at <= func.now())
        .returning(*pauses.c)
    )
    ended = [_pause(row) for row in await conn.execute(statement)]
    if ended:
        await _announce(conn, table)
    return ended


async def read_shard_pause(conn: AsyncConnection, table: Table, shard: ShardRef) -> Pause | None:
    """The pause that holds ``shard``'s first row not due, if any (a category's first)."""
    pauses = pauses_of(table)
    values = shard_values(table, shard)
    where = " AND ".join(f"t.{name} = :{name}" for name in values)
    statement = text(
        f"""
        SELECT p.kind, p.number, p.reason, p.paused_by, p.since, p.paused_via, p.paused_role,
               p.ends_at
        FROM (SELECT t.category, t.shard_scope FROM {table.name} t
              WHERE {where} AND {not_due_sql(table, "t")}
              ORDER BY t.id LIMIT 1) h
        JOIN {pauses.name} p ON (p.kind = 'category' AND p.number = h.category)
                             OR (p.kind = 'scope' AND p.number = h.shard_scope)
        WHERE {_holds("p")}
        ORDER BY p.kind LIMIT 1
        """
    )
    row = (await conn.execute(statement, values)).one_or_none()
    return None if row is None else _pause(row)


async def _announce(conn: AsyncConnection, table: Table) -> None:
    # Delivered at commit, like the rows' own notifications.
    await conn.execute(select(func.pg_notify(notify_channel(table.name), PAUSES_CHANGED)))


def _pause(row: Any) -> Pause:
    p = row._mapping
    return Pause(
        PauseKind(p["kind"]),
        int(p["number"]),
        p["reason"],
        p["paused_by"],
        p["since"],
        p["paused_via"],
        p[PAUSED_ROLE],
        p[PAUSE_ENDS_AT],
    )
