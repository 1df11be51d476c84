"""How many rows the calls logged so far cover, kept up to date call by call (when to stop a
drain); :mod:`bench.peers.checker` has the final word."""

from __future__ import annotations

import bisect
from collections import defaultdict

from bench.peers.calls import Call
from bench.peers.checker import Row

Group = tuple[int, int, int]  # key, category, object


class Coverage:
    def __init__(self, rows: list[Row], *, coalescing: bool) -> None:
        self.coalescing = coalescing
        self.total = len(rows)
        self.covered = 0
        self._seqs: dict[Group, list[int]] = defaultdict(list)
        for row in rows:
            self._seqs[(row.key, row.category, row.obj)].append(row.seq)
        for seqs in self._seqs.values():
            seqs.sort()
        self._highest: dict[Group, int] = {}  # coalescing: the highest sequence handled
        self._done: set[int] = set()  # otherwise: the rows handled

    def add(self, call: Call) -> bool:
        """Count a call; whether it covered a row not covered before."""
        group = (call.key, call.category, call.obj)
        seqs = self._seqs.get(group)
        if not call.ok or seqs is None:
            return False
        if not self.coalescing:
            if call.seq in self._done or call.seq not in seqs:
                return False
            self._done.add(call.seq)
            self.covered += 1
            return True
        before = bisect.bisect_right(seqs, self._highest.get(group, 0))
        after = bisect.bisect_right(seqs, call.seq)
        if after <= before:
            return False
        self._highest[group] = call.seq
        self.covered += after - before
        return True

    def complete(self) -> bool:
        return self.covered >= self.total
