"""The PostgreSQL of a peers run: the embedded server with ``pg_stat_statements`` loaded, a
database of its own for every system and workload, and the statements and transactions each
run sent."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from outbox_bridge.dev.embedded import EmbeddedPostgres

PRELOAD = "pg_stat_statements"


def libpq(url: str, database: str | None = None) -> str:
    """``url`` (SQLAlchemy or libpq) as a libpq URL, on ``database`` if given."""
    parsed = make_url(url).set(drivername="postgresql")
    if database:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


@contextlib.contextmanager
def embedded(data_dir: Path) -> Iterator[str]:
    """The embedded PostgreSQL, restarted once with ``pg_stat_statements`` preloaded."""
    server = EmbeddedPostgres(data_dir)
    url = libpq(server.start())
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            preloaded = conn.execute("SHOW shared_preload_libraries").fetchone()
            if not preloaded or PRELOAD not in str(preloaded[0]):
                conn.execute(f"ALTER SYSTEM SET shared_preload_libraries = '{PRELOAD}'")
                conn.execute("ALTER SYSTEM SET max_connections = 300")
        if not preloaded or PRELOAD not in str(preloaded[0]):
            server.stop()
            url = libpq(server.start())
        yield url
    finally:
        server.stop()


def create_database(admin_url: str, name: str) -> tuple[str, bool]:
    """A fresh database ``name``; returns its URL and whether pg_stat_statements is there."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = libpq(admin_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute(f"CREATE EXTENSION IF NOT EXISTS {PRELOAD}")
            conn.execute("SELECT count(*) FROM pg_stat_statements").fetchone()
        except psycopg.Error:
            return url, False
    return url, True


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Statements:
    """What a database was sent between :meth:`reset` and :meth:`read`: statements from
    ``pg_stat_statements`` (top-level, every backend), transactions and tuples from
    ``pg_stat_database`` (flushed by each backend at most once a second: read late)."""

    def __init__(self, url: str, *, statements: bool) -> None:
        self.url = url
        self.statements = statements
        self._before: dict[str, int] = {}

    def _database(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted, "
            "tup_returned FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        return {
            "transactions": int(row[0]),
            "tuples_written": int(row[1]),
            "tuples_read": int(row[2]),
        }

    def reset(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            if self.statements:
                conn.execute(
                    "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                    "WHERE datname = current_database()), 0)"
                )
            self._before = self._database(conn)

    def read(self) -> dict[str, int | None]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            after = self._database(conn)
            counts: dict[str, int | None] = {k: after[k] - self._before[k] for k in after}
            counts["statements"] = None
            if self.statements:
                row = conn.execute(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d "
                    "ON d.oid = s.dbid WHERE d.datname = current_database()"
                ).fetchone()
                counts["statements"] = int(row[0]) if row else None
        return counts
