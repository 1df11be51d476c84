"""django-celery-outbox 0.4 on Celery 5, its broker PostgreSQL through Kombu's SQLAlchemy
transport (``sqla+postgresql://``): unordered.

The producer calls the task's ``delay`` inside ``transaction.atomic``: django-celery-outbox
records it in its outbox table, committed with the app's data. Its relay
(``manage.py celery_outbox_relay``) publishes the committed rows to the broker; a Celery worker
runs them. Celery keeps no order per key (a worker's pool runs what it fetches at once), so this
runs unordered and the checker counts what that costs. Tables: the outbox's by Django's
``migrate``, the broker's by Kombu on first use. The handler is a plain ``def`` (Celery runs
functions), on Celery's thread pool at the run's concurrency; a failing call is retried by
Celery after 1 s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import LOG_DIR, FlakyFailure, handle
from bench.peers.checker import Row

TASK = "outbox_row"
MAX_RETRIES = 100


def _configure(spec: RunSpec) -> None:
    """Django's settings for the run's database, then ``django.setup()``."""
    import django
    from django.conf import settings
    from sqlalchemy.engine import make_url

    url = make_url(spec.database_url)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.database,
                "USER": url.username or "",
                "PASSWORD": url.password or "",
                "HOST": url.query.get("host") or url.host or "",
                "PORT": str(url.port or ""),
            }
        },
        INSTALLED_APPS=["django_celery_outbox"],
        CELERY_OUTBOX_APP=f"{__name__}.app",
        USE_TZ=True,
        LOGGING_CONFIG=None,
    )
    django.setup()


def _broker(spec: RunSpec) -> str:
    return "sqla+" + spec.database_url.replace("postgresql://", "postgresql+psycopg://", 1)


_APP: Any = None


def __getattr__(name: str) -> Any:
    """``app``: the Celery app (``CELERY_OUTBOX_APP`` names it), built on first use."""
    if name != "app":
        raise AttributeError(name)
    global _APP
    if _APP is None:
        from django_celery_outbox import OutboxCelery

        spec = RunSpec.load(Path(os.environ[LOG_DIR]))
        _APP = OutboxCelery("peers", broker=_broker(spec))
        _APP.conf.update(task_ignore_result=True, worker_hijack_root_logger=False)

        @_APP.task(name=TASK, bind=True, max_retries=MAX_RETRIES, default_retry_delay=1)
        def outbox_row(self: Any, key: int, seq: int, category: int, obj: int) -> None:
            try:
                handle(key, seq, category, obj)
            except FlakyFailure as exc:
                raise self.retry(exc=exc) from exc

    return _APP


class CeleryOutbox(Peer):
    name = "django-celery-outbox"
    distributions = ("django-celery-outbox", "celery", "kombu", "django")
    module = "django_celery_outbox"
    ordered = False
    coroutines = False
    roles = ("relay", "worker")
    setting = (
        "unordered: Celery has no order per key; relay manage.py celery_outbox_relay, "
        "worker --pool threads --concurrency = the run's; broker sqla+postgresql (Kombu)"
    )

    def install_schema(self, spec: RunSpec) -> None:
        from django.core.management import call_command

        _configure(spec)
        call_command("migrate", verbosity=0)

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        from django.db import transaction

        _configure(spec)
        task = __getattr__("app").tasks[TASK]

        def enqueue(rows: Sequence[Row]) -> None:
            with transaction.atomic():
                for r in rows:
                    task.delay(r.key, r.seq, r.category, r.obj)

        yield enqueue

    def serve(self, spec: RunSpec, role: str) -> None:
        _configure(spec)
        if role == "relay":
            from django.core.management import call_command

            call_command("celery_outbox_relay")
            return
        __getattr__("app").worker_main(
            ["worker", "--pool=threads", f"--concurrency={spec.concurrency}",
             "--loglevel=WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        )  # fmt: skip
