"""Object identifiers for rows that must never coalesce.

A coalescing group is a shard, a category and an object identifier: rows that share all three
are handled once, with the newest. Event-style rows (an audit log entry, a sent e-mail) must
each be handled, so each needs an object identifier of its own.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select

from outbox_bridge.registry import OutboxApp
from outbox_bridge.sessions import sync_result


def _next_value(app: OutboxApp, table: str | None) -> Select[tuple[int]]:
    # The table's own id sequence: every outbox table already has it (no migration needed),
    # and a sequence never hands out a value twice, even to a transaction that rolls back.
    outbox = app.table(table)
    return select(func.nextval(func.pg_get_serial_sequence(outbox.fullname, "id")))


def next_object_identifier(session: Any, app: OutboxApp, table: str | None = None) -> int:
    """A new object identifier, unique in ``table`` (the app's first when omitted), taken
    with ``session`` (a SQLAlchemy ``Session`` or ``Connection``).

    It comes from the table's ``id`` sequence: no other call returns it, so a row that carries
    it never coalesces with another row that carries a minted identifier. Give every row of
    such a category a minted identifier; a row with any other object identifier (a primary
    key) could equal one. The value is used up even if the transaction rolls back, and row ids
    skip it (ids only order rows; the gaps are harmless). The database role needs ``USAGE`` on
    the sequence (``pg_get_serial_sequence('<table>', 'id')``).
    """
    result = sync_result(session.execute(_next_value(app, table)), "next_object_identifier")
    return int(result.scalar_one())


async def next_object_identifier_async(
    session: Any, app: OutboxApp, table: str | None = None
) -> int:
    """:func:`next_object_identifier` for an ``AsyncSession`` or ``AsyncConnection``."""
    result = await session.execute(_next_value(app, table))
    return int(result.scalar_one())
