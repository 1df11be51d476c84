"""The outbox tables in a Django project's migrations (CreateOutbox, DropOutbox): pytest-django
migrated the test databases with tests/django_app/migrations, and the schema is the one
`init-db` creates; the operations are reversible, print their SQL, leave the model state alone,
serialize into migration files, and follow the database routers."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.state import ProjectState
from django.db.migrations.writer import OperationWriter
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge import OutboxApp, OutboxTable
from outbox_bridge.contrib.django.conf import database_url
from outbox_bridge.contrib.django.operations import CreateOutbox, DropOutbox, UpgradeOutbox
from outbox_bridge.db.install import install_schema
from tests.harness import SCOPES, unique_table
from tests.test_alembic import catalog

scratch_app = OutboxApp(scopes=SCOPES, tables=[OutboxTable("django_scratch_outbox")])
SCRATCH = "tests.test_django_migrations:scratch_app"
NOTHING: dict[str, list[str]] = {"columns": [], "indexes": [], "triggers": [], "functions": []}


@pytest.fixture
def sync_engine(transactional_db: None) -> Iterator[Engine]:
    """An engine on the Django test database (committed data only)."""
    engine = create_engine(database_url())
    yield engine
    engine.dispose()


def schema(engine: Engine, table: str) -> dict[str, Any]:
    with engine.connect() as conn:
        found = catalog(conn, table)
        owners = catalog(conn, f"{table}_owners")
    return {**found, "owners": owners["columns"], "owner_indexes": owners["indexes"]}


async def test_the_migrated_tables_are_the_ones_init_db_creates(sync_engine) -> None:
    reference = OutboxApp(scopes=SCOPES, tables=[OutboxTable(unique_table())])
    await create_like_init_db(reference)
    try:
        for migrated in ("django_outbox", "django_archive_outbox"):
            found = schema(sync_engine, migrated)
            assert found == schema(sync_engine, reference.table().name)
            assert len(found["indexes"]) == 3 and len(found["triggers"]) == 1
            assert "trace_context jsonb YES" in " ".join(found["columns"])
    finally:
        with sync_engine.begin() as conn:
            name = reference.table().name
            conn.execute(text(f"DROP TABLE {name}, {name}_owners; DROP FUNCTION {name}_notify()"))


async def create_like_init_db(app: OutboxApp) -> None:
    engine = create_async_engine(database_url())
    try:
        await install_schema(engine, app.metadata)
    finally:
        await engine.dispose()


def test_create_and_drop_are_reversible(sync_engine) -> None:
    state = ProjectState()
    create = CreateOutbox(SCRATCH)
    drop = DropOutbox(SCRATCH, tables=["django_scratch_outbox"])
    table = "django_scratch_outbox"

    def run(operation: Any, forwards: bool) -> None:
        with connection.schema_editor() as editor:
            if forwards:
                operation.database_forwards("django_app", editor, state, state)
            else:
                operation.database_backwards("django_app", editor, state, state)

    run(create, forwards=True)
    created = schema(sync_engine, table)
    assert created["triggers"] and created["owners"]
    run(drop, forwards=True)
    assert schema(sync_engine, table) == {**NOTHING, "owners": [], "owner_indexes": []}
    run(drop, forwards=False)
    assert schema(sync_engine, table) == created
    run(create, forwards=False)
    assert schema(sync_engine, table) == {**NOTHING, "owners": [], "owner_indexes": []}
    # No model state: the autodetector sees nothing to do.
    before = state.clone()
    create.state_forwards("django_app", state)
    assert state.models == before.models


def test_upgrade_outbox_gives_an_older_table_this_version_s_columns(sync_engine) -> None:
    """A table created by an earlier version (here: without the columns that record the
    PostgreSQL role) gains them from UpgradeOutbox; a second run changes nothing, and backwards
    it does nothing."""
    state = ProjectState()
    table = "django_scratch_outbox"

    def run(operation: Any, forwards: bool = True) -> None:
        with connection.schema_editor() as editor:
            method = operation.database_forwards if forwards else operation.database_backwards
            method("django_app", editor, state, state)

    run(CreateOutbox(SCRATCH))
    try:
        created = schema(sync_engine, table)
        with sync_engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {table}_pauses DROP COLUMN paused_role"))
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN trace_context"))
        assert schema(sync_engine, table) != created
        upgrade = UpgradeOutbox(SCRATCH)
        for _ in range(2):
            run(upgrade)
        assert schema(sync_engine, table) == created
        with sync_engine.connect() as conn:
            pauses = catalog(conn, f"{table}_pauses")["columns"]
        assert any(
            c.startswith("paused_role text NO") and "session_user" in c.lower() for c in pauses
        )
        run(upgrade, forwards=False)
        assert schema(sync_engine, table) == created
    finally:
        run(CreateOutbox(SCRATCH), forwards=False)


def test_migrate_backwards_drops_the_outbox_and_forwards_creates_it(sync_engine) -> None:
    call_command("migrate", "django_app", "zero", verbosity=0)
    assert schema(sync_engine, "django_outbox")["columns"] == []
    assert schema(sync_engine, "django_archive_outbox")["columns"] == []
    call_command("migrate", "django_app", verbosity=0)
    assert schema(sync_engine, "django_outbox")["triggers"]


@pytest.mark.django_db
def test_sqlmigrate_prints_the_statements() -> None:
    out = io.StringIO()
    call_command("sqlmigrate", "django_app", "0001", stdout=out)
    sql = out.getvalue()
    for statement in (
        "CREATE TABLE django_outbox (",
        "CREATE INDEX django_outbox_shard_idx ON django_outbox",
        "CREATE OR REPLACE FUNCTION django_outbox_notify() RETURNS trigger",
        "CREATE OR REPLACE TRIGGER django_outbox_notify AFTER INSERT ON django_outbox",
        "CREATE TABLE django_outbox_owners (",
        "CREATE TABLE django_archive_outbox (",
        "-- Create the outbox tables (django_outbox)",
        "-- Create the outbox tables (every table of tests.django_app.outbox:archive_app)",
    ):
        assert statement in sql, statement
    out = io.StringIO()
    call_command("sqlmigrate", "django_app", "0001", backwards=True, stdout=out)
    assert "DROP TABLE django_outbox" in out.getvalue()
    assert "DROP FUNCTION IF EXISTS django_outbox_notify()" in out.getvalue()


class NoTestAppOnOther:
    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if db == "other" and app_label == "django_app":
            return False
        return None


@pytest.mark.django_db(databases=["default", "other"])
def test_the_routers_decide_where_the_outbox_goes(settings) -> None:
    settings.DATABASE_ROUTERS = [f"{__name__}.NoTestAppOnOther"]
    out = io.StringIO()
    call_command("sqlmigrate", "django_app", "0001", database="other", stdout=out)
    assert "CREATE TABLE" not in out.getvalue()
    assert "-- Create the outbox tables (django_outbox)\n--\n-- (no-op)" in out.getvalue()
    out = io.StringIO()
    call_command("sqlmigrate", "django_app", "0001", database="default", stdout=out)
    assert "CREATE TABLE django_outbox (" in out.getvalue()
    for alias in ("default", "other"):
        assert connections[alias].vendor == "postgresql"


@pytest.mark.django_db
def test_makemigrations_sees_no_change() -> None:
    call_command("makemigrations", "django_app", check=True, dry_run=True, verbosity=0)


def test_the_operations_serialize_into_a_migration_file() -> None:
    written, imports = OperationWriter(
        CreateOutbox("shop.outbox:app", tables=["outbox"]), indentation=0
    ).serialize()
    assert written == (
        "outbox_bridge.contrib.django.operations.CreateOutbox(\n"
        "    app='shop.outbox:app',\n"
        "    tables=['outbox'],\n"
        "),"
    )
    assert imports == {"import outbox_bridge.contrib.django.operations"}
    assert DropOutbox("shop.outbox:app").deconstruct() == (
        "DropOutbox",
        [],
        {"app": "shop.outbox:app"},
    )
    with pytest.raises(TypeError, match="module:attribute"):
        CreateOutbox(scratch_app)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not one string"):
        CreateOutbox(SCRATCH, tables="outbox")
