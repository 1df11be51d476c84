"""Handlers that use Django's ORM, in the worker.

A handler runs in the worker, outside any request, so nothing closes its database connections
the way Django does around a request (``close_old_connections`` on ``request_started`` and
``request_finished``): a connection broken by a database restart would stay broken in its
thread, and the handler would fail at every retry. :func:`with_django_connections` wraps a
handler so that each call starts and ends like a request: connections that are broken, or
older than ``CONN_MAX_AGE``, are closed (and opened again on next use). The ``outbox_worker``
management command wraps every handler of the app with it.

Plain ``def`` handlers may use the ORM directly: each runs in one of the worker's handler
threads (``HANDLER_THREADS``), each thread with its own connection. ``async def`` handlers use
the async ORM (``aget``, ``asave``, ...), which Django runs with ``sync_to_async`` in one
thread for all of them: prefer plain handlers for ORM work.
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
