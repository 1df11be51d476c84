"""The database roles of an outbox and the privileges each needs on the outbox tables: the
GRANT statements (``outbox-bridge grants``), the check of a role's privileges that names what
it lacks, and the worker's check of the database at start (the schema is this version's and its
role has the privileges a worker needs). Only the catalog is read (no lock, no DDL): what
differs is refused with the command that fixes it, run by the schema owner.

The schema owner (who runs ``init-db`` or the migrations) owns the tables and needs no grant.
A worker changes only rows; a producer only inserts; a reader only reads; an operator reads and
pauses, parks and unparks, and sets rate limits.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import MetaData, Table, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox_bridge.config import safe_url
from outbox_bridge.db.catalog import is_outbox, read_schema_state
from outbox_bridge.db.schema import limits_of, owners_of, parked_of, pauses_of
from outbox_bridge.errors import (
    ConfigurationError,
    MissingPrivilegeError,
    OutboxError,
    SchemaMismatchError,
)


class Role(enum.StrEnum):
    """The kinds of database role an outbox has besides the schema owner."""

    WORKER = "worker"
    PRODUCER = "producer"
    READER = "reader"
    OPERATOR = "operator"


class Side(enum.StrEnum):
    """An outbox table, or one of the tables beside it."""

    OUTBOX = "outbox"
    OWNERS = "owners"
    PARKED = "parked"
    PAUSES = "pauses"
    LIMITS = "limits"


_READ = ("SELECT",)
_WRITE = ("SELECT", "INSERT", "UPDATE", "DELETE")

# What each role does with each table (the documentation's table is this one):
# - worker: reads and deletes handled rows, records which shards their own workflow holds,
#   reads parked groups, records pauses asked of the pause control workflow, and takes tokens
#   of the rate limits' buckets (creates a category's bucket, changes its tokens alone);
# - producer: INSERT ... RETURNING id (the producer API returns the new id: SELECT on id alone);
# - reader: the listing commands (shards, status, pause --list, park --list, summaries);
# - operator: a reader who pauses and unpauses, parks and unparks, and sets rate limits.
PRIVILEGES: dict[Role, dict[Side, tuple[str, ...]]] = {
    Role.WORKER: {
        Side.OUTBOX: ("SELECT", "DELETE"),
        Side.OWNERS: _WRITE,
        Side.PARKED: _READ,
        Side.PAUSES: _WRITE,
        Side.LIMITS: (
            "SELECT",
            "INSERT (category)",
            "UPDATE (tokens)",
            "UPDATE (refilled_at)",
            "UPDATE (declared)",
        ),
    },
    Role.PRODUCER: {Side.OUTBOX: ("INSERT", "SELECT (id)")},
    Role.READER: {side: _READ for side in Side},
    Role.OPERATOR: {
        Side.OUTBOX: _READ,
        Side.OWNERS: _READ,
        Side.PARKED: ("SELECT", "INSERT", "UPDATE"),
        Side.PAUSES: ("SELECT", "INSERT", "UPDATE", "DELETE"),
        Side.LIMITS: ("SELECT", "INSERT", "UPDATE"),
    },
}


def side_table(outbox: Table, side: Side) -> Table:
    """``outbox``'s table of ``side``."""
    sides = {
        Side.OWNERS: owners_of,
        Side.PARKED: parked_of,
        Side.PAUSES: pauses_of,
        Side.LIMITS: limits_of,
    }
    return outbox if side is Side.OUTBOX else sides[side](outbox)


def outbox_tables(metadata: MetaData) -> list[Table]:
    return [table for table in metadata.sorted_tables if is_outbox(table)]


def quoted(name: str) -> str:
    """``name`` (a role's, a schema's) as an SQL identifier, quoted: it is not trusted to be
    one."""
    return '"' + name.replace('"', '""') + '"'


def grant_statements(
    metadata: MetaData, roles: Mapping[Role, str], *, schema: str = "public"
) -> list[str]:
    """The GRANT statements that give each role of ``roles`` (kind: role name) what it needs
    on every outbox table of ``metadata`` and the tables beside it, and nothing else."""
    statements: list[str] = []
    for kind, name in roles.items():
        role = quoted(name)
        statements.append(f"GRANT USAGE ON SCHEMA {quoted(schema)} TO {role}")
        for outbox in outbox_tables(metadata):
            for side, privileges in PRIVILEGES[kind].items():
                table = side_table(outbox, side).name
                statements.append(f"GRANT {', '.join(privileges)} ON {table} TO {role}")
    return statements


