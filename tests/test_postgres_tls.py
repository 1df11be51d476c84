"""The outbox over TLS with ``sslmode=verify-full``: a PostgreSQL of the test's own serves a
certificate for ``localhost`` signed by a CA the test made (``openssl``); the worker's engine and
its LISTEN connection connect with the URL's ``sslmode`` and ``sslrootcert`` and handle a row.
A wrong CA, or a host name the certificate does not hold, is refused with a
:class:`ConfigurationError` that names ``sslmode`` and holds no password."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import MagicMock

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox_bridge.config import libpq_url
from outbox_bridge.db.tls import refuse_tls_failures, tls_refusal
from outbox_bridge.dev.embedded import free_port
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.runtime.assembly import build_engine
from outbox_bridge.runtime.bridge import Bridge
from outbox_bridge.runtime.hub import ShardHub
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    unique_table,
    wait_until,
    write_rows,
)

PASSWORD = "-".join(["tls", "s3cret"])  # the server trusts any; it must show nowhere


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(folder: Path) -> None:
    """ca.pem (and its key), server.pem and server.key for DNS:localhost signed by it, and
    other-ca.pem, a CA that signed nothing here."""
    folder.mkdir(parents=True)
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=outbox test {ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            cwd=folder,
        )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", "server.key", "-out", "server.csr", cwd=folder,
    )  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem",
        cwd=folder,
    )  # fmt: skip


@dataclasses.dataclass
class TlsServer:
    port: int
    ca: Path
    other_ca: Path

    def url(
        self, host: str = "localhost", ca: Path | None = None, mode: str = "verify-full"
    ) -> str:
        root = ca or self.ca
        return (
            f"postgresql+psycopg://postgres:{PASSWORD}@{host}:{self.port}/postgres"
            f"?sslmode={mode}&sslrootcert={root}"
        )


def _server_binaries() -> Path | None:
    """A PostgreSQL built with TLS: Debian's (the embedded one is built without it)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), reverse=True)
    return found[0].parent if found else None


