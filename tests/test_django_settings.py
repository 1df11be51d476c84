"""The Django integration's settings: a DATABASES entry as the worker's database URL, the
OUTBOX_BRIDGE dict as OutboxSettings, the app it names, the system checks that refuse what
does not fit, and the handler wrapper of the worker command. No database, no Temporal."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.utils.connection import ConnectionDoesNotExist
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from outbox_bridge import ConfigurationError, OutboxApp, OutboxMessage
from outbox_bridge.config import safe_url
from outbox_bridge.contrib.django import conf, handlers
from outbox_bridge.contrib.django.checks import (
    APP_ID,
    NO_APP_ID,
    SETTINGS_ID,
    check_outbox_settings,
)
from outbox_bridge.contrib.django.conf import (
    OutboxConfigurationError,
    database_url,
    load_app,
    outbox_app,
    outbox_settings,
)
from outbox_bridge.contrib.django.flush import outbox_context
from outbox_bridge.contrib.django.handlers import with_django_connections
from outbox_bridge.flush import DEFAULT_TIMEOUT
from tests.django_app import outbox as test_outbox
from tests.harness import SCOPES, Category

APP = "tests.django_app.outbox:app"


def entry(**values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"NAME": "shop", "USER": "", "PASSWORD": "", "HOST": "", "PORT": ""}
    return {**base, **values}


def parts(url: str) -> tuple[Any, ...]:
    parsed = make_url(url)
    return (
        parsed.drivername,
        parsed.username,
        parsed.password,
        parsed.host,
        parsed.port,
        parsed.database or None,
        dict(parsed.query),
    )


@pytest.fixture
def databases(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Connections with the DATABASES entries a test puts here (nothing connects)."""
    found: dict[str, Any] = {}

    class Connections:
        def __getitem__(self, alias: str) -> Any:
            if alias not in found:
                raise ConnectionDoesNotExist(alias)
            vendor, settings_dict = found[alias]
            return SimpleNamespace(vendor=vendor, settings_dict=settings_dict)

    monkeypatch.setattr(conf, "connections", Connections())
    return found


@pytest.mark.parametrize(
    ("settings_dict", "url"),
    [
        (
            entry(USER="shop", PASSWORD="s3cret", HOST="db.internal", PORT="6432"),
            "postgresql+psycopg://shop:s3cret@db.internal:6432/shop",
        ),
        (
            entry(HOST="/var/run/postgresql", PORT=5433),
            "postgresql+psycopg:///shop?host=/var/run/postgresql&port=5433",
        ),
        (
            # libpq parameters are kept, what only Django reads is not.
            entry(
                HOST="db",
                OPTIONS={
                    "sslmode": "verify-full",
                    "sslrootcert": "/etc/ca.pem",
                    "connect_timeout": 5,
                    "isolation_level": 3,
                    "server_side_binding": True,
                    "pool": {"min_size": 2},
                    "assume_role": "writer",
                },
            ),
            "postgresql+psycopg://db/shop?connect_timeout=5&sslmode=verify-full"
            "&sslrootcert=/etc/ca.pem",
        ),
        (entry(NAME=None), "postgresql+psycopg:///postgres"),
        (entry(NAME=None, OPTIONS={"service": "shop"}), "postgresql+psycopg:///?service=shop"),
        (entry(HOST="a,b", PORT="5432,5433"), "postgresql+psycopg:///shop?host=a,b&port=5432,5433"),
    ],
)
def test_a_databases_entry_as_the_worker_s_database_url(databases, settings_dict, url) -> None:
    databases["default"] = ("postgresql", settings_dict)
    assert parts(database_url()) == parts(url)


def test_database_urls_are_refused_for_what_is_not_postgresql(databases) -> None:
    databases["default"] = ("sqlite", entry())
    with pytest.raises(OutboxConfigurationError, match="is a sqlite database; outbox-bridge"):
        database_url()
    with pytest.raises(OutboxConfigurationError, match="no alias 'replica'"):
        database_url("replica")
    databases["bad"] = ("postgresql", entry(HOST="db", PORT="five"))
    with pytest.raises(OutboxConfigurationError, match="PORT"):
        database_url("bad")


