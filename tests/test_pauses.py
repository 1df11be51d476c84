"""Pausing a whole category or scope at run time (`outbox-bridge pause`, `unpause`, `pauses`),
through the command line and a real worker: the paused rows wait, kept, and so do the rows
behind them in their shards; other shards drain; a restart keeps the pause; a resume drains
everything in order."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ActivityError
from temporalio.service import RPCError

from outbox_bridge import OutboxMessage
from outbox_bridge.db.pauses import read_pauses
from outbox_bridge.testing import assert_replays
from outbox_bridge.workflows.models import PauseChange, PausesView, ShardState, ShardStatus
from tests.harness import (
    COMMAND_POLL_INTERVAL,
    Category,
    Recorder,
    fast_settings,
    fresh_app,
    refusal,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli
from tests.workflows.doubles import current_details

# A sweep only every two minutes: what ends a pause within a test's wait is the notification
# that the resume sends (the bridge sweeps at once), not the periodic sweep.
SLOW_SWEEP = 120.0


def _row(category: Category, shard: int, obj: int) -> dict[str, Any]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj}


async def _listed(servers: Any, table: str) -> dict[str, dict[str, Any]]:
    code, out, err = await cli(servers, table, "shards", "--json")
    assert code == 0, err
    return {entry["shard"]: entry for entry in json.loads(out)}


async def _states(servers: Any, table: str, shards: Sequence[str], state: str) -> bool:
    listed = await _listed(servers, table)
    return all(listed.get(shard, {}).get("state") == state for shard in shards)


def _in_order(recorder: Recorder, ids: Sequence[int]) -> bool:
    handled = recorder.ids()
    return [i for i in handled if i in ids] == list(ids)


async def _handled(recorder: Recorder, ids: Sequence[int]) -> bool:
    return set(ids) <= set(recorder.ids())


async def test_a_paused_category_waits_in_order_survives_a_restart_and_resumes(
    servers, engine
) -> None:
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings(sweep_interval=SLOW_SWEEP)
    code, out, err = await cli(
        servers, table, "pause", "--category", "project_update", "--reason", "search down"
    )
    assert code == 0, err
    assert "category PROJECT_UPDATE (2) paused: search down" in out
    async with running_worker(servers, app, settings):
        # ORGANIZATION:1 starts with a paused row; ORGANIZATION:2 has one after a due row;
        # ORGANIZATION:3 and USER:4 have none.
        one = await write_rows(
            engine, app, [_row(Category.PROJECT_UPDATE, 1, 10), _row(Category.MEMBER_UPDATE, 1, 1)]
        )
        two = await write_rows(
            engine,
            app,
            [
                _row(Category.ORGANIZATION_UPDATE, 2, 2),
                _row(Category.PROJECT_UPDATE, 2, 20),
                _row(Category.MEMBER_UPDATE, 2, 3),
            ],
        )
        free = await write_rows(
            engine,
            app,
            [_row(Category.ORGANIZATION_UPDATE, 3, 3), _row(Category.USER_UPDATE, 4, 4)],
        )
        await wait_until(lambda: _handled(recorder, [*free, two[0]]), what="unpaused rows")
        paused = ["ORGANIZATION:1", "ORGANIZATION:2"]
        await wait_until(
            lambda: _states(servers, table, paused, "paused"),
            interval=COMMAND_POLL_INTERVAL,
            what="paused shards",
        )
        waiting = [*one, *two[1:]]
        assert not set(waiting) & set(recorder.ids())  # the later MEMBER_UPDATEs wait too
        code, out, err = await cli(servers, table, "status", "ORGANIZATION:1", "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["state"] == "paused"
        assert "category PROJECT_UPDATE by" in shown["paused"] and "search down" in shown["paused"]
        # A flush answers at once that the head waits, and names the pause it waits for.
        code, out, err = await cli(
            servers, table, "flush", "ORGANIZATION:1", "--json", "--task-queue", settings.task_queue
        )
        assert code == 1, err
        flushed = json.loads(out)
        assert flushed["outcome"] == "deferred"
        assert (flushed["paused"]["name"], flushed["paused"]["reason"]) == (
            "PROJECT_UPDATE",
            "search down",
        )

    # A new worker keeps the pause: it is in the table.
    async with running_worker(servers, app, settings):
        [later] = await write_rows(engine, app, [_row(Category.USER_UPDATE, 5, 5)])
        await wait_until(lambda: _handled(recorder, [later]), what="the new worker draining")
        await wait_until(
            lambda: _states(servers, table, paused, "paused"),
            interval=COMMAND_POLL_INTERVAL,
            what="still paused",
        )
        assert not set(waiting) & set(recorder.ids())
        code, out, err = await cli(servers, table, "pauses", "--json")
        assert code == 0, err
        [listed] = json.loads(out)
        assert (listed["kind"], listed["name"], listed["reason"]) == (
            "category",
            "PROJECT_UPDATE",
            "search down",
        )

        code, out, err = await cli(servers, table, "unpause", "--category", "PROJECT_UPDATE")
        assert code == 0, err
        assert "category PROJECT_UPDATE (2) resumed" in out
        await wait_until(lambda: table_empty(engine, app), what="the paused rows after resume")
    assert _in_order(recorder, one) and _in_order(recorder, two)
    assert sorted(recorder.ids()) == sorted([*one, *two, *free, later])  # each once


async def test_a_paused_scope_waits_and_resumes(servers, engine) -> None:
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings(sweep_interval=SLOW_SWEEP)
    async with running_worker(servers, app, settings):
        code, _, err = await cli(servers, table, "pause", "--scope", "USER", "--reason", "gdpr")
        assert code == 0, err
        users = await write_rows(
            engine, app, [_row(Category.USER_UPDATE, 7, 1), _row(Category.USER_UPDATE, 7, 2)]
        )
        organizations = await write_rows(engine, app, [_row(Category.PROJECT_UPDATE, 7, 3)])
        await wait_until(lambda: _handled(recorder, organizations), what="the other scope")
        await wait_until(
            lambda: _states(servers, table, ["USER:7"], "paused"),
            interval=COMMAND_POLL_INTERVAL,
            what="paused",
        )
        assert not set(users) & set(recorder.ids())
        # By number too (a scope the app does not register can be named so).
        code, out, err = await cli(servers, table, "unpause", "--scope", "2")
        assert code == 0 and "scope USER (2) resumed" in out, err
        await wait_until(lambda: table_empty(engine, app), what="the scope after resume")
    assert _in_order(recorder, users)


async def _without_app(servers: Any, table: str, *target: str) -> tuple[int, str, str]:
    return await cli(
        servers, table, "pause", "--table", table, *target, "--reason", "later", "--app", ""
    )


async def test_pause_names_what_it_cannot_find(servers, engine) -> None:
    _, table, _ = await fresh_app(engine)
    code, _, err = await cli(servers, table, "pause", "--category", "NOPE", "--reason", "x")
    assert code == 2
    assert "unknown category 'NOPE' in app tests.sample_app:app" in err
    assert "PROJECT_UPDATE (2)" in err and "by its number" in err
    code, _, err = await cli(servers, table, "pause", "--reason", "x")
    assert code == 2 and "exactly one of --category and --scope" in err
    code, _, err = await cli(
        servers, table, "pause", "--category", "1", "--scope", "1", "--reason", "x"
    )
    assert code == 2 and "exactly one of --category and --scope" in err
    # Without the app, a name cannot be resolved; a number can.
    code, _, err = await _without_app(servers, table, "--category", "PROJECT_UPDATE")
    assert code == 2 and "--app module:attribute" in err, err
    code, out, err = await _without_app(servers, table, "--category", "99")
    assert code == 0 and "category 99 (99) paused: later" in out, err
    code, out, err = await cli(servers, table, "unpause", "--category", "98")
    assert code == 0 and "was not paused" in out, err


async def shows(handle: WorkflowHandle[Any, Any], text: str) -> bool:
    """The workflow's current details (the UI's first view) contain ``text``."""
    try:
        return text in await current_details(handle)
    except (RPCError, WorkflowQueryFailedError):
        return False  # not started yet


async def timer_summaries(handle: WorkflowHandle[Any, Any], client: Client) -> list[str]:
    """The summaries of the current run's timers: the label the UI shows of what it waits for."""
    converter = client.data_converter.payload_converter
    return [
        converter.from_payload(event.user_metadata.summary, str)
        for event in (await handle.fetch_history()).events
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
        and event.HasField("user_metadata")
    ]


