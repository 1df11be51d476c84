"""The tests' outbox apps: ``app`` (table ``django_outbox``), and ``archive_app`` (table
``django_archive_outbox``) for the rows a multi-database test writes on the ``other``
database, drained there by a worker of its own. Their handlers record every call."""

from __future__ import annotations

from outbox_bridge import OutboxApp, OutboxTable
from tests.harness import SCOPES, Category, Recorder

recorder = Recorder()
app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable("django_outbox")])
app.handler(*Category)(recorder.handle)

archive_recorder = Recorder()
archive_app = OutboxApp(
    scopes=SCOPES, categories=[Category], tables=[OutboxTable("django_archive_outbox")]
)
archive_app.handler(*Category)(archive_recorder.handle)
