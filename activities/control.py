"""The activity of the OutboxControl workflow: change a table's paused categories and scopes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity

from outbox_bridge.runtime.pause_control import PauseControl
from outbox_bridge.runtime.senders import update_sender
from outbox_bridge.workflows.models import PauseChangeInput, PausesView


class ControlActivities:
    """Activity implementations bound to one :class:`PauseControl`."""

    def __init__(self, control: PauseControl) -> None:
        self._control = control

    @activity.defn(name="change_pauses")
    async def change_pauses(self, request: PauseChangeInput) -> PausesView:
        """Pause or resume a category or a scope of the table; the table's pauses after it. A
        pause records its sender as Temporal recorded the update (``temporal:<identity>``)."""
        via = None
        if request.paused and request.update_id:
            via = await update_sender(request.update_id)
        return await self._control.change(request, via=via)

    def all(self) -> list[Callable[..., Any]]:
        return [self.change_pauses]
