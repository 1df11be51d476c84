from __future__ import annotations

import asyncio
import dataclasses
import logging
import warnings
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge.testing import PostgresServer, TemporalServer
from outbox_bridge.testing.plugin import watch_server
from outbox_bridge.testing.server_folder import ServerFolder
from outbox_bridge.testing.servers import log_tail
from tests.django_support import point_django_at
from tests.faults.harness import FIGURES, Figures, summary_lines
from tests.harness import (
    ServerRestartWarning,
    Servers,
    connect_client,
    new_engine,
    start_servers,
)

# tests/slots.py: a test of any tier but ``unit`` waits for one of the machine's test slots.
# tests/cpu.py: with OUTBOX_TEST_CPU set, the CPU each test used.
# tests/mypy_early.py: mypy starts once the tests are collected, beside them.
pytest_plugins = ["pytester", "tests.slots", "tests.cpu", "tests.mypy_early"]

# A test that provokes an ERROR record of the library on purpose says so with this marker;
# any other ERROR record of an ``outbox_bridge`` logger fails the test that was running.
ERROR_LOGS_MARKER = "logs_errors"


# -- tiers ----------------------------------------------------------------------------------------
#
# Every test belongs to one tier, a marker of its own (CONTRIBUTING.md says how to run each):
# ``unit`` needs no server; ``workflow`` runs the workflows on the time-skipping test server
# (tests/workflows); ``integration`` needs the real PostgreSQL and Temporal dev server;
# ``histories`` replays the recorded histories; ``faults`` are the full-size fault scenarios
# (opt-in, see tests/faults/conftest.py). A test's tier is the marker it carries, or else follows
# from its folder, its file and the fixtures it requests.

TIERS = ("unit", "workflow", "integration", "histories", "faults")
# Fixtures that start (or need) the real servers.
SERVER_FIXTURES = frozenset(
    {
        "servers",
        "engine",
        "client",
        "sync_engine",
        "fault_database",
        "fault_temporal",
        "fault_client",
        "own_postgres",
        "own_temporal",
        "server_dir",
        # pytest-django's, on the test PostgreSQL
        "django_db_setup",
        "db",
        "transactional_db",
    }
)
WORKFLOW_FIXTURES = frozenset({"time_skipping", "wf"})
HISTORY_FILES = frozenset({"test_replay.py"})
# Files whose tests all reach a server through a fixture no test names (a module's usefixtures).
INTEGRATION_FILES = frozenset({"test_django_models.py"})


def tier_of(item: pytest.Item) -> str:
    for marker in item.iter_markers():
        if marker.name in TIERS:
            return marker.name
    path = Path(item.path)
    fixtures = set(getattr(item, "fixturenames", ()))
    if "workflows" in path.parts or fixtures & WORKFLOW_FIXTURES:
        return "workflow"
    if path.name in HISTORY_FILES:
        return "histories"
    if "faults" in path.parts or path.name in INTEGRATION_FILES or fixtures & SERVER_FIXTURES:
        return "integration"
    # A Django test's database is on the test PostgreSQL (pytest-django asks for it when the test
    # starts); a pytest session of the test's own may start servers in its process.
    if item.get_closest_marker("django_db") is not None or "pytester" in fixtures:
        return "integration"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    # The ``faults`` tier (the full fault scenarios, the full exit loops) runs only when an -m
    # expression names it.
    if "faults" not in (config.option.markexpr or ""):
        full = [item for item in items if item.get_closest_marker("faults")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("faults")]


class _ErrorRecords(logging.Handler):
    """Keeps the records of level ERROR and above that reach it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _describe(record: logging.LogRecord) -> str:
    line = f"{record.levelname} {record.name}: {record.getMessage()}"
    if record.exc_info and record.exc_info[1] is not None:
        error = record.exc_info[1]
        line += f" [{type(error).__qualname__}: {error}]"
    return line


@pytest.fixture(autouse=True)
def no_library_error_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test when the library logged an error while it ran: an unexpected exception
    that the code survived (a bridge restart, say) would otherwise pass unnoticed, because the
    sweeps repair whatever it left behind."""
    records = _ErrorRecords()
    library = logging.getLogger("outbox_bridge")
    library.addHandler(records)
    try:
        yield
    finally:
        library.removeHandler(records)
    if records.records and request.node.get_closest_marker(ERROR_LOGS_MARKER) is None:
        lines = "\n".join(_describe(r) for r in records.records[:10])
        pytest.fail(
            f"the library logged {len(records.records)} error record(s) during the test "
            f"(mark it {ERROR_LOGS_MARKER} if that is its point):\n{lines}",
            pytrace=False,
        )


