"""``manage.py outbox_worker``: ``outbox-bridge worker`` with its settings from the Django
settings (:mod:`outbox_bridge.contrib.django.conf`) and every handler wrapped with
:func:`~outbox_bridge.contrib.django.handlers.with_django_connections`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import traceback
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from outbox_bridge.contrib.django.conf import outbox_app, outbox_settings
from outbox_bridge.contrib.django.handlers import with_django_connections
from outbox_bridge.errors import OutboxError
from outbox_bridge.observability.logs import configure_logging, quiet_sdk_loggers
from outbox_bridge.runtime.worker import run as run_worker


class Command(BaseCommand):
    help = (
        "Run the outbox-bridge worker: the bridge that finds shards with rows and the Temporal "
        "worker that runs their handlers, with settings from OUTBOX_BRIDGE and DATABASES."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--database",
            help="The DATABASES alias of the outbox tables (default: OUTBOX_BRIDGE['DATABASE'], "
            "else 'default').",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            settings = outbox_settings(using=options["database"])
            app = outbox_app()
            app.check_handlers()
        except OutboxError as exc:
            raise CommandError(str(exc), returncode=2) from None
        app.wrap_handlers(with_django_connections)
        if not logging.getLogger().handlers:  # else the project's LOGGING stands
            configure_logging(settings.log_level, settings.log_format)
        quiet_sdk_loggers()
        try:
            asyncio.run(run_worker(settings, app))
        except OutboxError as exc:
            raise CommandError(str(exc), returncode=2) from None

    def run_from_argv(self, argv: list[str]) -> None:
        """From ``manage.py``: run, then leave without interpreter teardown, as
        ``outbox-bridge worker`` does (a process that ran a Temporal worker can crash in
        teardown after its work is done, turning a success into a failure)."""
        code = 0
        try:
            super().run_from_argv(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
