"""The payload bytes one worker's drain rounds hold at once.

A round reads the newest rows of its groups, payloads as JSON text, and keeps them (decoded)
until its calls have ended. Every round of a worker takes its bytes from one budget before it
reads them and gives them back when it ends, so that however many rounds run at once (partitions,
shard workflows), their payloads together stay within the budget: a round that would go over it
waits for others to end. A round alone may go over it by one payload (at most the payload limit),
or no row could ever run.
"""

from __future__ import annotations

import sys

from outbox_bridge.runtime.waiters import Waiters

# What the rounds of one worker hold at once by default, in bytes of JSON text. Decoded, a
# payload takes 1x (one long string) to 4-6x (records, numbers, short strings) its text, and up
# to about 18x for thousands of empty objects: about 300 MiB at worst.
PAYLOAD_BUDGET_BYTES = 16 * 2**20


class PayloadBudget:
    """Bytes taken by rounds and not given back yet, and the rounds waiting for room. Used on
    the event loop only; giving back never waits (it runs as a round ends, also cancelled)."""

    def __init__(self, limit: int = PAYLOAD_BUDGET_BYTES) -> None:
        if limit < 1:
            raise ValueError(f"the payload budget must be at least 1 byte, not {limit}")
        self.limit = limit
        self.used = 0
        # Every waiter looks again when bytes come back: the first that fits goes on.
        self._waiters = Waiters(lambda: sys.maxsize)

    async def take(self, size: int) -> None:
        """Take ``size`` bytes, once they fit beside what the other rounds hold: at once when
        no round holds any. Call it once per round, holding nothing (a round that waits while it
        holds bytes could wait for another that waits for it): :meth:`add` for more."""
        await self._waiters.until(lambda: not self.used or self.used + size <= self.limit)
        self.used += size

    def add(self, size: int) -> None:
        """Count ``size`` more bytes (fewer, if negative) for a round that took some, without
        waiting for room: what it read turned out larger or smaller than it took."""
        self.used += size
        if size < 0:
            self._waiters.wake()

    def give(self, size: int) -> None:
        """Give back ``size`` bytes a round held (when it ends)."""
        self.add(-size)
