"""A FastAPI service that writes outbox rows in its request transactions and waits for them.

Each request changes models with an ``AsyncSession`` in one transaction; the models write their
outbox rows in the same flush, and ``outbox_context(session, flush=True)`` waits until the
worker has handled them before the response says what happened per shard. Run it with::

    uvicorn --factory examples.projects.api:create_api

next to ``OUTBOX_APP=examples.projects.outbox:app python worker.py`` (see examples/README.md).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and some
# of them are defined inside create_api.
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from examples.projects.outbox import Base, Category, Organization, Project, app
from outbox_bridge import (
    ConfigurationError,
    OutboxContext,
    OutboxSettings,
    create_outbox_tables,
    next_object_identifier_async,
    outbox_context,
)
from outbox_bridge.config import sqlalchemy_url


class NewOrganization(BaseModel):
    name: str = Field(min_length=1, max_length=200)


class NewProject(BaseModel):
    name: str = Field(min_length=1, max_length=200)


class Created(BaseModel):
    id: int
    handled: bool = Field(description="Every row the request wrote was handled before the answer.")
    shards: dict[str, str] = Field(description="The flush outcome of each shard written to.")


def created(new_id: int, outbox: OutboxContext) -> Created:
    return Created(
        id=new_id,
        handled=outbox.report.handled,
        shards={result.shard: result.outcome for result in outbox.report},
    )


def create_api(settings: OutboxSettings | None = None) -> FastAPI:
    """The service, configured like the worker (``OUTBOX_DATABASE_URL``, ``TEMPORAL_ADDRESS``,
    ``OUTBOX_TASK_QUEUE``, ...); it needs the worker's database URL."""
    settings = settings if settings is not None else OutboxSettings()
    if settings.database_url is None:
        raise ConfigurationError(
            "set OUTBOX_DATABASE_URL to the worker's database (the banner of worker.py shows it)"
        )
    engine = create_async_engine(sqlalchemy_url(settings.database_url.get_secret_value()))
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    app.configure_flush(settings)

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        # A real service would run its migrations instead (docs/how-to/tables.md).
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
            await create_outbox_tables(conn, app.metadata)
        yield
        await engine.dispose()

    api = FastAPI(title="outbox-bridge example: projects", lifespan=lifespan)

    async def open_session() -> AsyncIterator[AsyncSession]:
        async with sessions() as session:
            yield session

    Session = Annotated[AsyncSession, Depends(open_session)]

    @api.post("/organizations", status_code=201)
    async def create_organization(body: NewOrganization, session: Session) -> Created:
        async with outbox_context(session, flush=True) as outbox:
            organization = Organization(name=body.name)
            session.add(organization)
            await session.commit()  # writes the ORGANIZATION_UPDATE row in the same flush
        return created(organization.id, outbox)

    @api.post("/organizations/{organization_id}/projects", status_code=201)
    async def create_project(organization_id: int, body: NewProject, session: Session) -> Created:
        async with outbox_context(session, flush=True) as outbox:
            if await session.get(Organization, organization_id) is None:
                raise HTTPException(404, f"no organization {organization_id}")
            project = Project(organization_id=organization_id, name=body.name)
            session.add(project)
            await session.flush()  # the PROJECT_UPDATE row, and the project's id
            await app.write_async(
                session,
                category=Category.AUDIT_EVENT,
                shard_identifier=organization_id,
                # Every audit event must be delivered: an identifier of its own, never coalesced.
                object_identifier=await next_object_identifier_async(session, app),
                payload={"event": "project.created", "project_id": project.id},
            )
            await session.commit()
        return created(project.id, outbox)

    return api
