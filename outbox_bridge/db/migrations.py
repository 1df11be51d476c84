"""Alembic operations that add the outbox tables to your own migrations.

::

    from alembic import op

    from myapp.outbox import app
    from outbox_bridge.db.migrations import create_outbox, drop_outbox


    def upgrade() -> None:
        create_outbox(op, app)  # a later migration, after an upgrade: upgrade_outbox(op, app)


    def downgrade() -> None:
        drop_outbox(op, app)

The statements are those of ``init-db`` (:mod:`outbox_bridge.db.install`): a migrated database
and one ``init-db`` created are the same, and the worker checks either at start without
changing it. They go through ``op.execute``, so
offline mode (``alembic upgrade --sql``) prints them too. Importing this module does not need
Alembic; calling its functions does. Django's migration operations
(:mod:`outbox_bridge.contrib.django.operations`) run :func:`create_statements` and
:func:`drop_statements` too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy import Table
from sqlalchemy.schema import (
    CreateColumn,
    CreateIndex,
    CreateTable,
    DropTable,
    ExecutableDDLElement,
)

from outbox_bridge.db.install import (
    add_column_ddl,
    create_table_ddl,
    ddl_sql,
    lock_timeout_statement,
)
from outbox_bridge.db.schema import (
    drop_notify_ddl,
    limits_name,
    limits_of,
    notify_ddl,
    owners_name,
    owners_of,
    parked_name,
    parked_of,
    pauses_name,
    pauses_of,
)

if TYPE_CHECKING:
    from alembic.operations import Operations

    from outbox_bridge.registry import OutboxApp

# A statement of a migration: a SQLAlchemy DDL construct, or SQL text (the NOTIFY trigger's).
DDL: TypeAlias = ExecutableDDLElement | str


def _tables(app: OutboxApp, tables: Iterable[str] | None) -> list[Table]:
    if isinstance(tables, str):
        raise TypeError("tables must be a list of table names, not one string")
    return [app.table(name) for name in (app.tables if tables is None else tables)]


def create_statements(app: OutboxApp, *, tables: Iterable[str] | None = None) -> list[DDL]:
    """The statements that create the app's outbox tables (all, or those named in ``tables``)
    with their indexes, NOTIFY triggers, owner, parked-group, pause and rate-limit tables, in
    order."""
    statements: list[DDL] = []
    for table in _tables(app, tables):
        statements += [*create_table_ddl(table), *notify_ddl(table)]
        for side in (owners_of, parked_of, pauses_of, limits_of):
            statements += create_table_ddl(side(table))
    return statements


def upgrade_statements(app: OutboxApp, *, tables: Iterable[str] | None = None) -> list[DDL]:
    """The statements that bring the app's outbox tables (all, or those named in ``tables``),
    created by any earlier version, to this version's schema: missing tables, columns (each
    nullable or with a default that needs no table rewrite) and indexes, and the NOTIFY
    function and trigger. Idempotent, and they need no database to be planned (offline
    migrations print them); each waits at most a few seconds for its lock
    (:func:`lock_timeout_statement`), and a migration that times out is rolled back whole:
    run it again."""
    statements: list[DDL] = [lock_timeout_statement()]
    for table in _tables(app, tables):
        sides = [side(table) for side in (owners_of, parked_of, pauses_of, limits_of)]
        for each in (table, *sides):
            statements.append(CreateTable(each, if_not_exists=True))
            statements += [
                add_column_ddl(each.name, ddl_sql(CreateColumn(column)))
                for column in each.columns
                if not column.primary_key and (column.nullable or column.server_default is not None)
            ]
            statements += [
                CreateIndex(index, if_not_exists=True)
                for index in sorted(each.indexes, key=lambda i: str(i.name))
            ]
        statements += notify_ddl(table)
    return statements


def drop_statements(app: OutboxApp, *, tables: Iterable[str] | None = None) -> list[DDL]:
    """The statements that drop what :func:`create_statements` creates, in order."""
    statements: list[DDL] = []
    for table in reversed(_tables(app, tables)):
        trigger, function = drop_notify_ddl(table)
        sides = [limits_of(table), pauses_of(table), parked_of(table), owners_of(table)]
        statements += [DropTable(side, if_exists=True) for side in sides]
        statements += [trigger, DropTable(table), function]
    return statements


def create_outbox(op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None) -> None:
    """Create the app's outbox tables (all, or those named in ``tables``) with their indexes
    and NOTIFY triggers, as the installed version defines them (autogenerate against
    ``app.metadata`` shows what a later version changes)."""
    for statement in create_statements(app, tables=tables):
        op.execute(statement)


def create_shard_owners(
    op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None
) -> None:
    """Create the owner tables (``<table>_owners``, added in 0.2) in a database migrated with
    :func:`create_outbox` before them. (``init-db`` and :func:`upgrade_outbox` create missing
    tables too.)"""
    for table in _tables(app, tables):
        op.execute(CreateTable(owners_of(table), if_not_exists=True))


def create_parked_groups(
    op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None
) -> None:
    """Create the parked-group tables (``<table>_parked`` and their index) in a database
    migrated with :func:`create_outbox` before them. (``init-db`` and :func:`upgrade_outbox`
    too.)"""
    for table in _tables(app, tables):
        for statement in create_table_ddl(parked_of(table), if_not_exists=True):
            op.execute(statement)


def create_shard_pauses(
    op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None
) -> None:
    """Create the pause tables (``<table>_pauses``, added in 1.0) in a database migrated with
    :func:`create_outbox` before them. (``init-db`` and :func:`upgrade_outbox` create them too.)"""
    for table in _tables(app, tables):
        op.execute(CreateTable(pauses_of(table), if_not_exists=True))


def upgrade_outbox(op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None) -> None:
    """Bring the app's outbox tables to the installed version's schema
    (:func:`upgrade_statements`): the migration to add after upgrading outbox-bridge, before
    the new workers start (they refuse a schema that is not theirs)."""
    for statement in upgrade_statements(app, tables=tables):
        op.execute(statement)


def drop_outbox(op: Operations, app: OutboxApp, *, tables: Iterable[str] | None = None) -> None:
    """Drop what :func:`create_outbox` created: the trigger, its function, the table and its
    indexes, and every row still in the table."""
    for statement in drop_statements(app, tables=tables):
        op.execute(statement)


def exclude_outbox_tables(
    app: OutboxApp,
) -> Callable[[str | None, str, Mapping[str, str | None]], bool]:
    """An ``include_name`` hook for Alembic's ``context.configure`` that hides the app's outbox
    tables (and the tables beside them) from autogenerate, where ``init-db`` or these operations
    manages them (otherwise autogenerate proposes to drop them)::

        context.configure(..., include_name=exclude_outbox_tables(app))
    """
    sides = (str, owners_name, pauses_name, parked_name, limits_name)
    names = {name(table) for table in app.tables for name in sides}

    def include_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
        return not (type_ == "table" and name in names)

    return include_name
