"""The demo domain: a small SaaS with organizations, projects, members, users and audit logs.

``python worker.py --demo`` runs these handlers and writes steady traffic, so the Temporal UI
shows shards draining, coalescing, a flaky handler being retried, and deferred rows. The flaky
handler's failures are intended: ``--demo`` logs each in one line, without its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import timedelta
from enum import IntEnum

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.registry import OutboxApp, OutboxMessage

log = logging.getLogger("outbox_bridge.demo")


class ReplicaUnavailable(ConnectionError):
    """The demo's flaky replica did not answer: an intended failure, to show a shard that
    blocks and recovers on retry."""


class IntendedFailures(logging.Filter):
    """Keeps the line but drops the traceback of a log record about an intended failure
    (:class:`ReplicaUnavailable`). ``--demo`` installs it on the log handler; any other
    failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and isinstance(record.exc_info[1], ReplicaUnavailable):
            record.exc_info = None
            record.exc_text = None
        return True


class Scope(IntEnum):
    ORGANIZATION = 1
    USER = 2
    AUDIT_LOG = 3
    PROVISION = 4


class Category(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2
    ORGANIZATION_MEMBER_UPDATE = 3
    USER_UPDATE = 10
    USER_EMAIL_VERIFIED = 11
    AUDIT_LOG_EVENT = 20
    PROVISION_ORGANIZATION = 30


app = OutboxApp(
    scopes={
        Scope.ORGANIZATION: {
            Category.ORGANIZATION_UPDATE,
            Category.PROJECT_UPDATE,
            Category.ORGANIZATION_MEMBER_UPDATE,
        },
        Scope.USER: {Category.USER_UPDATE, Category.USER_EMAIL_VERIFIED},
        Scope.AUDIT_LOG: {Category.AUDIT_LOG_EVENT},
        Scope.PROVISION: {Category.PROVISION_ORGANIZATION},
    },
    categories=[Category],
)


@app.handler(Category.ORGANIZATION_UPDATE, Category.ORGANIZATION_MEMBER_UPDATE)
async def replicate_organization(message: OutboxMessage) -> None:
    await asyncio.sleep(0.005)


@app.handler(Category.PROJECT_UPDATE)
async def replicate_project(message: OutboxMessage) -> None:
    # A flaky downstream: one call in ten fails, to show a blocked shard being retried.
    if random.random() < 0.1:
        raise ReplicaUnavailable("project replica did not answer")
    await asyncio.sleep(0.005)


@app.handler(Category.USER_UPDATE, Category.USER_EMAIL_VERIFIED)
def replicate_user(message: OutboxMessage) -> None:  # plain def handlers run in a thread
    pass


@app.handler(Category.AUDIT_LOG_EVENT)
async def store_audit_event(message: OutboxMessage) -> None:
    pass


@app.handler(Category.PROVISION_ORGANIZATION)
async def provision_organization(message: OutboxMessage) -> None:
    log.info("provisioned organization %s", message.object_identifier)


async def write_traffic(
    engine: AsyncEngine, stop: asyncio.Event, *, rows_per_second: float = 20
) -> None:
    """Write demo rows until ``stop`` is set, one small transaction at a time."""
    rng = random.Random()
    written = 0
    while not stop.is_set():
        async with engine.begin() as conn:
            org = rng.randint(1, 25)
            choice = rng.random()
            if choice < 0.4:
                # Coalescible: the same project updated again and again.
                await app.write_async(
                    conn,
                    category=Category.PROJECT_UPDATE,
                    shard_identifier=org,
                    object_identifier=org * 100 + rng.randint(1, 3),
                    payload={"name": f"project-{rng.randint(1, 9)}"},
                )
            elif choice < 0.6:
                await app.write_async(
                    conn,
                    category=Category.ORGANIZATION_UPDATE,
                    shard_identifier=org,
                    object_identifier=org,
                    payload={"slug": f"org-{org}"},
                )
            elif choice < 0.75:
                user = rng.randint(1, 50)
                await app.write_async(
                    conn,
                    category=Category.USER_UPDATE,
                    shard_identifier=user,
                    object_identifier=user,
                )
            elif choice < 0.97:
                await app.write_async(
                    conn,
                    category=Category.AUDIT_LOG_EVENT,
                    shard_identifier=org,
                    object_identifier=written,
                    payload={"event": "member.invite"},
                )
            else:
                await app.write_async(
                    conn,
                    category=Category.PROVISION_ORGANIZATION,
                    shard_identifier=org,
                    object_identifier=org,
                    scheduled_for=timedelta(seconds=rng.randint(5, 30)),
                )
        written += 1
        if written % 200 == 0:
            log.info("demo traffic: %d rows written", written)
        try:
            await asyncio.wait_for(stop.wait(), timeout=1 / rows_per_second)
        except TimeoutError:
            pass
