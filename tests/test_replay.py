"""Every recorded history replays against the current workflow code (the design contract,
invariant 8: docs/explanation/contract.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

from outbox_bridge.testing import assert_replays

HISTORY_FOLDER = Path(__file__).parent / "histories"
HISTORIES = sorted(HISTORY_FOLDER.glob("*.json"))


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


def newest(scenario: str) -> Path:
    """The newest corpus's history of ``scenario`` (its first run, when it has several)."""
    stems = (scenario, f"{scenario}_run1")
    [path] = [p for p in latest_corpus(HISTORIES) if p.stem.split("-", 1)[1] in stems]
    return path


def first_scheduled_activity(recorded: dict[str, Any]) -> int:
    """The id of the first ActivityTaskScheduled event of ``recorded``."""
    return min(
        int(event["eventId"])
        for event in recorded["events"]
        if "activityTaskScheduledEventAttributes" in event
    )


def test_corpus_versions_compare_as_numbers() -> None:
    paths = [Path(f"{name}.json") for name in ("v9-drain", "v10-drain", "v10-flush_run1", "v2-x")]
    assert [p.stem for p in latest_corpus(paths)] == ["v10-drain", "v10-flush_run1"]


def test_the_corpus_covers_the_required_scenarios() -> None:
    # The newest version of the corpus covers every scenario; older versions stay to be replayed.
    names = {p.stem.split("-", 1)[1].split("_run")[0] for p in latest_corpus(HISTORIES)}
    assert {
        # Each shard workflow drains, retries, waits or continues as new after a handover.
        "drain",
        "failing_then_succeeding",
        "skip_resume",
        "continue_as_new",
        "deferred",
        "flush",
        "handover_failed",
        "handover_deferred",
        "skip_healthy",
        # The partition that handed each shard over and took it back.
        "drain_partition",
        "handover_failed_partition",
        "handover_deferred_partition",
    } <= names
    kinds = {e.event_type for p in HISTORIES for e in load(p).events}
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW in kinds
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in kinds  # skip cancels the attempt
    assert EventType.EVENT_TYPE_TIMER_STARTED in kinds


def patch_markers(path: Path) -> set[str]:
    """The patches a recorded run asked for: the ids of its patch markers."""
    return {
        json.loads(payload.data)["id"]
        for event in load(path).events
        if event.marker_recorded_event_attributes.marker_name == "core_patch"
        for payload in event.marker_recorded_event_attributes.details["patch-data"].payloads
    }


def test_the_corpus_holds_only_runs_that_took_every_patched_branch() -> None:
    """The code takes the patched branch of every patch it knows: a history whose run passed a
    patch's place without its marker is of code this one no longer supports, and is not kept.
    Each scenario recorded again later shows which markers its run records."""
    newest_markers = {
        p.stem.split("-", 1)[1]: patch_markers(p) for p in sorted(HISTORIES, key=version)
    }
    for path in HISTORIES:
        missing = newest_markers[path.stem.split("-", 1)[1]] - patch_markers(path)
        assert not missing, f"{path.name}: recorded without {sorted(missing)}"


def test_every_recorded_history_replays() -> None:
    """Unsandboxed, as the worker runs the workflows, and under the sandbox, which proves the
    code makes no call the sandbox would refuse as nondeterministic."""
    assert_replays(HISTORY_FOLDER)


# -- assert_replays ---------------------------------------------------------------------------------


