"""The open Django outbox contexts that :func:`~outbox_bridge.contrib.django.writes.write_row`
reports its rows to: a stack per thread or task, in a context variable, so that the rows
written with ``sync_to_async`` for an async view reach the context the view opened. (The
contexts, which flush through Temporal, are :mod:`outbox_bridge.contrib.django.flush`'s.)
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.models import ShardRef


class RowRecorder(Protocol):
    """An open outbox context, as ``write_row`` sees it."""

    def record_row(
        self, app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int
    ) -> None: ...


Stack = tuple[RowRecorder, ...]

# The open contexts, innermost last.
OPEN: ContextVar[Stack] = ContextVar("outbox_bridge_django_contexts", default=())


def record_write(app: OutboxApp, using: str, connection: Any, shard: ShardRef, row_id: int) -> None:
    """Called by ``write_row``: note the row in the innermost open context, if any."""
    stack = OPEN.get()
    if stack:
        stack[-1].record_row(app, using, connection, shard, row_id)
