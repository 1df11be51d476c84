"""What an in-process drain did (:func:`~outbox_bridge.testing.drain_outbox`'s report), and the
error it raises when a handler fails."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from outbox_bridge.errors import OutboxError
from outbox_bridge.registry import OutboxMessage


@dataclass(frozen=True)
class DrainFailure:
    """A handler that raised (or a row without a handler): the shard stopped there, and the
    rows of the group are kept."""

    table: str
    shard: str  # SCOPE:ID, or REGION:SCOPE:ID
    category: str
    message: OutboxMessage  # the row the handler was given: the newest of its group
    row_ids: tuple[int, ...]  # every row of the group, all kept
    error: Exception

    def __str__(self) -> str:
        coalesced = f", {len(self.row_ids)} rows coalesced" if len(self.row_ids) > 1 else ""
        return (
            f"the handler of {self.category} failed on row {self.message.id} of {self.table} "
            f"(shard {self.shard}, object {self.message.object_identifier}{coalesced}): "
            f"{type(self.error).__qualname__}: {self.error}"
        )


@dataclass
class ShardReport:
    """What a drain did in one shard, and why it stopped if rows are left."""

    table: str
    shard: str  # SCOPE:ID, or REGION:SCOPE:ID
    messages: list[OutboxMessage] = field(default_factory=list)  # handled, in order
    rows_deleted: int = 0
    deferred_until: datetime | None = None  # the shard waits for a row not due yet
    failure: DrainFailure | None = None  # the shard stopped at this failure
    skipped: bool = False  # skipped by an operator: left alone

    @property
    def handled(self) -> int:
        """Handler calls that succeeded (one per coalescing group)."""
        return len(self.messages)

    @property
    def coalesced(self) -> int:
        """Rows deleted without a call of their own: older rows of a handled group."""
        return self.rows_deleted - self.handled

    @property
    def ids(self) -> list[int]:
        """The ids of the rows the handlers were given, in order."""
        return [message.id for message in self.messages]


@dataclass
class DrainReport:
    """What :func:`drain_outbox` did: one :class:`ShardReport` per shard that had rows, in the
    order the shards were drained."""

    shards: list[ShardReport] = field(default_factory=list)

    @property
    def handled(self) -> int:
        """Handler calls that succeeded, in every shard."""
        return sum(report.handled for report in self.shards)

    @property
    def coalesced(self) -> int:
        """Rows deleted without a handler call of their own, in every shard."""
        return sum(report.coalesced for report in self.shards)

    @property
    def rows_deleted(self) -> int:
        return sum(report.rows_deleted for report in self.shards)

    @property
    def messages(self) -> list[OutboxMessage]:
        """Every message handled, shard after shard."""
        return [message for report in self.shards for message in report.messages]

    @property
    def failures(self) -> list[DrainFailure]:
        return [report.failure for report in self.shards if report.failure is not None]

    def shard(self, name: str, *, table: str | None = None) -> ShardReport:
        """The report of shard ``name`` (``SCOPE:ID``; of ``table`` when the app has several
        with that shard). Raises ``KeyError`` if the drain found no row there."""
        for report in self.shards:
            if report.shard == name and table in (None, report.table):
                return report
        raise KeyError(f"the drain found no row in shard {name}")


class HandlerFailedError(OutboxError):
    """A handler raised during :func:`drain_outbox`: the handler's exception is its cause, the
    failed row is ``failure.message``, and ``report`` says what was handled before."""

    def __init__(self, failure: DrainFailure, report: DrainReport) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.report = report
