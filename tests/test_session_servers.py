"""A test session's embedded servers run beside other pytest sessions: their data lives in a
folder of the session's own, outside pytest's temporary directory (which every new pytest
session of the user resets to mode 0700); a session killed midway leaves nothing running for
long; and when a session's server stops, the first failure says why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from outbox_bridge.dev.embedded import EmbeddedTemporal
from outbox_bridge.testing.server_folder import OWNER_FILE, PREFIX, ServerFolder
from tests.harness import Servers
from tests.support import ROOT

ANOTHER_PROJECT = """
def test_uses_pytests_temporary_directory(tmp_path):
    assert tmp_path.is_dir()
"""


def pytest_env() -> dict[str, str]:
    """This environment without pytest's and pytest-django's settings."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "DJANGO_SETTINGS_MODULE"))
    }


async def test_a_pytest_of_another_project_leaves_the_session_servers_running(
    servers: Servers, engine: AsyncEngine, client: Client, tmp_path: Path
) -> None:
    """Another project's pytest, started while this session's servers run, resets pytest's
    temporary directory of this user to mode 0700: the servers keep answering, also once
    PostgreSQL writes its control file (a checkpoint), which it could not reach any more when
    its data was there."""
    project = tmp_path / "another"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_another.py").write_text(ANOTHER_PROJECT)
    other = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"],
        cwd=project,
        env=pytest_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stdout + other.stderr
    async with engine.connect() as conn:
        if servers.postgres is not None:  # the embedded one: a superuser
            await conn.execute(text("CHECKPOINT"))
    async with engine.connect() as conn:  # a new connection: the server still accepts them
        assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
    await client.workflow_service.get_system_info(GetSystemInfoRequest())
    if servers.postgres is not None:
        assert servers.postgres.why_stopped() is None


# -- the plugin's embedded servers -----------------------------------------------------------------

KILLED_MIDWAY = """
import json, time
from pathlib import Path

import psutil
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


def data_dir(server):
    return Path(make_url(server.url).query["host"])


def postmaster(server):
    return psutil.Process(int((data_dir(server) / "postmaster.pid").read_text().split()[0]))


def wait_stopped(process):
    deadline = time.monotonic() + 60
    while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.05)


def test_the_server_runs_outside_pytests_temporary_directory(outbox_postgres, tmp_path):
    print("DATA", json.dumps({"data": str(data_dir(outbox_postgres)), "tmp": str(tmp_path)}))
    with create_engine(outbox_postgres.url).connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar_one() == 1


def test_the_server_stops(outbox_postgres):
    process = postmaster(outbox_postgres)
    try:
        {how}
    finally:
        wait_stopped(process)


def test_needs_the_server(outbox_postgres):
    pass


def test_needs_it_too(outbox_postgres):
    pass


def test_needs_no_server():
    pass
"""

KILL = "process.kill()"
# What a new pytest session did to an embedded PostgreSQL started under root with its data in
# pytest's temporary directory: a folder above its data no longer lets its system user in, and
# the server stops at its next checkpoint.
CUT_OFF = """data_dir(outbox_postgres).parent.chmod(0o700)
        with create_engine(outbox_postgres.url).connect() as conn:
            conn.execute(text("CHECKPOINT"))"""


@pytest.mark.parametrize(
    "how",
    [
        "killed",
        pytest.param(
            "cut_off",
            marks=pytest.mark.skipif(
                not hasattr(os, "geteuid") or os.geteuid() != 0,
                reason="embedded PostgreSQL runs as a system user of its own only under root",
            ),
        ),
    ],
)
def test_when_the_plugins_postgresql_stops_the_first_failure_says_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(
        test_servers=KILLED_MIDWAY.replace("{how}", KILL if how == "killed" else CUT_OFF)
    )
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "-s", timeout=170)
    output = result.stdout.str()
    # -s: the first test's print comes between its name and its outcome.
    found = re.findall(r"::(test_\w+) (?:DATA .*\n)?(PASSED|FAILED|ERROR)", output)
    outcomes = dict(found)
    assert outcomes == {
        "test_the_server_runs_outside_pytests_temporary_directory": "PASSED",
        # Killed, it passes; cut off, its checkpoint fails (and its report says why).
        "test_the_server_stops": "PASSED" if how == "killed" else "FAILED",
        "test_needs_the_server": "ERROR",
        "test_needs_it_too": "ERROR",
        "test_needs_no_server": "PASSED",
    }, output

    # The data was in a folder of the session's own, outside pytest's, removed with the session.
    [printed] = re.findall(r"DATA (\{.*\})", output)
    where = json.loads(printed)
    data, tmp = Path(where["data"]), Path(where["tmp"])
    assert data.parent.parent.parent == Path(tempfile.gettempdir()).resolve(), data
    assert data.parent.parent.name.startswith(PREFIX), data
    assert not data.is_relative_to(tmp.parents[1]), (data, tmp)  # pytest's basetemp
    assert not data.parent.parent.exists()

    # The first failure says why in full (the end of the log, and the likely cause if known);
    # each later one names it.
    stopped = f"the embedded PostgreSQL with its data in {data} has stopped"
    # (In the reports; the short summary may repeat a report's first lines.)
    reports = output.split("short test summary info")[0]
    assert reports.count(f"{stopped}\nthe end of its log") == 1, output
    first = "test_needs_the_server" if how == "killed" else "test_the_server_stops"
    assert f"{stopped} (the failure of test_servers.py::{first} says why)" in output, output
    if how == "cut_off":
        assert "Permission denied" in output, output
        assert (
            "Likely cause: the server runs as the system user 'embedded_postgres', and "
            f"{data.parent} (mode 0700) no longer lets other users in." in output
        ), output


