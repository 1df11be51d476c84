"""Real servers for an application's integration tests: a PostgreSQL server with a database per
test cloned from a template, a Temporal dev server, and the app's worker, running in-process.

The pytest plugin (:mod:`outbox_bridge.testing.plugin`) builds its fixtures from these; they
work without pytest too. Everything asynchronous runs in an :class:`EventLoopThread`, so that
the worker goes on running while a test blocks, and the tests' own event loops are left alone.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from pathlib import Path
from threading import Thread
from types import TracebackType
from typing import Any, TypeVar

from pydantic import SecretStr
from sqlalchemy import ColumnElement, Engine, MetaData, Table, and_, create_engine, func, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.config import OutboxSettings, sqlalchemy_url
from outbox_bridge.db.schema import create_outbox_tables
from outbox_bridge.db.store import shard_where
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port
from outbox_bridge.runtime.shards import parse_shard, shard_status
from outbox_bridge.runtime.temporal import connect
from outbox_bridge.runtime.worker import serve
from outbox_bridge.workflows.models import PartitionRef, ShardRef

T = TypeVar("T")


def load_app(spec: str) -> OutboxApp:
    """The :class:`~outbox_bridge.OutboxApp` named by ``module:attribute``."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"outbox_app {spec!r} is not module:attribute")
    app = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(app, OutboxApp):
        raise ConfigurationError(f"outbox_app {spec!r} is not an OutboxApp (got {app!r})")
    return app


