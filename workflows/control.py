"""The OutboxControl workflow: one per table, where a person pauses and resumes a whole category
or scope (see the workflows reference). It holds nothing ``<table>_pauses`` does not."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from outbox_bridge.workflows.inputs import (
        InvalidInput,
        check_pause_change,
        check_pauses_view,
        decoded,
    )
    from outbox_bridge.workflows.models import (
        ControlInput,
        PauseChange,
        PauseChangeInput,
        PausesView,
        Refusals,
        until_text,
        via_text,
    )

CHANGE_TIMEOUT = timedelta(seconds=30)
# One timer's length; it is there for its summary, the first thing the UI shows.
HEADLINE_TIMER = timedelta(days=7)
# Pauses named in the headline; the current details list them all.
HEADLINE_PAUSES = 5


@workflow.defn(name="OutboxControl")
class OutboxControl:
    @workflow.init
    def __init__(self, input: ControlInput) -> None:
        self._table = input.table
        self._view = input.view
        self._changed = False  # the view changed since it was last shown
        self._refused = Refusals()  # refresh signals not applied (this run)

    @workflow.run
    async def run(self, input: ControlInput) -> None:
        while True:
            self._publish()
            self._changed = False
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._changed or workflow.info().is_continue_as_new_suggested(),
                    timeout=HEADLINE_TIMER,
                    timeout_summary=self._headline(),
                )
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(ControlInput(self._table, self._view))

    # -- updates, signal and query ----------------------------------------------------------------

    @workflow.update
    async def pause(self, change: PauseChange) -> PausesView:
        """Pause what ``change`` names until ``unpause``; answers with every pause."""
        return await self._change(change, paused=True)

    @pause.validator
    def _check_pause(self, change: PauseChange) -> None:
        if isinstance(change.reason, str) and not change.reason.strip():
            raise InvalidInput("a pause needs a reason")
        check_pause_change(change, pausing=True)

    @workflow.update
    async def unpause(self, change: PauseChange) -> PausesView:
        """Resume what ``change`` names; answers with every pause left."""
        return await self._change(change, paused=False)

    @unpause.validator
    def _check_unpause(self, change: PauseChange) -> None:
        check_pause_change(change, pausing=False)

    @workflow.signal
    def refresh(self, *args: Any) -> None:
        """The table's pauses (:class:`PausesView`), as the worker read them after a change made
        elsewhere. A view out of bounds or of another shape is refused and shown."""
        view = decoded("refresh", args, PausesView, check_pauses_view, self._refused)
        if view is None:
            self._publish()  # the details only: the headline timer stands
        elif view != self._view:  # the bridge also refreshes after the updates' own changes
            self._view = view
            self._changed = True

    @workflow.query
    def pauses(self) -> PausesView:
        return self._view

    async def _change(self, change: PauseChange, *, paused: bool) -> PausesView:
        update = workflow.current_update_info()
        view: PausesView = await workflow.execute_activity(
            "change_pauses",
            PauseChangeInput(self._table, change, paused, update.id if update else None),
            result_type=PausesView,
            start_to_close_timeout=CHANGE_TIMEOUT,
            # A name the app does not know fails at once; a database outage is retried.
            retry_policy=RetryPolicy(
                maximum_attempts=5, non_retryable_error_types=["ConfigurationError"]
            ),
            summary="pause" if paused else "unpause",
        )
        self._view = view
        self._changed = True
        return view

    # -- what the UI shows ----------------------------------------------------------------------

    def _headline(self) -> str:
        pauses = self._view.pauses
        if not pauses:
            return "nothing paused (the pause update pauses a category or a scope)"
        named = [
            f"{p.kind} {p.name} by {p.paused_by}{via_text(p.paused_via)}{until_text(p.ends_at)}: "
            f"{p.reason}"
            for p in pauses
        ]
        more = len(named) - HEADLINE_PAUSES
        shown = "; ".join(named[:HEADLINE_PAUSES]) + (f"; and {more} more" if more > 0 else "")
        return f"paused: {shown}"

    def _publish(self) -> None:
        lines = [
            f"**Table** `{self._table}`: pause or resume a whole category or scope with the "
            '`pause` and `unpause` updates, e.g. `{"category": "PROJECT_UPDATE", "reason": '
            '"search is down"}` or `{"scope": "ORGANIZATION"}`'
        ]
        if not self._view.pauses:
            lines.append("**Paused** nothing")
        for p in self._view.pauses:
            by = f"{p.paused_by}{via_text(p.paused_via)}"
            since = f"since {p.since}{until_text(p.ends_at)}"
            lines.append(f"**Paused** {p.kind} {p.name} ({p.number}) by {by} {since}: {p.reason}")
        if self._refused.summary is not None:
            lines.append(f"**{self._refused.summary}**")
        workflow.set_current_details("\n\n".join(lines))
