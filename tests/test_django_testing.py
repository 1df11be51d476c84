"""drain_outbox_django: the testing toolkit's in-process drain on a Django database. Its engine
is on the test database and disposed afterwards; a test whose rows have not committed is
refused. The end-to-end test runs once outbox_bridge.testing (the toolkit) is installed."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from sqlalchemy import Engine, text

from outbox_bridge import ConfigurationError, OutboxApp
from outbox_bridge.contrib.django import testing
from outbox_bridge.contrib.django.testing import drain_outbox_django
from tests.django_app.outbox import app, recorder
from tests.django_support import next_identifier, rows

TOOLKIT = importlib.util.find_spec("outbox_bridge.testing") is not None


@pytest.mark.django_db
def test_rows_that_have_not_committed_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"django_db\(transaction=True\)"):
        drain_outbox_django(app)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_drain_gets_an_engine_on_the_test_database(monkeypatch) -> None:
    seen: list[tuple[OutboxApp, Engine, Any, str]] = []

    def drain_outbox(given: OutboxApp, bind: Engine, **options: Any) -> str:
        with bind.connect() as conn:
            database = conn.execute(text("SELECT current_database()")).scalar_one()
        seen.append((given, bind, options, database))
        return "drained"

    monkeypatch.setattr(testing, "drain_outbox", drain_outbox)
    assert drain_outbox_django(app, using="other", limit=5) == "drained"
    [(given, bind, options, database)] = seen
    assert given is app and isinstance(bind, Engine) and options == {"limit": 5}
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


@pytest.mark.django_db(transaction=True)
def test_without_the_toolkit_it_says_so(monkeypatch) -> None:
    monkeypatch.setattr(testing, "drain_outbox", None)
    with pytest.raises(ConfigurationError, match=r"needs outbox_bridge\.testing"):
        drain_outbox_django(app)


@pytest.mark.skipif(not TOOLKIT, reason="outbox_bridge.testing (the testing toolkit) is absent")
@pytest.mark.django_db(transaction=True)
def test_rows_written_by_a_view_are_handled_in_the_test() -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute("DELETE FROM django_outbox")
    shard = next_identifier()
    assert Client().get(f"/write/{shard}").status_code == 200  # committed by the view
    drain_outbox_django(app)
    assert any(call.object_identifier == shard for call in recorder.calls)
    assert rows() == []
