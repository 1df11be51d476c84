"""Inputs, results, signals and queries of the outbox's workflows and their activities.

Everything here ends up in Temporal history, so it carries shard keys, ids, counts and error
classes only, never a payload (the design contract, invariant 7: docs/explanation/contract.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

from temporalio.common import SearchAttributeKey

# Custom search attributes of shard workflows (registered by the worker).
SCOPE_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxScope")
# Not "OutboxShard": the Temporal UI reads a search attribute named like a workflow type as
# that type, and a query that combines them finds nothing.
SHARD_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxShardKey")
STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxState")
BLOCKED_CATEGORY_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxBlockedCategory")
BLOCKED_SINCE_ATTRIBUTE = SearchAttributeKey.for_datetime("OutboxBlockedSince")


class ShardState(StrEnum):
    """A shard workflow's state: its ``OutboxState`` search attribute and ``status`` answer."""

    DRAINING = "draining"
    BLOCKED = "blocked"  # a handler failed; its category activity is being retried
    SKIPPED = "skipped"  # paused by an operator: nothing runs, every row is kept
    DEFERRED = "deferred"  # the head row is scheduled later; the shard waits for it
    IDLE = "idle"


class FlushOutcome(StrEnum):
    """How a flush ended: the rows were handled, or why not (they stay and run later)."""

    HANDLED = "handled"
    BLOCKED = "blocked"
    SKIPPED = "skipped"
    DEFERRED = "deferred"
    TIMED_OUT = "timed_out"
    UNAVAILABLE = "unavailable"  # Temporal did not answer


class HeldFor(StrEnum):
    """Why a shard's own workflow holds it (partitions leave a held shard alone)."""

    FAILED = "failed"  # a handler failed: the category activity retries it
    DEFERRED = "deferred"  # its head row is scheduled later: a durable timer waits
    SKIPPED = "skipped"  # an operator (or the skip_shards setting) paused it
    WORKFLOW = "workflow"  # its workflow runs for another reason (a flush, a restart, ...)


@dataclass(frozen=True, slots=True)
class ShardRef:
    """Which shard: the table, the scope (value and name), the identifier, and the region."""

    table: str
    scope: int
    scope_name: str
    shard_identifier: int
    region: str | None = None

    @property
    def key(self) -> str:
        """The shard as operators name it: ``SCOPE:ID`` or ``REGION:SCOPE:ID``."""
        prefix = f"{self.region}:" if self.region is not None else ""
        return f"{prefix}{self.scope_name}:{self.shard_identifier}"

    @property
    def workflow_id(self) -> str:
        return f"outbox:{self.table}:{self.key}"


@dataclass
class ShardOptions:
    """Tuning handed to every run of a shard workflow (set from the worker's settings)."""

    handler_timeout_seconds: float = 300.0
    heartbeat_timeout_seconds: float = 30.0
    initial_retry_seconds: float = 1.0
    max_retry_interval_seconds: float = 3600.0
    drain_max_groups: int = 1000
    drain_time_budget_seconds: float = 2.0
    max_history_events: int = 10_000


def via_text(via: str | None) -> str:
    """Who Temporal recorded as the sender, beside the declared name: `` (via temporal:ann)``."""
    return f" (via {via})" if via else ""


def when(moment: datetime | str | None) -> str:
    """A time as the UI's reader wants it: to the second, in UTC (``?`` when unknown)."""
    if moment is None:
        return "?"
    moment = datetime.fromisoformat(moment) if isinstance(moment, str) else moment
    moment = moment.astimezone(UTC) if moment.tzinfo is not None else moment
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def until_text(ends_at: str | None) -> str:
    """When a timed pause ends, as its details show it: ``, until 2026-12-01 09:00:00 UTC``."""
    return "" if ends_at is None else f", until {when(ends_at)}"


@dataclass
class SkipInfo:
    """Why a shard is skipped: ``by`` as the sender declared it, ``via`` as Temporal recorded it."""

    reason: str
    by: str | None = None
    at: str | None = None
    via: str | None = None

    @property
    def who(self) -> str:
        return f"{self.by or 'an operator'}{via_text(self.via)}"


@dataclass
class Refusals:
    """Signals a workflow refused (nothing of them was applied): how many, and the last one."""

    count: int = 0
    last: str | None = None

    @property
    def summary(self) -> str | None:
        if not self.count:
            return None
        plural = "s" if self.count > 1 else ""
        return f"Refused {self.count} signal{plural}; last: {self.last}"


@dataclass
class HandlerFailure:
    """Why a head group failed: the exception class, and its message unless redacted."""

    error_type: str
    message: str = ""


