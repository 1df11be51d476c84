"""Draining the outbox in a Django test, without a worker or Temporal.

:func:`drain_outbox_django` runs the testing toolkit's in-process drain
(:func:`outbox_bridge.testing.drain_outbox`) against a Django database: it builds a SQLAlchemy
engine for the same database (the test database, in a test) and hands it over.
:func:`drain_outbox_django_async` does the same in an async test.

The rows must have committed, as for a worker: run the test with
``@pytest.mark.django_db(transaction=True)`` (or a ``TransactionTestCase``). A test in a
transaction that never commits (the ``db`` fixture, ``TestCase``) keeps its rows where no other
connection sees them, and is refused.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge.contrib.django.conf import database_url
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.testing import DrainReport, drain_outbox, drain_outbox_async


class DrainOptions(TypedDict, total=False):
    """The options of :func:`~outbox_bridge.testing.drain_outbox`, passed on as they are."""

    shard: str | None
    table: str | None
    run_deferred: bool
    raise_on_failure: bool


def drain_outbox_django(
    app: OutboxApp, using: str | None = None, **options: Unpack[DrainOptions]
) -> DrainReport:
    """Handle the committed rows of ``app`` on the Django database ``using`` (default
    ``"default"``) in the calling thread: :func:`~outbox_bridge.testing.drain_outbox` with an
    engine on that database, disposed afterwards, and the same options (``shard``, ``table``,
    ``run_deferred``, ``raise_on_failure``) and report. Handlers that use the ORM run in the
    test's thread, on the test database."""
    engine = create_engine(_committed_rows_url(using))
    try:
        return drain_outbox(app, engine, **options)
    finally:
        engine.dispose()


async def drain_outbox_django_async(
    app: OutboxApp, using: str | None = None, **options: Unpack[DrainOptions]
) -> DrainReport:
    """:func:`drain_outbox_django` in the running event loop
    (:func:`~outbox_bridge.testing.drain_outbox_async` with an async engine). Async handlers run
    in this loop; plain-def handlers in a thread, where the ORM has a connection of its own."""
    engine = create_async_engine(_committed_rows_url(using))
    try:
        return await drain_outbox_async(app, engine, **options)
    finally:
        await engine.dispose()


def _committed_rows_url(using: str | None) -> str:
    """The URL of the database ``using``, once its rows are known to be committed."""
    alias = using or DEFAULT_DB_ALIAS
    if connections[alias].in_atomic_block:
        raise ConfigurationError(
            f"the rows written on {alias!r} have not committed: the test runs inside a "
            "transaction (django_db without transaction=True, or TestCase); mark it "
            "django_db(transaction=True) so that the drain sees them"
        )
    return database_url(alias)
