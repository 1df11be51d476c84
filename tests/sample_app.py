"""A small OutboxApp for the command-line tests (``--app tests.sample_app:app``).

Its table is ``$SAMPLE_OUTBOX_TABLE`` (default ``sample_outbox``), so that each test drains a
table of its own. Its handlers record every call in ``sample_calls`` (created by the test), keyed
by table and row id: the test process can then see what a worker subprocess handled. Recording is
idempotent (delivery is at least once).

``incomplete_app`` has the same registry but no handler for PROJECT_UPDATE: the worker must
refuse to start it. ``regional_app`` has the same scopes and categories on a regional table of
the same name, for the shard commands (it has no handlers: it is not run by a worker).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from enum import IntEnum

import psycopg
from psycopg.types.json import Jsonb

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.config import libpq_url, sqlalchemy_url

TABLE = os.environ.get("SAMPLE_OUTBOX_TABLE", "sample_outbox")
CALLS_TABLE = "sample_calls"

CALLS_DDL = f"""
CREATE TABLE IF NOT EXISTS {CALLS_TABLE} (
    outbox_table text NOT NULL,
    row_id bigint NOT NULL,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    shard_scope int NOT NULL,
    shard_identifier bigint NOT NULL,
    category int NOT NULL,
    object_identifier bigint NOT NULL,
    coalesced int NOT NULL,
    payload jsonb,
    handler text NOT NULL,
    PRIMARY KEY (outbox_table, row_id)
)
"""


class SampleScope(IntEnum):
    ORGANIZATION = 1
    USER = 2


class SampleCategory(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2
    USER_UPDATE = 10


# Annotated: a dict of the app's own enums is not a Mapping[IntEnum, ...] to mypy (Mapping's
# key type is invariant), see tests/test_lint.py.
SCOPES: Mapping[IntEnum, Iterable[IntEnum]] = {
    SampleScope.ORGANIZATION: [SampleCategory.ORGANIZATION_UPDATE, SampleCategory.PROJECT_UPDATE],
    SampleScope.USER: [SampleCategory.USER_UPDATE],
}


def _new_app() -> OutboxApp:
    return OutboxApp(scopes=SCOPES, categories=[SampleCategory], tables=[OutboxTable(TABLE)])


app = _new_app()
incomplete_app = _new_app()
not_an_app = "this is not an OutboxApp"
regional_app = OutboxApp(
    scopes=SCOPES, categories=[SampleCategory], tables=[OutboxTable(TABLE, regional=True)]
)


def record(message: OutboxMessage, handler: str) -> None:
    url = os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        raise RuntimeError("tests.sample_app records its calls in OUTBOX_DATABASE_URL; set it")
    with psycopg.connect(libpq_url(sqlalchemy_url(url)), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {CALLS_TABLE} (outbox_table, row_id, shard_scope, shard_identifier, "
            "category, object_identifier, coalesced, payload, handler) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (
                TABLE,
                message.id,
                int(message.shard_scope),
                message.shard_identifier,
                int(message.category),
                message.object_identifier,
                message.coalesced,
                Jsonb(message.payload) if message.payload is not None else None,
                handler,
            ),
        )


@app.handler(SampleCategory.ORGANIZATION_UPDATE, SampleCategory.PROJECT_UPDATE)
def handle_organization(message: OutboxMessage) -> None:
    """A plain ``def`` handler (run in a thread by the worker)."""
    record(message, "sync")


@app.handler(SampleCategory.USER_UPDATE)
async def handle_user(message: OutboxMessage) -> None:
    """An ``async def`` handler."""
    await asyncio.to_thread(record, message, "async")


incomplete_app.handler(SampleCategory.ORGANIZATION_UPDATE)(handle_organization)
incomplete_app.handler(SampleCategory.USER_UPDATE)(handle_user)
