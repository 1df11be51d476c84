"""The servers a benchmark run uses: its own embedded PostgreSQL and Temporal dev servers in a
temporary directory, or the ones named by ``OUTBOX_DATABASE_URL`` / ``TEMPORAL_ADDRESS``.

Temporal modes: ``file`` is the dev server on its SQLite file with the WAL pragmas of
:class:`~outbox_bridge.dev.embedded.EmbeddedTemporal` (what ``worker.py`` starts),
``memory`` the dev server in memory, ``external`` a server given by address (its storage is
unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from outbox_bridge.dev.embedded import EmbeddedPostgres, EmbeddedTemporal, free_port

_serial = itertools.count(1)


@dataclass
class TemporalServer:
    mode: str
    address: str
    embedded: EmbeddedTemporal | None = None

    def rss_mb(self) -> float | None:
        """Resident memory of an embedded dev server, in MB."""
        if self.embedded is None:
            return None
        try:
            pid = int(self.embedded.pid_file.read_text())
            return psutil.Process(pid).memory_info().rss / 2**20
        except (OSError, ValueError, psutil.Error):
            return None


@contextlib.asynccontextmanager
async def database(base_dir: Path, url: str | None) -> AsyncIterator[str]:
    """``url`` if given, else an embedded PostgreSQL under ``base_dir`` for the whole run."""
    if url:
        yield url
        return
    postgres = EmbeddedPostgres(base_dir / "postgres")
    started = await asyncio.to_thread(postgres.start)
    try:
        yield started
    finally:
        await asyncio.to_thread(postgres.stop)


@contextlib.asynccontextmanager
async def temporal(mode: str, base_dir: Path, address: str | None) -> AsyncIterator[TemporalServer]:
    """A fresh dev server for one measurement (``file`` or ``memory``), or the given one."""
    if address:
        yield TemporalServer("external", address)
        return
    server = EmbeddedTemporal(
        base_dir / f"temporal-{mode}-{next(_serial)}",
        port=free_port(),
        ui_port=None,
        in_memory=mode == "memory",
    )
    started = await server.start()
    try:
        yield TemporalServer(mode, started, server)
    finally:
        await asyncio.to_thread(server.stop)
