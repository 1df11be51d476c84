"""What a handler's exception leaves in Temporal: by default its class and its message with the
credentials masked; with a payload codec of the app's, everything the outbox's workflows carry
(inputs, signals, results, and failures' messages and stack traces) encoded by that codec.
Against the real PostgreSQL and Temporal dev server; the histories are fetched with a plain
client, as anyone with access to the namespace would read them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowHistory
from temporalio.converter import PayloadCodec

from outbox_bridge import OutboxMessage, OutboxSettings
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.runtime.scrub import scrub_credentials
from outbox_bridge.runtime.shards import parse_shard, shard_status
from outbox_bridge.runtime.temporal import load_payload_codec, outbox_data_converter
from outbox_bridge.workflows.models import ShardRef, ShardStatus
from tests.harness import (
    Category,
    Servers,
    fast_settings,
    fresh_app,
    running_worker,
    wait_until,
    write_rows,
)

SECRET = "s3cret"
ENCODING = b"binary/outbox-test-reversed"


class ReversingCodec(PayloadCodec):
    """Stands in for an encryption codec: its payloads are unreadable without it."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [
            Payload(metadata={"encoding": ENCODING}, data=p.SerializeToString()[::-1])
            for p in payloads
        ]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        decoded = []
        for payload in payloads:
            if payload.metadata.get("encoding") != ENCODING:
                decoded.append(payload)  # not ours: as it is
                continue
            original = Payload()
            original.ParseFromString(payload.data[::-1])
            decoded.append(original)
        return decoded


async def _histories(client: Client, task_queue: str) -> dict[str, bytes]:
    """Every workflow of the task queue, its history's events as the server keeps them
    (payloads as stored, failures' messages)."""
    found = {}
    async for listed in client.list_workflows(f"TaskQueue = '{task_queue}'"):
        history = await client.get_workflow_handle(listed.id).fetch_history()
        found[listed.id] = b"\n".join(event.SerializeToString() for event in history.events)
    return found


async def _blocked(client: Client, shard: ShardRef) -> bool:
    try:
        status = await shard_status(client, shard)
    except Exception:
        return False
    return status.state == "blocked" and status.attempts >= 2


@dataclass
class Blocked:
    """A shard blocked by a failing handler, and what a plain client of the namespace reads."""

    shard: ShardRef
    status: ShardStatus  # as ``reader`` decodes it
    histories: dict[str, bytes]  # every workflow of the task queue
    shard_history: WorkflowHistory
    description: WorkflowExecutionDescription


async def _block_a_shard(
    servers: Servers,
    engine: AsyncEngine,
    client: Client,
    handler: Callable[[OutboxMessage], Awaitable[None]],
    settings: OutboxSettings,
    reader: Client,
) -> Blocked:
    """Run a worker until ``handler``'s shard is blocked and retried; what Temporal keeps."""
    recorder, _, app = await fresh_app(engine)
    recorder.behaviour[Category.PROJECT_UPDATE] = handler
    row = {"category": Category.PROJECT_UPDATE, "shard_identifier": 31, "object_identifier": 1}
    await write_rows(engine, app, [row])
    shard = parse_shard("ORGANIZATION:31", app)
    async with running_worker(servers, app, settings):
        await wait_until(lambda: _blocked(reader, shard), what="the blocked shard, retried")
        handle = client.get_workflow_handle(shard.workflow_id)
        return Blocked(
            shard,
            await shard_status(reader, shard),
            await _histories(client, settings.task_queue),
            await handle.fetch_history(),
            await handle.describe(),
        )


