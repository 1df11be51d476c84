"""The OutboxShard workflow: one per shard that needs attention, running its handlers one at a
time.

On demand (the default), a shard gets this workflow when a partition hands it over (a handler
failed, the head is deferred, the shard is on the skip list), when an operator skips it, or
when a flush waits on it. While the workflow runs it holds the shard (partitions leave it
alone); once the shard is empty it gives it back and completes. With ``--shard-workflows
always`` every shard with rows runs in this workflow, started by the bridge.

The workflow holds no rows, only ids and counts. It drains with a local activity while handlers
succeed, switches to a server-retried category activity when one fails (so the UI shows which
category is stuck), sleeps on a durable timer while the head row is deferred, and continues as
new before its history grows long, also while it is blocked, skipped or deferred, carrying
where it stands.
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
        BLOCKED_CATEGORY_ATTRIBUTE,
        BLOCKED_SINCE_ATTRIBUTE,
        FLUSH_MAX_TIMEOUT_SECONDS,
        STATE_ATTRIBUTE,
        DrainInput,
        DrainResult,
        FlushCheck,
        FlushCheckInput,
        FlushInput,
        FlushOutcome,
        FlushResult,
        HandleHeadInput,
        HandleHeadResult,
        HandlerFailure,
        HandoverInput,
        HeadGroup,
        HeldFor,
        HoldInput,
        NotifyInput,
        RecheckInput,
        ResumeInput,
        ShardCarry,
        ShardInput,
        ShardState,
        ShardStatus,
        ShardSummary,
        SkipInfo,
        SkipInput,
        flush_queue,
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
# A run continues as new also while it waits (blocked, skipped, deferred, lingering), carrying
# where it stands.
CONTINUE_WHILE_WAITING_PATCH = "continue-as-new-while-waiting"
# A skipped shard's pause is recorded in the table, so that its partition leaves it alone.
HOLD_WHEN_SKIPPED_PATCH = "hold-when-skipped"
# A flush's wait runs on the flush task queue, not in the worker's local-activity slots.
FLUSH_QUEUE_PATCH = "flush-check-queue"
# A blocked shard carried over a continue-as-new waits for the attempt its backoff scheduled.
RETRY_SCHEDULE_PATCH = "blocked-retry-schedule"
# A blocked shard whose head an operator changed tries it again at once (signal ``recheck``).
RECHECK_HEAD_PATCH = "recheck-blocked-head"
# Every patch above is decided once, in the run's first activation. A patch asked for later
# (after a local drain returned, say) is replayed right only if its marker lies in the very
# workflow task that asks, and a local activity's result can reach the workflow one task later
# than its replay delivers it (the SDK's core completes a task with the marker and asks for
# a new one before handing the result over, e.g. when it answers a query in that completion);
# the run then fails every task it replays. A run with this marker has every behaviour
# above; a new behaviour goes behind a new patch asked for here too, implying this one.
PATCHES_AT_START_PATCH = "patches-at-start"
BACKOFF_COEFFICIENT = 2.0


class _Interrupted(Exception):
    """An activity was stopped because the run must continue as new first."""


class _Recheck(Exception):
    """A blocked head's category activity was stopped because the head in the table changed."""


