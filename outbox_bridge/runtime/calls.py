"""Calling handlers: one shard's head groups, in order, each with its newest row. Sync handlers
of consecutive groups run in one worker thread hop; async ones on the event loop. The first
failure stops the shard and is raised as :class:`HandlerFailed`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.db.grants import Role, privilege_advice
from outbox_bridge.db.reads import GroupRows
from outbox_bridge.errors import (
    CategoryScopeError,
    OutboxError,
    PayloadDecodeError,
    PayloadTooLargeError,
    ShardFaultError,
    UnknownCategoryError,
)
from outbox_bridge.observability.logs import FAILED_CALL, FailedCall, log_context
from outbox_bridge.observability.observe import RoundObserver
from outbox_bridge.producer import byte_size
from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage
from outbox_bridge.runtime.call_slots import MAX_CONCURRENT_CALLS, CallSlots, Limit
from outbox_bridge.runtime.rate_limits import RateLimits, turn
from outbox_bridge.runtime.scrub import scrub_credentials
from outbox_bridge.runtime.waiters import RoundShards
from outbox_bridge.workflows.models import HandlerFailure, HeadGroup, ShardRef

if TYPE_CHECKING:
    from outbox_bridge.runtime.round_writes import Round

log = logging.getLogger(__name__)

# What a handler's exception may put into Temporal history: its class, and this much of its
# message (a handler can raise with a whole response body in the message).
MAX_ERROR_MESSAGE = 2000


class HandlerTimeoutError(Exception):
    """An async handler ran past ``handler_timeout`` and was cancelled."""


class HandlerFailed(Exception):
    """A handler raised; carries what may enter Temporal history about it."""

    def __init__(self, failure: HandlerFailure, group: GroupRows) -> None:
        super().__init__(failure.message or failure.error_type)
        self.failure = failure
        self.group = group


@dataclasses.dataclass
class Call:
    """One head group ready to be handled: its handler and message, or why it has none."""

    group: GroupRows
    handler: Handler | None
    message: OutboxMessage
    category: str  # the category's name, for spans, metrics and logs
    error: BaseException | None = None
    # Asked for every call of a shard's hop at each hop: inspecting the handler once is enough.
    is_sync: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.is_sync = self.handler is not None and not OutboxApp.is_async_handler(self.handler)


class HandlerCalls:
    """Prepares and runs the handler calls of ``app``'s categories."""

    def __init__(
        self,
        app: OutboxApp,
        *,
        redact_errors: bool,
        threads: int,
        timeout: float = math.inf,
        max_calls: int = MAX_CONCURRENT_CALLS,
        max_payload_bytes: int | None = None,
        engine: AsyncEngine | None = None,
        rates: RateLimits | None = None,
    ) -> None:
        self._app = app
        self.rates = rates  # the categories' rate limits (None: none is applied)
        # No row with a larger payload is read whole (the statement leaves its payload out).
        self.max_payload_bytes = max_payload_bytes or app.max_payload_bytes
        self._redact = redact_errors
        # An async call is cancelled after this long (a plain-def call's thread cannot be
        # stopped: its shard stays locked until it returns).
        self._timeout = timeout
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="outbox-handler")
        self.slots = CallSlots(app, max_calls, engine)  # fleet-wide limits on engine's database
        any_async = any(
            OutboxApp.is_async_handler(handler)
            for category in app.categories
            if (handler := app.handler_for(category)) is not None
        )
        # How many calls the worker can have under way at once: plain-def ones wait for a thread.
        self.at_once = max_calls if any_async else min(threads, max_calls)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.slots.close()
        if self.rates is not None:
            self.rates.close()

    # -- preparing -------------------------------------------------------------------------

    def head(self, group: GroupRows) -> HeadGroup:
        return HeadGroup(
            category=group.category,
            category_name=self._app.category_name(group.category),
            object_identifier=group.object_identifier,
            first_id=group.first_id,
            last_id=group.last_id,
            rows=len(group.ids),
        )

    def prepare(self, shard: ShardRef, group: GroupRows, row: Row[Any]) -> Call:
        """The call of ``group`` with its newest ``row``; a row that cannot be handled (unknown
        category, another scope's category, a payload over the limit or undecodable) gives a
        call that fails."""
        payload, undecodable = _decode_payload(shard, row, self.max_payload_bytes)
        message = _message(
            self._app, group, row, payload, "region" in self._app.table(shard.table).c
        )
        category = self._app.category_name(group.category)
        try:
            handler = _resolve(self._app, shard, group.category)
        except OutboxError as exc:
            return Call(group, None, message, category, exc)
        if undecodable is not None:
            return Call(group, None, message, category, undecodable)
        return Call(group, handler, message, category)

    # -- running ---------------------------------------------------------------------------

    async def run(
        self,
        shard: ShardRef,
        calls: list[Call],
        handled: Callable[[Call], None],
        observer: RoundObserver,
        *,
        deadline: float = math.inf,
        attempt: int = 1,
        may_continue: Callable[[], bool] = lambda: True,
        pace: Round | None = None,
        round_: RoundShards | None = None,
    ) -> bool:
        """Call the handlers of ``calls`` in order, reporting each success to ``handled``.
        Raises :class:`HandlerFailed` at the first failure; returns False when ``may_continue``,
        the deadline (after the first call) or a slot that did not come free stopped it early.
        Consecutive sync handlers under the same limits run in one thread hop.

        ``pace``'s deletes keep the calls from running far ahead (its ``undeleted`` bound): a
        call starts once they caught up, and a thread hop runs at most that bound's limit of
        sync handlers, stops when it is reached, and counts each group it handled at once."""
        index = 0
        clock: _CallClock | None = None  # the handler timeout of the async calls
        hop = len(calls) if pace is None else pace.undeleted.limit
        try:
            while index < len(calls):
                call = calls[index]
                if not await _may_start(index, deadline, may_continue, pace):
                    return False
                limits = self.slots.limits(call.group.category)
                category = call.group.category
                async with turn(self.rates, shard, category, limits, deadline, round_) as free:
                    # A wait for a slot may have outlived the round's connection.
                    if not free or not may_continue():
                        return False
                    if call.is_sync:
                        end = self._sync_run_end(shard, calls, index, hop, limits)
                        count, error, paused = await self._in_thread(
                            calls[index:end],
                            handled,
                            observer,
                            deadline,
                            index,
                            attempt,
                            may_continue,
                            pace,
                        )
                        index += count
                        if error is not None:
                            number = nth_attempt(attempt, index)
                            raise failure(shard, calls[index], error, number, self._redact)
                        if index < end and not paused:
                            return False
                        continue
                    if clock is None and self._timeout != math.inf:
                        clock = _CallClock(self._timeout)
                    await self._call_async(
                        shard, call, observer, nth_attempt(attempt, index), clock
                    )
                handled(call)
                index += 1
            return True
        finally:
            if clock is not None:
                clock.close()

    def _rated(self, shard: ShardRef, call: Call) -> bool:
        """Whether ``call``'s category is rate limited (a token per call)."""
        return self.rates is not None and self.rates.limited(shard.table, call.group.category)

    def _sync_run_end(
        self, shard: ShardRef, calls: list[Call], index: int, hop: int, limits: list[Limit]
    ) -> int:
        """Where the sync calls from ``index`` that run in one thread hop end: at most ``hop``
        of them, each under the same ``limits``, and one alone if rate limited."""
        end = index + 1
        if self._rated(shard, calls[index]):
            return end
        while (
            end < len(calls)
            and end - index < hop
            and calls[end].is_sync
            and self.slots.limits(calls[end].group.category) == limits
            and not self._rated(shard, calls[end])
        ):
            end += 1
        return end

    async def _call_async(
        self,
        shard: ShardRef,
        call: Call,
        observer: RoundObserver,
        attempt: int,
        clock: _CallClock | None,
    ) -> None:
        try:
            with observer.call(call.group, call.message, call.category, attempt):
                if call.error is not None:
                    raise call.error
                assert call.handler is not None
                returned = await self._bounded(call, clock)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this attempt was cancelled (a timeout, a skip, a shutdown)
            # The handler raised CancelledError itself: a failure like any other, or
            # the local drain would fail the shard's workflow instead of blocking it.
            raise failure(shard, call, exc, attempt, self._redact) from exc
        except BaseException as exc:  # a handler's SystemExit must not stop the worker
            raise failure(shard, call, exc, attempt, self._redact) from exc
        _check_returned(self._app, call, returned)

    async def _bounded(self, call: Call, clock: _CallClock | None) -> object:
        assert call.handler is not None
        running = call.handler(call.message)
        if clock is None:
            return await running  # type: ignore[misc]
        # Not wait_for: it would run the handler in a task of its own, and asyncio lets a
        # SystemExit or KeyboardInterrupt raised in a task stop the whole event loop.
        clock.start()
        try:
            return await running  # type: ignore[misc]
        except asyncio.CancelledError:
            if clock.stop(cancelled=True):
                raise HandlerTimeoutError(
                    f"the handler did not return within {self._timeout:g} s (handler_timeout); "
                    "it was cancelled and will be retried"
                ) from None
            raise
        finally:
            clock.stop(cancelled=False)  # a second stop after the first does nothing

    async def _in_thread(
        self,
        run: list[Call],
        handled: Callable[[Call], None],
        observer: RoundObserver,
        deadline: float,
        offset: int,
        attempt: int,
        may_continue: Callable[[], bool],
        pace: Round | None,
    ) -> tuple[int, BaseException | None, bool]:
        """Call the sync handlers of ``run`` in one worker thread; returns how many succeeded,
        the exception of the one that failed, and whether ``pace`` stopped it early."""
        stop = False  # set by the event loop: no further call (a cheaper flag than an Event)
        count = 0
        paused = False
        loop = asyncio.get_running_loop()
        undeleted = None if pace is None else pace.undeleted

        def call_all() -> BaseException | None:
            nonlocal count, paused
            for call in run:
                if stop:
                    return None
                if not may_continue() or (offset + count and time.monotonic() > deadline):
                    return None
                # Also before the first call: other drains may have gone ahead meanwhile.
                if undeleted is not None and undeleted.ahead():
                    paused = True
                    return None
                assert call.handler is not None
                try:
                    number = nth_attempt(attempt, offset + count)
                    with observer.call(call.group, call.message, call.category, number):
                        returned = call.handler(call.message)
                except BaseException as exc:  # reported by the caller, like an async handler's
                    return exc
                _check_returned(self._app, call, returned)
                # Reported on the event loop's thread, which alone keeps the round's books.
                if undeleted is not None:
                    undeleted.unreported(1)
                loop.call_soon_threadsafe(report, call)
                count += 1
            return None

        def report(call: Call) -> None:
            if undeleted is not None:
                undeleted.unreported(-1)
            handled(call)

        future = loop.run_in_executor(self._executor, contextvars.copy_context().run, call_all)
        try:
            error = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be interrupted: stop after the running handler and keep the shard
            # lock until it returns, however often the attempt is cancelled meanwhile.
            stop = True
            while not future.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(future)
            await asyncio.sleep(0)  # let the reports scheduled by the thread run
            raise
        await asyncio.sleep(0)  # let the reports scheduled by the thread run first
        return count, error, paused

    def fault(self, shard: ShardRef, what: str, exc: BaseException) -> HandlerFailure:
        """A step of a round (``what``: "its rows cannot be read") failed for ``shard`` alone:
        logged with its traceback; returns what may enter Temporal history about it."""
        cause = getattr(exc, "orig", None) or exc  # a driver's own message, not the statement
        advice = privilege_advice(cause, Role.WORKER)  # a right revoked while it runs
        error = ShardFaultError(
            f"shard {shard.key}: {what}: {type(cause).__qualname__}: {cause}{advice}"
        )
        with log_context(shard=shard.key):
            log.warning("%s", error, exc_info=exc)
        return HandlerFailure(type(error).__qualname__, history_text(error, self._redact))


