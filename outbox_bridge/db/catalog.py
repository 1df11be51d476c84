"""What the database holds of the outbox schema, read from PostgreSQL's catalog, against what the
app's ``MetaData`` defines.

Reading the catalog takes no lock on any table and needs no privilege: the worker checks the
schema with it at every start (and refuses to start on a difference), and ``init-db`` plans
from it only the statements that change something.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import CheckConstraint, Column, MetaData, Table, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.schema import notify_function, notify_function_body

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it bare

# An AFTER INSERT ... FOR EACH STATEMENT trigger (pg_trigger.tgtype: the INSERT bit alone).
_AFTER_INSERT_STATEMENT = 4

_TABLE_EXISTS = text("SELECT to_regclass(:table) IS NOT NULL")
_COLUMNS = text(
    "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
    "WHERE attrelid = to_regclass(:table) AND attnum > 0 AND NOT attisdropped"
)
_INDEXES = text(
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = to_regclass(:table)"
)
_CONSTRAINTS = text("SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(:table)")
_FUNCTION = text(
    "SELECT p.prosrc FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
    "WHERE p.oid = to_regprocedure(:signature) AND l.lanname = 'plpgsql'"
)
_TRIGGER = text(
    "SELECT t.tgtype, t.tgenabled, t.tgnewtable, t.tgfoid = to_regprocedure(:signature) "
    "FROM pg_trigger t WHERE t.tgrelid = to_regclass(:table) AND t.tgname = :trigger "
    "AND NOT t.tgisinternal"
)


def column_type(column: Column[object]) -> str:
    """``column``'s type as PostgreSQL's ``format_type`` names it (``bigint``, ``jsonb``,
    ``timestamp with time zone``)."""
    return str(column.type.compile(dialect=_DIALECT)).lower()


def is_outbox(table: Table) -> bool:
    """Whether ``table`` is an outbox table (its side tables and other tables are not)."""
    return "regional" in table.info


@dataclass
class TableState:
    """What the catalog holds of one table of the metadata."""

    table: Table
    exists: bool
    columns: dict[str, str] = field(default_factory=dict)  # name: format_type
    indexes: set[str] = field(default_factory=set)
    constraints: set[str] = field(default_factory=set)
    function_current: bool = True  # outbox tables: the NOTIFY function is this version's
    trigger_current: bool = True  # outbox tables: its trigger exists and calls that function

    def missing_columns(self) -> list[Column[object]]:
        return [c for c in self.table.columns if c.name not in self.columns]

    def mistyped_columns(self) -> list[str]:
        """A phrase for each column whose type differs from the metadata's."""
        name, found = self.table.name, self.columns
        return [
            f"column {name}.{c.name} is {found[c.name]}, expected {column_type(c)}"
            for c in self.table.columns
            if c.name in found and found[c.name] != column_type(c)
        ]

    def missing_indexes(self) -> list[str]:
        names = (str(index.name) for index in self.table.indexes)
        return sorted(name for name in names if name not in self.indexes)

    def missing_checks(self) -> list[CheckConstraint]:
        return [
            constraint
            for constraint in self.table.constraints
            if isinstance(constraint, CheckConstraint)
            and isinstance(constraint.name, str)
            and constraint.name not in self.constraints
        ]

    def problems(self) -> list[str]:
        """What differs from the metadata, one phrase each (empty: as expected)."""
        name = self.table.name
        if not self.exists:
            return [f"table {name} is missing"]
        found = [f"column {name}.{c.name} is missing" for c in self.missing_columns()]
        found += self.mistyped_columns()
        found += [f"index {index} on {name} is missing" for index in self.missing_indexes()]
        found += [f"constraint {c.name} on {name} is missing" for c in self.missing_checks()]
        if not self.function_current:
            found.append(
                f"function {notify_function(self.table)}() is missing or not this version's"
            )
        if not self.trigger_current:
            found.append(
                f"trigger {notify_function(self.table)} on {name} is missing or does not call "
                f"{notify_function(self.table)}() after each insert statement"
            )
        return found


async def read_table_state(conn: AsyncConnection, table: Table) -> TableState:
    """What the catalog holds of ``table`` (reads only the catalog)."""
    params = {"table": table.name}
    if not (await conn.execute(_TABLE_EXISTS, params)).scalar_one():
        return TableState(table, exists=False)
    state = TableState(
        table,
        exists=True,
        columns={name: kind for name, kind in await conn.execute(_COLUMNS, params)},
        indexes=set((await conn.execute(_INDEXES, params)).scalars()),
        constraints=set((await conn.execute(_CONSTRAINTS, params)).scalars()),
    )
    if is_outbox(table):
        signature = f"{notify_function(table)}()"
        source = (await conn.execute(_FUNCTION, {"signature": signature})).scalar_one_or_none()
        state.function_current = source == notify_function_body(table)
        trigger = (
            await conn.execute(
                _TRIGGER, {**params, "signature": signature, "trigger": notify_function(table)}
            )
        ).first()
        state.trigger_current = trigger is not None and (
            trigger[0] == _AFTER_INSERT_STATEMENT
            and trigger[1] != "D"  # disabled
            and trigger[2] == "new_rows"
            and bool(trigger[3])
        )
    return state


async def read_schema_state(conn: AsyncConnection, metadata: MetaData) -> list[TableState]:
    """:func:`read_table_state` of every table of ``metadata``, in creation order."""
    return [await read_table_state(conn, table) for table in metadata.sorted_tables]
