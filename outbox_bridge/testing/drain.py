"""Handling an app's outbox rows in-process, without Temporal, with the worker's own reads,
calls and deletes but no shard lock: for a database no worker drains at the same time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypedDict, TypeVar, Unpack, cast

from sqlalchemy import Connection, Engine, Row, Table
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox_bridge.db.ownership import read_held_shards
from outbox_bridge.db.reads import GroupRows
from outbox_bridge.db.scans import read_shard_ranges
from outbox_bridge.db.writes import delete_handled
from outbox_bridge.errors import OutboxError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.calls import Call, HandlerCalls
from outbox_bridge.runtime.heads import read_shard_heads
from outbox_bridge.runtime.shards import parse_shard
from outbox_bridge.testing.report import DrainFailure, DrainReport, HandlerFailedError, ShardReport
from outbox_bridge.workflows.models import HeldFor, ShardRef

T = TypeVar("T")

MAX_GROUPS = 500  # head groups per read of a shard, as the worker's drain_max_groups
# Handlers that write a new row for every row they handle would keep a drain going forever.
MAX_READS = 10_000

SyncBind = Engine | Connection | Session
AsyncBind = AsyncEngine | AsyncConnection | AsyncSession


class DrainOptions(TypedDict, total=False):
    """The keyword options of :func:`drain_outbox`, which the other drains take as they are."""

    shard: str | ShardRef | None
    table: str | None
    run_deferred: bool
    raise_on_failure: bool


class _UsageError(TypeError):
    """The drain was called where it cannot run a handler: not the handler's failure."""


class _Drain:
    """One drain over a connection: shard after shard, each up to its end, first failure or
    first row not yet due; again while rows were handled (handlers may write more)."""

    def __init__(
        self, app: OutboxApp, invoke: Callable[[Call], Awaitable[None]], options: DrainOptions
    ) -> None:
        self.app = app
        self.invoke = invoke
        self.targets = shard_targets(app, options.get("shard"), options.get("table"))
        self.run_deferred = options.get("run_deferred", False)
        self.raise_on_failure = options.get("raise_on_failure", True)
        self.report = DrainReport()
        self._reports: dict[tuple[str, str], ShardReport] = {}
        self._reads = 0

    async def run(self, conn: AsyncConnection) -> DrainReport:
        self.conn = conn
        self.calls = HandlerCalls(self.app, redact_errors=False, threads=1)
        try:
            while await self._round():
                pass
        finally:
            self.calls.close()
        return self.report

    async def _round(self) -> bool:
        """Drain every shard with rows once; whether any row was handled."""
        progressed = False
        for table, only in self.targets:
            skipped = {
                (held.region, held.scope, held.shard_identifier)
                for held in await read_held_shards(self.conn, table)
                if held.held_for == HeldFor.SKIPPED
            }
            for ref in await self._pending(table, only):
                report = self._reports.get((table.name, ref.key))
                if report is None:
                    report = self._reports[table.name, ref.key] = ShardReport(table.name, ref.key)
                    self.report.shards.append(report)
                if report.skipped or report.failure or report.deferred_until:
                    continue
                if (ref.region, ref.scope, ref.shard_identifier) in skipped:
                    report.skipped = True
                    continue
                before = report.rows_deleted
                await self._shard(table, ref, report)
                progressed = progressed or report.rows_deleted > before
                if report.failure is not None and self.raise_on_failure:
                    raise HandlerFailedError(report.failure, self.report) from report.failure.error
        return progressed

    async def _pending(self, table: Table, only: ShardRef | None) -> list[ShardRef]:
        """The shards of ``table`` with rows, the one with the oldest row first."""
        ranges = sorted(await read_shard_ranges(self.conn, table), key=lambda r: r.min_id)
        name = self.app.scope_name
        refs = (
            ShardRef(table.name, r.scope, name(r.scope), r.shard_identifier, r.region)
            for r in ranges
        )
        return [ref for ref in refs if only in (None, ref)]

    async def _shard(self, table: Table, ref: ShardRef, report: ShardReport) -> None:
        conn = self.conn

        async def execute(work: Callable[[AsyncConnection], Awaitable[Any]]) -> Any:
            return await work(conn)

        while True:
            self._reads += 1
            if self._reads > MAX_READS:
                raise OutboxError(
                    f"the outbox was not empty after {MAX_READS} reads: do the handlers write a "
                    "new row for each row they handle?"
                )
            heads = await read_shard_heads(
                execute,
                table,
                [ref],
                max_groups=MAX_GROUPS,
                skip_held=False,
                max_payload_bytes=self.calls.max_payload_bytes,
                deferred_as_due=self.run_deferred,
            )
            if not heads:
                return  # emptied
            [head] = heads
            if not head.groups and head.deferred_until is None:
                return  # nothing due and nothing deferred: nothing to do
            for group in head.groups:
                row = head.rows.get(group.last_id)
                if row is None:
                    break  # a handler deleted it: read the head again
                if not await self._handle(table, ref, group, row, report):
                    return
            else:
                if not head.more and head.deferred_until is not None:
                    report.deferred_until = head.deferred_until
                    return

    async def _handle(
        self, table: Table, ref: ShardRef, group: GroupRows, row: Row[Any], report: ShardReport
    ) -> bool:
        """Handle ``group`` with its newest ``row`` and delete its rows; False if the handler
        failed (recorded in ``report``, the rows kept)."""
        call = self.calls.prepare(ref, group, row)
        try:
            if call.error is not None:
                raise call.error
            await self.invoke(call)
        except _UsageError:
            raise
        except Exception as exc:
            # Not BaseException: pytest's fail or skip and KeyboardInterrupt go through.
            report.failure = DrainFailure(
                table.name, ref.key, call.category, call.message, tuple(group.ids), exc
            )
            return False
        report.messages.append(call.message)
        report.rows_deleted += len(await delete_handled(self.conn, table, group.ids))
        return True


