"""Every SQL statement outbox-bridge runs against an outbox table, named and kept in one place.

All statements are SQLAlchemy Core constructs with bound parameters; table names come from the
registry, which accepts only plain identifiers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Row,
    Table,
    Text,
    TextClause,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    or_,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, BIT
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.parked import not_parked
from outbox_bridge.db.pauses import due_at, due_at_sql, not_due, not_due_sql, wait_seconds_sql
from outbox_bridge.db.schema import (
    TRACE_CONTEXT_COLUMN,
    owners_of,
    shard_columns,
    shard_where,
)
from outbox_bridge.db.timestamps import LATEST
from outbox_bridge.workflows.models import ShardRef


@dataclass(slots=True)
class GroupRows:
    """A coalescing group as read at the head of a shard: every visible id, ascending."""

    category: int
    object_identifier: int
    ids: list[int]

    @property
    def first_id(self) -> int:
        return self.ids[0]

    @property
    def last_id(self) -> int:
        return self.ids[-1]


@dataclass(frozen=True)
class ShardRange:
    """A shard with pending rows, as seen by a sweep."""

    region: str | None
    scope: int
    shard_identifier: int
    min_id: int
    max_id: int
    rows: int = 0


def _any_id(ids: Sequence[int]) -> ColumnElement[Any]:
    # One array parameter, not one parameter per id: groups can hold many thousand rows.
    return any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger)))


# held_for of a shard held because it is skipped (no drain takes it, not even its workflow's).
SKIPPED_HOLD = "skipped"
# SQLSTATE of a lock wait that ran into lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


def lock_key(shard: ShardRef) -> str:
    return f"outbox:{shard.table}:{shard.region or ''}:{shard.scope}:{shard.shard_identifier}"


async def try_lock_shards(conn: AsyncConnection, shards: Sequence[ShardRef]) -> list[bool]:
    """Take the free advisory locks of ``shards`` in one statement; which were taken, in order.
    Session locks, not transaction ones (no transaction stays open while a handler runs): a
    crashed worker's closed connection releases them."""
    if not shards:
        return []
    result = await conn.execute(
        text(
            "SELECT pg_try_advisory_lock(hashtextextended(k, 0)) "
            "FROM unnest(CAST(:keys AS text[])) WITH ORDINALITY AS u(k, n) ORDER BY n"
        ),
        {"keys": [lock_key(shard) for shard in shards]},
    )
    return [bool(taken) for taken in result.scalars()]


_UNLOCK_SHARDS = text(
    "SELECT pg_advisory_unlock(hashtextextended(k, 0)) FROM unnest(CAST(:keys AS text[])) AS u(k)"
)


async def unlock_shards(conn: AsyncConnection, shards: Sequence[ShardRef]) -> None:
    """Release the advisory locks of ``shards`` held by this connection."""
    if shards:
        await conn.execute(_UNLOCK_SHARDS, {"keys": [lock_key(shard) for shard in shards]})


async def lock_shard_waiting(conn: AsyncConnection, shard: ShardRef, seconds: float) -> bool:
    """Take ``shard``'s advisory lock, waiting at most ``seconds`` (a skip waits for a drain
    round of the shard to end rather than fail). False if the wait ran out."""
    timeout = f"{max(1, int(seconds * 1000))}ms"
    await conn.execute(
        text("SELECT set_config('lock_timeout', :timeout, false)"), {"timeout": timeout}
    )
    try:
        await conn.execute(
            text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), {"key": lock_key(shard)}
        )
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return False
        raise
    finally:
        await conn.execute(text("SELECT set_config('lock_timeout', '0', false)"))
    return True


async def read_pending_up_to(
    conn: AsyncConnection, table: Table, shard: ShardRef, up_to_id: int
) -> tuple[bool, datetime | None]:
    """Whether rows of the shard up to ``up_to_id`` are pending, and if the first of them not
    yet due (scheduled later, or paused) is among them, when it is due (the shard waits for it).
    Parked rows are not waited for, except row ``up_to_id`` itself."""
    where = and_(shard_where(table, shard), table.c.id <= up_to_id)
    barrier = (
        select(due_at(table))
        .where(where, _visible(table), not_due(table))
        .order_by(table.c.id)
        .limit(1)
        .scalar_subquery()
    )
    waited = exists().where(where, or_(_visible(table), table.c.id == up_to_id))
    pending, deferred_until = (await conn.execute(select(waited, barrier))).one()
    return bool(pending), deferred_until


