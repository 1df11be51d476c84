"""A partition retries a shard whose handler failed, at once and then on the backoff, for
``handover_after`` seconds before the shard goes to a workflow of its own: the schedule (unit
tests), and against the real servers, a brief failure that never becomes a workflow and a lasting
one that does, with the shard's order kept and the other shards going on meanwhile."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime

import pytest
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge import OutboxMessage
from outbox_bridge.errors import UnknownCategoryError
from outbox_bridge.runtime.local_retries import LocalRetries, attempt_offsets
from outbox_bridge.runtime.round_writes import ShardOutcome
from outbox_bridge.workflows.models import HandlerFailure, ShardOptions, ShardRef
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)

SHARD = ShardRef(table="t", scope=1, scope_name="ORGANIZATION", shard_identifier=1)


def options(initial: float = 1.0, ceiling: float = 3600.0) -> ShardOptions:
    return ShardOptions(initial_retry_seconds=initial, max_retry_interval_seconds=ceiling)


def failed(shard: ShardRef = SHARD, error_type: str = "ConnectionError") -> ShardOutcome:
    return ShardOutcome(shard, failure=HandlerFailure(error_type, "down"), handler_raised=True)


def test_the_partition_tries_again_at_once_then_on_the_backoff_within_the_window() -> None:
    assert attempt_offsets(options(), 5.0) == [0.0, 1.0, 3.0]  # the next, at 7 s, is too late
    assert attempt_offsets(options(), 0.0) == []
    assert attempt_offsets(options(), 0.5) == [0.0]
    assert attempt_offsets(options(0.2, 0.4), 1.0) == pytest.approx([0.0, 0.2, 0.6, 1.0])


def test_a_failing_shard_waits_for_each_retry_then_is_handed_over() -> None:
    retries = LocalRetries(options(), 5.0)
    now = 100.0
    for attempt, wait in enumerate([0.0, 1.0, 2.0], start=1):
        assert retries.attempt(SHARD) == attempt
        assert retries.later(failed(), now)
        assert retries.waits(SHARD) and retries.next_due() == now + wait
        if wait:
            assert retries.due(now + wait - 0.01) == []
        assert retries.due(now + wait) == [SHARD] and not retries.waits(SHARD)
        now += wait
    assert retries.attempt(SHARD) == 4
    assert not retries.later(failed(), now)  # the fourth failure: its workflow takes over
    assert retries.attempt(SHARD) == 1 and not retries.waits(SHARD) and retries.waiting == 0


def test_a_success_forgets_the_failures_and_other_shards_keep_their_own() -> None:
    other = ShardRef(table="t", scope=1, scope_name="ORGANIZATION", shard_identifier=2)
    retries = LocalRetries(options(), 5.0)
    assert retries.later(failed(), 0.0) and retries.later(failed(other), 0.5)
    assert retries.due(0.0) == [SHARD]
    assert retries.later(failed(), 0.0)  # second failure: its retry in 1 s
    assert retries.due(0.6) == [other]
    retries.succeeded(SHARD)
    assert retries.attempt(SHARD) == 1 and retries.attempt(other) == 2


def test_only_a_handler_s_own_failure_is_retried_by_the_partition() -> None:
    retries = LocalRetries(options(), 5.0)
    unknown = failed(error_type=UnknownCategoryError.__qualname__)
    assert not retries.later(unknown, 0.0)  # no handler can take the row: no point waiting
    fault = ShardOutcome(SHARD, failure=HandlerFailure("ValueError", "undecodable"))
    assert not retries.later(fault, 0.0)  # the round could not even call the handler
    assert not LocalRetries(options(), 0.0).later(failed(), 0.0)  # 0: handed over at once


class FailingFor:
    """A handler that fails its first ``times`` calls, noting when each was made."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.failures: list[datetime] = []

    async def __call__(self, message: OutboxMessage) -> None:
        if len(self.failures) < self.times:
            self.failures.append(datetime.now(UTC))
            raise ConnectionError(f"replica restarting (call {len(self.failures)})")


