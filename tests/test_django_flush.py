"""Waiting after the commit in Django (outbox_bridge.contrib.django.flush): views, contexts and
the middleware wait until the rows that committed are handled, by a worker running in a thread
of this process (tests/django_support.py) on the Django test database; rolled-back rows are
not waited for, the wait comes after every on_commit callback, and each database's rows reach
their own worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.http import JsonResponse
from django.test import AsyncClient, Client

from outbox_bridge import FlushReport, FlushResult
from outbox_bridge.contrib.django.flush import flush_report, outbox_context
from outbox_bridge.contrib.django.testing import outbox_worker_django
from outbox_bridge.contrib.django.writes import write_row
from outbox_bridge.registry import FlushRoute
from outbox_bridge.testing import OutboxWorker, worker_settings
from outbox_bridge.workflows.models import FlushOutcome, HandlerFailure, HeadGroup, SkipInfo
from tests.django_app.outbox import app, archive_app, archive_recorder, recorder
from tests.django_support import next_identifier
from tests.harness import Category, Recorder

MIDDLEWARE = ["outbox_bridge.contrib.django.flush.OutboxFlushMiddleware"]


# The workers' partitions never idle out: the tests' rows come in bursts far apart.
SETTINGS = {"idle_timeout": 0}


@pytest.fixture(scope="module")
def worker(servers, django_db_setup) -> Iterator[OutboxWorker]:
    """The worker of ``app``, on the default test database."""
    with outbox_worker_django(
        app, temporal_address=servers.temporal_address, settings=worker_settings(**SETTINGS)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def archive_worker(servers, django_db_setup) -> Iterator[OutboxWorker]:
    """The worker of ``archive_app``, on the ``other`` test database."""
    with outbox_worker_django(
        archive_app,
        temporal_address=servers.temporal_address,
        using="other",
        settings=worker_settings(**SETTINGS),
    ) as running:
        yield running


def write(shard: int, *, using: str | None = None) -> int:
    return write_row(
        app,
        category=Category.ORGANIZATION_UPDATE,
        shard_identifier=shard,
        object_identifier=shard,
        using=using,
    )


def outcomes(results: list[FlushResult]) -> dict[str, str]:
    return {result.shard: result.outcome for result in results}


def handled(*shards: int) -> dict[str, str]:
    return {f"ORGANIZATION:{shard}": "handled" for shard in shards}


def called(shard: int, calls: Recorder = recorder) -> bool:
    return any(call.object_identifier == shard for call in calls.calls)


def wait_for_call(shard: int, calls: Recorder = recorder, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not called(shard, calls):
        assert time.monotonic() < deadline, f"no handler call for {shard} within {timeout} s"
        time.sleep(0.05)


pytestmark = pytest.mark.usefixtures("worker")


@pytest.mark.django_db(transaction=True)
def test_a_decorated_view_answers_once_its_rows_are_handled() -> None:
    shard = next_identifier()
    response = Client().get(f"/flushed/{shard}")
    assert response.status_code == 200
    report = flush_report(response)
    assert report is not None and report.handled
    assert outcomes(report.results) == handled(shard)
    assert called(shard)  # before the answer
    # Without the decorator the same view answers at once.
    plain = Client().get(f"/write/{next_identifier()}")
    assert plain.status_code == 200 and flush_report(plain) is None


@pytest.mark.django_db(transaction=True)
def test_a_view_answers_with_its_flush_report_as_json() -> None:
    shard = next_identifier()
    response = Client().get(f"/report/{shard}")
    assert response.status_code == 200, response.content
    assert response.json() == {
        "handled": True,
        "results": [
            {
                "shard": f"ORGANIZATION:{shard}",
                "outcome": "handled",
                "head": None,
                "blocked_since": None,
                "error": None,
                "skip": None,
                "deferred_until": None,
                "detail": None,
                "paused": None,
            }
        ],
        "not_committed": [],
    }


def test_every_field_of_a_flush_report_is_json() -> None:
    head = HeadGroup(1, "PROJECT_UPDATE", 7, 10, 12, 3)
    report = FlushReport(
        [
            FlushResult(
                "ORGANIZATION:1",
                FlushOutcome.BLOCKED,
                head,
                "2026-01-02T03:04:05+00:00",
                HandlerFailure("ValueError", "no such project"),
            ),
            FlushResult(
                "ORGANIZATION:2", FlushOutcome.SKIPPED, skip=SkipInfo("maintenance", "ada")
            ),
        ],
        not_committed=["ORGANIZATION:3"],
    )
    answer = json.loads(JsonResponse(report.as_dict()).content)
    assert answer["handled"] is False and answer["not_committed"] == ["ORGANIZATION:3"]
    blocked, skipped = answer["results"]
    assert blocked["outcome"] == "blocked" and skipped["outcome"] == "skipped"
    assert blocked["head"] == {
        "category": 1,
        "category_name": "PROJECT_UPDATE",
        "object_identifier": 7,
        "first_id": 10,
        "last_id": 12,
        "rows": 3,
    }
    assert blocked["error"] == {"error_type": "ValueError", "message": "no such project"}
    assert skipped["skip"] == {"reason": "maintenance", "by": "ada", "at": None, "via": None}
    assert json.loads(json.dumps(report.as_dict())) == answer  # plain json too


@pytest.mark.django_db(transaction=True)
def test_rows_that_rolled_back_are_not_waited_for() -> None:
    failed, kept, in_savepoint = next_identifier(), next_identifier(), next_identifier()
    with outbox_context(flush=True) as outbox:
        with pytest.raises(RuntimeError), transaction.atomic():
            write(failed)
            raise RuntimeError("the transaction rolls back")
        with transaction.atomic():
            write(kept)
            with pytest.raises(RuntimeError), transaction.atomic():
                write(in_savepoint)
                raise RuntimeError("the savepoint rolls back")
    assert outcomes(outbox.report.results) == handled(kept)
    assert outbox.report.not_committed == []
    assert not called(failed) and not called(in_savepoint)


@pytest.mark.django_db(transaction=True)
def test_the_flush_waits_after_every_on_commit_callback() -> None:
    first, follow_up = next_identifier(), next_identifier()
    order: list[str] = []

    def write_a_follow_up() -> None:
        order.append("follow-up")
        with transaction.atomic():  # a row of its own, committed in the callback
            write(follow_up)

    with outbox_context(flush=True) as outbox:
        with transaction.atomic():
            transaction.on_commit(lambda: order.append("before"))
            write(first)
            transaction.on_commit(write_a_follow_up)
            assert not called(first)
        order.append("committed")
    assert order == ["before", "follow-up", "committed"]
    assert outcomes(outbox.report.results) == handled(first, follow_up)


@pytest.mark.django_db(transaction=True)
def test_a_context_that_ends_before_the_commit_waits_for_nothing(caplog) -> None:
    shard = next_identifier()
    with transaction.atomic():
        with outbox_context(flush=True) as outbox:
            write(shard)
    assert outbox.report.results == []
    assert outbox.report.not_committed == [f"ORGANIZATION:{shard}"]
    assert "ended before its rows committed" in caplog.text
    wait_for_call(shard)  # handled all the same, asynchronously


@pytest.mark.django_db(transaction=True)
def test_nested_contexts_wait_like_outbox_context() -> None:
    not_waited, committed_later = next_identifier(), next_identifier()
    with outbox_context(flush=True) as outer:
        with transaction.atomic():
            with outbox_context():  # flush=False: its rows are not waited for
                write(not_waited)
            with outbox_context(flush=True) as inner:
                write(committed_later)
        assert inner.report.results == []
        assert inner.report.not_committed == []
    # The enclosing context waited for the inner one's row, which committed after it ended.
    assert outcomes(outer.report.results) == handled(committed_later)


@pytest.mark.django_db(transaction=True)
def test_with_atomic_requests_the_middleware_waits_after_the_request_s_commit(
    settings, monkeypatch
) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    shard = next_identifier()
    # The decorator runs inside the request's transaction: its rows have not committed yet.
    decorated = flush_report(Client().get(f"/flushed-request-transaction/{shard}"))
    assert decorated is not None
    assert decorated.results == [] and decorated.not_committed == [f"ORGANIZATION:{shard}"]
    # The middleware runs outside it.
    settings.MIDDLEWARE = MIDDLEWARE
    shard = next_identifier()
    report = flush_report(Client().get(f"/request-transaction/{shard}"))
    assert report is not None and outcomes(report.results) == handled(shard)
    assert called(shard)


@pytest.mark.django_db(transaction=True)
def test_the_middleware_waits_for_model_saves_and_for_nothing_else(settings) -> None:
    settings.MIDDLEWARE = MIDDLEWARE
    response = Client().get("/projects/apollo")
    organization = response.json()["organization"]
    report = flush_report(response)
    assert report is not None and outcomes(report.results) == handled(organization)
    assert called(response.json()["project"])  # the project's row, on its organization's shard
    start = time.monotonic()
    nothing = flush_report(Client().get("/missing"))
    assert nothing is not None and nothing.results == [] and time.monotonic() - start < 1


@pytest.fixture
async def async_db(transactional_db: None) -> Any:
    yield
    await sync_to_async(connections.close_all, thread_sensitive=True)()


async def test_an_async_view_and_the_async_middleware_wait(async_db, settings) -> None:
    shard = next_identifier()
    response = await AsyncClient().get(f"/async/{shard}")
    assert response.status_code == 200
    report = flush_report(response)
    assert report is not None and outcomes(report.results) == handled(shard)
    settings.MIDDLEWARE = MIDDLEWARE
    shard = next_identifier()
    response = await AsyncClient().get(f"/write/{shard}")  # a sync view, under ASGI
    report = flush_report(response)
    assert report is not None and outcomes(report.results) == handled(shard)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.usefixtures("archive_worker")
def test_each_database_s_rows_are_flushed_through_their_own_app() -> None:
    archived, main, rolled_back = next_identifier(), next_identifier(), next_identifier()

    def archive(shard: int) -> None:
        write_row(
            archive_app,
            category=Category.ORGANIZATION_UPDATE,
            shard_identifier=shard,
            object_identifier=shard,
            using="other",
        )

    with outbox_context(flush=True) as outbox:
        with transaction.atomic(using="other"):
            archive(archived)
            with pytest.raises(RuntimeError), transaction.atomic():
                write(rolled_back)  # default's transaction rolls back, other's commits
                raise RuntimeError("default rolls back")
        with transaction.atomic():
            write(main)
    assert outcomes(outbox.report.results) == handled(archived, main)
    assert called(archived, archive_recorder) and not called(archived)
    assert called(main) and not called(main, archive_recorder)
    assert not called(rolled_back)


@pytest.mark.django_db(transaction=True)
def test_the_flush_is_configured_from_the_django_settings(settings, worker) -> None:
    app.flush_route = FlushRoute()
    try:
        settings.OUTBOX_BRIDGE = {
            "APP": "tests.django_app.outbox:app",
            "TEMPORAL_ADDRESS": worker.settings.temporal_address,
            "TASK_QUEUE": worker.settings.task_queue,
        }
        shard = next_identifier()
        with outbox_context(flush=True) as outbox, transaction.atomic():
            write(shard)
        assert outcomes(outbox.report.results) == handled(shard)
        assert app.flush_route.settings is not None
        assert app.flush_route.settings.task_queue == worker.settings.task_queue

        # Settings that do not fit: the rows committed, the flush answers unavailable.
        app.flush_route = FlushRoute()
        settings.OUTBOX_BRIDGE = {"APP": "tests.django_app.outbox:app", "PARTITIONS": 0}
        shard = next_identifier()
        with outbox_context(flush=True) as outbox, transaction.atomic():
            write(shard)
        [result] = outbox.report.results
        assert result.outcome == "unavailable"
        assert result.detail is not None and "PARTITIONS" in result.detail
        wait_for_call(shard)
    finally:
        app.flush_route = FlushRoute()
        app.configure_flush(worker.settings)
