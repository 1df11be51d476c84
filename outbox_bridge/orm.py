"""Outbox rows from SQLAlchemy ORM models (:class:`OutboxModel`).

Mapper events note exactly the instances that the unit of work wrote: an update with no net
change is in ``session.dirty`` but writes nothing, and an orphan deleted by ``delete-orphan`` is
written but never in ``session.deleted``. The session's ``after_flush`` event then writes their
rows with ``app.write(session)``, so an ``outbox_context`` around the session sees them. An
``AsyncSession`` runs the same events on its sync session.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, get_args

from sqlalchemy import Integer, event
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Mapper, Session, object_session

from outbox_bridge.declarations import Declaration, ModelRow, Operation, declare, model_row
from outbox_bridge.errors import OutboxModelError
from outbox_bridge.registry import OutboxApp

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import UOWTransaction

# Key in session.info: the changes of the flush under way.
PENDING = "outbox_bridge.orm.pending"


class OutboxModel:
    """Mix into a mapped class so that every flushed insert, update and delete of an instance
    writes an outbox row in the same flush.

    Declare on the class (or on a shared base of your replicated models):

    - ``__outbox_app__``: the :class:`~outbox_bridge.OutboxApp` (required).
    - ``__outbox_category__``: the category of the rows (required). Its scope comes from the
      app's registry.
    - ``__outbox_shard__``: the attribute holding the shard identifier. When omitted, it is
      ``<scope>_id`` (``organization_id`` for ``ORGANIZATION``) if the class has one, else the
      primary key if the class is the scope's own model (``Organization`` for
      ``ORGANIZATION``, ``AuditLog`` for ``AUDIT_LOG``).
    - ``__outbox_object__``: the attribute holding the object identifier; the primary key
      (a single integer column) when omitted.
    - ``__outbox_table__``: the app's table to write to; the app's first when omitted.
      Regional tables are refused: they need one row per target region, written with
      ``app.write``.

    One row per written instance per flush, so several flushes of one transaction can write
    several rows for an object: they coalesce, and the handler gets the newest. Override
    :meth:`outbox_payload` to give the rows a payload. Statements that bypass the unit of work
    (``session.execute(update(...))``, ``bulk_insert_mappings``, ...) write no row: see
    :func:`write_outbox_rows`.
    """

    __outbox_app__: ClassVar[OutboxApp]
    __outbox_category__: ClassVar[IntEnum]
    __outbox_shard__: ClassVar[str | None] = None
    __outbox_object__: ClassVar[str | None] = None
    __outbox_table__: ClassVar[str | None] = None

    def outbox_payload(self, operation: Operation) -> Any:
        """The payload of the row written for ``operation`` on this instance (``None``: none).

        Called after the flush for inserts and updates and before the row goes for deletes.
        Rows coalesce, so a handler sees only the newest payload of its group: carry what
        identifies the change, and read the current state from the database in the handler.
        """
        return None


@dataclass(frozen=True)
class _Change:
    instance: Any
    operation: Operation
    row: ModelRow | None  # computed at once for deletes: after the DELETE, nothing can load


# -- declaration ---------------------------------------------------------------------------------

# Each mapped OutboxModel class, resolved once when it is mapped.
_declarations: weakref.WeakKeyDictionary[type[Any], Declaration] = weakref.WeakKeyDictionary()


def _primary_key_attribute(mapper: Mapper[Any]) -> str | None:
    """The attribute of a single-column integer primary key, or ``None``."""
    column, *others = mapper.primary_key
    if others or not isinstance(column.type, Integer):
        return None
    return mapper.get_property_by_column(column).key


def _declare(mapper: Mapper[Any], cls: type[Any]) -> None:
    _declarations[cls] = declare(
        cls,
        primary_key=_primary_key_attribute(mapper),
        primary_key_columns=", ".join(f"{c.name} {c.type}" for c in mapper.primary_key),
    )
    _listen_to_sessions()


# -- rows ----------------------------------------------------------------------------------------


def _describe(instance: Any) -> str:
    identity = sa_inspect(instance).identity
    if identity is None:
        return f"a new {type(instance).__name__}"
    key = identity[0] if len(identity) == 1 else identity
    return f"{type(instance).__name__} {key!r}"


def _declaration(instance: Any) -> Declaration:
    state = sa_inspect(instance, raiseerr=False)
    declaration = None if state is None else _declarations.get(state.mapper.class_)
    if declaration is None:
        raise OutboxModelError(
            f"{type(instance).__name__} is not a mapped class declared with OutboxModel"
        )
    return declaration


def _row_of(instance: Any, operation: Operation) -> ModelRow:
    return model_row(_declaration(instance), instance, operation, _describe, "before the flush")


def _write_row(session: Session, row: ModelRow) -> int:
    # With the Session itself, not its connection: outbox_context finds its rows through it.
    return row.app.write(session, **row.fields)


# -- events --------------------------------------------------------------------------------------


def _note(instance: Any, operation: Operation, row: ModelRow | None = None) -> None:
    session = object_session(instance)
    if session is not None:
        session.info.setdefault(PENDING, []).append(_Change(instance, operation, row))


def _inserted(mapper: Mapper[Any], connection: Connection, instance: Any) -> None:
    _note(instance, "insert")


def _updated(mapper: Mapper[Any], connection: Connection, instance: Any) -> None:
    # after_update also fires for instances marked dirty whose columns did not change.
    session = object_session(instance)
    if session is not None and session.is_modified(instance, include_collections=False):
        _note(instance, "update")


def _deleting(mapper: Mapper[Any], connection: Connection, instance: Any) -> None:
    # The row still exists: an identifier that is not loaded can still be loaded.
    _note(instance, "delete", _row_of(instance, "delete"))


def _forget_changes(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    # Left over by a flush that failed before after_flush: those changes rolled back.
    session.info.pop(PENDING, None)


def _write_changes(session: Session, flush_context: UOWTransaction) -> None:
    changes: list[_Change] = session.info.pop(PENDING, [])
    for change in changes:
        _write_row(session, change.row or _row_of(change.instance, change.operation))


def _listen_to_sessions() -> None:
    """Listen on every Session (the sync sessions of AsyncSession included), once."""
    if not event.contains(Session, "after_flush", _write_changes):
        event.listen(Session, "before_flush", _forget_changes)
        event.listen(Session, "after_flush", _write_changes)


event.listen(OutboxModel, "after_mapper_constructed", _declare, propagate=True)
event.listen(OutboxModel, "after_insert", _inserted, propagate=True)
event.listen(OutboxModel, "after_update", _updated, propagate=True)
event.listen(OutboxModel, "before_delete", _deleting, propagate=True)


# -- changes that bypass the unit of work --------------------------------------------------------


def write_outbox_rows(
    session: Session, instances: Iterable[Any], *, operation: Operation = "update"
) -> list[int]:
    """Write the outbox row of each :class:`OutboxModel` instance, as a flush that did
    ``operation`` to it would have, and return the new rows' ids.

    For changes that bypass the unit of work and so write no row themselves: ORM bulk
    ``insert``/``update``/``delete`` statements, ``bulk_insert_mappings``, Core statements.
    Fetch the changed instances with ``RETURNING`` and pass them here, in the same
    transaction::

        projects = session.scalars(
            update(Project).where(Project.organization_id == 4).values(archived=True)
            .returning(Project)
        ).all()
        write_outbox_rows(session, projects)

    Every row is checked before any is written. Never commits.
    """
    if operation not in get_args(Operation):
        raise ValueError(f"operation must be one of {get_args(Operation)}, got {operation!r}")
    if not isinstance(session, Session):
        raise TypeError(
            "write_outbox_rows() needs a sync Session; with an AsyncSession use "
            "await write_outbox_rows_async()"
        )
    rows = [_row_of(instance, operation) for instance in instances]
    return [_write_row(session, row) for row in rows]


async def write_outbox_rows_async(
    session: AsyncSession, instances: Iterable[Any], *, operation: Operation = "update"
) -> list[int]:
    """:func:`write_outbox_rows` for an ``AsyncSession``."""
    return await session.run_sync(write_outbox_rows, list(instances), operation=operation)


__all__ = [
    "Operation",
    "OutboxModel",
    "write_outbox_rows",
    "write_outbox_rows_async",
]
