"""Waiting after the commit until a request's rows are handled, for Django: around a block
(:func:`outbox_context`), a view (:func:`flush_outbox`) or every request
(:class:`OutboxFlushMiddleware`), with :class:`~outbox_bridge.Flusher`'s flush."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextvars import Token
from dataclasses import dataclass
from typing import Any, Self, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import transaction
from django.http import HttpRequest, HttpResponseBase

from outbox_bridge.contrib.django.conf import (
    OutboxConfigurationError,
    flush_timeout,
    outbox_app,
    outbox_settings,
)
from outbox_bridge.contrib.django.writes import OPEN, Stack
from outbox_bridge.flush import DEFAULT_TIMEOUT, Flusher, FlushingContext, FlushReport, Written
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger("outbox_bridge.contrib.django.flush")

REPORT_ATTRIBUTE = "outbox_report"  # of a response, set by flush_outbox and the middleware

View = TypeVar("View", bound=Callable[..., Any])


@dataclass(eq=False)
class _Row:
    """A row written in a context, until its ``on_commit`` callback runs or its context ends."""

    app: OutboxApp
    connection: Any
    shard: ShardRef
    row_id: int
    flush: bool
    owner: OutboxContext | None

    def committed(self) -> None:
        if self.owner is not None:
            self.owner._commit(self)

    def still_pending(self) -> bool:
        """Its transaction is still open: its ``on_commit`` callback is queued (a rollback
        drops it) in the connection's ``run_on_commit`` list of ``(savepoint ids, callback,
        robust)``, which Django's ``TestCase.captureOnCommitCallbacks`` reads too."""
        queued = getattr(self.connection, "run_on_commit", None) or []
        return any(entry[1] == self.committed for entry in queued)


class OutboxContext(FlushingContext):
    """See :func:`outbox_context`."""

    _log = log
    _commit_hint = (
        "end the transaction inside the block to wait for them (with ATOMIC_REQUESTS, use "
        "OutboxFlushMiddleware)"
    )

    def __init__(self, *, flush: bool, timeout: float, flusher: Flusher | None) -> None:
        super().__init__(flush=flush, timeout=timeout, flusher=flusher)
        self._pending: list[_Row] = []
        self._parent: OutboxContext | None = None
        self._token: Token[Stack] | None = None

    def record_row(
        self, app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int
    ) -> None:
        """Note a row written in this context (called by ``write_row``)."""
        row = _Row(app, connection, shard, row_id, self._flush, self)
        self._pending.append(row)
        transaction.on_commit(row.committed, using=using)

    def _commit(self, row: _Row) -> None:
        if row in self._pending:
            self._pending.remove(row)
        if row.flush:
            self._add(self._committed, row.shard, Written(row.app, row.row_id, flush=True))

    def __enter__(self) -> Self:
        stack = OPEN.get()
        self._parent = cast(OutboxContext, stack[-1]) if stack else None
        self._token = OPEN.set((*stack, self))
        return self

    def _close(self, failed: bool) -> list[str]:
        if self._token is not None:
            OPEN.reset(self._token)
            self._token = None
        pending, self._pending = self._pending, []
        waiting = [] if failed else [row for row in pending if row.still_pending()]
        for row in pending:
            row.owner = None
        if self._parent is None:
            return list(dict.fromkeys(row.shard.key for row in waiting))
        # Commits with an enclosing transaction: the enclosing context waits for it.
        for row in waiting:
            row.owner = self._parent
        self._parent._pending += waiting
        return []

    def _flusher_for(self, app: OutboxApp) -> Flusher | str:
        """The app's flusher, configured from the Django settings for ``OUTBOX_BRIDGE``'s app
        when nothing configured it; or why there is none."""
        route = app.flush_route
        unconfigured = route.settings is None and route.client is None and route.flusher is None
        if self._flusher is None and unconfigured:
            try:
                if _configured_app() is app:
                    app.configure_flush(outbox_settings())
            except OutboxConfigurationError as exc:
                detail = f"the flush is not configured: {exc}"
                log.warning("outbox rows not flushed: %s; they are handled asynchronously", detail)
                return detail
        return super()._flusher_for(app)


def outbox_context(
    *, flush: bool = False, timeout: float | None = None, flusher: Flusher | None = None
) -> OutboxContext:
    """Track the outbox rows written inside the block with ``write_row`` (and by
    ``OutboxModel`` saves and deletes), on any database: :func:`outbox_bridge.outbox_context`
    for Django, with the same ``flush``, ``timeout``, ``flusher``, nesting and ``.report``;
    ``timeout`` defaults to ``OUTBOX_BRIDGE["FLUSH_TIMEOUT"]``, like :func:`flush_outbox`'s.
    End the transaction inside the block::

        with outbox_context(flush=True) as outbox:
            with transaction.atomic():
                project.save()
        if not outbox.report.handled:
            ...

    A row counts as committed when its ``transaction.on_commit`` callback runs, after every
    callback registered before it; rows of a transaction or savepoint that rolled back are not
    waited for.
    """
    if timeout is None:  # a context that waits for nothing reads no setting
        timeout = flush_timeout(DEFAULT_TIMEOUT) if flush else DEFAULT_TIMEOUT
    return OutboxContext(flush=flush, timeout=timeout, flusher=flusher)


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


def _flushing(view: View, timeout: Callable[[], float]) -> View:
    """``view`` (sync or async) in ``outbox_context(flush=True)``, its response with the report."""

    def attach(response: Any, report: FlushReport) -> Any:
        if isinstance(response, HttpResponseBase):
            setattr(response, REPORT_ATTRIBUTE, report)
            for result in report:
                if not result.handled:
                    log.info("flush of shard %s answered %s", result.shard, result.outcome)
        return response

    if iscoroutinefunction(view):

        @functools.wraps(view)
        async def async_view(*args: Any, **kwargs: Any) -> Any:
            async with outbox_context(flush=True, timeout=timeout()) as outbox:
                response = await view(*args, **kwargs)
            return attach(response, outbox.report)

        return cast(View, async_view)

    @functools.wraps(view)
    def sync_view(*args: Any, **kwargs: Any) -> Any:
        with outbox_context(flush=True, timeout=timeout()) as outbox:
            response = view(*args, **kwargs)
        return attach(response, outbox.report)

    return cast(View, sync_view)


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
        return _flushing(fn, lambda: flush_timeout(DEFAULT_TIMEOUT) if timeout is None else timeout)

    return decorate(view) if view is not None else decorate


class OutboxFlushMiddleware:
    """Middleware that lets each response leave once the rows its request wrote and committed
    are handled (``outbox_context(flush=True)`` around the rest of the chain), for every view,
    sync or async, with or without ``ATOMIC_REQUESTS``. The report is attached to the response
    (:func:`flush_report`); a request that wrote no row waits for nothing. The timeout is
    ``OUTBOX_BRIDGE["FLUSH_TIMEOUT"]``."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.timeout = flush_timeout(DEFAULT_TIMEOUT)
        self._respond = _flushing(get_response, lambda: self.timeout)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        return self._respond(request)


__all__ = [
    "OutboxContext",
    "OutboxFlushMiddleware",
    "flush_outbox",
    "flush_report",
    "outbox_context",
]
