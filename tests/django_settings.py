"""The Django project of the Django integration's tests (tests/test_django*.py), run by
pytest-django (``DJANGO_SETTINGS_MODULE`` in pyproject.toml).

Its two databases are on the test PostgreSQL: tests/conftest.py fills in where it is before
pytest-django creates the test databases (test_djangotests, test_djangotests_other). A
subprocess that runs the project (the ``outbox_worker`` command) finds it in the environment:
``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGPASSWORD``, and ``DJANGO_TESTS_DATABASE`` for the name
of the default database.
"""

from __future__ import annotations

import os
from typing import Any


def _database(name: str) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "HOST": os.environ.get("PGHOST", ""),
        "PORT": os.environ.get("PGPORT", ""),
        "USER": os.environ.get("PGUSER", ""),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
    }


SECRET_KEY = "outbox-bridge tests"
USE_TZ = True
# Django sets the process's TZ from TIME_ZONE when the settings load (before any server
# starts), so the test PostgreSQL runs in this zone, not UTC: the suite checks the worker
# does not depend on the session's time zone.
TIME_ZONE = "America/Chicago"
DEBUG = False
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outbox_bridge.contrib.django",
    "outbox_bridge.contrib.django.admin",
    "tests.django_app",
]
# What the admin needs (tests/test_django_admin.py): its templates and middleware, which touch
# no database in a request that neither logs in nor sends a message.
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": _database(os.environ.get("DJANGO_TESTS_DATABASE", "djangotests")),
    "other": _database("djangotests_other"),
}
ROOT_URLCONF = "tests.django_app.urls"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
OUTBOX_BRIDGE: dict[str, Any] = {"APP": "tests.django_app.outbox:app"}
