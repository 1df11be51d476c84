"""``manage.py outbox_worker`` as a real subprocess (``python -m django outbox_worker``) on
the Django tests' project: its settings from the Django settings and the environment, its
health endpoints, a row written by a Django view handled by it (the view's flush answers
handled), a graceful stop on SIGTERM, and no password in its output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.db import connections
from django.test import Client

from outbox_bridge import OutboxSettings
from outbox_bridge.contrib.django.flush import flush_report
from outbox_bridge.dev.embedded import free_port
from outbox_bridge.registry import FlushRoute
from tests.django_app.outbox import app
from tests.django_support import database_settings, end_workflows, next_identifier, rows
from tests.harness import Servers
from tests.support import clean_env
from tests.test_cli import CANARY

ROOT = Path(__file__).resolve().parents[1]


def worker_env(servers: Servers, task_queue: str, health_port: int) -> tuple[dict[str, str], str]:
    """The subprocess's environment (tests/django_settings.py reads the database from it), and
    the password it is given: the test database's own, or a canary the embedded PostgreSQL
    ignores (it trusts local connections)."""
    database = database_settings(servers)
    password = database["PASSWORD"] or CANARY
    env = clean_env(
        PGHOST=database["HOST"],
        PGPORT=database["PORT"],
        PGUSER=database["USER"],
        PGPASSWORD=password,
        DJANGO_TESTS_DATABASE=str(connections["default"].settings_dict["NAME"]),
        TEMPORAL_ADDRESS=servers.temporal_address,
        OUTBOX_TASK_QUEUE=task_queue,
        OUTBOX_HEALTH_PORT=str(health_port),
        OUTBOX_HEALTH_HOST="127.0.0.1",
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_SWEEP_INTERVAL="1",
    )
    return env, password


def get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def wait_for(what: str, check: object, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not callable(check) or not check():
        assert proc.poll() is None, f"the worker exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.django_db(transaction=True)
def test_the_worker_command_handles_the_rows_of_a_view(servers, tmp_path) -> None:
    task_queue = f"tq-django-{uuid.uuid4().hex[:8]}"
    health_port = free_port()
    env, password = worker_env(servers, task_queue, health_port)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "outbox_worker",
                "--settings",
                "tests.django_settings",
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            text=True,
        )
    try:
        wait_for("the banner", lambda: "outbox-bridge is running" in out.read_text(), proc)
        wait_for("readiness", lambda: get(health_port, "/readyz")[0] == 200, proc, timeout=30)
        assert get(health_port, "/healthz")[0] == 200

        app.configure_flush(
            OutboxSettings(temporal_address=servers.temporal_address, task_queue=task_queue)
        )
        shard = next_identifier()
        response = Client().get(f"/flushed/{shard}")
        report = flush_report(response)
        assert report is not None
        assert [(r.shard, r.outcome) for r in report] == [(f"ORGANIZATION:{shard}", "handled")]
        assert response.json()["id"] not in [row["id"] for row in rows()]  # handled: deleted

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        app.flush_route = FlushRoute()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        end_workflows(servers, app, OutboxSettings(task_queue=task_queue))
    output = out.read_text() + err.read_text()
    assert "postgresql+psycopg://" in output and "***" in output  # the banner, masked
    assert password not in output, output
    assert "Traceback" not in output, output
