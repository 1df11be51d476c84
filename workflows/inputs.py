"""What the outbox's workflows accept from outside: the documented bounds of every signal and
update input and of the options a run is started with, as pure checks.

Anyone with access to the Temporal namespace can send a signal or an update, so each input is
checked before it is applied: an update's validator rejects it (no history event), a signal
handler refuses it (nothing applied; the workflow shows it). The bridge and the command line run
the same checks before they send, so what they send is never refused. The bounds accept every
input this project's own code has sent, which keeps the recorded histories replaying.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from temporalio.converter import value_to_type

from outbox_bridge.workflows.models import (
    FLUSH_MAX_TIMEOUT_SECONDS,
    FlushInput,
    HandoverInput,
    HeadGroup,
    HeldFor,
    NotifyInput,
    PartitionOptions,
    PauseChange,
    PausesView,
    RecheckInput,
    Refusals,
    ResumeInput,
    ShardOptions,
    SkipInfo,
    SkipInput,
)

T = TypeVar("T")

# Operator text (a reason, a name in ``by``), a category's or scope's name, a timestamp.
MAX_TEXT = 1000
# A handler's error message as a handover carries it (the worker cuts it at 2,000 characters
# and says how many more the log has).
MAX_ERROR_TEXT = 4000
# Seconds until a deferred head is due: any time a timestamp can name.
MAX_DEFERRAL = 1e12
# Shards listed in ``skip_shards``, and the length of each one's workflow id.
MAX_SKIP_SHARDS = 10_000
MAX_WORKFLOW_ID = 1000
# Row ids and counts: PostgreSQL's bigint.
MAX_ID = 2**63 - 1
# Pauses a control workflow shows.
MAX_PAUSES = 10_000
# Longest interval, timeout or delay an option may name (seconds): a day, a week for backoff.
DAY = 86_400.0
WEEK = 7 * DAY


class InvalidInput(ValueError):
    """An input outside its documented bounds; the message names the field, the value and the
    bounds."""


@dataclass(frozen=True)
class Bound:
    """A number's documented range: ``low`` excluded when ``open_low`` (a positive interval)."""

    low: float
    high: float
    integer: bool = False
    open_low: bool = False

    def text(self) -> str:
        high = f"{self.high:,.0f}" if self.high == int(self.high) else str(self.high)
        if self.open_low:
            return f"> 0 and ≤ {high}"
        low = f"{self.low:,.0f}" if self.low == int(self.low) else str(self.low)
        return f"{low}..{high}"


# The bounds of each option, by field name: the reference documents them from here.
PARTITION_BOUNDS: dict[str, Bound] = {
    "round_seconds": Bound(1, 3600),
    "max_shards": Bound(1, 10_000, integer=True),
    "max_groups": Bound(1, 10_000, integer=True),
    "time_budget_seconds": Bound(0, 3600, open_low=True),
    "max_rounds": Bound(1, 64, integer=True),
    "poll_interval_seconds": Bound(0, DAY, open_low=True),
    "rescan_interval_seconds": Bound(0, DAY, open_low=True),
    "heartbeat_timeout_seconds": Bound(0, 3600, open_low=True),
    "max_history_events": Bound(10, 50_000, integer=True),
}
SHARD_BOUNDS: dict[str, Bound] = {
    "handler_timeout_seconds": Bound(0, DAY, open_low=True),
    "heartbeat_timeout_seconds": Bound(0, 3600, open_low=True),
    "initial_retry_seconds": Bound(0, DAY, open_low=True),
    "max_retry_interval_seconds": Bound(0, WEEK, open_low=True),
    "drain_max_groups": Bound(1, 10_000, integer=True),
    "drain_time_budget_seconds": Bound(0, 3600, open_low=True),
    "max_history_events": Bound(10, 50_000, integer=True),
}
ID = Bound(0, MAX_ID, integer=True)
# The longest a timed pause may last (a pause without an end lasts until unpaused).
PAUSE_FOR = Bound(0, 366 * DAY, open_low=True)


def check_number(name: str, value: object, bound: Bound) -> None:
    """Raise :class:`InvalidInput` unless ``value`` is a number within ``bound``."""
    wanted = "an integer" if bound.integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be {wanted} ({bound.text()}), got {_shown(value)}")
    if bound.integer and not isinstance(value, int):
        raise InvalidInput(f"{name} must be {wanted} ({bound.text()}), got {_shown(value)}")
    too_low = value <= bound.low if bound.open_low else value < bound.low
    if math.isnan(value) or too_low or value > bound.high:
        raise InvalidInput(f"{name} {_shown(value)} is outside {bound.text()}")


