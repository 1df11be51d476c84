"""Writing outbox rows with Django's connections (outbox_bridge.contrib.django.writes): the
checks and errors of app.write, inside transaction.atomic() only, committed or rolled back with
the transaction, on any database alias, traced like app.write, and from async code. Real
PostgreSQL (pytest-django's test databases); no worker."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connections, transaction
from django.db.transaction import TransactionManagementError
from opentelemetry import trace

from outbox_bridge import ConfigurationError, InvalidRowError, OutboxError, RegistryError
from outbox_bridge.contrib.django.writes import NotInTransactionError, write_row, write_row_async
from tests.django_app.models import Note
from tests.django_app.outbox import app, archive_app
from tests.django_support import ARCHIVE, OUTBOX, rows
from tests.harness import Category, Scope
from tests.otel import span_exporter


@pytest.fixture
def empty_outbox(request: pytest.FixtureRequest, django_db_blocker: Any) -> None:
    """The outbox tables of the test's databases start empty (Django's flush between tests
    only empties its models' tables)."""
    marker = request.node.get_closest_marker("django_db")
    aliases = (marker.kwargs.get("databases") if marker else None) or ["default"]
    with django_db_blocker.unblock():
        for alias in aliases:
            with connections[alias].cursor() as cursor:
                cursor.execute(f"DELETE FROM {OUTBOX}; DELETE FROM {ARCHIVE}")


def write(**row: Any) -> int:
    values: dict[str, Any] = {
        "category": Category.PROJECT_UPDATE,
        "shard_identifier": 4,
        "object_identifier": 7,
    }
    values.update(row)
    return write_row(app, **values)


# -- the checks of app.write ---------------------------------------------------------------------


class NeverRuns:
    """A session app.write must not reach: the row is refused before anything runs."""

    def execute(self, statement: object) -> None:
        raise AssertionError("app.write ran a refused row")


REFUSED: list[dict[str, Any]] = [
    {"category": 99},
    {"category": "PROJECT_UPDATE"},
    {"category": Category.PROJECT_UPDATE, "shard_scope": Scope.USER},
    {"shard_identifier": 2**63},
    {"shard_identifier": True},
    {"object_identifier": 1.5},
    {"payload": {"when": datetime.now(UTC)}},
    {"payload": {"text": "nul \x00"}},
    {"payload": float("nan")},
    {"payload": {"blob": "x" * 2**20}},
    {"region": "eu"},
    {"scheduled_for": datetime(2030, 1, 1)},
    {"scheduled_for": "tomorrow"},
    {"table": "elsewhere"},
]


@pytest.mark.django_db
@pytest.mark.parametrize("row", REFUSED, ids=lambda row: ",".join(row))
def test_a_row_is_refused_like_app_write_refuses_it(row: dict[str, Any]) -> None:
    values: dict[str, Any] = {
        "category": Category.PROJECT_UPDATE,
        "shard_identifier": 4,
        "object_identifier": 7,
        **row,
    }
    with pytest.raises((InvalidRowError, RegistryError)) as expected:
        app.write(NeverRuns(), **values)
    with transaction.atomic(), pytest.raises(type(expected.value)) as refused:
        write_row(app, **values)
    assert str(refused.value) == str(expected.value)
    assert rows() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("empty_outbox")
