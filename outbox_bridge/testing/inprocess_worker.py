"""The app's worker in a test (:class:`OutboxWorker`), which waits for rows to be handled and
explains a shard left unhandled."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from pydantic import SecretStr
from sqlalchemy import ColumnElement, Table, and_, func, select, true
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.schema import shard_columns, shard_where
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import shard_status
from outbox_bridge.runtime.temporal import connect
from outbox_bridge.runtime.worker import serve
from outbox_bridge.testing.drain import shard_targets
from outbox_bridge.testing.servers import EventLoopThread, OutboxDatabase
from outbox_bridge.workflows.models import PartitionRef, ShardRef


def worker_settings(**overrides: Any) -> OutboxSettings:
    """Settings for a worker under test: short retry and sweep timers, a task queue of its own,
    no health endpoints; ``overrides`` are :class:`~outbox_bridge.OutboxSettings` fields."""
    values: dict[str, Any] = {
        "initial_retry_interval": 0.2,
        "max_retry_interval": 1.0,
        "handover_after": 0.0,  # a failing shard gets its workflow at once: tests see it
        "handler_timeout": 20.0,
        "heartbeat_timeout": 5.0,
        "poll_interval": 0.2,
        "sweep_interval": 1.5,
        "task_queue": f"outbox-test-{uuid.uuid4().hex[:8]}",
        "health_port": 0,  # the default (8080) belongs to the machine; a taken one logs an error
    }
    values.update(overrides)
    return OutboxSettings(**values)


class OutboxWorker:
    """The bridge and Temporal worker of ``app`` on ``database``, running in ``loop`` (as
    ``outbox-bridge worker`` would, in this process) between :meth:`start` and :meth:`stop`.

    Its ``settings`` carry the database URL and the Temporal address, so that the code under
    test can flush to it: ``app.configure_flush(worker.settings)``.
    """

    def __init__(
        self,
        app: OutboxApp,
        database: OutboxDatabase,
        temporal_address: str,
        loop: EventLoopThread,
        settings: OutboxSettings | None = None,
    ) -> None:
        self.app = app
        self.database = database
        self.loop = loop
        self.settings = (settings or worker_settings()).model_copy(
            update={"database_url": SecretStr(database.url), "temporal_address": temporal_address}
        )
        self.client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    def start(self, timeout: float = 60.0) -> OutboxWorker:
        """Start the worker; returns once its bridge found the tables and swept once."""
        self.loop.run(self._start(timeout))
        return self

    async def _start(self, timeout: float) -> None:
        address = self.settings.temporal_address
        assert address is not None
        self.client = await connect(self.settings, address)
        await self._end_partitions_of_other_queues()
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._task = asyncio.create_task(
            serve(
                self.settings,
                self.app,
                stop=self._stop,
                database_url=self.database.url,
                temporal_address=address,
                ready=ready,
            ),
            name="outbox-worker",
        )
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait(
            [self._task, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        if self._task.done():
            self._task.result()  # raises why the worker stopped
        if not ready.is_set():
            await self._stop_worker()
            raise TimeoutError(f"the worker did not become ready within {timeout:g} s")

    def stop(self) -> None:
        """Stop the worker, then terminate the workflows it left running, so that the next
        test's worker finds none."""
        self.loop.run(self._stop_worker())

    async def _stop_worker(self) -> None:
        try:
            if self._stop is not None and self._task is not None:
                self._stop.set()
                await asyncio.wait_for(self._task, 60)
        finally:
            await self._terminate_workflows()

    def _partition_ids(self) -> list[str]:
        regions = tuple(sorted(self.settings.regions)) if self.settings.regions else None
        return [
            PartitionRef(table, n, self.settings.partitions, regions).workflow_id
            for table in self.app.tables
            for n in range(self.settings.partitions)
        ]

    async def _end_partitions_of_other_queues(self) -> None:
        """Partition ids name the table, not the task queue: end those that a worker which did
        not stop cleanly left on another queue, before this one finds them."""
        assert self.client is not None
        for workflow_id in self._partition_ids():
            handle = self.client.get_workflow_handle(workflow_id)
            with contextlib.suppress(RPCError):  # never started, or ended meanwhile
                description = await handle.describe()
                if (
                    description.status == WorkflowExecutionStatus.RUNNING
                    and description.task_queue != self.settings.task_queue
                ):
                    await handle.terminate("left running by an earlier worker of the tests")

    async def _terminate_workflows(self) -> None:
        client = self.client
        if client is None:
            return
        known = self._partition_ids()
        query = f"ExecutionStatus = 'Running' AND TaskQueue = '{self.settings.task_queue}'"
        quiet = 0
        deadline = time.monotonic() + 15
        while quiet < 2 and time.monotonic() < deadline:
            running = [execution.id async for execution in client.list_workflows(query)]
            for workflow_id in [*known, *running]:
                with contextlib.suppress(RPCError):  # not running (any more)
                    await client.get_workflow_handle(workflow_id).terminate("the test is over")
            known = []
            quiet = 0 if running else quiet + 1
            await asyncio.sleep(0.1)

    def __enter__(self) -> OutboxWorker:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def wait_handled(
        self, target: int | str | None = None, *, table: str | None = None, timeout: float = 10.0
    ) -> None:
        """Wait until the worker has handled (deleted) rows of the database:

        - ``target`` an ``int``: the row with that id (of ``table``, the app's first table by
          default);
        - a ``str``: every row of that shard (``SCOPE:ID``, ``REGION:SCOPE:ID``) pending now;
        - ``None``: every row pending now (in ``table``, or in every table of the app).

        Raises ``AssertionError`` after ``timeout`` seconds, saying what is left and what the
        shard's workflow reports (a handler that keeps failing, a row not due yet), or at once
        if the worker stopped.
        """
        __tracebackhide__ = True
        waits = self._pending(target, table)
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            if self._task is None:
                raise RuntimeError("the worker is not running: call start() first")
            if self._task.done():
                raise AssertionError(f"the worker stopped: {self._stopped_because()}")
            with self.database.engine.connect() as conn:
                left = [
                    (table_, where)
                    for table_, where in waits
                    if conn.execute(select(select(table_.c.id).where(where).exists())).scalar()
                ]
            if not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(self._explain(target, left, timeout))
            time.sleep(pause)
            pause = min(pause * 1.5, 0.2)

    async def wait_handled_async(
        self, target: int | str | None = None, *, table: str | None = None, timeout: float = 10.0
    ) -> None:
        """:meth:`wait_handled`, without blocking the running event loop."""
        await asyncio.to_thread(self.wait_handled, target, table=table, timeout=timeout)

    def _pending(
        self, target: int | str | None, table: str | None
    ) -> list[tuple[Table, ColumnElement[bool]]]:
        """What to wait for: per table, the rows that must be gone."""
        app = self.app
        if isinstance(target, int) and not isinstance(target, bool):
            outbox = app.table(table)
            return [(outbox, outbox.c.id == target)]
        if target is not None and not isinstance(target, str):
            raise TypeError(f"wait_handled() takes a row id or a shard, not {target!r}")
        wanted = shard_targets(app, target, table)
        waits: list[tuple[Table, ColumnElement[bool]]] = []
        with self.database.engine.connect() as conn:
            for outbox, shard in wanted:
                where = shard_where(outbox, shard) if shard is not None else true()
                highest = conn.execute(select(func.max(outbox.c.id)).where(where)).scalar()
                if highest is not None:
                    waits.append((outbox, and_(where, outbox.c.id <= highest)))
        return waits

    def _stopped_because(self) -> str:
        assert self._task is not None
        if self._task.cancelled():
            return "cancelled"
        error = self._task.exception()
        return f"{type(error).__name__}: {error}" if error is not None else "it returned"

    def _explain(
        self,
        target: int | str | None,
        left: list[tuple[Table, ColumnElement[bool]]],
        timeout: float,
    ) -> str:
        what = {int: f"row {target}", str: f"shard {target}"}.get(type(target), "the rows")
        lines = [f"{what} not handled within {timeout:g} s"]
        with self.database.engine.connect() as conn:
            for outbox, where in left:
                keys = [outbox.c[name] for name in shard_columns("region" in outbox.c)]
                first_id = func.min(outbox.c.id)
                query = select(*keys, func.count(), first_id).where(where).group_by(*keys)
                for *key, rows, first in conn.execute(query.order_by(first_id).limit(5)):
                    region = key[0] if len(key) == 3 else None
                    scope, ident = key[-2:]
                    shard = ShardRef(outbox.name, scope, self.app.scope_name(scope), ident, region)
                    lines.append(
                        f"  shard {shard.key} of {outbox.name}: {rows} row(s) left from id "
                        f"{first}; {self._shard_state(shard)}"
                    )
        return "\n".join(lines)

    def _shard_state(self, shard: ShardRef) -> str:
        """What the shard's workflow says, if it has one."""
        if self.client is None:
            return "no Temporal client"
        try:
            status = self.loop.run(shard_status(self.client, shard), timeout=10)
        except RPCError:
            return "no workflow of its own (a partition drains it)"
        except Exception as exc:
            return f"its workflow did not answer ({type(exc).__name__}: {exc})"
        said = [f"its workflow is {status.state}"]
        if (head := status.head) is not None:
            said.append(f"head {head.summary} (ids {head.first_id}-{head.last_id})")
        if status.last_error is not None:
            error = status.last_error
            said.append(
                f"last error after {status.attempts} attempt(s): "
                f"{error.error_type}: {error.message}".rstrip(": ")
            )
        if status.deferred_until:
            said.append(f"deferred until {status.deferred_until}")
        if status.skip is not None:
            said.append(f"skipped: {status.skip.reason}")
        return ", ".join(said)