class EventLoopThread:
    """An event loop running in a daemon thread of its own."""

    def __init__(self, name: str = "outbox-testing") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` in the loop and wait for its result."""
        return self.submit(coroutine).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.run(_cancel_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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


# -- the worker ------------------------------------------------------------------------------------


def worker_settings(**overrides: Any) -> OutboxSettings:
    """Settings for a worker under test: short retry, sweep and idle timers (a test sees a
    retry or a sweep within a second or two), a task queue of its own, no health endpoints.
    ``overrides`` are :class:`~outbox_bridge.OutboxSettings` fields."""
    values: dict[str, Any] = {
        "idle_timeout": 2.0,
        "initial_retry_interval": 0.2,
        "max_retry_interval": 1.0,
        "handler_timeout": 20.0,
        "heartbeat_timeout": 5.0,
        "poll_interval": 0.2,
        "sweep_interval": 1.5,
        "task_queue": f"outbox-test-{uuid.uuid4().hex[:8]}",
        "health_port": 0,
    }
    values.update(overrides)
    return OutboxSettings(**values)


class OutboxWorker:
    """The bridge and Temporal worker of ``app`` on ``database``, running in ``loop`` (as
    ``outbox-bridge worker`` would, in this process) between :meth:`start` and :meth:`stop`.

    Its ``settings`` carry the database URL and the Temporal address, so that the code under
    test can flush to it: ``app.configure_flush(worker.settings)``.
    """

    def __init__(
        self,
        app: OutboxApp,
        database: OutboxDatabase,
        temporal_address: str,
        loop: EventLoopThread,
        settings: OutboxSettings | None = None,
    ) -> None:
        self.app = app
        self.database = database
        self.loop = loop
        self.settings = (settings or worker_settings()).model_copy(
            update={
                "database_url": SecretStr(database.url),
                "temporal_address": temporal_address,
            }
        )
        self.client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    @property
    def task_queue(self) -> str:
        return self.settings.task_queue

    # -- running --------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> OutboxWorker:
        """Start the worker; returns once its bridge is ready (it found the tables and its
        first sweep ran)."""
        self.loop.run(self._start(timeout))
        return self

    async def _start(self, timeout: float) -> None:
        address = self.settings.temporal_address
        assert address is not None
        self.client = await connect(self.settings, address)
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._task = asyncio.create_task(
            serve(
                self.settings,
                self.app,
                stop=self._stop,
                database_url=self.database.url,
                temporal_address=address,
                ready=ready,
            ),
            name="outbox-worker",
        )
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait(
            [self._task, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if self._task.done():
            waiter.cancel()
            self._task.result()  # raises why the worker stopped
        if not ready.is_set():
            waiter.cancel()
            await self._stop_worker()
            raise TimeoutError(f"the worker did not become ready within {timeout:g} s")

    def stop(self) -> None:
        """Stop the worker, then terminate the workflows it left running (its shard and
        partition workflows), so that none is found by the next test's worker."""
        self.loop.run(self._stop_worker())

    async def _stop_worker(self) -> None:
        try:
            if self._stop is not None and self._task is not None:
                self._stop.set()
                await asyncio.wait_for(self._task, 60)
        finally:
            await self._terminate_workflows()

    async def _terminate_workflows(self) -> None:
        client = self.client
        if client is None:
            return
        regions = tuple(sorted(self.settings.regions)) if self.settings.regions else None
        known = [
            PartitionRef(table, n, self.settings.partitions, regions).workflow_id
            for table in self.app.tables
            for n in range(self.settings.partitions)
        ]
        query = f"ExecutionStatus = 'Running' AND TaskQueue = '{self.task_queue}'"
        quiet = 0
        deadline = time.monotonic() + 15
        while quiet < 2 and time.monotonic() < deadline:
            running = [execution.id async for execution in client.list_workflows(query)]
            for workflow_id in [*known, *running]:
                try:
                    await client.get_workflow_handle(workflow_id).terminate("the test is over")
                except RPCError:
                    pass  # not running (any more)
            known = []
            quiet = 0 if running else quiet + 1
            await asyncio.sleep(0.1)

    def __enter__(self) -> OutboxWorker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- waiting --------------------------------------------------------------------------------

    def wait_handled(
        self, target: int | str | None = None, *, table: str | None = None, timeout: float = 10.0
    ) -> None:
        """Wait until the worker has handled (deleted) rows of the database:

        - ``target`` an ``int``: the row with that id (of ``table``, the app's first table by
          default);
        - a ``str``: every row of that shard (``SCOPE:ID``, ``REGION:SCOPE:ID``) pending now;
        - ``None``: every row pending now (in ``table``, or in every table of the app).

        Raises ``AssertionError`` after ``timeout`` seconds, saying what is left and what the
        shard's workflow reports (a handler that keeps failing, a row not due yet), or at once
        if the worker stopped.
        """
        __tracebackhide__ = True
        waits = self._pending(target, table)
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            if self._task is None:
                raise RuntimeError("the worker is not running: call start() first")
            if self._task.done():
                raise AssertionError(f"the worker stopped: {self._stopped_because()}")
            with self.database.engine.connect() as conn:
                left = [
                    (table_, where)
                    for table_, where in waits
                    if conn.execute(select(select(table_.c.id).where(where).exists())).scalar()
                ]
            if not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(self._explain(target, left, timeout))
            time.sleep(pause)
            pause = min(pause * 1.5, 0.2)

    async def wait_handled_async(
        self, target: int | str | None = None, *, table: str | None = None, timeout: float = 10.0
    ) -> None:
        """:meth:`wait_handled`, without blocking the running event loop."""
        await asyncio.to_thread(self.wait_handled, target, table=table, timeout=timeout)

    def _pending(
        self, target: int | str | None, table: str | None
    ) -> list[tuple[Table, ColumnElement[bool]]]:
        """What to wait for: per table, the rows that must be gone."""
        app = self.app
        if isinstance(target, int) and not isinstance(target, bool):
            outbox = app.table(table)
            return [(outbox, outbox.c.id == target)]
        names = [app.table(table).name] if table is not None else list(app.tables)
        wanted: list[tuple[Table, ShardRef | None]] = []
        if target is None:
            wanted = [(app.table(name), None) for name in names]
        elif isinstance(target, str):
            for name in names:
                if (target.count(":") >= 2) == app.table_spec(name).regional:
                    wanted.append((app.table(name), parse_shard(target, app, table=name)))
            if not wanted:
                parse_shard(target, app, table=table)  # raises, saying which form is needed
        else:
            raise TypeError(f"wait_handled() takes a row id or a shard, not {target!r}")
        waits: list[tuple[Table, ColumnElement[bool]]] = []
        with self.database.engine.connect() as conn:
            for outbox, shard in wanted:
                where = shard_where(outbox, shard) if shard is not None else None
                highest = conn.execute(
                    select(func.max(outbox.c.id)).where(*([where] if where is not None else []))
                ).scalar()
                if highest is not None:
                    up_to = outbox.c.id <= highest
                    waits.append((outbox, and_(where, up_to) if where is not None else up_to))
        return waits

    def _stopped_because(self) -> str:
        assert self._task is not None
        if self._task.cancelled():
            return "cancelled"
        error = self._task.exception()
        return f"{type(error).__name__}: {error}" if error is not None else "it returned"

    def _explain(
        self,
        target: int | str | None,
        left: list[tuple[Table, ColumnElement[bool]]],
        timeout: float,
    ) -> str:
        what = {int: f"row {target}", str: f"shard {target}"}.get(type(target), "the rows")
        lines = [f"{what} not handled within {timeout:g} s"]
        with self.database.engine.connect() as conn:
            for outbox, where in left:
                columns = [
                    c for c in ("region", "shard_scope", "shard_identifier") if c in outbox.c
                ]
                query = (
                    select(*(outbox.c[c] for c in columns), func.count(), func.min(outbox.c.id))
                    .where(where)
                    .group_by(*(outbox.c[c] for c in columns))
                    .order_by(func.min(outbox.c.id))
                    .limit(5)
                )
                for found in conn.execute(query):
                    values = tuple(found)
                    region = values[0] if "region" in outbox.c else None
                    scope, ident, rows, first = values[-4:]
                    shard = ShardRef(outbox.name, scope, self.app.scope_name(scope), ident, region)
                    lines.append(
                        f"  shard {shard.key} of {outbox.name}: {rows} row(s) left from id "
                        f"{first}; {self._shard_state(shard)}"
                    )
        return "\n".join(lines)

    def _shard_state(self, shard: ShardRef) -> str:
        """What the shard's workflow says, if it has one."""
        if self.client is None:
            return "no Temporal client"
        try:
            status = self.loop.run(shard_status(self.client, shard), timeout=10)
        except RPCError:
            return "no workflow of its own (a partition drains it)"
        except Exception as exc:
            return f"its workflow did not answer ({type(exc).__name__}: {exc})"
        said = [f"its workflow is {status.state}"]
        if status.head is not None:
            said.append(
                f"head {status.head.summary} (ids {status.head.first_id}-{status.head.last_id})"
            )
        if status.last_error is not None:
            error = status.last_error
            said.append(
                f"last error after {status.attempts} attempt(s): "
                f"{error.error_type}: {error.message}".rstrip(": ")
            )
        if status.deferred_until:
            said.append(f"deferred until {status.deferred_until}")
        if status.skip is not None:
            said.append(f"skipped: {status.skip.reason}")
        return ", ".join(said)
