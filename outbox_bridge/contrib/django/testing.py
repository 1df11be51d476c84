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

from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy import create_engine

from outbox_bridge.contrib.django.conf import database_url
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp

# The testing toolkit's drain, drain_outbox(app, bind) with a SQLAlchemy Engine, Connection or
# Session as bind. Until a release ships outbox_bridge.testing, drain_outbox_django says so.
try:
    from outbox_bridge.testing import (  # type: ignore[import-not-found, unused-ignore]
        drain_outbox,
    )
except ImportError:  # an outbox-bridge without the testing toolkit
    drain_outbox = None


def drain_outbox_django(app: OutboxApp, using: str | None = None, **options: Any) -> Any:
    """``drain_outbox(app, engine, **options)`` with an engine on the Django database ``using``
    (default ``"default"``), disposed afterwards; returns what ``drain_outbox`` returns."""
    alias = using or DEFAULT_DB_ALIAS
    if connections[alias].in_atomic_block:
        raise ConfigurationError(
            f"the rows written on {alias!r} have not committed: the test runs inside a "
            "transaction (django_db without transaction=True, or TestCase); mark it "
            "django_db(transaction=True) so that the drain sees them"
        )
    if drain_outbox is None:
        raise ConfigurationError(
            "drain_outbox_django needs outbox_bridge.testing (the testing toolkit), which this "
            "version of outbox-bridge does not have"
        )
    engine = create_engine(database_url(alias))
    try:
        return drain_outbox(app, engine, **options)
    finally:
        engine.dispose()
