"""Least privilege against real PostgreSQL roles and a real worker: the worker runs no DDL (it
checks the catalog and refuses a schema that differs, with the fix), drains with DML rights
alone, and starts beside an open producer transaction without holding up other producers;
``init-db`` takes no lock on an up-to-date schema and bounds its waits; each role can do what
its GRANTs allow and is refused the rest with the privilege named; PostgreSQL records who
paused and parked."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox_bridge import MissingPrivilegeError, SchemaMismatchError
from outbox_bridge.db.grants import MissingPrivilege, Role, grant_statements, missing_privileges
from outbox_bridge.db.install import install_schema
from outbox_bridge.db.migrations import upgrade_statements
from outbox_bridge.db.parked import park_head, unpark
from outbox_bridge.db.schema import (
    PARKED_ROLE,
    PAUSED_ROLE,
    TRACE_CONTEXT_COLUMN,
    UNPARKED_ROLE,
    parked_name,
    pauses_name,
)
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    Recorder,
    Scope,
    Servers,
    count_rows,
    fresh_app,
    running_worker,
    sql,
    wait_until,
)
from tests.test_cli_shards import cli
from tests.test_statistics import table_without_statistics

ROW: dict[str, Any] = {
    "category": Category.PROJECT_UPDATE,
    "shard_identifier": 7,
    "object_identifier": 1,
}


def role_url(servers: Servers, role: str) -> str:
    """The test database's URL for ``role`` (the embedded server trusts its Unix socket)."""
    url = make_url(servers.database_url).set(username=role, password=None)
    return url.render_as_string(hide_password=False)


@pytest.fixture
async def roles(engine: AsyncEngine) -> AsyncIterator[dict[Role, str]]:
    """A login role of each kind, new for the test, with no privilege yet."""
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"outbox_{role.value}_{suffix}" for role in Role}
    for name in names.values():
        await sql(engine, f"CREATE ROLE {name} LOGIN")
    yield names
    for name in names.values():
        await sql(engine, f"DROP OWNED BY {name}")
        await sql(engine, f"DROP ROLE {name}")


async def grant(engine: AsyncEngine, app: Any, roles: dict[Role, str]) -> None:
    async with engine.begin() as conn:
        for statement in grant_statements(app.metadata, roles):
            await conn.execute(text(statement))


async def granted_app(
    engine: AsyncEngine, roles: dict[Role, str], role: Role
) -> tuple[Recorder, str, Any, str]:
    """A recording app on a table of its own, and the name of ``role``'s role, granted on it."""
    recorder, table, app = await fresh_app(engine)
    await grant(engine, app, {role: roles[role]})
    return recorder, table, app, roles[role]


@pytest.fixture
async def as_role(servers: Servers) -> AsyncIterator[Any]:
    """``as_role(name)``: an engine connected as ``name``, disposed after the test."""
    engines: list[AsyncEngine] = []

    def connect(name: str) -> AsyncEngine:
        engines.append(create_async_engine(role_url(servers, name)))
        return engines[-1]

    yield connect
    for each in engines:
        await each.dispose()


# -- the worker checks, never changes, the schema --------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("DROP TRIGGER {t}_notify ON {t}", "trigger {t}_notify on {t} is missing"),
        (f"ALTER TABLE {{t}}_pauses DROP COLUMN {PAUSED_ROLE}", f"{{t}}_pauses.{PAUSED_ROLE}"),
        ("DROP TABLE {t}_parked", "table {t}_parked is missing"),
        ("DROP INDEX {t}_group_idx", "index {t}_group_idx on {t} is missing"),
    ],
)
async def test_a_worker_refuses_a_schema_that_is_not_its_own_with_the_fix(
    servers: Servers, engine: AsyncEngine, damage: str, named: str
) -> None:
    _recorder, table, app = await fresh_app(engine)
    await sql(engine, damage.format(t=table))
    with pytest.raises(SchemaMismatchError) as refused:
        async with running_worker(servers, app, install=False):
            pass
    message = str(refused.value)
    assert named.format(t=table) in message
    assert "outbox-bridge init-db" in message and "upgrade_outbox" in message
    # Nothing was repaired: the worker changed no schema.
    with pytest.raises(SchemaMismatchError):
        async with running_worker(servers, app, install=False):
            pass