@dataclass(frozen=True)
class FirstRow:
    """A shard's first pending row, and whether it may run now (by the database's clock)."""

    id: int
    category: int
    object_identifier: int
    due: bool

    def heads(self, category: int, object_identifier: int) -> bool:
        """Whether this row belongs to the group ``(category, object_identifier)``."""
        return (self.category, self.object_identifier) == (category, object_identifier)


def _first_row_columns(table: Table) -> list[Any]:
    return [table.c.id, table.c.category, table.c.object_identifier, ~not_due(table)]


def _visible(table: Table) -> TextClause:
    """``table``'s rows of no parked group, as a Core clause."""
    return text(not_parked(table, table.name))


async def read_first_row(conn: AsyncConnection, table: Table, shard: ShardRef) -> FirstRow | None:
    """The shard's first pending row not parked, if it has any (one index lookup)."""
    first = select(*_first_row_columns(table)).where(shard_where(table, shard), _visible(table))
    row = (await conn.execute(first.order_by(table.c.id).limit(1))).one_or_none()
    return None if row is None else FirstRow(row[0], row[1], row[2], bool(row[3]))


async def read_shard_max_id(conn: AsyncConnection, table: Table, shard: ShardRef) -> int | None:
    """The shard's highest pending id not parked, if it has such rows."""
    highest = select(func.max(table.c.id)).where(shard_where(table, shard), _visible(table))
    value: int | None = (await conn.execute(highest)).scalar_one()
    return value


async def read_trace_contexts(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, Any]:
    """The stored producer trace context of each of ``ids`` that has one."""
    column = table.c[TRACE_CONTEXT_COLUMN]
    return await _by_id(conn, table, column, ids, column.is_not(None))


async def _by_id(
    conn: AsyncConnection, table: Table, value: Any, ids: Sequence[int], *where: Any
) -> dict[int, Any]:
    """``value`` of each of ``ids`` still there (and matching ``where``), by id."""
    if not ids:
        return {}
    result = await conn.execute(select(table.c.id, value).where(table.c.id == _any_id(ids), *where))
    return {row_id: value for row_id, value in result}


async def read_oldest_ages(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, float]:
    """Per scope, the age in seconds (by the database's clock) of the oldest of ``ids`` (each
    shard's lowest pending id: one index lookup per shard, no scan of the table)."""
    if not ids:
        return {}
    age = func.extract("epoch", func.max(func.now() - table.c.date_added))
    result = await conn.execute(
        select(table.c.shard_scope, age)
        .where(table.c.id == _any_id(ids))
        .group_by(table.c.shard_scope)
    )
    return {int(scope): float(seconds) for scope, seconds in result}


async def read_row_ages(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, float]:
    """The age in seconds (by the database's clock) of each of ``ids`` still there."""
    age = func.extract("epoch", func.now() - table.c.date_added)
    return {row_id: float(age) for row_id, age in (await _by_id(conn, table, age, ids)).items()}


def _shard_key_columns(table: Table) -> list[Any]:
    return [table.c[name] for name in shard_columns("region" in table.c)]


def _with_region(table: Table, row: Sequence[Any]) -> tuple[Any, ...]:
    """``row``'s values, led by its region: None in a table without one."""
    values: tuple[Any, ...] = tuple(row)
    return values if "region" in table.c else (None, *values)


# -- partitions -------------------------------------------------------------------------------
# A shard's partition is the first 32 bits of the MD5 of "<region>:<scope>:<identifier>", modulo
# the number of partitions: the same in Python and in SQL, so that a partition's scan returns
# only its own shards.


def partition_number(region: str | None, scope: int, identifier: int, partitions: int) -> int:
    """The partition (of ``partitions``) that drains the shard while it is healthy."""
    digest = hashlib.md5(f"{region or ''}:{scope}:{identifier}".encode(), usedforsecurity=False)
    return int.from_bytes(digest.digest()[:4], "big") % partitions


