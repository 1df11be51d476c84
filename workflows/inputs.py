"""What the outbox's workflows accept from outside: the documented bounds of every signal and
update input and of the options a run is started with. Anyone with access to the namespace can
send a signal or an update: a validator rejects an update out of bounds (no history event), a
signal handler refuses a signal (nothing applied; the workflow shows it). The bridge and the
command line run the same checks before they send. The bounds accept every input this project's
own code has sent, which keeps the recorded histories replaying.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from enum import Enum
from types import UnionType
from typing import Any, TypeVar, get_args, get_type_hints

from temporalio import workflow
from temporalio.converter import value_to_type

from outbox_bridge.workflows.models import (
    FLUSH_MAX_TIMEOUT_SECONDS,
    FlushInput,
    HandoverInput,
    PartitionOptions,
    PauseChange,
    PausesView,
    Refusals,
    ResumeInput,
    SkipInput,
    when,
)

T = TypeVar("T")

# Operator text (a reason, a name in ``by``), a category's or scope's name, a timestamp.
MAX_TEXT = 1000
# A handler's error message as a handover carries it (the worker cuts it at 2,000 characters
# and says how many more the log has).
MAX_ERROR_TEXT = 4000
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
    """An input outside its documented bounds; the message names the field, value and bounds."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """A number's documented range: ``low`` excluded when ``open_low`` (a positive interval)."""

    low: float
    high: float
    integer: bool = False
    open_low: bool = False

    def text(self) -> str:
        low, high = (f"{n:,.0f}" if n == int(n) else str(n) for n in (self.low, self.high))
        return f"> {low} and ≤ {high}" if self.open_low else f"{low}..{high}"


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
INT32 = Bound(-(2**31), 2**31 - 1, integer=True)
# The longest a timed pause may last (a pause without an end lasts until unpaused).
PAUSE_FOR = Bound(0, 366 * DAY, open_low=True)
# The bound of every number a message carries, by field name.
NUMBERS: dict[str, Bound] = {
    **PARTITION_BOUNDS,
    **SHARD_BOUNDS,
    **dict.fromkeys(("max_id", "first_id", "last_id", "rows"), ID),
    **dict.fromkeys(("category", "number"), INT32),  # a head group's category, a pause's number
    "object_identifier": Bound(-MAX_ID - 1, MAX_ID, integer=True),
    "deferred_seconds": Bound(-1e12, 1e12),  # until a head is due: any time a timestamp names
    "for_seconds": PAUSE_FOR,
}


def check_number(name: str, value: object, bound: Bound) -> None:
    """Raise :class:`InvalidInput` unless ``value`` is a number within ``bound``."""
    if not _is_number(value) or (bound.integer and not isinstance(value, int)):
        wanted = "an integer" if bound.integer else "a number"
        raise InvalidInput(f"{name} must be {wanted} ({bound.text()}), got {_shown(value)}")
    assert isinstance(value, int | float)
    too_low = value <= bound.low if bound.open_low else value < bound.low
    if math.isnan(value) or too_low or value > bound.high:
        raise InvalidInput(f"{name} {_shown(value)} is outside {bound.text()}")


def check_text(name: str, value: object, *, required: bool = False, limit: int = MAX_TEXT) -> None:
    """Raise unless ``value`` is text of at most ``limit`` characters, not blank if ``required``."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be text, got {_shown(value)}")
    if len(value) > limit:
        raise InvalidInput(f"{name} is {len(value):,} characters long, at most {limit:,}")
    if required and not value.strip():
        raise InvalidInput(f"{name} is required (it is shown to every operator)")


def check_fields(model: object, *, required: Collection[str] = (), prefix: str = "") -> None:
    """Check each field of ``model`` as its type says: a number within its bound in
    :data:`NUMBERS`, text within its limit (not blank if named in ``required``), a member of its
    enum, a nested model field by field; None where the type allows it. Lists are their
    checker's own."""
    hints = get_type_hints(type(model))
    for field in dataclasses.fields(model):  # type: ignore[arg-type]
        value, kind = getattr(model, field.name), hints[field.name]
        if isinstance(kind, UnionType):  # X | None
            if value is None:
                continue
            kind = next(t for t in get_args(kind) if t is not type(None))
        _check_field(prefix + field.name, value, kind, required)