async def test_an_older_table_gains_the_new_columns_from_init_db_and_the_migrations(
    servers: Servers, engine: AsyncEngine, sync_engine: Engine
) -> None:
    _recorder, table, app = await fresh_app(engine)
    added = {
        pauses_name(table): [PAUSED_ROLE],
        parked_name(table): [PARKED_ROLE, UNPARKED_ROLE],
        table: [TRACE_CONTEXT_COLUMN],
    }
    older = "; ".join(
        f"ALTER TABLE {name} DROP COLUMN {column}"
        for name, columns in added.items()
        for column in columns
    )
    await sql(engine, older)
    await sql(
        engine,
        f"INSERT INTO {pauses_name(table)} (kind, number, reason, paused_by) "
        "VALUES ('category', 2, 'before the upgrade', 'ann')",
    )
    changes = await install_schema(engine, app.metadata)
    assert sorted(c.statement for c in changes) == sorted(
        f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {column}"
        + (" TEXT" if column != TRACE_CONTEXT_COLUMN else " JSONB")
        + (" DEFAULT session_user NOT NULL" if column in (PAUSED_ROLE, PARKED_ROLE) else "")
        for name, columns in added.items()
        for column in columns
    )
    assert await install_schema(engine, app.metadata) == []  # up to date now
    async with running_worker(servers, app, install=False):  # the worker accepts it
        pass
    # The Alembic operation (and Django's UpgradeOutbox) run these statements on an older table.
    await sql(engine, older)
    with sync_engine.begin() as conn:
        for statement in upgrade_statements(app):
            conn.execute(text(statement) if isinstance(statement, str) else statement)
    assert await install_schema(engine, app.metadata) == []


# -- no lock that a producer waits for ------------------------------------------------------------