async def test_a_shard_waiting_on_a_pause_shows_the_pause_on_its_first_view(
    servers, engine, client
) -> None:
    _, table, app = await fresh_app(engine)
    code, _, err = await cli(
        servers, table, "pause", "--category", "PROJECT_UPDATE", "--reason", "search down"
    )
    assert code == 0, err
    code, out, err = await cli(servers, table, "pauses", "--json")
    assert code == 0, err
    [pause] = json.loads(out)
    shown = f"category PROJECT_UPDATE (search down, by {pause['paused_by']}, since "
    handle = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:9")
    async with running_worker(servers, app, fast_settings(sweep_interval=SLOW_SWEEP)):
        await write_rows(
            engine, app, [_row(Category.PROJECT_UPDATE, 9, 90), _row(Category.MEMBER_UPDATE, 9, 9)]
        )
        await wait_until(lambda: shows(handle, f"**Paused** {shown}"), what="the pause shown")
        assert "**Deferred until**" not in await current_details(handle)

        async def labelled() -> bool:
            return any(
                s.startswith(f"paused: {shown}") for s in await timer_summaries(handle, client)
            )

        await wait_until(labelled, what="the timer's label naming the pause")
        status = await handle.query("status", result_type=ShardStatus)
        assert status.state == ShardState.DEFERRED  # the search attribute's value too
    # The drain a deferred handover now runs first is behind a patch: the run replays.
    assert_replays(await handle.fetch_history())


async def _paused_in_view(handle: WorkflowHandle[Any, Any], names: list[str]) -> bool:
    view = await handle.query("pauses", result_type=PausesView)
    return sorted(p.name for p in view.pauses) == sorted(names)


