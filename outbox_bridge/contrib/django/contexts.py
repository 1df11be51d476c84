"""The open Django outbox contexts that :func:`~outbox_bridge.contrib.django.writes.write_row`
reports its rows to: a stack per thread or task, in a context variable, so that the rows
written with ``sync_to_async`` for an async view reach the context the view opened.

This sits on the producer's side, like :mod:`outbox_bridge.sessions`; the contexts themselves,
which flush through Temporal once their block ends, are
:mod:`outbox_bridge.contrib.django.flush`'s.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any, Protocol

from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardRef


class RowRecorder(Protocol):
    """An open outbox context, as ``write_row`` sees it."""

    def record_row(
        self, app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int
    ) -> None: ...


Stack = tuple[RowRecorder, ...]

_open: ContextVar[Stack] = ContextVar("outbox_bridge_django_contexts", default=())


def open_contexts() -> Stack:
    """The open contexts, innermost last."""
    return _open.get()


def push(context: RowRecorder) -> Token[Stack]:
    """Open ``context``; pass the token to :func:`pop` when it ends."""
    return _open.set((*_open.get(), context))


def pop(token: Token[Stack]) -> None:
    _open.reset(token)


def record_write(app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int) -> None:
    """Called by ``write_row``: note the row in the innermost open context, if any."""
    stack = _open.get()
    if stack:
        stack[-1].record_row(app, using, connection, shard, row_id)
