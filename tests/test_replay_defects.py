"""Histories recorded by the fault suite that do not replay: each a known defect, kept so that
its fix can be shown to replay them (and then move them into the replay corpus).

``always-two-workers-unhandled-command``: an OutboxShard run under ``--shard-workflows always``
with two workers, one killed again and again (tests/faults/test_crashes.py). Its eager first
task timed out on the killed worker; the next task ran the drain (a local activity, marker 9)
and, in the task after, blocked on a failing head, writing the ``state-search-attributes``
patch marker (event 13); a completion was then refused with UnhandledCommand (event 23). Every
later task replays the history and fails: the replay reaches ``blocked`` (and asks for the
patch) in the first task already, so the marker finds no matching command, and the shard's
workflow is stuck.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

DEFECTS = Path(__file__).parent / "histories" / "defects"


@pytest.mark.xfail(
    strict=True,
    reason="nondeterminism: 'Non-deprecated patch marker encountered for change "
    "state-search-attributes, but there is no corresponding change command'",
)
async def test_an_always_mode_history_refused_with_unhandled_command_replays() -> None:
    path = DEFECTS / "always-two-workers-unhandled-command.json"
    history = WorkflowHistory.from_json("defect", json.loads(path.read_text()))
    replayer = Replayer(
        workflows=[OutboxShard, OutboxPartition], workflow_runner=UnsandboxedWorkflowRunner()
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