def check_text(
    name: str,
    value: object,
    *,
    optional: bool = False,
    required: bool = False,
    limit: int = MAX_TEXT,
) -> None:
    """Raise unless ``value`` is text of at most ``limit`` characters (None if ``optional``;
    not blank if ``required``)."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be text, got {_shown(value)}")
    if len(value) > limit:
        raise InvalidInput(f"{name} is {len(value):,} characters long, at most {limit:,}")
    if required and not value.strip():
        raise InvalidInput(f"{name} is required (it is shown to every operator)")


def check_partition_options(options: PartitionOptions) -> None:
    _check_bounds(options, PARTITION_BOUNDS)
    skips = options.skip_shards
    if not isinstance(skips, tuple | list) or len(skips) > MAX_SKIP_SHARDS:
        raise InvalidInput(f"skip_shards must list at most {MAX_SKIP_SHARDS:,} shard workflow ids")
    for shard in skips:
        if (
            not isinstance(shard, str)
            or not shard.startswith("outbox:")
            or len(shard) > MAX_WORKFLOW_ID
        ):
            raise InvalidInput(
                f"skip_shards holds {_shown(shard)}, not a shard workflow id (outbox:<table>:"
                f"<SCOPE>:<id>, at most {MAX_WORKFLOW_ID:,} characters)"
            )


def check_shard_options(options: ShardOptions) -> None:
    _check_bounds(options, SHARD_BOUNDS)


def check_notify(notice: NotifyInput) -> None:
    check_number("max_id", notice.max_id, ID)
    if not isinstance(notice.late, bool):
        raise InvalidInput(f"late must be true or false, got {_shown(notice.late)}")


def check_recheck(recheck: RecheckInput) -> None:
    check_text("reason", recheck.reason)


def check_skip(skip: SkipInput) -> None:
    if not isinstance(skip.reason, str) or not skip.reason.strip():
        raise InvalidInput("skip needs a reason (it is shown to every operator)")
    check_text("reason", skip.reason)
    check_text("by", skip.by, optional=True)


def check_resume(resume: ResumeInput | None) -> None:
    if resume is not None:
        check_text("by", resume.by, optional=True)


def check_handover(handover: HandoverInput) -> None:
    check_number("max_id", handover.max_id, ID)
    if not isinstance(handover.held_for, HeldFor):
        raise InvalidInput(f"held_for must be one of {', '.join(HeldFor)}")
    if handover.head is not None:
        _check_head(handover.head)
    if handover.failure is not None:
        check_text("failure.error_type", handover.failure.error_type)
        check_text("failure.message", handover.failure.message, limit=MAX_ERROR_TEXT)
    check_text("deferred_until", handover.deferred_until, optional=True)
    if handover.deferred_seconds is not None:
        deferral = Bound(-MAX_DEFERRAL, MAX_DEFERRAL)
        check_number("deferred_seconds", handover.deferred_seconds, deferral)
    if handover.skip is not None:
        _check_skip_info(handover.skip)


def check_flush(flush: FlushInput) -> None:
    up_to, timeout = flush.up_to_id, flush.timeout_seconds
    if isinstance(up_to, bool) or not isinstance(up_to, int) or not 1 <= up_to <= MAX_ID:
        raise InvalidInput(f"flush needs up_to_id, a positive integer row id; got {_shown(up_to)}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= FLUSH_MAX_TIMEOUT_SECONDS
    ):
        raise InvalidInput(
            f"flush needs timeout_seconds between 0 and {FLUSH_MAX_TIMEOUT_SECONDS:.0f}; "
            f"got {_shown(timeout)}"
        )


def check_pause_change(change: PauseChange, *, pausing: bool) -> None:
    if (change.category is None) == (change.scope is None):
        raise InvalidInput("give exactly one of category and scope (a name or a number)")
    check_text("category", change.category, optional=True)
    check_text("scope", change.scope, optional=True)
    check_text("reason", change.reason, required=pausing)
    check_text("by", change.by)
    if not (change.category or change.scope or "").strip():
        raise InvalidInput("category or scope is blank: give a name or a number")
    if pausing:
        pause_end(change.for_seconds, change.until)


def pause_end(for_seconds: object, until: object) -> tuple[float | None, datetime | None]:
    """A timed pause's end, checked: seconds from now (within :data:`PAUSE_FOR`) or a time with
    a zone, at most one of them (neither: the pause lasts until unpaused). Whether ``until`` is
    still to come is decided where the clock is read (the worker, the command)."""
    if for_seconds is not None and until is not None:
        raise InvalidInput("give at most one of for_seconds and until")
    if for_seconds is not None:
        check_number("for_seconds", for_seconds, PAUSE_FOR)
        return float(for_seconds), None  # type: ignore[arg-type]
    if until is None:
        return None, None
    check_text("until", until)
    try:
        moment = datetime.fromisoformat(str(until))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise InvalidInput(
            f"until must be an ISO 8601 time with a time zone (2026-12-01T09:00:00Z or "
            f"…+01:00), got {_shown(until)}"
        )
    return None, moment


def check_pauses_view(view: PausesView) -> None:
    if not isinstance(view.pauses, list) or len(view.pauses) > MAX_PAUSES:
        raise InvalidInput(f"pauses must list at most {MAX_PAUSES:,} pauses")
    for pause in view.pauses:
        check_number("number", pause.number, Bound(-(2**31), 2**31 - 1, integer=True))
        for name in ("name", "reason", "paused_by", "since"):
            check_text(name, getattr(pause, name))
        check_text("paused_via", pause.paused_via, optional=True)
        check_text("ends_at", pause.ends_at, optional=True)


def clipped(text: str) -> str:
    """``text`` cut to :data:`MAX_TEXT` characters: operator text read from a table (which
    takes any length) as a workflow is shown it."""
    return text if len(text) <= MAX_TEXT else f"{text[: MAX_TEXT - 1]}…"


def decode(args: Sequence[Any], model: type[T], check: Callable[[T], None]) -> T:
    """A signal's one argument (as plain JSON values) as ``model``, checked; raises
    :class:`InvalidInput` for anything else (no argument, several, a shape that does not
    convert)."""
    if len(args) != 1:
        raise InvalidInput(f"takes one {model.__name__} argument, got {len(args)}")
    try:
        value: T = value_to_type(model, args[0])
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidInput(f"is not a {model.__name__}: {_clip(str(exc))}") from None
    if isinstance(args[0], dict):
        _check_raw_numbers(args[0], value)
    check(value)
    return value


def _check_raw_numbers(raw: dict[Any, Any], value: object) -> None:
    """The converter turns ``true`` into 1 and 1.5 into 1 for an integer field: refuse both."""
    for name, given in raw.items():
        converted = getattr(value, str(name), None)
        if isinstance(converted, bool) or not isinstance(converted, int | float):
            continue
        if isinstance(given, bool) or not isinstance(given, int | float):
            raise InvalidInput(f"{name} must be a number, got {_shown(given)}")
        if isinstance(converted, int) and given != converted:
            raise InvalidInput(f"{name} must be an integer, got {_shown(given)}")


def _check_bounds(options: object, bounds: dict[str, Bound]) -> None:
    for name, bound in bounds.items():
        check_number(name, getattr(options, name), bound)


def _check_head(head: HeadGroup) -> None:
    check_number("head.category", head.category, Bound(-(2**31), 2**31 - 1, integer=True))
    check_text("head.category_name", head.category_name, required=True)
    for name in ("object_identifier",):
        check_number(f"head.{name}", getattr(head, name), Bound(-MAX_ID - 1, MAX_ID, integer=True))
    for name in ("first_id", "last_id", "rows"):
        check_number(f"head.{name}", getattr(head, name), ID)


def _check_skip_info(skip: SkipInfo) -> None:
    check_text("skip.reason", skip.reason, required=True)
    check_text("skip.by", skip.by, optional=True)
    check_text("skip.at", skip.at, optional=True)


def _shown(value: object) -> str:
    """A refused value as a message shows it: cut short, so a huge input cannot fill history."""
    return _clip(repr(value))


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def note_refusal(refusals: Refusals, what: str, at: datetime, error: Exception) -> str:
    """Count a refused signal in ``refusals`` and return its line: ``what at <time>: why``."""
    when = at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    line = f"{what} at {when}: {_clip(str(error), 300)}"
    refusals.count += 1
    refusals.last = line
    return line
