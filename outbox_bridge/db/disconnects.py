"""Telling a lost database from a failing statement.

A lost connection (a restart, a failover, a network cut, ``pg_terminate_backend``) is an
outage: the worker waits it out and reconnects. Any other error (a statement PostgreSQL
refuses, a bug) is a failure that waiting does not fix, and is reported as one.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy import exc as sa
from sqlalchemy.ext.asyncio import AsyncEngine

# What the driver and SQLAlchemy raise when the connection is gone or cannot be made.
_CONNECTION_ERRORS = (
    OSError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    sa.OperationalError,
    sa.InterfaceError,
    sa.PendingRollbackError,  # a connection SQLAlchemy invalidated when it was lost
    sa.DisconnectionError,
)


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` says the database cannot be reached (the connection was lost or
    could not be made), rather than that a statement failed on a live connection."""
    if isinstance(error, sa.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, _CONNECTION_ERRORS)


# A pooled connection idle for longer than this is pinged before it is handed out.
PING_AFTER_IDLE_SECONDS = 1.0
_CHECKED_IN_AT = "outbox_bridge.checked_in_at"


def ping_idle_connections(engine: AsyncEngine, after: float = PING_AFTER_IDLE_SECONDS) -> None:
    """Have ``engine``'s pool ping a connection before handing it out when it sat idle for
    ``after`` seconds or more, and replace it if the ping finds it lost: ``pool_pre_ping``'s
    check, without its round trip on every checkout (a fifth of a lone row's wait for its
    handler under light traffic). A connection lost while it was busy, or within ``after`` of its
    last use, fails its next statement instead, which every user of the pool treats as the
    outage it is."""

    @event.listens_for(engine.sync_engine, "checkin")
    def checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_CHECKED_IN_AT)
        if since is None or time.monotonic() - since < after:
            return  # new, or in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            if connection_lost(exc):
                raise sa.DisconnectionError("a pooled connection was lost while idle") from exc
            raise
