"""outbox-bridge's pytest plugin: fixtures for an application's integration tests, with a
PostgreSQL database per test, a Temporal dev server and the app's worker running in-process.

pytest loads it in every run where outbox-bridge is installed (the ``pytest11`` entry point
``outbox_bridge``; ``-p no:outbox_bridge`` leaves it out). Loading it costs nothing: it declares
its ini options and fixtures, and imports the worker's side of the package (Temporal's client
and worker, the embedded servers) only when a test uses one of its fixtures; nothing starts
before that.

Fixtures (see the documentation's "Test your handlers" page):

- ``outbox_app`` (session): the app under test, from the ``outbox_app`` ini option
  (``module:attribute``); override the fixture to build it yourself.
- ``outbox_metadata`` (session): the tables every test database has (the app's).
- ``outbox_postgres`` (session): the PostgreSQL server, at ``OUTBOX_TEST_DATABASE_URL`` or the
  ``outbox_database_url`` ini option, else an embedded one.
- ``outbox_temporal`` (session): the Temporal server, at ``OUTBOX_TEST_TEMPORAL_ADDRESS`` or the
  ``outbox_temporal_address`` ini option, else a dev server in memory.
- ``outbox_database``: a database of the test's own, cloned from a template; dropped after it.
- ``outbox_session_database`` (session): one such database for the whole session.
- ``outbox_settings``: the settings of the test's worker (short timers, a task queue of its own).
- ``outbox_worker``: the app's worker on ``outbox_database``, running for the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from sqlalchemy import MetaData

    from outbox_bridge.config import OutboxSettings
    from outbox_bridge.registry import OutboxApp
    from outbox_bridge.testing.inprocess_worker import OutboxWorker
    from outbox_bridge.testing.servers import (
        DatabaseTemplate,
        EventLoopThread,
        OutboxDatabase,
        PostgresServer,
        TemporalServer,
    )

DATABASE_URL_ENV = "OUTBOX_TEST_DATABASE_URL"
TEMPORAL_ADDRESS_ENV = "OUTBOX_TEST_TEMPORAL_ADDRESS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "outbox_app",
        "outbox-bridge: the OutboxApp under test, as module:attribute (or override the "
        "outbox_app fixture)",
    )
    parser.addini(
        "outbox_database_url",
        f"outbox-bridge: a PostgreSQL server to create the test databases in (the environment's "
        f"{DATABASE_URL_ENV} comes first; default: an embedded server)",
    )
    parser.addini(
        "outbox_temporal_address",
        f"outbox-bridge: a Temporal server for the test workers (the environment's "
        f"{TEMPORAL_ADDRESS_ENV} comes first; default: a dev server in memory)",
    )


def _servers() -> ModuleType:
    # Imported when a fixture is used, not when pytest loads the plugin (see the module).
    from outbox_bridge.testing import servers

    return servers


def _worker() -> ModuleType:
    # Imported when a fixture is used, as _servers.
    from outbox_bridge.testing import inprocess_worker

    return inprocess_worker


def _setting(config: pytest.Config, env: str, ini: str) -> str | None:
    value = os.environ.get(env) or config.getini(ini)
    return str(value) if value else None


@pytest.fixture(scope="session")
def outbox_app(pytestconfig: pytest.Config) -> OutboxApp:
    """The app under test: the ``outbox_app`` ini option, as ``module:attribute``."""
    spec = pytestconfig.getini("outbox_app")
    if not spec:
        pytest.fail(
            "the outbox fixtures need the app under test: set `outbox_app = module:attribute` "
            "in pytest's configuration, or define an `outbox_app` fixture that returns it",
            pytrace=False,
        )
    app: OutboxApp = _servers().load_app(str(spec))
    return app


@pytest.fixture(scope="session")
def outbox_metadata(outbox_app: OutboxApp) -> Sequence[MetaData]:
    """The tables of every test database: the app's outbox tables. Override it to add your
    models' (``return [outbox_app.metadata, Base.metadata]``)."""
    return [outbox_app.metadata]


@pytest.fixture(scope="session")
def _outbox_loop() -> Iterator[EventLoopThread]:
    loop: EventLoopThread = _servers().EventLoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def outbox_postgres(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PostgresServer]:
    """The PostgreSQL server of the test databases (``.url``)."""
    url = _setting(pytestconfig, DATABASE_URL_ENV, "outbox_database_url")
    servers = _servers()
    server: PostgresServer = (
        servers.PostgresServer(url)
        if url is not None
        else servers.PostgresServer.embedded(tmp_path_factory.mktemp("outbox-postgres") / "data")
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def outbox_temporal(
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    _outbox_loop: EventLoopThread,
) -> Iterator[TemporalServer]:
    """The Temporal server of the test workers (``.address``)."""
    address = _setting(pytestconfig, TEMPORAL_ADDRESS_ENV, "outbox_temporal_address")
    servers = _servers()
    server: TemporalServer = (
        servers.TemporalServer(address)
        if address is not None
        else servers.TemporalServer.embedded(
            tmp_path_factory.mktemp("outbox-temporal"), _outbox_loop
        )
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _outbox_template(
    outbox_postgres: PostgresServer,
    outbox_metadata: Sequence[MetaData],
    _outbox_loop: EventLoopThread,
) -> Iterator[DatabaseTemplate]:
    template: DatabaseTemplate = _servers().DatabaseTemplate(
        outbox_postgres, outbox_metadata, _outbox_loop
    )
    yield template
    template.drop()


@pytest.fixture
def outbox_database(_outbox_template: DatabaseTemplate) -> Iterator[OutboxDatabase]:
    """A database of the test's own, with the tables of ``outbox_metadata`` (``.url``,
    ``.engine``); dropped when the test ends."""
    database = _outbox_template.clone()
    yield database
    database.drop()


@pytest.fixture(scope="session")
def outbox_session_database(_outbox_template: DatabaseTemplate) -> Iterator[OutboxDatabase]:
    """One database for the whole session: tests see each other's rows."""
    database = _outbox_template.clone()
    yield database
    database.drop()


@pytest.fixture
def outbox_settings() -> OutboxSettings:
    """The settings of the test's worker: short timers and a task queue of its own. Override
    it to change a setting (``return worker_settings(partitions=2)``)."""
    settings: OutboxSettings = _worker().worker_settings()
    return settings


@pytest.fixture
def outbox_worker(
    outbox_app: OutboxApp,
    outbox_database: OutboxDatabase,
    outbox_temporal: TemporalServer,
    outbox_settings: OutboxSettings,
    _outbox_loop: EventLoopThread,
) -> Iterator[OutboxWorker]:
    """The app's worker, running on ``outbox_database`` for the test (in a thread of its own),
    with ``wait_handled(row id or shard, timeout=...)``; stopped after the test, and its
    workflows terminated."""
    worker: OutboxWorker = _worker().OutboxWorker(
        outbox_app, outbox_database, outbox_temporal.address, _outbox_loop, outbox_settings
    )
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