@dataclass(frozen=True)
class MissingPrivilege:
    privilege: str
    table: str

    def __str__(self) -> str:
        return f"{self.privilege} on {self.table}"


_HAS_PRIVILEGE = text("SELECT has_table_privilege(:table, :privilege)")
_HAS_COLUMN_PRIVILEGE = text("SELECT has_column_privilege(:table, :column, :privilege)")
CURRENT_ROLE = text("SELECT current_user")


async def missing_privileges(
    conn: AsyncConnection, tables: Iterable[Table], role: Role
) -> list[MissingPrivilege]:
    """What the connection's role lacks on ``tables`` (outbox tables) of what ``role`` needs
    (reads only the catalog)."""
    missing: list[MissingPrivilege] = []
    for outbox in tables:
        for side, privileges in PRIVILEGES[role].items():
            table = side_table(outbox, side).name
            for privilege in privileges:
                if not await _has(conn, table, privilege):
                    missing.append(MissingPrivilege(privilege, table))
    return missing


async def _has(conn: AsyncConnection, table: str, privilege: str) -> bool:
    if " (" in privilege:  # a column privilege: SELECT (id)
        kind, column = privilege.rstrip(")").split(" (")
        params = {"table": table, "column": column, "privilege": kind}
        return bool((await conn.execute(_HAS_COLUMN_PRIVILEGE, params)).scalar_one())
    params = {"table": table, "privilege": privilege}
    return bool((await conn.execute(_HAS_PRIVILEGE, params)).scalar_one())


# SQLSTATE of a statement refused for a missing privilege.
INSUFFICIENT_PRIVILEGE = "42501"
_SIDE_SUFFIXES = {f"_{side.value}": side for side in Side if side is not Side.OUTBOX}


def side_of(table: str) -> Side:
    """Which of an outbox's tables ``table`` is, by its name."""
    return next((s for suffix, s in _SIDE_SUFFIXES.items() if table.endswith(suffix)), Side.OUTBOX)


async def privilege_error(engine: AsyncEngine, error: DBAPIError, role: Role) -> OutboxError:
    """What a statement refused with ``INSUFFICIENT_PRIVILEGE`` lacked, as an error naming the
    role, the privileges ``role`` needs on the table the database named, and the GRANT
    command; read on a connection of its own (the refused transaction is aborted)."""
    reason = " ".join(str(error.orig).split())
    found = re.search(r"permission denied for (?:table|relation) (\S+)", reason)
    async with engine.connect() as conn:
        name = str((await conn.execute(CURRENT_ROLE)).scalar_one())
        missing = []
        if found is not None:
            table = found.group(1)
            for privilege in PRIVILEGES[role].get(side_of(table), ()):
                if not await _has(conn, table, privilege):
                    missing.append(MissingPrivilege(privilege, table))
    if missing:
        return MissingPrivilegeError(describe_missing(name, missing, role))
    return MissingPrivilegeError(
        f"role {name} was refused: {reason}. A role needs the privileges "
        f"`{grants_command(role, name)}` prints (run by the tables' owner)"
    )


def privilege_advice(error: BaseException, role: Role) -> str:
    """For a driver error refused for a missing privilege, what a ``role`` runs to get it (to
    append to the error's message); else nothing."""
    if getattr(error, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
        return ""
    return f" (grant the {role.value}'s privileges with `{grants_command(role, 'ROLE')}`)"


def grants_command(role: Role, name: str) -> str:
    """The command that prints the GRANT statements ``name`` needs as a ``role``."""
    return f"outbox-bridge grants --{role.value} {name}"


def describe_missing(role_name: str, missing: Sequence[MissingPrivilege], role: Role) -> str:
    """One sentence: what ``role_name`` lacks and the command a schema owner runs to grant it."""
    return (
        f"role {role_name} lacks {', '.join(map(str, missing))}: grant it with "
        f"`{grants_command(role, role_name)}` (with the app's --app; add --apply to run the "
        "GRANTs as the tables' owner)"
    )


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
