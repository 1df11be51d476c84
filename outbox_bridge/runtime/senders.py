"""Who sent a signal or an update, as the Temporal server recorded it.

The SDK does not hand a signal or update handler its sender, so an activity of the run looks it
up in the run's history: the ``identity`` of a ``WorkflowExecutionSignaled`` event, the
``accepted_request.meta.identity`` of a ``WorkflowExecutionUpdateAccepted`` event, and the
event's ``principal`` (the caller the server authenticated, e.g. on Temporal Cloud) when it
has one. A client identity is what the client declared unless the namespace authenticates its
clients (mTLS, Cloud API keys); the result says which it is: ``temporal:<identity>``, or
``temporal:<identity> (principal <type>:<name>)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.service import RPCError

from outbox_bridge.workflows.models import SkipInfo

log = logging.getLogger(__name__)

# History events read per page, newest first: the sender is almost always on the first page.
PAGE = 200
# Pages read at most (a run continues as new long before this).
MAX_PAGES = 100
# An identity is cut to this length before it is stored or shown.
MAX_IDENTITY = 200

SIGNALED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
UPDATE_ACCEPTED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED


def sender(identity: str, event: HistoryEvent) -> str:
    """``temporal:<identity>``, with the event's authenticated principal when it has one."""
    shown = f"temporal:{identity[:MAX_IDENTITY] or '?'}"
    if event.HasField("principal") and event.principal.name:
        principal = event.principal
        shown += f" (principal {principal.type[:MAX_IDENTITY]}:{principal.name[:MAX_IDENTITY]})"
    return shown


async def update_sender(update_id: str) -> str | None:
    """The sender of update ``update_id`` of the current activity's workflow run, None if it
    cannot be found."""

    async def accepted(event: HistoryEvent) -> str | None:
        if event.event_type != UPDATE_ACCEPTED:
            return None
        request = event.workflow_execution_update_accepted_event_attributes.accepted_request
        if request.meta.update_id != update_id:
            return None
        return sender(request.meta.identity, event)

    return await _newest(accepted)


async def skip_sender(skip: SkipInfo) -> str | None:
    """The sender of the newest ``skip`` signal or update of the current activity's workflow
    run whose argument (as plain JSON values) asked for ``skip``, None if none is found."""

    async def took(payloads: Any) -> bool:
        try:
            values = await activity.client().data_converter.decode(payloads.payloads)
        except Exception:  # an argument the workflow refused as well
            return False
        value = values[0] if len(values) == 1 else None
        return (
            isinstance(value, dict)
            and str(value.get("reason") or "").strip() == skip.reason
            and value.get("by") == skip.by
        )

    async def sent(event: HistoryEvent) -> str | None:
        if event.event_type == SIGNALED:
            signaled = event.workflow_execution_signaled_event_attributes
            if signaled.signal_name == "skip" and await took(signaled.input):
                return sender(signaled.identity, event)
        elif event.event_type == UPDATE_ACCEPTED:
            request = event.workflow_execution_update_accepted_event_attributes.accepted_request
            if request.input.name == "skip" and await took(request.input.args):
                return sender(request.meta.identity, event)
        return None

    return await _newest(sent)


async def _newest(found: Callable[[HistoryEvent], Any]) -> str | None:
    """The first non-None ``found(event)``, reading the current activity's workflow run's
    history newest first."""
    client, info = activity.client(), activity.info()
    workflow_id, run_id = info.workflow_id, info.workflow_run_id
    if not workflow_id or not run_id:
        return None  # not an activity of a workflow
    request = GetWorkflowExecutionHistoryReverseRequest(
        namespace=client.namespace,
        execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
        maximum_page_size=PAGE,
    )
    try:
        for _ in range(MAX_PAGES):
            page = await client.workflow_service.get_workflow_execution_history_reverse(request)
            for event in page.history.events:
                who = await found(event)
                if who is not None:
                    return str(who)
            if not page.next_page_token:
                break
            request.next_page_token = page.next_page_token
    except RPCError as exc:
        log.warning("cannot read the history of %s for a sender: %s", workflow_id, exc.message)
    return None
