"""Outbox rows from Django models (:class:`OutboxModel`), written by ``post_save`` and
``post_delete`` receivers in the change's transaction, so ``QuerySet.delete()`` and cascades
write theirs too; :func:`write_outbox_rows` writes those of changes that send no signal. The
declaration is the SQLAlchemy mixin's (:mod:`outbox_bridge.declarations`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, ClassVar, get_args

from asgiref.sync import sync_to_async
from django.db import models, router, transaction
from django.db.models.signals import class_prepared, post_delete, post_save

from outbox_bridge.contrib.django.writes import write_row
from outbox_bridge.declarations import Declaration, ModelRow, Operation, declare, model_row
from outbox_bridge.errors import OutboxModelError
from outbox_bridge.registry import OutboxApp


class OutboxModel(models.Model):
    """An abstract model whose instances write an outbox row when they are saved or deleted.

    Declared like SQLAlchemy's :class:`~outbox_bridge.OutboxModel`, on the model or on an
    abstract base: ``__outbox_app__`` and ``__outbox_category__`` (required),
    ``__outbox_shard__`` (default: ``<scope>_id``, such as a foreign key named after the scope,
    else the primary key of the scope's own model), ``__outbox_object__`` (default: the
    integer primary key) and ``__outbox_table__`` (default: the app's first; not a regional
    one).

    Every ``save()`` writes a row (operation ``"insert"`` when it created the object, else
    ``"update"``: Django does not know whether anything changed), and so does every deleted
    object. Override :meth:`outbox_payload` to give the rows a payload.
    """

    __outbox_app__: ClassVar[OutboxApp]
    __outbox_category__: ClassVar[IntEnum]
    __outbox_shard__: ClassVar[str | None] = None
    __outbox_object__: ClassVar[str | None] = None
    __outbox_table__: ClassVar[str | None] = None

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Django's ``save()``, in ``transaction.atomic()`` on the database it writes to: the
        outbox row written after it commits with it (a save in autocommit included)."""
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using, savepoint=False):
            super().save(*args, **kwargs)

    def outbox_payload(self, operation: Operation) -> Any:
        """The payload of the row written for ``operation`` on this instance (``None``: none).

        Called after the change (``"insert"``, ``"update"``, ``"delete"``; a deleted instance
        still has its field values). Rows coalesce, so a handler sees only the newest payload
        of its group: carry what identifies the change, and read the current state from the
        database in the handler.
        """
        return None


# -- declaration ---------------------------------------------------------------------------------

# Each concrete OutboxModel class (proxies included), resolved once when it is defined.
_declarations: weakref.WeakKeyDictionary[type[Any], Declaration] = weakref.WeakKeyDictionary()


def _integer_primary_key(cls: type[models.Model]) -> str | None:
    """The attribute of an integer primary key (a one-to-one parent link counts as its
    target's type), or ``None``."""
    pk = cls._meta.pk
    field: Any = pk
    while field is not None and field.is_relation:
        field = field.target_field
    if pk is None or not isinstance(field, models.IntegerField):
        return None
    return str(pk.attname)


def _primary_key_columns(cls: type[models.Model]) -> str:
    pk = cls._meta.pk
    return "none" if pk is None else f"{pk.column} {pk.get_internal_type()}"


def _declare(sender: type[Any], **kwargs: Any) -> None:
    if not issubclass(sender, OutboxModel):
        return
    _declarations[sender] = declare(
        sender,
        primary_key=_integer_primary_key(sender),
        primary_key_columns=_primary_key_columns(sender),
    )
    uid = f"outbox_bridge.contrib.django:{sender.__module__}.{sender.__qualname__}"
    post_save.connect(_saved, sender=sender, weak=False, dispatch_uid=uid)
    post_delete.connect(_deleted, sender=sender, weak=False, dispatch_uid=uid)


class_prepared.connect(_declare, weak=False, dispatch_uid="outbox_bridge.contrib.django")


# -- rows ----------------------------------------------------------------------------------------


def _describe(instance: Any) -> str:
    key = getattr(instance, "pk", None)
    if key is None:
        return f"a new {type(instance).__name__}"
    return f"{type(instance).__name__} {key!r}"


def _row_of(instance: Any, operation: Operation) -> ModelRow:
    declaration = _declarations.get(type(instance))
    if declaration is None:
        raise OutboxModelError(
            f"{type(instance).__name__} is not a concrete model declared with OutboxModel"
        )
    return model_row(declaration, instance, operation, _describe, "before saving it")


def _write(row: ModelRow, using: str | None) -> int:
    return write_row(row.app, **row.fields, using=using)


def _saved(sender: type[Any], instance: Any, created: bool, using: str, **kwargs: Any) -> None:
    _write(_row_of(instance, "insert" if created else "update"), using)


def _deleted(sender: type[Any], instance: Any, using: str, **kwargs: Any) -> None:
    _write(_row_of(instance, "delete"), using)


# -- changes that send no signal -----------------------------------------------------------------


def _database(instance: Any, using: str | None) -> str:
    if using is not None:
        return using
    saved_in = instance._state.db
    if isinstance(saved_in, str):
        return saved_in
    return str(router.db_for_write(type(instance), instance=instance))


def write_outbox_rows(
    instances: Iterable[Any], *, operation: Operation = "update", using: str | None = None
) -> list[int]:
    """Write the outbox row of each :class:`OutboxModel` instance, as a ``save()`` or a
    ``delete()`` that did ``operation`` to it would have, and return the new rows' ids.

    For changes that send no signal and so write no row themselves: ``bulk_create()`` (on
    PostgreSQL it sets the primary keys), ``bulk_update()``, ``QuerySet.update()`` (read the
    objects first) and raw SQL. Inside the same ``transaction.atomic()``::

        with transaction.atomic():
            projects = list(Project.objects.select_for_update().filter(organization_id=4))
            Project.objects.filter(pk__in=[p.pk for p in projects]).update(archived=True)
            write_outbox_rows(projects)

    Each row goes to ``using``, else the database the instance was read from or saved to.
    Every row is checked before any is written. Never commits.
    """
    if operation not in get_args(Operation):
        raise ValueError(f"operation must be one of {get_args(Operation)}, got {operation!r}")
    rows = [(_row_of(instance, operation), _database(instance, using)) for instance in instances]
    return [_write(row, alias) for row, alias in rows]


async def write_outbox_rows_async(
    instances: Iterable[Any], *, operation: Operation = "update", using: str | None = None
) -> list[int]:
    """:func:`write_outbox_rows` for async code, with ``sync_to_async`` in one
    ``transaction.atomic()`` of its own (async code cannot hold one open: after
    ``abulk_create()``, the rows commit apart from the objects; for one transaction, do both in
    a sync function under ``atomic()``)."""
    objects = list(instances)
    aliases = sorted({_database(instance, using) for instance in objects})

    def write() -> list[int]:
        with contextlib.ExitStack() as transactions:
            for alias in aliases:
                transactions.enter_context(transaction.atomic(using=alias))
            return write_outbox_rows(objects, operation=operation, using=using)

    return await sync_to_async(write, thread_sensitive=True)()


__all__ = ["OutboxModel", "write_outbox_rows", "write_outbox_rows_async"]