def shard_targets(
    app: OutboxApp, shard: str | ShardRef | None, table: str | None
) -> list[tuple[Table, ShardRef | None]]:
    """The tables to drain, each with the one shard to drain in it (None: every shard)."""
    names = [app.table(table).name] if table is not None else list(app.tables)
    if shard is None:
        return [(app.table(name), None) for name in names]
    if isinstance(shard, ShardRef):
        return [(app.table(shard.table), shard)]
    targets: list[tuple[Table, ShardRef | None]] = []
    for name in names:
        # A shard's name fits the tables of its form (REGION:SCOPE:ID for a regional table).
        if (shard.count(":") >= 2) == app.table_spec(name).regional:
            targets.append((app.table(name), parse_shard(shard, app, table=name)))
    if not targets:
        parse_shard(shard, app, table=table)  # raises, saying which form the name needs
    return targets


class _Blocking:
    """A sync ``Connection`` behind the awaitable ``execute`` of :mod:`outbox_bridge.db.ownership`:
    statements run at once, in the calling thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        return self.conn.execute(statement, parameters)


class _SyncCalls:
    """Calls handlers in the calling thread; ``async def`` ones on an event loop of its own."""

    def __init__(self) -> None:
        self._runner: asyncio.Runner | None = None

    async def __call__(self, call: Call) -> None:
        assert call.handler is not None
        if call.is_sync:
            call.handler(call.message)
            return
        if self._runner is None:  # never set as the thread's current loop
            self._runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        running = cast(Coroutine[Any, Any, None], call.handler(call.message))
        try:
            self._runner.run(running)
        except RuntimeError as exc:
            if "running event loop" not in str(exc):
                raise
            running.close()
            raise _UsageError(
                "drain_outbox() cannot run an async handler while an event loop runs in this "
                "thread (an async test): use await drain_outbox_async()"
            ) from None

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


def _to_the_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits (every statement and call in it completes at once)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise RuntimeError("the in-process drain waited on something: it cannot run synchronously")


@contextlib.contextmanager
def _sync_connection(bind: SyncBind) -> Iterator[Connection]:
    if isinstance(bind, Session):
        bind.flush()  # rows of OutboxModel instances are written by the flush
        yield bind.connection()
    elif isinstance(bind, Connection):
        yield bind
    elif isinstance(bind, Engine):  # each statement commits on its own, like the worker's
        with bind.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        raise TypeError(
            f"drain_outbox() needs a SQLAlchemy Engine, Connection or Session, not "
            f"{type(bind).__name__} (an async one takes drain_outbox_async())"
        )


def drain_outbox(
    app: OutboxApp,
    bind: SyncBind,
    *,
    shard: str | ShardRef | None = None,
    table: str | None = None,
    run_deferred: bool = False,
    raise_on_failure: bool = True,
) -> DrainReport:
    """Handle every due row of ``app``'s tables in the calling thread, as the worker would:
    shard by shard in id order, each coalescing group once with its newest row, deleting
    exactly the rows handled. Rows that handlers write meanwhile are handled too.

    Args:
        app: the app whose handlers run.
        bind: an ``Engine`` (each statement commits on its own), or a ``Connection`` or
            ``Session``: the drain then runs in its transaction, sees its uncommitted rows and
            deletes in it, and never commits (a test may roll everything back).
        shard: only this shard (``SCOPE:ID``, ``REGION:SCOPE:ID`` for a regional table).
        table: only this table of the app.
        run_deferred: handle rows not due yet too, in id order; otherwise the first of them
            holds its shard, as in the worker.
        raise_on_failure: raise :class:`HandlerFailedError` at the first handler that raises;
            otherwise record it in the report, keep its rows and stop its shard (the other
            shards go on).

    Shards skipped by an operator (``outbox-bridge skip``) are left alone; a shard that a
    workflow holds for any other reason is drained (no workflow runs in a test). Sync
    handlers run in the calling thread, async ones on an event loop of the drain's own.
    """
    options = DrainOptions(
        shard=shard, table=table, run_deferred=run_deferred, raise_on_failure=raise_on_failure
    )
    calls = _SyncCalls()
    drain = _Drain(app, calls, options)
    with contextlib.closing(calls), _sync_connection(bind) as conn:
        return _to_the_end(drain.run(cast(AsyncConnection, _Blocking(conn))))


async def _call_async(call: Call) -> None:
    assert call.handler is not None
    if call.is_sync:  # in a thread, as the worker runs plain-def handlers
        await asyncio.to_thread(call.handler, call.message)
    else:
        await cast(Awaitable[None], call.handler(call.message))


@contextlib.asynccontextmanager
async def _async_connection(bind: AsyncBind) -> AsyncIterator[AsyncConnection]:
    if isinstance(bind, AsyncSession):
        await bind.flush()
        yield await bind.connection()
    elif isinstance(bind, AsyncConnection):
        yield bind
    elif isinstance(bind, AsyncEngine):
        async with bind.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        raise TypeError(
            "drain_outbox_async() needs a SQLAlchemy AsyncEngine, AsyncConnection or "
            f"AsyncSession, not {type(bind).__name__} (a sync one takes drain_outbox())"
        )


async def drain_outbox_async(
    app: OutboxApp, bind: AsyncBind, **options: Unpack[DrainOptions]
) -> DrainReport:
    """:func:`drain_outbox` in the running event loop, with an ``AsyncEngine``,
    ``AsyncConnection`` or ``AsyncSession``, and its options. Async handlers run in this loop;
    plain-def handlers in a thread, one at a time, as the worker runs them."""
    drain = _Drain(app, _call_async, options)
    async with _async_connection(bind) as conn:
        return await drain.run(conn)


class OutboxRunner:
    """Drains when its block ends (unless the block raised): ``with`` runs
    :func:`drain_outbox`, ``async with`` runs :func:`drain_outbox_async`. ``report`` holds the
    last drain's report; :meth:`drain` drains within the block."""

    def __init__(
        self, app: OutboxApp, bind: SyncBind | AsyncBind, **options: Unpack[DrainOptions]
    ) -> None:
        unknown = sorted(options.keys() - DrainOptions.__annotations__)
        if unknown:  # now, not when the block ends
            raise TypeError(
                f"unknown drain options {unknown}; they are {list(DrainOptions.__annotations__)}"
            )
        self.app = app
        self.bind = bind
        self.options = options
        self.report: DrainReport | None = None

    def drain(self) -> DrainReport:
        self.report = drain_outbox(self.app, cast(SyncBind, self.bind), **self.options)
        return self.report

    async def drain_async(self) -> DrainReport:
        bind = cast(AsyncBind, self.bind)
        self.report = await drain_outbox_async(self.app, bind, **self.options)
        return self.report

    def __enter__(self) -> OutboxRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.drain()

    async def __aenter__(self) -> OutboxRunner:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self.drain_async()


def outbox_runner(
    app: OutboxApp, bind: SyncBind | AsyncBind, **options: Unpack[DrainOptions]
) -> OutboxRunner:
    """A context manager that drains ``app``'s outbox when its block ends: ``with
    outbox_runner(app, session) as runner:`` (or ``async with`` and an async bind). The
    options are :func:`drain_outbox`'s."""
    return OutboxRunner(app, bind, **options)
