"""Histories recorded by the fault suite that do not replay: each a known defect, kept so that
its fix can be shown to replay (and then move them into the replay corpus).

``always-two-workers-unhandled-command``: an OutboxShard run under ``--shard-workflows always``
with two workers, one killed again and again (tests/faults/test_crashes.py). Its eager first
task timed out on the killed worker; the next task ran the drain (a local activity, marker 9)
and, in the task after, blocked on a failing head, writing the ``state-search-attributes``
patch marker (event 13); a completion was then refused with UnhandledCommand (event 23). Every
later task replays the history and fails: the replay reaches ``blocked`` (and asks for the
patch) in the first task already, so the marker finds no matching command, and the shard's
workflow is stuck.

The cause: task 8 completed with the drain's marker and asked the server for a new task
(event 11 was started by that completion) before the workflow had the result. The SDK's core
forces a new task so when it answers a query in the completion while a local activity's result
is not yet given to the workflow (the bridge's supervisor queries shard workflows), or when a
local activity outlives 80% of the task timeout (not the case here: the task took 1.2 s); the
history does not record which. A replay gives the result in the task that recorded its
marker, one task earlier than the run had it. Commands
still match in order across that boundary, but ``workflow.patched`` during replay is true only
if the marker lies in the very task that asks, so the first patch asked for after a local
activity's result is refused. The workflow now decides its patches in a run's first activation
(``patches-at-start``), which no such task boundary moves. The recorded history itself was written by code
that asked later, and no workflow code can tell, when the replay gives the drain's result,
that the run had it one task later: it stays a defect (strict xfail); the same race under the
current code is shown to replay by the history derived from it.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from outbox_bridge.testing import assert_replays
from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import PATCHES_AT_START_PATCH, OutboxShard

DEFECTS = Path(__file__).parent / "histories" / "defects"
UNHANDLED = DEFECTS / "always-two-workers-unhandled-command.json"


@pytest.mark.xfail(
    strict=True,
    reason="recorded by code that asked for its patches after the drain's result, which the "
    "replay gives one task earlier than the run had it: 'Non-deprecated patch marker "
    "encountered for change state-search-attributes, but there is no corresponding change "
    "command'",
)
async def test_an_always_mode_history_refused_with_unhandled_command_replays() -> None:
    history = WorkflowHistory.from_json("defect", json.loads(UNHANDLED.read_text()))
    replayer = Replayer(
        workflows=[OutboxShard, OutboxPartition], workflow_runner=UnsandboxedWorkflowRunner()
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure


def _json_payload(value: Any) -> dict[str, Any]:
    data = json.dumps(value, separators=(",", ":")).encode()
    return {
        "metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
        "data": base64.b64encode(data).decode(),
    }


def _as_current_code_records(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The defect's events as the current code records the same run: its patch marker (with the
    change-version upsert the SDK adds) in the first completed task, before the drain's marker,
    and no patch marker after the drain's result (events 13, 14, 16 and 17 go). The race stays:
    the drain's marker in task 8, the workflow going on with its result in task 11. Ends with
    the task after the UnhandledCommand, the first one that failed to replay."""
    by_id = {int(event["eventId"]): event for event in events}
    marker = copy.deepcopy(by_id[13])
    marker["markerRecordedEventAttributes"]["details"]["patch-data"]["payloads"] = [
        _json_payload({"id": PATCHES_AT_START_PATCH, "deprecated": False})
    ]
    marker["markerRecordedEventAttributes"]["workflowTaskCompletedEventId"] = "8"
    upsert = copy.deepcopy(by_id[14])
    version = upsert["upsertWorkflowSearchAttributesEventAttributes"]
    version["workflowTaskCompletedEventId"] = "8"
    fields = version["searchAttributes"]["indexedFields"]["TemporalChangeVersion"]
    fields["data"] = _json_payload([PATCHES_AT_START_PATCH])["data"]
    kept = [*range(1, 9), marker, upsert, 9, 10, 11, 12, 15, *range(18, 27)]
    new_ids: dict[int, int] = {}
    derived = []
    for position, item in enumerate(kept, start=1):
        if isinstance(item, int):
            new_ids[item] = position
            item = copy.deepcopy(by_id[item])
        derived.append({**item, "eventId": str(position)})

    def renumber(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith("EventId") and key != "eventId" and isinstance(value, str):
                    node[key] = str(new_ids.get(int(value), int(value)))
                else:
                    renumber(value)
        elif isinstance(node, list):
            for value in node:
                renumber(value)

    for event in derived:
        renumber({key: value for key, value in event.items() if key != "eventId"})
    return derived


def test_the_same_race_replays_under_the_current_code() -> None:
    recorded = json.loads(UNHANDLED.read_text())
    events = _as_current_code_records(recorded["events"])
    # The race is still in it: the drain's result is recorded a task before the one that blocks.
    kinds = [(event["eventId"], event["eventType"]) for event in events]
    assert kinds[8:14] == [
        ("9", "EVENT_TYPE_MARKER_RECORDED"),  # patches-at-start
        ("10", "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"),
        ("11", "EVENT_TYPE_MARKER_RECORDED"),  # the drain's result
        ("12", "EVENT_TYPE_WORKFLOW_TASK_SCHEDULED"),
        ("13", "EVENT_TYPE_WORKFLOW_TASK_STARTED"),
        ("14", "EVENT_TYPE_WORKFLOW_TASK_COMPLETED"),
    ]
    assert events[14]["eventType"] == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"  # blocked
    assert events[15]["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    assert events[-1]["eventType"] == "EVENT_TYPE_WORKFLOW_TASK_STARTED"
    derived = WorkflowHistory.from_json("derived", {**recorded, "events": events})
    assert_replays(derived)