class _CallClock:
    """The handler timeout of one run of async calls: ``asyncio.timeout`` around each call, but
    one timer for the whole run, moved on to the deadline of the call running when it fires."""

    # A timer may fire a hair before its time; this close to the deadline it has passed.
    TOLERANCE = 0.001

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("handler calls run in a task")
        self._task = task
        self._deadline: float | None = None  # of the call running now
        self._timer: asyncio.TimerHandle | None = None
        self._expiring = False
        self._cancelling = 0

    def start(self) -> None:
        """A call starts: it may run ``timeout`` seconds from now."""
        self._deadline = self._loop.time() + self._timeout
        self._cancelling = self._task.cancelling()
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return  # no call runs: the next one sets the timer again
        if self._loop.time() < deadline - self.TOLERANCE:
            self._timer = self._loop.call_at(deadline, self._fire)
            return
        self._expiring = True
        self._task.cancel()

    def stop(self, *, cancelled: bool) -> bool:
        """The call ended (``cancelled``: by a CancelledError); whether it ran out of time."""
        self._deadline = None
        if not self._expiring:
            return False
        self._expiring = False
        # As asyncio.timeout: a timeout only if no other cancellation was asked for meanwhile.
        return self._task.uncancel() <= self._cancelling and cancelled

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _decode_payload(shard: ShardRef, row: Row[Any], limit: int) -> tuple[Any, OutboxError | None]:
    """The row's payload, or why it cannot be decoded: over ``limit`` bytes (left unread), or
    JSON PostgreSQL stores and Python cannot read (nested 10,000 deep, 5,000 digits)."""
    size = row.payload_bytes or 0
    if size > limit:
        return None, PayloadTooLargeError(
            f"row {row.id}'s payload is {byte_size(size)}, over the limit of "
            f"{byte_size(limit)} (max_payload_bytes), so it is not read: park its group "
            f"(outbox-bridge park {shard.key} --reason ...), raise the limit "
            "(OUTBOX_MAX_PAYLOAD_BYTES) for a worker with the memory for it, or shrink or "
            "delete the row"
        )
    text = row.payload
    if text is None:
        return None, None
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:
        return None, PayloadDecodeError(
            f"the payload of row {row.id} cannot be decoded: {type(exc).__qualname__}: {exc}; "
            f"fix or delete the row, or skip shard {shard.key}"
        )


