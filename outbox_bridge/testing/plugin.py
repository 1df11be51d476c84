"""outbox-bridge's pytest plugin (the ``pytest11`` entry point ``outbox_bridge``): a PostgreSQL
database per test, a Temporal server and the app's worker in-process (see the testing page).

Loading it costs nothing: the worker's side of the package is imported only in fixtures. A test
that needs an embedded server that stopped fails before it starts, saying why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
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
        ServerFolder,
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


# -- servers that stopped --------------------------------------------------------------------------


@dataclass
class _Watch:
    fixture: str
    why_stopped: Callable[[], str | None]
    first_failure: str | None = None  # the test whose failure explained it


_WATCHES = pytest.StashKey[list[_Watch]]()


def watch_server(
    config: pytest.Config, fixture: str, why_stopped: Callable[[], str | None]
) -> None:
    """Before each test that uses ``fixture`` (directly or not), and after each such test that
    failed, ask ``why_stopped()`` whether its server stopped: the test then fails before it
    starts, or its report gets the answer (in full the first time, then naming that failure)."""
    config.stash.setdefault(_WATCHES, []).append(_Watch(fixture, why_stopped))


def _stopped(item: pytest.Item) -> list[tuple[_Watch, str]]:
    uses = set(getattr(item, "fixturenames", ()))
    watched = [w for w in item.config.stash.get(_WATCHES, []) if w.fixture in uses]
    return [(watch, why) for watch in watched if (why := watch.why_stopped()) is not None]


def _explain(item: pytest.Item, stopped: list[tuple[_Watch, str]]) -> str:
    lines = []
    for watch, why in stopped:
        if watch.first_failure is None:
            watch.first_failure = item.nodeid
            lines.append(why)
        else:
            first_line = why.splitlines()[0]
            lines.append(f"{first_line} (the failure of {watch.first_failure} says why)")
    return "\n\n".join(lines)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    stopped = _stopped(item)
    if stopped:
        pytest.fail(_explain(item, stopped), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when == "call":
        stopped = _stopped(item)
        if stopped:
            report.sections.append(("outbox-bridge: a server stopped", _explain(item, stopped)))
    return report


# -- fixtures --------------------------------------------------------------------------------------


def _setting(config: pytest.Config, env: str, ini: str) -> str | None:
    value = os.environ.get(env) or config.getini(ini)
    return str(value) if value else None


@pytest.fixture(scope="session")
def outbox_app(pytestconfig: pytest.Config) -> OutboxApp:
    """The app under test: the ``outbox_app`` ini option, as ``module:attribute``."""
    from outbox_bridge.testing.servers import load_app  # in fixtures: see the module

    spec = pytestconfig.getini("outbox_app")
    if not spec:
        pytest.fail(
            "the outbox fixtures need the app under test: set `outbox_app = module:attribute` "
            "in pytest's configuration, or define an `outbox_app` fixture that returns it",
            pytrace=False,
        )
    return load_app(str(spec))


@pytest.fixture(scope="session")
def outbox_metadata(outbox_app: OutboxApp) -> Sequence[MetaData]:
    """The tables of every test database: the app's outbox tables; override it to add yours."""
    return [outbox_app.metadata]


@pytest.fixture(scope="session")
def _outbox_loop() -> Iterator[EventLoopThread]:
    from outbox_bridge.testing.servers import EventLoopThread

    loop = EventLoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def _outbox_server_folder() -> Iterator[ServerFolder]:
    """Where the embedded servers keep their data (see the module)."""
    from outbox_bridge.testing.servers import ServerFolder

    folder = ServerFolder()
    yield folder
    folder.remove()


def _new_server_folder(request: pytest.FixtureRequest, name: str) -> Path:
    folder: ServerFolder = request.getfixturevalue("_outbox_server_folder")
    return folder.new(name)


@pytest.fixture(scope="session")
def outbox_postgres(
    pytestconfig: pytest.Config, request: pytest.FixtureRequest
) -> Iterator[PostgresServer]:
    """The PostgreSQL server of the test databases (``.url``)."""
    from outbox_bridge.testing.servers import PostgresServer

    url = _setting(pytestconfig, DATABASE_URL_ENV, "outbox_database_url")
    if url is not None:
        server = PostgresServer(url)
    else:
        server = PostgresServer.embedded(_new_server_folder(request, "postgres") / "data")
        watch_server(pytestconfig, "outbox_postgres", server.why_stopped)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def outbox_temporal(
    pytestconfig: pytest.Config, request: pytest.FixtureRequest, _outbox_loop: EventLoopThread
) -> Iterator[TemporalServer]:
    """The Temporal server of the test workers (``.address``)."""
    from outbox_bridge.testing.servers import TemporalServer

    address = _setting(pytestconfig, TEMPORAL_ADDRESS_ENV, "outbox_temporal_address")
    if address is not None:
        server = TemporalServer(address)
    else:
        folder = _new_server_folder(request, "temporal")
        server = TemporalServer.embedded(folder, _outbox_loop)
        watch_server(pytestconfig, "outbox_temporal", server.why_stopped)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _outbox_template(
    outbox_postgres: PostgresServer,
    outbox_metadata: Sequence[MetaData],
    _outbox_loop: EventLoopThread,
) -> Iterator[DatabaseTemplate]:
    from outbox_bridge.testing.servers import DatabaseTemplate

    template = DatabaseTemplate(outbox_postgres, outbox_metadata, _outbox_loop)
    yield template
    template.drop()


@pytest.fixture
def outbox_database(_outbox_template: DatabaseTemplate) -> Iterator[OutboxDatabase]:
    """A database of the test's own with the tables of ``outbox_metadata``, dropped after it."""
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
    """The settings of the test's worker (:func:`worker_settings`); override it to change one."""
    from outbox_bridge.testing.inprocess_worker import worker_settings

    return worker_settings()


@pytest.fixture
def outbox_worker(
    outbox_app: OutboxApp,
    outbox_database: OutboxDatabase,
    outbox_temporal: TemporalServer,
    outbox_settings: OutboxSettings,
    _outbox_loop: EventLoopThread,
) -> Iterator[OutboxWorker]:
    """The app's worker on ``outbox_database``, in a thread of its own; stopped after the test,
    and its workflows terminated."""
    from outbox_bridge.testing.inprocess_worker import OutboxWorker

    worker = OutboxWorker(
        outbox_app, outbox_database, outbox_temporal.address, _outbox_loop, outbox_settings
    )
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