def row(category: Category, shard: int, obj: int) -> dict[str, object]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj}


async def shard_workflow_started(client: Client, table: str, shard: int) -> datetime | None:
    try:
        description = await client.get_workflow_handle(
            f"outbox:{table}:ORGANIZATION:{shard}"
        ).describe()
    except RPCError:
        return None
    return description.start_time


async def test_a_brief_failure_is_retried_by_the_partition_and_never_becomes_a_workflow(
    servers, engine, client, caplog
) -> None:
    recorder, table, app = await fresh_app(engine)
    failing = FailingFor(2)
    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    # The group behind fails twice too, in the round whose first group succeeded: its failures
    # are counted from there, not on top of the first group's.
    behind = FailingFor(2)
    recorder.behaviour[Category.MEMBER_UPDATE] = behind
    blocked = await write_rows(
        engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.MEMBER_UPDATE, 1, 11),
            row(Category.ORGANIZATION_UPDATE, 1, 1),
        ],
    )
    others = await write_rows(
        engine, app, [row(Category.ORGANIZATION_UPDATE, s, s) for s in (2, 3, 4)]
    )
    # Three attempts in the window: at first, at once, then 0.5 s later.
    settings = fast_settings(handover_after=0.6, initial_retry_interval=0.5)
    caplog.set_level(logging.WARNING, logger="outbox_bridge.runtime.calls")
    async with running_worker(servers, app, settings):
        await wait_until(lambda: table_empty(engine, app), what="the shard retried and drained")
    # Each failing group was called three times (two failures, one success), in the shard's
    # order; the other shards did not wait for the retries.
    shard_one = [c.id for c in recorder.calls if c.shard == "1:1"]
    assert shard_one == blocked
    assert len(failing.failures) == len(behind.failures) == 2
    succeeded = next(c for c in recorder.calls if c.id == blocked[0]).at
    assert (failing.failures[1] - failing.failures[0]).total_seconds() < 0.5  # at once
    assert (succeeded - failing.failures[1]).total_seconds() >= 0.45  # the first backoff
    assert behind.failures[0] >= succeeded
    assert max(c.at for c in recorder.calls if c.id in others) < succeeded
    # No workflow of its own: the failures cost no workflow start.
    assert await shard_workflow_started(client, table, 1) is None
    for obj in (10, 11):
        attempts = [
            int(m.group(1))
            for record in caplog.records
            if (m := re.search(rf"object={obj} .*attempt=(\d+)", record.getMessage()))
        ]
        assert attempts == [1, 2], obj


async def test_a_lasting_failure_goes_to_its_workflow_once_the_window_is_over(
    servers, engine, client
) -> None:
    recorder, table, app = await fresh_app(engine)
    failing = FailingFor(10_000)
    recorder.behaviour[Category.PROJECT_UPDATE] = failing
    await write_rows(engine, app, [row(Category.PROJECT_UPDATE, 5, 50)])
    # Attempts at 0, then at once, then 0.2 and 0.6 s later; the next (1.4 s) is past the window.
    settings = fast_settings(handover_after=1.0, initial_retry_interval=0.2, max_retry_interval=1.0)
    async with running_worker(servers, app, settings):

        async def has_workflow() -> bool:
            return await shard_workflow_started(client, table, 5) is not None

        await wait_until(has_workflow, what="the shard's workflow")
        started = await shard_workflow_started(client, table, 5)
        assert started is not None
        before = [at for at in failing.failures if at < started]
        assert len(before) == 4, failing.failures
        assert (before[-1] - before[0]).total_seconds() >= 0.55
        await wait_until(lambda: len(failing.failures) >= 6, what="the workflow's retries")
    assert recorder.calls == []  # never handled, every row kept
    assert not await table_empty(engine, app)
