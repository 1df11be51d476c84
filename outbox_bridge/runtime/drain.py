"""Draining a shard: read its head groups, run their handlers, delete what succeeded.

This is the library behind the activities. Every call holds the shard's advisory lock on its own
connection for its whole duration, so two executions of one shard never overlap, and never
holds a transaction or a row lock while a handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import Row
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox_bridge.db.schema import TRACE_CONTEXT_COLUMN
from outbox_bridge.db.store import (
    GroupRows,
    delete_rows,
    read_head,
    read_pending_up_to,
    read_shard_head_info,
    read_trace_contexts,
    try_lock_shard,
    unlock_shard,
)
from outbox_bridge.errors import (
    CategoryScopeError,
    OutboxError,
    ShardLockedError,
    UnknownCategoryError,
)
from outbox_bridge.observability.logs import log_context
from outbox_bridge.observability.observe import BatchObserver
from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.workflows.models import (
    DrainInput,
    DrainResult,
    FlushCheck,
    FlushCheckInput,
    HandleHeadInput,
    HandleHeadResult,
    HandlerFailure,
    HeadGroup,
    ShardRef,
)

log = logging.getLogger("outbox_bridge.runtime.drain")

# A waiting flush reads the table after 10 ms, then less and less often, at least every 250 ms.
FLUSH_POLL_FIRST = 0.01
FLUSH_POLL_MAX = 0.25


class HandlerFailed(Exception):
    """A handler raised; carries what may enter Temporal history about it."""

    def __init__(self, failure: HandlerFailure, group: GroupRows) -> None:
        super().__init__(failure.message or failure.error_type)
        self.failure = failure
        self.group = group


class ShardDrainer:
    """Runs handlers for shards of ``app``'s tables against ``engine``."""

    def __init__(
        self,
        engine: AsyncEngine,
        app: OutboxApp,
        *,
        redact_errors: bool = False,
        handler_threads: int = 16,
        hub: ShardHub | None = None,
        max_lingering: int = 100,
    ) -> None:
        self._hub = hub
        self._max_lingering = max_lingering
        self._engine = engine
        self._app = app
        self._redact = redact_errors
        self._executor = ThreadPoolExecutor(handler_threads, thread_name_prefix="outbox-handler")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- locking ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _locked(self, shard: ShardRef) -> AsyncIterator[AsyncConnection]:
        conn = await self._engine.connect()
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        locked = False
        try:
            locked = await try_lock_shard(conn, shard)
            if not locked:
                raise ShardLockedError(
                    f"shard {shard.key} is locked by another execution (a previous attempt may "
                    "still be running its handler); retrying"
                )
            yield conn
        finally:
            await self._release(conn, shard, locked)

    @staticmethod
    async def _release(conn: AsyncConnection, shard: ShardRef, locked: bool) -> None:
        try:
            if locked:
                await unlock_shard(conn, shard)
        except BaseException:
            # A connection that may still hold the lock must never go back to the pool.
            await conn.invalidate()
            raise
        finally:
            await conn.close()

    # -- public entry points ---------------------------------------------------------------

    async def drain(self, request: DrainInput) -> DrainResult:
        """Handle head groups in order until the shard is empty, a handler fails, the head is
        deferred, or the batch limits are reached; stops at the first failure.

        With ``linger_seconds``, a drain that emptied its shard then waits that long for news of
        new rows from the bridge (:class:`ShardHub`), handling them as they come, without
        holding the shard lock or a connection while it waits.
        """
        result = DrainResult()
        hub = self._hub
        if (
            hub is None
            or request.linger_seconds <= 0
            or hub.closed
            or len(hub) >= self._max_lingering  # lingering drains hold activity slots
        ):
            await self._drain_batch(request, result)
            return result
        # Registered for the whole call, not only while waiting: news of rows that commit
        # while a batch runs is kept in the event and drained right after the batch, instead
        # of going to the workflow while this drain waits a linger period for the next news.
        key = request.shard.hub_key
        event = hub.arrive(key)
        try:
            await self._drain_batch(request, result)
            until = time.monotonic() + max(request.linger_max_seconds, request.linger_seconds)
            while _emptied(result) and not hub.closed:
                if not event.is_set():
                    # Wait at most linger_seconds for the next row, linger_max_seconds in all.
                    remaining = min(request.linger_seconds, until - time.monotonic())
                    if remaining <= 0:
                        break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(event.wait(), remaining)
                    if not event.is_set():
                        break  # nothing was handed to us: the bridge signals what comes next
                event.clear()
                before = result.rows_handled
                try:
                    await self._drain_batch(request, result)
                except ShardLockedError:
                    result.more = True  # another execution holds the shard: let the workflow see
                    break
                result.lingered_rows += result.rows_handled - before
        finally:
            # Also when cancelled (a skip): a stale entry would swallow the bridge's news.
            hub.leave(key, event)
        if event.is_set() and not hub.closed:
            result.more = True  # news came as we left: the workflow drains again
        return result

    async def _drain_batch(self, request: DrainInput, result: DrainResult) -> None:
        shard = request.shard
        table = self._app.table(shard.table)
        deadline = time.monotonic() + request.time_budget_seconds
        result.more = False
        async with self._locked(shard) as conn:
            info = await read_shard_head_info(conn, table, shard)
            result.highest_seen_id = max(result.highest_seen_id, info.highest_id or 0)
            groups, rows = await read_head(
                conn, table, shard, barrier_id=info.barrier_id, limit=request.max_groups
            )
            calls: list[_Call] = []
            for group in groups:
                row = rows.get(group.last_id)
                if row is None:  # deleted behind our back: read the head again
                    break
                calls.append(self._prepare(shard, group, row))
            observer = await self._observer(conn, shard, calls, rows)
            done: list[int] = []

            def handled(call: _Call) -> None:
                done.extend(call.group.ids)
                result.groups_handled += 1

            try:
                finished = await self._run(shard, calls, handled, observer, deadline=deadline)
                if finished:
                    result.more = len(calls) < len(groups) or len(groups) == request.max_groups
                else:
                    result.more = True
            except HandlerFailed as failed:
                result.failed = self._head(failed.group)
                result.failure = failed.failure
            finally:
                result.rows_handled += await delete_rows(conn, table, done)
                observer.finish()
        result.deferred_until = None
        if not result.more and result.failed is None and info.deferred_until is not None:
            result.deferred_until = info.deferred_until.isoformat()

    async def wait_handled(self, request: FlushCheckInput) -> FlushCheck:
        """Wait until no row of the shard up to ``up_to_id`` is pending (handled), one of them
        holds the shard as a deferred head (not due yet), or the timeout passes. Polls the
        table with growing pauses; takes no lock, so it never delays the drain."""
        shard = request.shard
        table = self._app.table(shard.table)
        deadline = time.monotonic() + request.timeout_seconds
        pause = FLUSH_POLL_FIRST
        while True:
            try:
                async with self._engine.connect() as conn:
                    pending, deferred_until = await read_pending_up_to(
                        conn, table, shard, request.up_to_id
                    )
            except SQLAlchemyError as exc:
                log.warning("flush of shard %s cannot read the table: %s", shard.key, exc)
            else:
                if not pending:
                    return FlushCheck(handled=True)
                if deferred_until is not None:
                    return FlushCheck(handled=False, deferred_until=deferred_until.isoformat())
            left = deadline - time.monotonic()
            if left <= 0:
                return FlushCheck(handled=False)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 1.5, FLUSH_POLL_MAX)

    async def handle_head(
        self,
        request: HandleHeadInput,
        *,
        heartbeat: Callable[[], None] | None = None,
        attempt: int = 1,
    ) -> HandleHeadResult:
        """Handle the shard's head group if it is still the given group (it may have been
        handled meanwhile, or removed by an operator). Raises :class:`HandlerFailed`."""
        shard = request.shard
        table = self._app.table(shard.table)
        async with self._locked(shard) as conn:
            info = await read_shard_head_info(conn, table, shard)
            groups, rows = await read_head(conn, table, shard, barrier_id=info.barrier_id, limit=1)
            if not groups or (groups[0].category, groups[0].object_identifier) != (
                request.category,
                request.object_identifier,
            ):
                return HandleHeadResult(handled=False)
            group = groups[0]
            if heartbeat is not None:
                heartbeat()
            call = self._prepare(shard, group, rows[group.last_id])
            observer = await self._observer(conn, shard, [call], rows)
            await self._run(shard, [call], lambda _: None, observer, attempt=attempt + 1)
            deleted = await delete_rows(conn, table, group.ids)
            observer.finish()
            return HandleHeadResult(handled=True, rows_handled=deleted, last_id=group.last_id)

    # -- handler invocation ----------------------------------------------------------------

    def _head(self, group: GroupRows) -> HeadGroup:
        return HeadGroup(
            category=group.category,
            category_name=self._app.category_name(group.category),
            object_identifier=group.object_identifier,
            first_id=group.first_id,
            last_id=group.last_id,
            rows=len(group.ids),
        )

    def _resolve_handler(self, shard: ShardRef, category: int) -> Handler:
        known = self._app.category(category)
        if known is None:
            raise UnknownCategoryError(
                f"category {category} is not registered in this worker's app; deploy a worker "
                f"whose registry has it, or skip shard {shard.key}"
            )
        owner = self._app.scope_of(category)
        if owner is None or int(owner) != shard.scope:
            raise CategoryScopeError(
                f"category {known.name} belongs to scope {owner.name if owner else '?'}, but the "
                f"row is in scope {shard.scope_name}; fix or delete the row, or skip shard "
                f"{shard.key}"
            )
        handler = self._app.handler_for(category)
        if handler is None:  # the worker checks this at start; kept for apps built by hand
            raise UnknownCategoryError(f"category {known.name} has no handler in this worker")
        return handler

    def _message(self, shard: ShardRef, group: GroupRows, row: Row[Any]) -> OutboxMessage:
        scope = self._app.scope(row.shard_scope)
        category = self._app.category(row.category)
        return OutboxMessage(
            id=row.id,
            shard_scope=scope if scope is not None else row.shard_scope,
            shard_identifier=row.shard_identifier,
            category=category if category is not None else row.category,
            object_identifier=row.object_identifier,
            payload=row.payload,
            region=getattr(row, "region", None),
            date_added=row.date_added,
            scheduled_for=row.scheduled_for,
            coalesced=len(group.ids),
        )

    def _prepare(self, shard: ShardRef, group: GroupRows, row: Row[Any]) -> _Call:
        message = self._message(shard, group, row)
        category = self._app.category_name(group.category)
        try:
            handler = self._resolve_handler(shard, group.category)
        except OutboxError as exc:
            return _Call(group, None, message, category, exc)
        return _Call(group, handler, message, category)

    async def _observer(
        self, conn: AsyncConnection, shard: ShardRef, calls: list[_Call], rows: dict[int, Row[Any]]
    ) -> BatchObserver:
        """The batch's observer; with tracing on, given the producer trace context of every row
        the calls cover (the handled rows' came with them; the others take one statement)."""
        observer = BatchObserver(shard, redact_errors=self._redact)
        if observer.traced and calls:
            contexts = {
                row_id: carrier
                for row_id, row in rows.items()
                if (carrier := getattr(row, TRACE_CONTEXT_COLUMN, None)) is not None
            }
            covered = [row_id for call in calls for row_id in call.group.ids[:-1]]
            if covered:
                table = self._app.table(shard.table)
                contexts.update(await read_trace_contexts(conn, table, covered))
            observer.set_trace_contexts(contexts)
        return observer

    async def _run(
        self,
        shard: ShardRef,
        calls: list[_Call],
        handled: Callable[[_Call], None],
        observer: BatchObserver,
        *,
        deadline: float = math.inf,
        attempt: int = 1,
    ) -> bool:
        """Call the handlers of ``calls`` in order, reporting each success to ``handled``.

        Raises :class:`HandlerFailed` at the first failure; returns False when the deadline
        stopped it early (the first call always runs). Runs of consecutive sync handlers go to
        a worker thread in one hop, so a backlog of cheap handlers does not pay a thread switch
        per row. Each call gets its own span from ``observer`` (a child of the activity's).
        """
        index = 0
        while index < len(calls):
            call = calls[index]
            if call.is_sync:
                end = index
                while end < len(calls) and calls[end].is_sync:
                    end += 1
                count, error = await self._in_thread(
                    calls[index:end], handled, observer, deadline, index, attempt
                )
                index += count
                if error is not None:
                    raise self._failure(shard, calls[index], error, attempt)
                if index < end:
                    return False
                continue
            if index and time.monotonic() > deadline:
                return False
            try:
                with observer.call(call.group, call.message, call.category, attempt):
                    if call.error is not None:
                        raise call.error
                    assert call.handler is not None
                    returned = await call.handler(call.message)  # type: ignore[misc]
            except asyncio.CancelledError as exc:
                if _cancelled():
                    raise  # this attempt was cancelled (a timeout, a skip, a shutdown)
                # The handler raised CancelledError itself: a failure like any other, or the
                # local drain would fail the shard's workflow instead of blocking it.
                raise self._failure(shard, call, exc, attempt) from exc
            except BaseException as exc:  # a handler's SystemExit must not take the worker down
                raise self._failure(shard, call, exc, attempt) from exc
            self._check_returned(call, returned)
            handled(call)
            index += 1
        return True

    async def _in_thread(
        self,
        run: list[_Call],
        handled: Callable[[_Call], None],
        observer: BatchObserver,
        deadline: float,
        offset: int,
        attempt: int,
    ) -> tuple[int, BaseException | None]:
        """Call the sync handlers of ``run`` in order in one worker thread; returns how many
        succeeded and the exception of the one that failed, if any."""
        stop = threading.Event()
        count = 0

        def call_all() -> BaseException | None:
            nonlocal count
            for call in run:
                if stop.is_set() or (offset + count and time.monotonic() > deadline):
                    return None
                assert call.handler is not None
                try:
                    with observer.call(call.group, call.message, call.category, attempt):
                        returned = call.handler(call.message)
                except BaseException as exc:  # reported by the caller, like an async handler's
                    return exc
                self._check_returned(call, returned)
                handled(call)
                count += 1
            return None

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, contextvars.copy_context().run, call_all)
        try:
            error = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be interrupted: stop after the running handler and keep the shard
            # lock until it really returns, so that a retry never overlaps it. What succeeded
            # is deleted by the caller.
            stop.set()
            with contextlib.suppress(BaseException):
                await future
            raise
        return count, error

    def _failure(
        self, shard: ShardRef, call: _Call, exc: BaseException, attempt: int
    ) -> HandlerFailed:
        group = call.group
        with log_context(shard=shard.key, category=call.category):
            # The traceback on the first failure and every tenth retry; one line in between.
            log.warning(
                "handler failed: shard=%s category=%s object=%s id=%s coalesced=%s attempt=%s: "
                "%s: %s",
                shard.key,
                call.category,
                group.object_identifier,
                group.last_id,
                len(group.ids),
                attempt,
                type(exc).__qualname__,
                exc,
                exc_info=exc if attempt % 10 == 1 else None,
            )
        message_text = "" if self._redact else str(exc)
        return HandlerFailed(HandlerFailure(type(exc).__qualname__, message_text), group)

    def _check_returned(self, call: _Call, returned: object) -> None:
        if returned is not None:
            log.warning(
                "handler for %s returned %r; handlers should return None (the value is ignored)",
                self._app.category_name(call.group.category),
                type(returned).__name__,
            )


@dataclasses.dataclass
class _Call:
    """One head group ready to be handled: its handler and message, or why it has none."""

    group: GroupRows
    handler: Handler | None
    message: OutboxMessage
    category: str  # the category's name, for spans, metrics and logs
    error: BaseException | None = None

    @property
    def is_sync(self) -> bool:
        return self.handler is not None and not OutboxApp.is_async_handler(self.handler)


def _cancelled() -> bool:
    """Whether the running task was asked to cancel (rather than something raising
    CancelledError on its own)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _emptied(result: DrainResult) -> bool:
    return not result.more and result.failed is None and result.deferred_until is None
