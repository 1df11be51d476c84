"""How the bridge reports what stops it: a lost database is an outage it waits out (a
warning), anything else (a statement PostgreSQL refuses, a bug) is a failure, logged as an
error with its traceback, even though the bridge restarts either way."""

from __future__ import annotations

import logging

import psycopg
import pytest
from sqlalchemy import exc

from outbox_bridge.runtime.bridge import Bridge
from tests.harness import fresh_app, running_worker, wait_until

BRIDGE_LOGGER = "outbox_bridge.runtime.bridge"
STATEMENT = "SELECT shard_scope FROM outbox GROUP BY shard_scope"


def refused() -> Exception:
    """What SQLAlchemy raises for a statement PostgreSQL refuses (a column renamed by a
    migration, a role without the privilege)."""
    return exc.ProgrammingError(
        STATEMENT, {}, psycopg.errors.UndefinedColumn('column "shard_scope" does not exist')
    )


def lost() -> Exception:
    """What SQLAlchemy raises when the server closed the connection."""
    return exc.OperationalError(
        STATEMENT, {}, psycopg.OperationalError("server closed the connection unexpectedly")
    )


@pytest.mark.parametrize(
    ("error", "level", "says"),
    [
        pytest.param(
            refused, logging.ERROR, "bridge failed", id="refused", marks=pytest.mark.logs_errors
        ),
        pytest.param(lost, logging.WARNING, "bridge lost the database", id="lost"),
    ],
)
async def test_a_failing_sweep_is_an_error_and_a_lost_database_a_warning(
    servers, engine, monkeypatch, caplog, error, level: int, says: str
) -> None:
    _, _, app = await fresh_app(engine)
    sweep = Bridge._sweep
    sweeps = 0

    async def failing_after_the_first(self: Bridge) -> None:
        """The first sweep runs (the worker is ready after it); every later one fails."""
        nonlocal sweeps
        sweeps += 1
        if sweeps > 1:
            raise error()
        await sweep(self)

    monkeypatch.setattr(Bridge, "_sweep", failing_after_the_first)
    caplog.set_level(logging.INFO, logger="outbox_bridge")

    def reported() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == BRIDGE_LOGGER and says in r.message]

    async with running_worker(servers, app):
        await wait_until(lambda: bool(reported()), what=f"{says!r} logged")
    [record, *_] = reported()
    assert record.levelno == level
    assert sweeps >= 2
    if level == logging.ERROR:
        # With its traceback: where the failure comes from.
        assert record.exc_info is not None and isinstance(record.exc_info[1], exc.ProgrammingError)
    else:
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
