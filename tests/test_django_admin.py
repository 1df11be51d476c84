"""The outbox in the Django admin (outbox_bridge.contrib.django.admin), through Django's test
client as logged-in staff: the shards listed with their counts and owners, pause, unpause, park
and unpark recorded as the admin user (read back with the command line's reads), users without
the permission refused, bad input refused on the form with nothing changed. Real PostgreSQL
(the Django test database) and the suite's Temporal dev server, which the park and the unpark
tell."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections, transaction
from django.test import Client
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge.config import sqlalchemy_url
from outbox_bridge.contrib.django.admin import admin as outbox_admin
from outbox_bridge.contrib.django.conf import outbox_settings
from outbox_bridge.contrib.django.testing import outbox_worker_django
from outbox_bridge.contrib.django.writes import write_row
from outbox_bridge.db.parked import ParkedGroup, read_parked
from outbox_bridge.db.pauses import Pause, read_pauses
from outbox_bridge.db.schema import owners_of, parked_of, pauses_of
from outbox_bridge.testing import worker_settings
from tests.django_app.outbox import app, recorder
from tests.django_support import OUTBOX, next_identifier
from tests.harness import Category, Scope

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/admin/outbox_bridge/outbox/"
TABLE = app.table(OUTBOX)


@pytest.fixture(autouse=True)
def outbox(settings: Any, servers: Any) -> Iterator[None]:
    """The app of the tests' project, the suite's Temporal; the outbox and its pause, parked
    and owner tables empty before and after (Django's flush empties only the outbox)."""
    settings.OUTBOX_BRIDGE = {
        "APP": "tests.django_app.outbox:app",
        "TEMPORAL_ADDRESS": servers.temporal_address,
    }
    _empty()
    yield
    _empty()


def _empty() -> None:
    with connections["default"].cursor() as cursor:
        for table in (TABLE, pauses_of(TABLE), parked_of(TABLE), owners_of(TABLE)):
            cursor.execute(f"DELETE FROM {table.name}")


def staff(name: str, *codenames: str) -> Client:
    """A test client logged in as staff user ``name`` with the outbox permissions named."""
    user = User.objects.create_user(name, password="unused", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="outbox_bridge", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def write(category: Category, shard: int, obj: int) -> int:
    with transaction.atomic():
        return write_row(app, category=category, shard_identifier=shard, object_identifier=obj)


def pauses() -> list[Pause]:
    found: list[Pause] = _read(read_pauses)
    return found


def parked(*, with_unparked: bool = False) -> list[ParkedGroup]:
    found: list[ParkedGroup] = _read(read_parked, with_unparked=with_unparked)
    return found


def _read(read: Any, **options: Any) -> Any:
    """What a read of the command line's finds in the outbox's database."""

    async def run() -> Any:
        url = outbox_settings().database_url
        assert url is not None
        engine = create_async_engine(sqlalchemy_url(url.get_secret_value()))
        try:
            async with engine.connect() as conn:
                return await read(conn, TABLE, **options)
        finally:
            await engine.dispose()

    return async_to_sync(run)()


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# -- the shards ------------------------------------------------------------------------------------


def test_the_shards_are_listed_with_their_counts_owners_and_a_search() -> None:
    for obj in (1, 1, 2):
        write(Category.PROJECT_UPDATE, 41, obj)
    write(Category.ORGANIZATION_UPDATE, 42, 42)
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {owners_of(TABLE).name} (shard_scope, shard_identifier, held_for) "
            "VALUES (%s, 42, 'failed')",
            [int(Scope.ORGANIZATION)],
        )
    client = staff("viewer", "view_outbox")

    response = client.get(URL)
    assert response.status_code == 200
    listed = {
        line.ref.key: (line.rows, line.groups, line.owner) for line in response.context["shards"]
    }
    assert listed == {"ORGANIZATION:41": (3, 2, "free"), "ORGANIZATION:42": (1, 1, "held (failed)")}
    assert b"held (failed)" in response.content
    assert b"payload" not in response.content.lower().replace(b"payloads are never shown", b"")
    assert b"park head group" not in response.content  # no park permission

    found = client.get(URL, {"q": "42"}).context["shards"]
    assert [line.ref.key for line in found] == ["ORGANIZATION:42"]
    refused = client.get(URL, {"q": "forty-two"})
    assert refused.context["shards"] == []
    assert "not a shard identifier" in messages_of(refused)[0]


def test_the_shards_are_paginated_deepest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox_admin, "PER_PAGE", 1)
    write(Category.PROJECT_UPDATE, 43, 1)
    write(Category.PROJECT_UPDATE, 43, 2)
    write(Category.PROJECT_UPDATE, 44, 1)
    client = staff("viewer", "view_outbox")

    first = client.get(URL)
    assert [line.ref.key for line in first.context["shards"]] == ["ORGANIZATION:43"]
    assert first.context["has_next"]
    second = client.get(URL, {"p": "2"})
    assert [line.ref.key for line in second.context["shards"]] == ["ORGANIZATION:44"]
    assert not second.context["has_next"]