def test_outbox_bridge_maps_onto_outbox_settings(databases, settings, monkeypatch) -> None:
    databases["default"] = ("postgresql", entry(NAME="main"))
    databases["outbox"] = ("postgresql", entry(NAME="events", PASSWORD="canary-pw"))
    monkeypatch.setenv("OUTBOX_TASK_QUEUE", "from-the-environment")
    monkeypatch.setenv("OUTBOX_SHUTDOWN_GRACE", "3")
    settings.OUTBOX_BRIDGE = {
        "APP": APP,
        "DATABASE": "outbox",
        "task_queue": "from-django",  # any letter case
        "TEMPORAL_ADDRESS": "temporal:7233",
        "TEMPORAL_API_KEY": "key-canary",
        "PARTITIONS": 8,
        "FLUSH_TIMEOUT": 3,
    }
    mapped = outbox_settings()
    assert mapped.task_queue == "from-django"  # the Django settings before the environment
    assert mapped.shutdown_grace == 3  # the environment for what they do not give
    assert mapped.temporal_address == "temporal:7233"
    assert mapped.partitions == 8
    assert mapped.app == APP
    assert mapped.temporal_api_key == SecretStr("key-canary")
    assert mapped.database_url is not None
    url = make_url(mapped.database_url.get_secret_value())
    # No USER: the password is libpq's parameter.
    assert (url.database, url.query["password"]) == ("events", "canary-pw")
    assert "canary-pw" not in safe_url(url) and "canary" not in repr(mapped)
    # --database (using) wins over OUTBOX_BRIDGE["DATABASE"].
    other = outbox_settings(using="default").database_url
    assert other is not None and make_url(other.get_secret_value()).database == "main"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("not a dict", "OUTBOX_BRIDGE must be a dict"),
        ({"TASKQUEUE": "x"}, "unknown key 'TASKQUEUE'"),
        ({"task_queue": "a", "TASK_QUEUE": "b"}, "gives TASK_QUEUE twice"),
        ({"DATABASE_URL": "postgresql://h/d", "DATABASE": "default"}, "both DATABASE_URL"),
        ({"PARTITIONS": 0}, r"OUTBOX_BRIDGE\['PARTITIONS'\]: Input should be greater"),
        ({"DATABASE": 5}, "must be a DATABASES alias"),
    ],
)
def test_outbox_bridge_refusals(databases, settings, given, message) -> None:
    databases["default"] = ("postgresql", entry())
    settings.OUTBOX_BRIDGE = given
    with pytest.raises(OutboxConfigurationError, match=message) as info:
        outbox_settings()
    assert isinstance(info.value, ImproperlyConfigured)
    assert isinstance(info.value, ConfigurationError)


def test_an_invalid_secret_is_not_repeated(databases, settings) -> None:
    databases["default"] = ("postgresql", entry())
    settings.OUTBOX_BRIDGE = {"TEMPORAL_API_KEY": ["key-canary"]}
    with pytest.raises(OutboxConfigurationError, match="TEMPORAL_API_KEY") as info:
        outbox_settings()
    assert "key-canary" not in str(info.value)


def test_the_app_is_named_like_outbox_app(settings, monkeypatch) -> None:
    assert load_app(APP) is test_outbox.app
    assert load_app("tests.django_app.outbox.archive_app") is test_outbox.archive_app
    with pytest.raises(OutboxConfigurationError, match=r"cannot import 'tests\.nowhere'"):
        load_app("tests.nowhere:app")
    with pytest.raises(OutboxConfigurationError, match="is Recorder, not an OutboxApp"):
        load_app("tests.django_app.outbox:recorder")
    with pytest.raises(OutboxConfigurationError, match="module:attribute"):
        load_app("app")
    settings.OUTBOX_BRIDGE = {}
    monkeypatch.delenv("OUTBOX_APP", raising=False)
    with pytest.raises(OutboxConfigurationError, match="no OutboxApp configured"):
        outbox_app()
    monkeypatch.setenv("OUTBOX_APP", "tests.django_app.outbox:archive_app")
    assert outbox_app() is test_outbox.archive_app  # the environment, as for the worker


