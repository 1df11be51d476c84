"""Real servers for an application's integration tests: a PostgreSQL server with a database per
test cloned from a template, and a Temporal dev server (the app's worker is in
:mod:`outbox_bridge.testing.inprocess_worker`).

The pytest plugin (:mod:`outbox_bridge.testing.plugin`) builds its fixtures from these; they
work without pytest too. Everything asynchronous runs in an :class:`EventLoopThread`, so that
the worker goes on running while a test blocks, and the tests' own event loops are left alone.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Engine, MetaData, create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from outbox_bridge.config import sqlalchemy_url
from outbox_bridge.db.schema import create_outbox_tables
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port
from outbox_bridge.runtime.loop_thread import EventLoopThread as EventLoopThread  # re-exported


def load_app(spec: str) -> OutboxApp:
    """The :class:`~outbox_bridge.OutboxApp` named by ``module:attribute``."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"outbox_app {spec!r} is not module:attribute")
    app = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(app, OutboxApp):
        raise ConfigurationError(f"outbox_app {spec!r} is not an OutboxApp (got {app!r})")
    return app


# -- PostgreSQL ------------------------------------------------------------------------------------


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class PostgresServer:
    """The PostgreSQL server that test databases are created in, at ``url`` (its role needs
    the ``CREATEDB`` privilege), or an embedded one (:meth:`embedded`); :meth:`stop` stops an
    embedded server."""

    def __init__(self, url: str, *, embedded: EmbeddedPostgres | None = None) -> None:
        self._embedded = embedded
        self.url = sqlalchemy_url(url)
        self._admin = create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=NullPool)

    @classmethod
    def embedded(cls, data_dir: Path) -> PostgresServer:
        """Start a PostgreSQL server with its data in ``data_dir`` (the ``embedded`` extra)."""
        server = EmbeddedPostgres(data_dir)
        return cls(server.start(), embedded=server)

    def database_url(self, name: str) -> str:
        """The SQLAlchemy URL of database ``name`` on this server, password included."""
        return self.url.set(database=name).render_as_string(hide_password=False)

    def create_database(self, name: str, *, template: str | None = None) -> None:
        statement = f"CREATE DATABASE {_quoted(name)}"
        if template is not None:
            statement += f" TEMPLATE {_quoted(template)}"
        with self._admin.connect() as conn:
            conn.exec_driver_sql(statement)

    def drop_database(self, name: str) -> None:
        """Drop database ``name``, closing whatever connections are left on it."""
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)")

    def stop(self) -> None:
        self._admin.dispose()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None


class OutboxDatabase:
    """A test database: its ``name``, its SQLAlchemy ``url`` (for ``create_engine`` and
    ``create_async_engine`` alike), and a sync ``engine`` on it, made on first use."""

    def __init__(self, server: PostgresServer, name: str) -> None:
        self.server = server
        self.name = name
        self.url = server.database_url(name)
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = create_engine(self.url)
        return self._engine

    def drop(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        self.server.drop_database(self.name)


class DatabaseTemplate:
    """A database holding the tables of ``metadata`` (the outbox tables and their NOTIFY
    triggers for an app's metadata), from which :meth:`clone` makes a database per test: a
    copy of a few empty tables takes milliseconds."""

    def __init__(
        self, server: PostgresServer, metadata: Sequence[MetaData], loop: EventLoopThread
    ) -> None:
        self.server = server
        self.name = f"outbox_template_{uuid.uuid4().hex[:12]}"
        server.create_database(self.name)
        try:
            loop.run(_create_tables(server.database_url(self.name), metadata))
        except BaseException:
            server.drop_database(self.name)
            raise

    def clone(self) -> OutboxDatabase:
        name = f"outbox_test_{uuid.uuid4().hex[:12]}"
        self.server.create_database(name, template=self.name)
        return OutboxDatabase(self.server, name)

    def drop(self) -> None:
        self.server.drop_database(self.name)


async def _create_tables(url: str, metadata: Sequence[MetaData]) -> None:
    # No pool: a template database must have no connection left when it is copied.
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            for each in dict.fromkeys(metadata):  # each once, in order
                await create_outbox_tables(conn, each)
    finally:
        await engine.dispose()


# -- Temporal --------------------------------------------------------------------------------------


class TemporalServer:
    """The Temporal server of the test workers, at ``address``, or a dev server in memory
    (:meth:`embedded`); :meth:`stop` stops a dev server."""

    def __init__(self, address: str, *, embedded: EmbeddedTemporal | None = None) -> None:
        self.address = address
        self._embedded = embedded

    @classmethod
    def embedded(cls, data_dir: Path, loop: EventLoopThread) -> TemporalServer:
        """Start a dev server (the ``embedded`` extra) in memory, on a free port; its log and
        pid file go to ``data_dir``."""
        server = EmbeddedTemporal(data_dir, port=free_port(), ui_port=None, in_memory=True)
        return cls(loop.run(server.start()), embedded=server)

    def stop(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
