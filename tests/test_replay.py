"""Every recorded history replays against the current workflow code (the design contract,
invariant 8: docs/explanation/contract.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def load(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(f"replay-{path.stem}", json.loads(path.read_text()))


def version(path: Path) -> int:
    """The corpus version of a recorded history: ``v10-drain.json`` is of version 10."""
    prefix = path.stem.split("-", 1)[0]
    assert prefix[0] == "v" and prefix[1:].isdigit(), f"{path.name}: no vN- prefix"
    return int(prefix[1:])


def latest_corpus(paths: list[Path]) -> list[Path]:
    """The histories of the newest corpus version (versions compare as numbers: v10 > v9)."""
    newest = max(version(p) for p in paths)
    return [p for p in paths if version(p) == newest]


def test_corpus_versions_compare_as_numbers() -> None:
    paths = [Path(f"{name}.json") for name in ("v9-drain", "v10-drain", "v10-flush_run1", "v2-x")]
    assert [p.stem for p in latest_corpus(paths)] == ["v10-drain", "v10-flush_run1"]


def test_the_corpus_covers_the_required_scenarios() -> None:
    # The newest version of the corpus covers every scenario; older versions stay to be replayed.
    names = {p.stem.split("-", 1)[1].split("_run")[0] for p in latest_corpus(HISTORIES)}
    assert {
        "drain",
        "failing_then_succeeding",
        "skip_resume",
        "continue_as_new",
        "deferred",
        "lingering",
        "complete_when_empty",
        "lingering_from_start",
        "flush",
        # Since v5, on demand: partitions, handovers, giving a shard back.
        "handover_failed",
        "handover_failed_partition",
        "handover_deferred",
        "skip_healthy",
        "flush_on_demand",
        "blocked_continue_as_new",
    } <= names
    kinds = {e.event_type for p in HISTORIES for e in load(p).events}
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW in kinds
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in kinds  # skip cancels the attempt
    assert EventType.EVENT_TYPE_TIMER_STARTED in kinds


# The worker runs the workflow unsandboxed (it is library code); replaying under the sandbox as
# well proves the code makes no call the sandbox would refuse as nondeterministic.
RUNNERS = {"unsandboxed": UnsandboxedWorkflowRunner(), "sandboxed": SandboxedWorkflowRunner()}


@pytest.mark.parametrize("runner", RUNNERS.values(), ids=list(RUNNERS))
@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays(path: Path, runner: WorkflowRunner) -> None:
    replayer = Replayer(workflows=[OutboxShard, OutboxPartition], workflow_runner=runner)
    result = await replayer.replay_workflow(load(path), raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
