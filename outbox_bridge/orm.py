"""Outbox rows from SQLAlchemy ORM models.

A mapped class that mixes in :class:`OutboxModel` writes one outbox row for every instance that
a flush inserts, updates or deletes, in that same flush: the row commits or rolls back with the
change it describes. The scope follows from the category; the shard identifier and the object
identifier are inferred from the class once, when it is mapped, and a declaration that does
not fit raises :class:`~outbox_bridge.OutboxModelError` right there.

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
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from sqlalchemy import Integer, event
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Mapper, Session, object_session

from outbox_bridge.errors import OutboxModelError, RegistryError
from outbox_bridge.registry import OutboxApp

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import UOWTransaction

Operation = Literal["insert", "update", "delete"]

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
class _Declaration:
    app: OutboxApp
    category: IntEnum
    table: str
    shard_attribute: str
    object_attribute: str


@dataclass(frozen=True)
class _Row:
    declaration: _Declaration
    shard_identifier: int
    object_identifier: int
    payload: Any


@dataclass(frozen=True)
class _Change:
    instance: Any
    operation: Operation
    row: _Row | None  # computed at once for deletes: after the DELETE, nothing can load


# -- declaration ---------------------------------------------------------------------------------

# Each mapped OutboxModel class, resolved once when it is mapped.
_declarations: weakref.WeakKeyDictionary[type[Any], _Declaration] = weakref.WeakKeyDictionary()


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def _primary_key_attribute(mapper: Mapper[Any]) -> str | None:
    """The attribute of a single-column integer primary key, or ``None``."""
    if len(mapper.primary_key) != 1:
        return None
    column = mapper.primary_key[0]
    if not isinstance(column.type, Integer):
        return None
    return mapper.get_property_by_column(column).key


def _declared_attribute(cls: type[Any], option: str) -> str | None:
    value = getattr(cls, option, None)
    if value is None:
        return None
    if not isinstance(value, str) or not hasattr(cls, value):
        raise OutboxModelError(
            f"{cls.__name__}: {option} is {value!r}, which is not the name of an attribute of "
            f"{cls.__name__}"
        )
    return value


def _object_attribute(mapper: Mapper[Any], cls: type[Any]) -> str:
    declared = _declared_attribute(cls, "__outbox_object__")
    if declared is not None:
        return declared
    key = _primary_key_attribute(mapper)
    if key is None:
        columns = ", ".join(f"{c.name} {c.type}" for c in mapper.primary_key)
        raise OutboxModelError(
            f"{cls.__name__}: the object identifier is the primary key, which must be one "
            f"integer column (it is {columns}); declare __outbox_object__ = '<attribute>' "
            "naming an integer attribute"
        )
    return key


def _shard_attribute(mapper: Mapper[Any], cls: type[Any], scope: IntEnum) -> str:
    declared = _declared_attribute(cls, "__outbox_shard__")
    if declared is not None:
        return declared
    conventional = f"{scope.name.lower()}_id"
    if hasattr(cls, conventional):
        return conventional
    own = _camel(scope.name)
    key = _primary_key_attribute(mapper)
    if cls.__name__ == own and key is not None:
        return key
    raise OutboxModelError(
        f"{cls.__name__}: cannot infer the shard identifier of scope {scope.name}: it has no "
        f"attribute {conventional!r} and is not the {own} model; declare __outbox_shard__ = "
        f"'<attribute holding the {scope.name.lower()} id>'"
    )


def _resolve(mapper: Mapper[Any], cls: type[Any]) -> _Declaration:
    name = cls.__name__
    app = getattr(cls, "__outbox_app__", None)
    if not isinstance(app, OutboxApp):
        raise OutboxModelError(
            f"{name}: __outbox_app__ must be the OutboxApp that receives its rows, got {app!r}"
        )
    given = getattr(cls, "__outbox_category__", None)
    if given is None:
        raise OutboxModelError(
            f"{name}: declare __outbox_category__ = <category>, the category of its rows"
        )
    category = None
    if isinstance(given, int) and not isinstance(given, bool):
        category = app.category(given)
    if category is None:
        raise OutboxModelError(
            f"{name}: __outbox_category__ {given!r} is not registered in any scope of its app"
        )
    scope = app.scope_of(category)
    assert scope is not None  # every registered category has a scope
    try:
        table = app.table_spec(getattr(cls, "__outbox_table__", None))
    except RegistryError as exc:
        raise OutboxModelError(f"{name}: __outbox_table__: {exc}") from None
    if table.regional:
        raise OutboxModelError(
            f"{name}: table {table.name} is regional and needs one row per target region; "
            "write those rows with app.write(session, region=...) instead"
        )
    return _Declaration(
        app,
        category,
        table.name,
        _shard_attribute(mapper, cls, scope),
        _object_attribute(mapper, cls),
    )


def _declare(mapper: Mapper[Any], cls: type[Any]) -> None:
    _declarations[cls] = _resolve(mapper, cls)
    _listen_to_sessions()


# -- rows ----------------------------------------------------------------------------------------


def _describe(instance: Any) -> str:
    identity = sa_inspect(instance).identity
    if identity is None:
        return f"a new {type(instance).__name__}"
    key = identity[0] if len(identity) == 1 else identity
    return f"{type(instance).__name__} {key!r}"


def _declaration(instance: Any) -> _Declaration:
    state = sa_inspect(instance, raiseerr=False)
    declaration = None if state is None else _declarations.get(state.mapper.class_)
    if declaration is None:
        raise OutboxModelError(
            f"{type(instance).__name__} is not a mapped class declared with OutboxModel"
        )
    return declaration


def _identifier(instance: Any, attribute: str, what: str) -> int:
    value = getattr(instance, attribute)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OutboxModelError(
            f"cannot write the outbox row of {_describe(instance)}: its {what} ({attribute}) is "
            f"{value!r}, not an integer; set it before the flush"
        )
    return value


def _row_of(instance: Any, operation: Operation) -> _Row:
    declaration = _declaration(instance)
    return _Row(
        declaration,
        _identifier(instance, declaration.shard_attribute, "shard identifier"),
        _identifier(instance, declaration.object_attribute, "object identifier"),
        instance.outbox_payload(operation),
    )


def _write_row(session: Session, row: _Row) -> int:
    # With the Session itself, not its connection: outbox_context finds its rows through it.
    return row.declaration.app.write(
        session,
        category=row.declaration.category,
        shard_identifier=row.shard_identifier,
        object_identifier=row.object_identifier,
        payload=row.payload,
        table=row.declaration.table,
    )


# -- events --------------------------------------------------------------------------------------


def _note(instance: Any, operation: Operation, row: _Row | None = None) -> None:
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
    objects = list(instances)

    def write(sync_session: Session) -> list[int]:
        return write_outbox_rows(sync_session, objects, operation=operation)

    return await session.run_sync(write)


__all__ = [
    "Operation",
    "OutboxModel",
    "write_outbox_rows",
    "write_outbox_rows_async",
]