# -- pauses --------------------------------------------------------------------------------------


def test_pause_and_unpause_are_recorded_as_the_admin_user() -> None:
    write(Category.PROJECT_UPDATE, 45, 1)
    client = staff("ann", "view_outbox", "pause_outbox")
    form = {
        "kind": "category",
        "name": "project_update",
        "reason": "search is down",
        "duration": "0:30:00",
        "by": "mallory",  # not a field: who acts is the user Django authenticated
        "paused_by": "mallory",
    }
    response = client.post(f"{URL}pauses/", form)
    assert response.status_code == 302

    [pause] = pauses()
    assert (pause.kind, pause.number, pause.reason) == ("category", 2, "search is down")
    assert pause.paused_by == "django:ann"
    assert pause.ends_at is not None
    assert pause.ends_at - pause.since == timedelta(minutes=30)
    listed = client.get(f"{URL}pauses/")
    assert b"django:ann" in listed.content
    assert b"PROJECT_UPDATE" in listed.content
    # The time left, beside the end.
    assert re.search(rb"\(in (29|30)\xc2\xa0minutes\)", listed.content), listed.content
    [waiting] = client.get(URL).context["shards"]
    assert waiting.paused == "category PROJECT_UPDATE by django:ann: search is down"

    unpaused = client.post(f"{URL}pauses/", {"unpause": "1", "kind": "category", "number": "2"})
    assert unpaused.status_code == 302
    assert pauses() == []
    # Both in the admin's own history, as the user who made them.
    since = pause.since.astimezone(UTC)
    history = LogEntry.objects.filter(user__username="ann").order_by("action_time")
    assert [entry.change_message for entry in history] == [
        "category PROJECT_UPDATE paused: search is down",
        f"category PROJECT_UPDATE resumed (paused since {since:%Y-%m-%d %H:%M} UTC)",
    ]


def test_a_scope_pause_without_a_duration_lasts_until_unpaused() -> None:
    client = staff("ann", "view_outbox", "pause_outbox")
    form = {"kind": "scope", "name": "1", "reason": "maintenance"}
    assert client.post(f"{URL}pauses/", form).status_code == 302
    [pause] = pauses()
    assert (pause.kind, pause.number, pause.ends_at, pause.paused_by) == (
        "scope",
        1,
        None,
        "django:ann",
    )


@pytest.mark.parametrize(
    ("form", "field", "error"),
    [
        ({"kind": "category", "name": "NO_SUCH"}, "name", "unknown category 'NO_SUCH'"),
        ({"kind": "region", "name": "1"}, "kind", "Select a valid choice"),
        ({"kind": "category", "name": "2", "reason": ""}, "reason", "This field is required"),
        ({"kind": "category", "name": "2", "duration": "soon"}, "duration", "valid duration"),
        (
            {"kind": "category", "name": "2", "duration": "400 00:00:00"},
            "duration",
            "at most 366 days",
        ),
        ({"kind": "category", "name": "2", "duration": "-0:01:00"}, "duration", "over 0"),
    ],
)
def test_bad_pause_input_is_a_form_error_and_pauses_nothing(
    form: dict[str, str], field: str, error: str
) -> None:
    client = staff("ann", "view_outbox", "pause_outbox")
    response = client.post(f"{URL}pauses/", {"reason": "why", **form})
    assert response.status_code == 200
    assert error in " ".join(response.context["form"].errors[field])
    assert pauses() == []


# -- parked groups ---------------------------------------------------------------------------------


def test_park_and_unpark_are_recorded_as_the_admin_user() -> None:
    first = write(Category.PROJECT_UPDATE, 51, 7)
    write(Category.MEMBER_UPDATE, 51, 8)
    client = staff("bob", "view_outbox", "park_outbox")
    shard = {"table": OUTBOX, "scope": str(int(Scope.ORGANIZATION)), "shard_identifier": "51"}

    listed = client.get(URL)
    assert b"park head group" in listed.content
    assert client.get(f"{URL}park/", shard).status_code == 200
    response = client.post(f"{URL}park/", {**shard, "reason": "bad payload", "by": "mallory"})
    assert response.status_code == 302

    [group] = parked()
    assert (group.category, group.object_identifier, group.first_id) == (2, 7, first)
    assert (group.parked_by, group.reason, group.rows) == ("django:bob", "bad payload", 1)
    page = client.get(f"{URL}parked/")
    assert b"django:bob" in page.content
    assert [line.parked_groups for line in client.get(URL).context["shards"]] == [1]

    unpark = {**shard, "category": "2", "object_identifier": "7"}
    assert client.post(f"{URL}parked/", unpark).status_code == 302
    assert parked() == []
    [record] = parked(with_unparked=True)
    assert record.unparked_by == "django:bob"
    assert record.unparked_at is not None
    history = LogEntry.objects.filter(user__username="bob").order_by("action_time")
    assert [entry.change_message for entry in history] == [
        "shard ORGANIZATION:51: parked PROJECT_UPDATE object=7 (1 rows)",
        "shard ORGANIZATION:51: unparked PROJECT_UPDATE object=7",
    ]


