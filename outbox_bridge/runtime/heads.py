"""What a round finds at the heads of its shards: the coalescing groups to handle, in order, and
their newest rows, read for many shards in a few statements. The testing toolkit's in-process
drain reads with these too."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Table
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.reads import (
    GroupRows,
    GroupTail,
    ShardWindow,
    WindowRow,
    read_group_tails,
    read_payload_sizes,
    read_rows,
    read_windows,
)
from outbox_bridge.workflows.models import HandlerFailure, ShardRef

# Runs one statement on the connection that holds the shards' locks: ``execute(work)`` awaits
# ``work(conn)`` (see Round.execute).
Execute = Callable[[Callable[[AsyncConnection], Awaitable[Any]]], Awaitable[Any]]


@dataclass(slots=True)
class ShardHead:
    """What a round found at the head of one shard: the groups to handle, in order."""

    shard: ShardRef
    groups: list[GroupRows]
    highest_id: int
    more: bool = False  # due rows may remain after these groups
    open_ended: bool = False  # the read stopped at its window, not at a deferred row
    deferred_seconds: float | None = None  # then the head is a row not due for this long
    deferred_until: datetime | None = None  # (when it is due)
    rows: dict[int, Row[Any]] = field(default_factory=dict)  # the newest row of each group
    fault: HandlerFailure | None = None  # why the head cannot be read (its first group fails)


async def read_shard_heads(
    execute: Execute,
    table: Table,
    shards: Sequence[ShardRef],
    *,
    max_groups: int,
    skip_held: bool,
    max_payload_bytes: int,
    skip_paused: bool = False,
    with_trace_context: bool = False,
    deferred_as_due: bool = False,
    max_bytes: int | None = None,
    reserve: Callable[[int], Awaitable[None]] | None = None,
    rated: Callable[[int], int | None] | None = None,
) -> list[ShardHead]:
    """The head groups of each of ``shards`` (at most ``max_groups`` each) and their newest
    rows, in a few statements for all of them: the windows, the groups' tails past a full
    window, then the rows. ``deferred_as_due`` (``drain_outbox(run_deferred=True)``) counts
    rows not yet due as due in the windows; ``max_bytes`` keeps each shard's prefix of groups
    whose newest rows fit that many payload bytes in all (their JSON text). A payload over
    ``max_payload_bytes`` is never read (its row comes without it, and its call fails), and
    its shard's later groups wait for a later round. ``reserve(bytes)`` is awaited before the
    rows are read, with what they may hold (given back, when negative, once they are read).
    ``rated(category)`` caps the groups of a rate-limited category in one head (see
    :func:`head_of`)."""
    window = max(2 * max_groups, 16)
    windows = await execute(
        lambda conn: read_windows(
            conn,
            table,
            shards,
            window=window,
            skip_held=skip_held,
            skip_paused=skip_paused,
        )
    )
    heads = [
        head_of(
            shards[found.index],
            _as_due(found) if deferred_as_due else found,
            window,
            max_groups,
            rated,
        )
        for found in windows
    ]
    await _read_tails(execute, table, heads, windows)
    expected = await _fit_payloads(execute, table, heads, max_bytes, max_payload_bytes)
    if reserve is not None:
        await reserve(expected)
    newest = [group.last_id for head in heads for group in head.groups]
    rows = await execute(
        lambda conn: read_rows(
            conn,
            table,
            newest,
            with_trace_context=with_trace_context,
            max_payload_bytes=max_payload_bytes,
        )
    )
    if reserve is not None:
        await reserve(sum(len(row.payload or "") for row in rows.values()) - expected)
    for head in heads:
        head.rows = {g.last_id: rows[g.last_id] for g in head.groups if g.last_id in rows}
    return heads


def _as_due(window: ShardWindow) -> ShardWindow:
    window.rows = [dataclasses.replace(row, deferred_seconds=None) for row in window.rows]
    return window


async def _read_tails(
    execute: Execute, table: Table, heads: list[ShardHead], windows: list[ShardWindow]
) -> None:
    """Extend the groups of each open-ended head with their rows past its window."""
    tails: list[tuple[ShardHead, GroupRows, GroupTail]] = [
        (head, group, GroupTail(head.shard, group.category, group.object_identifier, after))
        for head, found in zip(heads, windows, strict=True)
        if head.open_ended  # the head groups may go on past the window
        for after in [found.rows[-1].id]
        for group in head.groups
    ]
    if not tails:
        return
    found_tails = await execute(lambda conn: read_group_tails(conn, table, [t for *_, t in tails]))
    for (head, group, _), (ids, deferred) in zip(tails, found_tails, strict=True):
        group.ids.extend(ids)
        if deferred is not None:
            head.more = True  # the rows up to the barrier come first


async def _fit_payloads(
    execute: Execute,
    table: Table,
    heads: list[ShardHead],
    max_bytes: int | None,
    max_payload_bytes: int,
) -> int:
    """Keep the heads' groups within ``max_bytes``; returns what their payloads may take."""
    newest = [group.last_id for head in heads for group in head.groups]
    if max_bytes is None or len(newest) <= 1:
        # Without sizes (a lone group), what its payload may take at most, until it is read.
        return max_payload_bytes * len(newest)
    sizes = await execute(lambda conn: read_payload_sizes(conn, table, newest))
    if _keep_within(heads, sizes, max_bytes, max_payload_bytes):
        newest = [group.last_id for head in heads for group in head.groups]
    return sum(size for i in newest if (size := sizes.get(i, 0)) <= max_payload_bytes)


