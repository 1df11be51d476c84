"""The one checker for every system: what the handler calls logged say about the rows.

A row is *covered* by a successful call of its coalescing group (key, category, object) whose
row sequence is at least its own, for a system that coalesces (it hands the group's newest row
and the older ones are done with it); for one that does not, by a successful call for itself. From
the calls of each key, in the order they started:

- **lost**: rows no successful call covered;
- **order violations**: a call whose lowest newly covered row comes after a row of the same key
  that is still not covered (a row handled before an earlier one of its key);
- **duplicates**: successful calls that covered no row not already covered;
- **overlaps**: calls of one key that ran at the same time as an earlier call of that key;
- **calls per row**: successful calls over rows (1 without coalescing, less with it).

Pure: rows and calls in, a :class:`Verdict` out.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.peers.calls import Call

EXAMPLES = 5  # problems of each kind quoted in the verdict


@dataclass(frozen=True)
class Row:
    """One outbox row: its sequence (its order of commit) and its coalescing group."""

    seq: int
    key: int
    category: int
    obj: int


@dataclass
class Verdict:
    rows: int
    keys: int
    calls: int = 0
    failed_calls: int = 0
    lost: int = 0
    order_violations: int = 0
    duplicates: int = 0
    overlaps: int = 0
    unknown_calls: int = 0  # calls naming a row the run never wrote
    examples: list[str] = field(default_factory=list)
    # When each covered row's covering call started (for commit → handler latency).
    covered_at: dict[int, float] = field(default_factory=dict)

    @property
    def calls_per_row(self) -> float:
        return (self.calls - self.failed_calls) / self.rows if self.rows else 0.0

    @property
    def clean(self) -> bool:
        return not (self.lost or self.order_violations or self.duplicates or self.overlaps)

    def figures(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "keys": self.keys,
            "calls": self.calls,
            "failed_calls": self.failed_calls,
            "calls_per_row": round(self.calls_per_row, 4),
            "lost": self.lost,
            "order_violations": self.order_violations,
            "duplicates": self.duplicates,
            "overlaps": self.overlaps,
            "unknown_calls": self.unknown_calls,
            "examples": self.examples,
        }


class _Key:
    """The pending rows of one key: a heap of every pending sequence (lazily pruned) and, per
    group, its pending sequences in order."""

    def __init__(self) -> None:
        self.heap: list[int] = []
        self.groups: dict[tuple[int, int], deque[int]] = defaultdict(deque)
        self.done: set[int] = set()

    def add(self, row: Row) -> None:
        heapq.heappush(self.heap, row.seq)
        self.groups[(row.category, row.obj)].append(row.seq)

    def lowest_pending(self) -> int | None:
        while self.heap and self.heap[0] in self.done:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def cover(self, call: Call, *, coalescing: bool) -> list[int]:
        pending = self.groups.get((call.category, call.obj))
        if not coalescing:
            if pending is None or call.seq not in pending:
                return []
            pending.remove(call.seq)
            return [call.seq]
        covered: list[int] = []
        while pending and pending[0] <= call.seq:
            covered.append(pending.popleft())
        return covered

    def pending(self) -> int:
        return sum(len(group) for group in self.groups.values())


def check(rows: Iterable[Row], calls: Iterable[Call], *, coalescing: bool = True) -> Verdict:
    """Check ``calls`` against the ``rows`` written. With ``coalescing``, a call covers the
    pending rows of its group up to its own; without, its own row only (a system that does not
    coalesce, whose calls then each answer for exactly one row)."""
    keys: dict[int, _Key] = defaultdict(_Key)
    count = 0
    for row in sorted(rows, key=lambda r: r.seq):
        keys[row.key].add(row)
        count += 1
    verdict = Verdict(rows=count, keys=len(keys))
    by_key: dict[int, list[Call]] = defaultdict(list)
    for call in calls:
        verdict.calls += 1
        verdict.failed_calls += not call.ok
        if call.key not in keys:
            verdict.unknown_calls += 1
            continue
        by_key[call.key].append(call)
    for key, key_calls in by_key.items():
        key_calls.sort(key=lambda c: (c.start, c.end))
        _overlaps(verdict, key, key_calls)
        _coverage(verdict, key, keys[key], [c for c in key_calls if c.ok], coalescing)
    verdict.lost = sum(state.pending() for state in keys.values())
    if verdict.lost:
        verdict.examples.append(f"{verdict.lost} rows never handled")
    return verdict


def _note(verdict: Verdict, text: str) -> None:
    if len(verdict.examples) < 3 * EXAMPLES:
        verdict.examples.append(text)


def _overlaps(verdict: Verdict, key: int, calls: Sequence[Call]) -> None:
    latest_end, latest = float("-inf"), None
    for call in calls:
        if latest is not None and call.start < latest_end:
            verdict.overlaps += 1
            _note(verdict, f"key {key}: row {call.seq} started while row {latest.seq} ran")
        if call.end > latest_end:
            latest_end, latest = call.end, call


def _coverage(
    verdict: Verdict, key: int, state: _Key, calls: Sequence[Call], coalescing: bool
) -> None:
    for call in calls:
        covered = state.cover(call, coalescing=coalescing)
        if not covered:
            verdict.duplicates += 1
            _note(verdict, f"key {key}: row {call.seq} handled again")
            continue
        lowest = state.lowest_pending()
        if lowest is not None and lowest < covered[0]:
            verdict.order_violations += 1
            _note(verdict, f"key {key}: row {covered[0]} handled before row {lowest}")
        for seq in covered:
            state.done.add(seq)
            verdict.covered_at[seq] = call.start
