"""Install and upgrade the outbox schema (``outbox-bridge init-db``), as a schema owner.

Only what the catalog shows missing or different is changed (:mod:`outbox_bridge.db.catalog`):
on an up-to-date database no statement runs, so no lock is taken on an outbox table. A
statement that has to run waits at most ``lock_timeout`` for its lock (PostgreSQL queues every
later request behind a waiting DDL lock: producers' INSERTs would wait too), then the whole
transaction is rolled back and tried again after a pause, a bounded number of times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import CheckConstraint, MetaData, Table, TextClause, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable, ExecutableDDLElement

from outbox_bridge.config import safe_url
from outbox_bridge.db.catalog import TableState, is_outbox, read_schema_state
from outbox_bridge.db.schema import notify_function_ddl, notify_trigger_ddl
from outbox_bridge.errors import ConfigurationError, SchemaLockError, SchemaMismatchError

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it bare

# SQLSTATE of a statement cancelled by lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"
LOCK_TIMEOUT_SECONDS = 3.0
LOCK_ATTEMPTS = 5
# Two installs at once (two deploys) must not race on CREATE TABLE.
_INSTALL_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended('outbox-bridge:ddl', 0))")


@dataclass(frozen=True)
class SchemaChange:
    """One statement of an install, and the table whose lock it takes."""

    table: str
    statement: str


def lock_timeout_statement(seconds: float = LOCK_TIMEOUT_SECONDS) -> str:
    """The statement that bounds how long the rest of the transaction's statements wait for a
    lock: a schema change waiting for a lock makes every producer's INSERT queue behind it."""
    return f"SET LOCAL lock_timeout = '{int(seconds * 1000)}ms'"


def ddl_sql(statement: ExecutableDDLElement | CreateColumn | str) -> str:
    """``statement`` (a SQLAlchemy DDL construct, or SQL text) as PostgreSQL's SQL text."""
    if isinstance(statement, str):
        return statement.strip()
    return str(statement.compile(dialect=_DIALECT)).strip()


def create_table_ddl(table: Table, *, if_not_exists: bool = False) -> list[ExecutableDDLElement]:
    """The statements that create ``table`` and its indexes (in the order of their names)."""
    indexes = sorted(table.indexes, key=lambda index: str(index.name))
    return [
        CreateTable(table, if_not_exists=if_not_exists),
        *(CreateIndex(index, if_not_exists=if_not_exists) for index in indexes),
    ]


def add_column_ddl(table: str, column_sql: str) -> str:
    """The statement that adds a column (``CreateColumn``'s text) to an existing table when it
    is missing. The columns a version adds are nullable or have a constant (or
    ``session_user``) default, so PostgreSQL adds them without rewriting the table."""
    return f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column_sql}"


def add_check_ddl(table: str, check: CheckConstraint) -> str:
    """The statement that adds ``check`` to an existing table, ``NOT VALID``: existing rows
    are not scanned, new writes are checked."""
    sqltext = check.sqltext.compile(dialect=_DIALECT)
    return f"ALTER TABLE {table} ADD CONSTRAINT {check.name} CHECK ({sqltext}) NOT VALID"


def changes_for(state: TableState) -> list[SchemaChange]:
    """The statements that make ``state``'s table what its metadata defines."""
    table = state.table
    name = table.name
    changes: list[str] = []
    if not state.exists:
        changes += [ddl_sql(statement) for statement in create_table_ddl(table)]
    else:
        changes += [
            add_column_ddl(name, ddl_sql(CreateColumn(column)))
            for column in state.missing_columns()
        ]
        named = {str(index.name): index for index in table.indexes}
        changes += [
            ddl_sql(CreateIndex(named[missing], if_not_exists=True))
            for missing in state.missing_indexes()
        ]
        changes += [add_check_ddl(name, check) for check in state.missing_checks()]
    if is_outbox(table):
        if not state.exists or not state.function_current:
            changes.append(notify_function_ddl(table))
        if not state.exists or not state.trigger_current or not state.function_current:
            changes.append(notify_trigger_ddl(table))
    return [SchemaChange(name, statement) for statement in changes]


async def create_outbox_tables(
    conn: AsyncConnection, metadata: MetaData, *, progress: Callable[[str], None] | None = None
) -> list[SchemaChange]:
    """Create what the catalog shows missing or different of ``metadata``'s outbox tables
    (tables, columns, indexes, checks, NOTIFY triggers) in ``conn``'s transaction, as a schema
    owner; returns the statements run (none on an up-to-date database: no lock taken).

    Raises:
        SchemaMismatchError: a column has another type than the metadata's (changed by hand:
            nothing is changed here, the message says what to do).
    """
    await _execute(conn, "the advisory lock of another init-db", _INSTALL_LOCK)
    states = await read_schema_state(conn, metadata)
    mistyped = [phrase for state in states for phrase in state.mistyped_columns()]
    if mistyped:
        raise SchemaMismatchError(
            f"{'; '.join(mistyped)}: init-db changes no column's type (that could rewrite the "
            "table); change the column's type yourself, then run init-db again"
        )
    changes = [c for state in states for c in changes_for(state)]
    for change in changes:
        if progress is not None:
            progress(f"{change.table}: {change.statement.split(' (')[0].strip()}")
        await _execute(conn, f"table {change.table}", text(change.statement))
    return changes


async def _execute(conn: AsyncConnection, locking: str, statement: TextClause) -> None:
    """Run ``statement``, whose lock is ``locking`` (``table <name>``, ...)."""
    try:
        await conn.execute(statement)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            raise _LockWait(locking) from exc
        raise


class _LockWait(Exception):
    def __init__(self, locking: str) -> None:
        super().__init__(locking)
        self.locking = locking


async def install_schema(
    engine: AsyncEngine,
    metadata: MetaData,
    *,
    progress: Callable[[str], None] | None = None,
    lock_timeout: float = LOCK_TIMEOUT_SECONDS,
    attempts: int = LOCK_ATTEMPTS,
) -> list[SchemaChange]:
    """:func:`create_outbox_tables` in a transaction of its own whose statements wait at most
    ``lock_timeout`` seconds for a lock; on a timeout the transaction is rolled back and tried
    again after a growing pause (``progress`` hears of each attempt), ``attempts`` times.

    Raises:
        SchemaLockError: every attempt timed out waiting for a lock.
        ConfigurationError: the database refused a statement (the driver's message, with no
            password).
    """
    for attempt in range(1, attempts + 1):
        try:
            async with engine.begin() as conn:
                await conn.execute(text(lock_timeout_statement(lock_timeout)))
                return await create_outbox_tables(conn, metadata, progress=progress)
        except _LockWait as wait:
            if attempt == attempts:
                raise SchemaLockError(
                    f"could not get a lock on {wait.locking} in {safe_url(engine.url)} within "
                    f"{lock_timeout:g} s, {attempts} times: a long transaction holds a lock on "
                    "it (see pg_stat_activity and pg_locks). Nothing was changed; run "
                    "`outbox-bridge init-db` again once it has ended"
                ) from None
            if progress is not None:
                progress(
                    f"waiting for a lock on {wait.locking}: attempt {attempt + 1} of {attempts}"
                )
            await asyncio.sleep(min(2.0**attempt, 30.0) * 0.5)
        except DBAPIError as exc:
            raise ConfigurationError(
                f"cannot create the outbox tables in {safe_url(engine.url)}: "
                f"{str(exc.orig).strip()}. Run `outbox-bridge init-db` as the tables' owner "
                "(a role that may create them)"
            ) from None
    raise AssertionError("unreachable")  # pragma: no cover
