"""Drain rounds: the pure logic that turns a shard's window of rows into its head groups, the
partition a shard belongs to, and the bounds on what a partition queues and a round reads.

Unit tests without a server, then rounds against a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Row, Table
from sqlalchemy.ext.asyncio import AsyncConnection
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from outbox_bridge.db.reads import GroupRows, ShardWindow, WindowRow
from outbox_bridge.db.reads import read_rows as store_read_rows
from outbox_bridge.db.scans import read_shard_ranges
from outbox_bridge.runtime import heads as heads_module
from outbox_bridge.runtime import hub as hub_module
from outbox_bridge.runtime import partition_drain as partition_drain_module
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.heads import ShardHead, _keep_within, head_of
from outbox_bridge.runtime.hub import PartitionInbox, ShardHub, partition_of
from outbox_bridge.runtime.partition_drain import PartitionDrain, _ScanTimes, carried_round
from outbox_bridge.runtime.round_writes import ShardOutcome
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import (
    SHARDS_COUNTED,
    PartitionDrainInput,
    PartitionOptions,
    PartitionRef,
    PartitionRound,
    ShardRef,
)
from outbox_bridge.workflows.partition import _at_least
from tests.harness import (
    Category,
    Recorder,
    count_rows,
    create_tables,
    fresh_app,
    make_app,
    unique_table,
    wait_until,
    write_rows,
)

SHARD = ShardRef("outbox", 1, "ORGANIZATION", 42)
LATER = datetime(2030, 1, 1, tzinfo=UTC)


def due(row_id: int, category: int, obj: int) -> WindowRow:
    return WindowRow(row_id, category, obj, None, None)


def deferred(row_id: int, category: int, obj: int, seconds: float = 60.0) -> WindowRow:
    return WindowRow(row_id, category, obj, seconds, LATER + timedelta(seconds=seconds))


def groups_of(rows: list[WindowRow], *, size: int = 16, max_groups: int = 100) -> list[object]:
    head = head_of(SHARD, ShardWindow(0, rows, rows[-1].id if rows else 0), size, max_groups)
    return [(g.category, g.object_identifier, g.ids) for g in head.groups]


# -- head_of: a window of rows into head groups -------------------------------------------------


def test_groups_are_ordered_by_their_lowest_id_and_coalesce_their_rows() -> None:
    rows = [due(1, 2, 10), due(2, 1, 5), due(3, 2, 10), due(4, 3, 7), due(5, 1, 5), due(6, 2, 11)]
    assert groups_of(rows) == [(2, 10, [1, 3]), (1, 5, [2, 5]), (3, 7, [4]), (2, 11, [6])]
    head = head_of(SHARD, ShardWindow(0, rows, 9), 16, 100)
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
    head = head_of(SHARD, ShardWindow(0, rows, 5), 16, 100)
    assert [(g.category, g.ids) for g in head.groups] == [(2, [1]), (1, [2])]
    assert not head.more and not head.open_ended
    # Once these groups are handled, the shard waits for the barrier.
    assert head.deferred_seconds == 30.0
    assert head.deferred_until == LATER + timedelta(seconds=30)


def test_a_deferred_head_leaves_no_group() -> None:
    rows = [deferred(1, 2, 10, 5.0), due(2, 2, 10), due(3, 1, 1)]
    head = head_of(SHARD, ShardWindow(0, rows, 3), 16, 100)
    assert head.groups == []
    assert head.deferred_seconds == 5.0
    assert not head.more


def test_max_groups_truncates_but_later_rows_of_taken_groups_still_coalesce() -> None:
    rows = [due(1, 1, 1), due(2, 1, 2), due(3, 1, 3), due(4, 1, 1), due(5, 1, 2), due(6, 1, 4)]
    head = head_of(SHARD, ShardWindow(0, rows, 6), 16, 2)
    assert [(g.object_identifier, g.ids) for g in head.groups] == [(1, [1, 4]), (2, [2, 5])]
    assert head.more  # groups 3 and 4 wait for the next round
    assert not head.open_ended


def test_a_rate_limited_category_ends_the_head_after_its_cap_and_nothing_passes_it() -> None:
    """Category 1 may have 2 groups in a head: the third ends it, also for the unlimited
    groups after it (order within the shard), while taken groups still coalesce."""
    rows = [due(1, 1, 1), due(2, 2, 9), due(3, 1, 2), due(4, 1, 3), due(5, 2, 8), due(6, 1, 1)]
    head = head_of(SHARD, ShardWindow(0, rows, 6), 16, 100, {1: 2}.get)
    assert [(g.category, g.object_identifier, g.ids) for g in head.groups] == [
        (1, 1, [1, 6]),
        (2, 9, [2]),
        (1, 2, [3]),
    ]
    assert head.more  # group (1, 3) and the ones after it wait for a later round
    uncapped = head_of(SHARD, ShardWindow(0, rows, 6), 16, 100, {1: None}.get)
    assert len(uncapped.groups) == 5 and not uncapped.more


def test_a_barrier_after_truncation_is_not_reported_as_the_shard_s_deferral() -> None:
    """Groups were left for the next round: the shard does not wait for the barrier yet."""
    rows = [due(1, 1, 1), due(2, 1, 2), deferred(3, 1, 3)]
    head = head_of(SHARD, ShardWindow(0, rows, 3), 16, 1)
    assert [g.ids for g in head.groups] == [[1]]
    assert head.more
    assert head.deferred_seconds is None and head.deferred_until is None


def test_a_full_window_is_open_ended() -> None:
    """The window stopped at its size, not at a barrier: the head groups may go on past it
    (the round reads their tails), and due rows may remain."""
    rows = [due(n, 1, n % 3) for n in range(1, 9)]
    head = head_of(SHARD, ShardWindow(0, rows, 8), 8, 100)
    assert head.open_ended and head.more
    assert [g.ids for g in head.groups] == [[1, 4, 7], [2, 5, 8], [3, 6]]


def test_a_full_window_ending_at_a_barrier_is_not_open_ended() -> None:
    rows = [due(1, 1, 1), due(2, 1, 2), deferred(3, 1, 1)]
    head = head_of(SHARD, ShardWindow(0, rows, 3), 3, 100)
    assert not head.open_ended and not head.more
    assert head.deferred_seconds == 60.0


def test_a_full_window_with_truncated_groups_is_open_ended_too() -> None:
    rows = [due(n, 1, n) for n in range(1, 5)]
    head = head_of(SHARD, ShardWindow(0, rows, 4), 4, 2)
    assert head.open_ended and head.more
    assert [g.ids for g in head.groups] == [[1], [2]]


def test_a_short_window_is_the_whole_shard() -> None:
    head = head_of(SHARD, ShardWindow(0, [due(7, 1, 1)], 7), 16, 100)
    assert not head.open_ended and not head.more
    assert [g.ids for g in head.groups] == [[7]]


# -- partition_of: stable across processes and releases -------------------------------------------


ODD_KEYS = [
    ShardRef("outbox", 1, "ORGANIZATION", 42),
    ShardRef("outbox", 2, "2", -5, "eu:west"),
    ShardRef("outbox", 1, "ORGANIZATION", 2**63 - 1),
    ShardRef("outbox", -(2**31), str(-(2**31)), -(2**63)),
    ShardRef("outbox", 1, "ORGANIZATION", 1, "ü"),
]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        # The first 32 bits of the MD5 of "<region>:<scope>:<identifier>", modulo 1, 2, 4, 7,
        # 16 and 1000 partitions.
        (ShardRef("outbox", 1, "ORGANIZATION", 42), [0, 1, 3, 4, 11, 747]),
        (ShardRef("outbox", 2, "2", 7), [0, 1, 3, 4, 7, 431]),
        (ShardRef("outbox", 1, "ORGANIZATION", 42, "eu"), [0, 0, 0, 0, 12, 836]),
        (ShardRef("outbox", 2, "2", -5, "eu:west"), [0, 0, 2, 0, 2, 666]),
        (ShardRef("outbox", 1, "ORGANIZATION", 2**63 - 1), [0, 0, 2, 0, 14, 918]),
        (ShardRef("outbox", -(2**31), str(-(2**31)), -(2**63)), [0, 0, 0, 2, 12, 924]),
        (ShardRef("outbox", 1, "ORGANIZATION", 1, "ü"), [0, 1, 3, 0, 11, 259]),
    ],
)
def test_partition_of_never_changes(key: ShardRef, expected: list[int]) -> None:
    """Which partition drains a shard must be the same in every worker of a deployment, old
    and new releases mixed during an upgrade: these values are fixed, never recomputed."""
    assert [partition_of(key, n) for n in (1, 2, 4, 7, 16, 1000)] == expected


def test_partition_of_does_not_depend_on_the_table() -> None:
    assert partition_of(ShardRef("a", 1, "ORGANIZATION", 42), 16) == partition_of(
        ShardRef("b", 1, "ORGANIZATION", 42), 16
    )


def test_partition_of_spreads_shards_over_every_partition() -> None:
    counts = [0] * 8
    for ident in range(8000):
        counts[partition_of(ShardRef("outbox", 1, "ORGANIZATION", ident), 8)] += 1
    assert min(counts) > 800 and max(counts) < 1200


# -- a round's payload budget ------------------------------------------------------------------------


def head_with(shard: int, sizes: list[int], first_id: int) -> tuple[ShardHead, dict[int, int]]:
    """A head of one group per size, the newest row of each with that payload size."""
    ref = ShardRef("outbox", 1, "ORGANIZATION", shard)
    groups = [GroupRows(1, n, [first_id + n]) for n in range(len(sizes))]
    head = ShardHead(ref, groups, first_id + len(sizes))
    return head, {first_id + n: size for n, size in enumerate(sizes)}


def kept(heads: list[ShardHead]) -> list[int]:
    return [len(head.groups) for head in heads]


LIMIT = 1_000  # the payload limit of the budget tests: no payload is over it but where said


def test_the_budget_takes_every_shard_s_first_group_before_any_second() -> None:
    a, sizes_a = head_with(1, [4, 4, 4], 100)
    b, sizes_b = head_with(2, [3, 3], 200)
    c, sizes_c = head_with(3, [8], 300)
    heads = [a, b, c]
    assert _keep_within(heads, {**sizes_a, **sizes_b, **sizes_c}, 10, LIMIT)
    # Level 1: a (4) and b (3) fit, c (8) does not; level 2: a's second (4) does not, b's does.
    assert kept(heads) == [1, 2, 0]
    assert a.more and c.more and not b.more


def test_a_shard_keeps_a_prefix_of_its_groups() -> None:
    """Never a group skipped and a later one of the same shard taken: it would run first."""
    head, sizes = head_with(1, [1, 100, 1, 1], 100)
    assert _keep_within([head], sizes, 10, LIMIT)
    assert [g.last_id for g in head.groups] == [100]


def test_at_least_one_group_is_taken_however_large() -> None:
    big, sizes = head_with(1, [50, 1], 100)
    other, other_sizes = head_with(2, [50], 200)
    assert _keep_within([big, other], {**sizes, **other_sizes}, 10, LIMIT)
    assert kept([big, other]) == [1, 0]


def test_a_cut_shard_no_longer_reports_its_deferred_barrier() -> None:
    head, sizes = head_with(1, [5, 6], 100)
    head.deferred_seconds, head.deferred_until = 30.0, datetime(2030, 1, 1, tzinfo=UTC)
    assert _keep_within([head], sizes, 10, LIMIT)
    assert head.more and head.deferred_seconds is None and head.deferred_until is None


def test_a_payload_over_the_limit_costs_nothing_and_ends_its_shard_s_groups() -> None:
    """It is not read (its call fails without it): it takes none of the budget, and its
    shard's later groups wait, the other shards' groups go on."""
    over, sizes = head_with(1, [5, 2_000, 1], 100)
    other, other_sizes = head_with(2, [4, 1], 200)
    assert _keep_within([over, other], {**sizes, **other_sizes}, 10, LIMIT)
    assert [g.last_id for g in over.groups] == [100, 101] and over.more
    assert kept([other]) == [2] and not other.more


def test_what_fits_is_left_alone() -> None:
    a, sizes_a = head_with(1, [4, 4], 100)
    b, sizes_b = head_with(2, [2], 200)
    a.deferred_seconds = 5.0
    assert not _keep_within([a, b], {**sizes_a, **sizes_b}, 10, LIMIT)
    assert kept([a, b]) == [2, 1] and not a.more and a.deferred_seconds == 5.0
    # Unknown sizes (rows deleted meanwhile) count as nothing.
    assert not _keep_within([a, b], {}, 0, LIMIT)


PAYLOAD_CHARS = 150_000  # random hex: incompressible, stored at about this size
BUDGET = 500_000


async def test_a_round_reads_no_more_payload_bytes_than_its_budget(engine, monkeypatch) -> None:
    """Large payloads: each round reads the newest rows of only as many groups as fit its
    budget (one group per round at least), every shard's groups run in order, and every row
    is handled once."""
    recorder, _, app = await fresh_app(engine)
    table = app.table()
    rows: list[dict[str, object]] = []
    for obj in range(3):
        for shard in range(1, 5):
            text = os.urandom(PAYLOAD_CHARS // 2).hex()
            rows.append(
                {
                    "category": Category.PROJECT_UPDATE,
                    "shard_identifier": shard,
                    "object_identifier": obj,
                    "payload": {"blob": text},
                }
            )
    # One group alone is larger than the budget: it still runs, in a round of its own.
    rows.append(
        {
            "category": Category.MEMBER_UPDATE,
            "shard_identifier": 5,
            "object_identifier": 1,
            "payload": {"blob": os.urandom(BUDGET // 2 + 1).hex()},
        }
    )
    ids = await write_rows(engine, app, rows)
    reads: list[tuple[int, int]] = []  # rows and payload characters of each read
    real_read_rows = store_read_rows

    async def read_rows(
        conn: AsyncConnection, table: Table, wanted: list[int], **options: Any
    ) -> dict[int, Row[Any]]:
        found = await real_read_rows(conn, table, wanted, **options)
        reads.append((len(found), sum(len(str(row.payload)) for row in found.values())))
        return found

    monkeypatch.setattr(heads_module, "read_rows", read_rows)
    calls = HandlerCalls(app, redact_errors=False, threads=2)
    drains = DrainEngine(engine, app, calls=calls, max_round_bytes=BUDGET)
    shards = [ShardRef(table.name, 1, "ORGANIZATION", n) for n in range(1, 6)]
    try:
        for _ in range(30):
            if not await count_rows(engine, app):
                break
            async with drains.locked(table, shards) as locked:
                heads = await drains.read_heads(locked, max_groups=100, skip_held=True)
                await drains.run(locked, heads, deadline=math.inf)
    finally:
        calls.close()
    assert await count_rows(engine, app) == 0
    # 12 groups of 150 kB, 3 a round at most; the large group in a round of its own.
    assert all(size <= BUDGET for rows, size in reads if rows > 1), reads
    assert [rows for rows, size in reads if size > BUDGET] == [1]
    assert len(reads) >= 5
    handled: dict[str, list[int]] = defaultdict(list)
    for call in recorder.calls:
        handled[call.shard].append(call.id)
    for shard in range(1, 5):
        assert handled[f"1:{shard}"] == [
            i for i, r in zip(ids, rows, strict=True) if r["shard_identifier"] == shard
        ]
    assert sorted(recorder.ids()) == sorted(ids)


# -- a partition's queue ------------------------------------------------------------------------------


class NoHandovers:
    """A starter for a partition drain whose shards never need their own workflow."""

    skip_shards: frozenset[str] = frozenset()

    async def hand_over(self, shard: ShardRef, handover: object) -> bool:
        raise AssertionError(f"unexpected handover of {shard.key}")


async def test_a_partition_s_scan_returns_its_own_shards_as_partition_of_assigns_them(
    engine,
) -> None:
    """The database picks a partition's shards with the same function as the workers' news:
    every shard is returned to exactly the partition that ``partition_of`` names, the odd keys
    above included; a limited scan returns the shards with the oldest rows first."""
    app = make_app(unique_table(), Recorder(), regional=True)
    await create_tables(engine, app)
    table = app.table()
    odd = [(k.region or "", k.scope, k.shard_identifier) for k in ODD_KEYS]
    shards = odd + [("eu", 1, n) for n in range(200)] + [("", 3, n) for n in range(-50, 50)]
    async with engine.begin() as conn:
        await conn.execute(
            table.insert(),
            [
                {
                    "region": region,
                    "shard_scope": scope,
                    "shard_identifier": ident,
                    "category": 1,
                    "object_identifier": 1,
                }
                for region, scope, ident in shards
            ],
        )
    for partitions in (1, 4, 7):
        found: dict[tuple[str, int, int], int] = {}
        async with engine.connect() as conn:
            for number in range(partitions):
                for r in await read_shard_ranges(conn, table, partition=(number, partitions)):
                    assert (r.region, r.scope, r.shard_identifier) not in found
                    found[(r.region or "", r.scope, r.shard_identifier)] = number
        assert found == {
            key: partition_of(ShardRef(table.name, key[1], str(key[1]), key[2], key[0]), partitions)
            for key in shards
        }
    async with engine.connect() as conn:
        page = await read_shard_ranges(conn, table, partition=(0, 1), limit=5)
    assert [(r.region, r.scope, r.shard_identifier) for r in page] == shards[:5]


async def test_a_partition_s_queue_stays_bounded_and_overflow_is_found_by_a_scan(
    engine, monkeypatch
) -> None:
    """More shards with rows than the queue holds: the queue never holds more than its cap,
    and the shards left out are found by a scan of every shard once the queue runs low
    (the regular one is an hour away here); every row is handled."""
    recorder, _, app = await fresh_app(engine)
    await write_rows(
        engine,
        app,
        [
            {"category": Category.PROJECT_UPDATE, "shard_identifier": n, "object_identifier": 1}
            for n in range(40)
        ],
    )
    calls = HandlerCalls(app, redact_errors=False, threads=2)
    drains = DrainEngine(engine, app, calls=calls)
    hub = ShardHub()
    options = PartitionOptions(
        round_seconds=120.0,
        max_shards=3,
        max_rounds=1,
        poll_interval_seconds=0.1,
        rescan_interval_seconds=3600.0,
    )
    beats: list[PartitionRound] = []
    drain = PartitionDrain(
        drains,
        NoHandovers(),  # type: ignore[arg-type]
        hub,
        PartitionDrainInput(PartitionRef(app.table().name, 0, 1), options),
        heartbeat=beats.append,
        max_queued=5,
    )
    sizes: list[int] = []

    async def watch() -> None:
        while True:
            sizes.append(len(drain._queue))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    running = asyncio.create_task(drain.run())
    try:
        await wait_until(lambda: len(recorder.calls) == 40, timeout=30, what="every shard")
    finally:
        hub.close()
        await stopped(running)
        watcher.cancel()
        calls.close()
    assert max(sizes) <= 5
    assert all(beat.queued <= 5 for beat in beats)
    assert sorted(int(c.shard.split(":")[1]) for c in recorder.calls) == list(range(40))


async def stopped(running: asyncio.Task[PartitionRound]) -> None:
    """Wait for a drain whose worker is stopping: it fails (benign), so that the server retries
    it at once on another worker."""
    with pytest.raises(ApplicationError, match="this worker is stopping"):
        await running


async def test_a_drain_that_starts_on_a_stopping_worker_leaves_the_partition_benignly(
    engine,
) -> None:
    """Started after its worker began to stop, a drain fails at once with the benign failure
    its other refusals use: the server retries it on another worker, and the worker logs it at
    debug level only."""
    _, _, app = await fresh_app(engine)
    hub = ShardHub()
    hub.close()
    calls = HandlerCalls(app, redact_errors=False, threads=1)
    drain = PartitionDrain(
        DrainEngine(engine, app, calls=calls),
        NoHandovers(),  # type: ignore[arg-type]
        hub,
        PartitionDrainInput(PartitionRef(app.table().name, 0, 1), PartitionOptions()),
    )
    try:
        with pytest.raises(ApplicationError, match="this worker is stopping") as left:
            await drain.run()
    finally:
        calls.close()
    assert left.value.type == "PartitionElsewhere"
    assert left.value.category == ApplicationErrorCategory.BENIGN


async def test_an_idle_partition_scans_less_while_its_worker_listens(engine) -> None:
    """Without LISTEN a partition scans for new rows every poll interval. While its worker's
    bridge listens, each scan that finds nothing doubles the wait before the next (the
    notifications bring the rows), up to the full scans' interval; a row whose notification
    never reached the drain is still found by a scan, and the wait starts over from the poll
    interval. When the bridge stops listening, the drain polls at the interval again."""
    recorder, table_name, app = await fresh_app(engine)
    calls = HandlerCalls(app, redact_errors=False, threads=1)
    hub = ShardHub()
    options = PartitionOptions(
        round_seconds=120.0, poll_interval_seconds=0.05, rescan_interval_seconds=3600.0
    )
    drain = PartitionDrain(
        DrainEngine(engine, app, calls=calls),
        NoHandovers(),  # type: ignore[arg-type]
        hub,
        PartitionDrainInput(PartitionRef(table_name, 0, 1), options),
    )
    polls: list[float] = []  # when each scan for new rows (not a full scan) began
    scan = drain._scan

    async def counted(*, full: bool) -> bool:
        if not full:
            polls.append(time.monotonic())
        return await scan(full=full)

    drain._scan = counted  # type: ignore[method-assign]

    def polls_within(seconds: float) -> int:
        since = time.monotonic()
        return sum(1 for at in polls if at >= since - seconds)

    running = asyncio.create_task(drain.run())
    try:
        await asyncio.sleep(1.5)
        not_listening = polls_within(1.5)
        hub.set_listening(True)
        await asyncio.sleep(3.0)
        listening = polls_within(3.0)  # waits of 0.05, 0.1, 0.2, 0.4, 0.8, 1.6 s
        assert listening <= 6 and not_listening >= 6, (not_listening, listening)
        # A row the drain hears nothing of: the next scan finds it.
        await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 7, "object_identifier": 1}],
        )
        await wait_until(lambda: len(recorder.calls) == 1, timeout=30, what="the row")
        hub.set_listening(False)
        await asyncio.sleep(1.0)
        assert polls_within(1.0) >= 4
    finally:
        hub.close()
        await stopped(running)
        calls.close()


def test_a_partition_s_inbox_asks_for_a_scan_past_its_cap(monkeypatch) -> None:
    monkeypatch.setattr(hub_module, "MAX_NEWS", 3)
    inbox = PartitionInbox("outbox", 0, 1)
    for n in range(3):
        inbox.offer(ShardRef("outbox", 1, "ORGANIZATION", n), 10 + n)
    assert not inbox.rescan
    inbox.offer(
        ShardRef("outbox", 1, "ORGANIZATION", 1), 99
    )  # a shard it knows: newer news is kept
    inbox.offer(ShardRef("outbox", 1, "ORGANIZATION", 7), 20)
    assert inbox.rescan and len(inbox.news) == 3
    assert inbox.news[ShardRef("outbox", 1, "ORGANIZATION", 1)] == 99
    assert inbox.event.is_set()


def test_a_partition_drain_queues_news_up_to_its_cap() -> None:
    """News of more shards than the cap: the queue keeps the first ones and notes the
    overflow (the next scan of every shard finds the others)."""
    hub = ShardHub()
    drain = _tiny_drain(hub, max_queued=10)
    inbox = hub.open_partition("t_tiny", 0, 1)
    for n in range(1000):
        inbox.offer(ShardRef("t_tiny", 1, "ORGANIZATION", n), n + 1)
    assert not drain._take_news(inbox)
    assert list(drain._queue) == [ShardRef("t_tiny", 1, "ORGANIZATION", n) for n in range(10)]
    assert drain._queue.overflowed
    started = time.monotonic()
    for _ in range(100):
        drain._queue.next_round(drain._options.max_shards)
    assert time.monotonic() - started < 1.0


def _tiny_drain(
    hub: ShardHub,
    partition: int = 0,
    partitions: int = 1,
    *,
    engine: Any = None,
    max_queued: int = 20_000,
) -> PartitionDrain:
    """A drain of partition ``partition`` (of ``partitions``) of a table ``t_tiny``."""
    return PartitionDrain(
        DrainEngine(
            engine,
            _tiny_app(),
            calls=SimpleNamespace(at_once=1000, rates=None),  # type: ignore[arg-type]
            max_undeleted_groups=10,
        ),
        NoHandovers(),  # type: ignore[arg-type]
        hub,
        PartitionDrainInput(PartitionRef("t_tiny", partition, partitions), PartitionOptions()),
        max_queued=max_queued,
    )


async def test_a_drain_scans_every_shard_once_its_overflowed_queue_runs_low(monkeypatch) -> None:
    """Shards were left out of a full queue: once fewer than half its cap are queued (not only
    when it is empty), the next scan due is a scan of every shard, not one for new rows."""
    drain = _tiny_drain(ShardHub(), max_queued=10)
    scanned: list[bool] = []

    async def scan(*, full: bool) -> bool:
        scanned.append(full)
        return False

    monkeypatch.setattr(drain, "_scan", scan)
    for n in range(6):
        drain._queue.add(ShardRef("t_tiny", 1, "ORGANIZATION", n))
    drain._queue.overflowed = True
    now = time.monotonic()
    scans = _ScanTimes(last_poll=now - 5.0, next_rescan=now + 3600.0)
    await drain._scan_if_due(scans, False, now)
    assert scanned == [False]  # 6 of 10 queued: a scan for new rows
    drain._queue.next_round(2)  # 4 left
    scans.last_poll = now - 5.0
    await drain._scan_if_due(scans, False, now)
    assert scanned == [False, True]
    assert scans.next_rescan >= now + drain._options.rescan_interval_seconds


def test_a_drain_counts_distinct_shards_up_to_its_cap(monkeypatch) -> None:
    """The shards a drain reports as drained are distinct, and counted up to SHARDS_COUNTED
    only (each counted one is kept): past it, the partition's details say "at least"."""
    monkeypatch.setattr(partition_drain_module, "SHARDS_COUNTED", 3)
    drain = _tiny_drain(ShardHub())
    shards = [ShardRef("t_tiny", 1, "ORGANIZATION", n) for n in range(5)]
    drain._count([ShardOutcome(shards[0], groups_handled=1, rows_handled=1)] * 2, set())
    drain._count([ShardOutcome(shards[1])], set())  # no group handled: not drained
    assert drain._report(time.monotonic()).shards_drained == 1
    drain._count([ShardOutcome(s, groups_handled=1, rows_handled=2) for s in shards], set())
    report = drain._report(time.monotonic())
    assert (report.shards_drained, report.rows_handled, report.groups_handled) == (3, 12, 7)
    assert _at_least(SHARDS_COUNTED - 1) == f"{SHARDS_COUNTED - 1} shards"
    assert _at_least(SHARDS_COUNTED) == f"at least {SHARDS_COUNTED} shards"


