"""Real servers behind the pytest plugin's fixtures: PostgreSQL with a database per test cloned
from a template, and a Temporal dev server. Asynchronous work runs in an
:class:`EventLoopThread`: the worker goes on while a test blocks, and tests' loops are left alone.
"""

from __future__ import annotations

import os
import stat
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Engine, MetaData, create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from outbox_bridge import registry
from outbox_bridge.config import sqlalchemy_url
from outbox_bridge.db.install import create_outbox_tables
from outbox_bridge.dev.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.loop_thread import EventLoopThread as EventLoopThread  # re-exported
from outbox_bridge.testing.server_folder import ServerFolder as ServerFolder  # re-exported

if sys.platform != "win32":
    import pwd

LOG_TAIL_LINES = 20  # of a server's log, in a report of its death


def load_app(spec: str) -> OutboxApp:
    """The :class:`~outbox_bridge.OutboxApp` named by ``module:attribute``."""
    return registry.load_app(spec, given_as="outbox_app", error=ConfigurationError)


# -- PostgreSQL ------------------------------------------------------------------------------------


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class PostgresServer:
    """The PostgreSQL server that test databases are created in, at ``url`` (its role needs
    ``CREATEDB``), or an embedded one (:meth:`embedded`, stopped by :meth:`stop`)."""

    def __init__(self, url: str, *, embedded: EmbeddedPostgres | None = None) -> None:
        self._embedded = embedded
        self._pid = None if embedded is None else _postmaster_pid(embedded.data_dir)
        self.url = sqlalchemy_url(url)
        self._admin = create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=NullPool)

    @classmethod
    def embedded(cls, data_dir: Path) -> PostgresServer:
        """Start a PostgreSQL server with its data in ``data_dir`` (the ``embedded`` extra)."""
        server = EmbeddedPostgres(data_dir)
        return cls(server.start(), embedded=server)

    def why_stopped(self) -> str | None:
        """None while it runs (or is not embedded); else that it stopped (the first line), the
        end of its log, and the likely cause when it could not reach its files."""
        if self._embedded is None or self._pid is None or _running(self._pid):
            return None
        data_dir = self._embedded.data_dir
        log_file = data_dir / "log"
        tail = log_tail(log_file)
        why = (
            f"the embedded PostgreSQL with its data in {data_dir} has stopped\n"
            f"the end of its log ({log_file}):\n{tail}"
        )
        if "Permission denied" in tail:
            why += "\n" + _permission_cause(data_dir)
        return why

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
        embedded, self._embedded = self._embedded, None
        if embedded is None:
            return
        died = self._pid is not None and not _running(self._pid)
        try:
            embedded.stop()
        except Exception:
            if not died:  # a server that died has nothing left to stop
                raise


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

    def dispose(self) -> None:
        """Close the connections of ``engine``, if it was made."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def drop(self) -> None:
        self.dispose()
        self.server.drop_database(self.name)


class DatabaseTemplate:
    """A database holding the tables of ``metadata`` from which :meth:`clone` makes a database
    per test (a copy of a few empty tables takes milliseconds)."""

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
    (:meth:`embedded`, stopped by :meth:`stop`)."""

    def __init__(self, address: str, *, embedded: EmbeddedTemporal | None = None) -> None:
        self.address = address
        self._embedded = embedded

    @classmethod
    def embedded(cls, data_dir: Path, loop: EventLoopThread) -> TemporalServer:
        """Start a dev server (the ``embedded`` extra) in memory, on a free port; its log and
        pid file go to ``data_dir``."""
        server = EmbeddedTemporal(data_dir, port=free_port(), ui_port=None, in_memory=True)
        return cls(loop.run(server.start()), embedded=server)

    def why_stopped(self) -> str | None:
        """None while it runs (or is not embedded); else its exit code (the first line) and the
        end of its log."""
        if self._embedded is None or (code := self._embedded.exit_code()) is None:
            return None
        log_file = self._embedded.data_dir / "temporal.log"
        return (
            f"the Temporal dev server at {self.address} has exited with code {code}\n"
            f"the end of its log ({log_file}):\n{log_tail(log_file)}"
        )

    def stop(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None


# -- why a server stopped --------------------------------------------------------------------------


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the log file ``path``, indented."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"    (unreadable: {exc})"
    return "\n".join(f"    {line}" for line in text.splitlines()[-lines:]) or "    (empty)"


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    import psutil  # the embedded extra, which started the server

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _permission_cause(data_dir: Path) -> str:
    """The likely cause of a server that could not open its own files."""
    advice = (
        "Every new pytest session resets pytest's temporary folder (pytest-of-<user>) to mode "
        "0700: keep the servers' data out of it, in a folder no other session changes (as "
        "outbox-bridge's fixtures do, under the system's temporary directory)."
    )
    server_uid = data_dir.stat().st_uid
    if sys.platform == "win32" or server_uid == os.getuid():
        return f"Likely cause: it lost access to its files. {advice}"
    user = pwd.getpwuid(server_uid).pw_name
    for folder in reversed(data_dir.parents):  # from the root down
        mode = folder.stat().st_mode
        if folder.stat().st_uid != server_uid and not mode & stat.S_IXOTH:
            return (
                f"Likely cause: the server runs as the system user {user!r}, and {folder} "
                f"(mode {stat.S_IMODE(mode):04o}) no longer lets other users in. {advice}"
            )
    return (
        f"Likely cause: the server runs as the system user {user!r}, and a folder above "
        f"{data_dir} did not let it in when it needed its files. {advice}"
    )