def test_bad_park_input_changes_nothing() -> None:
    write(Category.PROJECT_UPDATE, 52, 1)
    client = staff("bob", "view_outbox", "park_outbox")
    shard = {"scope": str(int(Scope.ORGANIZATION)), "shard_identifier": "52"}

    blank = client.post(f"{URL}park/", {**shard, "reason": " "})
    assert blank.status_code == 200
    assert "reason" in blank.context["form"].errors
    empty_shard = client.post(f"{URL}park/", {**shard, "shard_identifier": "53", "reason": "x"})
    assert empty_shard.status_code == 200
    assert "has no row to park" in messages_of(empty_shard)[0]
    assert client.get(f"{URL}park/", {"scope": "x"}).status_code == 404
    assert client.get(URL, {"table": "no_such_table"}).status_code == 404
    nothing = client.post(f"{URL}parked/", {**shard, "category": "2", "object_identifier": "1"})
    assert nothing.status_code == 302
    assert parked(with_unparked=True) == []


# -- permissions -----------------------------------------------------------------------------------


def test_users_without_the_permission_are_refused_and_change_nothing() -> None:
    write(Category.PROJECT_UPDATE, 61, 1)
    viewer = staff("viewer", "view_outbox")
    shard = {"scope": str(int(Scope.ORGANIZATION)), "shard_identifier": "61"}
    pause = {"kind": "category", "name": "PROJECT_UPDATE", "reason": "no"}

    assert viewer.get(URL).status_code == 200
    assert viewer.post(f"{URL}pauses/", pause).status_code == 403
    assert viewer.get(f"{URL}park/", shard).status_code == 403
    assert viewer.post(f"{URL}park/", {**shard, "reason": "no"}).status_code == 403
    unpark = {**shard, "category": "2", "object_identifier": "1"}
    assert viewer.post(f"{URL}parked/", unpark).status_code == 403
    # The pause permission does not give the park one, nor the other way round.
    parker = staff("parker", "view_outbox", "park_outbox")
    assert parker.post(f"{URL}pauses/", pause).status_code == 403
    pauser = staff("pauser", "view_outbox", "pause_outbox")
    assert pauser.post(f"{URL}park/", {**shard, "reason": "no"}).status_code == 403
    # Staff without the view permission see nothing; a user who is not staff logs in first.
    assert staff("nobody").get(URL).status_code == 403
    outsider = User.objects.create_user("outsider", password="unused")
    client = Client()
    client.force_login(outsider)
    assert client.get(URL).status_code == 302
    assert pauses() == []
    assert parked(with_unparked=True) == []


# -- the park wakes the shard, as the command line's does ----------------------------------------


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def held_for(shard: int) -> str | None:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"SELECT held_for FROM {owners_of(TABLE).name} WHERE shard_identifier = %s", [shard]
        )
        found = cursor.fetchone()
    return None if found is None else str(found[0])


def test_a_park_lets_a_blocked_shard_go_on_at_once(servers: Any) -> None:
    """The shard's failing head is tried again in two minutes, and the sweep looks at held
    shards as seldom: only the park's wake-up lets the shard go on within the test."""
    shard = next_identifier()
    recorder.fail_until_fixed(Category.PROJECT_UPDATE)
    settings = worker_settings(
        idle_timeout=0, initial_retry_interval=120.0, max_retry_interval=120.0, sweep_interval=120.0
    )
    client = staff("bob", "view_outbox", "park_outbox")
    try:
        with outbox_worker_django(
            app, temporal_address=servers.temporal_address, settings=settings
        ):
            stuck = write(Category.PROJECT_UPDATE, shard, 1)
            member = write(Category.MEMBER_UPDATE, shard, 2)
            wait_for(lambda: held_for(shard) == "failed", "blocked shard")
            form = {"scope": str(int(Scope.ORGANIZATION)), "shard_identifier": str(shard)}
            assert client.post(f"{URL}park/", {**form, "reason": "replica down"}).status_code == 302
            wait_for(lambda: member in recorder.ids(), "call for the shard's next group")
            assert stuck not in recorder.ids()
    finally:
        recorder.behaviour.pop(int(Category.PROJECT_UPDATE))
