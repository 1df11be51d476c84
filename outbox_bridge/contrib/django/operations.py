"""Django migration operations that create and drop the outbox tables, with the statements of
``outbox-bridge init-db`` (:func:`outbox_bridge.db.migrations.create_statements`). The tables
are not Django models: the operations change no model state, and like ``RunSQL`` they run on a
database when the routers allow the migration's app there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.db import router
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.operations.base import Operation
from django.db.migrations.state import ProjectState

from outbox_bridge.contrib.django.conf import OutboxConfigurationError, load_app
from outbox_bridge.db.install import ddl_sql
from outbox_bridge.db.migrations import DDL, create_statements, drop_statements, upgrade_statements
from outbox_bridge.registry import OutboxApp


class _OutboxOperation(Operation):
    reduces_to_sql = True
    reversible = True
    atomic = True

    def __init__(
        self, app: str, tables: Sequence[str] | None = None, hints: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(app, str):
            raise TypeError(
                f"{type(self).__name__} takes the app as 'module:attribute' (a migration file "
                f"must be able to name it), got {type(app).__name__}"
            )
        if isinstance(tables, str):
            raise TypeError("tables must be a list of table names, not one string")
        self.app = app
        self.tables = list(tables) if tables is not None else None
        self.hints = hints or {}

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"app": self.app}
        if self.tables is not None:
            kwargs["tables"] = self.tables
        if self.hints:
            kwargs["hints"] = self.hints
        return (type(self).__qualname__, [], kwargs)

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        """No model state: the outbox tables are not Django models."""

    def outbox_app(self) -> OutboxApp:
        return load_app(self.app)

    creates: bool  # forwards (and drops them backwards)

    def _run(self, app_label: str, schema_editor: BaseDatabaseSchemaEditor, create: bool) -> None:
        self._execute(app_label, schema_editor, create_statements if create else drop_statements)

    def _execute(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        statements: Callable[..., list[DDL]],
    ) -> None:
        connection = schema_editor.connection
        if not router.allow_migrate(connection.alias, app_label, **self.hints):
            return
        if connection.vendor != "postgresql":
            raise OutboxConfigurationError(
                f"{type(self).__name__} needs PostgreSQL, and database {connection.alias!r} is "
                f"{connection.vendor}; keep the migration off it with a router (allow_migrate) "
                "or hints"
            )
        for statement in statements(self.outbox_app(), tables=self.tables):
            schema_editor.execute(ddl_sql(statement), params=None)

    def database_forwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        self._run(app_label, schema_editor, create=self.creates)

    def database_backwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        self._run(app_label, schema_editor, create=not self.creates)

    def describe(self) -> str:
        tables = ", ".join(self.tables) if self.tables is not None else f"every table of {self.app}"
        return f"{'Create' if self.creates else 'Drop'} the outbox tables ({tables})"

    @property
    def migration_name_fragment(self) -> str:
        return "create_outbox" if self.creates else "drop_outbox"


class CreateOutbox(_OutboxOperation):
    """Create the outbox tables of the app that ``app`` names (``"module:attribute"``): all of
    them, or those named in ``tables``. Backwards, drop them, and every row in them."""

    creates = True


class DropOutbox(_OutboxOperation):
    """Drop the outbox tables of ``app`` (all, or those named in ``tables``) and every row in
    them. Backwards, create them again, empty."""

    creates = False


class UpgradeOutbox(_OutboxOperation):
    """Bring the outbox tables of ``app`` (all, or those named in ``tables``), created by an
    earlier version, to the installed version's schema (the statements of
    :func:`outbox_bridge.db.migrations.upgrade_statements`: missing tables, columns, indexes,
    the NOTIFY trigger; each waits a few seconds at most for its lock). Add it in a migration
    after upgrading outbox-bridge, before the new workers start. Backwards, it does nothing:
    the columns stay."""

    creates = True

    def _run(self, app_label: str, schema_editor: BaseDatabaseSchemaEditor, create: bool) -> None:
        if create:
            self._execute(app_label, schema_editor, upgrade_statements)

    def describe(self) -> str:
        tables = ", ".join(self.tables) if self.tables is not None else f"every table of {self.app}"
        return f"Upgrade the outbox tables ({tables})"

    @property
    def migration_name_fragment(self) -> str:
        return "upgrade_outbox"


__all__ = ["CreateOutbox", "DropOutbox", "UpgradeOutbox"]