@workflow.defn(name="OutboxShard")
class OutboxShard:
    @workflow.init
    def __init__(self, input: ShardInput) -> None:
        self._shard = input.shard
        self._options = input.options
        # Everything that outlives a run: what continue-as-new carries.
        self._s = input.carry or ShardCarry()
        # A run starts because rows exist (or carried on from a run that had some).
        self._dirty = True
        # Set when rows arrive after this run's first drain: traffic is steady, so linger.
        self._drained = False
        self._state = ShardState.DRAINING
        self._deferred_until: datetime | None = (
            datetime.fromisoformat(self._s.deferred_until) if self._s.deferred_until else None
        )
        self._deferred_seconds: float | None = None
        self._handover: HandoverInput | None = None
        self._skip_recorded = False  # the skip is in the table: no drain takes the shard
        self._waiting_can_continue = False  # set in run() (a patch decides)
        self._blocked_at: datetime | None = None  # when this run's category activity began
        self._retry_from = self._options.initial_retry_seconds
        self._recheck = False  # the head in the table changed while this run was blocked
        # Decided in the first activation, so that no later task's timing decides a patch.
        self._patched_at_start = workflow.patched(PATCHES_AT_START_PATCH)

    # -- main loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: ShardInput) -> ShardSummary:
        self._publish()
        if self._s.head is not None or self._s.skip is not None or self._deferred_until:
            # Carried over a continue-as-new (or started skipped): this run waits like the last.
            self._waiting_can_continue = self._patched(CONTINUE_WHILE_WAITING_PATCH)
        while True:
            if self._may_continue_as_new():
                workflow.continue_as_new(
                    ShardInput(shard=self._shard, options=self._options, carry=self._carry())
                )
            try:
                if await self._step():
                    return ShardSummary(
                        self._shard.key, self._s.rows_handled, self._s.groups_handled
                    )
            except _Interrupted:
                continue  # continue as new at the top of the loop

    async def _step(self) -> bool:
        """Do what the shard needs next; True when the run is done."""
        if self._handover is not None:
            await self._take_handover()
        elif self._s.skip is not None:
            await self._stay_skipped()
        elif self._s.head is not None and self._s.blocked_since is not None:
            await self._unblock(self._s.head, self._s.last_error, resumed=True)
            self._dirty = True
        elif self._dirty:
            await self._drain_once()
        elif self._deferred_until is not None:
            await self._wait_for_deferred()
        elif not workflow.all_handlers_finished():
            # A flush is waiting for its answer: stay, and drain if rows arrive meanwhile.
            await workflow.wait_condition(
                lambda: (
                    workflow.all_handlers_finished()
                    or self._dirty
                    or self._s.skip is not None
                    or self._handover is not None
                )
            )
        else:
            return await self._idle_expired()
        return False

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

    def _continue_due(self) -> bool:
        """While waiting: whether to stop waiting and continue as new."""
        return self._waiting_can_continue and self._may_continue_as_new()

    def _patched(self, patch: str) -> bool:
        """Whether the run has the behaviour behind ``patch``: at once if the run decided its
        patches at its start, else asked where the behaviour begins (as older runs did)."""
        return self._patched_at_start or workflow.patched(patch)

    def _enable_continue_while_waiting(self) -> None:
        if not self._waiting_can_continue:
            self._waiting_can_continue = self._patched(CONTINUE_WHILE_WAITING_PATCH)

    async def _stay_skipped(self) -> None:
        self._enable_continue_while_waiting()
        if self._holds_skips():
            # In the table, so that no drain takes the shard any more (a partition's, or a
            # lingering drain of this workflow's that has not heard of the skip yet).
            await self._hold(HeldFor.SKIPPED)
            self._skip_recorded = True
        self._set_state(ShardState.SKIPPED)
        await workflow.wait_condition(lambda: self._s.skip is None or self._may_continue_as_new())
        if self._s.skip is None:
            if self._skip_recorded:
                # Resumed: on demand this workflow keeps the shard until it is empty; with a
                # workflow for every shard, nothing holds it.
                await self._hold(HeldFor.WORKFLOW, release=not self._options.owns_shard)
                self._skip_recorded = False
            # Resuming retries the head at once, from scratch (if it fails again, the shard is
            # blocked again, since then).
            self._clear_head()
            self._dirty = True

    def _holds_skips(self) -> bool:
        return self._patched(HOLD_WHEN_SKIPPED_PATCH)

    async def _hold(self, held_for: HeldFor, *, release: bool = False) -> None:
        """Record in the table that this workflow holds the shard (or, with ``release``, no
        longer does); waits for a round in the shard to end (retried by the server until the
        database answers)."""
        handle = workflow.start_activity(
            "hold_shard",
            HoldInput(self._shard, held_for, release=release),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=self._retry_policy(maximum_interval=10.0),
            summary=f"hold {self._shard.key}",
        )
        await self._until_done(handle, cancel_on_skip=False)

    async def _wait_for_deferred(self) -> None:
        assert self._deferred_until is not None
        self._enable_continue_while_waiting()
        self._set_state(ShardState.DEFERRED)
        if self._deferred_seconds is not None:
            # By the database's clock, which decides when the row is due: a clock difference
            # with Temporal can neither make the shard spin nor wake it early.
            remaining = max(self._deferred_seconds, 0.05)
            self._deferred_seconds = None
        else:
            remaining = (self._deferred_until - workflow.now()).total_seconds()
        if remaining > 0:
            try:
                await workflow.wait_condition(
                    lambda: (
                        self._dirty
                        or self._s.skip is not None
                        or self._handover is not None
                        or self._continue_due()
                    ),
                    timeout=timedelta(seconds=remaining),
                )
                # Woken by news, a skip, a handover, or a due continue-as-new (which carries
                # the deferral over).
                return
            except TimeoutError:
                pass
        self._deferred_until = None
        self._dirty = True

    async def _idle_expired(self) -> bool:
        self._set_state(ShardState.IDLE)
        if self._options.idle_timeout_seconds <= 0 or self._options.owns_shard:
            # Complete as soon as the shard is empty: a signal that races the completion fails
            # this task and is replayed first; a later one starts a new run.
            return True
        try:
            await workflow.wait_condition(
                lambda: self._dirty or self._s.skip is not None or self._may_continue_as_new(),
                timeout=timedelta(seconds=self._options.idle_timeout_seconds),
            )
        except TimeoutError:
            # A signal that races the completion fails this task and is replayed first, so
            # returning here never drops work.
            return not self._dirty and self._s.skip is None
        return False

    async def _take_handover(self) -> None:
        """Start from what the partition found, without repeating its attempt."""
        handover, self._handover = self._handover, None
        assert handover is not None
        if handover.held_for == HeldFor.FAILED and handover.head is not None:
            self._drained = True
            await self._unblock(handover.head, handover.failure)
            self._dirty = True
        elif handover.held_for == HeldFor.DEFERRED and handover.deferred_until is not None:
            self._drained = True
            self._dirty = False
            self._deferred_until = datetime.fromisoformat(handover.deferred_until)
            self._deferred_seconds = handover.deferred_seconds

    # -- draining --------------------------------------------------------------------------

    async def _drain_once(self) -> None:
        self._dirty = False
        self._deferred_until = None
        self._clear_head()
        self._set_state(ShardState.DRAINING)
        result = await self._drain()
        if result is None:  # skipped while draining
            self._dirty = True
            return
        self._drained = True
        self._count(result.rows_handled, result.groups_handled)
        self._s.highest_seen_id = max(self._s.highest_seen_id, result.highest_seen_id)
        if result.failed is not None:
            await self._unblock(result.failed, result.failure)
            self._dirty = True
            return
        if result.more or result.lingered_rows:
            # Rows kept coming while the drain lingered: linger again rather than go idle.
            self._dirty = True
        elif result.deferred_until is not None:
            self._deferred_until = datetime.fromisoformat(result.deferred_until)
            self._deferred_seconds = result.deferred_seconds

    async def _drain(self) -> DrainResult | None:
        owns = self._options.owns_shard
        if (
            self._s.traffic
            and not owns  # on demand, the partitions take steady traffic
            and self._options.linger_seconds > 0
            and self._patched(LINGER_ACTIVITY_PATCH)
        ):
            lingered = await self._linger()
            if lingered is not None or self._s.skip is not None:
                return lingered
        request = DrainInput(
            shard=self._shard,
            max_groups=self._options.drain_max_groups,
            time_budget_seconds=self._options.drain_time_budget_seconds,
            own=owns,
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
                    # The cap may not be below the first interval (a setting above 10 s).
                    maximum_interval=timedelta(
                        seconds=max(10.0, self._options.initial_retry_seconds)
                    ),
                    maximum_attempts=LOCAL_DRAIN_ATTEMPTS,
                ),
            )
            return await self._until_done(local)
        except (ActivityError, ApplicationError):
            # The database or the shard lock kept failing: drain with a normal activity, which
            # the server retries without adding history and the UI shows as pending. (A local
            # activity's last failure reaches the workflow as the ApplicationError itself;
            # before this was caught, it failed the run and the bridge had to start another.)
            if not self._patched(LOCAL_DRAIN_FALLBACK_PATCH):
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
            return await self._until_done(remote)

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
            return await self._until_done(handle)
        except ActivityError:
            return None  # fall back to the local drain and its own fallback

    async def _unblock(
        self, head: HeadGroup, failure: HandlerFailure | None, *, resumed: bool = False
    ) -> None:
        """Retry the failed head group as a category activity until it succeeds or the shard is
        skipped. ``resumed``: carried over a continue-as-new, with its attempts, since when and
        where the backoff stood."""
        s = self._s
        s.head = head
        if not resumed:
            s.attempts = 1
            s.last_error = failure
            s.blocked_since = workflow.now().isoformat()
            s.retry_interval_seconds = None
        self._retry_from = s.retry_interval_seconds or self._options.initial_retry_seconds
        self._set_state(ShardState.BLOCKED)
        self._enable_continue_while_waiting()
        self._recheck = False
        if resumed and not await self._wait_for_next_attempt():
            return  # skipped meanwhile
        self._blocked_at = workflow.now()
        handle = workflow.start_activity(
            head.category_name,
            HandleHeadInput(self._shard, head.category, head.object_identifier),
            result_type=HandleHeadResult,
            start_to_close_timeout=timedelta(seconds=self._options.handler_timeout_seconds),
            heartbeat_timeout=timedelta(seconds=self._options.heartbeat_timeout_seconds),
            retry_policy=self._retry_policy(initial=self._retry_from),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
            summary=head.summary,
        )
        try:
            result = await self._until_done(handle, recheck=True)
        except _Interrupted:
            self._carry_backoff()
            raise
        except _Recheck:
            # Tried again at once by the caller, still blocked since then, with the backoff
            # where it stood (if the new head fails too).
            self._carry_backoff()
            self._s.next_attempt_at = None
            return
        if result is None:
            return  # skipped: keep showing what blocked the shard
        if result.handled:
            self._count(result.rows_handled, 1)
        self._clear_head()
        self._set_state(ShardState.DRAINING)

    async def _wait_for_next_attempt(self) -> bool:
        """A run carried over while blocked waits until the attempt the last run's backoff had
        scheduled, so that continuing as new never retries sooner than the backoff says.
        False if the shard was skipped meanwhile; raises :class:`_Interrupted` if the run
        must continue as new first (carrying the same schedule), and returns at once when
        the head changed (``recheck``)."""
        s = self._s
        if s.next_attempt_at is None or not self._patched(RETRY_SCHEDULE_PATCH):
            return True
        remaining = (datetime.fromisoformat(s.next_attempt_at) - workflow.now()).total_seconds()
        if remaining > 0:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._s.skip is not None or self._recheck or self._continue_due(),
                    timeout=timedelta(seconds=remaining),
                )
            if s.skip is not None:
                return False
            if not self._recheck and self._continue_due():
                raise _Interrupted
        # The attempt the last run scheduled: the backoff goes on from the interval after it.
        self._retry_from = min(
            self._retry_from * BACKOFF_COEFFICIENT, self._options.max_retry_interval_seconds
        )
        s.next_attempt_at = None
        return True

    def _carry_backoff(self) -> None:
        """Before continuing as new while blocked: how many attempts the server made since this
        run's category activity began (from the retry schedule: the server does not tell the
        workflow), and where the backoff stands, so the next run goes on from there."""
        assert self._blocked_at is not None
        elapsed = (workflow.now() - self._blocked_at).total_seconds()
        interval, waited, attempts = self._retry_from, 0.0, 1
        ceiling = self._options.max_retry_interval_seconds
        while waited + interval <= elapsed:
            waited += interval
            attempts += 1
            interval = min(interval * BACKOFF_COEFFICIENT, ceiling)
        self._s.attempts += attempts
        self._s.retry_interval_seconds = interval
        next_attempt = self._blocked_at + timedelta(seconds=waited + interval)
        self._s.next_attempt_at = next_attempt.isoformat()

    async def _until_done(
        self, handle: ActivityHandle[T], *, cancel_on_skip: bool = True, recheck: bool = False
    ) -> T | None:
        """Await ``handle``. A skip cancels it (TRY_CANCEL: no further retries) and yields
        None; with ``recheck``, a changed head cancels it and raises :class:`_Recheck`; a due
        continue-as-new cancels it and raises :class:`_Interrupted`."""
        await workflow.wait_condition(
            lambda: (
                handle.done()
                or (cancel_on_skip and self._s.skip is not None)
                or (recheck and self._recheck)
                or self._continue_due()
            )
        )
        if handle.done():
            return await handle
        skipped = cancel_on_skip and self._s.skip is not None
        handle.cancel()
        with contextlib.suppress(ActivityError, asyncio.CancelledError):
            await handle
        if skipped:
            return None
        if recheck and self._recheck:
            raise _Recheck
        raise _Interrupted

    def _retry_policy(
        self, *, initial: float | None = None, maximum_interval: float | None = None
    ) -> RetryPolicy:
        first = initial or self._options.initial_retry_seconds
        ceiling = maximum_interval or self._options.max_retry_interval_seconds
        return RetryPolicy(
            initial_interval=timedelta(seconds=first),
            backoff_coefficient=BACKOFF_COEFFICIENT,
            maximum_interval=timedelta(seconds=max(first, ceiling)),
            maximum_attempts=0,
        )

    def _clear_head(self) -> None:
        s = self._s
        s.head = None
        s.attempts = 0
        s.last_error = None
        s.blocked_since = None
        s.retry_interval_seconds = None
        s.next_attempt_at = None

    def _count(self, rows: int, groups: int) -> None:
        self._s.rows_handled += rows
        self._s.groups_handled += groups

    def _carry(self) -> ShardCarry:
        carry = self._s
        carry.deferred_until = self._deferred_until.isoformat() if self._deferred_until else None
        return carry

    # -- signals and queries -----------------------------------------------------------------

    @workflow.signal
    def notify(self, input: NotifyInput) -> None:
        """Rows up to ``max_id`` are committed in this shard."""
        self._rows_committed(input.max_id, input.late)

    @workflow.signal
    def recheck(self, input: RecheckInput) -> None:
        """The bridge saw that the head in the table is no longer the group this shard is
        blocked on: try the head again now (the activity finds out what it is)."""
        if self._state == ShardState.BLOCKED and self._patched(RECHECK_HEAD_PATCH):
            self._recheck = True

    @workflow.signal
    def handover(self, input: HandoverInput) -> None:
        """A partition gives the shard to this workflow (it holds it already): its handler
        failed, its head is deferred, or it is on the skip list."""
        self._rows_committed(input.max_id, late=True)
        if input.skip is not None and self._s.skip is None:
            self._s.skip = SkipInfo(input.skip.reason, input.skip.by, workflow.now().isoformat())
        if not self._drained and self._s.head is None:
            self._handover = input  # else this run has seen the shard itself: it drains again

    def _rows_committed(self, max_id: int, late: bool) -> None:
        self._s.max_known_id = max(self._s.max_known_id, max_id)
        if late or max_id > self._s.highest_seen_id:
            self._dirty = True
            self._s.traffic = self._s.traffic or self._drained

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
        # The table is the truth: an activity watches it (the rows may be handled by a
        # lingering drain or a partition the workflow hears from only when it returns). It runs
        # on a task queue of its own, whose slots no drain needs: however many flushes wait,
        # the drains they wait for still run.
        request = FlushCheckInput(self._shard, up_to, input.timeout_seconds)
        bound = timedelta(seconds=input.timeout_seconds + 10)
        check: ActivityHandle[FlushCheck]
        if self._patched(FLUSH_QUEUE_PATCH):
            check = workflow.start_activity(
                "flush_check",
                request,
                result_type=FlushCheck,
                task_queue=flush_queue(workflow.info().task_queue),
                schedule_to_close_timeout=bound,
                retry_policy=RetryPolicy(maximum_attempts=1),
                cancellation_type=ActivityCancellationType.TRY_CANCEL,
            )
        else:
            check = workflow.start_local_activity(
                "flush_check",
                request,
                result_type=FlushCheck,
                start_to_close_timeout=bound,
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
                return FlushResult(self._shard.key, FlushOutcome.HANDLED)
            if checked.deferred_until is not None:
                return FlushResult(
                    self._shard.key, FlushOutcome.DEFERRED, deferred_until=checked.deferred_until
                )
        return self._flush_stopped(up_to) or FlushResult(self._shard.key, FlushOutcome.TIMED_OUT)

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
        s = self._s
        if s.skip is not None:
            return FlushResult(self._shard.key, FlushOutcome.SKIPPED, head=s.head, skip=s.skip)
        head = s.head
        if self._state == ShardState.BLOCKED and head is not None and head.first_id <= up_to:
            return FlushResult(
                self._shard.key,
                FlushOutcome.BLOCKED,
                head=head,
                blocked_since=s.blocked_since,
                error=s.last_error,
            )
        return None

    @workflow.signal
    def skip(self, input: SkipInput) -> None:
        """Pause the shard: the in-flight attempt is abandoned, no handler runs, rows are kept."""
        reason = (input.reason or "").strip()
        if not reason:
            workflow.logger.warning("skip ignored for %s: a reason is required", self._shard.key)
            return
        self._s.skip = SkipInfo(reason=reason, by=input.by, at=workflow.now().isoformat())
        self._set_state(ShardState.SKIPPED)

    @workflow.signal
    def resume(self, input: ResumeInput | None = None) -> None:
        """Continue a skipped shard; its head is retried at once."""
        if self._s.skip is not None:
            self._s.skip = None
            self._dirty = True

    # The same two operations as updates: the caller learns at once whether they were taken,
    # and a malformed one is refused by its validator without reaching the shard's history.

    @workflow.update(name="skip")
    async def skip_update(self, input: SkipInput) -> ShardStatus:
        """:meth:`skip`, answered with the shard's status once the skip is recorded in the
        table: from then on no handler of the shard starts (one that was running when the
        skip came has returned)."""
        self.skip(input)
        if self._holds_skips():
            await workflow.wait_condition(lambda: self._skip_recorded or self._s.skip is None)
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
        if self._s.skip is None:
            raise ValueError(f"shard {self._shard.key} is not skipped")

    @workflow.query
    def status(self) -> ShardStatus:
        s = self._s
        return ShardStatus(
            shard=self._shard.key,
            state=self._state,
            max_known_id=s.max_known_id,
            highest_seen_id=s.highest_seen_id,
            rows_handled=s.rows_handled,
            groups_handled=s.groups_handled,
            head=s.head,
            attempts=s.attempts,
            last_error=s.last_error,
            blocked_since=s.blocked_since,
            deferred_until=self._deferred_until.isoformat() if self._deferred_until else None,
            skip=s.skip,
        )

    # -- what the UI shows ---------------------------------------------------------------------

    def _set_state(self, state: ShardState) -> None:
        self._state = state
        self._publish()
        self._index()

    def _index(self) -> None:
        """Keep the search attributes OutboxState, OutboxBlockedCategory and OutboxBlockedSince
        current, so that the UI can list shards by state. Each upsert is a history event: only
        changes are written, and the idle state of a run that completes at once is not."""
        if self._state == ShardState.IDLE and (
            self._options.idle_timeout_seconds <= 0 or self._options.owns_shard
        ):
            return
        s = self._s
        blocked = s.head is not None and s.blocked_since is not None
        category = s.head.category_name if blocked and s.head else None
        since = datetime.fromisoformat(s.blocked_since) if blocked and s.blocked_since else None
        current = workflow.info().typed_search_attributes
        updates = [
            STATE_ATTRIBUTE.value_set(self._state.value)
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
        if changed and self._patched(STATE_ATTRIBUTES_PATCH):
            workflow.upsert_search_attributes(changed)

    def _publish(self) -> None:
        # Current details are not carried over continue-as-new; every run sets them again.
        s = self._s
        lines = [
            f"**Shard** `{self._shard.key}` (table `{self._shard.table}`)",
            f"**State** {self._state.value}",
            f"**Rows handled** {s.rows_handled} in {s.groups_handled} groups",
        ]
        if s.head is not None:
            head = s.head
            lines.append(f"**Head group** {head.summary}, ids {head.first_id}–{head.last_id}")
        if s.last_error is not None:
            lines.append(f"**Attempts** {s.attempts}+, last error `{s.last_error.error_type}`")
        if s.blocked_since is not None:
            lines.append(f"**Blocked since** {s.blocked_since}")
        if self._deferred_until is not None:
            lines.append(f"**Deferred until** {self._deferred_until.isoformat()}")
        if s.skip is not None:
            skip = s.skip
            lines.append(f"**Skipped** by {skip.by or 'an operator'} at {skip.at}: {skip.reason}")
        workflow.set_current_details("\n\n".join(lines))


def _set_or_unset(key: SearchAttributeKey[V], value: V | None) -> SearchAttributeUpdate[V]:
    return key.value_unset() if value is None else key.value_set(value)