def test_system_checks(settings, monkeypatch) -> None:
    monkeypatch.delenv("OUTBOX_APP", raising=False)
    assert check_outbox_settings() == []  # tests/django_settings.py
    settings.OUTBOX_BRIDGE = {}
    assert [m.id for m in check_outbox_settings()] == [NO_APP_ID]
    settings.OUTBOX_BRIDGE = {"APP": APP, "PARTITIONS": -1}
    assert [m.id for m in check_outbox_settings()] == [SETTINGS_ID]
    settings.OUTBOX_BRIDGE = {"APP": "tests.django_app.outbox:missing"}
    [error] = check_outbox_settings()
    assert error.id == APP_ID and "is missing, not an OutboxApp" in error.msg
    settings.OUTBOX_BRIDGE = {"APP": APP, "DATABASE": "nowhere"}
    [error] = check_outbox_settings()
    assert error.id == SETTINGS_ID and "no alias 'nowhere'" in error.msg
    settings.OUTBOX_BRIDGE = {"APP": APP, "FLUSH_TIMEOUT": 0}
    [error] = check_outbox_settings()
    assert error.id == SETTINGS_ID and "FLUSH_TIMEOUT" in error.msg


def test_the_worker_command_refuses_what_does_not_fit(settings, monkeypatch) -> None:
    monkeypatch.delenv("OUTBOX_APP", raising=False)
    settings.OUTBOX_BRIDGE = {}
    with pytest.raises(CommandError, match="no OutboxApp configured") as info:
        call_command("outbox_worker")
    assert info.value.returncode == 2
    settings.OUTBOX_BRIDGE = {"APP": "tests.test_django_settings:incomplete_app"}
    with pytest.raises(CommandError, match="no handler for categories"):
        call_command("outbox_worker")
    settings.OUTBOX_BRIDGE = {"APP": APP}
    with pytest.raises(CommandError, match="no alias 'nowhere'"):
        call_command("outbox_worker", database="nowhere")


incomplete_app = OutboxApp(scopes=SCOPES, categories=[Category])


# -- handlers in the worker ----------------------------------------------------------------------


def test_handlers_run_between_two_connection_checks(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(handlers, "close_old_connections", lambda: events.append("close"))
    message = OutboxMessage(1, 1, 1, 1, 1, None, None, None, None)  # type: ignore[arg-type]

    def plain(message: OutboxMessage) -> None:
        events.append("plain")

    async def asynchronous(message: OutboxMessage) -> None:
        events.append("async")

    wrapped_plain = with_django_connections(plain)
    wrapped_async = with_django_connections(asynchronous)
    assert not OutboxApp.is_async_handler(wrapped_plain)
    assert OutboxApp.is_async_handler(wrapped_async)
    assert with_django_connections(wrapped_plain) is wrapped_plain  # wrapped once
    wrapped_plain(message)
    assert events == ["close", "plain", "close"]
    events.clear()
    result = wrapped_async(message)
    assert result is not None
    asyncio.run(result)  # type: ignore[arg-type]
    assert events == ["close", "async", "close"]

    def failing(message: OutboxMessage) -> None:
        raise RuntimeError("handler failed")

    events.clear()
    with pytest.raises(RuntimeError):
        with_django_connections(failing)(message)
    assert events == ["close", "close"]


def test_flush_timeout_is_the_default_wait_of_every_django_flush(settings) -> None:
    """``outbox_context``, like ``flush_outbox`` and the middleware, waits ``FLUSH_TIMEOUT``
    seconds unless given its own; a value that does not fit is refused when a block that waits
    opens."""
    settings.OUTBOX_BRIDGE = {"APP": APP, "FLUSH_TIMEOUT": 3}
    assert outbox_context(flush=True)._timeout == 3
    assert outbox_context(flush=True, timeout=5)._timeout == 5
    settings.OUTBOX_BRIDGE = {"APP": APP}
    assert outbox_context(flush=True)._timeout == DEFAULT_TIMEOUT
    settings.OUTBOX_BRIDGE = {"APP": APP, "FLUSH_TIMEOUT": "10"}
    with pytest.raises(OutboxConfigurationError, match=r"FLUSH_TIMEOUT'\] must be a number"):
        outbox_context(flush=True)
    assert outbox_context()._timeout == DEFAULT_TIMEOUT  # it waits for nothing: not read
