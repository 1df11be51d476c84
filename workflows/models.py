"""Inputs, results, signals and queries of the OutboxShard workflow and its activities.

Everything here ends up in Temporal history, so it carries shard keys, ids, counts and error
classes only, never a payload (the design contract, invariant 7: docs/explanation/contract.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from temporalio.common import SearchAttributeKey

# Custom search attributes of shard workflows (registered by the worker; see
# docs/reference/workflows.md).
SCOPE_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxScope")
SHARD_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxShard")
STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxState")
BLOCKED_CATEGORY_ATTRIBUTE = SearchAttributeKey.for_keyword("OutboxBlockedCategory")
BLOCKED_SINCE_ATTRIBUTE = SearchAttributeKey.for_datetime("OutboxBlockedSince")


@dataclass(frozen=True)
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

    @property
    def hub_key(self) -> tuple[str, str | None, int, int]:
        return (self.table, self.region, self.scope, self.shard_identifier)


@dataclass
class ShardOptions:
    """Tuning handed to every run of a shard workflow (set by the bridge from the settings)."""

    idle_timeout_seconds: float = 0.0
    handler_timeout_seconds: float = 300.0
    heartbeat_timeout_seconds: float = 30.0
    initial_retry_seconds: float = 1.0
    max_retry_interval_seconds: float = 3600.0
    drain_max_groups: int = 1000
    drain_time_budget_seconds: float = 2.0
    max_history_events: int = 10_000
    linger_seconds: float = 0.0
    linger_max_seconds: float = 120.0


@dataclass
class SkipInfo:
    reason: str
    by: str | None = None
    at: str | None = None


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
class ShardCarry:
    """State carried across continue-as-new."""

    max_known_id: int = 0
    highest_seen_id: int = 0
    rows_handled: int = 0
    groups_handled: int = 0
    skip: SkipInfo | None = None
    # Rows kept arriving: the run drains with a lingering activity from the start (set by the
    # bridge for a shard it started or signalled moments ago, and carried across runs).
    traffic: bool = False


@dataclass
class ShardInput:
    shard: ShardRef
    options: ShardOptions = field(default_factory=ShardOptions)
    carry: ShardCarry | None = None


@dataclass
class NotifyInput:
    """Signal ``notify``: rows up to ``max_id`` are committed. ``late`` marks a row that
    committed after rows with higher ids had been announced."""

    max_id: int = 0
    late: bool = False


@dataclass
class SkipInput:
    """Signal ``skip``: pause the shard, keeping every row."""

    reason: str = ""
    by: str | None = None


@dataclass
class ResumeInput:
    """Signal ``resume``: continue a skipped shard; its head is retried at once."""

    by: str | None = None


@dataclass
class DrainInput:
    shard: ShardRef
    max_groups: int = 1000
    time_budget_seconds: float = 2.0
    linger_seconds: float = 0.0
    linger_max_seconds: float = 0.0


@dataclass
class DrainResult:
    """What one drain call did, and why it stopped."""

    groups_handled: int = 0
    rows_handled: int = 0
    highest_seen_id: int = 0
    more: bool = False
    deferred_until: str | None = None
    failed: HeadGroup | None = None
    failure: HandlerFailure | None = None
    lingered_rows: int = 0


@dataclass
class HandleHeadInput:
    """Input of a category activity: handle the head group of the shard if it is this group."""

    shard: ShardRef
    category: int
    object_identifier: int


@dataclass
class HandleHeadResult:
    handled: bool
    rows_handled: int = 0
    last_id: int = 0


@dataclass
class ShardSummary:
    """Result of a shard workflow run that went idle."""

    shard: str
    rows_handled: int
    groups_handled: int


@dataclass
class ShardStatus:
    """Answer of the ``status`` query."""

    shard: str
    state: str
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


# A shard workflow's states (its OutboxState search attribute) ...
DRAINING, BLOCKED, SKIPPED, DEFERRED, IDLE = "draining", "blocked", "skipped", "deferred", "idle"
# ... and the outcomes of a flush: handled, timed out, or the state that stopped it.
HANDLED, TIMED_OUT = "handled", "timed_out"
FLUSH_MAX_TIMEOUT_SECONDS = 3600.0


@dataclass
class FlushInput:
    """Update ``flush``: wait until every row of the shard up to ``up_to_id`` is handled."""

    up_to_id: int = 0
    timeout_seconds: float = 10.0


@dataclass
class FlushResult:
    """Answer of ``flush``: ``handled``; ``blocked`` behind ``head`` (since ``blocked_since``,
    failing with ``error``); ``skipped`` (``skip`` says why); ``deferred`` (the head row is
    scheduled for ``deferred_until``); or ``timed_out``. Only ``handled`` means the rows were
    processed; the others leave them for asynchronous processing, nothing is lost."""

    shard: str
    outcome: str
    head: HeadGroup | None = None
    blocked_since: str | None = None
    error: HandlerFailure | None = None
    skip: SkipInfo | None = None
    deferred_until: str | None = None
    detail: str | None = None  # why Temporal gave no answer (outcome "unavailable")

    @property
    def handled(self) -> bool:
        return self.outcome == HANDLED


@dataclass
class FlushCheckInput:
    """Local activity ``flush_check``: wait until no row of the shard up to ``up_to_id`` is
    pending, or the head of those rows is deferred, for at most ``timeout_seconds``."""

    shard: ShardRef
    up_to_id: int
    timeout_seconds: float


@dataclass
class FlushCheck:
    handled: bool
    deferred_until: str | None = None
