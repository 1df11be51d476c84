"""Drain rounds: the pure logic that turns a shard's window of rows into its head groups, the
partition a shard belongs to, and the bounds on what a partition queues and a round reads.

Unit tests without a server, then rounds against a real PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox_bridge.db.store import ShardWindow, WindowRow
from outbox_bridge.runtime.batch import _head_of
from outbox_bridge.runtime.hub import ShardKey, partition_of
from outbox_bridge.workflows.models import ShardRef

SHARD = ShardRef("outbox", 1, "ORGANIZATION", 42)
LATER = datetime(2030, 1, 1, tzinfo=UTC)


def due(row_id: int, category: int, obj: int) -> WindowRow:
    return WindowRow(row_id, category, obj, None, None)


def deferred(row_id: int, category: int, obj: int, seconds: float = 60.0) -> WindowRow:
    return WindowRow(row_id, category, obj, seconds, LATER + timedelta(seconds=seconds))


def groups_of(rows: list[WindowRow], *, size: int = 16, max_groups: int = 100) -> list[object]:
    head = _head_of(SHARD, ShardWindow(0, rows, rows[-1].id if rows else 0), size, max_groups)
    return [(g.category, g.object_identifier, g.ids) for g in head.groups]


# -- _head_of: a window of rows into head groups -------------------------------------------------


def test_groups_are_ordered_by_their_lowest_id_and_coalesce_their_rows() -> None:
    rows = [due(1, 2, 10), due(2, 1, 5), due(3, 2, 10), due(4, 3, 7), due(5, 1, 5), due(6, 2, 11)]
    assert groups_of(rows) == [(2, 10, [1, 3]), (1, 5, [2, 5]), (3, 7, [4]), (2, 11, [6])]
    head = _head_of(SHARD, ShardWindow(0, rows, 9), 16, 100)
    assert [g.last_id for g in head.groups] == [3, 5, 4, 6]  # each handled with its newest row
    assert head.highest_id == 9
    assert not head.more and not head.open_ended
    assert head.deferred_seconds is None and head.deferred_until is None


def test_the_same_object_in_another_category_is_another_group() -> None:
    assert groups_of([due(1, 1, 5), due(2, 2, 5), due(3, 1, 5)]) == [(1, 5, [1, 3]), (2, 5, [2])]


def test_a_deferred_row_is_a_barrier_that_nothing_passes() -> None:
    """Rows after the first row not yet due wait for it, even rows of a group that is already
    at the head: coalescing them past the barrier would run them before it."""
    rows = [due(1, 2, 10), due(2, 1, 5), deferred(3, 3, 7, 30.0), due(4, 2, 10), due(5, 4, 1)]
    head = _head_of(SHARD, ShardWindow(0, rows, 5), 16, 100)
    assert [(g.category, g.ids) for g in head.groups] == [(2, [1]), (1, [2])]
    assert not head.more and not head.open_ended
    # Once these groups are handled, the shard waits for the barrier.
    assert head.deferred_seconds == 30.0
    assert head.deferred_until == LATER + timedelta(seconds=30)


def test_a_deferred_head_leaves_no_group() -> None:
    rows = [deferred(1, 2, 10, 5.0), due(2, 2, 10), due(3, 1, 1)]
    head = _head_of(SHARD, ShardWindow(0, rows, 3), 16, 100)
    assert head.groups == []
    assert head.deferred_seconds == 5.0
    assert not head.more


def test_max_groups_truncates_but_later_rows_of_taken_groups_still_coalesce() -> None:
    rows = [due(1, 1, 1), due(2, 1, 2), due(3, 1, 3), due(4, 1, 1), due(5, 1, 2), due(6, 1, 4)]
    head = _head_of(SHARD, ShardWindow(0, rows, 6), 16, 2)
    assert [(g.object_identifier, g.ids) for g in head.groups] == [(1, [1, 4]), (2, [2, 5])]
    assert head.more  # groups 3 and 4 wait for the next round
    assert not head.open_ended


def test_a_barrier_after_truncation_is_not_reported_as_the_shard_s_deferral() -> None:
    """Groups were left for the next round: the shard does not wait for the barrier yet."""
    rows = [due(1, 1, 1), due(2, 1, 2), deferred(3, 1, 3)]
    head = _head_of(SHARD, ShardWindow(0, rows, 3), 16, 1)
    assert [g.ids for g in head.groups] == [[1]]
    assert head.more
    assert head.deferred_seconds is None and head.deferred_until is None


def test_a_full_window_is_open_ended() -> None:
    """The window stopped at its size, not at a barrier: the head groups may go on past it
    (the round reads their tails), and due rows may remain."""
    rows = [due(n, 1, n % 3) for n in range(1, 9)]
    head = _head_of(SHARD, ShardWindow(0, rows, 8), 8, 100)
    assert head.open_ended and head.more
    assert [g.ids for g in head.groups] == [[1, 4, 7], [2, 5, 8], [3, 6]]


def test_a_full_window_ending_at_a_barrier_is_not_open_ended() -> None:
    rows = [due(1, 1, 1), due(2, 1, 2), deferred(3, 1, 1)]
    head = _head_of(SHARD, ShardWindow(0, rows, 3), 3, 100)
    assert not head.open_ended and not head.more
    assert head.deferred_seconds == 60.0


def test_a_full_window_with_truncated_groups_is_open_ended_too() -> None:
    rows = [due(n, 1, n) for n in range(1, 5)]
    head = _head_of(SHARD, ShardWindow(0, rows, 4), 4, 2)
    assert head.open_ended and head.more
    assert [g.ids for g in head.groups] == [[1], [2]]


def test_a_short_window_is_the_whole_shard() -> None:
    head = _head_of(SHARD, ShardWindow(0, [due(7, 1, 1)], 7), 16, 100)
    assert not head.open_ended and not head.more
    assert [g.ids for g in head.groups] == [[7]]


# -- partition_of: stable across processes and releases -------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        # CRC-32 of "<region>:<scope>:<identifier>", modulo 1, 2, 4, 7, 16 and 1000 partitions.
        (ShardKey("outbox", None, 1, 42), [0, 1, 3, 6, 15, 207]),
        (ShardKey("outbox", None, 2, 7), [0, 1, 1, 3, 1, 17]),
        (ShardKey("outbox", "eu", 1, 42), [0, 0, 0, 2, 12, 772]),
        (ShardKey("outbox", "eu:west", 2, -5), [0, 0, 2, 3, 2, 986]),
        (ShardKey("outbox", None, 1, 2**63 - 1), [0, 1, 1, 2, 9, 497]),
        (ShardKey("outbox", None, -(2**31), -(2**63)), [0, 1, 3, 2, 7, 47]),
        (ShardKey("outbox", "ü", 1, 1), [0, 1, 1, 3, 13, 597]),
    ],
)
def test_partition_of_never_changes(key: ShardKey, expected: list[int]) -> None:
    """Which partition drains a shard must be the same in every worker of a deployment, old
    and new releases mixed during an upgrade: these values are fixed, never recomputed."""
    assert [partition_of(key, n) for n in (1, 2, 4, 7, 16, 1000)] == expected


def test_partition_of_does_not_depend_on_the_table() -> None:
    assert partition_of(ShardKey("a", None, 1, 42), 16) == partition_of(
        ShardKey("b", None, 1, 42), 16
    )


def test_partition_of_spreads_shards_over_every_partition() -> None:
    counts = [0] * 8
    for ident in range(8000):
        counts[partition_of(ShardKey("outbox", None, 1, ident), 8)] += 1
    assert min(counts) > 800 and max(counts) < 1200
