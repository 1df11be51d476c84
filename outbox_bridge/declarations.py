"""The rules that turn a model class into the outbox rows of its instances, shared by
SQLAlchemy's :class:`~outbox_bridge.orm.OutboxModel` and Django's
(:mod:`outbox_bridge.contrib.django.models`), which only say what the ORM knows (the primary
key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

from outbox_bridge.errors import OutboxModelError, RegistryError
from outbox_bridge.registry import OutboxApp

Operation = Literal["insert", "update", "delete"]


@dataclass(frozen=True)
class Declaration:
    """What a model class writes: its app, category and table, and the attributes that hold
    the shard and object identifiers of an instance."""

    app: OutboxApp
    category: IntEnum
    table: str
    shard_attribute: str
    object_attribute: str


@dataclass(frozen=True)
class ModelRow:
    """The outbox row of one instance, checked: its app, and the keyword arguments that write
    it (``app.write``'s)."""

    app: OutboxApp
    fields: dict[str, Any]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


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


def _object_attribute(cls: type[Any], primary_key: str | None, primary_key_columns: str) -> str:
    declared = _declared_attribute(cls, "__outbox_object__")
    if declared is not None:
        return declared
    if primary_key is None:
        raise OutboxModelError(
            f"{cls.__name__}: the object identifier is the primary key, which must be one "
            f"integer column (it is {primary_key_columns}); declare __outbox_object__ = "
            "'<attribute>' naming an integer attribute"
        )
    return primary_key


def _shard_attribute(cls: type[Any], scope: IntEnum, primary_key: str | None) -> str:
    declared = _declared_attribute(cls, "__outbox_shard__")
    if declared is not None:
        return declared
    conventional = f"{scope.name.lower()}_id"
    if hasattr(cls, conventional):
        return conventional
    own = _camel(scope.name)
    if cls.__name__ == own and primary_key is not None:
        return primary_key
    raise OutboxModelError(
        f"{cls.__name__}: cannot infer the shard identifier of scope {scope.name}: it has no "
        f"attribute {conventional!r} and is not the {own} model; declare __outbox_shard__ = "
        f"'<attribute holding the {scope.name.lower()} id>'"
    )


def declare(cls: type[Any], *, primary_key: str | None, primary_key_columns: str) -> Declaration:
    """Resolve the outbox declaration of ``cls``, or raise :class:`OutboxModelError` saying
    what to declare. ``primary_key``: the attribute of a one-integer-column primary key, else
    None; ``primary_key_columns`` describes the primary key for the message that refuses it.
    """
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
    return Declaration(
        app,
        category,
        table.name,
        _shard_attribute(cls, scope, primary_key),
        _object_attribute(cls, primary_key, primary_key_columns),
    )


# Describes an instance for a message ("Project 4", "a new Project"): called only on refusal.
Describe = Callable[[Any], str]


def model_row(
    declaration: Declaration, instance: Any, operation: Operation, describe: Describe, when: str
) -> ModelRow:
    """The row of ``instance`` for ``operation``: its identifiers checked (else
    :class:`OutboxModelError` naming the instance and ``when`` the value must be set, such as
    "before the flush"), its payload from ``instance.outbox_payload(operation)``."""

    def identifier(attribute: str, what: str) -> int:
        value = getattr(instance, attribute)
        if isinstance(value, bool) or not isinstance(value, int):
            raise OutboxModelError(
                f"cannot write the outbox row of {describe(instance)}: its {what} ({attribute}) "
                f"is {value!r}, not an integer; set it {when}"
            )
        return value

    return ModelRow(
        declaration.app,
        {
            "category": declaration.category,
            "shard_identifier": identifier(declaration.shard_attribute, "shard identifier"),
            "object_identifier": identifier(declaration.object_attribute, "object identifier"),
            "payload": instance.outbox_payload(operation),
            "table": declaration.table,
        },
    )
