"""Unit tests of the handler timeout of async handler calls (no servers).

A run of async calls shares one timer (``_CallClock``) instead of an ``asyncio.timeout`` per
call; the timeout still bounds each call from its own start, never the run as a whole, and an
outside cancellation stays a cancellation.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.db.reads import GroupRows
from outbox_bridge.observability.observe import RoundObserver
from outbox_bridge.runtime.calls import Call, HandlerCalls, HandlerFailed, HandlerTimeoutError
from outbox_bridge.workflows.models import ShardRef
from tests.harness import SCOPES, Category, Scope

SHARD = ShardRef("outbox", int(Scope.ORGANIZATION), Scope.ORGANIZATION.name, 1)
NOW = datetime.now(UTC)


def calls_of(durations: list[float], started: list[float]) -> list[Call]:
    async def handler(message: OutboxMessage) -> None:
        started.append(time.monotonic())
        await asyncio.sleep(durations[message.id - 1])

    calls = []
    for index in range(1, len(durations) + 1):
        message = OutboxMessage(
            id=index,
            shard_scope=Scope.ORGANIZATION,
            shard_identifier=1,
            category=Category.ORGANIZATION_UPDATE,
            object_identifier=index,
            payload=None,
            region=None,
            date_added=NOW,
            scheduled_for=NOW,
        )
        group = GroupRows(int(Category.ORGANIZATION_UPDATE), index, [index])
        calls.append(Call(group, handler, message, Category.ORGANIZATION_UPDATE.name))
    return calls


def handler_calls(timeout: float) -> HandlerCalls:
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable("outbox")])
    return HandlerCalls(app, redact_errors=False, threads=1, timeout=timeout)


async def test_the_timeout_bounds_each_call_not_the_run() -> None:
    runner = handler_calls(timeout=1.0)
    handled: list[int] = []
    started: list[float] = []
    calls = calls_of([0.4, 0.4, 0.4, 0.0, 0.4], started)
    finished = await runner.run(
        SHARD,
        calls,
        lambda call: handled.append(call.message.id),
        RoundObserver(SHARD),
    )
    # 1.6 s in all, more than the timeout, and no call ran out of time.
    assert finished and handled == [1, 2, 3, 4, 5]
    runner.close()


async def test_a_call_that_runs_out_of_time_fails_after_the_timeout_from_its_start() -> None:
    runner = handler_calls(timeout=0.7)
    handled: list[int] = []
    started: list[float] = []
    calls = calls_of([0.4, 0.4, 30.0, 0.0], started)
    with pytest.raises(HandlerFailed) as failed:
        await runner.run(
            SHARD,
            calls,
            lambda call: handled.append(call.message.id),
            RoundObserver(SHARD),
        )
    # A timeout counted from the run's start would have cut the second call (0.8 s in):
    # the third, which never returns, is the one that ran out of time.
    assert handled == [1, 2] and len(started) == 3
    assert failed.value.failure.error_type == HandlerTimeoutError.__qualname__
    assert failed.value.group.last_id == 3
    # The task is not left with a cancellation request.
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)
    runner.close()


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    runner = handler_calls(timeout=5.0)
    started: list[float] = []
    calls = calls_of([0.0, 30.0], started)
    task = asyncio.create_task(runner.run(SHARD, calls, lambda _: None, RoundObserver(SHARD)))
    while len(started) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    runner.close()


async def test_the_timer_is_gone_after_the_run() -> None:
    runner = handler_calls(timeout=60.0)
    loop = asyncio.get_running_loop()
    before = len(loop._scheduled)  # type: ignore[attr-defined]
    await runner.run(
        SHARD,
        calls_of([0.0] * 50, []),
        lambda _: None,
        RoundObserver(SHARD),
    )
    # One timer for the run, cancelled at its end (asyncio.timeout scheduled one per call).
    live = [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
    assert len(live) <= before
    runner.close()
