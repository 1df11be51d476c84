"""The demo domain: a small SaaS with organizations, projects, members, users and audit logs.

``outbox-bridge worker --demo`` runs these handlers and writes steady traffic, so the Temporal
UI shows shards draining and coalescing, and shards that need attention (:func:`banner` tells
which). Their failures are intended: :class:`IntendedFailures` drops their tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import datetime, timedelta
from enum import IntEnum
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.config import OutboxSettings
from outbox_bridge.registry import OutboxApp, OutboxMessage

log = logging.getLogger("outbox_bridge.demo")


class ReplicaUnavailable(ConnectionError):
    """The demo's project replica did not answer: an intended failure, to show a shard that
    blocks (and recovers on retry, or once the outage is over)."""


class IntendedFailures(logging.Filter):
    """Drops the traceback (not the line) of a log record about a :class:`ReplicaUnavailable`."""

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


# The organization whose project replica is down at the start (its shard: ORGANIZATION:7).
OUTAGE_ORGANIZATION = 7
# Share of the other PROJECT_UPDATE calls that fail at random.
FLAKY_SHARE = 0.05
# The demo's retry cap (unless --max-retry-interval is given): the blocked shard is retried
# often enough to recover soon after its outage ends.
RETRY_CAP_SECONDS = 30.0


class Outage:
    """The planned outage of organization 7's project replica."""

    def __init__(self) -> None:
        self._until = 0.0  # time.monotonic()
        self.ends_at: datetime | None = None

    def start(self, seconds: float) -> None:
        self._until = time.monotonic() + seconds
        self.ends_at = datetime.now().astimezone() + timedelta(seconds=seconds) if seconds else None

    def active(self) -> bool:
        return time.monotonic() < self._until


outage = Outage()


@app.handler(Category.PROJECT_UPDATE)
async def replicate_project(message: OutboxMessage) -> None:
    if message.shard_identifier == OUTAGE_ORGANIZATION and outage.active():
        ends = outage.ends_at.strftime("%H:%M:%S") if outage.ends_at else "later"
        raise ReplicaUnavailable(
            f"the project replica of organization {OUTAGE_ORGANIZATION} is down until {ends} "
            "(the demo's planned outage)"
        )
    if random.random() < FLAKY_SHARE:
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
    log.debug("provisioned organization %s", message.object_identifier)


def demo_settings(settings: OutboxSettings) -> OutboxSettings:
    """``settings`` with retries capped at :data:`RETRY_CAP_SECONDS`, unless a cap was given."""
    if "max_retry_interval" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"max_retry_interval": RETRY_CAP_SECONDS})


def banner(settings: OutboxSettings, ui: str | None) -> list[str]:
    """What the demo does, for the worker's banner (lines indented by two spaces)."""
    shard = f"ORGANIZATION:{OUTAGE_ORGANIZATION}"
    workflow = f"outbox:{app.table().name}:{shard}"
    where = (
        f"{ui}/namespaces/{settings.temporal_namespace}/workflows/{workflow}"
        if ui
        else f"workflow {workflow} in the Temporal UI"
    )
    lines = ["Demo: about 20 rows/s over 25 organizations and 50 users."]
    if settings.demo_outage and outage.ends_at is not None:
        lines += [
            f"- {shard} is blocked: the project replica of organization {OUTAGE_ORGANIZATION} "
            f"is down until {outage.ends_at:%H:%M:%S} ({settings.demo_outage:g} s), so each of "
            f"its PROJECT_UPDATE calls fails and the shard waits, retried every "
            f"{settings.max_retry_interval:g} s at most, while the other shards go on. Open it, "
            "skip it and resume it (the quick start shows how):",
            f"  {where}",
        ]
    lines += [
        f"- One other PROJECT_UPDATE call in {round(1 / FLAKY_SHARE)} fails at random: its "
        "partition tries it again at once, and it goes on without a workflow of its own.",
        "- One row in thirty provisions an organization 5 to 30 s later: its shard waits for "
        "it (deferred).",
    ]
    if not settings.log_failures:
        lines.append(
            "- Handler failures are counted under the summary lines; --log-failures logs each."
        )
    return lines


async def write_traffic(
    engine: AsyncEngine,
    stop: asyncio.Event,
    *,
    rows_per_second: float = 20,
    outage_seconds: float = 0.0,
) -> None:
    """Start the outage of organization 7's replica for ``outage_seconds``, then write demo
    rows until ``stop`` is set, one small transaction at a time; the first is a PROJECT_UPDATE
    of organization 7, which blocks its shard while the outage lasts."""
    outage.start(outage_seconds)
    rng = random.Random()
    written = 0
    while not stop.is_set():
        async with engine.begin() as conn:
            await app.write_async(conn, **_next_row(rng, written))
        written += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=1 / rows_per_second)
        except TimeoutError:
            pass


def _next_row(rng: random.Random, written: int) -> dict[str, Any]:
    """The arguments of ``app.write_async`` for the demo's next row."""
    org = OUTAGE_ORGANIZATION if written == 0 else rng.randint(1, 25)
    choice = 0.0 if written == 0 else rng.random()
    if choice < 0.4:  # coalescible: the same project updated again and again
        project = org * 100 + rng.randint(1, 3)
        name = {"name": f"project-{rng.randint(1, 9)}"}
        return _row(Category.PROJECT_UPDATE, org, project, payload=name)
    if choice < 0.6:
        return _row(Category.ORGANIZATION_UPDATE, org, org, payload={"slug": f"org-{org}"})
    if choice < 0.75:
        user = rng.randint(1, 50)
        return _row(Category.USER_UPDATE, user, user)
    if choice < 0.97:
        return _row(Category.AUDIT_LOG_EVENT, org, written, payload={"event": "member.invite"})
    later = timedelta(seconds=rng.randint(5, 30))
    return _row(Category.PROVISION_ORGANIZATION, org, org, scheduled_for=later)


def _row(category: Category, shard: int, obj: int, **more: Any) -> dict[str, Any]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **more}
