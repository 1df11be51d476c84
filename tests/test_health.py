"""The worker's health endpoints and its graceful stop (``outbox_bridge.observability.health``, ``outbox_bridge.runtime.shutdown``, ``worker.py``).

``/healthz`` and ``/readyz`` are read over real HTTP from a real worker: in-process through
``serve`` (the harness), and as a ``python worker.py`` subprocess that is then stopped with
SIGTERM while a handler call is in flight. PostgreSQL outages use a second, throwaway embedded
PostgreSQL, never the session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.config import OutboxSettings
from outbox_bridge.dev.embedded import EmbeddedPostgres, free_port
from outbox_bridge.observability.health import LIVENESS_PATH, READINESS_PATH, HealthServer
from outbox_bridge.runtime.assembly import build_drains, build_worker
from tests.harness import (
    Recorder,
    Servers,
    fast_settings,
    make_app,
    running_worker,
    unique_table,
    wait_until,
)
from tests.support import WorkerProcess, clean_env, init_db, with_password, worker_process

CANARY = "h3alth-canary"


# -- an app whose handler waits until the test releases it (run by the worker subprocess) --------


class HoldScope(IntEnum):
    ORGANIZATION = 1


class HoldCategory(IntEnum):
    HOLD = 1


hold_app = OutboxApp(
    scopes={HoldScope.ORGANIZATION: {HoldCategory.HOLD}},
    categories=[HoldCategory],
    tables=[OutboxTable(os.environ.get("HOLD_OUTBOX_TABLE", "hold_outbox"))],
)


@hold_app.handler(HoldCategory.HOLD)
async def hold(message: OutboxMessage) -> None:
    """Marks its start in ``$HOLD_DIR``, then waits for a ``release`` file there."""
    directory = Path(os.environ["HOLD_DIR"])
    (directory / f"started-{message.id}").touch()
    while not (directory / "release").exists():
        await asyncio.sleep(0.05)
    (directory / f"finished-{message.id}").touch()


# -- HTTP ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


async def http(
    port: int, path: str, *, method: str = "GET", request: bytes | None = None
) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request or f"{method} {path} HTTP/1.1\r\nHost: worker\r\n\r\n".encode())
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head, _, raw = response.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return Answer(int(status_line.split()[1]), headers, raw)


async def status_is(port: int, path: str, status: int) -> bool:
    try:
        return (await http(port, path)).status == status
    except OSError:
        return False


# -- in-process ------------------------------------------------------------------------------------


async def test_a_running_worker_is_live_and_ready(servers) -> None:
    port = free_port()
    settings = fast_settings(health_port=port, health_host="127.0.0.1")
    app = make_app(unique_table(), Recorder())
    async with running_worker(servers, app, settings):
        live = await http(port, LIVENESS_PATH)
        assert live.status == 200
        assert live.headers["content-type"] == "application/json"
        assert live.body == {"status": "ok"}

        await wait_until(lambda: status_is(port, READINESS_PATH, 200), what="/readyz 200")
        ready = await http(port, READINESS_PATH)
        assert ready.body["status"] == "ready"
        checks = ready.body["checks"]
        assert set(checks) == {"database", "temporal", "worker"}
        assert all(check["ok"] is True for check in checks.values()), checks
        assert checks["database"]["detail"] == "PostgreSQL answered SELECT 1"
        assert checks["worker"]["detail"] == f"polling task queue {settings.task_queue}"
        assert ready.body["bridge"] == "active"  # its table is its own: no other bridge

        head = await http(port, READINESS_PATH, method="HEAD")
        assert head.status == 200 and head.raw == b""
        assert int(head.headers["content-length"]) > 0
        post = await http(port, READINESS_PATH, method="POST")
        assert (post.status, post.headers["allow"]) == (405, "GET, HEAD")
        missing = await http(port, "/metrics")
        assert missing.status == 404
        assert missing.body["paths"] == [LIVENESS_PATH, READINESS_PATH]
        garbled = await http(port, "", request=b"hello\r\n\r\n")
        assert garbled.status == 400
    # The endpoints close with the worker.
    with pytest.raises(OSError):
        await http(port, LIVENESS_PATH)


async def test_readyz_reports_a_postgresql_outage(servers, server_dir) -> None:
    """The worker's own PostgreSQL stops: /readyz turns 503 and says why; /healthz stays 200."""
    postgres = EmbeddedPostgres(server_dir / "postgres")
    url = make_url(await asyncio.to_thread(postgres.start))
    own = dataclasses.replace(servers, database_url=url.render_as_string(hide_password=False))
    port = free_port()
    settings = fast_settings(health_port=port, health_host="127.0.0.1")
    try:
        async with running_worker(own, make_app(unique_table(), Recorder()), settings):
            await wait_until(lambda: status_is(port, READINESS_PATH, 200), what="/readyz 200")
            await asyncio.to_thread(postgres.stop)
            await wait_until(lambda: status_is(port, READINESS_PATH, 503), what="/readyz 503")
            answer = await http(port, READINESS_PATH)
            assert answer.body["status"] == "not ready"
            database = answer.body["checks"]["database"]
            assert database["ok"] is False
            assert database["detail"].startswith("PostgreSQL is unreachable: "), database
            assert answer.body["checks"]["temporal"]["ok"] is True
            assert answer.body["checks"]["worker"]["ok"] is True
            live = await http(port, LIVENESS_PATH)
            assert (live.status, live.body) == (200, {"status": "ok"})
    finally:
        postgres.stop()


