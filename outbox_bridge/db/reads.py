"""What a drain round reads at the heads of its shards, many shards per statement: windows of
the shard index, the tails of groups past them, the newest rows and their payload sizes.

All statements are SQLAlchemy Core constructs with bound parameters; table names come from the
registry, which accepts only plain identifiers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Row,
    Table,
    Text,
    TextClause,
    any_,
    bindparam,
    case,
    cast,
    func,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.driver import Compiled, rows_of
from outbox_bridge.db.parked import not_parked
from outbox_bridge.db.pauses import due_at_sql, not_due_sql, wait_seconds_sql
from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN, owners_of
from outbox_bridge.db.timestamps import LATEST
from outbox_bridge.workflows.models import HeldFor, ShardRef


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


def any_id(ids: Sequence[int]) -> ColumnElement[Any]:
    # One array parameter, not one parameter per id: groups can hold many thousand rows.
    return any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger)))


def visible(table: Table) -> TextClause:
    """``table``'s rows of no parked group, as a Core clause."""
    return text(not_parked(table, table.name))


async def read_trace_contexts(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, Any]:
    """The stored producer trace context of each of ``ids`` that has one."""
    column = table.c[TRACE_CONTEXT_COLUMN]
    return await by_id(conn, table, column, ids, column.is_not(None))


async def by_id(
    conn: AsyncConnection, table: Table, value: Any, ids: Sequence[int], *where: Any
) -> dict[int, Any]:
    """``value`` of each of ``ids`` still there (and matching ``where``), by id."""
    if not ids:
        return {}
    result = await conn.execute(select(table.c.id, value).where(table.c.id == any_id(ids), *where))
    return {row_id: value for row_id, value in result}


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
    shards their own workflow holds (:mod:`outbox_bridge.db.ownership`), ``skip_paused`` the
    skipped ones."""
    if not shards:
        return []
    _, params = _shard_source(table, shards)
    params.update(window=window, paused=HeldFor.SKIPPED.value)
    statement = _windows_statement(table, skip_held, skip_paused)
    windows: dict[int, ShardWindow] = {}
    for n, row_id, category, object_identifier, deferred, due, highest in await rows_of(
        conn, statement, params, generic_plan=True
    ):
        found = windows.get(n)
        if found is None:
            found = windows[n] = ShardWindow(n - 1, [], highest)
        found.rows.append(WindowRow(row_id, category, object_identifier, _finite(deferred), due))
    return list(windows.values())


_WINDOWS_STATEMENTS: dict[tuple[Table, bool, bool], Compiled] = {}


def _windows_statement(table: Table, skip_held: bool, skip_paused: bool) -> Compiled:
    """:func:`read_windows`' statement, built and compiled once per table and kind."""
    key = (table, skip_held, skip_paused)
    if key in _WINDOWS_STATEMENTS:
        return _WINDOWS_STATEMENTS[key]
    regional = "region" in table.c
    source, _ = _shard_source(table, [])
    held = ""
    if skip_held or skip_paused:
        owners = owners_of(table)
        paused = "" if skip_held else " AND o.held_for = :paused"
        held = (
            f"WHERE NOT EXISTS (SELECT 1 FROM {owners.name} o "
            f"WHERE {_joins('o', regional)}{paused})"
        )
    statement = text(
        f"""
        SELECT s.n, w.id, w.category, w.object_identifier,
               extract(epoch FROM d.due - now())::float8 AS deferred, d.due, m.highest
        FROM {source}
        CROSS JOIN LATERAL (
            SELECT max(t.id) AS highest FROM {table.name} t WHERE {_joins("t", regional)}
        ) m
        CROSS JOIN LATERAL (
            SELECT t.id, t.category, t.object_identifier, t.scheduled_for FROM {table.name} t
            WHERE {_joins("t", regional)} AND {not_parked(table, "t")}
            ORDER BY t.id LIMIT :window
        ) w
        CROSS JOIN LATERAL (SELECT {due_at_sql(table, "w", "s.scope")} AS due) d
        {held}
        ORDER BY s.n, w.id
        """
    )
    _WINDOWS_STATEMENTS[key] = Compiled.of(statement)
    return _WINDOWS_STATEMENTS[key]


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
    ``max_payload_bytes`` (:func:`read_payload_sizes`) is never sent: its row's ``payload`` is
    None and its ``payload_bytes`` says how large it is (None for the other rows)."""
    if not ids:
        return {}
    statement = _rows_statement(table, with_trace_context)
    params = {"ids": list(ids), "max_payload_bytes": max_payload_bytes}
    return {
        row.id: row
        for row in await rows_of(conn, statement, params, namedtuple_row, generic_plan=True)
    }


_ROWS_STATEMENTS: dict[tuple[Table, bool], Compiled] = {}


def _rows_statement(table: Table, with_trace_context: bool) -> Compiled:
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
        _ROWS_STATEMENTS[key] = Compiled.of(
            select(*columns).select_from(table.join(text_of, true())).where(table.c.id == ids)
        )
    return _ROWS_STATEMENTS[key]


async def read_payload_sizes(
    conn: AsyncConnection, table: Table, ids: Sequence[int]
) -> dict[int, int]:
    """The UTF-8 bytes of the JSON text of each of ``ids``' payload as the worker reads it
    (``payload::text``, 0 without one): the uncompressed size, not the stored one. PostgreSQL
    builds the text to measure it, which costs the database what reading the payload would
    (half a second for 100 MB); no payload is sent."""
    size = func.coalesce(func.octet_length(cast(table.c.payload, Text)), 0)
    return await by_id(conn, table, size, ids)