async def _may_start(
    index: int, deadline: float, may_continue: Callable[[], bool], pace: Round | None
) -> bool:
    """Whether the call at ``index`` may start: once ``pace``'s deletes caught up, while the
    round goes on, and before the deadline unless it is the first call."""
    if pace is not None:
        await pace.pace()
    return may_continue() and not (index and time.monotonic() > deadline)


def _resolve(app: OutboxApp, shard: ShardRef, category: int) -> Handler:
    """The handler of ``category`` for a row of ``shard``, or why the row cannot be handled."""
    known = app.category(category)
    if known is None:
        raise UnknownCategoryError(
            f"category {category} is not registered in this worker's app; deploy a worker "
            f"whose registry has it, or skip shard {shard.key}"
        )
    owner = app.scope_of(category)
    if owner is None or int(owner) != shard.scope:
        # Not `if owner`: a scope whose value is 0 is falsy.
        owner_name = owner.name if owner is not None else "?"
        raise CategoryScopeError(
            f"category {known.name} belongs to scope {owner_name}, but the "
            f"row is in scope {shard.scope_name}; fix or delete the row, or skip shard "
            f"{shard.key}"
        )
    handler = app.handler_for(category)
    if handler is None:  # the worker checks this at start; kept for apps built by hand
        raise UnknownCategoryError(f"category {known.name} has no handler in this worker")
    return handler


