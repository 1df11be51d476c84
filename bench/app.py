"""The benchmark's registry and its handler: no-op handlers that count calls.

One scope and five categories. The same :class:`HandlerProbe` instance serves the bridge (called
by the worker on its event loop) and the baseline (called from its threads), so both sides run
exactly the same handler code.
"""

from __future__ import annotations

import threading
import time
from enum import IntEnum

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable


class Scope(IntEnum):
    TENANT = 1


class Category(IntEnum):
    ITEM_CREATED = 1
    ITEM_UPDATED = 2
    ITEM_DELETED = 3
    MEMBER_UPDATED = 4
    SETTINGS_UPDATED = 5


CATEGORIES = [int(c) for c in Category]


class HandlerProbe:
    """A no-op ``async def`` handler that counts its calls and, when asked, records the wall time
    at which it first started for each row id (for commit→handler latency)."""

    def __init__(self, *, record_starts: bool = False) -> None:
        self.record_starts = record_starts
        self.calls = 0
        self.starts: dict[int, float] = {}
        self._lock = threading.Lock()  # the baseline calls it from several threads

    async def handle(self, message: OutboxMessage) -> None:
        started = time.time()
        with self._lock:
            self.calls += 1
            if self.record_starts:
                self.starts.setdefault(message.id, started)


def make_app(table: str, probe: HandlerProbe) -> OutboxApp:
    """An app with one table whose every category is handled by ``probe``."""
    app = OutboxApp(
        scopes={Scope.TENANT: set(Category)}, categories=[Category], tables=[OutboxTable(table)]
    )
    app.handler(*Category)(probe.handle)
    return app