async def test_init_db_on_an_up_to_date_schema_takes_no_lock_on_the_outbox_tables(
    engine: AsyncEngine,
) -> None:
    _recorder, table, app = await fresh_app(engine)
    tables = [table, f"{table}_owners", parked_name(table), pauses_name(table)]
    async with engine.connect() as holder:
        # Stronger than any producer's lock: even a read of these tables would wait for it.
        await holder.execute(text(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE"))
        changes = await install_schema(engine, app.metadata, lock_timeout=0.5, attempts=1)
        assert changes == []
        assert holder.in_transaction()
        await holder.rollback()


async def test_init_db_waits_for_its_lock_a_bounded_number_of_times_and_says_so(
    servers: Servers, engine: AsyncEngine
) -> None:
    _recorder, table, _app = await fresh_app(engine)
    await sql(engine, f"ALTER TABLE {pauses_name(table)} DROP COLUMN {PAUSED_ROLE}")
    async with engine.connect() as producer:
        # An open transaction that wrote to the pause table: ALTER TABLE waits for it.
        await producer.execute(
            text(
                f"INSERT INTO {pauses_name(table)} (kind, number, reason, paused_by) "
                "VALUES ('scope', 1, 'open', 'ann')"
            )
        )
        code, out, err = await cli(
            servers, table, "init-db", "--lock-timeout", "0.2", "--attempts", "2"
        )
        assert producer.in_transaction()
        await producer.rollback()
    assert code == 2, out + err
    assert f"waiting for a lock on table {pauses_name(table)}: attempt 2 of 2" in err
    assert f"could not get a lock on table {pauses_name(table)}" in err and "Traceback" not in err
    code, out, err = await cli(servers, table, "init-db")
    assert code == 0, err
    code, out, err = await cli(servers, table, "init-db")
    assert code == 0 and "nothing changed, no table locked" in out, out + err


async def test_a_worker_starting_beside_an_open_producer_transaction_holds_up_no_producer(
    servers: Servers, engine: AsyncEngine
) -> None:
    """The outage a worker start used to cause: its trigger DDL waited for the open
    transaction, and every other producer's INSERT queued behind the DDL."""
    recorder, _table, app = await fresh_app(engine)
    async with engine.connect() as long_producer:
        held = await app.write_async(long_producer, **ROW)  # uncommitted, for the whole test
        async with running_worker(servers, app, install=False):
            second = create_async_engine(
                servers.database_url, connect_args={"options": "-c statement_timeout=1000"}
            )
            try:
                async with second.begin() as conn:
                    # Fails with a statement timeout if anything queued it behind a lock.
                    written = await app.write_async(conn, **{**ROW, "shard_identifier": 8})
            finally:
                await second.dispose()
            assert long_producer.in_transaction()
            await wait_until(lambda: written in recorder.ids(), what="the second row handled")
            assert held not in recorder.ids()
            await long_producer.commit()
            await wait_until(lambda: held in recorder.ids(), what="the long one's row handled")
            await wait_until(lambda: _empty(engine, app), what="both rows deleted")


async def _empty(engine: AsyncEngine, app: Any) -> bool:
    return await count_rows(engine, app) == 0


# -- roles ------------------------------------------------------------------------------------------


async def test_a_worker_drains_with_dml_rights_and_a_producer_only_inserts(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str], as_role: Any
) -> None:
    recorder, table, app = await fresh_app(engine)
    await grant(engine, app, {Role.WORKER: roles[Role.WORKER], Role.PRODUCER: roles[Role.PRODUCER]})
    producer = as_role(roles[Role.PRODUCER])
    async with producer.begin() as conn:
        ids = [
            await app.write_async(conn, **{**ROW, "shard_identifier": shard, "payload": {"n": 1}})
            for shard in range(20)
        ]
    for forbidden in (f"DELETE FROM {table}", f"SELECT payload FROM {table}"):
        with pytest.raises(DBAPIError, match=f"permission denied for table {table}"):
            async with producer.begin() as conn:
                await conn.execute(text(forbidden))
    async with running_worker(servers, app, database_url=role_url(servers, roles[Role.WORKER])):
        await wait_until(lambda: set(ids) <= set(recorder.ids()), what="every row handled")
        await wait_until(lambda: _empty(engine, app), what="every row deleted")


async def test_a_worker_lacking_a_privilege_refuses_to_start_naming_it(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str]
) -> None:
    _recorder, table, app, worker = await granted_app(engine, roles, Role.WORKER)
    await sql(engine, f"REVOKE DELETE ON {table} FROM {worker}")
    with pytest.raises(MissingPrivilegeError) as refused:
        async with running_worker(servers, app, database_url=role_url(servers, worker)):
            pass
    assert f"role {worker} lacks DELETE on {table}:" in str(refused.value)
    assert f"outbox-bridge grants --worker {worker}" in str(refused.value)


async def test_read_only_commands_work_for_a_select_only_role_and_in_a_read_only_transaction(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str]
) -> None:
    _recorder, table, _app, reader = await granted_app(engine, roles, Role.READER)
    read_only = {"PGOPTIONS": "-c default_transaction_read_only=on"}
    for url, env in ((role_url(servers, reader), None), (servers.database_url, read_only)):
        for command in (["shards", "--json"], ["pauses", "--json"], ["parked", "--json"]):
            code, out, err = await cli(servers, table, *command, database_url=url, env=env)
            assert code == 0, (command, err)
            assert json.loads(out) == []


async def test_a_role_without_a_right_gets_the_right_named_not_a_traceback(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str]
) -> None:
    _recorder, table, _app, reader = await granted_app(engine, roles, Role.READER)
    code, _out, err = await cli(
        servers,
        table,
        "pause",
        "--category",
        "project_update",
        "--reason",
        "maintenance",
        database_url=role_url(servers, reader),
    )
    assert code == 2
    assert f"role {reader} lacks INSERT on {pauses_name(table)}" in err, err
    assert f"outbox-bridge grants --operator {reader}" in err and "Traceback" not in err


