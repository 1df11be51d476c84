"""Replaying exported workflow histories against the installed workflow code, unsandboxed as the
worker runs it, then sandboxed (no call the sandbox refuses); a history that fails is replayed
again cut short, to find the first event the code disagrees with."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.worker import (
    Replayer,
    UnsandboxedWorkflowRunner,
    WorkflowReplayResult,
    WorkflowRunner,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from outbox_bridge.runtime.loop_thread import settle_native_threads_at_exit
from outbox_bridge.workflows.control import OutboxControl
from outbox_bridge.workflows.partition import OutboxPartition
from outbox_bridge.workflows.shard import OutboxShard

# Every workflow a worker runs: exported histories are of either.
WORKFLOWS = (OutboxShard, OutboxPartition, OutboxControl)

# Replay workers at once: a replay is a long chain of hand-offs with the SDK's core threads, so a
# few overlap their waits (one per history would cost more in starts than replays).
REPLAY_WORKERS = 4

# The sandbox imports the workflow modules afresh for each history. Under pytest, those of a
# package that provides a pytest plugin (this one, outbox_bridge.testing) can be assertion-
# rewritten, and a rewritten module imports ``_pytest.assertion.rewrite``: re-imported in every
# sandbox, with pytest, pluggy and pygments behind it, that cost about a CPU-second per history.
# pytest is no workflow code: the sandbox takes the host's, as it takes the standard library's.
SANDBOX_RESTRICTIONS = SandboxRestrictions.default.with_passthrough_modules("_pytest")


@functools.cache
def _quiet_runtime() -> Runtime:
    """A runtime that logs errors only (the core warns of each workflow task a replay fails)."""
    errors_only = TelemetryFilter(core_level="ERROR", other_level="ERROR")
    return Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(filter=errors_only)))


class HistoryError(ValueError):
    """A file or history that cannot be replayed."""


def load_history(path: Path) -> WorkflowHistory:
    """The history in ``path``, as ``outbox-bridge history export``, the Temporal CLI and the
    UI's download write it. Raises :class:`HistoryError`."""
    try:
        recorded = WorkflowHistory.from_json(path.stem, json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, json_format.Error) as exc:
        raise HistoryError(f"not a workflow history ({exc})") from None
    check_history(recorded)
    started = recorded.events[0].workflow_execution_started_event_attributes
    workflow_id = getattr(started, "workflow_id", "") or path.stem
    return WorkflowHistory(workflow_id, recorded.events)


def check_history(history: WorkflowHistory) -> None:
    """Raise :class:`HistoryError` unless ``history`` can be replayed: it begins with the
    workflow's start and holds a workflow task."""
    events = history.events
    if not events or events[0].event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
        raise HistoryError("not a workflow history (it does not begin with a start event)")
    if not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED for e in events):
        # Nothing to replay (and the SDK's replayer would wait forever for a workflow task).
        raise HistoryError("the history has no workflow task to replay")


# What an event names, by the attributes it carries.
_DETAILS: dict[str, Callable[[Any], str]] = {
    "activity_task_scheduled_event_attributes": lambda a: a.activity_type.name,
    "timer_started_event_attributes": lambda a: f"timer {a.timer_id}",
    "marker_recorded_event_attributes": lambda a: a.marker_name,
    "workflow_execution_signaled_event_attributes": lambda a: a.signal_name,
    "workflow_execution_update_accepted_event_attributes": lambda a: a.accepted_request.input.name,
}


def describe_event(event: HistoryEvent) -> str:
    """``event 6 ActivityTaskScheduled PROJECT_UPDATE``: id, type and what the event names."""
    kind = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
    name = "".join(part.capitalize() for part in kind.split("_"))
    which = event.WhichOneof("attributes")
    detail = _DETAILS[which](getattr(event, which)) if which in _DETAILS else ""
    return f"event {event.event_id} {name}" + (f" {detail}" if detail else "")


# The SDK wraps the core's failure in Rust debug output: its message is what matters.
_CORE_MESSAGE = re.compile(r'message: "((?:[^"\\]|\\.)*)"')


def _reason(error: Exception) -> str:
    found = _CORE_MESSAGE.search(str(error))
    return found.group(1).replace('\\"', '"') if found else str(error)