def _partition_sql(table: Table, partitions: int) -> ColumnElement[Any]:
    """:func:`partition_number` of each row's shard, in SQL."""
    region: Any = func.coalesce(table.c.region, "") if "region" in table.c else ""
    key = func.concat(region, ":", table.c.shard_scope, ":", table.c.shard_identifier)
    first_bits = cast(func.concat("x", func.left(func.md5(key), 8)), BIT(32))
    return cast(first_bits, BigInteger).op("%")(partitions)


async def read_shard_ranges(
    conn: AsyncConnection,
    table: Table,
    *,
    after_id: int | None = None,
    regions: Sequence[str] | None = None,
    partition: tuple[int, int] | None = None,
    limit: int | None = None,
) -> list[ShardRange]:
    """Shards with rows (above ``after_id``, if given) and their id range; with ``partition``
    (number, partitions) only its shards, with ``limit`` that many with the oldest rows."""
    keys = _shard_key_columns(table)
    first = func.min(table.c.id)
    query = select(*keys, first, func.max(table.c.id), func.count()).group_by(*keys)
    if after_id is not None:
        query = query.where(table.c.id > after_id)
    if regions is not None and "region" in table.c:
        query = query.where(
            table.c.region == any_(bindparam("regions", list(regions), type_=ARRAY(Text)))
        )
    if partition is not None:
        number, partitions = partition
        query = query.having(_partition_sql(table, partitions) == number)
    if limit is not None:
        query = query.order_by(first).limit(limit)
    return [ShardRange(*_with_region(table, row)) for row in await conn.execute(query)]


@dataclass(frozen=True)
class ShardDepth:
    """A shard's backlog: pending rows, coalescing groups, and its oldest row."""

    region: str | None
    scope: int
    shard_identifier: int
    rows: int
    groups: int
    oldest: datetime


async def read_shard_depths(
    conn: AsyncConnection,
    table: Table,
    *,
    scope: int | None = None,
    oldest_first: bool = False,
    limit: int = 20,
) -> list[ShardDepth]:
    """The deepest shards (or those with the oldest pending row), one aggregate query."""
    keys = _shard_key_columns(table)
    rows = func.count().label("rows")
    oldest = func.min(table.c.date_added).label("oldest")
    groups = func.count(func.distinct(func.row(table.c.category, table.c.object_identifier)))
    query = select(*keys, rows, groups.label("groups"), oldest).group_by(*keys)
    if scope is not None:
        query = query.where(table.c.shard_scope == scope)
    query = query.order_by(oldest.asc() if oldest_first else rows.desc()).limit(limit)
    return [ShardDepth(*_with_region(table, row)) for row in await conn.execute(query)]


# -- many shards at once ---------------------------------------------------------------------


@dataclass(slots=True)
class WindowRow:
    """A row near the head of a shard, as the index holds it (no payload)."""

    id: int
    category: int
    object_identifier: int
    deferred_seconds: float | None  # > 0: not due for that long (by the database's clock)
    scheduled_for: datetime | None  # when it is due, if it is not yet


@dataclass
class ShardWindow:
    """The first rows of one shard, in id order, and its highest id."""

    index: int  # the shard's position in the request
    rows: list[WindowRow]
    highest_id: int


def _shard_source(
    table: Table, shards: Sequence[ShardRef], **extra: tuple[str, Sequence[Any]]
) -> tuple[str, dict[str, Any]]:
    """``unnest`` of the shards' keys as ``s(region?, scope, ident, <extra>..., n)``: one row
    per shard (``n`` its position, from 1), with the ``extra`` columns given as
    ``name=(sql type, values)``."""
    columns: list[tuple[str, str, Sequence[Any]]] = []
    if "region" in table.c:
        columns.append(("region", "text", [shard.region or "" for shard in shards]))
    columns.append(("scope", "integer", [shard.scope for shard in shards]))
    columns.append(("ident", "bigint", [shard.shard_identifier for shard in shards]))
    columns += [(name, sql_type, values) for name, (sql_type, values) in extra.items()]
    arrays = ", ".join(f"CAST(:{name}s AS {sql_type}[])" for name, sql_type, _ in columns)
    names = ", ".join(name for name, _, _ in columns)
    params = {f"{name}s": list(values) for name, _, values in columns}
    return f"unnest({arrays}) WITH ORDINALITY AS s({names}, n)", params


