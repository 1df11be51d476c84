"""Settings of the example project.

The database is PostgreSQL, found through libpq's variables (``PGHOST``, ``PGPORT``,
``PGUSER``, ``PGPASSWORD``, ``PGDATABASE``). The worker (``manage.py outbox_worker``) and the
flushes take their settings from ``OUTBOX_BRIDGE`` and this ``DATABASES`` entry; what
``OUTBOX_BRIDGE`` does not give comes from the environment, like for ``outbox-bridge worker``:
``TEMPORAL_ADDRESS`` (unset: the worker starts a Temporal dev server on 127.0.0.1:7233, where
the flushes look for it too), ``OUTBOX_TASK_QUEUE``, ``OUTBOX_HEALTH_PORT``, ...
"""

from __future__ import annotations

import os
from typing import Any

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure: for the example only")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "outbox_bridge.contrib.django",  # manage.py outbox_worker, and the OUTBOX_BRIDGE checks
    "examples.djangoshop.shop",
]
# A JSON API without sessions or forms: no middleware is needed.
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "examples.djangoshop.urls"

DATABASES: dict[str, dict[str, Any]] = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PGDATABASE", "djangoshop"),
        "HOST": os.environ.get("PGHOST", ""),
        "PORT": os.environ.get("PGPORT", ""),
        "USER": os.environ.get("PGUSER", ""),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
    }
}

OUTBOX_BRIDGE: dict[str, Any] = {
    "APP": "examples.djangoshop.shop.outbox:app",
    "FLUSH_TIMEOUT": 10,
}
