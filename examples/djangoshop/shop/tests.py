"""The example's tests (pytest-django): ``pytest examples/djangoshop`` from the repository root,
with PostgreSQL named by PGHOST, PGPORT, PGUSER and PGPASSWORD.

pytest-django creates the test database with the migrations (the outbox table included). The
models and the views write rows without a worker, and drain_outbox_django runs the handlers in
the test. The requests that wait for their rows run against the app's worker, started in this
process on the test database (outbox_worker_django), with Temporal from outbox-bridge's pytest
plugin: at OUTBOX_TEST_TEMPORAL_ADDRESS, else a dev server in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from examples.djangoshop.shop.models import Invitation, Organization, Project, SearchEntry
from examples.djangoshop.shop.outbox import Category, Scope, app
from outbox_bridge.contrib.django.flush import flush_report
from outbox_bridge.contrib.django.testing import drain_outbox_django, outbox_worker_django
from outbox_bridge.testing import OutboxWorker, TemporalServer


def outbox_rows() -> list[tuple[int, int, int, int]]:
    """(scope, shard, category, object) of the rows waiting in the outbox table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT shard_scope, shard_identifier, category, object_identifier "
            "FROM shop_outbox ORDER BY id"
        )
        return [tuple(row) for row in cursor.fetchall()]


def post(client: Client, path: str, **body: Any) -> Any:
    return client.post(path, json.dumps(body), content_type="application/json")


# -- without a worker: the rows are written, and wait in the table ------------------------------
#
# Transactional tests: the rows commit, as in production. Django empties the outbox table after
# each of them, with the model tables, so each test sees only its own rows, in any order.


@pytest.mark.django_db(transaction=True)
def test_saving_and_deleting_models_writes_rows() -> None:
    with transaction.atomic():
        organization = Organization.objects.create(name="acme")
        project = Project.objects.create(organization=organization, name="apollo")
    org, pk = organization.pk, project.pk
    organization.delete()  # the project goes with it: two more rows
    scope = Scope.ORGANIZATION
    assert outbox_rows() == [
        (scope, org, Category.ORGANIZATION_UPDATE, org),
        (scope, org, Category.PROJECT_UPDATE, pk),
        (scope, org, Category.PROJECT_UPDATE, pk),
        (scope, org, Category.ORGANIZATION_UPDATE, org),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_failed_request_writes_nothing() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Organization.objects.create(name="acme")
        raise RuntimeError("the request failed")
    assert outbox_rows() == []


@pytest.mark.django_db(transaction=True)
def test_the_handlers_index_what_the_models_wrote() -> None:
    with transaction.atomic():
        organization = Organization.objects.create(name="acme")
        project = Project.objects.create(organization=organization, name="apollo")
        project.name = "apollo 11"
        project.save()  # coalesces with the project's first row
    report = drain_outbox_django(app)  # the handlers, in this test's thread
    assert (report.handled, report.coalesced) == (2, 1)
    assert outbox_rows() == []
    indexed = SearchEntry.objects.order_by("kind").values_list("kind", "object_id", "title")
    assert list(indexed) == [
        ("organization", organization.pk, "acme"),
        ("project", project.pk, "apollo 11"),
    ]


# -- with a worker: the app's worker on the test database ------------------------------------------


@pytest.fixture(autouse=True)
def patient_flushes(settings: Any) -> None:
    """The views wait up to a minute here, not the app's 10 s: on a busy CI machine a handler
    call can take longer than a request should wait in production."""
    settings.OUTBOX_BRIDGE = {**settings.OUTBOX_BRIDGE, "FLUSH_TIMEOUT": 60}


@pytest.fixture(scope="session")
def worker(django_db_setup: None, outbox_temporal: TemporalServer) -> Iterator[OutboxWorker]:
    """The app's worker, in this process, on the test database, until the tests are done; the
    views' flushes go to it."""
    with outbox_worker_django(temporal_address=outbox_temporal.address) as running:
        yield running


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("worker")
def test_requests_answer_once_the_search_index_has_their_changes() -> None:
    client = Client()
    created = post(client, "/organizations", name="acme")
    assert created.status_code == 201, created.content
    organization = created.json()
    shard = f"ORGANIZATION:{organization['id']}"
    assert organization["handled"] is True
    assert organization["shards"] == {shard: "handled"}

    created = post(client, f"/organizations/{organization['id']}/projects", name="apollo")
    assert created.status_code == 201
    assert created.json()["shards"] == {shard: "handled"}
    # The handlers indexed both before the answers: the search finds them at once.
    found = client.get("/search", {"q": "a"}).json()["results"]
    assert found == [
        {"kind": "organization", "id": organization["id"], "title": "acme"},
        {"kind": "project", "id": created.json()["id"], "title": "apollo"},
    ]
    assert post(client, "/organizations/0/projects", name="x").status_code == 404


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("worker")
def test_an_invitation_is_sent_before_the_answer() -> None:
    client = Client()
    organization = post(client, "/organizations", name="acme").json()["id"]
    invited = post(client, f"/organizations/{organization}/invitations", email="ada@example.com")
    assert invited.status_code == 201
    report = flush_report(invited)
    assert report is not None and report.handled
    sent = Invitation.objects.get(pk=invited.json()["id"]).sent_at
    assert sent is not None
    assert outbox_rows() == []
