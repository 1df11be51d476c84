"""Django's DEBUG error pages and ``SafeExceptionReporterFilter`` show the settings; the
password of a URL in ``OUTBOX_BRIDGE`` (``DATABASE_URL``, or any key) is masked there, while
the outbox still connects with it."""

from __future__ import annotations

import pprint
import sys

import pytest
from django.apps import apps
from django.test import RequestFactory
from django.views.debug import ExceptionReporter, SafeExceptionReporterFilter
from sqlalchemy import create_engine, text

from outbox_bridge.config import sqlalchemy_url
from outbox_bridge.contrib.django.conf import MaskedURL, mask_urls_in_error_pages, outbox_settings
from tests.support import with_password

APP = "tests.django_app.outbox:app"
# Spelled in parts: the error page quotes this file's source around the failing line.
CANARY = "-".join(["s3cret", "django", "page"])


def _page_of_an_error() -> str:
    try:
        raise RuntimeError("a view failed")
    except RuntimeError:
        reporter = ExceptionReporter(RequestFactory().get("/"), *sys.exc_info())
        return reporter.get_traceback_html()


def test_the_database_url_password_is_masked_on_error_pages_and_still_connects(
    servers, settings
) -> None:
    url, password = with_password(servers.database_url, CANARY)
    settings.DEBUG = True
    settings.OUTBOX_BRIDGE = {"APP": APP, "DATABASE_URL": url, "TASK_QUEUE": "orders"}
    apps.get_app_config("outbox_bridge").ready()
    safe = SafeExceptionReporterFilter().get_safe_settings()
    shown = pprint.pformat(safe["OUTBOX_BRIDGE"])
    assert password not in shown
    assert "postgresql" in shown and "***" in shown and "orders" in shown, shown
    page = _page_of_an_error()
    assert "OUTBOX_BRIDGE" in page and password not in page
    # The outbox reads the URL itself, password and all, and connects with it.
    read = outbox_settings()
    assert read.database_url is not None
    given = read.database_url.get_secret_value()
    assert type(given) is str and given == url
    engine = create_engine(sqlalchemy_url(given))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("key", "value", "masked"),
    [
        ("DATABASE_URL", "postgresql://u:pw-1@h/db", True),
        ("DATABASE_URL", "postgresql://u@h/db?password=pw-1", True),
        ("TEMPORAL_PROFILE", "https://u:pw-1@h/", True),  # any key
        ("DATABASE_URL", "postgresql://u@h/db", False),
        ("TEMPORAL_ADDRESS", "temporal.example.com:7233", False),
        ("TEMPORAL_PROFILE", "not a url pw-1", False),
    ],
)
def test_only_urls_with_a_password_are_masked(settings, key: str, value: str, masked: bool) -> None:
    settings.OUTBOX_BRIDGE = {"APP": APP, key: value}
    assert mask_urls_in_error_pages() == int(masked)
    kept = settings.OUTBOX_BRIDGE[key]
    assert isinstance(kept, MaskedURL) is masked
    assert str(kept) == value and f"{kept}" == value
    assert ("pw-1" in repr(kept)) == ("pw-1" in value and not masked)
    assert mask_urls_in_error_pages() == 0  # done once
