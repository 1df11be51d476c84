"""drain_outbox_django: the testing toolkit's in-process drain on a Django database. Its engine
is on the test database and disposed afterwards; a test whose rows have not committed is
refused; the rows a view committed, on either database, are handled in the test's thread, a
failing handler fails the drain with its row kept, and an async test drains in its loop."""

from __future__ import annotations

import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.test import Client
from sqlalchemy import Engine, text

from outbox_bridge import ConfigurationError, OutboxApp, OutboxMessage
from outbox_bridge.contrib.django import testing
from outbox_bridge.contrib.django.testing import (
    UncommittedTransactionError,
    drain_outbox_django,
    drain_outbox_django_async,
)
from outbox_bridge.contrib.django.writes import write_row, write_row_async
from outbox_bridge.testing import DrainReport, HandlerFailedError
from tests.django_app.outbox import app, archive_app, archive_recorder, recorder
from tests.django_support import ARCHIVE, next_identifier, rows
from tests.harness import Category


@pytest.mark.django_db
def test_a_drain_in_the_transaction_of_a_test_case_is_refused() -> None:
    with pytest.raises(UncommittedTransactionError, match=r"django_db\(transaction=True\)"):
        drain_outbox_django(app)


@pytest.mark.django_db(transaction=True)
def test_a_drain_inside_atomic_is_refused() -> None:
    with pytest.raises(UncommittedTransactionError, match="drain after the atomic block"):
        with transaction.atomic():
            drain_outbox_django(app)
    assert issubclass(UncommittedTransactionError, ConfigurationError)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_drain_gets_an_engine_on_the_test_database(monkeypatch) -> None:
    seen: list[tuple[OutboxApp, Engine, Any, str]] = []
    drained = DrainReport()

    def drain_outbox(given: OutboxApp, bind: Engine, **options: Any) -> DrainReport:
        with bind.connect() as conn:
            database = conn.execute(text("SELECT current_database()")).scalar_one()
        seen.append((given, bind, options, database))
        return drained

    monkeypatch.setattr(testing, "drain_outbox", drain_outbox)
    assert drain_outbox_django(app, using="other", shard="ORGANIZATION:1") is drained
    [(given, bind, options, database)] = seen
    assert given is app and isinstance(bind, Engine)
    assert options == {"shard": "ORGANIZATION:1"}
    assert database == connections["other"].settings_dict["NAME"]
    assert others_connected("other") == 0  # disposed: nothing else holds the test database


def others_connected(alias: str) -> int:
    """Connections to the database of ``alias`` besides Django's (closing ones given time)."""
    deadline = time.monotonic() + 5
    while True:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            (count,) = cursor.fetchone() or (0,)
        if count == 0 or time.monotonic() > deadline:
            return int(count)
        time.sleep(0.05)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_rows_written_by_a_view_are_handled_in_the_test() -> None:
    shard, archived = next_identifier(), next_identifier()
    assert Client().get(f"/write/{shard}").status_code == 200  # committed by the view
    with transaction.atomic(using="other"):
        write_row(
            archive_app,
            category=Category.ORGANIZATION_UPDATE,
            shard_identifier=archived,
            object_identifier=archived,
            using="other",
        )

    report = drain_outbox_django(app)
    assert report.shard(f"ORGANIZATION:{shard}").handled == 1
    assert any(call.object_identifier == shard for call in recorder.calls)
    assert rows() == []
    assert len(rows(ARCHIVE, using="other")) == 1  # another database, another app

    report = drain_outbox_django(archive_app, using="other")
    assert [message.object_identifier for message in report.messages] == [archived]
    assert any(call.object_identifier == archived for call in archive_recorder.calls)
    assert rows(ARCHIVE, using="other") == []


@pytest.mark.django_db(transaction=True)
def test_a_failing_handler_fails_the_drain_and_keeps_its_row() -> None:
    shard = next_identifier()

    async def fail(message: OutboxMessage) -> None:
        raise RuntimeError(f"cannot handle {message.object_identifier}")

    recorder.behaviour[int(Category.PROJECT_UPDATE)] = fail
    try:
        with transaction.atomic():
            written = write_row(
                app,
                category=Category.PROJECT_UPDATE,
                shard_identifier=shard,
                object_identifier=shard,
            )
        with pytest.raises(HandlerFailedError) as failed:
            drain_outbox_django(app)
        assert isinstance(failed.value.__cause__, RuntimeError)
        assert failed.value.failure.message.id == written
        assert [row["id"] for row in rows()] == [written]
    finally:
        del recorder.behaviour[int(Category.PROJECT_UPDATE)]


@pytest.fixture
async def async_db(transactional_db: None) -> Any:
    """An async transactional test: the connections of sync_to_async's thread are closed
    afterwards (else the test database cannot be dropped)."""
    yield
    await sync_to_async(connections.close_all, thread_sensitive=True)()


async def test_an_async_test_drains_in_its_event_loop(async_db) -> None:
    shard = next_identifier()
    written = await write_row_async(
        app, category=Category.ORGANIZATION_UPDATE, shard_identifier=shard, object_identifier=shard
    )
    report = await drain_outbox_django_async(app)
    assert [message.id for message in report.messages] == [written]
    assert any(call.object_identifier == shard for call in recorder.calls)
    assert await sync_to_async(rows, thread_sensitive=True)() == []
