"""The pytest plugin of outbox_bridge.testing: its fixtures in this suite (on the suite's servers,
see tests/conftest.py), in a user's project that pytester runs with nothing but the plugin's
entry point and an ini option, and in examples/testing run as a project of its own."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.testing.inprocess_worker import OutboxWorker, worker_settings
from outbox_bridge.testing.plugin import DATABASE_URL_ENV, TEMPORAL_ADDRESS_ENV
from outbox_bridge.workflows.models import PartitionInput, PartitionRef
from tests.harness import Category, Recorder, make_app

ROOT = Path(__file__).resolve().parents[1]
RECORDER = Recorder()


@pytest.fixture(scope="session")
def outbox_app() -> OutboxApp:
    """The app of this module's tests (the plugin's other fixtures build on it)."""
    return make_app("plugin_outbox", RECORDER)


@pytest.fixture(autouse=True)
def _no_calls_yet() -> None:
    RECORDER.calls.clear()
    RECORDER.behaviour.clear()


@pytest.fixture(autouse=True)
def _a_project_without_django(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-django exports this suite's DJANGO_SETTINGS_MODULE; the users' projects run here
    are not Django projects and must not inherit it."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)


def test_a_row_through_the_real_worker(outbox_app, outbox_worker, outbox_database) -> None:
    with outbox_database.engine.begin() as conn:
        first = outbox_app.write(
            conn, category=Category.PROJECT_UPDATE, shard_identifier=1, object_identifier=10
        )
    outbox_worker.wait_handled(first, timeout=30)
    assert RECORDER.ids() == [first]

    with outbox_database.engine.begin() as conn:
        rows = [
            outbox_app.write(conn, category=category, shard_identifier=2, object_identifier=2)
            for category in (Category.ORGANIZATION_UPDATE, Category.MEMBER_UPDATE)
        ]
        later = outbox_app.write(
            conn, category=Category.USER_UPDATE, shard_identifier=3, object_identifier=3
        )
    outbox_worker.wait_handled("ORGANIZATION:2", timeout=30)
    # Shards run side by side: the order is the shard's own.
    assert [c.id for c in RECORDER.calls if c.shard == "1:2"] == rows
    outbox_worker.wait_handled(timeout=30)
    assert later in RECORDER.ids()


async def test_waiting_in_an_async_test(outbox_app, outbox_worker, outbox_database) -> None:
    with outbox_database.engine.begin() as conn:
        row = outbox_app.write(
            conn, category=Category.USER_UPDATE, shard_identifier=4, object_identifier=4
        )
    await outbox_worker.wait_handled_async(row, timeout=30)
    assert RECORDER.ids() == [row]


def test_a_shard_that_is_not_handled_is_explained(
    outbox_app, outbox_worker, outbox_database
) -> None:
    async def unavailable(message: OutboxMessage) -> None:
        raise ConnectionError("replica unavailable")

    RECORDER.behaviour[Category.PROJECT_UPDATE] = unavailable
    with outbox_database.engine.begin() as conn:
        blocked = outbox_app.write(
            conn, category=Category.PROJECT_UPDATE, shard_identifier=5, object_identifier=50
        )
        deferred = outbox_app.write(
            conn,
            category=Category.USER_UPDATE,
            shard_identifier=6,
            object_identifier=6,
            scheduled_for=timedelta(hours=1),
        )
    with pytest.raises(AssertionError) as raised:
        outbox_worker.wait_handled(blocked, timeout=5)
    message = str(raised.value)
    assert message.startswith(f"row {blocked} not handled within 5 s"), message
    assert "shard ORGANIZATION:5 of plugin_outbox: 1 row(s) left" in message, message
    assert "its workflow is blocked, head PROJECT_UPDATE object=50" in message, message
    assert "ConnectionError: replica unavailable" in message, message

    with pytest.raises(
        AssertionError, match=r"USER:6 .*its workflow is deferred, .*deferred until"
    ):
        outbox_worker.wait_handled(deferred, timeout=1)


def test_each_test_has_a_database_of_its_own(
    outbox_app, outbox_database, outbox_session_database
) -> None:
    """The previous tests left rows behind (a blocked and a deferred one) in theirs."""
    assert outbox_database.name != outbox_session_database.name
    for database in (outbox_database, outbox_session_database):
        with database.engine.connect() as conn:
            count = conn.execute(select(func.count()).select_from(outbox_app.table()))
            assert count.scalar_one() == 0


# -- a user's project -----------------------------------------------------------------------------

USER_APP = """
from enum import IntEnum

from outbox_bridge import OutboxApp, OutboxMessage


class Scope(IntEnum):
    ORGANIZATION = 1