def _joins(alias: str, regional: bool) -> str:
    condition = f"{alias}.shard_scope = s.scope AND {alias}.shard_identifier = s.ident"
    return f"{alias}.region = s.region AND {condition}" if regional else condition


async def read_windows(
    conn: AsyncConnection,
    table: Table,
    shards: Sequence[ShardRef],
    *,
    window: int,
    skip_held: bool,
    skip_paused: bool = False,
) -> list[ShardWindow]:
    """For each of ``shards`` with rows, its first ``window`` rows in id order (from the shard
    index, no payloads) and its highest id, in one statement. ``skip_held`` leaves out the
    shards their own workflow holds (``db/ownership.py``), ``skip_paused`` the skipped ones."""
    if not shards:
        return []
    regional = "region" in table.c
    source, params = _shard_source(table, shards)
    held = ""
    if skip_held or skip_paused:
        owners = owners_of(table)
        paused = "" if skip_held else " AND o.held_for = :paused"
        params["paused"] = SKIPPED_HOLD
        held = (
            f"WHERE NOT EXISTS (SELECT 1 FROM {owners.name} o "
            f"WHERE {_joins('o', regional)}{paused})"
        )
    statement = text(
        f"""
        SELECT s.n, w.id, w.category, w.object_identifier,
               {wait_seconds_sql(table, "w", "s.scope")} AS deferred,
               {due_at_sql(table, "w", "s.scope")} AS due,
               m.highest
        FROM {source}
        CROSS JOIN LATERAL (
            SELECT max(t.id) AS highest FROM {table.name} t WHERE {_joins("t", regional)}
        ) m
        CROSS JOIN LATERAL (
            SELECT t.id, t.category, t.object_identifier, t.scheduled_for FROM {table.name} t
            WHERE {_joins("t", regional)} AND {not_parked(table, "t")}
            ORDER BY t.id LIMIT :window
        ) w
        {held}
        ORDER BY s.n, w.id
        """
    )
    windows: dict[int, ShardWindow] = {}
    for n, row_id, category, object_identifier, deferred, due, highest in await conn.execute(
        statement, {**params, "window": window}
    ):
        found = windows.get(n)
        if found is None:
            found = windows[n] = ShardWindow(n - 1, [], highest)
        found.rows.append(WindowRow(row_id, category, object_identifier, _finite(deferred), due))
    return list(windows.values())


def _finite(seconds: float | None) -> float | None:
    """Seconds until a row is due, capped at :data:`LATEST` (as ``infinity`` reads)."""
    if seconds is None:
        return None
    latest = (LATEST - datetime.now(UTC)).total_seconds()
    return seconds if math.isfinite(seconds) and seconds < latest else latest


@dataclass(frozen=True)
class GroupTail:
    """A head group that may go on past a shard's window: where to look for the rest."""

    shard: ShardRef
    category: int
    object_identifier: int
    after_id: int  # the window's last id


