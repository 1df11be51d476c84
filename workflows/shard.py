"""The OutboxShard workflow: one per active shard, running its handlers one at a time.

The workflow holds no rows, only ids and counts. It drains with a local activity while handlers
succeed, switches to a server-retried category activity when one fails (so the UI shows which
category is stuck), sleeps on a durable timer while the head row is deferred, and completes
after an idle period; the bridge starts it again when rows arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from outbox_bridge.workflows.models import (
        BLOCKED,
        BLOCKED_CATEGORY_ATTRIBUTE,
        BLOCKED_SINCE_ATTRIBUTE,
        DEFERRED,
        DRAINING,
        FLUSH_MAX_TIMEOUT_SECONDS,
        HANDLED,
        IDLE,
        SKIPPED,
        STATE_ATTRIBUTE,
        TIMED_OUT,
        DrainInput,
        DrainResult,
        FlushCheck,
        FlushCheckInput,
        FlushInput,
        FlushResult,
        HandleHeadInput,
        HandleHeadResult,
        HandlerFailure,
        HeadGroup,
        NotifyInput,
        ResumeInput,
        ShardCarry,
        ShardInput,
        ShardStatus,
        ShardSummary,
        SkipInfo,
        SkipInput,
    )

T = TypeVar("T")
V = TypeVar("V", str, datetime)

# Retries of the local drain before it falls back to a normal (visible, server-retried) one.
LOCAL_DRAIN_ATTEMPTS = 3
# Rows arriving after the first drain are drained by a lingering normal activity.
LINGER_ACTIVITY_PATCH = "linger-activity"
# A local drain's final failure is caught as an ApplicationError too.
LOCAL_DRAIN_FALLBACK_PATCH = "local-drain-fallback"
# The state is kept in search attributes (OutboxState, OutboxBlockedCategory, ...).
STATE_ATTRIBUTES_PATCH = "state-search-attributes"


@workflow.defn(name="OutboxShard")
class OutboxShard:
    @workflow.init
    def __init__(self, input: ShardInput) -> None:
        self._shard = input.shard
        self._options = input.options
        carry = input.carry or ShardCarry()
        self._max_known_id = carry.max_known_id
        self._highest_seen_id = carry.highest_seen_id
        self._rows_handled = carry.rows_handled
        self._groups_handled = carry.groups_handled
        self._skip: SkipInfo | None = carry.skip
        # A run starts because rows exist (or carried on from a run that had some).
        self._dirty = True
        # Set when rows arrive after this run's first drain: traffic is steady, so linger.
        self._drained = False
        self._traffic = carry.traffic
        self._state = DRAINING
        self._head: HeadGroup | None = None
        self._attempts = 0
        self._last_error: HandlerFailure | None = None
        self._blocked_since: datetime | None = None
        self._deferred_until: datetime | None = None

    # -- main loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: ShardInput) -> ShardSummary:
        self._publish()
        while True:
            if self._may_continue_as_new():
                workflow.continue_as_new(
                    ShardInput(shard=self._shard, options=self._options, carry=self._carry())
                )
            if self._skip is not None:
                await self._stay_skipped()
            elif self._dirty:
                await self._drain_once()
            elif self._deferred_until is not None:
                await self._wait_for_deferred()
            elif not workflow.all_handlers_finished():
                # A flush is waiting for its answer: stay, and drain if rows arrive meanwhile.
                await workflow.wait_condition(
                    lambda: (
                        workflow.all_handlers_finished() or self._dirty or self._skip is not None
                    )
                )
            elif await self._idle_expired():
                return ShardSummary(self._shard.key, self._rows_handled, self._groups_handled)

    def _flush_answered_or_work(self) -> bool:
        return workflow.all_handlers_finished() or self._dirty or self._skip is not None

    def _may_continue_as_new(self) -> bool:
        """The history is long enough to continue as new, and no flush is waiting. (Waiting
        for flushes instead, with draining stopped, would deadlock them: they wait for rows
        to be handled.)"""
        info = workflow.info()
        due = (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._options.max_history_events
        )
        return due and workflow.all_handlers_finished()

    async def _stay_skipped(self) -> None:
        self._set_state(SKIPPED)
        await workflow.wait_condition(lambda: self._skip is None or self._may_continue_as_new())
        if self._skip is None:
            self._dirty = True  # resuming retries the head at once

    async def _wait_for_deferred(self) -> None:
        assert self._deferred_until is not None
        self._set_state(DEFERRED)
        remaining = (self._deferred_until - workflow.now()).total_seconds()
        if remaining > 0:
            try:
                await workflow.wait_condition(
                    lambda: self._dirty or self._skip is not None,
                    timeout=timedelta(seconds=remaining),
                )
                return
            except TimeoutError:
                pass
        self._deferred_until = None
        self._dirty = True

    async def _idle_expired(self) -> bool:
        self._set_state(IDLE)
        if self._options.idle_timeout_seconds <= 0:
            # Complete as soon as the shard is empty: a signal that races the completion fails
            # this task and is replayed first; a later one starts a new run.
            return True
        try:
            await workflow.wait_condition(
                lambda: self._dirty or self._skip is not None or self._may_continue_as_new(),
                timeout=timedelta(seconds=self._options.idle_timeout_seconds),
            )
        except TimeoutError:
            # A signal that races the completion fails this task and is replayed first, so
            # returning here never drops work.
            return not self._dirty and self._skip is None
        return False

    # -- draining --------------------------------------------------------------------------

    async def _drain_once(self) -> None:
        self._dirty = False
        self._deferred_until = None
        # Resumed after a skip: the head that blocked is retried from scratch (if it fails
        # again, the shard is blocked again, since then).
        self._head = None
        self._attempts = 0
        self._last_error = None
        self._blocked_since = None
        self._set_state(DRAINING)
        result = await self._drain()
        if result is None:  # skipped while draining
            self._dirty = True
            return
        self._drained = True
        self._count(result.rows_handled, result.groups_handled)
        self._highest_seen_id = max(self._highest_seen_id, result.highest_seen_id)
        if result.failed is not None:
            await self._unblock(result.failed, result.failure)
            self._dirty = True
            return
        if result.more or result.lingered_rows:
            # Rows kept coming while the drain lingered: linger again rather than go idle.
            self._dirty = True
        elif result.deferred_until is not None:
            self._deferred_until = datetime.fromisoformat(result.deferred_until)

    async def _drain(self) -> DrainResult | None:
        if (
            self._traffic
            and self._options.linger_seconds > 0
            and workflow.patched(LINGER_ACTIVITY_PATCH)
        ):
            lingered = await self._linger()
            if lingered is not None or self._skip is not None:
                return lingered
        request = DrainInput(
            shard=self._shard,
            max_groups=self._options.drain_max_groups,
            time_budget_seconds=self._options.drain_time_budget_seconds,
        )
        options = self._options
        timeout = timedelta(
            seconds=options.handler_timeout_seconds + options.drain_time_budget_seconds
        )
        try:
            local = workflow.start_local_activity(
                "drain_shard",
                request,
                result_type=DrainResult,
                start_to_close_timeout=timeout,
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=self._options.initial_retry_seconds),
                    maximum_interval=timedelta(seconds=10),
                    maximum_attempts=LOCAL_DRAIN_ATTEMPTS,
                ),
            )
            return await self._unless_skipped(local)
        except (ActivityError, ApplicationError):
            # The database or the shard lock kept failing: drain with a normal activity, which
            # the server retries without adding history and the UI shows as pending. (A local
            # activity's last failure reaches the workflow as the ApplicationError itself;
            # before this was caught, it failed the run and the bridge had to start another.)
            if not workflow.patched(LOCAL_DRAIN_FALLBACK_PATCH):
                raise
            remote = workflow.start_activity(
                "drain_shard",
                request,
                result_type=DrainResult,
                start_to_close_timeout=timeout,
                retry_policy=self._retry_policy(),
                cancellation_type=ActivityCancellationType.TRY_CANCEL,
                summary=f"drain {self._shard.key}",
            )
            return await self._unless_skipped(remote)

    async def _linger(self) -> DrainResult | None:
        """Rows keep arriving: drain with a normal activity that stays for the next rows, so
        steady traffic costs a handful of events per linger period instead of several per
        row. Its heartbeats add no history; a skip cancels it."""
        options = self._options
        request = DrainInput(
            shard=self._shard,
            max_groups=options.drain_max_groups,
            time_budget_seconds=options.drain_time_budget_seconds,
            linger_seconds=options.linger_seconds,
            linger_max_seconds=options.linger_max_seconds,
        )
        handle = workflow.start_activity(
            "linger_shard",
            request,
            result_type=DrainResult,
            start_to_close_timeout=timedelta(
                seconds=options.linger_max_seconds
                + options.handler_timeout_seconds
                + options.drain_time_budget_seconds
            ),
            heartbeat_timeout=timedelta(seconds=options.heartbeat_timeout_seconds),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=options.initial_retry_seconds),
                maximum_attempts=LOCAL_DRAIN_ATTEMPTS,
            ),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
            summary=f"linger {self._shard.key}",
        )
        try:
            return await self._unless_skipped(handle)
        except ActivityError:
            return None  # fall back to the local drain and its own fallback

    async def _unblock(self, head: HeadGroup, failure: HandlerFailure | None) -> None:
        """Retry the failed head group as a category activity until it succeeds or the shard is
        skipped."""
        self._head = head
        self._attempts = 1
        self._last_error = failure
        self._blocked_since = workflow.now()
        self._set_state(BLOCKED)
        handle = workflow.start_activity(
            head.category_name,
            HandleHeadInput(self._shard, head.category, head.object_identifier),
            result_type=HandleHeadResult,
            start_to_close_timeout=timedelta(seconds=self._options.handler_timeout_seconds),
            heartbeat_timeout=timedelta(seconds=self._options.heartbeat_timeout_seconds),
            retry_policy=self._retry_policy(),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
            summary=head.summary,
        )
        result = await self._unless_skipped(handle)
        if result is None:
            return  # skipped: keep showing what blocked the shard
        if result.handled:
            self._count(result.rows_handled, 1)
        self._head = None
        self._attempts = 0
        self._last_error = None
        self._blocked_since = None
        self._set_state(DRAINING)

    async def _unless_skipped(self, handle: ActivityHandle[T]) -> T | None:
        """Await ``handle``; a skip cancels it (TRY_CANCEL: no further retries) and yields None."""
        await workflow.wait_condition(lambda: handle.done() or self._skip is not None)
        if handle.done():
            return await handle
        handle.cancel()
        try:
            await handle
        except (ActivityError, asyncio.CancelledError):
            pass
        return None

    def _retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            initial_interval=timedelta(seconds=self._options.initial_retry_seconds),
            backoff_coefficient=2.0,
            maximum_interval=timedelta(seconds=self._options.max_retry_interval_seconds),
            maximum_attempts=0,
        )

    def _count(self, rows: int, groups: int) -> None:
        self._rows_handled += rows
        self._groups_handled += groups

    def _carry(self) -> ShardCarry:
        return ShardCarry(
            max_known_id=self._max_known_id,
            highest_seen_id=self._highest_seen_id,
            rows_handled=self._rows_handled,
            groups_handled=self._groups_handled,
            skip=self._skip,
            traffic=self._traffic,
        )

    # -- signals and queries -----------------------------------------------------------------

    @workflow.signal
    def notify(self, input: NotifyInput) -> None:
        """Rows up to ``max_id`` are committed in this shard."""
        self._rows_committed(input.max_id, input.late)

    def _rows_committed(self, max_id: int, late: bool) -> None:
        self._max_known_id = max(self._max_known_id, max_id)
        if late or max_id > self._highest_seen_id:
            self._dirty = True
            self._traffic = self._traffic or self._drained

    @workflow.update
    async def flush(self, input: FlushInput) -> FlushResult:
        """Wait until every row of the shard up to ``up_to_id`` is handled (``handled``), or
        say why not: ``blocked`` behind a failing head, ``skipped``, ``deferred`` head, or
        ``timed_out``. The rows stay for asynchronous processing in every case."""
        up_to = input.up_to_id
        self._rows_committed(up_to, late=False)
        stopped = self._flush_stopped(up_to)
        if stopped is not None:
            return stopped
        # The table is the truth: a local activity watches it (the rows may be handled by a
        # lingering drain the workflow hears from only when it returns).
        check = workflow.start_local_activity(
            "flush_check",
            FlushCheckInput(self._shard, up_to, input.timeout_seconds),
            result_type=FlushCheck,
            start_to_close_timeout=timedelta(seconds=input.timeout_seconds + 10),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        await workflow.wait_condition(
            lambda: check.done() or self._flush_stopped(up_to) is not None
        )
        if not check.done():
            check.cancel()
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await check
        else:
            try:
                checked = await check
            except (ActivityError, ApplicationError):
                checked = FlushCheck(handled=False)  # the table could not be read in time
            if checked.handled:
                return FlushResult(self._shard.key, HANDLED)
            if checked.deferred_until is not None:
                return FlushResult(self._shard.key, DEFERRED, deferred_until=checked.deferred_until)
        return self._flush_stopped(up_to) or FlushResult(self._shard.key, TIMED_OUT)

    @flush.validator
    def _validate_flush(self, input: FlushInput) -> None:
        up_to, timeout = input.up_to_id, input.timeout_seconds
        if not isinstance(up_to, int) or isinstance(up_to, bool) or up_to < 1:
            raise ValueError(f"flush needs up_to_id, a positive integer row id; got {up_to!r}")
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 0 < timeout <= FLUSH_MAX_TIMEOUT_SECONDS
        ):
            raise ValueError(
                f"flush needs timeout_seconds between 0 and {FLUSH_MAX_TIMEOUT_SECONDS:.0f}; "
                f"got {timeout!r}"
            )

    def _flush_stopped(self, up_to: int) -> FlushResult | None:
        """Why rows up to ``up_to`` cannot be handled now, if they cannot."""
        if self._skip is not None:
            return FlushResult(self._shard.key, SKIPPED, head=self._head, skip=self._skip)
        head = self._head
        if self._state == BLOCKED and head is not None and head.first_id <= up_to:
            return FlushResult(
                self._shard.key,
                BLOCKED,
                head=head,
                blocked_since=self._blocked_since.isoformat() if self._blocked_since else None,
                error=self._last_error,
            )
        return None

    @workflow.signal
    def skip(self, input: SkipInput) -> None:
        """Pause the shard: the in-flight attempt is abandoned, no handler runs, rows are kept."""
        reason = (input.reason or "").strip()
        if not reason:
            workflow.logger.warning("skip ignored for %s: a reason is required", self._shard.key)
            return
        self._skip = SkipInfo(reason=reason, by=input.by, at=workflow.now().isoformat())
        self._set_state(SKIPPED)

    @workflow.signal
    def resume(self, input: ResumeInput | None = None) -> None:
        """Continue a skipped shard; its head is retried at once."""
        if self._skip is not None:
            self._skip = None
            self._dirty = True

    # The same two operations as updates: the caller learns at once whether they were taken,
    # and a malformed one is refused by its validator without reaching the shard's history.

    @workflow.update(name="skip")
    def skip_update(self, input: SkipInput) -> ShardStatus:
        """:meth:`skip`, answered with the shard's status."""
        self.skip(input)
        return self.status()

    @skip_update.validator
    def _validate_skip(self, input: SkipInput) -> None:
        if not isinstance(input.reason, str) or not input.reason.strip():
            raise ValueError("skip needs a reason (it is shown to every operator)")
        if input.by is not None and not isinstance(input.by, str):
            raise ValueError(f"skip's by must be a name, got {input.by!r}")

    @workflow.update(name="resume")
    def resume_update(self, input: ResumeInput) -> ShardStatus:
        """:meth:`resume`, answered with the shard's status."""
        self.resume(input)
        return self.status()

    @resume_update.validator
    def _validate_resume(self, input: ResumeInput) -> None:
        if self._skip is None:
            raise ValueError(f"shard {self._shard.key} is not skipped")

    @workflow.query
    def status(self) -> ShardStatus:
        return ShardStatus(
            shard=self._shard.key,
            state=self._state,
            max_known_id=self._max_known_id,
            highest_seen_id=self._highest_seen_id,
            rows_handled=self._rows_handled,
            groups_handled=self._groups_handled,
            head=self._head,
            attempts=self._attempts,
            last_error=self._last_error,
            blocked_since=self._blocked_since.isoformat() if self._blocked_since else None,
            deferred_until=self._deferred_until.isoformat() if self._deferred_until else None,
            skip=self._skip,
        )

    # -- what the UI shows ---------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        self._state = state
        self._publish()
        self._index()

    def _index(self) -> None:
        """Keep the search attributes OutboxState, OutboxBlockedCategory and OutboxBlockedSince
        current, so that the UI can list shards by state. Each upsert is a history event: only
        changes are written, and the idle state of a run that completes at once is not."""
        if self._state == IDLE and self._options.idle_timeout_seconds <= 0:
            return
        blocked = self._head is not None and self._blocked_since is not None
        category = self._head.category_name if blocked and self._head else None
        since = self._blocked_since if blocked else None
        current = workflow.info().typed_search_attributes
        updates = [
            STATE_ATTRIBUTE.value_set(self._state)
            if current.get(STATE_ATTRIBUTE) != self._state
            else None,
            _set_or_unset(BLOCKED_CATEGORY_ATTRIBUTE, category)
            if current.get(BLOCKED_CATEGORY_ATTRIBUTE) != category
            else None,
            _set_or_unset(BLOCKED_SINCE_ATTRIBUTE, since)
            if current.get(BLOCKED_SINCE_ATTRIBUTE) != since
            else None,
        ]
        changed = [update for update in updates if update is not None]
        if changed and workflow.patched(STATE_ATTRIBUTES_PATCH):
            workflow.upsert_search_attributes(changed)

    def _publish(self) -> None:
        # Current details are not carried over continue-as-new; every run sets them again.
        lines = [
            f"**Shard** `{self._shard.key}` (table `{self._shard.table}`)",
            f"**State** {self._state}",
            f"**Rows handled** {self._rows_handled} in {self._groups_handled} groups",
        ]
        if self._head is not None:
            head = self._head
            lines.append(f"**Head group** {head.summary}, ids {head.first_id}–{head.last_id}")
        if self._last_error is not None:
            lines.append(
                f"**Attempts** {self._attempts}+, last error `{self._last_error.error_type}`"
            )
        if self._blocked_since is not None:
            lines.append(f"**Blocked since** {self._blocked_since.isoformat()}")
        if self._deferred_until is not None:
            lines.append(f"**Deferred until** {self._deferred_until.isoformat()}")
        if self._skip is not None:
            skip = self._skip
            lines.append(f"**Skipped** by {skip.by or 'an operator'} at {skip.at}: {skip.reason}")
        workflow.set_current_details("\n\n".join(lines))


def _set_or_unset(key: SearchAttributeKey[V], value: V | None) -> SearchAttributeUpdate[V]:
    return key.value_unset() if value is None else key.value_set(value)
