"""The outbox tables in the application's own Alembic migrations (outbox_bridge.db.migrations).

A real `alembic upgrade` and `downgrade` against the test PostgreSQL, with a generated env.py
and a version file that calls create_outbox / drop_outbox: the schema is the one the worker
creates, NOTIFY works, autogenerate sees no difference against app.metadata, and the downgrade
leaves nothing behind.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import psycopg
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import Connection, Engine, MetaData, text

from outbox_bridge import OutboxApp, OutboxTable
from outbox_bridge.config import libpq_url, sqlalchemy_url
from outbox_bridge.db.migrations import (
    create_parked_groups,
    exclude_outbox_tables,
    upgrade_outbox,
)
from outbox_bridge.db.schema import notify_channel, parked_name
from tests.harness import SCOPES, Category, Scope, create_tables, unique_table

ENV_PY = """
from alembic import context

config = context.config
options = {"version_table": config.attributes["version_table"]}
if context.is_offline_mode():
    context.configure(dialect_name="postgresql", literal_binds=True, **options)
else:
    context.configure(connection=config.attributes["connection"], **options)
with context.begin_transaction():
    context.run_migrations()
"""

VERSION = '''
"""the outbox tables"""

from alembic import op

from outbox_bridge import OutboxApp, OutboxTable
from outbox_bridge.db.migrations import create_outbox, drop_outbox

revision = "0001_outbox"
down_revision = None
branch_labels = None
depends_on = None

app = OutboxApp(
    scopes={{}}, tables=[OutboxTable("{normal}"), OutboxTable("{regional}", regional=True)]
)


def upgrade() -> None:
    create_outbox(op, app)


def downgrade() -> None:
    drop_outbox(op, app)
'''


def alembic_config(directory: Path, app: OutboxApp) -> Config:
    """An Alembic project in ``directory`` whose one revision creates ``app``'s tables."""
    normal, regional = app.tables
    (directory / "versions").mkdir(parents=True)
    (directory / "env.py").write_text(ENV_PY)
    (directory / "versions" / "0001_outbox.py").write_text(
        VERSION.format(normal=normal, regional=regional)
    )
    config = Config(output_buffer=io.StringIO())
    config.set_main_option("script_location", str(directory))
    config.attributes["version_table"] = f"alembic_version_{normal}"
    return config


def run(config: Config, engine: Engine, action: Any, revision: str) -> None:
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        action(config, revision)


def catalog(conn: Connection, table: str) -> dict[str, Any]:
    """What PostgreSQL knows of ``table``, with its name replaced by ``T`` for comparison."""

    def rows(query: str) -> list[str]:
        found = conn.execute(text(query), {"t": table}).scalars().all()
        return sorted(str(row).replace(table, "T") for row in found)

    return {
        "columns": rows(
            "SELECT column_name || ' ' || data_type || ' ' || is_nullable || ' ' "
            "|| coalesce(column_default, '') || ' ' || is_identity "
            "FROM information_schema.columns WHERE table_name = :t"
        ),
        "indexes": rows("SELECT indexdef FROM pg_indexes WHERE tablename = :t"),
        "triggers": rows(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE NOT tgisinternal AND tgrelid = to_regclass(:t)"
        ),
        "functions": rows(
            "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = :t || '_notify'"
        ),
    }


def differences(conn: Connection, app: OutboxApp, metadata: MetaData, **options: Any) -> list[Any]:
    """Autogenerate's differences between ``metadata`` and the database, for ``app``'s tables
    only (the test database holds the tables of every other test too)."""
    ours = set(app.metadata.tables)  # the outbox tables and their owner tables

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        return type_ != "table" or name in ours

    exclude = options.pop("exclude", None)

    def included(name: str | None, type_: str, parent_names: Any) -> bool:
        return include_name(name, type_, parent_names) and (
            exclude is None or exclude(name, type_, parent_names)
        )

    context = MigrationContext.configure(conn, opts={"include_name": included, **options})
    return list(compare_metadata(context, metadata))


def two_tables() -> OutboxApp:
    return OutboxApp(
        scopes=SCOPES,
        tables=[OutboxTable(unique_table()), OutboxTable(unique_table(), regional=True)],
    )


async def test_upgrade_creates_what_the_worker_creates_and_downgrade_removes_it(
    engine, sync_engine, tmp_path
) -> None:
    app = two_tables()
    config = alembic_config(tmp_path / "migrations", app)
    reference = two_tables()
    await create_tables(engine, reference)  # the worker's own way

    run(config, sync_engine, command.upgrade, "head")
    with sync_engine.connect() as conn:
        for migrated, created in zip(app.tables, reference.tables, strict=True):
            schema = catalog(conn, migrated)
            assert schema == catalog(conn, created)
            assert len(schema["indexes"]) == 3  # pkey, shard, group
            assert len(schema["triggers"]) == len(schema["functions"]) == 1
            parked = catalog(conn, parked_name(migrated))
            assert parked == catalog(conn, parked_name(created))
            assert len(parked["indexes"]) == 2  # pkey, the groups parked now

    run(config, sync_engine, command.downgrade, "base")
    with sync_engine.connect() as conn:
        for name in [*app.tables, *(parked_name(table) for table in app.tables)]:
            assert catalog(conn, name) == {
                "columns": [],
                "indexes": [],
                "triggers": [],
                "functions": [],
            }
        # The worker-created tables of another app are untouched.
        assert catalog(conn, next(iter(reference.tables)))["triggers"]


