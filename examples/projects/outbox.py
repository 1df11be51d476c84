"""The example's domain: organizations and their projects, replicated by outbox handlers.

The worker runs it with ``OUTBOX_APP=examples.projects.outbox:app python worker.py``. Saving
or deleting an ``Organization`` or a ``Project`` writes its outbox row in the same transaction
(``OutboxModel``). Audit events are rows of their own, in a scope of their own, with minted
object identifiers so that none is coalesced away.
"""

from __future__ import annotations

import logging
from enum import IntEnum

from sqlalchemy import BigInteger, ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox_bridge import OutboxApp, OutboxMessage, OutboxModel, OutboxTable

log = logging.getLogger("examples.projects")


class Scope(IntEnum):
    ORGANIZATION = 1
    AUDIT_LOG = 2  # apart from ORGANIZATION: a failing audit sink blocks no replication


class Category(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2
    AUDIT_EVENT = 3


app = OutboxApp(
    scopes={
        Scope.ORGANIZATION: {Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE},
        Scope.AUDIT_LOG: {Category.AUDIT_EVENT},
    },
    categories=[Category],
    tables=[OutboxTable("example_outbox")],
)


class Base(DeclarativeBase):
    pass


class Replicated(OutboxModel):
    __outbox_app__ = app


class Organization(Replicated, Base):
    # The scope's own model: its id is the shard identifier.
    __tablename__ = "example_organization"
    __outbox_category__ = Category.ORGANIZATION_UPDATE

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class Project(Replicated, Base):
    # organization_id is the shard identifier: an organization's changes are handled in order.
    __tablename__ = "example_project"
    __outbox_category__ = Category.PROJECT_UPDATE

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    organization_id: Mapped[int] = mapped_column(ForeignKey("example_organization.id"))
    name: Mapped[str] = mapped_column(String(200))


@app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)
async def replicate(message: OutboxMessage) -> None:
    # Rows coalesce: read the current state by id rather than trusting a payload.
    log.info(
        "replicating %s %d of organization %d (%d row(s))",
        message.category.name if isinstance(message.category, IntEnum) else message.category,
        message.object_identifier,
        message.shard_identifier,
        message.coalesced,
    )


@app.handler(Category.AUDIT_EVENT)
async def ship_audit_event(message: OutboxMessage) -> None:
    log.info("audit event %d: %s", message.object_identifier, message.payload)
