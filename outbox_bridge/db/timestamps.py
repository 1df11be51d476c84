"""PostgreSQL's ``infinity`` and ``-infinity`` timestamps, read as Python datetimes.

A producer writing plain SQL may store them in ``scheduled_for``, and psycopg cannot load them
(a ``datetime`` cannot be infinite), which would fail every drain of the row's shard. The worker
reads them as the latest and earliest aware datetimes instead: a row due at ``infinity`` defers
its shard like a row due in year 9999, and a row due since ``-infinity`` is due now.

Every other value goes to psycopg's own loader, its C implementation when installed (wrapped:
a compiled loader cannot be subclassed), about 25 times faster than the pure-Python one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from psycopg import _cmodule
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.types.datetime import TimestamptzLoader
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

LATEST = datetime.max.replace(tzinfo=UTC)
EARLIEST = datetime.min.replace(tzinfo=UTC)


# psycopg's text loader of timestamptz: the compiled one when available.
_FAST_LOADER: type[Loader] = getattr(_cmodule._psycopg, "TimestamptzLoader", TimestamptzLoader)


class InfiniteTimestamptzLoader(Loader):
    """psycopg's text loader of ``timestamptz``, with ``±infinity`` as the extreme datetimes."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._load = _FAST_LOADER(oid, context).load

    def load(self, data: Buffer) -> datetime:
        if data == b"infinity":
            return LATEST
        if data == b"-infinity":
            return EARLIEST
        return self._load(data)  # type: ignore[no-any-return]


def load_infinite_timestamps(engine: AsyncEngine) -> None:
    """Have every connection of ``engine`` read ``±infinity`` timestamps (see the module)."""

    @event.listens_for(engine.sync_engine, "connect")
    def register(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.driver_connection.adapters.register_loader(
            "timestamptz", InfiniteTimestamptzLoader
        )


def iso_utc(moment: datetime) -> str:
    """``moment`` in ISO 8601, in UTC whatever the database session's time zone: what the
    workflows keep and show reads the same from every server."""
    return moment.astimezone(UTC).isoformat()
