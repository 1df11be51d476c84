"""Shard health in the Temporal UI: OutboxState, OutboxBlockedCategory and OutboxBlockedSince
follow every state transition, upserted only on change, and the saved queries of
docs/how-to/operate.md return exactly the right shards."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge import OutboxMessage
from outbox_bridge.workflows.models import (
    BLOCKED_CATEGORY_ATTRIBUTE,
    BLOCKED_SINCE_ATTRIBUTE,
    STATE_ATTRIBUTE,
    ResumeInput,
    SkipInput,
)
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)


def row(shard: int, obj: int = 1, **extra: object) -> dict[str, object]:
    return {
        "category": Category.PROJECT_UPDATE,
        "shard_identifier": shard,
        "object_identifier": obj,
        **extra,
    }


async def shards_matching(client: Client, query: str, task_queue: str) -> set[str]:
    found = set()
    async for execution in client.list_workflows(f"{query} AND TaskQueue = '{task_queue}'"):
        found.add(execution.id.rsplit(":", 2)[-2] + ":" + execution.id.rsplit(":", 1)[-1])
    return found


async def test_state_attributes_follow_blocked_skipped_resumed(servers, engine, client) -> None:
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    failing = True

    async def flaky(message: OutboxMessage) -> None:
        if failing and message.shard_identifier == 31:
            raise ConnectionError("search index down")

    recorder.behaviour[int(Category.PROJECT_UPDATE)] = flaky
    settings = fast_settings()
    tq = settings.task_queue
    before_block = datetime.now(UTC) - timedelta(seconds=1)
    async with running_worker(servers, app, settings):
        await write_rows(engine, app, [row(31), row(32)])
        handle = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:31")

        async def matches(query: str, expected: set[str]) -> bool:
            return await shards_matching(client, query, tq) == expected

        await wait_until(
            lambda: matches('OutboxState = "blocked"', {"ORGANIZATION:31"}),
            what="the blocked shard listed by OutboxState",
        )
        attributes = (await handle.describe()).typed_search_attributes
        assert attributes.get(BLOCKED_CATEGORY_ATTRIBUTE) == "PROJECT_UPDATE"
        since = attributes.get(BLOCKED_SINCE_ATTRIBUTE)
        assert since is not None and since >= before_block
        # The saved query "blocked for longer than ...".
        later = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
        assert await matches(f'OutboxBlockedSince < "{later}"', {"ORGANIZATION:31"})
        assert await matches(f'OutboxBlockedSince < "{before_block.isoformat()}"', set())

        await handle.signal("skip", SkipInput(reason="search index down", by="test"))
        await wait_until(
            lambda: matches(
                'OutboxScope = "ORGANIZATION" AND OutboxState = "skipped"', {"ORGANIZATION:31"}
            ),
            what="the skipped shard listed by scope and state",
        )
        assert await matches('OutboxState = "blocked"', set())

        failing = False
        await handle.signal("resume", ResumeInput(by="test"))
        await wait_until(lambda: table_empty(engine, app), what="the resumed shard")
        await handle.result()
        attributes = (await handle.describe()).typed_search_attributes
        assert attributes.get(STATE_ATTRIBUTE) == "draining"
        assert attributes.get(BLOCKED_CATEGORY_ATTRIBUTE) is None
        assert attributes.get(BLOCKED_SINCE_ATTRIBUTE) is None

    healthy = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:32")
    # A partition drained the healthy shard: it never had a workflow.
    with pytest.raises(RPCError) as missing:
        await healthy.describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND
    # The blocked one upserted once per change: blocked, skipped, draining. Nothing else: no
    # TemporalChangeVersion either (the workflow code asks for no patch).
    upserted = [
        sorted(
            e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        )
        for e in (await handle.fetch_history()).events
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
    ]
    assert upserted == [
        ["OutboxBlockedCategory", "OutboxBlockedSince", "OutboxState"],
        ["OutboxState"],
        ["OutboxBlockedCategory", "OutboxBlockedSince", "OutboxState"],
    ]


async def test_a_deferred_shard_is_listed_by_its_state(servers, engine, client) -> None:
    """A shard whose head is deferred goes to its own workflow, listed as deferred; a shard
    drained by a partition next to it is listed in no state (it has no workflow)."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    settings = fast_settings()
    async with running_worker(servers, app, settings):
        await write_rows(engine, app, [row(41, scheduled_for=timedelta(hours=1)), row(42)])

        async def state_of(shard: int, state: str) -> bool:
            handle = client.get_workflow_handle(f"outbox:{table}:ORGANIZATION:{shard}")
            try:
                attributes = (await handle.describe()).typed_search_attributes
            except RPCError:
                return False
            return bool(attributes.get(STATE_ATTRIBUTE) == state)

        await wait_until(lambda: state_of(41, "deferred"), what="the deferred shard")
        await wait_until(lambda: len(recorder.calls) == 1, what="the healthy shard's row")
        assert await shards_matching(client, 'OutboxState = "deferred"', settings.task_queue) == {
            "ORGANIZATION:41"
        }
        assert await shards_matching(client, "OutboxState IS NOT NULL", settings.task_queue) == {
            "ORGANIZATION:41"
        }