def _check_field(name: str, value: object, kind: Any, required: Collection[str]) -> None:
    field = name.rpartition(".")[2]
    if kind is bool and not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {_shown(value)}")
    if kind in (int, float):
        check_number(name, value, NUMBERS[field])
    elif kind is str:
        limit = MAX_ERROR_TEXT if field == "message" else MAX_TEXT
        check_text(name, value, required=name in required, limit=limit)
    elif isinstance(kind, type) and issubclass(kind, Enum) and not isinstance(value, kind):
        raise InvalidInput(f"{name} must be one of {', '.join(kind)}")
    elif dataclasses.is_dataclass(kind):
        check_fields(value, required=required, prefix=f"{name}.")


check_shard_options = check_fields


def check_partition_options(options: PartitionOptions) -> None:
    check_fields(options)
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


def check_skip(skip: SkipInput) -> None:
    if not isinstance(skip.reason, str) or not skip.reason.strip():
        raise InvalidInput("skip needs a reason (it is shown to every operator)")
    check_fields(skip)


def check_resume(resume: ResumeInput | None) -> None:
    if resume is not None:
        check_fields(resume)


def check_handover(handover: HandoverInput) -> None:
    check_fields(handover, required=("head.category_name", "skip.reason"))


def check_flush(flush: FlushInput) -> None:
    up_to, timeout = flush.up_to_id, flush.timeout_seconds
    if not _is_number(up_to) or not isinstance(up_to, int) or not 1 <= up_to <= MAX_ID:
        raise InvalidInput(f"flush needs up_to_id, a positive integer row id; got {_shown(up_to)}")
    if not _is_number(timeout) or not 0 < timeout <= FLUSH_MAX_TIMEOUT_SECONDS:
        raise InvalidInput(
            f"flush needs timeout_seconds between 0 and {FLUSH_MAX_TIMEOUT_SECONDS:.0f}; "
            f"got {_shown(timeout)}"
        )


def check_pause_change(change: PauseChange, *, pausing: bool) -> None:
    if (change.category is None) == (change.scope is None):
        raise InvalidInput("give exactly one of category and scope (a name or a number)")
    check_fields(change, required=("reason",) if pausing else ())
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
        check_fields(pause)


def decode(args: Sequence[Any], model: type[T], check: Callable[[T], None]) -> T:
    """A signal's one argument (as plain JSON values) as ``model``, checked; raises
    :class:`InvalidInput` for anything else (no argument, several, a shape that does not
    convert)."""
    if len(args) != 1:
        raise InvalidInput(f"takes one {model.__name__} argument, got {len(args)}")
    try:
        value: T = value_to_type(model, args[0])
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidInput(f"is not a {model.__name__}: {clipped(str(exc), 80)}") from None
    if isinstance(args[0], dict):
        _check_raw_numbers(args[0], value)
    check(value)
    return value


def _check_raw_numbers(raw: dict[Any, Any], value: object) -> None:
    """The converter turns ``true`` into 1 and 1.5 into 1 for an integer field: refuse both."""
    for name, given in raw.items():
        converted = getattr(value, str(name), None)
        if not _is_number(converted):
            continue
        if not _is_number(given):
            raise InvalidInput(f"{name} must be a number, got {_shown(given)}")
        if isinstance(converted, int) and given != converted:
            raise InvalidInput(f"{name} must be an integer, got {_shown(given)}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def clipped(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters: operator text read from a table (which takes any
    length) as a workflow shows it, or a refused value as a message shows it."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def _shown(value: object) -> str:
    """A refused value, cut short: a huge input cannot fill history."""
    return clipped(repr(value), 80)


def refused(refusals: Refusals, what: str, error: Exception) -> None:
    """Count a refused input in ``refusals`` as its line (``what at <time>: why``), and log it."""
    refusals.count += 1
    refusals.last = f"{what} at {when(workflow.now())}: {clipped(str(error), 300)}"
    workflow.logger.warning("%s refused: %s", workflow.info().workflow_id, refusals.last)


def decoded(
    what: str, args: Sequence[Any], model: type[T], check: Callable[[T], None], refusals: Refusals
) -> T | None:
    """A signal's argument as ``model``, or None when it is refused (and counted)."""
    try:
        return decode(args, model, check)
    except InvalidInput as exc:
        refused(refusals, what, exc)
        return None