def scheduling_another_activity(recorded: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` as if the workflow had scheduled another category's activity."""
    for event in recorded["events"]:
        attributes = event.get("activityTaskScheduledEventAttributes")
        if attributes:
            attributes["activityType"]["name"] = "USER_UPDATE"
    return recorded


def tampered(tmp_path: Path) -> Path:
    """A recorded history as if the workflow had scheduled another category's activity."""
    recorded = json.loads(newest("failing_then_succeeding").read_text())
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(scheduling_another_activity(recorded)))
    return path


def pascal_case(name: str, prefix: str) -> str:
    """``EVENT_TYPE_WORKFLOW_EXECUTION_STARTED`` as the Temporal UI writes it:
    ``WorkflowExecutionStarted``."""
    return "".join(part.capitalize() for part in name.removeprefix(prefix).split("_"))


def as_the_ui_writes_it(recorded: dict[str, Any]) -> dict[str, Any]:
    """A history in the JSON of the Temporal UI's download (and older CLIs): enum values
    without their prefix, in PascalCase."""
    for event in recorded["events"]:
        event["eventType"] = pascal_case(event["eventType"], "EVENT_TYPE_")
        for value in event.values():
            queue = value.get("taskQueue") if isinstance(value, dict) else None
            if queue and "kind" in queue:
                queue["kind"] = pascal_case(queue["kind"], "TASK_QUEUE_KIND_")
    return recorded


def test_assert_replays_reads_the_sdks_and_the_uis_json(tmp_path: Path) -> None:
    """``outbox-bridge history export`` writes the SDK's JSON indented (the corpus's files);
    the SDK's ``to_json`` writes it as it is; the UI's download names enums its own way.
    Each replays, and each fails the same way when the code disagrees with it."""
    exported = newest("failing_then_succeeding")
    sdk = tmp_path / "sdk" / "history.json"
    ui = tmp_path / "ui" / "history.json"
    for path in (sdk, ui):
        path.parent.mkdir()
    sdk.write_text(load(exported).to_json())
    assert sdk.read_text() != exported.read_text() and "EVENT_TYPE_" in sdk.read_text()
    ui.write_text(json.dumps(as_the_ui_writes_it(json.loads(exported.read_text()))))
    assert "EVENT_TYPE_" not in ui.read_text() and "WorkflowTaskScheduled" in ui.read_text()
    assert_replays(exported, sdk, ui)

    for path in (sdk, ui):
        path.write_text(json.dumps(scheduling_another_activity(json.loads(path.read_text()))))
    with pytest.raises(AssertionError) as raised:
        assert_replays(sdk, ui)
    message = str(raised.value)
    assert message.startswith("2 of 2 histories do not replay"), message
    for path in (sdk, ui):
        assert f"{path}: [TMPRL1100] Nondeterminism error" in message, message
    assert message.count("ActivityTaskScheduled USER_UPDATE (unsandboxed)") == 2, message


def test_assert_replays_takes_files_folders_patterns_and_histories(tmp_path: Path) -> None:
    drain = newest("drain")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "drain.json").write_text(drain.read_text())
    assert_replays(
        drain,
        str(tmp_path / "nested"),
        f"{tmp_path}/**/*.json",
        load(newest("flush")),
    )


def test_a_nondeterministic_history_fails_naming_the_file_and_the_event(tmp_path: Path) -> None:
    bad = tampered(tmp_path)
    at = first_scheduled_activity(json.loads(bad.read_text()))
    drain = newest("drain")
    with pytest.raises(AssertionError) as raised:
        assert_replays(drain, bad)
    message = str(raised.value)
    assert message.startswith("1 of 2 histories do not replay"), message
    assert f"{bad}: [TMPRL1100] Nondeterminism error" in message, message
    assert f"at event {at} ActivityTaskScheduled USER_UPDATE (unsandboxed)" in message, message
    assert drain.stem not in message


def test_among_many_histories_the_one_that_does_not_replay_is_named(tmp_path: Path) -> None:
    """Histories are replayed several at a time: a failure is reported for its own history."""
    corpus = latest_corpus(HISTORIES)
    bad = tampered(tmp_path)
    with pytest.raises(AssertionError) as raised:
        assert_replays(*corpus[:5], bad, *corpus[5:])
    message = str(raised.value)
    assert message.startswith(f"1 of {len(corpus) + 1} histories do not replay"), message
    [failure] = message.splitlines()[1:]
    assert failure.startswith(f"  {bad}: [TMPRL1100] Nondeterminism error"), failure


def test_assert_replays_refuses_what_is_no_history(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no history file matches"):
        assert_replays(f"{tmp_path}/*.json")
    with pytest.raises(FileNotFoundError, match="no history file"):
        assert_replays(tmp_path / "missing.json")
    (tmp_path / "notes.json").write_text('{"events": "none"}')
    with pytest.raises(AssertionError, match=r"notes\.json: not a workflow history"):
        assert_replays(tmp_path)


async def test_assert_replays_in_an_async_test(tmp_path: Path) -> None:
    assert_replays(newest("deferred"))
    with pytest.raises(AssertionError, match=r"tampered\.json"):
        assert_replays(tampered(tmp_path))
