"""In-process hand-off between the bridge and lingering drains.

After a drain empties its shard it lingers for a few seconds, waiting here for news of its
shard. When the bridge learns of new rows in a shard whose drain is lingering in this process,
it wakes that drain instead of signalling the workflow: the rows are handled at once and
steady traffic costs no workflow task per row.

A lingering drain stays registered for its whole call, batches included: news that comes
while it handles rows waits in its event, and it reads its shard again right after the batch.
Both sides run on one event loop, so an offer and a drain's departure are ordered; news that
came just before the drain left makes it ask its workflow to drain again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class ShardHub:
    def __init__(self) -> None:
        self._lingering: dict[Hashable, asyncio.Event] = {}
        self.closed = False

    def close(self) -> None:
        """Shutting down: wake every lingering drain so that it returns now."""
        self.closed = True
        for event in self._lingering.values():
            event.set()

    def arrive(self, key: Hashable) -> asyncio.Event:
        """Register a lingering drain for ``key``; the event is set when rows arrive."""
        event = asyncio.Event()
        self._lingering[key] = event
        return event

    def leave(self, key: Hashable, event: asyncio.Event) -> None:
        if self._lingering.get(key) is event:
            del self._lingering[key]

    def offer(self, key: Hashable) -> bool:
        """Hand news of new rows to a drain lingering on ``key``; False if none is."""
        event = self._lingering.get(key)
        if event is None:
            return False
        event.set()
        return True

    def __len__(self) -> int:
        return len(self._lingering)