async def test_postgresql_records_the_role_that_paused_parked_and_unparked(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str], as_role: Any
) -> None:
    _recorder, table, app, operator = await granted_app(engine, roles, Role.OPERATOR)
    url = role_url(servers, operator)
    code, out, err = await cli(
        servers,
        table,
        *("pause", "--scope", "organization", "--reason", "r"),
        database_url=url,
        env={"LOGNAME": "someone-else", "USER": "someone-else"},
    )
    assert code == 0, err
    code, out, err = await cli(servers, table, "pauses", "--json")
    [paused] = json.loads(out)
    assert (paused["paused_by"], paused["paused_role"]) == ("someone-else", operator)
    async with engine.begin() as conn:
        await app.write_async(conn, **ROW)
    shard = ShardRef(table, int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, 7)
    async with as_role(operator).begin() as conn:
        await park_head(conn, app.table(), shard, reason="bad row", by="declared")
    async with engine.begin() as conn:  # the schema owner puts it back
        await unpark(conn, app.table(), shard, by="declared too")
    code, out, err = await cli(servers, table, "parked", "--all", "--json")
    [group] = json.loads(out)
    assert (group["parked_by"], group[PARKED_ROLE]) == ("declared", operator)
    assert group[UNPARKED_ROLE] == make_url(servers.database_url).username


async def test_a_right_revoked_while_the_worker_runs_holds_its_shard_not_the_worker(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str], caplog: pytest.LogCaptureFixture
) -> None:
    recorder, table, app, worker = await granted_app(engine, roles, Role.WORKER)
    async with running_worker(servers, app, database_url=role_url(servers, worker)):
        await sql(engine, f"REVOKE DELETE ON {table} FROM {worker}")
        async with engine.begin() as conn:
            row = await app.write_async(conn, **ROW)
        await wait_until(lambda: row in recorder.ids(), what="the row handled")
        assert await count_rows(engine, app) == 1  # its delete was refused: kept
        refused = f"permission denied for table {table}"

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if refused in r.getMessage()]

        await wait_until(lambda: bool(said()), what="the refusal logged")
        assert "outbox-bridge grants --worker ROLE" in said()[0], said()
        await sql(engine, f"GRANT DELETE ON {table} TO {worker}")
        await wait_until(lambda: _empty(engine, app), what="the row deleted once granted")


async def test_a_worker_that_may_not_analyze_says_so_once_and_drains(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Before PostgreSQL 17 a role that does not own the table cannot ANALYZE it (PostgreSQL
    skips it with a warning): the worker says what to do once, and drains all the same."""
    recorder, table, app = await table_without_statistics(engine, 1_500)
    worker = roles[Role.WORKER]
    await grant(engine, app, {Role.WORKER: worker})
    async with running_worker(servers, app, database_url=role_url(servers, worker)):
        await wait_until(lambda: _empty(engine, app), timeout=60, what="the rows")
    assert len(recorder.calls) == 1_500
    said = [r.getMessage() for r in caplog.records if "cannot analyze it" in r.getMessage()]
    assert len(said) == 1 and f"run ANALYZE {table}" in said[0], said


async def test_the_grants_command_prints_and_applies_exactly_the_statements_of_each_role(
    servers: Servers, engine: AsyncEngine, roles: dict[Role, str], as_role: Any
) -> None:
    _recorder, table, app = await fresh_app(engine)
    flags = [f"--{role.value}={name}" for role, name in roles.items()]
    code, out, err = await cli(servers, table, "grants", *flags, "--apply")
    assert code == 0, err
    assert out.splitlines() == [f"{s};" for s in grant_statements(app.metadata, roles)]
    for role, name in roles.items():
        async with as_role(name).connect() as conn:
            assert await missing_privileges(conn, [app.table()], role) == []
    # Nothing more than its own: a reader cannot pause, a worker cannot insert rows.
    async with as_role(roles[Role.WORKER]).connect() as conn:
        assert await missing_privileges(conn, [app.table()], Role.PRODUCER) == [
            MissingPrivilege("INSERT", table)
        ]
    async with as_role(roles[Role.READER]).connect() as conn:
        missing = await missing_privileges(conn, [app.table()], Role.OPERATOR)
    assert {m.privilege for m in missing} == {"INSERT", "UPDATE", "DELETE"}
