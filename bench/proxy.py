"""A TCP proxy that delays every chunk it forwards, as a database in another zone would.

Each connection to the proxy gets its own connection to the upstream server (TCP or a Unix
socket), and each direction its own queue of ``(due time, chunk)``: a chunk is read as soon as it
arrives, stamped ``delay`` seconds ahead, and written once that time has come, in the order it was
read. The stream never stalls behind a sleep, and what arrives during a delay is forwarded one
delay after it arrived, not after the chunk before it.

``python -m bench.proxy --target HOST:PORT|/path/to/socket --delay-ms 2`` runs one in its own
process (what the bench does, so that the proxy's Python never competes with the worker's event
loop or its GIL): it prints ``listening HOST:PORT`` once ready, and on SIGTERM or SIGINT closes
every connection and prints ``closed N``, the connections it forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[1]
LISTENING, CLOSED = "listening", "closed"
START_TIMEOUT = STOP_TIMEOUT = 30.0
# What a proxy that leaked a task or a socket, or failed, writes on its stderr.
LEAKS = ("ResourceWarning", "Task was destroyed", "Exception ignored", "Traceback")
CHUNK = 64 * 1024
QUEUED_CHUNKS = 64  # per direction; a full queue stops reading (TCP back-pressure)


@dataclass(frozen=True)
class Upstream:
    """Where the proxy connects: ``host:port``, or a Unix socket when ``host`` is a path."""

    host: str
    port: int = 5432

    @classmethod
    def parse(cls, text: str) -> Upstream:
        if text.startswith("/"):
            return cls(text, 0)
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT or a socket path, got {text!r}")
        return cls(host, int(port))

    @classmethod
    def of_database(cls, libpq: str) -> Upstream:
        """The server a libpq URL names (its socket directory's socket, or its host and port)."""
        params = conninfo_to_dict(libpq)
        host = str(params.get("host") or "localhost")
        port = int(params.get("port") or 5432)
        return cls(f"{host}/.s.PGSQL.{port}", 0) if host.startswith("/") else cls(host, port)

    def __str__(self) -> str:
        return self.host if self.port == 0 else f"{self.host}:{self.port}"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.port == 0:
            return await asyncio.open_unix_connection(self.host)
        return await asyncio.open_connection(self.host, self.port)


class DelayProxy:
    """Listen on ``host:port`` (0: any free port) and forward to ``upstream``, ``delay`` seconds
    late in each direction. Use as an async context manager; :attr:`port` is where it listens."""

    def __init__(
        self, upstream: Upstream, delay: float, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.upstream = upstream
        self.delay = delay
        self.host = host
        self.port = port
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening, then end every connection still open."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own, not the stream's callback task: close() cancels it, and the
        # callback's task must not end cancelled (asyncio 3.11 reports that as an error).
        task = asyncio.create_task(self._relay(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.connections += 1

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await self.upstream.open()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._forward(reader, upstream_writer))
                group.create_task(self._forward(upstream_reader, writer))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # a side that resets or refuses ends the connection, as a network would
        finally:
            await _close(writer)
            if upstream_writer is not None:
                await _close(upstream_writer)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read into the queue at once, write each chunk when it is due."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)

        async def receive() -> None:
            while chunk := await reader.read(CHUNK):
                await queue.put((loop.time() + self.delay, chunk))
            await queue.put((loop.time() + self.delay, b""))  # the end of stream is late too

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                while (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        async with asyncio.TaskGroup() as group:
            group.create_task(receive())
            group.create_task(send())


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def serve(upstream: Upstream, delay: float, port: int) -> None:
    """Run a proxy until SIGTERM or SIGINT, announcing its address on stdout, then how many
    connections it forwarded."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with DelayProxy(upstream, delay, port=port) as proxy:
        print(f"{LISTENING} {proxy.host}:{proxy.port}", flush=True)
        await stop.wait()
    print(f"{CLOSED} {proxy.connections}", flush=True)


@dataclass
class ProxiedDatabase:
    """A database URL that leads through a proxy process, and what the proxy forwarded."""

    url: str
    delay_ms: float
    pid: int
    connections: int | None = None  # known once the proxy has stopped


@contextlib.asynccontextmanager
async def proxied_database(database_url: str, delay_ms: float) -> AsyncIterator[ProxiedDatabase]:
    """Run ``python -m bench.proxy`` in front of ``database_url``'s server for the block and
    give the URL through it. A proxy that does not stop cleanly (an exit code, or a leaked task
    or socket reported on its stderr) is an error."""
    # Imported here: the proxy's own process needs none of the settings (pydantic, SQLAlchemy).
    from outbox_bridge.config import libpq_url, sqlalchemy_url

    url = sqlalchemy_url(database_url)
    upstream = Upstream.of_database(libpq_url(url))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-W", "default::ResourceWarning", "-m", "bench.proxy",
        "--target", str(upstream), "--delay-ms", str(delay_ms),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        first = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        word, _, address = first.decode().strip().partition(" ")
        if word != LISTENING:
            raise RuntimeError(f"the delaying proxy did not start: {first!r}")
        host, _, port = address.rpartition(":")
        through = url.difference_update_query(["host", "port"]).set(host=host, port=int(port))
        proxied = ProxiedDatabase(
            through.render_as_string(hide_password=False), delay_ms, process.pid
        )
        yield proxied
    finally:
        out, err = await _stop(process)
    word, _, count = out.decode().strip().rpartition("\n")[2].partition(" ")
    errors = err.decode().strip()
    if process.returncode != 0 or word != CLOSED or any(leak in errors for leak in LEAKS):
        raise RuntimeError(
            f"the delaying proxy did not stop cleanly (exit {process.returncode}): "
            f"{errors or out.decode().strip()}"
        )
    if errors:  # a warning of some library: shown, not fatal
        print(errors, file=sys.stderr)
    proxied.connections = int(count)


async def _stop(process: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """Ask the proxy to stop (SIGTERM), kill it if it has not within ``STOP_TIMEOUT``; its
    output."""
    if process.returncode is None:
        process.terminate()
    try:
        return await asyncio.wait_for(process.communicate(), STOP_TIMEOUT)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        return out, err + b"\nkilled: it did not stop within %d s of SIGTERM" % STOP_TIMEOUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__)
    parser.add_argument("--target", required=True, help="HOST:PORT or a Unix socket's path")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay each way")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms cannot be negative")
    try:
        upstream = Upstream.parse(args.target)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(upstream, args.delay_ms / 1000, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
