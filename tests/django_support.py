"""What the Django tests share: the test PostgreSQL as Django database settings, the rows of an
outbox table, and the end of the workflows a worker in a subprocess left."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from typing import Any

from django.conf import settings
from django.db import connections
from sqlalchemy.engine import make_url
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from outbox_bridge import OutboxApp, OutboxSettings
from outbox_bridge.workflows.models import PartitionRef
from tests.harness import Servers, connect_client

# The tests' outbox tables (tests/django_app/outbox.py).
OUTBOX = "django_outbox"
ARCHIVE = "django_archive_outbox"


def rows(table: str = OUTBOX, using: str = "default") -> list[dict[str, Any]]:
    """The rows of an outbox table, read with Django's connection."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT id, shard_scope, shard_identifier, category, object_identifier, "
            f"payload::text, scheduled_for, trace_context::text FROM {table} ORDER BY id"
        )
        names = [
            "id",
            "shard_scope",
            "shard_identifier",
            "category",
            "object_identifier",
            "payload",
            "scheduled_for",
            "trace_context",
        ]
        found = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    for row in found:
        for key in ("payload", "trace_context"):
            row[key] = None if row[key] is None else json.loads(row[key])
    return found


def database_settings(servers: Servers) -> dict[str, str]:
    """The test PostgreSQL as a DATABASES entry's HOST, PORT, USER and PASSWORD."""
    url = make_url(servers.database_url)
    host = url.host or str(url.query.get("host", ""))
    port = url.port or url.query.get("port", "")
    return {
        "HOST": host,
        "PORT": str(port or ""),
        "USER": url.username or "",
        "PASSWORD": url.password or "",
    }


def point_django_at(servers: Servers) -> None:
    """Every alias of the Django settings on the test PostgreSQL (changed in place: the
    connections share these dicts)."""
    for entry in settings.DATABASES.values():
        entry.update(database_settings(servers))


def end_workflows(servers: Servers, app: OutboxApp, options: OutboxSettings) -> None:
    """Terminate the workflows that a stopped worker (of these options) left running: its
    partitions wait for rows for ever, and workflow ids name the table, not the task queue, so
    the next worker of these tables (on a task queue of its own) would find them running where
    nobody polls, and its rows would wait."""
    failures: list[BaseException] = []

    # On a loop and a thread of their own: asyncio.run in the test's thread would unset
    # pytest-asyncio's loop there.
    def run() -> None:
        try:
            asyncio.run(_end_workflows(servers, app, options))
        except BaseException as exc:  # re-raised in the caller's thread
            failures.append(exc)

    thread = threading.Thread(target=run, name="end-workflows")
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the workflows were not terminated within 60 s"
    if failures:
        raise failures[0]


async def _end_workflows(servers: Servers, app: OutboxApp, options: OutboxSettings) -> None:
    client = await connect_client(servers)
    task_queue, partitions = options.task_queue, options.partitions
    # A partition's id is known (and described at once); shard workflows are listed.
    ids = [
        PartitionRef(table, n, partitions).workflow_id
        for table in app.tables
        for n in range(partitions)
    ]
    query = f"ExecutionStatus = 'Running' AND TaskQueue = '{task_queue}'"
    ids += [execution.id async for execution in client.list_workflows(query)]
    for workflow_id in ids:
        handle = client.get_workflow_handle(workflow_id)
        try:
            described = await handle.describe()
        except RPCError:
            continue  # never started
        if described.status == WorkflowExecutionStatus.RUNNING and (
            described.task_queue == task_queue
        ):
            with contextlib.suppress(RPCError):  # ended meanwhile
                await handle.terminate("the test is over")


# Shard and object identifiers unique in the session, far above the models' primary keys: the
# Django tests share one table, one Temporal namespace and the workers' shard workflows.
_identifiers = itertools.count(10**9)


def next_identifier() -> int:
    return next(_identifiers)