# -- a session killed midway -----------------------------------------------------------------------

KILLED_SESSION = """
import asyncio, json, sys
from pathlib import Path

from outbox_bridge.dev.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port
from outbox_bridge.testing.server_folder import ServerFolder

folder = ServerFolder(Path(sys.argv[1]))
postgres = EmbeddedPostgres(folder.new("postgres") / "data")
postgres.start()
temporal = EmbeddedTemporal(folder.new("temporal"), port=free_port(), ui_port=None, in_memory=True)
asyncio.run(temporal.start())
pids = {
    "postgres": int((postgres.data_dir / "postmaster.pid").read_text().split()[0]),
    "temporal": int(temporal.pid_file.read_text()),
}
print(json.dumps({"folder": str(folder.path), **pids}), flush=True)
sys.stdin.read()  # until killed
"""


def test_the_next_session_removes_what_a_killed_session_left(server_dir: Path) -> None:
    """A session killed midway leaves its servers running (the Temporal dev server in a session
    of its own, PostgreSQL as a daemon): the next session stops them and removes their folder,
    and leaves the folder of a session that still runs alone. (Under a folder of this session's
    own, not pytest's temporary directory: another pytest session would cut the servers off.)"""
    parent = server_dir
    running = ServerFolder(parent)
    with subprocess.Popen(
        [sys.executable, "-c", KILLED_SESSION, str(parent)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as killed:
        try:
            assert killed.stdout is not None
            left = json.loads(killed.stdout.readline())
        finally:
            killed.send_signal(signal.SIGKILL)
    servers = [psutil.Process(left["postgres"]), psutil.Process(left["temporal"])]
    assert all(server.is_running() for server in servers)

    ServerFolder(parent).remove()

    assert not Path(left["folder"]).exists()
    for server in servers:
        psutil.wait_procs([server], timeout=30)
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert (running.path / OWNER_FILE).exists()
    running.remove()
    assert not running.path.exists()


def test_a_folder_being_made_is_left_alone_one_never_claimed_is_removed(tmp_path: Path) -> None:
    """Between ``mkdtemp`` and its owner's lock a folder has no owner written yet: a session
    that starts then leaves it alone, unless it stayed so for an hour."""
    being_made = tmp_path / f"{PREFIX}new"
    being_made.mkdir()
    (being_made / OWNER_FILE).touch()
    not_yet = tmp_path / f"{PREFIX}newer"
    not_yet.mkdir()
    never = tmp_path / f"{PREFIX}old"
    never.mkdir()
    (never / OWNER_FILE).touch()
    two_hours_ago = time.time() - 7200
    os.utime(never, (two_hours_ago, two_hours_ago))

    ServerFolder(tmp_path).remove()

    assert being_made.exists() and not_yet.exists()
    assert not never.exists()


def test_the_session_s_dev_server_gives_each_task_queue_one_partition(servers: Servers) -> None:
    """Partitions left loaded by the tests' workers kept four-partition dev servers busy after
    those workers had gone (CONTRIBUTING.md); the running server was started with one."""
    pid = int(servers.temporal.pid_file.read_text().split()[0])
    words = psutil.Process(pid).cmdline()
    given = {words[i + 1] for i, word in enumerate(words[:-1]) if word == "--dynamic-config-value"}
    assert given == {
        "matching.numTaskqueueReadPartitions=1",
        "matching.numTaskqueueWritePartitions=1",
    }


def test_a_dev_server_s_dynamic_config_can_be_replaced(tmp_path: Path) -> None:
    server = EmbeddedTemporal(tmp_path, ui_port=None, dynamic_config={"limit.maxIDLength": 300})
    words = server.command()
    assert words.count("--dynamic-config-value") == 1, words
    assert words[words.index("--dynamic-config-value") + 1] == "limit.maxIDLength=300"