async def test_create_parked_groups_adds_the_parked_group_tables_to_an_older_schema(
    engine, sync_engine
) -> None:
    app, reference = two_tables(), two_tables()
    await create_tables(engine, app)
    await create_tables(engine, reference)
    with sync_engine.begin() as conn:
        for table in app.tables:
            conn.execute(text(f"DROP TABLE {parked_name(table)}"))  # as before they existed
        operations = Operations(MigrationContext.configure(conn))
        for _ in range(2):  # a second run changes nothing
            create_parked_groups(operations, app)
        for upgraded, created in zip(app.tables, reference.tables, strict=True):
            parked = catalog(conn, parked_name(upgraded))
            assert parked["columns"] and parked == catalog(conn, parked_name(created))


async def test_upgrade_outbox_brings_an_older_schema_to_this_version_s(engine, sync_engine) -> None:
    app, reference = two_tables(), two_tables()
    await create_tables(engine, app)
    await create_tables(engine, reference)
    with sync_engine.begin() as conn:
        for table in app.tables:  # as an earlier version created them
            conn.execute(text(f"DROP TABLE {parked_name(table)}"))
            conn.execute(text(f"ALTER TABLE {table}_pauses DROP COLUMN paused_role"))
            conn.execute(text(f"DROP TRIGGER {table}_notify ON {table}"))
        operations = Operations(MigrationContext.configure(conn))
        for _ in range(2):  # a second run changes nothing
            upgrade_outbox(operations, app)
        for upgraded, created in zip(app.tables, reference.tables, strict=True):
            for name in (str, parked_name, lambda t: f"{t}_pauses"):
                assert catalog(conn, name(upgraded)) == catalog(conn, name(created))


async def test_migrated_table_notifies_the_bridge(servers, sync_engine, tmp_path) -> None:
    app = two_tables()
    run(alembic_config(tmp_path / "migrations", app), sync_engine, command.upgrade, "head")
    table = app.table().name
    url = libpq_url(sqlalchemy_url(servers.database_url))
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {notify_channel(table)}")
        with sync_engine.begin() as conn:
            row_id = app.write(
                conn, category=Category.PROJECT_UPDATE, shard_identifier=4, object_identifier=1
            )
        received = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert [json.loads(payload) for payload in received] == [[[int(Scope.ORGANIZATION), 4, row_id]]]


async def test_autogenerate_sees_no_difference(sync_engine, tmp_path) -> None:
    app = two_tables()
    run(alembic_config(tmp_path / "migrations", app), sync_engine, command.upgrade, "head")
    with sync_engine.connect() as conn:
        # app.metadata in target_metadata: the migrated tables match it exactly.
        assert differences(conn, app, app.metadata) == []
        assert differences(conn, app, app.metadata, compare_server_default=True) == []
        # Without app.metadata, autogenerate would drop the outbox tables...
        dropped = differences(conn, app, MetaData())
        removed = sorted(d[1].name for d in dropped if d[0] == "remove_table")
        assert removed == sorted(app.metadata.tables)
        # ... unless they are excluded.
        excluded = differences(conn, app, MetaData(), exclude=exclude_outbox_tables(app))
        assert excluded == []


def test_offline_mode_prints_the_statements(tmp_path) -> None:
    app = two_tables()
    config = alembic_config(tmp_path / "migrations", app)
    command.upgrade(config, "head", sql=True)
    command.downgrade(config, "0001_outbox:base", sql=True)
    script = config.output_buffer.getvalue()  # type: ignore[union-attr]
    for name in app.tables:
        for statement in (
            f"CREATE TABLE {name} (",
            f"CREATE INDEX {name}_shard_idx ON {name}",
            f"CREATE INDEX {name}_group_idx ON {name}",
            f"CREATE OR REPLACE FUNCTION {name}_notify()",
            f"CREATE OR REPLACE TRIGGER {name}_notify AFTER INSERT ON {name}",
            f"DROP TRIGGER IF EXISTS {name}_notify ON {name}",
            f"DROP TABLE {name}",
            f"DROP FUNCTION IF EXISTS {name}_notify()",
        ):
            assert statement in script
    # Only the regional table has a region column.
    normal, regional = app.tables
    assert "region TEXT NOT NULL" in script.split(f"CREATE TABLE {regional} (")[1].split(";")[0]
    assert "region" not in script.split(f"CREATE TABLE {normal} (")[1].split(";")[0]
