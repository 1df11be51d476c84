"""The OutboxShard workflow: owns one shard that needs attention (a failed handler, a deferred
head, a skip, a flush) until it is empty, then gives it back and completes.

Everything it knows is one :class:`ShardRecord`, carried whole across continue-as-new; the state
is derived from it. It drains with a local activity, retries a failing head as a normal activity
named after its category, sleeps on a durable timer while the head is deferred, and carries ids
and counts only, never a payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from outbox_bridge.workflows.inputs import (
        InvalidInput,
        check_flush,
        check_handover,
        check_notify,
        check_recheck,
        check_resume,
        check_shard_options,
        check_skip,
        decode,
        note_refusal,
    )
    from outbox_bridge.workflows.models import (
        BLOCKED_CATEGORY_ATTRIBUTE,
        BLOCKED_SINCE_ATTRIBUTE,
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
        HandoverInput,
        HeldFor,
        HoldInput,
        NotifyInput,
        PauseInfo,
        RecheckInput,
        ResumeInput,
        ShardInput,
        ShardOptions,
        ShardRecord,
        ShardState,
        ShardStatus,
        ShardSummary,
        SkipInfo,
        SkipInput,
        flush_queue,
        until_text,
    )

T = TypeVar("T")

# Tries of the local drain before it falls back to a normal (visible, server-retried) one.
LOCAL_DRAIN_ATTEMPTS = 3
# How long one timer of a skipped shard lasts; when it fires, the shard waits on the next.
SKIPPED_TIMER = timedelta(days=7)
BACKOFF_COEFFICIENT = 2.0
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
        self._r = input.record or ShardRecord()
        # Per run: when this run's category activity began, and a changed head while blocked.
        self._blocked_at: datetime | None = None
        self._recheck = False
        # News of rows in this run, compared before and after a drain (which continue-as-new
        # never interrupts: not carried).
        self._news = 0
        # Until the run's body starts: a handover that starts the run comes before it.
        self._starting = True
        try:
            check_shard_options(self._options)
        except InvalidInput as exc:  # started by hand with options out of bounds
            self._options = ShardOptions()
            note_refusal(self._r.refused, "start options (defaults used)", workflow.now(), exc)

    @workflow.run
    async def run(self, input: ShardInput) -> ShardSummary:
        self._starting = False
        while True:
            self._show()
            if self._history_long() and workflow.all_handlers_finished():
                workflow.continue_as_new(ShardInput(self._shard, self._options, self._r))
            try:
                state = self._r.state
                if self._r.skip_held and state != ShardState.SKIPPED:
                    await self._take_back_skipped()
                elif state == ShardState.SKIPPED:
                    await self._stay_skipped()
                elif state == ShardState.BLOCKED:
                    await self._retry_head()
                elif state == ShardState.DRAINING:
                    await self._drain()
                elif state == ShardState.DEFERRED:
                    await self._wait_deferred()
                elif not workflow.all_handlers_finished():
                    # A flush waits for its answer: stay, and act on what comes meanwhile.
                    await workflow.wait_condition(
                        lambda: workflow.all_handlers_finished() or self._r.state != ShardState.IDLE
                    )
                else:
                    # Empty, and given back by the last drain. A signal that races the
                    # completion fails this task and is replayed first: nothing is dropped.
                    r = self._r
                    return ShardSummary(self._shard.key, r.rows_handled, r.groups_handled)
            except _Interrupted:
                pass  # continue as new at the top of the loop

    # -- what the state asks for ----------------------------------------------------------------

    async def _drain(self) -> None:
        r = self._r
        r.deferred_until = r.deferred_seconds = r.paused = None
        news = self._news
        result = await self._drain_call()
        if result is None:
            return  # skipped meanwhile: drained again once resumed
        r.parked = result.parked
        # Still draining if rows may remain, or news came while the drain ran.
        r.pending = result.more or self._news != news
        self._count(result.rows_handled, result.groups_handled)
        r.highest_seen_id = max(r.highest_seen_id, result.highest_seen_id)
        if result.failed is not None:
            r.head = result.failed
            r.attempts = 1
            r.last_error = result.failure
            r.blocked_since = workflow.now().isoformat()
            r.retry_interval_seconds = r.next_attempt_at = None
            r.pending = False
        elif not r.pending and result.deferred_until is not None:
            r.deferred_until = result.deferred_until
            r.deferred_seconds = result.deferred_seconds
            r.paused = result.paused

    async def _drain_call(self) -> DrainResult | None:
        """One drain of the shard: a local activity, falling back to a normal one (retried by
        the server without adding history) when the database or the shard lock keeps failing."""
        options = self._options
        request = DrainInput(
            self._shard, options.drain_max_groups, options.drain_time_budget_seconds
        )
        timeout = timedelta(
            seconds=options.handler_timeout_seconds + options.drain_time_budget_seconds
        )
        try:
            local = workflow.start_local_activity(
                "drain_shard",
                request,
                result_type=DrainResult,
                start_to_close_timeout=timeout,
                retry_policy=dataclasses.replace(
                    self._retry_policy(maximum_interval=10.0), maximum_attempts=LOCAL_DRAIN_ATTEMPTS
                ),
            )
            return await self._until_done(local, interruptible=False)
        except (ActivityError, ApplicationError):
            # A local activity's last failure arrives as the ApplicationError itself.
            remote = workflow.start_activity(
                "drain_shard",
                request,
                result_type=DrainResult,
                start_to_close_timeout=timeout,
                retry_policy=self._retry_policy(),
                cancellation_type=ActivityCancellationType.TRY_CANCEL,
                summary=f"drain {self._shard.key}",
            )
            return await self._until_done(remote, interruptible=False)

    async def _retry_head(self) -> None:
        """Retry the failing head group as its category activity until it succeeds, the shard
        is skipped, the head changes in the table, or the run must continue as new."""
        r = self._r
        assert r.head is not None
        head = r.head
        await self._wait_for_scheduled_attempt()
        if r.skip is not None:
            return
        self._recheck = False
        retry_from = r.retry_interval_seconds or self._options.initial_retry_seconds
        self._blocked_at = workflow.now()
        handle = workflow.start_activity(
            head.category_name,
            HandleHeadInput(
                self._shard, head.category, head.object_identifier, prior_attempts=r.attempts
            ),
            result_type=HandleHeadResult,
            start_to_close_timeout=timedelta(seconds=self._options.handler_timeout_seconds),
            heartbeat_timeout=timedelta(seconds=self._options.heartbeat_timeout_seconds),
            retry_policy=self._retry_policy(initial=retry_from),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
            summary=self._headline(),
        )
        try:
            result = await self._until_done(handle, recheck=True)
        except _Interrupted:
            self._carry_backoff(retry_from)
            raise
        except _Recheck:
            # Tried again at once (by the next turn of the loop), still blocked since then.
            self._carry_backoff(retry_from)
            r.next_attempt_at = None
            return
        if result is None:
            return  # skipped: the head stays shown
        if result.handled:
            self._count(result.rows_handled, 1)
        r.clear_head()
        r.pending = True

    async def _wait_for_scheduled_attempt(self) -> None:
        """A run carried over while blocked waits for the attempt the last run's backoff had
        scheduled: continuing as new never retries sooner than the backoff says."""
        r = self._r
        if r.next_attempt_at is None:
            return
        remaining = (datetime.fromisoformat(r.next_attempt_at) - workflow.now()).total_seconds()
        if remaining > 0:
            next_attempt = f"{self._headline()}; next attempt at {_when(r.next_attempt_at)}"
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: r.skip is not None or self._recheck or self._continue_due(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary=next_attempt,
                )
            if r.skip is not None:
                return
            if not self._recheck and self._continue_due():
                raise _Interrupted
        # The scheduled attempt: the backoff goes on from the interval after it.
        interval = r.retry_interval_seconds or self._options.initial_retry_seconds
        r.retry_interval_seconds = min(
            interval * BACKOFF_COEFFICIENT, self._options.max_retry_interval_seconds
        )
        r.next_attempt_at = None

    def _carry_backoff(self, retry_from: float) -> None:
        """The server's attempts since this run's category activity began (from the retry
        schedule) and where the backoff stands, for the next run to go on from."""
        assert self._blocked_at is not None
        r = self._r
        elapsed = (workflow.now() - self._blocked_at).total_seconds()
        interval, waited, attempts = retry_from, 0.0, 1
        ceiling = self._options.max_retry_interval_seconds
        while waited + interval <= elapsed:
            waited += interval
            attempts += 1
            interval = min(interval * BACKOFF_COEFFICIENT, ceiling)
        r.attempts += attempts
        r.retry_interval_seconds = interval
        # The server's last attempt may be just behind us: a whole interval from now.
        workflow.deprecate_patch(CARRY_BACKOFF_FROM_NOW)
        r.next_attempt_at = (workflow.now() + timedelta(seconds=interval)).isoformat()

    async def _stay_skipped(self) -> None:
        r = self._r
        if not r.skip_held:  # in the table: from now on no drain takes the shard
            skip = r.skip
            via = await self._hold(HeldFor.SKIPPED, skip)
            if skip is not None and isinstance(via, str):  # None in runs of older code
                skip.via = via
            r.skip_held = True
            self._show()
        # The timer is there for its summary, the first thing the UI shows of a skipped shard.
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: r.skip is None or self._continue_due(),
                timeout=SKIPPED_TIMER,
                timeout_summary=self._headline(),
            )

    async def _take_back_skipped(self) -> None:
        """Resumed: the table says skipped no more."""
        await self._hold(HeldFor.WORKFLOW)
        self._r.skip_held = False

    async def _wait_deferred(self) -> None:
        r = self._r
        assert r.deferred_until is not None
        if r.deferred_seconds is not None:
            # By the database's clock, which decides when the row is due.
            remaining = max(r.deferred_seconds, 0.05)
            r.deferred_seconds = None
        else:
            remaining = (datetime.fromisoformat(r.deferred_until) - workflow.now()).total_seconds()
        if remaining > 0:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: r.state != ShardState.DEFERRED or self._continue_due(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary=self._headline(),
                )
                return  # news, a skip, a handover, or a continue-as-new (which carries it)
        r.deferred_until = r.paused = None
        r.pending = True

    async def _hold(self, held_for: HeldFor, skip: SkipInfo | None = None) -> object:
        """Record in the table that this workflow holds the shard. Held for ``skip``: the
        sender of the skip as Temporal recorded it (``temporal:<identity>``), if found."""
        handle: ActivityHandle[object] = workflow.start_activity(
            "hold_shard",
            HoldInput(self._shard, held_for, skip=skip),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=self._retry_policy(maximum_interval=10.0),
            summary=f"hold {self._shard.key}",
        )
        return await self._until_done(handle, cancel_on_skip=False, interruptible=False)

    # -- waiting -----------------------------------------------------------------------------------

    def _history_long(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._options.max_history_events
        )

    def _continue_due(self) -> bool:
        """While waiting: the run should continue as new (not while a flush waits)."""
        return self._history_long() and workflow.all_handlers_finished()

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
        r = self._r
        await workflow.wait_condition(
            lambda: (
                handle.done()
                or (cancel_on_skip and r.skip is not None)
                or (recheck and self._recheck)
                or (interruptible and self._continue_due())
            )
        )
        if handle.done():
            return await handle
        skipped = cancel_on_skip and r.skip is not None
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

    def _count(self, rows: int, groups: int) -> None:
        self._r.rows_handled += rows
        self._r.groups_handled += groups

    # -- signals, updates and queries ----------------------------------------------------------

    # Signal handlers take their arguments undecoded (``*args``) and decode them here: an input
    # of any shape or out of bounds (``workflows/inputs.py``) is refused, counted and shown,
    # never applied, and never a failed workflow task.

    @workflow.signal
    def notify(self, *args: Any) -> None:
        """Rows up to ``max_id`` are committed in this shard (see :class:`NotifyInput`)."""
        notice = self._decoded("notify", args, NotifyInput, check_notify)
        if notice is not None:
            self._rows_committed(notice.max_id, late=notice.late)

    @workflow.signal
    def handover(self, *args: Any) -> None:
        """A partition gives the shard, held for this workflow already (:class:`HandoverInput`)."""
        input = self._decoded("handover", args, HandoverInput, check_handover)
        if input is None:
            return
        r = self._r
        r.max_known_id = max(r.max_known_id, input.max_id)
        if input.skip is not None and r.skip is None:
            r.skip = SkipInfo(input.skip.reason, input.skip.by, workflow.now().isoformat())
            r.skip_held = True  # the partition recorded it
        if r.head is not None or r.pending:  # known already, or the next drain finds out
            self._news += 1
            return
        if input.held_for == HeldFor.FAILED and input.head is not None:
            r.head = input.head
            r.attempts = 1  # the partition's call
            r.last_error = input.failure
            r.blocked_since = workflow.now().isoformat()
            r.paused = None
        elif input.held_for == HeldFor.DEFERRED and self._drains_handed_deferral():
            # The drain finds out why the head waits (a pause, its parked groups) for the UI.
            r.pending = True
        elif input.held_for == HeldFor.DEFERRED and input.deferred_until is not None:
            r.deferred_until = input.deferred_until
            r.deferred_seconds = input.deferred_seconds
        elif input.skip is None:
            r.pending = True

    def _drains_handed_deferral(self) -> bool:
        """A run started by a deferred handover drains first. Its marker is recorded only then,
        in the run's first activation (a later one may replay in another task)."""
        if self._starting:
            workflow.deprecate_patch(DRAIN_HANDED_DEFERRED)
        return self._starting

    @workflow.signal
    def recheck(self, *args: Any) -> None:
        """The head in the table is no longer the group this shard is blocked on: try again."""
        if self._decoded("recheck", args, RecheckInput, check_recheck) is None:
            return
        if self._r.state == ShardState.BLOCKED:
            self._recheck = True

    def _rows_committed(self, max_id: int, *, late: bool) -> None:
        r = self._r
        r.max_known_id = max(r.max_known_id, max_id)
        if late or max_id > r.highest_seen_id:
            r.pending = True
            self._news += 1

    @workflow.signal
    def skip(self, *args: Any) -> None:
        """Pause the shard: the attempt under way is cancelled, every row is kept."""
        input = self._decoded("skip", args, SkipInput, check_skip)
        if input is not None:
            self._skip(input)

    def _skip(self, input: SkipInput) -> None:
        # Skipped again while held, the new skip's sender is not looked up (shown as unknown).
        self._r.skip = SkipInfo(
            reason=input.reason.strip(), by=input.by, at=workflow.now().isoformat()
        )
        self._show()

    @workflow.signal
    def resume(self, *args: Any) -> None:
        """Continue a skipped shard; its head is retried at once, from scratch."""
        given = args != () and args != (None,)  # its input is optional
        if given and self._decoded("resume", args, ResumeInput, check_resume) is None:
            return
        self._resume()

    def _resume(self) -> None:
        r = self._r
        if r.skip is not None:
            r.skip = None
            r.clear_head()
            r.pending = True

    def _decoded(
        self, signal: str, args: Sequence[Any], model: type[T], check: Callable[[T], None]
    ) -> T | None:
        """The signal's argument as ``model``, or None when it is refused (and shown)."""
        try:
            return decode(args, model, check)
        except InvalidInput as exc:
            line = note_refusal(self._r.refused, signal, workflow.now(), exc)
            workflow.logger.warning("%s refused: %s", self._shard.workflow_id, line)
            self._describe()  # the details only: a refused signal changes no search attribute
            return None

    # The same two as updates: the caller learns whether they were taken; validators refuse.

    @workflow.update(name="skip")
    async def skip_update(self, input: SkipInput) -> ShardStatus:
        """:meth:`skip`, answered once the skip is recorded in the table."""
        self._skip(input)
        await workflow.wait_condition(lambda: self._r.skip_held or self._r.skip is None)
        return self.status()

    @skip_update.validator
    def _validate_skip(self, input: SkipInput) -> None:
        check_skip(input)

    @workflow.update(name="resume")
    def resume_update(self, input: ResumeInput) -> ShardStatus:
        """:meth:`resume`, answered with the shard's status."""
        self._resume()
        return self.status()

    @resume_update.validator
    def _validate_resume(self, input: ResumeInput) -> None:
        check_resume(input)
        if self._r.skip is None:
            raise ValueError(f"shard {self._shard.key} is not skipped")

    @workflow.update
    async def flush(self, input: FlushInput) -> FlushResult:
        """Wait until every row of the shard up to ``up_to_id`` is handled, or say why not (see
        :class:`FlushResult`)."""
        up_to = input.up_to_id
        self._rows_committed(up_to, late=False)
        stopped = self._flush_stopped(up_to)
        if stopped is not None:
            return stopped
        # An activity watches the table, on a task queue whose slots no drain needs.
        check: ActivityHandle[FlushCheck] = workflow.start_activity(
            "flush_check",
            FlushCheckInput(self._shard, up_to, input.timeout_seconds),
            result_type=FlushCheck,
            task_queue=flush_queue(workflow.info().task_queue),
            schedule_to_close_timeout=timedelta(seconds=input.timeout_seconds + 10),
            retry_policy=RetryPolicy(maximum_attempts=1),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
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
                    self._shard.key,
                    FlushOutcome.DEFERRED,
                    deferred_until=checked.deferred_until,
                    paused=checked.paused,
                )
        return self._flush_stopped(up_to) or FlushResult(self._shard.key, FlushOutcome.TIMED_OUT)

    @flush.validator
    def _validate_flush(self, input: FlushInput) -> None:
        check_flush(input)

    def _flush_stopped(self, up_to: int) -> FlushResult | None:
        """Why rows up to ``up_to`` cannot be handled now, if they cannot."""
        r = self._r
        if r.skip is not None:
            return FlushResult(self._shard.key, FlushOutcome.SKIPPED, head=r.head, skip=r.skip)
        if r.head is not None and r.head.first_id <= up_to:
            return FlushResult(
                self._shard.key,
                FlushOutcome.BLOCKED,
                head=r.head,
                blocked_since=r.blocked_since,
                error=r.last_error,
            )
        return None

    @workflow.query
    def status(self) -> ShardStatus:
        r = self._r
        return ShardStatus(
            shard=self._shard.key,
            state=r.state,
            max_known_id=r.max_known_id,
            highest_seen_id=r.highest_seen_id,
            rows_handled=r.rows_handled,
            groups_handled=r.groups_handled,
            head=r.head,
            attempts=r.attempts,
            last_error=r.last_error,
            blocked_since=r.blocked_since,
            deferred_until=r.deferred_until,
            skip=r.skip,
            refused=r.refused,
        )

    # -- what the UI shows ---------------------------------------------------------------------

    def _show(self) -> None:
        """Set the current details, and upsert the search attributes that changed (each upsert
        is a history event; none for the idle state of a run about to complete)."""
        self._describe()
        r = self._r
        state = r.state
        if state == ShardState.IDLE:
            return
        category = r.head.category_name if r.head is not None else None
        since = datetime.fromisoformat(r.blocked_since) if r.blocked_since else None
        current = workflow.info().typed_search_attributes
        wanted: list[tuple[SearchAttributeKey[Any], Any]] = [
            (STATE_ATTRIBUTE, state.value),
            (BLOCKED_CATEGORY_ATTRIBUTE, category),
            (BLOCKED_SINCE_ATTRIBUTE, since),
        ]
        changed = [
            key.value_unset() if value is None else key.value_set(value)
            for key, value in wanted
            if current.get(key) != value
        ]
        if changed:
            workflow.upsert_search_attributes(changed)

    def _headline(self) -> str:
        """The state and its reason in one line: the summary of what the run waits on."""
        r = self._r
        if r.skip is not None:
            # Short: the UI cuts a long label off (the head shows on its cancelled activity).
            skip = r.skip
            return f"skipped by {skip.by or 'an operator'} at {_when(skip.at)}: {skip.reason}"
        if r.head is not None:
            return f"blocked on {r.head.summary} since {_when(r.blocked_since)}"
        if r.paused is not None:
            return f"paused: {_pause_line(r.paused)}"
        if r.deferred_until is not None:
            return f"deferred until {_when(r.deferred_until)}"
        return r.state.value

    def _describe(self) -> None:
        # Current details are not carried over continue-as-new; every run sets them again.
        r = self._r
        lines = [
            f"**Shard** `{self._shard.key}` (table `{self._shard.table}`)",
            f"**State** {r.state.value}",
            f"**Rows handled** {r.rows_handled} in {r.groups_handled} groups",
        ]
        if r.head is not None:
            head = r.head
            lines.append(f"**Head group** {head.summary}, ids {head.first_id}–{head.last_id}")
        if r.last_error is not None:
            lines.append(f"**Attempts** {r.attempts}+, last error `{r.last_error.error_type}`")
        if r.blocked_since is not None:
            lines.append(f"**Blocked since** {r.blocked_since}")
        if r.paused is not None:
            lines.append(f"**Paused** {_pause_line(r.paused)}")
        elif r.deferred_until is not None:
            lines.append(f"**Deferred until** {r.deferred_until}")
        if r.parked:
            lines.append(f"**Parked groups** {len(r.parked)}, set aside until unparked:")
            lines += [
                f"- {g.category_name} object={g.object_identifier}, {g.rows} rows: parked by "
                f"{g.parked_by} at {_when(g.parked_at)}: {g.reason}"
                for g in r.parked
            ]
        if r.skip is not None:
            skip = r.skip
            lines.append(f"**Skipped** by {skip.who} at {skip.at}: {skip.reason}")
        if r.refused.summary is not None:
            lines.append(f"**{r.refused.summary}**")
        workflow.set_current_details("\n\n".join(lines))


def _pause_line(pause: PauseInfo) -> str:
    """``category PROJECT_UPDATE (search down, by ann, since ...)``."""
    since = f"since {_when(pause.since)}{until_text(pause.ends_at)}"
    return f"{pause.kind} {pause.name} ({pause.reason}, by {pause.paused_by}, {since})"


def _when(iso: str | None) -> str:
    """An ISO timestamp as the UI's reader wants it: to the second, in UTC."""
    if iso is None:
        return "?"
    moment = datetime.fromisoformat(iso)
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