def _message(
    app: OutboxApp, group: GroupRows, row: Row[Any], payload: Any, regional: bool
) -> OutboxMessage:
    # The table says whether to ask for a region: a Row's missing attribute costs a caught
    # exception, several times the rest of the message.
    shard_scope, category_value = row.shard_scope, row.category
    scope = app.scope(shard_scope)
    category = app.category(category_value)
    return OutboxMessage(
        id=row.id,
        shard_scope=scope if scope is not None else shard_scope,
        shard_identifier=row.shard_identifier,
        category=category if category is not None else category_value,
        object_identifier=row.object_identifier,
        payload=payload,
        region=row.region if regional else None,
        date_added=row.date_added,
        scheduled_for=row.scheduled_for,
        coalesced=len(group.ids),
    )


def _check_returned(app: OutboxApp, call: Call, returned: object) -> None:
    if returned is not None:
        log.warning(
            "handler for %s returned %r; handlers should return None (the value is ignored)",
            app.category_name(call.group.category),
            type(returned).__name__,
        )


def nth_attempt(attempt: int, index: int) -> int:
    """The attempt of a run's call at ``index``: ``attempt`` for its first, the group a failure
    before may have tried; the groups after it are tried for the first time."""
    return attempt if index == 0 else 1


def failure(
    shard: ShardRef, call: Call, exc: BaseException, attempt: int, redact: bool
) -> HandlerFailed:
    """The failure of ``call``, logged (its traceback now and then), as it enters history."""
    group = call.group
    with log_context(shard=shard.key, category=call.category):
        # The traceback on the first failure and every tenth retry; one line in between.
        log.warning(
            "handler failed: shard=%s category=%s object=%s id=%s coalesced=%s attempt=%s: %s: %s",
            shard.key,
            call.category,
            group.object_identifier,
            group.last_id,
            len(group.ids),
            attempt,
            type(exc).__qualname__,
            exc,
            exc_info=exc if attempt % 10 == 1 else None,
            extra={FAILED_CALL: FailedCall(shard.key, call.category, type(exc).__qualname__)},
        )
    return HandlerFailed(HandlerFailure(type(exc).__qualname__, history_text(exc, redact)), group)


def history_text(exc: BaseException, redact: bool) -> str:
    """The exception's message as Temporal may keep it: none when redacted, else bounded
    and scrubbed of credentials."""
    if redact:
        return ""
    text = str(exc)
    # Scrubbed before the cut, which would leave a password without its URL's "@"; with
    # a margin, so that what masking shortened is still filled with scrubbed text.
    scrubbed = scrub_credentials(text[: 2 * MAX_ERROR_MESSAGE])
    if len(text) > MAX_ERROR_MESSAGE:
        cut = len(text) - MAX_ERROR_MESSAGE
        return f"{scrubbed[:MAX_ERROR_MESSAGE]}… ({cut} more characters in the worker's log)"
    return scrubbed
