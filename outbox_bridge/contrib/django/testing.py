"""Draining the outbox in a Django test, without a worker or Temporal.

:func:`drain_outbox_django` runs the testing toolkit's in-process drain
(:func:`outbox_bridge.testing.drain_outbox`) against a Django database: it builds a SQLAlchemy
engine for the same database (the test database, in a test) and hands it over.

The rows must have committed, as for a worker: run the test with
``@pytest.mark.django_db(transaction=True)`` (or a ``TransactionTestCase``). A test in a
transaction that never commits (the ``db`` fixture, ``TestCase``) keeps its rows where no other
connection sees them, and is refused.
"""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy import create_engine

from outbox_bridge.contrib.django.conf import database_url
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.testing import DrainReport, drain_outbox


def drain_outbox_django(
    app: OutboxApp,
    using: str | None = None,
    *,
    shard: str | None = None,
    table: str | None = None,
    run_deferred: bool = False,
    raise_on_failure: bool = True,
) -> DrainReport:
    """Handle the committed rows of ``app`` on the Django database ``using`` (default
    ``"default"``) in the calling thread: :func:`~outbox_bridge.testing.drain_outbox` with an
    engine on that database, disposed afterwards, and the same keyword arguments and report.
    Handlers that use the ORM run in the test's thread, on the test database."""
    alias = using or DEFAULT_DB_ALIAS
    if connections[alias].in_atomic_block:
        raise ConfigurationError(
            f"the rows written on {alias!r} have not committed: the test runs inside a "
            "transaction (django_db without transaction=True, or TestCase); mark it "
            "django_db(transaction=True) so that the drain sees them"
        )
    engine = create_engine(database_url(alias))
    try:
        return drain_outbox(
            app,
            engine,
            shard=shard,
            table=table,
            run_deferred=run_deferred,
            raise_on_failure=raise_on_failure,
        )
    finally:
        engine.dispose()