@pytest.fixture(scope="module", autouse=True)
def no_telemetry_left_installed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a module that leaves an OpenTelemetry provider installed: tracing or metrics would
    stay on for every later file, and results would depend on the order of the files (see
    tests/otel.py)."""
    from tests.otel import installed_providers

    before = installed_providers()
    yield
    left = [p for p in installed_providers() if p not in before]
    if left:
        pytest.fail(
            f"{request.node.nodeid} left the {' and '.join(left)} provider(s) installed",
            pytrace=False,
        )


# The servers this process started for the session (one set per xdist worker).
SESSION_SERVERS: list[Servers] = []
LOG_TAIL_LINES = 30


@pytest.fixture(scope="session")
def server_folder() -> Iterator[ServerFolder]:
    """Where the servers of this session (of this pytest-xdist process) keep their data: a
    folder of its own under the system's temporary directory. Not pytest's temporary directory,
    which a new pytest session resets to mode 0700, cutting the embedded PostgreSQL (which runs
    as a system user of its own under root) off from its files."""
    folder = ServerFolder()
    yield folder
    folder.remove()


@pytest.fixture
def server_dir(server_folder: ServerFolder) -> Path:
    """A new folder for the data of a server that a test starts for itself."""
    return server_folder.new("own")


@pytest.fixture(scope="session")
async def servers(
    server_folder: ServerFolder, pytestconfig: pytest.Config
) -> AsyncIterator[Servers]:
    started = await start_servers(server_folder.new("servers"))
    if started.postgres is not None:
        # A test that needs it fails first thing, saying why, once it stopped.
        watch_server(pytestconfig, "servers", started.postgres.why_stopped)
    SESSION_SERVERS.append(started)
    try:
        yield started
    finally:
        SESSION_SERVERS.remove(started)
        started.temporal.stop()
        if started.postgres is not None:
            started.postgres.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """If the session's Temporal dev server has exited, say so with the end of its log (in the
    warnings summary: the test that was running when it died has failed on its own) and start
    it again on the same address, so that one dead server does not fail every later test."""
    for started in SESSION_SERVERS:
        temporal = started.temporal
        code = temporal.exit_code()
        if code is None:
            continue
        log_file = temporal.data_dir / "temporal.log"
        tail = log_tail(log_file, LOG_TAIL_LINES)
        with ThreadPoolExecutor(1) as pool:  # outside the session's event loop
            pool.submit(asyncio.run, temporal.start(timeout=60)).result()
        warnings.warn(
            ServerRestartWarning(
                f"the session's Temporal dev server at {started.temporal_address} had exited "
                f"with code {code} before {item.nodeid}; it was started again. The end of its "
                f"log ({log_file}):\n{tail}"
            ),
            stacklevel=1,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist test process: hand the fault scenarios' figures to the main one."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        figures = session.config.stash.get(FIGURES, [])
        workeroutput["fault_figures"] = [dataclasses.asdict(f) for f in figures]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's hook, in the main process: a test process ended with its figures."""
    figures = getattr(node, "workeroutput", {}).get("fault_figures", [])
    node.config.stash.setdefault(FIGURES, []).extend(Figures(**f) for f in figures)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault summary table: a line per fault scenario that ran (tests/faults)."""
    figures = terminalreporter.config.stash.get(FIGURES, [])
    if figures:
        terminalreporter.section("fault scenarios")
        for line in summary_lines(figures):
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(servers: Servers) -> None:
    """pytest-django creates the Django tests' databases on the test PostgreSQL."""
    point_django_at(servers)


@pytest.fixture(scope="session")
async def engine(servers: Servers) -> AsyncIterator[AsyncEngine]:
    eng = new_engine(servers)
    yield eng
    await eng.dispose()


@pytest.fixture(scope="session")
async def client(servers: Servers) -> Client:
    return await connect_client(servers)


# The fixtures of outbox-bridge's pytest plugin (outbox_bridge.testing.plugin) use the suite's
# servers rather than starting their own.


@pytest.fixture(scope="session")
def outbox_postgres(servers: Servers) -> Iterator[PostgresServer]:
    server = PostgresServer(servers.database_url)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def outbox_temporal(servers: Servers) -> TemporalServer:
    return TemporalServer(servers.temporal_address)


@pytest.fixture(scope="session")
def sync_engine(servers: Servers) -> Iterator[Engine]:
    """A synchronous engine on the test database, for sync sessions and connections."""
    eng = create_engine(servers.database_url)
    yield eng
    eng.dispose()
