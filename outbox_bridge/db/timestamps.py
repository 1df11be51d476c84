"""PostgreSQL's ``±infinity`` timestamps read as the latest and earliest aware datetimes.

Plain SQL may store them in ``scheduled_for``, and psycopg cannot load them (a ``datetime`` is
finite): every drain of the row's shard would fail. Read this way, a row due at ``infinity``
defers its shard like one due in year 9999. Other values go to psycopg's own loader, the C one
when installed (wrapped: it cannot be subclassed), about 25 times faster than pure Python.
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
    """``moment`` in ISO 8601 and UTC, whatever the session's time zone: what the workflows
    keep and show reads the same from every server."""
    return moment.astimezone(UTC).isoformat()
