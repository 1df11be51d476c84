"""Handlers that use Django's ORM, in the worker: outside a request, nothing closes a
connection broken by a database restart, and the handler would fail at every retry.
:func:`with_django_connections` makes each call start and end like a request.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage

# Set on a wrapped handler, so that wrapping twice wraps once.
_WRAPPED = "__outbox_django_connections__"


def with_django_connections(handler: Handler) -> Handler:
    """``handler``, with Django's stale connections closed before and after each call (in the
    thread that runs it, or, for an async handler, in the thread Django runs its async ORM in).
    Keeps the handler's kind (async or plain)."""
    if getattr(handler, _WRAPPED, False):
        return handler
    if OutboxApp.is_async_handler(handler):
        close = sync_to_async(close_old_connections, thread_sensitive=True)

        @functools.wraps(handler)
        async def async_handler(message: OutboxMessage) -> None:
            await close()
            try:
                result = handler(message)
                if inspect.isawaitable(result):
                    await result
            finally:
                await close()

        setattr(async_handler, _WRAPPED, True)
        return async_handler

    @functools.wraps(handler)
    def sync_handler(message: OutboxMessage) -> Any:
        close_old_connections()
        try:
            return handler(message)
        finally:
            close_old_connections()

    setattr(sync_handler, _WRAPPED, True)
    return sync_handler
