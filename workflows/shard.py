"""The OutboxShard workflow: owns one shard that needs attention (a failed handler, a deferred
head, a skip, a flush) until it is empty, then gives it back and completes. Everything it knows
is one :class:`ShardRecord` (ids and counts, never a payload), carried across continue-as-new.

Its signal handlers take their arguments undecoded (``*args``) and decode them: an input of any
shape or out of bounds (``workflows/inputs.py``) is refused, counted and shown, never applied,
and never a failed workflow task.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from outbox_bridge.workflows import shard_transitions as change
    from outbox_bridge.workflows import shard_view as view
    from outbox_bridge.workflows.inputs import (
        InvalidInput,
        check_fields,
        check_flush,
        check_handover,
        check_resume,
        check_shard_options,
        check_skip,
        decoded,
        refused,
    )
    from outbox_bridge.workflows.models import (
        Blocked,
        Deferred,
        Draining,
        DrainInput,
        DrainResult,
        FlushCheck,
        FlushCheckInput,
        FlushInput,
        FlushOutcome,
        FlushResult,
        HandleHeadInput,
        HandleHeadResult,
        HandoverInput,
        HeldFor,
        HoldInput,
        NotifyInput,
        RecheckInput,
        Resumed,
        ResumeInput,
        ShardInput,
        ShardOptions,
        ShardRecord,
        ShardRef,
        ShardState,
        ShardStatus,
        ShardSummary,
        SkipInfo,
        SkipInput,
        Skipped,
        flush_queue,
        when,
    )

T = TypeVar("T")

# Tries of the local drain before it falls back to a normal (visible, server-retried) one.
LOCAL_DRAIN_ATTEMPTS = 3
# How long one timer of a skipped shard lasts; when it fires, the shard waits on the next.
SKIPPED_TIMER = timedelta(days=7)
# Patches since the 1.0 baseline, deprecated in 1.0.0 (docs: Upgrade safely).
CARRY_BACKOFF_FROM_NOW = "carry-backoff-from-now"
# A run started by a deferred handover drains before it waits, to learn why the head waits.
DRAIN_HANDED_DEFERRED = "drain-handed-deferred"


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
        self._r = input.carried()
        # Per run: when this run's category activity began, and a changed head while blocked.
        self._blocked_at: datetime | None = None
        self._recheck = False
        # News of rows in this run, compared around a drain (never interrupted: not carried).
        self._news = 0
        # Until the run's body starts: a handover that starts the run comes before it.
        self._starting = True
        try:
            check_shard_options(self._options)
        except InvalidInput as exc:  # started by hand with options out of bounds
            self._options = ShardOptions()
            refused(self._r.refused, "start options (defaults used)", exc)

    @workflow.run
    async def run(self, input: ShardInput) -> ShardSummary:
        self._starting = False
        while True:
            self._show()
            if self._continue_due():
                workflow.continue_as_new(ShardInput(self._shard, self._options, self._r))
            with contextlib.suppress(_Interrupted):  # continue as new at the top of the loop
                match self._r.phase:
                    case Resumed():
                        await self._hold(HeldFor.WORKFLOW)  # the table says skipped no more
                        change.taken_back(self._r)
                    case Skipped() as skipped:
                        await self._stay_skipped(skipped)
                    case Blocked() as blocked:
                        await self._retry_head(blocked)
                    case Draining():
                        await self._drain()
                    case Deferred() as deferred:
                        await self._wait_deferred(deferred)
                    case _ if not workflow.all_handlers_finished():
                        # A flush waits for its answer: stay, and act on what comes meanwhile.
                        await workflow.wait_condition(
                            lambda: (
                                workflow.all_handlers_finished() or self._r.state != ShardState.IDLE
                            )
                        )
                    case _:
                        # Empty, and given back by the last drain. A signal that races the
                        # completion fails this task and is replayed first: nothing is dropped.
                        r = self._r
                        return ShardSummary(self._shard.key, r.rows_handled, r.groups_handled)

    async def _drain(self) -> None:
        """One drain of the shard: a local activity, falling back to a normal one (retried by
        the server without adding history) when the database or the shard lock keeps failing."""
        news = self._news
        try:
            local = _start_drain(self._shard, self._options, local=True)
            result = await self._until_done(local, interruptible=False)
        except (ActivityError, ApplicationError):
            # A local activity's last failure arrives as the ApplicationError itself.
            remote = _start_drain(self._shard, self._options, local=False)
            result = await self._until_done(remote, interruptible=False)
        if result is not None:  # None: skipped meanwhile, drained again once resumed
            now = workflow.now().isoformat()
            change.drained(self._r, result, news=self._news != news, now=now)

    async def _retry_head(self, b: Blocked) -> None:
        """Retry the failing head group as its category activity until it succeeds, the shard
        is skipped, the head changes in the table, or the run must continue as new."""
        await self._wait_for_scheduled_attempt(b)
        if self._r.skip is not None:
            return
        self._recheck = False
        retry_from = b.retry_interval_seconds or self._options.initial_retry_seconds
        self._blocked_at = workflow.now()
        handle = _start_head(self._shard, self._options, b, retry_from, view.headline(self._r))
        try:
            result = await self._until_done(handle, recheck=True)
        except _Interrupted:
            self._carry_backoff(b, retry_from)
            raise
        except _Recheck:
            # Tried again at once (by the next turn of the loop), still blocked since then.
            self._carry_backoff(b, retry_from)
            b.next_attempt_at = None
            return
        if result is None:
            return  # skipped: the head stays shown
        if result.handled:
            self._r.rows_handled += result.rows_handled
            self._r.groups_handled += 1
        self._r.become(Draining())

    async def _wait_for_scheduled_attempt(self, b: Blocked) -> None:
        """A run carried over while blocked waits for the attempt the last run's backoff had
        scheduled: continuing as new never retries sooner than the backoff says."""
        if b.next_attempt_at is None:
            return
        remaining = _seconds_until(b.next_attempt_at)
        if remaining > 0:
            next_attempt = f"{view.headline(self._r)}; next attempt at {when(b.next_attempt_at)}"
            await _wait(lambda: self._stopped(True, True, True), remaining, next_attempt)
            if self._r.skip is not None:
                return
            if not self._recheck and self._continue_due():
                raise _Interrupted
        change.scheduled_attempt(b, self._options)

    def _carry_backoff(self, b: Blocked, retry_from: float) -> None:
        """Where the backoff stands, for the next run to go on from."""
        assert self._blocked_at is not None
        workflow.deprecate_patch(CARRY_BACKOFF_FROM_NOW)
        change.carry_backoff(b, self._options, self._blocked_at, workflow.now(), retry_from)

    async def _stay_skipped(self, skipped: Skipped) -> None:
        r = self._r
        if not skipped.recorded:  # in the table: from now on no drain takes the shard
            skip = skipped.skip
            via = await self._hold(HeldFor.SKIPPED, skip)
            if isinstance(via, str):  # None in runs of older code
                skip.via = via
            change.skip_recorded(r)
            self._show()
        # The timer is there for its summary, the first thing the UI shows of a skipped shard.
        await _wait(lambda: r.skip is None or self._continue_due(), SKIPPED_TIMER, view.headline(r))

    async def _wait_deferred(self, d: Deferred) -> None:
        r = self._r
        if d.deferred_seconds is not None:
            # By the database's clock, which decides when the row is due.
            remaining = max(d.deferred_seconds, 0.05)
            d.deferred_seconds = None
        else:
            remaining = _seconds_until(d.deferred_until)
        waited = lambda: r.state != ShardState.DEFERRED or self._continue_due()  # noqa: E731
        if remaining > 0 and await _wait(waited, remaining, view.headline(r)):
            return  # news, a skip, a handover, or a continue-as-new (which carries it)
        r.become(Draining())

    async def _hold(self, held_for: HeldFor, skip: SkipInfo | None = None) -> object:
        """Skip, or take back from a skip, the owner row; for ``skip``, its sender if found."""
        handle = _start_hold(self._shard, self._options, held_for, skip)
        return await self._until_done(handle, cancel_on_skip=False, interruptible=False)

    def _continue_due(self) -> bool:
        """The run should continue as new (not while a flush waits)."""
        info = workflow.info()
        long = info.get_current_history_length() >= self._options.max_history_events
        return (info.is_continue_as_new_suggested() or long) and workflow.all_handlers_finished()

    async def _until_done(
        self,
        handle: ActivityHandle[T],
        *,
        cancel_on_skip: bool = True,
        recheck: bool = False,
        interruptible: bool = True,
    ) -> T | None:
        """Await ``handle``. A skip cancels it and yields None; with ``recheck``, a changed head
        cancels it and raises :class:`_Recheck`; when ``interruptible``, a due continue-as-new
        cancels it and raises :class:`_Interrupted`."""
        stops = (cancel_on_skip, recheck, interruptible)
        await workflow.wait_condition(lambda: handle.done() or self._stopped(*stops))
        if handle.done():
            return await handle
        skipped = cancel_on_skip and self._r.skip is not None
        await _cancelled(handle)
        if skipped:
            return None
        if recheck and self._recheck:
            raise _Recheck
        raise _Interrupted

    def _stopped(self, skip: bool, recheck: bool, interrupt: bool) -> bool:
        """A skip, a changed head or a due continue-as-new stops the activity awaited."""
        return (
            (skip and self._r.skip is not None)
            or (recheck and self._recheck)
            or (interrupt and self._continue_due())
        )

    # -- signals, updates and queries ----------------------------------------------------------

    @workflow.signal
    def notify(self, *args: Any) -> None:
        """Rows up to ``max_id`` are committed in this shard (see :class:`NotifyInput`)."""
        notice = self._decoded("notify", args, NotifyInput, check_fields)
        if notice is not None:
            self._rows_committed(notice.max_id, late=notice.late)

    @workflow.signal
    def handover(self, *args: Any) -> None:
        """A partition gives the shard, held for this workflow already (:class:`HandoverInput`)."""
        input = self._decoded("handover", args, HandoverInput, check_handover)
        now = workflow.now().isoformat()
        if input is not None and change.handed_over(
            self._r, input, now, self._drains_handed_deferral
        ):
            self._news += 1

    def _drains_handed_deferral(self) -> bool:
        """A run started by a deferred handover drains first. Its marker is recorded only then,
        in the run's first activation (a later one may replay in another task)."""
        if self._starting:
            workflow.deprecate_patch(DRAIN_HANDED_DEFERRED)
        return self._starting

    @workflow.signal
    def recheck(self, *args: Any) -> None:
        """The head in the table is no longer the group this shard is blocked on: try again."""
        if self._decoded("recheck", args, RecheckInput, check_fields) is None:
            return
        if self._r.state == ShardState.BLOCKED:
            self._recheck = True

    def _rows_committed(self, max_id: int, *, late: bool) -> None:
        if change.rows_committed(self._r, max_id, late=late):
            self._news += 1

    @workflow.signal
    def skip(self, *args: Any) -> None:
        """Pause the shard: the attempt under way is cancelled, every row is kept."""
        input = self._decoded("skip", args, SkipInput, check_skip)
        if input is not None:
            self._skip(input)

    def _skip(self, input: SkipInput) -> None:
        # Skipped again while held, the new skip's sender is not looked up (shown as unknown).
        now = workflow.now().isoformat()
        change.skipped(self._r, SkipInfo(reason=input.reason.strip(), by=input.by, at=now))
        self._show()

    @workflow.signal
    def resume(self, *args: Any) -> None:
        """Continue a skipped shard; its head is retried at once, from scratch."""
        given = args != () and args != (None,)  # its input is optional
        if given and self._decoded("resume", args, ResumeInput, check_resume) is None:
            return
        change.resumed(self._r)

    def _decoded(
        self, signal: str, args: Sequence[Any], model: type[T], check: Callable[[T], None]
    ) -> T | None:
        """The signal's argument as ``model``, or None when it is refused (and shown)."""
        value = decoded(signal, args, model, check, self._r.refused)
        if value is None:  # the details only: a refused signal changes no search attribute
            view.describe(self._shard, self._r)
        return value

    # The same two as updates: the caller learns whether they were taken; validators refuse.

    @workflow.update(name="skip")
    async def skip_update(self, input: SkipInput) -> ShardStatus:
        """:meth:`skip`, answered once the skip is recorded in the table."""
        self._skip(input)
        await workflow.wait_condition(
            lambda: not isinstance(self._r.phase, Skipped) or self._r.phase.recorded
        )
        return self.status()

    @skip_update.validator
    def _validate_skip(self, input: SkipInput) -> None:
        check_skip(input)

    @workflow.update(name="resume")
    def resume_update(self, input: ResumeInput) -> ShardStatus:
        """:meth:`resume`, answered with the shard's status."""
        change.resumed(self._r)
        return self.status()

    @resume_update.validator
    def _validate_resume(self, input: ResumeInput) -> None:
        check_resume(input)
        if self._r.skip is None:
            raise ValueError(f"shard {self._shard.key} is not skipped")

    @workflow.update
    async def flush(self, input: FlushInput) -> FlushResult:
        """Wait until every row of the shard up to ``up_to_id`` is handled, or say why not: the
        shard's state, what an activity watching the table (on a task queue whose slots no
        drain needs) saw, or a timeout."""
        self._rows_committed(input.up_to_id, late=False)
        return await _flush(self._shard, lambda: self._r, input)

    @flush.validator
    def _validate_flush(self, input: FlushInput) -> None:
        check_flush(input)

    @workflow.query
    def status(self) -> ShardStatus:
        return view.status(self._shard, self._r)

    def _show(self) -> None:
        view.show(self._shard, self._r)


