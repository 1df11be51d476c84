"""What a shard workflow shows of its record: its status, its one-line headline, its details and
its search attributes. Pure functions of the record: nothing here waits or runs an activity."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey

from outbox_bridge.workflows.models import (
    BLOCKED_CATEGORY_ATTRIBUTE,
    BLOCKED_SINCE_ATTRIBUTE,
    STATE_ATTRIBUTE,
    Blocked,
    Deferred,
    FlushOutcome,
    FlushResult,
    PauseInfo,
    ShardRecord,
    ShardRef,
    ShardState,
    ShardStatus,
    until_text,
    when,
)


def status(shard: ShardRef, r: ShardRecord) -> ShardStatus:
    b = r.blocked
    deferred = r.current if isinstance(r.current, Deferred) else None
    return ShardStatus(
        shard=shard.key,
        state=r.state,
        max_known_id=r.max_known_id,
        highest_seen_id=r.highest_seen_id,
        rows_handled=r.rows_handled,
        groups_handled=r.groups_handled,
        head=b.head if b else None,
        attempts=b.attempts if b else 0,
        last_error=b.last_error if b else None,
        blocked_since=b.blocked_since if b else None,
        deferred_until=deferred.deferred_until if deferred else None,
        skip=r.skip,
        refused=r.refused,
    )


def flush_stopped(shard: ShardRef, r: ShardRecord, up_to: int) -> FlushResult | None:
    """Why rows up to ``up_to`` cannot be handled now, if they cannot."""
    b = r.blocked
    if r.skip is not None:
        return FlushResult(shard.key, FlushOutcome.SKIPPED, head=b.head if b else None, skip=r.skip)
    if b is not None and b.head.first_id <= up_to:
        return FlushResult(
            shard.key,
            FlushOutcome.BLOCKED,
            head=b.head,
            blocked_since=b.blocked_since,
            error=b.last_error,
        )
    return None


def show(shard: ShardRef, r: ShardRecord) -> None:
    """Set the current details, and upsert the search attributes that changed (each upsert is a
    history event; none for the idle state of a run about to complete)."""
    describe(shard, r)
    state = r.state
    if state == ShardState.IDLE:
        return
    b = r.blocked
    since = datetime.fromisoformat(b.blocked_since) if b and b.blocked_since else None
    current = workflow.info().typed_search_attributes
    wanted: list[tuple[SearchAttributeKey[Any], Any]] = [
        (STATE_ATTRIBUTE, state.value),
        (BLOCKED_CATEGORY_ATTRIBUTE, b.head.category_name if b else None),
        (BLOCKED_SINCE_ATTRIBUTE, since),
    ]
    changed = [
        key.value_unset() if value is None else key.value_set(value)
        for key, value in wanted
        if current.get(key) != value
    ]
    if changed:
        workflow.upsert_search_attributes(changed)


def headline(r: ShardRecord) -> str:
    """The state and its reason in one line: the summary of what the run waits on."""
    b, current = r.blocked, r.current
    if r.skip is not None:
        # Short: the UI cuts a long label off (the head shows on its cancelled activity).
        skip = r.skip
        return f"skipped by {skip.by or 'an operator'} at {when(skip.at)}: {skip.reason}"
    if b is not None:
        return f"blocked on {b.head.summary} since {when(b.blocked_since)}"
    if isinstance(current, Deferred) and current.paused is not None:
        return f"paused: {_pause_line(current.paused)}"
    if isinstance(current, Deferred):
        return f"deferred until {when(current.deferred_until)}"
    return r.state.value


def describe(shard: ShardRef, r: ShardRecord) -> None:
    # Current details are not carried over continue-as-new; every run sets them again.
    b, current = r.blocked, r.current
    lines = [
        f"**Shard** `{shard.key}` (table `{shard.table}`)",
        f"**State** {r.state.value}",
        f"**Rows handled** {r.rows_handled} in {r.groups_handled} groups",
    ]
    if b is not None:
        lines += _blocked_lines(b)
    if isinstance(current, Deferred) and current.paused is not None:
        lines.append(f"**Paused** {_pause_line(current.paused)}")
    elif isinstance(current, Deferred):
        lines.append(f"**Deferred until** {current.deferred_until}")
    if r.parked:
        lines.append(f"**Parked groups** {len(r.parked)}, set aside until unparked:")
        lines += [
            f"- {g.category_name} object={g.object_identifier}, {g.rows} rows: parked by "
            f"{g.parked_by} at {when(g.parked_at)}: {g.reason}"
            for g in r.parked
        ]
    if r.skip is not None:
        skip = r.skip
        lines.append(f"**Skipped** by {skip.who} at {skip.at}: {skip.reason}")
    if r.refused.summary is not None:
        lines.append(f"**{r.refused.summary}**")
    workflow.set_current_details("\n\n".join(lines))


def _blocked_lines(b: Blocked) -> list[str]:
    lines = [f"**Head group** {b.head.summary}, ids {b.head.first_id}–{b.head.last_id}"]
    if b.last_error is not None:
        lines.append(f"**Attempts** {b.attempts}+, last error `{b.last_error.error_type}`")
    if b.blocked_since is not None:
        lines.append(f"**Blocked since** {b.blocked_since}")
    return lines


def _pause_line(pause: PauseInfo) -> str:
    """``category PROJECT_UPDATE (search down, by ann, since ...)``."""
    since = f"since {when(pause.since)}{until_text(pause.ends_at)}"
    return f"{pause.kind} {pause.name} ({pause.reason}, by {pause.paused_by}, {since})"