def _keep_within(
    heads: Sequence[ShardHead], sizes: dict[int, int], budget: int, limit: int
) -> bool:
    """Keep, of each shard's groups, the prefix whose newest rows' payloads (``sizes``, by row
    id) fit ``budget`` bytes in all, every shard's first group before any shard's second; at
    least one group. A payload over ``limit`` is not read (it costs nothing) and ends its
    shard's prefix: its call fails. True if any group was left for a later round."""
    kept = [0] * len(heads)
    used = taken = 0
    open_ = [index for index, head in enumerate(heads) if head.groups]
    level = 0
    while open_:
        still = []
        for index in open_:
            groups = heads[index].groups
            size = sizes.get(groups[level].last_id, 0)
            unread = size > limit
            if unread:
                size = 0
            elif taken and used + size > budget:
                continue  # this shard stops here
            used += size
            taken += 1
            kept[index] += 1
            if level + 1 < len(groups) and not unread:
                still.append(index)
        open_ = still
        level += 1
    cut = False
    for head, count in zip(heads, kept, strict=True):
        if count < len(head.groups):
            del head.groups[count:]
            head.more = True  # the rest of its groups come first, in the next round
            head.deferred_seconds = head.deferred_until = None
            cut = True
    return cut


def head_of(
    shard: ShardRef,
    window: ShardWindow,
    size: int,
    max_groups: int,
    rated: Callable[[int], int | None] | None = None,
) -> ShardHead:
    """Coalescing groups of the window, ordered by their first id, up to the first row not yet
    due (the barrier: order within a shard waits for it). A full window (``size`` rows)
    without a barrier is open-ended: the head groups may go on past it. The head also ends
    after ``rated(category)`` groups of a rate-limited category (None: no cap): the calls
    a round can get tokens for, not rows read again round after round while they wait."""
    groups: dict[tuple[int, int], GroupRows] = {}
    per_category: dict[int, int] = {}
    head = ShardHead(shard, [], window.highest_id)
    barrier: WindowRow | None = None
    for row in window.rows:
        if row.deferred_seconds is not None:
            barrier = row
            break
        key = (row.category, row.object_identifier)
        group = groups.get(key)
        if group is None:
            if len(groups) == max_groups:
                head.more = True
                continue  # later rows of the groups already taken still coalesce into them
            cap = None if rated is None else rated(row.category)
            if cap is not None:
                taken = per_category[row.category] = per_category.get(row.category, 0) + 1
                if taken > cap:
                    max_groups = len(groups)  # no further group: order within the shard
                    head.more = True
                    continue
            group = groups[key] = GroupRows(row.category, row.object_identifier, [])
        group.ids.append(row.id)
    if barrier is None and len(window.rows) == size:
        head.open_ended = head.more = True  # rows go on past the window
    if barrier is not None and not head.more:
        # Once these groups are handled, the shard waits for this row.
        head.deferred_seconds = barrier.deferred_seconds
        head.deferred_until = barrier.scheduled_for
    head.groups = list(groups.values())
    return head