async def test_the_control_workflow_pauses_and_resumes_by_update(servers, engine, client) -> None:
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings(sweep_interval=SLOW_SWEEP)
    handle = client.get_workflow_handle(f"outbox:{table}:control")
    async with running_worker(servers, app, settings):
        await wait_until(lambda: _started(handle), what="the control workflow")
        # What a person sends from the UI or `temporal workflow update execute`.
        view = await handle.execute_update(
            "pause",
            PauseChange(category="project_update", reason="search down", by="ann"),
            result_type=PausesView,
        )
        [shown] = view.pauses
        assert (shown.kind, shown.name, shown.number, shown.paused_by) == (
            "category",
            "PROJECT_UPDATE",
            2,
            "ann",
        )
        async with engine.connect() as conn:
            [stored] = await read_pauses(conn, app.table())
        assert (stored.kind, stored.number, stored.reason) == ("category", 2, "search down")
        assert "**Paused** category PROJECT_UPDATE (2) by ann" in await current_details(handle)

        rows = await write_rows(
            engine, app, [_row(Category.PROJECT_UPDATE, 3, 30), _row(Category.MEMBER_UPDATE, 3, 3)]
        )
        free = await write_rows(engine, app, [_row(Category.MEMBER_UPDATE, 4, 4)])
        await wait_until(lambda: _handled(recorder, free), what="a shard without paused rows")
        await wait_until(
            lambda: _states(servers, table, ["ORGANIZATION:3"], "paused"),
            interval=COMMAND_POLL_INTERVAL,
            what="paused",
        )
        assert not set(rows) & set(recorder.ids())

        # Refused before it reaches the history: exactly one of category and scope, a reason.
        before = len((await handle.fetch_history()).events)
        for refused_change in (PauseChange(reason="x"), PauseChange(scope="USER", reason=" ")):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update("pause", refused_change, result_type=PausesView)
            assert "exactly one of" in refusal(refused.value) or "reason" in refusal(refused.value)
        kinds = [e.event_type for e in (await handle.fetch_history()).events][before:]
        assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED not in kinds
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(
                "pause", PauseChange(category="NOPE", reason="x"), result_type=PausesView
            )
        cause = refused.value.cause
        assert isinstance(cause, ActivityError)
        assert "unknown category 'NOPE'" in str(cause.cause) and "PROJECT_UPDATE (2)" in str(
            cause.cause
        )

        # A pause from the command line shows in the workflow too (the bridge refreshes it).
        code, _, err = await cli(servers, table, "pause", "--scope", "USER", "--reason", "gdpr")
        assert code == 0, err
        await wait_until(
            lambda: _paused_in_view(handle, ["PROJECT_UPDATE", "USER"]), what="the CLI's pause"
        )

        view = await handle.execute_update(
            "unpause", PauseChange(category="PROJECT_UPDATE"), result_type=PausesView
        )
        assert [p.name for p in view.pauses] == ["USER"]
        await wait_until(lambda: _handled(recorder, rows), what="the rows after unpause")
        assert _in_order(recorder, rows)
        assert "**Paused** category PROJECT_UPDATE" not in await current_details(handle)


async def _started(handle: WorkflowHandle[Any, Any]) -> bool:
    try:
        return (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    except RPCError:
        return False


async def test_a_blocked_shard_stops_retrying_when_its_category_is_paused(
    servers, engine, client
) -> None:
    recorder, table, app = await fresh_app(engine)
    calls: list[int] = []
    fixed = False

    async def down_until_fixed(message: OutboxMessage) -> None:
        calls.append(message.id)
        if not fixed:
            raise ConnectionError("search is down")

    recorder.behaviour[Category.PROJECT_UPDATE] = down_until_fixed
    handle = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:6")

    async def workflow_state(state: ShardState) -> bool:
        try:
            shown = await handle.query("status", result_type=ShardStatus)
        except (RPCError, WorkflowQueryFailedError):
            return False
        return bool(shown.state == state)

    async with running_worker(servers, app, fast_settings()):
        rows = await write_rows(
            engine, app, [_row(Category.PROJECT_UPDATE, 6, 60), _row(Category.MEMBER_UPDATE, 6, 6)]
        )
        await wait_until(lambda: workflow_state(ShardState.BLOCKED), what="a blocked shard")
        code, _, err = await cli(
            servers, table, "pause", "--category", "PROJECT_UPDATE", "--reason", "search down"
        )
        assert code == 0, err
        # At its next attempt the head is not due any more: the category activity ends without
        # calling the handler, and the workflow waits as for a deferred row.
        await wait_until(lambda: workflow_state(ShardState.DEFERRED), what="blocked → waiting")
        tried = len(calls)
        fixed = True
        code, _, err = await cli(servers, table, "unpause", "--category", "PROJECT_UPDATE")
        assert code == 0, err
        await wait_until(lambda: table_empty(engine, app), what="the shard after resume")
    assert calls[tried:] == [rows[0]]  # handled once more, after the resume
    assert _in_order(recorder, rows)
