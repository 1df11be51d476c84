"""The outbox tables as SQLAlchemy Core, and the NOTIFY trigger that wakes the bridge.

Add ``app.metadata`` (or :func:`outbox_table` on your own ``MetaData``) to your migrations to
manage these tables yourself; ``outbox-bridge init-db`` (:mod:`outbox_bridge.db.install`)
creates whatever is missing, and the worker only checks them (:mod:`outbox_bridge.db.catalog`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    ColumnElement,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    and_,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from outbox_bridge.workflows.models import ShardRef

# A NOTIFY payload is limited to 8,000 bytes; past this many bytes (octet_length: a region of
# multi-byte characters counts each of its bytes) the trigger asks for a sweep instead.
NOTIFY_PAYLOAD_LIMIT = 7000
SWEEP_NOTIFICATION = "*"
# The producer's W3C trace context, a JSON object: {"traceparent": ..., "tracestate": ...}.
TRACE_CONTEXT_COLUMN = "trace_context"
# Who acted, as PostgreSQL authenticated them (not as they declared): filled by PostgreSQL.
SESSION_USER = text("session_user")
PAUSED_ROLE = "paused_role"
PAUSE_ENDS_AT = "ends_at"
PARKED_ROLE = "parked_role"
LIMIT_ROLE = "set_role"
# The highest rate a category's limit may have (calls per second): past it, a limit shared
# through one row costs more than it saves.
MAX_PER_SECOND = 100_000
UNPARKED_ROLE = "unparked_role"


def notify_channel(table: str) -> str:
    return f"{table}_rows"


def shard_columns(regional: bool) -> list[str]:
    return (["region"] if regional else []) + ["shard_scope", "shard_identifier"]


def shard_values(table: Table, shard: ShardRef) -> dict[str, Any]:
    """``shard``'s values of ``table``'s shard columns (an outbox table or one beside it)."""
    values = {
        "region": shard.region,
        "shard_scope": shard.scope,
        "shard_identifier": shard.shard_identifier,
    }
    return {name: values[name] for name in shard_columns("region" in table.c)}


def shard_where(table: Table, shard: ShardRef) -> ColumnElement[bool]:
    """``table``'s rows of ``shard``."""
    return and_(*(table.c[name] == value for name, value in shard_values(table, shard).items()))


