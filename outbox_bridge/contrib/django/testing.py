"""The outbox in a Django test: drained without a worker (:func:`drain_outbox_django`), or
handled by the app's worker on the test database (:func:`outbox_worker_django`). Either needs
committed rows (:class:`UncommittedTransactionError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Unpack

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.transaction import TransactionManagementError
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge.config import OutboxSettings
from outbox_bridge.contrib.django.conf import (
    database_url,
    outbox_app,
    outbox_database,
    outbox_settings,
)
from outbox_bridge.contrib.django.handlers import with_django_connections
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.testing import (
    DrainReport,
    OutboxDatabase,
    OutboxWorker,
    PostgresServer,
    drain_outbox,
    drain_outbox_async,
    worker_settings,
)
from outbox_bridge.testing.drain import DrainOptions
from outbox_bridge.testing.servers import EventLoopThread


class UncommittedTransactionError(ConfigurationError, TransactionManagementError):
    """A drain called inside a transaction that has not committed (``transaction.atomic()``, or
    a ``TestCase`` or ``django_db`` without ``transaction=True``, which never commit): its own
    connection cannot see those rows. Both a :class:`~outbox_bridge.ConfigurationError` and
    Django's ``TransactionManagementError``."""


def drain_outbox_django(
    app: OutboxApp, using: str | None = None, **options: Unpack[DrainOptions]
) -> DrainReport:
    """Handle the committed rows of ``app`` on the Django database ``using`` (default
    ``"default"``) in the calling thread: :func:`~outbox_bridge.testing.drain_outbox` on that
    database, with its options and report. ORM handlers run in the test's thread and database."""
    engine = create_engine(_committed_rows_url(using))
    try:
        return drain_outbox(app, engine, **options)
    finally:
        engine.dispose()


async def drain_outbox_django_async(
    app: OutboxApp, using: str | None = None, **options: Unpack[DrainOptions]
) -> DrainReport:
    """:func:`drain_outbox_django` in the running event loop
    (:func:`~outbox_bridge.testing.drain_outbox_async`); plain-def handlers run in a thread,
    where the ORM has a connection of its own."""
    engine = create_async_engine(_committed_rows_url(using))
    try:
        return await drain_outbox_async(app, engine, **options)
    finally:
        await engine.dispose()


def _committed_rows_url(using: str | None) -> str:
    """The URL of the database ``using``, once its rows are known to be committed."""
    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    if not connection.in_atomic_block:
        return database_url(alias)
    if any(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks):
        raise UncommittedTransactionError(
            f"drain_outbox_django cannot see the rows written on {alias!r}: the test runs in a "
            "transaction that never commits (TestCase, or django_db without transaction=True); "
            "mark the test @pytest.mark.django_db(transaction=True), or make it a "
            "TransactionTestCase"
        )
    raise UncommittedTransactionError(
        f"drain_outbox_django cannot see the rows written on {alias!r}: it runs inside "
        "transaction.atomic(), whose rows have not committed; drain after the atomic block"
    )


@contextlib.contextmanager
def outbox_worker_django(
    app: OutboxApp | None = None,
    *,
    temporal_address: str | None = None,
    using: str | None = None,
    settings: OutboxSettings | None = None,
) -> Iterator[OutboxWorker]:
    """The worker of ``app`` (default: ``OUTBOX_BRIDGE["APP"]``'s) running in this process, in
    a thread of its own, on the Django database ``using`` (default: the outbox's; in a test, its
    test database). Yields the :class:`~outbox_bridge.testing.OutboxWorker` once it is ready.

    As in ``manage.py outbox_worker``, every handler is wrapped with
    :func:`~outbox_bridge.contrib.django.handlers.with_django_connections`. Meanwhile the app's
    flushes go to this worker. When the block ends, the worker stops and the workflows it left
    running are terminated.

    ``temporal_address`` defaults to the Django settings' ``TEMPORAL_ADDRESS`` (in pytest, pass
    the ``outbox_temporal`` fixture's ``.address``); ``settings`` to
    :func:`~outbox_bridge.testing.worker_settings`, its database and Temporal address replaced.
    """
    app = app if app is not None else outbox_app()
    alias = outbox_database(using)
    address = temporal_address or outbox_settings(using=alias).temporal_address
    if address is None:
        raise ConfigurationError(
            "outbox_worker_django needs a Temporal server: pass temporal_address= (the "
            "outbox_temporal fixture's .address starts a dev server) or set TEMPORAL_ADDRESS"
        )
    app.wrap_handlers(with_django_connections)
    server = PostgresServer(database_url(alias))
    database = OutboxDatabase(server, str(connections[alias].settings_dict["NAME"]))
    loop = EventLoopThread(name="outbox-django-worker")
    route = app.flush_route
    try:
        with OutboxWorker(app, database, address, loop, settings or worker_settings()) as worker:
            app.configure_flush(worker.settings)
            yield worker
    finally:
        app.flush_route = route
        loop.close()
        database.dispose()
        server.stop()
