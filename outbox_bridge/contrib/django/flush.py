"""Waiting after the commit until a request's rows are handled, for Django.

:func:`outbox_context` is ``outbox_bridge.outbox_context`` for Django's connections: the rows
written inside it with :func:`~outbox_bridge.contrib.django.writes.write_row` (models declared
with :class:`~outbox_bridge.contrib.django.models.OutboxModel` included) are recorded, each
with a ``transaction.on_commit`` callback on its database. A row counts once that callback ran:
its transaction committed. A transaction or savepoint that rolls back drops its callbacks, and
its rows are not waited for. With ``flush=True``, when the block ends, every shard written to
is flushed through :class:`~outbox_bridge.Flusher` (the same ``flush`` update with start as for
SQLAlchemy) and :attr:`OutboxContext.report` says, per shard, ``handled``, ``blocked``,
``skipped``, ``deferred``, ``timed_out`` or ``unavailable``. Once the rows committed, a flush
never raises.

For views: :func:`flush_outbox` wraps one view, :class:`OutboxFlushMiddleware` every request
(the one that also works with ``ATOMIC_REQUESTS``, whose transaction commits after the view
returns). Both let the response leave once the rows are handled, or the outcome is known, and
attach the report to the response (:func:`flush_report`).

The flush reaches Temporal with the app's flush settings (:meth:`OutboxApp.configure_flush
<outbox_bridge.OutboxApp.configure_flush>`); for the app that ``OUTBOX_BRIDGE["APP"]`` names,
they come from the Django settings when it was not configured otherwise.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextvars import Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import transaction
from django.http import HttpRequest, HttpResponseBase

from outbox_bridge.contrib.django.conf import (
    OutboxConfigurationError,
    flush_timeout,
    outbox_app,
    outbox_settings,
)
from outbox_bridge.contrib.django.contexts import Stack, open_contexts, pop, push
from outbox_bridge.flush import DEFAULT_TIMEOUT, Flusher, FlushReport, app_flusher
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import FlushOutcome, FlushResult, ShardRef

log = logging.getLogger("outbox_bridge.contrib.django.flush")

# The response attribute that flush_outbox and OutboxFlushMiddleware attach the report to.
REPORT_ATTRIBUTE = "outbox_report"

View = TypeVar("View", bound=Callable[..., Any])


@dataclass(eq=False)
class _Row:
    """A row written in a context, until its transaction commits (``committed``, called by
    ``on_commit``) or the context that holds it ends."""

    app: OutboxApp
    using: str
    connection: Any
    shard: ShardRef
    row_id: int
    flush: bool
    owner: OutboxContext | None

    def committed(self) -> None:
        if self.owner is not None:
            self.owner._commit(self)

    def still_pending(self) -> bool:
        """Its transaction is still open: its ``on_commit`` callback is queued. (A rollback
        drops the callbacks of what it rolled back.) The queue is the connection's
        ``run_on_commit`` list of ``(savepoint ids, callback, robust)``, which Django's own
        ``TestCase.captureOnCommitCallbacks`` reads too."""
        queued = getattr(self.connection, "run_on_commit", None) or []
        return any(entry[1] == self.committed for entry in queued)


class OutboxContext:
    """See :func:`outbox_context`. Use with ``with`` in sync code, ``async with`` in async code;
    ``report`` holds the answer once the block has ended."""

    def __init__(self, *, flush: bool, timeout: float, flusher: Flusher | None) -> None:
        if not 0 < timeout <= 3600:
            raise ValueError(f"flush timeout must be between 0 and 3600 seconds, got {timeout}")
        self._flush = flush
        self._timeout = timeout
        self._flusher = flusher
        self._pending: list[_Row] = []
        self._committed: dict[ShardRef, tuple[OutboxApp, int]] = {}
        self._parent: OutboxContext | None = None
        self._token: Token[Stack] | None = None
        self.report = FlushReport()

    # -- recording (called by write_row and the on_commit callbacks) ---------------------------

    def record_row(
        self, app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int
    ) -> None:
        """Note a row written in this context (called by ``write_row``)."""
        row = _Row(app, using, connection, shard, row_id, self._flush, self)
        self._pending.append(row)
        transaction.on_commit(row.committed, using=using)

    def _commit(self, row: _Row) -> None:
        if row in self._pending:
            self._pending.remove(row)
        if row.flush:
            known = self._committed.get(row.shard)
            up_to = row.row_id if known is None else max(known[1], row.row_id)
            self._committed[row.shard] = (row.app, up_to)

    # -- entering and leaving ------------------------------------------------------------------

    def _enter(self) -> OutboxContext:
        from_stack = _innermost()
        self._parent = from_stack
        self._token = push(self)
        return self

    def _leave(self, failed: bool) -> dict[OutboxApp, dict[ShardRef, int]]:
        """Close this context; return what to flush now, by app."""
        if self._token is not None:
            pop(self._token)
            self._token = None
        pending, self._pending = self._pending, []
        if failed:
            for row in pending:
                row.owner = None
            return {}
        waiting = [row for row in pending if row.still_pending()]
        for row in pending:
            row.owner = None
        if waiting:
            if self._parent is not None:
                # Commits with an enclosing transaction: the enclosing context waits for it.
                for row in waiting:
                    row.owner = self._parent
                    self._parent._pending.append(row)
            else:
                self.report.not_committed = list(dict.fromkeys(row.shard.key for row in waiting))
                log.warning(
                    "outbox_context ended before its rows committed (shards %s): they are "
                    "handled asynchronously; end the transaction inside the block to wait for "
                    "them (with ATOMIC_REQUESTS, use OutboxFlushMiddleware)",
                    ", ".join(self.report.not_committed),
                )
        targets: dict[OutboxApp, dict[ShardRef, int]] = {}
        for shard, (app, up_to) in self._committed.items():
            targets.setdefault(app, {})[shard] = up_to
        return targets

    def __enter__(self) -> OutboxContext:
        return self._enter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for app, targets in self._leave(exc_type is not None).items():
            flusher = _flusher_for(app, self._flusher)
            if isinstance(flusher, str):
                self.report.results += _unavailable(targets, flusher)
            else:
                self.report.results += flusher.flush_sync(targets, self._timeout)

    async def __aenter__(self) -> OutboxContext:
        return self._enter()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for app, targets in self._leave(exc_type is not None).items():
            flusher = _flusher_for(app, self._flusher)
            if isinstance(flusher, str):
                self.report.results += _unavailable(targets, flusher)
            else:
                self.report.results += await flusher.flush(targets, self._timeout)


def _innermost() -> OutboxContext | None:
    for context in reversed(open_contexts()):
        if isinstance(context, OutboxContext):
            return context
    return None


def outbox_context(
    *, flush: bool = False, timeout: float = DEFAULT_TIMEOUT, flusher: Flusher | None = None
) -> OutboxContext:
    """Track the outbox rows written inside the block with ``write_row`` (and by
    ``OutboxModel`` saves and deletes), on any database.

    With ``flush=True``, when the block ends, wait (at most ``timeout`` seconds) until every
    shard written to has handled the rows that committed inside the block; ``.report`` says,
    per shard, ``handled``, ``blocked``, ``skipped``, ``deferred``, ``timed_out`` or
    ``unavailable``. End the transaction inside the block::

        with outbox_context(flush=True) as outbox:
            with transaction.atomic():
                project.save()
        if not outbox.report.handled:
            ...

    A row counts as committed when its ``transaction.on_commit`` callback runs, after every
    callback registered before it. Rows of a transaction or savepoint that rolled back are not
    waited for. Contexts nest like ``outbox_bridge.outbox_context``: rows written in an inner
    ``flush=False`` context are not waited for; rows that commit only after an inner context
    ended are waited for by the enclosing one; rows still uncommitted when the outermost
    context ends are listed in ``report.not_committed``. ``flusher`` defaults to the app's.
    """
    return OutboxContext(flush=flush, timeout=timeout, flusher=flusher)


# -- which flusher -------------------------------------------------------------------------------


def _flusher_for(app: OutboxApp, given: Flusher | None) -> Flusher | str:
    """The flusher of ``app``, with its flush settings from the Django settings when ``app`` is
    the one ``OUTBOX_BRIDGE`` names and nothing configured them; or why there is none: a
    configuration that does not fit answers every shard ``unavailable`` (the rows committed,
    and a flush never raises)."""
    if given is not None:
        return given
    route = app.flush_route
    if route.settings is None and route.client is None and route.flusher is None:
        try:
            if _configured_app() is app:
                app.configure_flush(outbox_settings())
        except OutboxConfigurationError as exc:
            detail = f"the flush is not configured: {exc}"
            log.warning("outbox rows not flushed: %s; they are handled asynchronously", detail)
            return detail
    return app_flusher(app)


def _unavailable(targets: dict[ShardRef, int], detail: str) -> list[FlushResult]:
    return [FlushResult(shard.key, FlushOutcome.UNAVAILABLE, detail=detail) for shard in targets]


def _configured_app() -> OutboxApp | None:
    try:
        return outbox_app()
    except OutboxConfigurationError:
        return None


# -- views ---------------------------------------------------------------------------------------


def flush_report(response: HttpResponseBase) -> FlushReport | None:
    """The report that :func:`flush_outbox` or :class:`OutboxFlushMiddleware` attached to
    ``response`` (``None`` when neither ran)."""
    report = getattr(response, REPORT_ATTRIBUTE, None)
    return report if isinstance(report, FlushReport) else None


def _attach(response: Any, report: FlushReport) -> Any:
    if isinstance(response, HttpResponseBase):
        setattr(response, REPORT_ATTRIBUTE, report)
        for result in report:
            if not result.handled:
                log.info("flush of shard %s answered %s", result.shard, result.outcome)
    return response


@overload
def flush_outbox(view: View, *, timeout: float | None = None) -> View: ...


@overload
def flush_outbox(view: None = None, *, timeout: float | None = None) -> Callable[[View], View]: ...


def flush_outbox(
    view: View | None = None, *, timeout: float | None = None
) -> View | Callable[[View], View]:
    """Decorate a view (sync or async) so that its response leaves once the rows it wrote and
    committed are handled: the view runs in ``outbox_context(flush=True)``, and the report is
    attached to the response (:func:`flush_report`). ``timeout`` defaults to
    ``OUTBOX_BRIDGE["FLUSH_TIMEOUT"]``.

    The view must commit its transaction itself: with ``ATOMIC_REQUESTS``, Django commits it
    after the view returns, so use :class:`OutboxFlushMiddleware` (or mark the view
    ``transaction.non_atomic_requests``).
    """

    def decorate(fn: View) -> View:
        if iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                async with outbox_context(flush=True, timeout=_timeout(timeout)) as outbox:
                    response = await fn(request, *args, **kwargs)
                return _attach(response, outbox.report)

            return cast(View, async_view)

        @functools.wraps(fn)
        def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            with outbox_context(flush=True, timeout=_timeout(timeout)) as outbox:
                response = fn(request, *args, **kwargs)
            return _attach(response, outbox.report)

        return cast(View, sync_view)

    return decorate(view) if view is not None else decorate


def _timeout(given: float | None) -> float:
    return given if given is not None else flush_timeout(DEFAULT_TIMEOUT)


class OutboxFlushMiddleware:
    """Middleware that lets each response leave once the rows its request wrote and committed
    are handled (``outbox_context(flush=True)`` around the rest of the chain), for every view,
    sync or async, with or without ``ATOMIC_REQUESTS``. The report is attached to the response
    (:func:`flush_report`); a request that wrote no row waits for nothing. The timeout is
    ``OUTBOX_BRIDGE["FLUSH_TIMEOUT"]``."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.timeout = flush_timeout(DEFAULT_TIMEOUT)
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self._async:
            return self._acall(request)
        with outbox_context(flush=True, timeout=self.timeout) as outbox:
            response = self.get_response(request)
        return _attach(response, outbox.report)

    async def _acall(self, request: HttpRequest) -> Any:
        async with outbox_context(flush=True, timeout=self.timeout) as outbox:
            response = await self.get_response(request)
        return _attach(response, outbox.report)


__all__ = [
    "OutboxContext",
    "OutboxFlushMiddleware",
    "flush_outbox",
    "flush_report",
    "outbox_context",
]
