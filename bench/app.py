"""The benchmark's registry and its handler: no-op handlers that count calls.

One scope and five categories. The same :class:`HandlerProbe` instance serves the bridge (called
by the worker on its event loop) and the baseline (called from its threads), so both sides run
exactly the same handler code.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Collection, Mapping
from enum import IntEnum
from typing import Any

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

# A coalescing group: (shard_scope, shard_identifier, category, object_identifier).
GroupKey = tuple[int, int, int, int]


def fails(group: GroupKey, share: float) -> bool:
    """Whether ``group`` is one of the ``share`` of groups whose handler fails (decided by a
    CRC-32 of the group's columns: the same in every process, run and attempt)."""
    text = ":".join(str(part) for part in group).encode()
    return zlib.crc32(text) % 10_000 < round(share * 10_000)


class FlakyError(Exception):
    """What a failing group's handler raises, until it has failed often enough."""


class HandlerProbe:
    """A no-op ``async def`` handler that counts its calls and, when asked, records the wall time
    at which it first started for each row id (for commit→handler latency).

    With ``failing``, the handler of each of those groups raises :class:`FlakyError` on its first
    ``failures`` calls and succeeds afterwards, whichever side, attempt or drain calls it. With
    ``yield_once``, every call yields to the event loop once, as a handler that does I/O would.
    With ``wait_seconds``, every call waits that long (``asyncio.sleep``, or ``time.sleep`` in
    the ``plain`` def handler), as a call to another service would; ``peak`` is the most calls
    seen under way at once.
    """

    def __init__(
        self,
        *,
        record_starts: bool = False,
        failing: Collection[GroupKey] = (),
        failures: int = 3,
        yield_once: bool = False,
        wait_seconds: float = 0.0,
        plain: bool = False,
    ) -> None:
        self.record_starts = record_starts
        self.calls = 0
        self.failed = 0  # calls that raised
        self.starts: dict[int, float] = {}
        self.failing = frozenset(failing)
        self.failures = failures
        self.yield_once = yield_once
        self.wait_seconds = wait_seconds
        self.plain = plain
        self.running = 0
        self.peak = 0
        self._attempts: dict[GroupKey, int] = {}
        self._lock = threading.Lock()  # the baseline calls it from several threads

    def options(self) -> dict[str, Any]:
        """The keyword arguments that make the same handler in another process (JSON)."""
        return {
            "failing": sorted(self.failing),
            "failures": self.failures,
            "yield_once": self.yield_once,
            "wait_seconds": self.wait_seconds,
            "plain": self.plain,
        }

    def add_calls(self, outcome: dict[str, Any]) -> None:
        """Count the calls that the same handler made in another process."""
        self.calls += outcome["handler_calls"]
        self.failed += outcome["failed_calls"]
        self.peak = max(self.peak, outcome["peak_concurrent_calls"])

    async def handle(self, message: OutboxMessage) -> None:
        started = time.time()
        if self.yield_once:
            await asyncio.sleep(0)
        if self.wait_seconds:
            self._enter()
            try:
                await asyncio.sleep(self.wait_seconds)
            finally:
                self._leave()
        self._record(message, started)

    def handle_plain(self, message: OutboxMessage) -> None:
        """The same handler as a plain ``def`` (the worker runs it in a thread)."""
        started = time.time()
        if self.wait_seconds:
            self._enter()
            try:
                time.sleep(self.wait_seconds)
            finally:
                self._leave()
        self._record(message, started)

    def _enter(self) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)

    def _leave(self) -> None:
        with self._lock:
            self.running -= 1

    def _record(self, message: OutboxMessage, started: float) -> None:
        with self._lock:
            self.calls += 1
            if self.failing:
                group = (
                    int(message.shard_scope),
                    message.shard_identifier,
                    int(message.category),
                    message.object_identifier,
                )
                if group in self.failing:
                    attempt = self._attempts[group] = self._attempts.get(group, 0) + 1
                    if attempt <= self.failures:
                        self.failed += 1
                        raise FlakyError(f"group {group} fails on attempt {attempt}")
            if self.record_starts:
                self.starts.setdefault(message.id, started)


def make_app(
    table: str, probe: HandlerProbe, rate_limits: Mapping[int, str] | None = None
) -> OutboxApp:
    """An app with one table whose every category is handled by ``probe``, under the
    ``rate_limits`` given (category value: ``"100/s"``)."""
    app = OutboxApp(
        scopes={Scope.TENANT: set(Category)}, categories=[Category], tables=[OutboxTable(table)]
    )
    handle = probe.handle_plain if probe.plain else probe.handle
    if not rate_limits:
        app.handler(*Category)(handle)
        return app
    for category in Category:
        app.handler(category, rate_limit=rate_limits.get(int(category)))(handle)
    return app
