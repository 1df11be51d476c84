"""How a shard workflow's record changes on what it learns: a drain's result, a handover, news
of rows, a skip and a resume, the answers of the owner table's transitions, and the backoff a
blocked run carries over. Pure functions of the record: nothing here waits or runs anything."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio.common import RetryPolicy

from outbox_bridge.workflows.models import (
    Blocked,
    Deferred,
    Draining,
    DrainResult,
    HandoverInput,
    HeldFor,
    Idle,
    Phase,
    Resumed,
    ShardOptions,
    ShardRecord,
    SkipInfo,
    Skipped,
)

BACKOFF_COEFFICIENT = 2.0


def drained(r: ShardRecord, result: DrainResult, *, news: bool, now: str) -> None:
    """A drain's result. Still draining if rows may remain, or news came while it ran."""
    r.parked = result.parked
    r.rows_handled += result.rows_handled
    r.groups_handled += result.groups_handled
    r.highest_seen_id = max(r.highest_seen_id, result.highest_seen_id)
    pending = result.more or news
    if result.failed is not None:
        r.become(Blocked(result.failed, 1, result.failure, now))
    elif not pending and result.deferred_until is not None:
        r.become(Deferred(result.deferred_until, result.deferred_seconds, result.paused))
    else:
        r.become(Draining() if pending else Idle())


def rows_committed(r: ShardRecord, max_id: int, *, late: bool) -> bool:
    """Rows up to ``max_id`` are committed; True if they are news (rows to drain)."""
    r.max_known_id = max(r.max_known_id, max_id)
    if not late and max_id <= r.highest_seen_id:
        return False
    if isinstance(r.current, Idle | Deferred):
        r.become(Draining())
    return True


def handed_over(
    r: ShardRecord, input: HandoverInput, now: str, drains_first: Callable[[], bool]
) -> bool:
    """A partition gives the shard, held for the workflow already; True if it is news to a
    drain under way (the shard is known blocked, or a drain finds out). ``drains_first``: a
    deferred handover drains before it waits, asked only when it decides."""
    r.max_known_id = max(r.max_known_id, input.max_id)
    if input.skip is not None and r.skip is None:  # the partition recorded it
        r.phase = Skipped(SkipInfo(input.skip.reason, input.skip.by, now), r.current, True)
    current = r.current
    if isinstance(current, Blocked | Draining):
        return True
    phase = _handed_phase(current, input, now, drains_first)
    if phase is not None:
        r.become(phase)
    return False


def _handed_phase(
    current: Idle | Deferred, input: HandoverInput, now: str, drains_first: Callable[[], bool]
) -> Phase | None:
    if input.held_for == HeldFor.FAILED and input.head is not None:
        return Blocked(input.head, 1, input.failure, now)  # the partition's call
    if input.held_for == HeldFor.DEFERRED and drains_first():
        return Draining()  # the drain finds out why the head waits, for the UI
    if input.held_for == HeldFor.DEFERRED and input.deferred_until is not None:
        paused = current.paused if isinstance(current, Deferred) else None
        return Deferred(input.deferred_until, input.deferred_seconds, paused)
    return Draining() if input.skip is None else None


def skipped(r: ShardRecord, skip: SkipInfo) -> None:
    """Skipped (again). A shard resumed while the owner table still says skipped is skipped
    there already."""
    if isinstance(r.phase, Skipped):
        r.phase.skip = skip
    else:
        r.phase = Skipped(skip, r.current, recorded=isinstance(r.phase, Resumed))


def resumed(r: ShardRecord) -> None:
    """Resumed: the head is retried at once, from scratch, once the table says so too."""
    if isinstance(r.phase, Skipped):
        r.phase = Resumed() if r.phase.recorded else Draining()


def skip_recorded(r: ShardRecord) -> None:
    """The owner table says skipped (the skip's transition answered)."""
    if isinstance(r.phase, Skipped):
        r.phase.recorded = True
    else:
        r.phase = Resumed()  # resumed while it was recorded


def taken_back(r: ShardRecord) -> None:
    """The owner table says held by the workflow (the resume's transition answered)."""
    if isinstance(r.phase, Skipped):
        r.phase.recorded = False  # skipped again meanwhile: recorded again next
    elif isinstance(r.phase, Resumed):
        r.phase = Draining()


def attempts_since(elapsed: float, retry_from: float, ceiling: float) -> tuple[int, float, float]:
    """The server's attempts in ``elapsed`` seconds of a retry schedule that starts at
    ``retry_from``: how many, the interval now, and when the last one began."""
    interval, waited, attempts = retry_from, 0.0, 1
    while waited + interval <= elapsed:
        waited += interval
        attempts += 1
        interval = min(interval * BACKOFF_COEFFICIENT, ceiling)
    return attempts, interval, waited


def retry_policy(
    options: ShardOptions, *, initial: float | None = None, maximum_interval: float | None = None
) -> RetryPolicy:
    first = initial or options.initial_retry_seconds
    ceiling = maximum_interval or options.max_retry_interval_seconds
    return RetryPolicy(
        initial_interval=timedelta(seconds=first),
        backoff_coefficient=BACKOFF_COEFFICIENT,
        maximum_interval=timedelta(seconds=max(first, ceiling)),
        maximum_attempts=0,
    )


def scheduled_attempt(b: Blocked, options: ShardOptions) -> None:
    """The attempt a carried-over backoff scheduled: the backoff goes on from the interval
    after it."""
    interval = b.retry_interval_seconds or options.initial_retry_seconds
    b.retry_interval_seconds = min(
        interval * BACKOFF_COEFFICIENT, options.max_retry_interval_seconds
    )
    b.next_attempt_at = None


def carry_backoff(
    b: Blocked, options: ShardOptions, blocked_at: datetime, now: datetime, retry_from: float
) -> None:
    """The server's attempts since the category activity began at ``blocked_at`` (from the
    retry schedule) and where the backoff stands, for the next run to go on from; its next
    attempt a whole interval from ``now`` (the server's last one may be just behind us)."""
    elapsed = (now - blocked_at).total_seconds()
    attempts, interval, _ = attempts_since(elapsed, retry_from, options.max_retry_interval_seconds)
    b.attempts += attempts
    b.retry_interval_seconds = interval
    b.next_attempt_at = (now + timedelta(seconds=interval)).isoformat()