@dataclass
class HeadGroup:
    """A coalescing group at the head of a shard: handled once, with its newest row."""

    category: int
    category_name: str
    object_identifier: int
    first_id: int
    last_id: int
    rows: int

    @property
    def summary(self) -> str:
        coalesced = f" (×{self.rows} coalesced)" if self.rows > 1 else ""
        return f"{self.category_name} object={self.object_identifier}{coalesced}"


@dataclass
class ParkedNote:
    """A parked group of a shard, as its workflow shows it: operator text and ids, no payload."""

    category_name: str
    object_identifier: int
    reason: str
    parked_by: str
    parked_at: str
    rows: int = 0


# What a shard workflow knows: its counts, and one state of a tagged union; each state carries
# its own fields, and its tag (``state``) names it in the input of the run it continues as.


@dataclass
class Draining:
    """Rows may be due: the next step drains."""

    state: Literal["draining"] = "draining"


@dataclass
class Idle:
    """Empty, and given back by the last drain: the run completes."""

    state: Literal["idle"] = "idle"


@dataclass
class Blocked:
    """A failing head group, retried as its category activity until it succeeds."""

    head: HeadGroup
    attempts: int = 1  # calls of the head so far, the partition's first one included
    last_error: HandlerFailure | None = None
    blocked_since: str | None = None
    retry_interval_seconds: float | None = None  # where the backoff stands
    next_attempt_at: str | None = None  # when the backoff scheduled the next attempt
    state: Literal["blocked"] = "blocked"


@dataclass
class Deferred:
    """A head row scheduled later: when it is due, and in how long by the database's clock."""

    deferred_until: str
    deferred_seconds: float | None = None
    paused: PauseInfo | None = None  # the pause the deferred head waits for, if it is paused
    state: Literal["deferred"] = "deferred"


@dataclass
class Skipped:
    """Paused by an operator: nothing runs. ``recorded`` once the owner table says skipped;
    ``before``, the state it paused, still changes on what arrives (news, a handover)."""

    skip: SkipInfo
    before: Draining | Idle | Blocked | Deferred = field(default_factory=Draining)
    recorded: bool = False
    state: Literal["skipped"] = "skipped"


@dataclass
class Resumed:
    """Resumed while the owner table still says skipped: taken back, then drained."""

    state: Literal["resumed"] = "resumed"


Phase = Draining | Idle | Blocked | Deferred
ShardPhase = Phase | Skipped | Resumed


@dataclass
class ShardRecord:
    """Everything a shard workflow knows, carried whole across continue-as-new."""

    max_known_id: int = 0  # the highest row id it was told of
    highest_seen_id: int = 0  # the highest row id its drains read
    rows_handled: int = 0
    groups_handled: int = 0
    parked: list[ParkedNote] = field(default_factory=list)  # as the last drain read them
    refused: Refusals = field(default_factory=Refusals)  # signals it did not apply
    phase: ShardPhase = field(default_factory=Draining)

    @property
    def current(self) -> Phase:
        """The state under a skip (the state itself otherwise; resumed is draining)."""
        phase = self.phase
        if isinstance(phase, Skipped):
            return phase.before
        return Draining() if isinstance(phase, Resumed) else phase

    @property
    def blocked(self) -> Blocked | None:
        current = self.current
        return current if isinstance(current, Blocked) else None

    @property
    def skip(self) -> SkipInfo | None:
        return self.phase.skip if isinstance(self.phase, Skipped) else None

    @property
    def state(self) -> ShardState:
        return ShardState.SKIPPED if self.skip is not None else ShardState(self.current.state)

    def become(self, phase: Phase) -> None:
        """Move to ``phase``; under a skip, the skipped state changes instead."""
        if isinstance(self.phase, Skipped):
            self.phase.before = phase
        else:
            self.phase = phase


@dataclass(kw_only=True)
class CarriedRecord(ShardRecord):
    """The flat record older runs carry (and the recorded histories start with), read once."""

    pending: bool  # required: the mark of the flat record
    skip: SkipInfo | None = None
    skip_held: bool = False
    head: HeadGroup | None = None
    attempts: int = 0
    last_error: HandlerFailure | None = None
    blocked_since: str | None = None
    retry_interval_seconds: float | None = None
    next_attempt_at: str | None = None
    deferred_until: str | None = None
    deferred_seconds: float | None = None
    paused: PauseInfo | None = None

    def upgraded(self) -> ShardRecord:
        phase: ShardPhase
        if self.head is not None:
            phase = Blocked(self.head, self.attempts, self.last_error, self.blocked_since)
            phase.retry_interval_seconds = self.retry_interval_seconds
            phase.next_attempt_at = self.next_attempt_at
        elif self.pending:
            phase = Draining()
        elif self.deferred_until is not None:
            phase = Deferred(self.deferred_until, self.deferred_seconds, self.paused)
        else:
            phase = Idle()
        if self.skip is not None:
            phase = Skipped(self.skip, phase, recorded=self.skip_held)
        elif self.skip_held:
            phase = Resumed()
        counts = (self.max_known_id, self.highest_seen_id, self.rows_handled, self.groups_handled)
        return ShardRecord(*counts, self.parked, self.refused, phase)


