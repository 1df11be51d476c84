"""`outbox-bridge status|skip|resume` against a real worker (the command run in this process)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError

from outbox_bridge import OutboxMessage
from outbox_bridge.testing import assert_replays
from outbox_bridge.workflows.models import ResumeInput, SkipInput
from tests.harness import (
    COMMAND_POLL_INTERVAL,
    Category,
    fast_settings,
    fresh_app,
    refusal,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.support import run_cli


async def cli(
    servers,
    table: str,
    *args: str,
    env: dict[str, str] | None = None,
    database_url: str | None = None,
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        **(env or {}),
        "TEMPORAL_ADDRESS": servers.temporal_address,
        "OUTBOX_DATABASE_URL": database_url or servers.database_url,
        "OUTBOX_APP": "tests.sample_app:app",  # same scope and category names as the harness
        "SAMPLE_OUTBOX_TABLE": table,
    }
    run = await run_cli(*args, env=env)
    return run.code, run.stdout, run.stderr


async def test_status_skip_and_resume_from_the_command_line(servers, engine, client) -> None:
    recorder, table, app = await fresh_app(engine)
    fixed = recorder.fail_until_fixed(Category.PROJECT_UPDATE)
    [head] = await write_rows(
        engine,
        app,
        [{"category": Category.PROJECT_UPDATE, "shard_identifier": 8, "object_identifier": 80}],
    )

    async def status() -> dict[str, Any]:
        code, out, err = await cli(servers, table, "status", "ORGANIZATION:8", "--json")
        assert code == 0, err
        shown: dict[str, Any] = json.loads(out)
        return shown

    async def state_is(state: str) -> bool:
        code, out, _ = await cli(servers, table, "status", "ORGANIZATION:8", "--json")
        return code == 0 and json.loads(out)["state"] == state

    settings = fast_settings()
    async with running_worker(servers, app, settings):
        await wait_until(
            lambda: state_is("blocked"), interval=COMMAND_POLL_INTERVAL, what="a blocked shard"
        )
        await wait_until(
            lambda: _attempts_at_least(status(), 3),
            interval=COMMAND_POLL_INTERVAL,
            what="server-side retries",
        )
        shown = await status()
        assert shown["head"]["category_name"] == "PROJECT_UPDATE"
        assert shown["head"]["last_id"] == head
        assert shown["last_error"]["error_type"] == "ConnectionError"

        code, out, err = await cli(servers, table, "status", "ORGANIZATION:8")
        assert code == 0, err
        assert "blocked" in out and "PROJECT_UPDATE object=80" in out

        code, _, err = await cli(servers, table, "skip", "ORGANIZATION:8", "--reason", "  ")
        assert code == 2 and "reason" in err
        # The update's validator refuses what the command line would not send.
        handle = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:8")
        before = len((await handle.fetch_history()).events)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("skip", SkipInput(reason=" "))
        assert "skip needs a reason" in refusal(refused.value)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("resume", ResumeInput(by="someone"))
        assert refusal(refused.value) == "shard ORGANIZATION:8 is not skipped"
        kinds = [e.event_type for e in (await handle.fetch_history()).events][before:]
        assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED not in kinds
        assert (await status())["state"] == "blocked"

        code, out, err = await cli(servers, table, "skip", "ORGANIZATION:8", "--reason", "fix")
        assert code == 0, err
        assert (await status())["skip"]["reason"] == "fix"  # the update answered once taken
        # A shard a partition drains (no workflow of its own) gets one, started skipped: its
        # rows stay, through several of the partition's scans, until it is resumed. It is
        # started on the task queue of the command, which must be the workers'.
        code, _, err = await cli(servers, table, "skip", "ORGANIZATION:9", "--reason", "fix")
        assert code == 2 and "no worker polls task queue 'outbox'" in err, err
        queue = {"OUTBOX_TASK_QUEUE": settings.task_queue}
        code, _, err = await cli(
            servers, table, "skip", "ORGANIZATION:9", "--reason", "fix", env=queue
        )
        assert code == 0, err
        [nine] = await write_rows(
            engine,
            app,
            [{"category": Category.MEMBER_UPDATE, "shard_identifier": 9, "object_identifier": 9}],
        )
        await asyncio.sleep(2.0)  # ten of the partition's polls (--poll-interval 0.2)
        assert nine not in recorder.ids()
        code, out, err = await cli(servers, table, "status", "ORGANIZATION:9", "--json")
        assert code == 0 and json.loads(out)["state"] == "skipped", err

        fixed.set()
        for name in ("ORGANIZATION:8", "ORGANIZATION:9"):
            code, out, err = await cli(servers, table, "resume", name)
            assert code == 0, err
        await wait_until(lambda: table_empty(engine, app), what="delivery after resume")
    assert sorted(recorder.ids()) == sorted([head, nine])


async def test_status_of_a_shard_without_workflow_says_so(servers) -> None:
    code, _, err = await cli(servers, unique_table(), "status", "USER:424242")
    assert code == 1
    assert "has no workflow" in err
    code, _, err = await cli(servers, unique_table(), "status", "TEAM:1")
    assert code == 2
    assert "unknown scope" in err


async def test_status_of_a_shard_its_partition_drains_shows_its_pending_rows(
    servers, engine
) -> None:
    # No worker runs: the rows wait, as they do while a partition retries a failing handler
    # before the shard gets a workflow of its own.
    _, table, app = await fresh_app(engine)
    rows = [
        (Category.PROJECT_UPDATE, 90),
        (Category.PROJECT_UPDATE, 90),
        (Category.ORGANIZATION_UPDATE, 91),
    ]
    first, *_ = await write_rows(
        engine,
        app,
        [{"category": c, "shard_identifier": 9, "object_identifier": o} for c, o in rows],
    )
    code, out, err = await cli(servers, table, "status", "ORGANIZATION:9", env={"COLUMNS": "200"})
    assert code == 0, err
    assert "has no workflow of its own: a partition drains it" in out, out
    assert f"pending: 3 rows in 2 groups, lowest id {first}, the oldest written at" in out, out
    code, out, err = await cli(servers, table, "status", "ORGANIZATION:9", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["state"], shown["workflow_running"], shown["parked_groups"]) == (
        "none",
        False,
        [],
    )
    assert shown["pending"] | {"oldest": None} == {
        "rows": 3,
        "groups": 2,
        "lowest_id": first,
        "oldest": None,
    }, shown
    # Another shard of the same table, with no rows: nothing to show, as before.
    code, _, err = await cli(servers, table, "status", "ORGANIZATION:10")
    assert code == 1 and "has no workflow of its own" in err, err


async def _attempts_at_least(shown, minimum: int) -> bool:
    return int((await shown)["attempts"]) >= minimum


async def test_history_export_then_replay_and_a_nondeterministic_history_fails(
    servers, engine, tmp_path
) -> None:
    recorder, table, app = await fresh_app(engine)
    canary = "personal-data-canary-7f3a"
    failed: list[int] = []

    async def fail_once(message: OutboxMessage) -> None:
        if not failed:
            failed.append(message.id)
            raise ConnectionError("replica unavailable")

    # A failing call hands the shard to its own workflow: it has a history to export.
    recorder.behaviour[Category.USER_UPDATE] = fail_once
    async with running_worker(servers, app, fast_settings()):
        await write_rows(
            engine,
            app,
            [
                {
                    "category": Category.USER_UPDATE,
                    "shard_identifier": 5,
                    "object_identifier": 5,
                    "payload": {"email": canary},
                }
            ],
        )
        await wait_until(lambda: table_empty(engine, app), what="the row handled")
        exported = tmp_path / "user-5.json"
        code, out, err = await cli(
            servers, table, "history", "export", "USER:5", "-o", str(exported)
        )
        assert code == 0, err
    text = exported.read_text()
    assert "OutboxShard" in text and canary not in text  # ids and counts only, no payloads

    code, out, err = await cli(servers, table, "replay", str(exported))
    assert code == 0, out + err
    assert "1 replayed, 0 failed" in out
    assert_replays(exported)  # what an application's test does with its exported histories

    # The same history as if the workflow had scheduled another category: nondeterminism.
    recorded = json.loads(text)
    scheduled = [
        event
        for event in recorded["events"]
        if event.get("activityTaskScheduledEventAttributes", {}).get("activityType", {}).get("name")
        == "USER_UPDATE"
    ]
    assert scheduled, "the head's retry is a USER_UPDATE activity"
    for event in scheduled:
        event["activityTaskScheduledEventAttributes"]["activityType"]["name"] = "PROJECT_UPDATE"
    first = scheduled[0]["eventId"]
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(recorded))
    code, out, err = await cli(servers, table, "replay", str(exported), str(tampered))
    assert code == 1
    assert "1 replayed, 1 failed" in out
    # The file, the first event the code disagrees with, and the runner it failed under.
    assert f"FAIL {tampered}: " in out, out
    assert "Nondeterminism" in out, out
    assert f"at event {first} ActivityTaskScheduled PROJECT_UPDATE" in out, out
    assert "(unsandboxed)" in out, out


async def test_shards_lists_depth_age_and_state(servers, engine) -> None:
    from datetime import timedelta

    recorder, table, app = await fresh_app(engine)

    async def always_fails(message: OutboxMessage) -> None:
        raise ConnectionError("replica unavailable")

    recorder.behaviour[Category.PROJECT_UPDATE] = always_fails
    await write_rows(
        engine,
        app,
        [
            {
                "category": Category.USER_UPDATE,
                "shard_identifier": 2,
                "object_identifier": 2,
                "scheduled_for": timedelta(hours=1),
            },
        ],
    )
    await write_rows(
        engine,
        app,
        [
            {"category": Category.PROJECT_UPDATE, "shard_identifier": 8, "object_identifier": 80},
            {"category": Category.PROJECT_UPDATE, "shard_identifier": 8, "object_identifier": 80},
            {
                "category": Category.ORGANIZATION_UPDATE,
                "shard_identifier": 8,
                "object_identifier": 8,
            },
        ],
    )

    async def listed(*args: str) -> list[dict[str, object]]:
        code, out, err = await cli(servers, table, "shards", "--json", *args)
        assert code == 0, err
        found: list[dict[str, object]] = json.loads(out)
        return found

    async def settled() -> bool:
        states = {e["shard"]: e["state"] for e in await listed()}
        return states == {"ORGANIZATION:8": "blocked", "USER:2": "deferred"}

    async with running_worker(servers, app):
        await wait_until(
            settled, interval=COMMAND_POLL_INTERVAL, what="one blocked and one deferred shard"
        )
        deepest = await listed()
        assert [(e["shard"], e["rows"], e["groups"]) for e in deepest] == [
            ("ORGANIZATION:8", 3, 2),
            ("USER:2", 1, 1),
        ]
        assert deepest[0]["blocked_category"] == "PROJECT_UPDATE"
        assert [e["shard"] for e in await listed("--oldest")] == ["USER:2", "ORGANIZATION:8"]
        assert [e["shard"] for e in await listed("--state", "blocked")] == ["ORGANIZATION:8"]
        assert [e["shard"] for e in await listed("--scope", "user")] == ["USER:2"]
        assert [e["shard"] for e in await listed("--top", "1")] == ["ORGANIZATION:8"]
        code, out, err = await cli(servers, table, "shards")
        assert code == 0, err
        assert "ORGANIZATION:8" in out and "PROJECT_UPDATE" in out
        for shard in ("ORGANIZATION:8", "USER:2"):
            code, _, err = await cli(servers, table, "skip", shard, "--reason", "test over")
            assert code == 0, err


async def test_flush_from_the_command_line(servers, engine) -> None:
    recorder, table, app = await fresh_app(engine)

    async def failing(message: OutboxMessage) -> None:
        if message.shard_identifier == 21:
            await asyncio.sleep(3)  # still pending when the command runs
        if message.shard_identifier == 22:
            raise ConnectionError("replica unavailable")

    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    settings = fast_settings()
    env = {"OUTBOX_TASK_QUEUE": settings.task_queue}
    async with running_worker(servers, app, settings):
        code, out, err = await cli(servers, table, "flush", "ORGANIZATION:21", env=env)
        assert code == 0 and "no pending rows" in out, err
        code, out, err = await cli(servers, table, "flush", "ORGANIZATION:21", "--json", env=env)
        assert code == 0, err
        assert json.loads(out) | {"outcome": "handled", "detail": "no pending rows"} == json.loads(
            out
        )

        await write_rows(
            engine,
            app,
            [
                {
                    "category": Category.PROJECT_UPDATE,
                    "shard_identifier": 21,
                    "object_identifier": 1,
                },
                {
                    "category": Category.PROJECT_UPDATE,
                    "shard_identifier": 22,
                    "object_identifier": 2,
                },
            ],
        )
        code, out, err = await cli(servers, table, "flush", "ORGANIZATION:21", "--json", env=env)
        assert code == 0, err
        assert json.loads(out)["outcome"] == "handled"
        # Handled means the handler returned before the command did.
        assert any(call.shard == "1:21" for call in recorder.calls)

        code, out, err = await cli(
            servers, table, "flush", "ORGANIZATION:22", "--timeout", "20", env=env
        )
        assert code == 1, (out, err)
        assert "blocked" in out and "ConnectionError" in out and "PROJECT_UPDATE" in out

        code, _, err = await cli(
            servers, table, "flush", "ORGANIZATION:22", "--timeout", "0", env=env
        )
        assert code == 2 and "--timeout" in err