def _system_user() -> str | None:
    """Who runs that server: PostgreSQL refuses to run as root."""
    for name in ("postgres", "embedded_postgres"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    return None


@pytest.fixture
def tls_server() -> Iterator[TlsServer]:
    """A PostgreSQL of this test's own with ssl=on, on TCP at localhost only."""
    binaries, user = _server_binaries(), _system_user()
    if binaries is None or user is None:
        pytest.skip("needs a PostgreSQL built with TLS (Debian's postgresql package)")
    # Under the system's temporary directory, which the server's own user can reach.
    folder = Path(tempfile.mkdtemp(prefix="outbox-bridge-tls-"))
    folder.chmod(0o755)
    data = folder / "data"
    port = free_port()

    def run(*command: str | Path) -> None:
        subprocess.run([str(part) for part in command], check=True, capture_output=True, user=user)

    try:
        _certificates(folder / "tls")
        data.mkdir(mode=0o700)
        shutil.chown(data, user, user)
        run(binaries / "initdb", "-D", data, "--auth=trust", "-U", "postgres", "-E", "UTF8")
        for name in ("server.pem", "server.key"):
            shutil.copy(folder / "tls" / name, data / name)
            (data / name).chmod(0o600)
            shutil.chown(data / name, user, user)
        with (data / "postgresql.conf").open("a") as conf:
            conf.write(
                "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n"
                f"listen_addresses = 'localhost'\nport = {port}\n"
                f"unix_socket_directories = '{data}'\n"
            )
        run(binaries / "pg_ctl", "-D", data, "-w", "-t", "60", "-l", data / "log", "start")
        try:
            yield TlsServer(port, folder / "tls" / "ca.pem", folder / "tls" / "other-ca.pem")
        finally:
            run(binaries / "pg_ctl", "-D", data, "-w", "-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _encrypted_connections(conn: psycopg.Connection[tuple[object, ...]]) -> list[bool]:
    """Whether each client connection over TCP is encrypted."""
    rows = conn.execute(
        "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
        "WHERE a.backend_type = 'client backend' AND a.client_port IS NOT NULL"
    ).fetchall()
    return [bool(row[0]) for row in rows]


async def test_the_outbox_runs_over_verify_full_tls(servers, tls_server: TlsServer) -> None:
    """The worker's engine and its bridge's LISTEN connection, each over TLS, verified."""
    url = tls_server.url()
    own = dataclasses.replace(servers, database_url=url)
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    engine = build_engine(url, fast_settings())
    try:
        await create_tables(engine, app)
        async with running_worker(own, app, fast_settings()):
            [row_id] = await write_rows(
                engine,
                app,
                [
                    {
                        "category": Category.PROJECT_UPDATE,
                        "shard_identifier": 1,
                        "object_identifier": 1,
                    }
                ],
            )
            await wait_until(lambda: row_id in recorder.ids(), what="a row handled over TLS")
            with psycopg.connect(libpq_url(make_url(url)), autocommit=True) as conn:
                encrypted = _encrypted_connections(conn)
                # The worker's pool, its bridge's LISTEN and lock connections, and this one.
                assert len(encrypted) >= 4 and all(encrypted), encrypted
                listening = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'"
                ).fetchone()
                assert listening is not None and listening[0] >= 1
        async with engine.connect() as conn:
            ssl = await conn.scalar(
                text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            )
            assert ssl is True
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    ("host", "wrong_ca", "reason"),
    [
        ("localhost", True, "certificate verify failed"),
        ("127.0.0.1", False, "does not match host name"),
    ],
    ids=["another CA", "another host name"],
)
async def test_a_server_that_fails_verification_is_refused_clearly(
    tls_server: TlsServer, host: str, wrong_ca: bool, reason: str
) -> None:
    url = tls_server.url(host, tls_server.other_ca if wrong_ca else None)
    engine = build_engine(url, fast_settings())
    refuse_tls_failures(engine)
    try:
        with pytest.raises(ConfigurationError) as refused:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    message = str(refused.value)
    assert "sslmode=verify-full" in message and reason in message, message
    assert PASSWORD not in message and PASSWORD not in repr(refused.value.__cause__)
    # The bridge's own connections (psycopg, libpq's URL) are refused alike.
    with pytest.raises(psycopg.OperationalError) as raw:
        await psycopg.AsyncConnection.connect(libpq_url(make_url(url)))
    translated = tls_refusal(raw.value, make_url(url))
    assert translated is not None and str(translated) == message


@pytest.mark.logs_errors  # the refusal is reported as an error, on purpose
async def test_the_bridge_says_in_one_line_why_tls_refused_its_connection(
    tls_server: TlsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The bridge's LISTEN connection (psycopg, libpq's URL) to a server of another CA: an
    error record that names sslmode, no traceback, no password; it keeps trying."""
    url = make_url(tls_server.url(ca=tls_server.other_ca))
    app = make_app(unique_table(), Recorder())
    bridge = Bridge(
        app=app,
        engine=build_engine(url.render_as_string(hide_password=False), fast_settings()),
        listen_url=libpq_url(url),
        settings=fast_settings(),
        supervisor=MagicMock(),
        hub=ShardHub(),
    )
    stop = asyncio.Event()
    with caplog.at_level(logging.ERROR, logger="outbox_bridge"):
        running = asyncio.create_task(bridge.run(stop))
        await wait_until(lambda: bool(caplog.records), what="the bridge's error")
        stop.set()
        await asyncio.wait_for(running, timeout=10)
    [record] = caplog.records[:1]
    message = record.getMessage()
    assert message.startswith("bridge cannot connect: cannot connect to PostgreSQL at localhost")
    assert "(sslmode=verify-full): SSL error: certificate verify failed" in message
    assert record.exc_info is None and PASSWORD not in message
    assert not running.exception()
