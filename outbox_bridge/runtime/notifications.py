"""Reading the notifications of an outbox table's trigger, ``[[scope, shard identifier, highest
id], ...]`` (the region first in a regional table), trusting nothing: any role can ``NOTIFY``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
# PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more: a longer message is not read.
MAX_PAYLOAD_BYTES = 7999


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
