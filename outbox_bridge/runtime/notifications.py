"""Reading the notifications of an outbox table's trigger, ``[[scope, shard identifier, highest
id], ...]`` (the region first in a regional table), trusting nothing: any role can ``NOTIFY``,
as often as it likes. What a notification may cost is bounded: a refused one is counted and
logged at most once a minute, and the scans and sweeps notifications ask for are throttled.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
# PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more: a longer message is not read.
MAX_PAYLOAD_BYTES = 7999
# Seconds between two log records of refused notifications on one channel, at least.
REFUSALS_LOG_INTERVAL = 60.0
# Characters of a refused message that its log record shows.
REFUSED_SHOWN = 200

log = logging.getLogger("outbox_bridge.runtime.bridge")


@dataclass(frozen=True)
class Notification:
    """One shard of a notification: its highest new id."""

    region: str | None
    scope: int
    shard_identifier: int
    max_id: int


def parse_notification(payload: str, *, regional: bool) -> list[Notification] | str:
    """The shards a trigger's message names, or why the message is refused."""
    if len(payload) > MAX_PAYLOAD_BYTES or _utf8_length(payload) > MAX_PAYLOAD_BYTES:
        return "longer than a notification can be"
    try:
        entries = json.loads(payload)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(entries, list):
        return "not a list of shards"
    parsed = []
    for entry in entries:
        shard = _entry(entry, regional)
        if isinstance(shard, str):
            return shard
        parsed.append(shard)
    return parsed


def _entry(entry: Any, regional: bool) -> Notification | str:
    size = 4 if regional else 3
    if not isinstance(entry, list) or len(entry) != size:
        shape = "[region, scope, id, max id]" if regional else "[scope, id, max id]"
        return f"an entry is not {shape} for this table"
    region = entry[0] if regional else None
    if regional:
        if not isinstance(region, str) or not region:
            return "a region is not a non-empty string"
        if not _storable(region):  # JSON can spell what no text column holds (\u0000)
            return "a region is not text a column can hold"
    scope, ident, max_id = entry[-3:]
    if not _integer(scope, INT32):
        return "a scope is not a 32-bit integer"
    if not _integer(ident, INT64):
        return "a shard identifier is not a 64-bit integer"
    if not _integer(max_id, (1, INT64[1])):
        return "an id is not a positive 64-bit integer"
    return Notification(region, scope, ident, max_id)


def _utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _integer(value: Any, bounds: tuple[int, int]) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]
    )


@dataclass
class RefusalLog:
    """The refused notifications of one channel: each counted, logged at most once per
    ``interval`` (the first at once; later ones as how many, and the last one's reason and
    start)."""

    channel: str
    interval: float = REFUSALS_LOG_INTERVAL
    clock: Callable[[], float] = time.monotonic
    unlogged: int = 0
    _last: tuple[str, str] = ("", "")
    _since: float = field(default=-float("inf"))

    def refuse(self, reason: str, payload: str) -> None:
        self.unlogged += 1
        self._last = (reason, payload[:REFUSED_SHOWN])
        self.flush()

    def flush(self, *, now: bool = False) -> None:
        """Log what is unlogged if ``interval`` has passed since the last record (``now``: at
        once, as the bridge stops)."""
        at = self.clock()
        if not self.unlogged or (at - self._since < self.interval and not now):
            return
        reason, shown = self._last
        if self.unlogged == 1:
            log.warning(
                "refused a notification on %s (%s): %r; scanning instead",
                self.channel,
                reason,
                shown,
            )
        else:
            log.warning(
                "refused %s notifications on %s in the last %.0f s; last: (%s) %r; scanning "
                "instead, at most once a second",
                f"{self.unlogged:,}",
                self.channel,
                min(at - self._since, self.interval),
                reason,
                shown,
            )
        self.unlogged = 0
        self._since = at


@dataclass
class Throttle:
    """Lets a costly answer to notifications (a scan of every shard, a sweep) run at most once
    per ``interval``: the first request runs at once, later ones are held and coalesced into
    one run when the interval has passed."""

    interval: float
    clock: Callable[[], float] = time.monotonic
    pending: bool = False
    _last: float = field(default=-float("inf"))

    def request(self) -> None:
        self.pending = True

    def due_in(self) -> float | None:
        """Seconds until a held request may run (0: now); None when none is held."""
        if not self.pending:
            return None
        return max(0.0, self._last + self.interval - self.clock())

    def take(self) -> bool:
        """Whether a request may run now (then it is no longer held)."""
        if self.due_in() != 0.0:
            return False
        self.pending = False
        self._last = self.clock()
        return True