async def test_readiness_never_shows_the_database_password(servers, client, engine) -> None:
    settings = fast_settings(health_port=free_port(), health_host="127.0.0.1")
    unreachable = f"postgresql://outbox:{CANARY}@127.0.0.1:{free_port()}/outbox"
    health = HealthServer(settings, database_url=unreachable, stop=asyncio.Event())
    drains = build_drains(engine, make_app(unique_table(), Recorder()), fast_settings())
    try:
        await health.start()
        # Not attached yet: a worker that is still starting.
        starting = await http(settings.health_port, READINESS_PATH)
        assert starting.status == 503
        assert starting.body["checks"]["temporal"] == {
            "ok": False,
            "detail": "not connected to Temporal yet",
        }
        assert starting.body["checks"]["worker"] == {"ok": False, "detail": "starting"}

        health.attach(client=client, worker=build_worker(client, settings, drains))
        answer = await wait_for_answer(settings.health_port, "temporal")
        assert answer.status == 503
        database = answer.body["checks"]["database"]
        assert database["ok"] is False
        assert database["detail"].startswith("PostgreSQL is unreachable: "), database
        assert "127.0.0.1" in database["detail"]  # where it looked, without the password
        assert CANARY not in answer.raw.decode()
        assert answer.body["checks"]["temporal"]["ok"] is True
        assert answer.body["checks"]["worker"] == {"ok": False, "detail": "starting"}
    finally:
        await health.close()
        drains.close()


async def wait_for_answer(port: int, check: str) -> Answer:
    """The first /readyz answer whose ``check`` is ok (answers are reused for up to a second)."""
    answers: list[Answer] = []

    async def passed() -> bool:
        answers.append(await http(port, READINESS_PATH))
        return bool(answers[-1].body["checks"][check]["ok"])

    await wait_until(passed, what=f"the {check} check to pass")
    return answers[-1]


@pytest.mark.logs_errors  # the taken port is reported as an error, on purpose
async def test_a_taken_health_port_does_not_stop_the_worker(servers, caplog) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = fast_settings(health_port=port, health_host="127.0.0.1")
        with caplog.at_level(logging.ERROR, logger="outbox_bridge.observability.health"):
            async with running_worker(servers, make_app(unique_table(), Recorder()), settings):
                pass
    assert f"cannot serve the health endpoints on 127.0.0.1:{port}" in caplog.text
    assert "OUTBOX_HEALTH_PORT" in caplog.text


async def test_by_default_the_endpoints_listen_on_this_host_only_and_say_so(caplog) -> None:
    """Unset, health_host is 127.0.0.1: the endpoints answer there, and the log line that
    announces them (the demo's too) names that address."""
    port = free_port()
    settings = OutboxSettings(health_port=port)
    assert settings.health_host == "127.0.0.1"
    health = HealthServer(settings, database_url="postgresql://u@h/db", stop=asyncio.Event())
    with caplog.at_level(logging.INFO, logger="outbox_bridge.observability.health"):
        await health.start()
    try:
        assert f"health endpoints on http://127.0.0.1:{port}{LIVENESS_PATH}" in caplog.text
        answer = await http(port, LIVENESS_PATH)
        assert answer.status == 200
        # Another address of this host (one all interfaces would answer on): refused.
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), 2):
            pass
    finally:
        await health.close()


async def test_the_temporal_worker_is_built_with_the_configured_shutdown_grace(
    client, engine
) -> None:
    # That in-flight calls get the grace is what the SIGTERM tests below check.
    drains = build_drains(engine, make_app(unique_table(), Recorder()), fast_settings())
    try:
        for grace in (0.0, 7.5, 600.0):
            worker = build_worker(client, fast_settings(shutdown_grace=grace), drains)
            assert worker.config()["graceful_shutdown_timeout"] == timedelta(seconds=grace)
    finally:
        drains.close()


# -- python worker.py and SIGTERM -------------------------------------------------------------------