def _tiny_app() -> Any:
    from tests.harness import Recorder, make_app

    return make_app("t_tiny", Recorder())


class RecordedHandovers:
    """A starter for a partition drain that records each handover instead of starting a
    workflow."""

    skip_shards: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.handovers: list[tuple[ShardRef, Any]] = []

    async def hand_over(self, shard: ShardRef, handover: Any) -> bool:
        self.handovers.append((shard, handover))
        return True


async def test_a_listed_shard_its_workflow_holds_is_not_skipped_again(engine) -> None:
    """The skip_shards setting hands a listed shard nobody holds to its workflow, skipped. A
    listed shard that its workflow holds (an operator resumed it and the workflow drains it) is
    left to that workflow: neither skipped again nor drained by the partition."""
    from outbox_bridge.db.ownership import read_held_shards, take
    from outbox_bridge.workflows.models import HeldFor

    recorder, table_name, app = await fresh_app(engine)
    resumed, listed, healthy = (ShardRef(table_name, 1, "ORGANIZATION", n) for n in (1, 2, 3))
    await write_rows(
        engine,
        app,
        [
            {"category": Category.PROJECT_UPDATE, "shard_identifier": n, "object_identifier": 1}
            for n in (1, 2, 3)
        ],
    )
    async with engine.begin() as conn:
        await take(conn, app.table(), resumed)
    calls = HandlerCalls(app, redact_errors=False, threads=2)
    starter = RecordedHandovers()
    hub = ShardHub()
    options = PartitionOptions(
        round_seconds=120.0,
        poll_interval_seconds=0.1,
        skip_shards=(resumed.workflow_id, listed.workflow_id),
    )
    drain = PartitionDrain(
        DrainEngine(engine, app, calls=calls),
        starter,  # type: ignore[arg-type]
        hub,
        PartitionDrainInput(PartitionRef(table_name, 0, 1), options),
    )
    running = asyncio.create_task(drain.run())
    try:
        await wait_until(lambda: bool(recorder.calls and starter.handovers), what="a round")
        await asyncio.sleep(0.5)  # further rounds and scans change nothing
    finally:
        hub.close()
        await stopped(running)
        calls.close()
    assert [(shard, h.held_for, h.skip.by) for shard, h in starter.handovers] == [
        (listed, HeldFor.SKIPPED, "configuration")
    ]
    assert [c.shard for c in recorder.calls] == [f"{healthy.scope}:{healthy.shard_identifier}"]
    async with engine.connect() as conn:
        held = {s.shard_identifier: s.held_for for s in await read_held_shards(conn, app.table())}
    assert held == {1: HeldFor.WORKFLOW, 2: HeldFor.SKIPPED}


def test_a_drain_carries_on_the_counts_of_an_attempt_whose_worker_left() -> None:
    """A drain retried after its worker stopped or died reads that attempt's last heartbeat
    (as the data converter decodes it: a dict) and goes on counting from it."""
    assert carried_round([]) is None
    assert carried_round(["not a round"]) is None
    last = {"rows_handled": 120, "groups_handled": 100, "handed_over": 2, "deepest": [{}]}
    carried = carried_round([{"rows_handled": 1}, last])
    assert carried == PartitionRound(rows_handled=120, groups_handled=100, handed_over=2)
    assert carried_round([{"rows_handled": "many"}]) == PartitionRound()
