"""The example's tests (pytest-django): ``pytest examples/djangoshop`` from the repository root,
with PostgreSQL named by PGHOST, PGPORT, PGUSER and PGPASSWORD.

pytest-django creates the test database with the migrations (the outbox table included). The
models and the views write rows without a worker, and drain_outbox_django runs the handlers in
the test. The requests that wait for their rows run
against a real worker: ``manage.py outbox_worker``, started for these tests on the test
database, with Temporal at TEMPORAL_ADDRESS (unset: the worker starts a dev server on
127.0.0.1:7233, where the flushes look for it too).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from examples.djangoshop.shop.models import Invitation, Organization, Project, SearchEntry
from examples.djangoshop.shop.outbox import Category, Scope, app
from outbox_bridge.contrib.django.flush import flush_report
from outbox_bridge.contrib.django.testing import drain_outbox_django

MANAGE = Path(__file__).resolve().parents[1] / "manage.py"


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


@pytest.fixture
def no_rows_left(transactional_db: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM shop_outbox")


@pytest.mark.usefixtures("no_rows_left")
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


@pytest.mark.usefixtures("no_rows_left")
def test_a_failed_request_writes_nothing() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Organization.objects.create(name="acme")
        raise RuntimeError("the request failed")
    assert outbox_rows() == []


@pytest.mark.usefixtures("no_rows_left")
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


# -- with a worker: manage.py outbox_worker --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="session")
def worker(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``manage.py outbox_worker`` on the test database, until the tests are done."""
    port = free_port()
    env = {
        **os.environ,
        "PGDATABASE": str(connection.settings_dict["NAME"]),  # the test database
        "OUTBOX_HEALTH_PORT": str(port),
        "OUTBOX_HEALTH_HOST": "127.0.0.1",
        "OUTBOX_DATA_DIR": str(tmp_path_factory.mktemp("worker")),  # an embedded Temporal's
        "OUTBOX_TASK_QUEUE": os.environ.get("OUTBOX_TASK_QUEUE", f"shop-{uuid.uuid4().hex[:8]}"),
    }
    # The flushes of this process use the worker's task queue.
    os.environ["OUTBOX_TASK_QUEUE"] = env["OUTBOX_TASK_QUEUE"]
    proc = subprocess.Popen([sys.executable, str(MANAGE), "outbox_worker"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready(port):
            assert proc.poll() is None, f"the worker stopped ({proc.returncode})"
            assert time.monotonic() < deadline, "the worker was not ready within 60 s"
            time.sleep(0.2)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
