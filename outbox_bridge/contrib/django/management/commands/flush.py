"""``manage.py flush`` with the outbox tables (:mod:`outbox_bridge.contrib.django.tables`):
Django runs it after every ``TransactionTestCase``, so a transactional test leaves no outbox
row to the next one. Installing ``"outbox_bridge.contrib.django"`` puts it in place of
Django's, as ``django.contrib.staticfiles`` does with ``runserver``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from django.apps import apps
from django.core.management.base import CommandError
from django.core.management.color import no_style
from django.core.management.commands import flush
from django.core.management.sql import emit_post_migrate_signal, sql_flush
from django.db import connections

from outbox_bridge.contrib.django.tables import outbox_flush_sql


class Command(flush.Command):
    help = flush.Command.help + " The outbox tables are emptied too."

    def handle(self, **options: Any) -> None:
        database = options["database"]
        connection = connections[database]
        self.style = no_style()
        outbox = outbox_flush_sql(self.style, connection)
        if not outbox:
            super().handle(**options)
            return
        # Django's own handle(), with the outbox tables' TRUNCATE after the models'.
        for app_config in apps.get_app_configs():
            try:  # as Django does: each app's management module registers its receivers
                import_module(".management", app_config.name)
            except ImportError:
                pass
        models = sql_flush(
            self.style,
            connection,
            reset_sequences=options.get("reset_sequences", True),
            allow_cascade=options.get("allow_cascade", False),
        )
        name = connection.settings_dict["NAME"]
        if options["interactive"] and not self._confirmed(name):
            self.stdout.write("Flush cancelled.")
            return
        try:
            connection.ops.execute_sql_flush(models + outbox)
        except Exception as exc:
            raise CommandError(
                f"Database {name} couldn't be flushed ({exc}); 'manage.py sqlflush' prints "
                "the SQL this command could not run."
            ) from exc
        # As Django: no post_migrate for a database without model tables.
        if models and not options.get("inhibit_post_migrate", False):
            emit_post_migrate_signal(options["verbosity"], options["interactive"], database)

    def _confirmed(self, name: str) -> bool:
        answer = input(
            "You have requested a flush of the database.\n"
            f'This will IRREVERSIBLY DESTROY all data currently in the "{name}" database,\n'
            "the rows waiting in its outbox tables included, and return each table to an empty "
            "state.\nAre you sure you want to do this?\n\n"
            "    Type 'yes' to continue, or 'no' to cancel: "
        )
        return answer == "yes"