def _seconds_until(iso: str) -> float:
    return (datetime.fromisoformat(iso) - workflow.now()).total_seconds()


async def _wait(until: Callable[[], bool], timeout: float | timedelta, summary: str) -> bool:
    """Wait until ``until()`` (True) or a timer the UI shows as ``summary`` fires (False)."""
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    try:
        await workflow.wait_condition(until, timeout=timeout, timeout_summary=summary)
    except TimeoutError:
        return False
    return True


async def _cancelled(handle: ActivityHandle[T]) -> None:
    handle.cancel()
    with contextlib.suppress(ActivityError, asyncio.CancelledError):
        await handle


def _start_drain(
    shard: ShardRef, options: ShardOptions, *, local: bool
) -> ActivityHandle[DrainResult]:
    request = DrainInput(shard, options.drain_max_groups, options.drain_time_budget_seconds)
    timeout = timedelta(seconds=options.handler_timeout_seconds + options.drain_time_budget_seconds)
    if local:
        retry = change.retry_policy(options, maximum_interval=10.0)
        return workflow.start_local_activity(
            "drain_shard",
            request,
            result_type=DrainResult,
            start_to_close_timeout=timeout,
            retry_policy=dataclasses.replace(retry, maximum_attempts=LOCAL_DRAIN_ATTEMPTS),
        )
    return workflow.start_activity(
        "drain_shard",
        request,
        result_type=DrainResult,
        start_to_close_timeout=timeout,
        retry_policy=change.retry_policy(options),
        cancellation_type=ActivityCancellationType.TRY_CANCEL,
        summary=f"drain {shard.key}",
    )