@dataclasses.dataclass
class HoldWorker:
    """A ``python worker.py`` running the hold app, and where it serves and drains."""

    process: WorkerProcess
    port: int
    table: str

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.process.proc

    def text(self) -> str:
        return self.process.text()

    async def finish(self, timeout: float) -> int:
        return await self.process.finish(timeout)


@contextlib.asynccontextmanager
async def hold_worker(
    servers: Servers, tmp_path: Path, *, table: str | None = None, **settings: str
) -> AsyncIterator[HoldWorker]:
    url, password = with_password(servers.database_url, CANARY)
    port = free_port()
    table = table or unique_table()
    env = clean_env(
        "HOLD_",
        OUTBOX_DATABASE_URL=url,
        TEMPORAL_ADDRESS=servers.temporal_address,
        OUTBOX_TASK_QUEUE=f"tq-health-{table}",
        OUTBOX_APP="tests.test_health:hold_app",
        OUTBOX_HEALTH_PORT=str(port),
        OUTBOX_HEALTH_HOST="127.0.0.1",
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_SWEEP_INTERVAL="1",
        HOLD_OUTBOX_TABLE=table,
        HOLD_DIR=str(tmp_path),
        **settings,
    )
    await init_db(env)
    async with worker_process(env=env) as process:
        running = HoldWorker(process, port, table)
        yield running
    assert password not in running.text()
    assert "Traceback" not in running.text(), running.text()


async def write_hold_row(engine, table: str) -> int:
    async with engine.begin() as conn:
        result = await conn.execute(
            text(
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier)"
                " VALUES (1, 1, 1, 1) RETURNING id"
            )
        )
        return int(result.scalar_one())


async def rows_left(engine, table: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


async def test_sigterm_lets_the_call_in_flight_finish(servers, engine, tmp_path) -> None:
    async with hold_worker(servers, tmp_path, OUTBOX_SHUTDOWN_GRACE="120") as worker:
        await wait_until(lambda: status_is(worker.port, READINESS_PATH, 200), what="/readyz 200")
        row = await write_hold_row(engine, worker.table)
        await wait_until(lambda: (tmp_path / f"started-{row}").exists(), what="the handler")

        worker.proc.send_signal(signal.SIGTERM)
        # Stopping: no longer ready, still alive, the handler call still running.
        await wait_until(lambda: status_is(worker.port, READINESS_PATH, 503), what="/readyz 503")
        stopping = await http(worker.port, READINESS_PATH)
        assert stopping.body["checks"]["worker"]["detail"].startswith("stopping"), stopping.body
        assert (await http(worker.port, LIVENESS_PATH)).status == 200
        assert worker.proc.returncode is None

        (tmp_path / "release").touch()
        assert await worker.finish(timeout=60) == 0, worker.text()
    assert (tmp_path / f"finished-{row}").exists()
    assert await rows_left(engine, worker.table) == 0  # handled and deleted before the exit


async def test_sigterm_abandons_a_stuck_call_after_the_grace(servers, engine, tmp_path) -> None:
    """The handler does not return: the worker cancels it after the grace and exits cleanly.
    Its row is kept, and the next worker on the task queue handles it."""
    async with hold_worker(servers, tmp_path, OUTBOX_SHUTDOWN_GRACE="1") as worker:
        row = await write_hold_row(engine, worker.table)
        await wait_until(lambda: (tmp_path / f"started-{row}").exists(), what="the handler")
        worker.proc.send_signal(signal.SIGTERM)
        # The handler would wait forever; the drain's own timeout is minutes away.
        assert await worker.finish(timeout=60) == 0, worker.text()
    assert not (tmp_path / f"finished-{row}").exists()
    assert await rows_left(engine, worker.table) == 1
    assert "cancelling 1 handler call(s) still running after the shutdown grace of 1 s" in (
        worker.text()
    )

    (tmp_path / "release").touch()
    async with hold_worker(servers, tmp_path, table=worker.table) as successor:

        async def handled() -> bool:
            return await rows_left(engine, worker.table) == 0

        await wait_until(handled, what="the row handled by the next worker")
        await wait_until(lambda: status_is(successor.port, READINESS_PATH, 200), what="ready")
        successor.proc.send_signal(signal.SIGTERM)
        assert await successor.finish(timeout=60) == 0, successor.text()
    assert (tmp_path / f"finished-{row}").exists()


def test_settings_document_the_health_endpoints() -> None:
    fields = OutboxSettings.model_fields
    assert fields["health_port"].default == 8080
    assert OutboxSettings(health_port=0).health_port == 0  # 0 disables
    with pytest.raises(ValueError, match="health_port"):
        OutboxSettings(health_port=70000)
    with pytest.raises(ValueError, match="shutdown_grace"):
        OutboxSettings(shutdown_grace=-1)