# The generation of the workflow code a run was started by, in its memo (MEMO_CODE_KEY): runs
# of an older generation cannot be replayed by this code (``outbox-bridge upgrade-check``).
WORKFLOW_CODE = 1
MEMO_CODE_KEY = "outbox-bridge-workflow-code"


@dataclass
class ShardInput:
    shard: ShardRef
    options: ShardOptions = field(default_factory=ShardOptions)
    record: CarriedRecord | ShardRecord | None = None

    def carried(self) -> ShardRecord:
        """The record carried in (upgraded if older code carried it), or a new one."""
        if isinstance(self.record, CarriedRecord):
            return self.record.upgraded()
        return self.record or ShardRecord()


@dataclass
class NotifyInput:
    """``late``: a row committed after rows with higher ids had been announced."""

    max_id: int = 0
    late: bool = False


@dataclass
class RecheckInput:
    reason: str = ""


@dataclass
class SkipInput:
    reason: str = ""
    by: str | None = None


@dataclass
class ResumeInput:
    by: str | None = None


@dataclass
class HandoverInput:
    """What the partition found: the failed head and its failure, a deferred head, or a skip."""

    max_id: int = 0
    held_for: HeldFor = HeldFor.WORKFLOW
    head: HeadGroup | None = None
    failure: HandlerFailure | None = None
    deferred_until: str | None = None
    deferred_seconds: float | None = None
    skip: SkipInfo | None = None


@dataclass
class DrainInput:
    shard: ShardRef
    max_groups: int = 1000
    time_budget_seconds: float = 2.0


@dataclass
class HoldInput:
    """To skipped (``held_for`` skipped, with the ``skip``), or back to held by the workflow."""

    shard: ShardRef
    held_for: HeldFor = HeldFor.WORKFLOW
    wait_seconds: float = 30.0
    skip: SkipInfo | None = None


@dataclass
class DrainResult:
    """What one drain did, and why it stopped."""

    groups_handled: int = 0
    rows_handled: int = 0
    highest_seen_id: int = 0
    more: bool = False
    deferred_until: str | None = None
    failed: HeadGroup | None = None
    failure: HandlerFailure | None = None
    released: bool = False  # the shard was empty and went back to its partition
    deferred_seconds: float | None = None  # by the database's clock, when deferred_until is set
    paused: PauseInfo | None = None  # the pause that holds the deferred head, if one does
    parked: list[ParkedNote] = field(default_factory=list)  # the shard's parked groups


@dataclass
class HandleHeadInput:
    """Handle the shard's head group if it is this one; calls of it so far: ``prior_attempts``."""

    shard: ShardRef
    category: int
    object_identifier: int
    prior_attempts: int = 0


@dataclass
class HandleHeadResult:
    handled: bool
    rows_handled: int = 0
    last_id: int = 0


@dataclass
class ShardSummary:
    shard: str
    rows_handled: int
    groups_handled: int


@dataclass
class ShardStatus:
    """Answer of the ``status`` query."""

    shard: str
    state: ShardState
    max_known_id: int
    highest_seen_id: int
    rows_handled: int
    groups_handled: int
    head: HeadGroup | None = None
    attempts: int = 0
    last_error: HandlerFailure | None = None
    blocked_since: str | None = None
    deferred_until: str | None = None
    skip: SkipInfo | None = None
    refused: Refusals | None = None


FLUSH_MAX_TIMEOUT_SECONDS = 3600.0


@dataclass
class FlushInput:
    up_to_id: int = 0
    timeout_seconds: float = 10.0


@dataclass
class FlushResult:
    """Only ``handled`` means the rows were processed; every other outcome leaves them for
    asynchronous processing (nothing is lost), with the fields that say why."""

    shard: str
    outcome: FlushOutcome
    head: HeadGroup | None = None
    blocked_since: str | None = None
    error: HandlerFailure | None = None
    skip: SkipInfo | None = None
    deferred_until: str | None = None
    detail: str | None = None  # why Temporal gave no answer (outcome "unavailable")
    paused: PauseInfo | None = None  # the pause a ``deferred`` head waits for

    @property
    def handled(self) -> bool:
        return self.outcome == FlushOutcome.HANDLED


def flush_queue(task_queue: str) -> str:
    """The task queue of the activities that wait for a flush: the workers of ``task_queue``
    poll it too, with slots of its own."""
    return f"{task_queue}.flush"


@dataclass
class FlushCheckInput:
    shard: ShardRef
    up_to_id: int
    timeout_seconds: float


@dataclass
class FlushCheck:
    handled: bool
    deferred_until: str | None = None
    paused: PauseInfo | None = None  # the pause the not-due head waits for, if it is paused