async def test_credentials_in_a_handler_error_never_reach_the_history(
    servers, engine, client: Client
) -> None:
    async def leaky(message: OutboxMessage) -> None:
        raise ConnectionError(
            f"cannot reach postgresql://u:{SECRET}@h/db (host=h password={SECRET} "
            f"Authorization: Bearer {SECRET}-token)"
        )

    settings = fast_settings(max_retry_interval=0.5)
    blocked = await _block_a_shard(servers, engine, client, leaky, settings, client)
    error = blocked.status.last_error
    assert error is not None and error.error_type == "ConnectionError"
    assert error.message == (
        "cannot reach postgresql://u:***@h/db (host=h password=*** Authorization: Bearer ***)"
    )
    histories = blocked.histories
    assert blocked.shard.workflow_id in histories
    for workflow_id, history in histories.items():
        assert SECRET.encode() not in history, workflow_id
    assert b"postgresql://u:***@h/db" in histories[blocked.shard.workflow_id]
    assert b"ConnectionError" in histories[blocked.shard.workflow_id]


async def test_a_payload_codec_encodes_what_the_outbox_sends_to_temporal(
    servers, engine, client: Client
) -> None:
    """With ``payload_codec``, a plain client reads none of the outbox's payloads nor the
    failure's message; a client with the codec reads them all."""
    canary = "order 77 refused by the payment provider"

    async def refusing(message: OutboxMessage) -> None:
        raise RuntimeError(canary)

    settings = fast_settings(max_retry_interval=0.5, payload_codec=f"{__name__}:ReversingCodec")
    decoding = Client(
        client.service_client,
        namespace=client.namespace,
        data_converter=outbox_data_converter(settings),
    )
    blocked = await _block_a_shard(servers, engine, client, refusing, settings, decoding)
    error = blocked.status.last_error
    assert error is not None and (error.error_type, error.message) == ("RuntimeError", canary)
    assert all(canary.encode() not in history for history in blocked.histories.values())
    raw = blocked.shard_history
    payloads = [payload for event in raw.events for payload in _payloads(event)]
    assert payloads, "the shard's input, signals and results"
    assert {payload.metadata["encoding"] for payload in payloads} == {ENCODING}
    # The retried category activity's last failure, as a plain client describes it.
    failures = [
        pending.last_failure
        for pending in blocked.description.raw_description.pending_activities
        if pending.HasField("last_failure")
    ]
    assert failures, "the category activity is being retried"
    for failure in failures:
        assert failure.message == "Encoded failure" and not failure.stack_trace
        assert failure.encoded_attributes.metadata["encoding"] == ENCODING


def _payloads(event: HistoryEvent) -> list[Payload]:
    """The payloads of an event's input, signal or result."""
    for field in (
        "workflow_execution_started_event_attributes",
        "workflow_execution_signaled_event_attributes",
        "activity_task_scheduled_event_attributes",
        "activity_task_completed_event_attributes",
    ):
        if event.HasField(field):
            attributes = getattr(event, field)
            holder = attributes.result if "completed" in field else attributes.input
            return list(holder.payloads)
    return []


def test_scrubbing_keeps_what_went_wrong() -> None:
    assert scrub_credentials("KeyError: 'order 42'") == "KeyError: 'order 42'"
    assert scrub_credentials('FATAL: password authentication failed for user "app"') == (
        'FATAL: password authentication failed for user "app"'
    )
    assert (
        scrub_credentials("{'api_key': 'k1', 'user': 'bob'}") == "{'api_key': '***', 'user': 'bob'}"
    )
    assert scrub_credentials("https://h/x?id=3&access_token=t1&y=2") == (
        "https://h/x?id=3&access_token=***&y=2"
    )
    assert scrub_credentials("DB_PASSWORD=hunter2; author: alice") == (
        "DB_PASSWORD=***; author: alice"
    )


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("nocolon", "must look like module:attribute"),
        ("tests.no_such_module:codec", "cannot load payload_codec"),
        (f"{__name__}:SECRET", "is a str, not a temporalio.converter.PayloadCodec"),
    ],
)
def test_a_payload_codec_that_is_not_one_is_refused_clearly(spec: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        load_payload_codec(spec)
    assert isinstance(load_payload_codec(f"{__name__}:ReversingCodec"), ReversingCodec)
