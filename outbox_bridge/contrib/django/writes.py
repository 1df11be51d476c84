"""Writing outbox rows with Django's connections: :func:`write_row` is ``app.write`` for
Django (the same checks, INSERT and producer span, run on the connection's cursor). Each row is
reported to the innermost open outbox context (:mod:`outbox_bridge.contrib.django.flush`).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol, Unpack

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from sqlalchemy import Insert
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

from outbox_bridge.contrib.django.conf import OutboxConfigurationError
from outbox_bridge.errors import OutboxError
from outbox_bridge.observability.producer_spans import observed_write
from outbox_bridge.producer import RowFields, RowSpec
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardRef

# Django's PostgreSQL backend runs on psycopg 3 (outbox-bridge requires it), which takes the
# dialect's pyformat parameters and adapted values (Jsonb) as they are.
_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it bare


class RowRecorder(Protocol):
    """An open outbox context, as ``write_row`` sees it."""

    def record_row(
        self, app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int
    ) -> None: ...


Stack = tuple[RowRecorder, ...]

# The open contexts, innermost last, per thread or task: rows written with ``sync_to_async``
# for an async view reach the context the view opened.
OPEN: ContextVar[Stack] = ContextVar("outbox_bridge_django_contexts", default=())


class NotInTransactionError(OutboxError, TransactionManagementError):
    """A row written outside ``transaction.atomic()``: in autocommit it would commit apart from
    the change it describes. Both an :class:`~outbox_bridge.OutboxError` and Django's
    ``TransactionManagementError``."""


def compiled(statement: Insert) -> tuple[str, dict[str, Any]]:
    """``statement`` as SQL and parameters for a psycopg cursor: compiled for PostgreSQL, each
    value through its column type's bind processor (a payload becomes psycopg's ``Jsonb``)."""
    query = statement.compile(dialect=_DIALECT)
    parameters: dict[str, Any] = {}
    for name, value in query.construct_params().items():
        processor = query.binds[name].type.dialect_impl(_DIALECT).bind_processor(_DIALECT)
        parameters[name] = processor(value) if processor is not None else value
    return query.string, parameters


def write_row(app: OutboxApp, *, using: str | None = None, **row: Unpack[RowFields]) -> int:
    """Write one outbox row of ``app`` with the connection of database ``using`` (default:
    ``"default"``) and return its id. The row's keyword arguments and checks are those of
    :meth:`OutboxApp.write <outbox_bridge.OutboxApp.write>` (a row that does not fit the
    registry raises :class:`~outbox_bridge.InvalidRowError` and writes nothing).

    It must run inside ``transaction.atomic(using=...)`` (else :class:`NotInTransactionError`)
    and never commits: the row commits or rolls back with the caller's transaction, and an open
    :func:`~outbox_bridge.contrib.django.flush.outbox_context` waits for it once it committed.
    """
    prepared = app.prepare(RowSpec(**row))
    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    if connection.vendor != "postgresql":
        raise OutboxConfigurationError(
            f"database {alias!r} is {connection.vendor}: outbox rows live in PostgreSQL"
        )
    if not connection.in_atomic_block:
        raise NotInTransactionError(
            f"write outbox rows inside transaction.atomic(using={alias!r}): in autocommit the "
            "row would commit apart from the change it describes (wrap a row of its own in "
            "atomic() too)"
        )
    with observed_write(prepared) as seen:
        sql, parameters = compiled(seen.statement)
        with connection.cursor() as cursor:
            cursor.execute(sql, parameters)
            found = cursor.fetchone()
        assert found is not None  # INSERT ... RETURNING id returns the row
        row_id = seen.written(int(found[0]))
    if stack := OPEN.get():
        stack[-1].record_row(app, alias, connection, prepared.shard, row_id)
    return row_id


async def write_row_async(
    app: OutboxApp, *, using: str | None = None, **row: Unpack[RowFields]
) -> int:
    """:func:`write_row` for async code: run with ``sync_to_async`` inside
    ``transaction.atomic(using)``, so the row commits on its own when this returns (unless the
    thread is already inside ``atomic()``).

    To write it in one transaction with a model change, do both in one sync function under
    ``transaction.atomic()`` and call that with ``sync_to_async``, as
    :class:`~outbox_bridge.contrib.django.models.OutboxModel`'s ``asave()`` and ``adelete()`` do.
    """

    def write() -> int:
        with transaction.atomic(using=using):
            return write_row(app, using=using, **row)

    return await sync_to_async(write, thread_sensitive=True)()
