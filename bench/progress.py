"""Watching a table drain: progress lines every few seconds, a deadline, and the end time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from outbox_bridge.config import libpq_url, sqlalchemy_url

PROGRESS_EVERY = 5.0
CHECK_EVERY = 0.05


@dataclass
class DrainWatch:
    """How a drain ended: rows left (0 when the table emptied) and when it ended."""

    remaining: int
    ended: float  # time.monotonic()

    @property
    def completed(self) -> bool:
        return self.remaining == 0


def say(label: str, text: str) -> None:
    print(f"  [{label}] {text}", flush=True)


async def watch_drain(
    database_url: str,
    table: str,
    *,
    label: str,
    total: int,
    started: float,
    deadline: float,
    stopped: Callable[[], bool] = lambda: False,
) -> DrainWatch:
    """Poll ``table`` until it is empty, ``deadline`` (monotonic) passes or ``stopped()``;
    print the rows remaining every few seconds."""
    url = libpq_url(sqlalchemy_url(database_url))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        next_report = time.monotonic() + PROGRESS_EVERY
        while True:
            cur = await conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})")
            row = await cur.fetchone()
            now = time.monotonic()
            if row is not None and not row[0]:
                return DrainWatch(0, now)
            if now >= deadline or stopped() or now >= next_report:
                remaining = await table_count(conn, table)
                if now >= deadline or stopped():
                    return DrainWatch(remaining, now)
                rate = (total - remaining) / max(now - started, 1e-9)
                say(
                    label,
                    f"{remaining:,} rows remaining after {now - started:.0f} s "
                    f"({rate:,.0f} rows/s)",
                )
                next_report = now + PROGRESS_EVERY
            await asyncio.sleep(CHECK_EVERY)


async def table_count(conn: psycopg.AsyncConnection, table: str) -> int:
    cur = await conn.execute(f"SELECT count(*) FROM {table}")
    row = await cur.fetchone()
    return int(row[0]) if row else 0
