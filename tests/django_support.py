"""What the Django tests share: the test PostgreSQL as Django database settings, and a worker
that runs in a thread of its own while sync tests run Django code."""

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
from outbox_bridge.runtime.worker import serve
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


class ThreadWorker:
    """``serve(settings, app)`` on an event loop in a thread of its own, so that sync tests can
    run Django views (and their flushes) while it handles the rows."""

    def __init__(
        self, servers: Servers, app: OutboxApp, settings: OutboxSettings, database_url: str
    ) -> None:
        self.servers = servers
        self.app = app
        self.settings = settings
        self.database_url = database_url
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="django-test-worker", daemon=True)

    def start(self) -> ThreadWorker:
        self._thread.start()
        if not self._ready.wait(30) or self._failure is not None:
            self.close()
            raise AssertionError(f"the worker did not become ready: {self._failure!r}")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start() or close()
            self._failure = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(
            serve(
                self.settings,
                self.app,
                stop=self._stop,
                database_url=self.database_url,
                temporal_address=self.servers.temporal_address,
                ready=ready,
            )
        )
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            waiter.cancel()
            task.result()
        self._ready.set()
        await task

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the worker did not stop within 30 s"
        end_workflows(self.servers, self.app, self.settings)
        if self._failure is not None:
            raise self._failure


def end_workflows(servers: Servers, app: OutboxApp, worker_settings: OutboxSettings) -> None:
    """Terminate the workflows that a stopped worker (of these settings) left running: with an
    idle timeout of 0 its partitions wait for rows for ever, and workflow ids name the table,
    not the task queue, so the next worker of these tables (on a task queue of its own) would
    find them running where nobody polls, and its rows would wait."""
    failures: list[BaseException] = []

    # On a loop and a thread of their own: asyncio.run in the test's thread would unset
    # pytest-asyncio's loop there.
    def run() -> None:
        try:
            asyncio.run(_end_workflows(servers, app, worker_settings))
        except BaseException as exc:  # re-raised in the caller's thread
            failures.append(exc)

    thread = threading.Thread(target=run, name="end-workflows")
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the workflows were not terminated within 60 s"
    if failures:
        raise failures[0]


async def _end_workflows(servers: Servers, app: OutboxApp, worker_settings: OutboxSettings) -> None:
    client = await connect_client(servers)
    task_queue, partitions = worker_settings.task_queue, worker_settings.partitions
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


def flush_settings(worker: ThreadWorker) -> OutboxSettings:
    """The settings a producer flushes with to reach ``worker``."""
    update: dict[str, Any] = {"temporal_address": worker.servers.temporal_address}
    return worker.settings.model_copy(update=update)


# Shard and object identifiers unique in the session, far above the models' primary keys: the
# Django tests share one table, one Temporal namespace and the workers' shard workflows.
_identifiers = itertools.count(10**9)


def next_identifier() -> int:
    return next(_identifiers)
