"""The outbox tables of a Django database, for Django's ``flush`` (after every transactional
test, and ``manage.py flush``), which leaves the rows of tables that are not models.

The owner tables are kept: a worker that outlives the flush still needs to know which workflow
holds a shard. The identity is not restarted: a row id is the order within a shard, and a
running worker may have seen the old ones.
"""

from __future__ import annotations

from django.core.management.color import Style
from django.db import router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.loader import MigrationLoader

from outbox_bridge.contrib.django.conf import app_spec, load_app, outbox_database
from outbox_bridge.contrib.django.operations import CreateOutbox


def outbox_tables(connection: BaseDatabaseWrapper) -> list[str]:
    """The outbox tables on ``connection``'s database, sorted: those that exist of the
    migrations' ``CreateOutbox`` operations there (the routers allowing), and of the
    ``OUTBOX_BRIDGE`` app on the outbox's database (``init-db`` creates them where no
    migration did)."""
    if connection.vendor != "postgresql":
        return []
    names = set(_migrated_tables(connection.alias))
    spec = app_spec()
    if spec is not None and outbox_database() == connection.alias:
        names.update(load_app(spec).tables)
    existing = set(connection.introspection.table_names())
    return sorted(names & existing)


def _migrated_tables(alias: str) -> set[str]:
    """The tables of every ``CreateOutbox`` in the migration files that may run on ``alias``."""
    loader = MigrationLoader(None, load=False)
    loader.load_disk()
    names: set[str] = set()
    for (app_label, _), migration in loader.disk_migrations.items():
        for operation in migration.operations:
            if isinstance(operation, CreateOutbox) and router.allow_migrate(
                alias, app_label, **operation.hints
            ):
                given = operation.tables
                names.update(given if given is not None else operation.outbox_app().tables)
    return names


def outbox_flush_sql(style: Style, connection: BaseDatabaseWrapper) -> list[str]:
    """The statement that empties the outbox tables of ``connection`` (their identity kept),
    or none when it has none."""
    tables = outbox_tables(connection)
    return connection.ops.sql_flush(style, tables, reset_sequences=False)
