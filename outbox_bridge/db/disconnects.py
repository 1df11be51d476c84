"""Telling a lost database from a failing statement.

A lost connection (a restart, a failover, a network cut, ``pg_terminate_backend``) is an
outage: the worker waits it out and reconnects. Any other error (a statement PostgreSQL
refuses, a bug) is a failure that waiting does not fix, and is reported as one.
"""

from __future__ import annotations

import psycopg
from sqlalchemy import exc as sa

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