class Category(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2


app = OutboxApp(
    scopes={Scope.ORGANIZATION: {Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE}},
    categories=[Category],
)
replicated: list[int] = []


@app.handler(Category.ORGANIZATION_UPDATE)
def replicate(message: OutboxMessage) -> None:
    replicated.append(message.object_identifier)


@app.handler(Category.PROJECT_UPDATE)
async def replicate_project(message: OutboxMessage) -> None:
    replicated.append(message.object_identifier)
"""

USER_TESTS = """
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox_bridge.testing import drain_outbox
from shop import Category, app, replicated


@pytest.fixture(autouse=True)
def nothing_replicated_yet():
    replicated.clear()


def test_a_handler_without_temporal(outbox_database):
    with Session(outbox_database.engine) as session:
        for _ in range(2):
            app.write(session, category=Category.ORGANIZATION_UPDATE, shard_identifier=1,
                      object_identifier=1)
        report = drain_outbox(app, session)
        session.rollback()
    assert replicated == [1] and report.coalesced == 1


def test_through_the_worker(outbox_worker, outbox_database):
    with outbox_database.engine.begin() as conn:
        row = app.write(conn, category=Category.ORGANIZATION_UPDATE, shard_identifier=2,
                        object_identifier=2)
    outbox_worker.wait_handled(row, timeout=30)
    assert replicated == [2]


@pytest.mark.asyncio
async def test_through_the_worker_in_an_async_test(outbox_worker, outbox_database):
    with outbox_database.engine.begin() as conn:
        app.write(conn, category=Category.PROJECT_UPDATE, shard_identifier=3,
                  object_identifier=30)
    await outbox_worker.wait_handled_async("ORGANIZATION:3", timeout=30)
    assert replicated == [30]


def test_the_database_is_the_tests_own(outbox_database):
    with outbox_database.engine.begin() as conn:
        app.write(conn, category=Category.PROJECT_UPDATE, shard_identifier=4,
                  object_identifier=40)
    with outbox_database.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(app.table())).scalar_one() == 1
"""


def test_a_users_project_runs_with_the_plugin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, servers
) -> None:
    """The entry point loads the plugin: the user's ini names the app, the environment the
    servers; the fixtures give each test its database and a worker."""
    pytester.makepyfile(shop=USER_APP, test_shop=USER_TESTS)
    pytester.makeini(
        """
        [pytest]
        outbox_app = shop:app
        pythonpath = .
        asyncio_default_fixture_loop_scope = function
        filterwarnings = error
        """
    )
    monkeypatch.setenv(DATABASE_URL_ENV, servers.database_url)
    monkeypatch.setenv(TEMPORAL_ADDRESS_ENV, servers.temporal_address)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=170)
    result.assert_outcomes(passed=4)


def test_without_the_app_the_fixtures_say_what_is_missing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_nothing="""
        def test_needs_the_app(outbox_app):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*set `outbox_app = module:attribute`*"])


def test_loading_the_plugin_loads_nothing_of_the_worker() -> None:
    """pytest loads the plugin in every run of a project that has outbox-bridge installed."""
    script = """
import json, sys
import outbox_bridge.testing.plugin
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("temporalio", "outbox_bridge.")))))
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["outbox_bridge.testing", "outbox_bridge.testing.plugin"]


USES_THE_EMBEDDED_SERVERS = """
from sqlalchemy import text


def test_embedded_servers(outbox_database, outbox_temporal):
    with outbox_database.engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
    assert outbox_temporal.address.startswith("127.0.0.1:")
"""


def test_without_servers_configured_the_plugin_starts_embedded_ones(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(shop=USER_APP, test_embedded=USES_THE_EMBEDDED_SERVERS)
    pytester.makeini("[pytest]\noutbox_app = shop:app\npythonpath = .\n")
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    monkeypatch.delenv(TEMPORAL_ADDRESS_ENV, raising=False)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=170)
    result.assert_outcomes(passed=1)


def test_the_testing_example_runs_as_a_users_project(tmp_path: Path, servers) -> None:
    """examples/testing, copied out of the repository, is a project of its own: its pytest
    finds the plugin through the installed package's entry point, the app through its
    configuration, and the servers through the environment."""
    project = tmp_path / "catalog"
    shutil.copytree(ROOT / "examples" / "testing", project)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.pop("PYTHONPATH", None)
    env[DATABASE_URL_ENV] = servers.database_url
    env[TEMPORAL_ADDRESS_ENV] = servers.temporal_address
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for test in (
        "test_handlers.py::test_changes_coalesce_and_a_deletion_removes PASSED",
        "test_histories.py::test_recorded_histories_replay PASSED",
        "test_worker.py::test_the_worker_indexes_a_saved_product PASSED",
    ):
        assert test in result.stdout, result.stdout
    assert "6 passed" in result.stdout, result.stdout


async def test_a_worker_ends_partitions_left_on_another_task_queue(
    outbox_app, outbox_database, outbox_temporal, _outbox_loop, client
) -> None:
    """Partition ids name the table, not the task queue: partitions that an earlier worker left
    running on a queue nobody polls would be found and kept by the next test's worker, and its
    rows never drained. The toolkit's worker ends them before it starts."""
    settings = worker_settings()
    for n in range(settings.partitions):
        ref = PartitionRef(next(iter(outbox_app.tables)), n, settings.partitions, None)
        await client.start_workflow(
            "OutboxPartition",
            PartitionInput(ref, settings.partition_options(frozenset())),
            id=ref.workflow_id,
            task_queue="nobody-polls-this",
        )
    worker = OutboxWorker(outbox_app, outbox_database, outbox_temporal.address, _outbox_loop)
    worker.start()
    try:
        with outbox_database.engine.begin() as conn:
            row = outbox_app.write(
                conn, category=Category.USER_UPDATE, shard_identifier=6, object_identifier=6
            )
        await asyncio.to_thread(worker.wait_handled, row, timeout=30)
    finally:
        await asyncio.to_thread(worker.stop)
    assert RECORDER.ids() == [row]