def test_a_row_commits_with_the_transaction_and_carries_its_values() -> None:
    payload = {"name": "Zürich ✓", "nested": [1, {"a": None}], "quote": "'%s'"}
    with transaction.atomic():
        Note.objects.create(text="beside the row")
        first = write(payload=payload)
        later = write(
            category=Category.USER_UPDATE,
            shard_identifier=9,
            object_identifier=9,
            scheduled_for=timedelta(hours=1),
        )
        assert [r["id"] for r in rows()] == [first, later]  # visible inside the transaction
    assert later > first
    found = rows()
    assert [
        (r["shard_scope"], r["shard_identifier"], r["category"], r["object_identifier"])
        for r in found
    ] == [
        (Scope.ORGANIZATION, 4, Category.PROJECT_UPDATE, 7),
        (Scope.USER, 9, Category.USER_UPDATE, 9),
    ]
    assert found[0]["payload"] == payload
    assert found[1]["payload"] is None
    assert found[1]["scheduled_for"] > datetime.now(UTC) + timedelta(minutes=59)
    assert [r["trace_context"] for r in found] == [None, None]  # no span around the writes


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("empty_outbox")
def test_a_row_rolls_back_with_the_transaction_and_with_its_savepoint() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Note.objects.create(text="rolled back")
        write(object_identifier=1)
        raise RuntimeError("the request failed")
    with transaction.atomic():
        kept = write(object_identifier=2)
        with pytest.raises(RuntimeError), transaction.atomic():
            write(object_identifier=3)
            raise RuntimeError("the inner block failed")
    assert [(r["id"], r["object_identifier"]) for r in rows()] == [(kept, 2)]
    assert not Note.objects.exists()


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.usefixtures("empty_outbox")
def test_outside_atomic_nothing_is_written() -> None:
    with pytest.raises(
        NotInTransactionError, match=r"inside transaction.atomic\(using='default'\)"
    ) as info:
        write()
    assert isinstance(info.value, OutboxError)
    assert isinstance(info.value, TransactionManagementError)
    with transaction.atomic(using="other"), pytest.raises(NotInTransactionError):
        write()  # atomic on another database is not atomic on this one
    assert rows() == []


@pytest.mark.django_db
def test_a_database_that_is_not_postgresql_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(connections["default"], "vendor", "sqlite")
    with transaction.atomic(), pytest.raises(ConfigurationError, match="is sqlite"):
        write()


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.usefixtures("empty_outbox")
def test_each_database_alias_writes_and_commits_its_own_rows() -> None:
    with transaction.atomic(using="other"):
        archived = write_row(
            archive_app,
            category=Category.ORGANIZATION_UPDATE,
            shard_identifier=5,
            object_identifier=5,
            using="other",
        )
        with pytest.raises(RuntimeError), transaction.atomic():
            write(object_identifier=6)
            raise RuntimeError("default rolls back, other commits")
    assert [r["id"] for r in rows(ARCHIVE, using="other")] == [archived]
    assert rows(ARCHIVE) == rows() == rows(using="other") == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("empty_outbox")
def test_a_row_carries_the_trace_context_of_the_span_it_is_written_in() -> None:
    with span_exporter() as spans:
        with trace.get_tracer("tests").start_as_current_span("request"), transaction.atomic():
            inside = write()
        with transaction.atomic():
            outside = write()
        [producer] = [s for s in spans.get_finished_spans() if s.name.startswith("outbox.write")]
    assert producer.name == "outbox.write PROJECT_UPDATE"
    assert producer.attributes is not None and producer.attributes["outbox.id"] == inside
    context = producer.context
    assert context is not None
    traceparent = (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    )
    stored = {r["id"]: r["trace_context"] for r in rows()}
    assert stored == {inside: {"traceparent": traceparent}, outside: None}


# -- async ---------------------------------------------------------------------------------------


@pytest.fixture
async def async_db(transactional_db: None, empty_outbox: None) -> Any:
    """A transactional test whose async code used the database through sync_to_async: that
    thread's connections are closed afterwards (else the test database cannot be dropped)."""
    yield
    await sync_to_async(connections.close_all, thread_sensitive=True)()


async def test_write_row_async_commits_a_row_of_its_own(async_db) -> None:
    row_id = await write_row_async(
        app, category=Category.ORGANIZATION_UPDATE, shard_identifier=3, object_identifier=3
    )
    found = await sync_to_async(rows, thread_sensitive=True)()
    assert [(r["id"], r["object_identifier"]) for r in found] == [(row_id, 3)]
    with pytest.raises(InvalidRowError):
        await write_row_async(app, category=99, shard_identifier=1, object_identifier=1)


async def test_write_row_async_nests_in_the_caller_s_transaction(async_db) -> None:
    def fails_after_writing() -> None:
        with transaction.atomic():
            Note.objects.create(text="one transaction")
            async_to_sync(write_row_async)(
                app, category=Category.ORGANIZATION_UPDATE, shard_identifier=8, object_identifier=8
            )
            raise RuntimeError("the whole transaction rolls back")

    with pytest.raises(RuntimeError):
        await sync_to_async(fails_after_writing, thread_sensitive=True)()
    assert await sync_to_async(rows, thread_sensitive=True)() == []
