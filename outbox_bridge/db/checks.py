"""The worker's check of the database at start: the schema is this version's and its role has
the privileges a worker needs. Only the catalog is read (no lock, no DDL): what differs is
refused with the command that fixes it, run by the schema owner."""

from __future__ import annotations

from sqlalchemy import MetaData
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.config import safe_url
from outbox_bridge.db.catalog import read_schema_state
from outbox_bridge.db.grants import (
    CURRENT_ROLE,
    Role,
    describe_missing,
    missing_privileges,
    outbox_tables,
)
from outbox_bridge.errors import ConfigurationError, MissingPrivilegeError, SchemaMismatchError

SCHEMA_FIX = (
    "a schema owner runs `outbox-bridge init-db` with the worker's --app (or your migrations: "
    "outbox_bridge.db.migrations.upgrade_outbox for Alembic, the UpgradeOutbox operation for "
    "Django); the worker never changes the schema itself"
)


async def check_database(engine: AsyncEngine, metadata: MetaData, role: Role) -> None:
    """Refuse a database whose outbox schema differs from ``metadata``, or whose connecting
    role lacks a privilege that ``role`` needs.

    Raises:
        SchemaMismatchError: what is missing or different, and the command that fixes it.
        MissingPrivilegeError: the privileges and tables the role lacks, and the GRANT command.
        ConfigurationError: the database cannot be reached.
    """
    where = safe_url(engine.url)
    try:
        async with engine.connect() as conn:
            states = await read_schema_state(conn, metadata)
            problems = [problem for state in states for problem in state.problems()]
            missing = (
                [] if problems else await missing_privileges(conn, outbox_tables(metadata), role)
            )
            name = str((await conn.execute(CURRENT_ROLE)).scalar_one())
    except DBAPIError as exc:
        raise ConfigurationError(
            f"cannot read the outbox tables' catalog in {where}: {str(exc.orig).strip()}"
        ) from None
    if problems:
        raise SchemaMismatchError(
            f"the outbox schema in {where} is not this version's: {'; '.join(problems)}. "
            f"To fix it, {SCHEMA_FIX}"
        )
    if missing:
        raise MissingPrivilegeError(f"{describe_missing(name, missing, role)} ({where})")