async def _flush(
    shard: ShardRef, record: Callable[[], ShardRecord], input: FlushInput
) -> FlushResult:
    """The ``flush`` update's answer: why the rows cannot be handled now, what an activity
    watching the table (on a task queue whose slots no drain needs) saw, or a timeout."""
    up_to = input.up_to_id

    def stopped() -> FlushResult | None:
        return view.flush_stopped(shard, record(), up_to)

    if (answer := stopped()) is not None:
        return answer
    check: ActivityHandle[FlushCheck] = workflow.start_activity(
        "flush_check",
        FlushCheckInput(shard, up_to, input.timeout_seconds),
        result_type=FlushCheck,
        task_queue=flush_queue(workflow.info().task_queue),
        schedule_to_close_timeout=timedelta(seconds=input.timeout_seconds + 10),
        retry_policy=RetryPolicy(maximum_attempts=1),
        cancellation_type=ActivityCancellationType.TRY_CANCEL,
    )
    await workflow.wait_condition(lambda: check.done() or stopped() is not None)
    if not check.done():
        await _cancelled(check)
    else:
        try:
            checked = await check
        except (ActivityError, ApplicationError):
            checked = FlushCheck(handled=False)  # the table could not be read in time
        if checked.handled:
            return FlushResult(shard.key, FlushOutcome.HANDLED)
        if checked.deferred_until is not None:
            outcome = FlushOutcome.DEFERRED
            return FlushResult(
                shard.key, outcome, deferred_until=checked.deferred_until, paused=checked.paused
            )
    return stopped() or FlushResult(shard.key, FlushOutcome.TIMED_OUT)


def _start_head(
    shard: ShardRef, options: ShardOptions, b: Blocked, retry_from: float, summary: str
) -> ActivityHandle[HandleHeadResult]:
    """The category activity retrying the blocked head group, backing off from ``retry_from``."""
    head = b.head
    return workflow.start_activity(
        head.category_name,
        HandleHeadInput(shard, head.category, head.object_identifier, prior_attempts=b.attempts),
        result_type=HandleHeadResult,
        start_to_close_timeout=timedelta(seconds=options.handler_timeout_seconds),
        heartbeat_timeout=timedelta(seconds=options.heartbeat_timeout_seconds),
        retry_policy=change.retry_policy(options, initial=retry_from),
        cancellation_type=ActivityCancellationType.TRY_CANCEL,
        summary=summary,
    )


def _start_hold(
    shard: ShardRef, options: ShardOptions, held_for: HeldFor, skip: SkipInfo | None
) -> ActivityHandle[object]:
    return workflow.start_activity(
        "hold_shard",
        HoldInput(shard, held_for, skip=skip),
        start_to_close_timeout=timedelta(seconds=60),
        retry_policy=change.retry_policy(options, maximum_interval=10.0),
        summary=f"hold {shard.key}",
    )