@dataclass(frozen=True)
class ReplayFailure:
    """Why a history does not replay, and the first event the code disagrees with (if found)."""

    source: str
    reason: str
    runner: str | None = None
    event: HistoryEvent | None = None

    def __str__(self) -> str:
        where = f" at {describe_event(self.event)}" if self.event is not None else ""
        runner = f" ({self.runner})" if self.runner else ""
        return f"{self.source}: {self.reason}{where}{runner}"


class HistoryReplayer:
    """Replays histories of the outbox workflows, unsandboxed like the worker runs them and,
    with ``sandboxed``, under the sandbox as well."""

    def __init__(self, *, sandboxed: bool = True) -> None:
        # The SDK's threads of the replay workers may still call into Python at exit.
        settle_native_threads_at_exit()
        runners: list[tuple[str, WorkflowRunner]] = [("unsandboxed", UnsandboxedWorkflowRunner())]
        if sandboxed:
            runners.append(
                ("sandboxed", SandboxedWorkflowRunner(restrictions=SANDBOX_RESTRICTIONS))
            )
        self._replayers = [
            (
                name,
                Replayer(workflows=list(WORKFLOWS), workflow_runner=run, runtime=_quiet_runtime()),
            )
            for name, run in runners
        ]

    async def replay_all(
        self, histories: Sequence[Path | WorkflowHistory]
    ) -> list[ReplayFailure | None]:
        """Per history (a file, or a ``WorkflowHistory``), in order: None if it replays under
        every runner, else why it does not under the first it fails under."""
        failures: list[ReplayFailure | None] = [None] * len(histories)
        readable: dict[int, WorkflowHistory] = {}
        for index, history in enumerate(histories):
            try:
                recorded = load_history(history) if isinstance(history, Path) else history
                check_history(recorded)
                readable[index] = recorded
            except HistoryError as exc:
                failures[index] = ReplayFailure(_source(history), str(exc))
        for name, replayer in self._replayers:
            todo = [index for index in readable if failures[index] is None]
            results = await _replay_in_workers(replayer, [readable[i] for i in todo])
            for index, result in zip(todo, results, strict=True):
                if result.replay_failure is not None:
                    event = await _first_failing_event(replayer, readable[index])
                    reason = _reason(result.replay_failure)
                    failures[index] = ReplayFailure(_source(histories[index]), reason, name, event)
        return failures


def _source(history: Path | WorkflowHistory) -> str:
    return str(history) if isinstance(history, Path) else f"history of {history.workflow_id}"


async def _replay_in_workers(
    replayer: Replayer, histories: Sequence[WorkflowHistory]
) -> list[WorkflowReplayResult]:
    """The result of each history, in order (history ``i`` in worker ``i % REPLAY_WORKERS``)."""
    shares = [histories[start::REPLAY_WORKERS] for start in range(REPLAY_WORKERS)]
    replayed = await asyncio.gather(*(_replay_in_one_worker(replayer, s) for s in shares))
    return [replayed[i % REPLAY_WORKERS][i // REPLAY_WORKERS] for i in range(len(histories))]


async def _replay_in_one_worker(
    replayer: Replayer, histories: Sequence[WorkflowHistory]
) -> list[WorkflowReplayResult]:
    if not histories:
        return []

    async def each() -> AsyncIterator[WorkflowHistory]:
        for history in histories:
            yield history

    async with replayer.workflow_replay_iterator(each()) as results:
        return [result async for result in results]


async def _first_failing_event(replayer: Replayer, history: WorkflowHistory) -> HistoryEvent | None:
    """The event whose arrival makes the replay fail: a binary search over the history cut
    after each event (a few replays of a short prefix each). None if no cut fails."""
    events: Sequence[HistoryEvent] = history.events
    types = [event.event_type for event in events]
    if EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED not in types:
        return None
    started = types.index(EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED)

    async def fails(length: int) -> bool:
        cut = WorkflowHistory(history.workflow_id, list(events[:length]))
        result = await replayer.replay_workflow(cut, raise_on_replay_failure=False)
        return result.replay_failure is not None

    # A history needs its first workflow task to be replayed at all: cut after it at least.
    low, high = started + 1, len(events)
    if not await fails(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if await fails(middle):
            high = middle
        else:
            low = middle + 1
    return events[low - 1]
