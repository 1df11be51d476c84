"""Fixtures of the fault suite, and its summary table.

Every scenario has a fast variant, run by default, and a full one, marked ``faults``: the full
ones (and the slowest fast ones) run only when asked for with ``pytest -m faults`` (or any
``-m`` expression that names the marker; tests/conftest.py leaves them out otherwise). The figures of every scenario that ran are printed at
the end (tests/conftest.py: also from the test processes of pytest-xdist).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge.dev.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port
from tests.faults.harness import FIGURES, Figures, WorkerProcess, with_password
from tests.faults.scenario import Scenario
from tests.harness import Servers


@pytest.fixture(autouse=True)
def kill_leftover_workers() -> Iterator[None]:
    """Kill the workers a test left running, and fail the test if one of its workers logged
    an unexpected exception (those that Scenario.finish checked already are not reported
    twice)."""
    yield
    try:
        WorkerProcess.check_outputs()
    finally:
        WorkerProcess.kill_leftovers()


@pytest.fixture
def record_figures(request: pytest.FixtureRequest) -> Callable[[Figures], None]:
    def record(figures: Figures) -> None:
        request.config.stash.setdefault(FIGURES, []).append(figures)

    return record


@pytest.fixture
async def fault_temporal(tmp_path: Path) -> AsyncIterator[EmbeddedTemporal]:
    """A Temporal dev server of this test alone, on a database file (it can be killed and
    restarted without losing anything)."""
    temporal = EmbeddedTemporal(tmp_path / "temporal", port=free_port(), ui_port=None)
    await temporal.start(timeout=60)
    try:
        yield temporal
    finally:
        temporal.kill()  # its file is thrown away: no need to wait for a clean shutdown


@pytest.fixture
async def fault_client(fault_temporal: EmbeddedTemporal) -> Client:
    return await Client.connect(fault_temporal.address)


@pytest.fixture
def fault_database(servers: Servers) -> tuple[str, str]:
    """The session's database URL with a password to look for in outputs, and the password."""
    return with_password(servers.database_url)


@pytest.fixture
def own_postgres(server_dir: Path) -> Iterator[tuple[EmbeddedPostgres, str]]:
    """A PostgreSQL of this test alone, which it may stop and start again."""
    postgres = EmbeddedPostgres(server_dir / "pg")
    url = postgres.start()
    try:
        yield postgres, url
    finally:
        postgres.stop()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


class NewScenario(Protocol):
    def __call__(
        self,
        name: str,
        *,
        engine: AsyncEngine | None = None,
        database: tuple[str, str] | None = None,
    ) -> Scenario: ...


@pytest.fixture
def new_scenario(
    engine: AsyncEngine,
    fault_database: tuple[str, str],
    fault_temporal: EmbeddedTemporal,
    logs: Path,
) -> NewScenario:
    """A scenario of this test named ``name``: on the session's database, or on ``engine``
    and ``database`` (its URL and password: a PostgreSQL of the test's own)."""

    def new(
        name: str,
        *,
        engine: AsyncEngine | None = None,
        database: tuple[str, str] | None = None,
    ) -> Scenario:
        url, password = database or fault_database
        return Scenario(name, engine or session_engine, url, password, fault_temporal.address, logs)

    session_engine = engine
    return new