def outbox_table(name: str, metadata: MetaData, *, regional: bool = False) -> Table:
    """Define an outbox table named ``name`` on ``metadata``, with its owner, parked-group,
    pause and rate-limit tables. Only the five core columns (and ``region`` in a regional
    table) need a value on insert; the dates default to now. The columns are described on the
    contract page.
    """
    shard = shard_columns(regional)
    columns: list[Column[object]] = [
        *_group_rows(regional),
        Column("payload", JSONB(none_as_null=True), nullable=True),
        Column(
            "scheduled_from", DateTime(timezone=True), nullable=False, server_default=func.now()
        ),
        Column("scheduled_for", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("date_added", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # Set when the row was written inside a span; rows from plain SQL have none.
        Column(TRACE_CONTEXT_COLUMN, JSONB(none_as_null=True), nullable=True),
    ]
    table = Table(name, metadata, *columns, date_added_check(name))
    # The head of a shard, its coalescing groups and its deferral barrier are all read through
    # this index, mostly index-only.
    Index(
        f"{name}_shard_idx",
        *[table.c[c] for c in shard],
        table.c.id,
        postgresql_include=["category", "object_identifier", "scheduled_for"],
    )
    Index(
        f"{name}_group_idx",
        *[table.c[c] for c in shard],
        table.c.category,
        table.c.object_identifier,
        table.c.id,
    )
    table.info["regional"] = regional
    owner_table(table)
    parked_table(table)
    pause_table(table)
    limit_table(table)
    return table


def _group_rows(regional: bool) -> list[Column[object]]:
    """An id, and the columns that name a coalescing group (an outbox row's, a parked group's)."""
    columns: list[Column[object]] = [
        Column("id", BigInteger, Identity(always=False), primary_key=True),
    ]
    if regional:
        columns.append(Column("region", Text, nullable=False))
    return [
        *columns,
        Column("shard_scope", Integer, nullable=False),
        Column("shard_identifier", BigInteger, nullable=False),
        Column("category", Integer, nullable=False),
        Column("object_identifier", BigInteger, nullable=False),
    ]


def owner_table(outbox: Table) -> Table:
    """The table of the shards of ``outbox`` that their own ``OutboxShard`` workflow holds
    (its handler failed, it is skipped, its head is deferred, a flush waits on it); partitions
    drain the others. Rows change under the shard's lock: never in the middle of a drain.
    """
    regional = bool(outbox.info.get("regional"))
    columns: list[Column[object]] = []
    if regional:
        columns.append(Column("region", Text, primary_key=True))
    columns += [
        Column("shard_scope", Integer, primary_key=True),
        Column("shard_identifier", BigInteger, primary_key=True),
        # Why the workflow took the shard: failed, skipped, deferred, flush, ...
        Column("held_for", Text, nullable=False),
        Column("since", DateTime(timezone=True), nullable=False, server_default=func.now()),
    ]
    return _beside(outbox, "owners", Table(owners_name(outbox.name), outbox.metadata, *columns))


def owners_name(table: str) -> str:
    return f"{table}_owners"


def pause_table(outbox: Table) -> Table:
    """The table of the categories and scopes of ``outbox`` that an operator paused: their
    rows are not due, and their shards wait at them as at a row scheduled for later.
    """
    pauses = Table(
        pauses_name(outbox.name),
        outbox.metadata,
        Column("kind", Text, primary_key=True),  # category or scope
        Column("number", Integer, primary_key=True),  # the category's or the scope's value
        Column("reason", Text, nullable=False),
        Column("paused_by", Text, nullable=False),
        # The role PostgreSQL authenticated, beside the declared ``paused_by``.
        Column(PAUSED_ROLE, Text, nullable=False, server_default=SESSION_USER),
        Column("since", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # Who Temporal recorded as the sender of the control workflow's pause update
        # (``temporal:<identity>``); NULL for a pause made otherwise.
        Column("paused_via", Text, nullable=True),
        # When a timed pause ends by itself (``pause --for``/``--until``); NULL until unpaused.
        Column(PAUSE_ENDS_AT, DateTime(timezone=True), nullable=True),
        CheckConstraint("kind IN ('category', 'scope')", name=f"{outbox.name}_pauses_kind"),
    )
    return _beside(outbox, "pauses", pauses)


def pauses_name(table: str) -> str:
    return f"{table}_pauses"


def limit_table(outbox: Table) -> Table:
    """The token bucket of each rate-limited category of ``outbox``, shared by every worker,
    and the rate an operator set at run time in place of the declared one."""
    limits = Table(
        limits_name(outbox.name),
        outbox.metadata,
        Column("category", Integer, primary_key=True),
        Column("tokens", Double, nullable=False, server_default=text("0")),
        Column("refilled_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # Calls per second an operator set (``outbox-bridge limit``); NULL: the declared one.
        Column("per_second", Double, nullable=True),
        # The declared rate, as the worker that last took tokens declared it (for the commands).
        Column("declared", Double, nullable=True),
        Column("set_by", Text, nullable=True),
        # The role PostgreSQL authenticated, beside the declared ``set_by``.
        Column(LIMIT_ROLE, Text, nullable=True),
        Column("set_at", DateTime(timezone=True), nullable=True),
        CheckConstraint(
            f"per_second > 0 AND per_second <= {MAX_PER_SECOND}",
            name=f"{outbox.name}_limits_per_second",
        ),
    )
    return _beside(outbox, "limits", limits)


def limits_name(table: str) -> str:
    return f"{table}_limits"


def limits_of(outbox: Table) -> Table:
    """The rate-limit table of an outbox table defined by :func:`outbox_table`."""
    return _side(outbox, "limits")


def pauses_of(outbox: Table) -> Table:
    """The pause table of an outbox table defined by :func:`outbox_table`."""
    return _side(outbox, "pauses")


def owners_of(outbox: Table) -> Table:
    """The owner table of an outbox table defined by :func:`outbox_table`."""
    return _side(outbox, "owners")


def parked_table(outbox: Table) -> Table:
    """The table of the coalescing groups of ``outbox`` an operator parked (set aside so that
    their shard goes on), kept as the audit record once they are put back.

    A group with a row here and no ``unparked_at`` is invisible to every drain; its rows, later
    ones included, stay in the outbox table until it is unparked.
    """
    regional = bool(outbox.info.get("regional"))
    columns: list[Column[object]] = [
        *_group_rows(regional),
        # The group's first row when it was parked: where it stands in the shard's order.
        Column("first_id", BigInteger, nullable=False),
        Column("reason", Text, nullable=False),
        Column("parked_by", Text, nullable=False),
        Column("parked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("unparked_by", Text, nullable=True),
        Column("unparked_at", DateTime(timezone=True), nullable=True),
        # The roles PostgreSQL authenticated, beside the declared ``parked_by``/``unparked_by``.
        Column(PARKED_ROLE, Text, nullable=False, server_default=SESSION_USER),
        Column(UNPARKED_ROLE, Text, nullable=True),
    ]
    parked = Table(parked_name(outbox.name), outbox.metadata, *columns)
    # One open park per group; the drains' lookups go through this index.
    Index(
        f"{parked.name}_group_idx",
        *[parked.c[c] for c in shard_columns(regional)],
        parked.c.category,
        parked.c.object_identifier,
        unique=True,
        postgresql_where=parked.c.unparked_at.is_(None),
    )
    return _beside(outbox, "parked", parked)


def parked_name(table: str) -> str:
    return f"{table}_parked"


def parked_of(outbox: Table) -> Table:
    """The parked-group table of an outbox table defined by :func:`outbox_table`."""
    return _side(outbox, "parked")


def _beside(outbox: Table, kind: str, side: Table) -> Table:
    """Record ``side`` as ``outbox``'s table of ``kind`` (owners, parked, pauses, limits)."""
    side.info[f"{kind}_of"] = outbox.name
    outbox.info[kind] = side
    return side


def _side(outbox: Table, kind: str) -> Table:
    side = outbox.info[kind]
    assert isinstance(side, Table)
    return side


def notify_function(table: Table) -> str:
    """The name of the function the NOTIFY trigger of ``table`` runs (also its trigger's)."""
    return f"{table.name}_notify"


def notify_function_body(table: Table) -> str:
    """The PL/pgSQL body of :func:`notify_function`, as PostgreSQL keeps it (``prosrc``): the
    catalog's copy is compared with it to tell whether the installed function is this one."""
    regional = bool(table.info.get("regional"))
    shard = ", ".join(shard_columns(regional))
    return f"""
        DECLARE
            message text;
        BEGIN
            SELECT json_agg(json_build_array({shard}, max_id))::text INTO message
            FROM (SELECT {shard}, max(id) AS max_id FROM new_rows GROUP BY {shard}) AS shards;
            IF message IS NULL THEN
                RETURN NULL;
            END IF;
            IF octet_length(message) > {NOTIFY_PAYLOAD_LIMIT} THEN
                message := '{SWEEP_NOTIFICATION}';
            END IF;
            PERFORM pg_notify('{notify_channel(table.name)}', message);
            RETURN NULL;
        END
        """


def notify_ddl(table: Table) -> list[str]:
    """Statements that install the statement-level NOTIFY trigger on ``table`` (idempotent).

    One notification per INSERT statement, with the highest new id of each shard it touched
    (``*``, a sweep, past the payload limit), delivered at commit: a rolled-back row is never
    announced.
    """
    return [notify_function_ddl(table), notify_trigger_ddl(table)]


def notify_function_ddl(table: Table) -> str:
    """The statement that installs (or replaces) :func:`notify_function`."""
    return (
        f"CREATE OR REPLACE FUNCTION {notify_function(table)}() RETURNS trigger "
        f"LANGUAGE plpgsql AS $${notify_function_body(table)}$$"
    )


def notify_trigger_ddl(table: Table) -> str:
    """The statement that installs (or replaces) the trigger that runs :func:`notify_function`
    after each INSERT statement on ``table``."""
    name = notify_function(table)
    return (
        f"CREATE OR REPLACE TRIGGER {name} AFTER INSERT ON {table.name} "
        f"REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
    )


def drop_notify_ddl(table: Table) -> list[str]:
    """Statements that remove what :func:`notify_ddl` installs on ``table`` (idempotent)."""
    name = table.name
    return [
        f"DROP TRIGGER IF EXISTS {name}_notify ON {name}",
        f"DROP FUNCTION IF EXISTS {name}_notify()",
    ]


def date_added_check(table_name: str) -> CheckConstraint:
    """The CHECK constraint that refuses an infinite ``date_added`` (ages are computed from it,
    and Python has no infinite datetime)."""
    return CheckConstraint("isfinite(date_added)", name=f"{table_name}_date_added_finite")
