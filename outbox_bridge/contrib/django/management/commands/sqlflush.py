"""``manage.py sqlflush`` with the outbox tables: the statements the app's ``flush`` runs."""

from __future__ import annotations

from typing import Any

from django.core.management.commands import sqlflush
from django.core.management.sql import sql_flush
from django.db import connections

from outbox_bridge.contrib.django.tables import outbox_flush_sql


class Command(sqlflush.Command):
    def handle(self, **options: Any) -> str:
        connection = connections[options["database"]]
        statements = sql_flush(self.style, connection) + outbox_flush_sql(self.style, connection)
        if not statements and options["verbosity"] >= 1:
            self.stderr.write("No tables found.")
        return "\n".join(statements)
