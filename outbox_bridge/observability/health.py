"""The worker's health endpoints, ``/healthz`` and ``/readyz`` (the deploy page says what each
checks), served by a tiny HTTP/1.1 responder on asyncio streams (GET and HEAD, one request per
connection): no web framework is needed. ``/healthz`` checks nothing outside the process on
purpose: restarting workers fixes no outage of PostgreSQL or Temporal. No detail carries a
password or an API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from datetime import timedelta
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import psycopg
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from outbox_bridge.config import OutboxSettings, libpq_url, sqlalchemy_url

if TYPE_CHECKING:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from outbox_bridge.runtime.bridge import Bridge

log = logging.getLogger("outbox_bridge.observability.health")

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
CHECK_TIMEOUT = 2.0
"""Seconds each readiness check (PostgreSQL, Temporal) may take before it counts as failed."""
REUSE_SECONDS = 1.0
"""Probes within this time share one check, so that frequent probes (or a probe flood: the
port is often reachable from the network) cost at most one database connection a second."""
READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str


class HealthServer:
    """Serves ``/healthz`` and ``/readyz`` on ``settings.health_host:health_port`` (port 0:
    nothing is served); ``/readyz`` says the worker is starting until :meth:`attach`. A port
    already taken is logged and the worker runs without the endpoints, so that several workers
    on one host, or tests, never stop each other.
    """

    def __init__(self, settings: OutboxSettings, *, database_url: str, stop: asyncio.Event) -> None:
        url = sqlalchemy_url(database_url)
        self._libpq_url = libpq_url(url)
        api_key = settings.temporal_api_key
        secrets = (url.password, url.query.get("password"), api_key and api_key.get_secret_value())
        self._secrets = [s for s in secrets if isinstance(s, str) and s]
        self._host = settings.health_host
        self._port = settings.health_port
        self._task_queue = settings.task_queue
        self._stop = stop
        self._client: Client | None = None
        self._worker: Worker | None = None
        self._bridge: Bridge | None = None
        self._server: asyncio.Server | None = None
        self._remote: asyncio.Future[dict[str, Check]] | None = None
        self._remote_at = 0.0
        self._was_ready = False

    def attach(self, *, client: Client, worker: Worker, bridge: Bridge | None = None) -> None:
        """Start reporting on this Temporal client, worker and (when given) bridge."""
        self._client, self._worker, self._bridge = client, worker, bridge

    async def start(self) -> None:
        if self._port == 0:
            return
        try:
            self._server = await asyncio.start_server(self._connection, self._host, self._port)
        except OSError as exc:
            log.error(
                "cannot serve the health endpoints on %s:%s (%s); running without them. Choose "
                "a free --health-port (OUTBOX_HEALTH_PORT), or 0 to disable them",
                self._host,
                self._port,
                exc.strerror or exc,
            )
            return
        where = f"http://{self._host}:{self._port}"
        log.info("health endpoints on %s%s and %s", where, LIVENESS_PATH, READINESS_PATH)

    async def close(self) -> None:
        if self._remote is not None:
            self._remote.cancel()
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def liveness(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        checks = {**await self._remote_checks(), "worker": self._worker_check()}
        ready = all(check.ok for check in checks.values())
        self._log_change(ready, checks)
        body: dict[str, Any] = {
            "status": "ready" if ready else "not ready",
            "checks": {name: asdict(check) for name, check in checks.items()},
        }
        if self._bridge is not None:
            body["bridge"] = "active" if self._bridge.is_leader else "standby"
        return ready, body

    async def _remote_checks(self) -> dict[str, Check]:
        loop = asyncio.get_running_loop()
        stale = loop.time() - self._remote_at >= REUSE_SECONDS
        if self._remote is None or (self._remote.done() and stale):
            self._remote_at = loop.time()
            self._remote = asyncio.ensure_future(self._check_remote())
        return await asyncio.shield(self._remote)

    async def _check_remote(self) -> dict[str, Check]:
        database, temporal = await asyncio.gather(
            self._guarded("PostgreSQL", self._check_database()),
            self._guarded("Temporal", self._check_temporal()),
        )
        return {"database": database, "temporal": temporal}

    async def _guarded(self, service: str, check: Awaitable[Check]) -> Check:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                return await check
        except TimeoutError:
            return Check(False, f"{service} did not answer within {CHECK_TIMEOUT:g} s")
        except Exception as exc:
            return Check(False, f"{service} is unreachable: {self._describe(exc)}")

    async def _check_database(self) -> Check:
        # A new connection, not one from the worker's pool: a busy worker whose pool is taken
        # by drains is ready, and a fresh connection is what proves PostgreSQL reachable.
        conn = await psycopg.AsyncConnection.connect(self._libpq_url, autocommit=True)
        async with conn:
            await conn.execute("SELECT 1")
        return Check(True, "PostgreSQL answered SELECT 1")

    async def _check_temporal(self) -> Check:
        if self._client is None:
            return Check(False, "not connected to Temporal yet")
        await self._client.workflow_service.get_system_info(
            GetSystemInfoRequest(), retry=False, timeout=timedelta(seconds=CHECK_TIMEOUT)
        )
        return Check(True, f"Temporal answered, namespace {self._client.namespace}")

    def _worker_check(self) -> Check:
        if self._stop.is_set():
            return Check(False, "stopping: in-flight handler calls get the shutdown grace")
        if self._worker is not None and self._worker.is_shutdown:
            return Check(False, "the Temporal worker has stopped")
        if self._worker is None or not self._worker.is_running:
            return Check(False, "starting")
        return Check(True, f"polling task queue {self._task_queue}")

    def _describe(self, exc: Exception) -> str:
        text = " ".join(str(getattr(exc, "message", None) or exc).split()) or type(exc).__name__
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text[:300]

    def _log_change(self, ready: bool, checks: dict[str, Check]) -> None:
        if ready == self._was_ready or self._stop.is_set():
            return
        self._was_ready = ready
        if ready:
            log.info("ready")
        else:
            failed = "; ".join(f"{n}: {c.detail}" for n, c in checks.items() if not c.ok)
            log.warning("not ready: %s", failed)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                request = await reader.readline()
                while (await reader.readline()).strip():
                    pass  # headers: none is needed
            method, code, headers, body = await self._answer(request)
            head = f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n" + "".join(
                f"{name}: {value}\r\n" for name, value in headers.items()
            )
            writer.write(head.encode("latin-1") + b"\r\n" + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError):
            pass  # a client that is too slow, sends too long a line, or leaves
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request: bytes) -> tuple[str, int, dict[str, str], bytes]:
        parts = request.decode("latin-1").split()
        headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
        payload: dict[str, Any]
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            method, code, payload = "", 400, {"error": "bad request"}
        else:
            method, path = parts[0], parts[1].split("?", 1)[0]
            routes = {LIVENESS_PATH: self.liveness, READINESS_PATH: self.readiness}
            if path not in routes:
                code, payload = 404, {"error": "not found", "paths": list(routes)}
            elif method not in ("GET", "HEAD"):
                code, payload = 405, {"error": "method not allowed"}
                headers["Allow"] = "GET, HEAD"
            else:
                ok, payload = await routes[path]()
                code = 200 if ok else 503
        body = json.dumps(payload).encode()
        headers |= {"Content-Length": str(len(body)), "Connection": "close"}
        return method, code, headers, body