async def read_group_tails(
    conn: AsyncConnection, table: Table, tails: Sequence[GroupTail]
) -> list[tuple[list[int], float | None]]:
    """For each group of ``tails``: its ids after the window before the shard's first row not
    due, and in how many seconds that row is due (None: none in the way). One statement; each
    group costs two index lookups plus its rows, each shard a range scan to its newest group."""
    if not tails:
        return []
    regional = "region" in table.c
    source, params = _shard_source(
        table,
        [tail.shard for tail in tails],
        category=("integer", [tail.category for tail in tails]),
        object=("bigint", [tail.object_identifier for tail in tails]),
        after_id=("bigint", [tail.after_id for tail in tails]),
    )
    group = (
        f"{_joins('t', regional)} AND t.category = s.category "
        "AND t.object_identifier = s.object AND t.id > s.after_id"
    )
    key = "s.region, s.scope, s.ident" if regional else "s.scope, s.ident"
    statement = text(
        f"""
        WITH s AS (
            SELECT s.*, (SELECT max(t.id) FROM {table.name} t WHERE {group}) AS last_id
            FROM {source}
        ),
        barrier AS (
            SELECT {key}, (
                SELECT t.id FROM {table.name} t
                WHERE {_joins("t", regional)} AND t.id > min(s.after_id)
                  AND t.id <= max(s.last_id) AND {not_due_sql(table, "t")}
                  AND {not_parked(table, "t")}
                ORDER BY t.id LIMIT 1
            ) AS id
            FROM s GROUP BY {key}
        )
        SELECT s.n,
               ARRAY(SELECT t.id FROM {table.name} t
                     WHERE {group} AND t.id < coalesce(b.id, 9223372036854775807)
                     ORDER BY t.id) AS ids,
               (SELECT {wait_seconds_sql(table, "t")}
                FROM {table.name} t WHERE t.id = b.id) AS deferred
        FROM s JOIN barrier b USING ({key.replace("s.", "")})
        ORDER BY s.n
        """
    )
    result = await conn.execute(statement, params)
    return [(list(ids), _finite(deferred)) for _, ids, deferred in result]


def payload_bytes(payload: Any) -> ColumnElement[Any]:
    """The UTF-8 bytes of ``payload``'s JSON text as the worker reads it (``payload::text``):
    the uncompressed size, not the stored one. PostgreSQL builds the text to measure it, which
    costs the database what reading the payload would (half a second for 100 MB), and the
    worker nothing."""
    return func.octet_length(cast(payload, Text))


async def read_rows(
    conn: AsyncConnection,
    table: Table,
    ids: Sequence[int],
    *,
    with_trace_context: bool,
    max_payload_bytes: int,
) -> dict[int, Row[Any]]:
    """The rows ``ids`` still there, payloads as JSON text: the caller decodes them, so that a
    payload PostgreSQL stores but Python cannot decode fails its own row only. A payload over
    ``max_payload_bytes`` (:func:`payload_bytes`) is never sent: its row's ``payload`` is None
    and its ``payload_bytes`` says how large it is (None for the other rows)."""
    if not ids:
        return {}
    statement = _rows_statement(table, with_trace_context)
    result = await conn.execute(
        statement, {"ids": list(ids), "max_payload_bytes": max_payload_bytes}
    )
    return {row.id: row for row in result}


_ROWS_STATEMENTS: dict[tuple[Table, bool], Any] = {}


def _rows_statement(table: Table, with_trace_context: bool) -> Any:
    """:func:`read_rows`' statement, built once per table (building it was a fifth of its
    cost): its parameters are ``ids`` and ``max_payload_bytes``."""
    key = (table, with_trace_context)
    if key not in _ROWS_STATEMENTS:
        # OFFSET 0 keeps the subquery apart, so that the text is built once per row.
        text_of = (
            select(cast(table.c.payload, Text).label("text"))
            .correlate(table)
            .offset(0)
            .lateral("p")
        )
        size = func.octet_length(text_of.c.text)
        fits = size <= bindparam("max_payload_bytes", type_=BigInteger)
        columns: list[Any] = [
            c
            for c in table.c
            if c.name != "payload" and (with_trace_context or c.name != TRACE_CONTEXT_COLUMN)
        ]
        columns.append(case((fits, text_of.c.text)).label("payload"))
        columns.append(case((~fits, size)).label("payload_bytes"))
        ids = any_(bindparam("ids", type_=ARRAY(BigInteger)))
        _ROWS_STATEMENTS[key] = (
            select(*columns).select_from(table.join(text_of, true())).where(table.c.id == ids)
        )
    return _ROWS_STATEMENTS[key]


async def read_payload_sizes(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, int]:
    """The :func:`payload_bytes` of each of ``ids`` still there (0 without a payload); no
    payload is sent."""
    return await _by_id(conn, table, func.coalesce(payload_bytes(table.c.payload), 0), ids)