class PauseKind(StrEnum):
    """What a pause covers: one category (in every scope), or every row of one scope."""

    CATEGORY = "category"
    SCOPE = "scope"


@dataclass
class PauseInfo:
    """A pause as the control workflow shows it (operator text and numbers, no payload)."""

    kind: PauseKind
    number: int
    name: str  # the category's or scope's name in the worker's app, else its number
    reason: str
    paused_by: str
    since: str
    paused_via: str | None = None  # the update's sender as Temporal recorded it
    ends_at: str | None = None  # when a timed pause ends by itself (ISO 8601, UTC)


@dataclass
class PauseChange:
    """Exactly one of ``category`` and ``scope`` (a name or a number, as text); a timed pause
    ends ``for_seconds`` after it is made, or at ``until`` (ISO 8601 with a time zone)."""

    category: str | None = None
    scope: str | None = None
    reason: str = ""
    by: str = ""
    for_seconds: float | None = None
    until: str | None = None


@dataclass
class PauseChangeInput:
    table: str
    change: PauseChange
    paused: bool  # pause, else resume
    update_id: str | None = None  # whose sender the activity looks up in the run's history


@dataclass
class PausesView:
    """The table's pauses: the result of the updates, and the ``refresh`` signal the bridge
    sends when they changed outside the workflow (the command line, SQL)."""

    pauses: list[PauseInfo] = field(default_factory=list)


@dataclass
class ControlInput:
    table: str
    view: PausesView = field(default_factory=PausesView)


@dataclass(frozen=True)
class PartitionRef:
    """One of a table's partitions: it drains the healthy shards that hash to it."""

    table: str
    partition: int
    partitions: int
    regions: tuple[str, ...] | None = None  # only rows of these regions (regional tables)

    @property
    def workflow_id(self) -> str:
        scope = f":{'+'.join(self.regions)}" if self.regions else ""
        return f"outbox:{self.table}:partition:{self.partition}{scope}"


@dataclass
class PartitionOptions:
    """Tuning of a partition workflow and its drain (set by the bridge from the settings)."""

    # One drain activity runs this long, then reports: an idle partition costs about 6 history
    # events per round.
    round_seconds: float = 300.0
    max_shards: int = 200  # shards locked and read together in one round
    # Groups of one shard per round (more when the round has fewer shards): a round's
    # unhandled reads are thrown away.
    max_groups: int = 10
    time_budget_seconds: float = 2.0  # a round takes no new group after this
    max_rounds: int = 4  # rounds in flight at once (a slow shard holds only its own round)
    poll_interval_seconds: float = 1.0  # scan for rows above the newest id seen
    rescan_interval_seconds: float = 30.0  # scan every shard (late commits, missed news)
    heartbeat_timeout_seconds: float = 30.0
    max_history_events: int = 2000
    skip_shards: tuple[str, ...] = ()  # workflow ids of shards that start skipped


@dataclass
class PartitionCarry:
    """A partition's totals, carried across continue-as-new."""

    rows_handled: int = 0
    groups_handled: int = 0
    handed_over: int = 0
    rounds: int = 0
    refused: Refusals = field(default_factory=Refusals)  # signals it did not apply


@dataclass
class PartitionInput:
    partition: PartitionRef
    options: PartitionOptions = field(default_factory=PartitionOptions)
    carry: PartitionCarry | None = None


@dataclass
class ShardBacklog:
    """A shard in a partition's backlog, for its details: pending rows, oldest row's age."""

    shard: str
    rows: int
    age_seconds: float


# The distinct shards a drain counts at most (it keeps each one it counts): past this many, its
# round reports "at least" as many, in bounded memory however wide the outbox.
SHARDS_COUNTED = 10_000


@dataclass
class PartitionRound:
    """What one drain activity of a partition did (its result, and its heartbeat details)."""

    rows_handled: int = 0
    groups_handled: int = 0
    shards_drained: int = 0  # distinct shards, counted up to SHARDS_COUNTED ("at least" then)
    handed_over: int = 0
    seconds: float = 0.0
    queued: int = 0  # shards waiting when it ended
    deepest: list[ShardBacklog] = field(default_factory=list)
    oldest: list[ShardBacklog] = field(default_factory=list)
    # The table's rate-limited categories whose calls waited for a token in this worker then:
    # ``ORGANIZATION_UPDATE 100/s: 3 waiting`` (calls).
    rate_limited: list[str] = field(default_factory=list)


@dataclass
class PartitionDrainInput:
    partition: PartitionRef
    options: PartitionOptions


@dataclass(kw_only=True)
class PartitionStatus(PartitionCarry):
    """Answer of a partition's ``status`` query: its totals, and the last round."""

    partition: str
    last_round: PartitionRound | None = None
    options: PartitionOptions | None = None  # what its drains run with