async def delete_handled(conn: AsyncConnection, table: Table, ids: Sequence[int]) -> list[int]:
    """Delete exactly the rows ``ids`` a handler covered (rows committed meanwhile survive,
    even with a lower id: a late commit runs next round); returns the ids deleted."""
    if not ids:
        return []
    result = await conn.execute(_delete_statement(table, ids))
    return list(result.scalars())


def _delete_statement(table: Table, ids: Sequence[int]) -> Any:
    return delete(table).where(table.c.id == _any_id(ids)).returning(table.c.id)


class DriverWrites:
    """:func:`delete_handled` and :func:`unlock_shards` of one table, compiled once and run on
    the psycopg connection: SQLAlchemy's share (compiling, a greenlet, result rows) was most
    of their cost.

    Each delete commits asynchronously (no WAL flush, about 40% of its time): only a crash of
    PostgreSQL within the WAL writer's delay undoes it, and its rows run again, as
    at-least-once allows. Ownership changes commit synchronously, making earlier deletes
    durable too.
    """

    def __init__(self, table: Table, dialect: Dialect) -> None:
        asynchronous = select(func.set_config("synchronous_commit", "off", True)).scalar_subquery()
        statement = _delete_statement(table, []).where(asynchronous.is_not(None))
        delete_ = statement.compile(dialect=dialect)
        self._delete = str(delete_)
        self._delete_params = dict(delete_.params)
        self._unlock = str(_UNLOCK_SHARDS.compile(dialect=dialect))

    async def delete_handled(
        self, driver: psycopg.AsyncConnection[Any], ids: Sequence[int]
    ) -> list[int]:
        if not ids:
            return []
        params = {**self._delete_params, "ids": list(ids)}
        return [row[0] for row in await _run(driver, self._delete, params)]

    async def unlock_shards(
        self, driver: psycopg.AsyncConnection[Any], shards: Sequence[ShardRef]
    ) -> None:
        if shards:
            await _run(driver, self._unlock, {"keys": [lock_key(s) for s in shards]})


async def _run(
    driver: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any]
) -> list[Any]:
    """``statement``'s rows; a driver error raised as SQLAlchemy raises it (callers catch those)."""
    async with driver.cursor() as cursor:
        try:
            await cursor.execute(statement, params)
            return await cursor.fetchall()
        except psycopg.Error as exc:
            raise DBAPIError.instance(statement, None, exc, psycopg.Error) from exc


_DRIVER_WRITES: dict[tuple[Table, str], DriverWrites] = {}


def driver_writes(table: Table, dialect: Dialect) -> DriverWrites:
    """The :class:`DriverWrites` of ``table`` (made once per table and dialect)."""
    key = (table, dialect.name)
    if key not in _DRIVER_WRITES:
        _DRIVER_WRITES[key] = DriverWrites(table, dialect)
    return _DRIVER_WRITES[key]


# -- planner statistics ---------------------------------------------------------------------------

# A table with at least this many rows and no planner statistics gets analyzed: below it, the
# plans that statistics would change cost little either way.
STATISTICS_MIN_ROWS = 1_000


async def lacks_statistics(conn: AsyncConnection, table: Table) -> bool:
    """Whether ``table`` holds :data:`STATISTICS_MIN_ROWS` rows or more and no statistics on
    its shard columns. Without them the planner may range-scan a deep shard once per group of
    every round (a 20,000-row shard drained at 420 rows/s instead of 11,000)."""
    result = await conn.execute(
        text(
            f"""
            SELECT NOT EXISTS (
                SELECT 1 FROM pg_stats s
                JOIN pg_namespace n ON n.nspname = s.schemaname
                JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = s.tablename
                WHERE c.oid = to_regclass(:table) AND s.attname = 'shard_identifier'
            ) AND (SELECT count(*) FROM (SELECT 1 FROM {table.name} LIMIT :rows) r) >= :rows
            """
        ),
        {"table": table.name, "rows": STATISTICS_MIN_ROWS},
    )
    return bool(result.scalar())


async def analyze(conn: AsyncConnection, table: Table) -> None:
    """Gather ``table``'s planner statistics (needs the table's owner, or the MAINTAIN
    privilege from PostgreSQL 17)."""
    await conn.execute(text(f"ANALYZE {table.name}"))
