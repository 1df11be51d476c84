"""OutboxModel: saving or deleting a model instance writes its outbox row in the same flush.

Against a real PostgreSQL: the row commits and rolls back with the model change, identifiers are
inferred from the declaration (or refused with OutboxModelError), bulk statements write no row
unless write_outbox_rows is called, and rows written by the ORM are seen by outbox_context.
Minted object identifiers are unique and their rows never coalesce.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Integer,
    String,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Session, mapped_column, relationship

from outbox_bridge import (
    OutboxApp,
    OutboxModel,
    OutboxModelError,
    OutboxTable,
    PayloadTooLargeError,
    next_object_identifier,
    next_object_identifier_async,
    outbox_context,
    write_outbox_rows,
    write_outbox_rows_async,
)
from outbox_bridge.testing import drain_outbox_async
from tests.harness import (
    SCOPES,
    Category,
    Recorder,
    Scope,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    table_empty,
    unique_table,
)


@dataclass
class Models:
    """Model classes of one test, on tables of their own."""

    Base: Any
    Organization: Any
    Project: Any
    Membership: Any


def declare_models(app: OutboxApp) -> Models:
    suffix = unique_table()

    class Base(DeclarativeBase):
        pass

    class Replicated(OutboxModel):
        __outbox_app__ = app

    class Organization(Replicated, Base):
        # The scope's own model: its primary key is its shard identifier.
        __tablename__ = f"organization_{suffix}"
        __outbox_category__ = Category.ORGANIZATION_UPDATE
        id = mapped_column(BigInteger, primary_key=True)
        name = mapped_column(String, nullable=False)
        projects = relationship(
            "Project", cascade="all, delete-orphan", back_populates="organization"
        )

    class Project(Replicated, Base):
        # organization_id is the shard identifier of scope ORGANIZATION.
        __tablename__ = f"project_{suffix}"
        __outbox_category__ = Category.PROJECT_UPDATE
        id = mapped_column(BigInteger, primary_key=True)
        organization_id = mapped_column(ForeignKey(f"organization_{suffix}.id"), nullable=True)
        name = mapped_column(String, nullable=False)
        organization = relationship("Organization", back_populates="projects")

        def outbox_payload(self, operation: str) -> Any:
            return {"operation": operation, "name": self.name}

    class Membership(Replicated, Base):
        # Declared attributes: the shard is the user, the object an external number.
        __tablename__ = f"membership_{suffix}"
        __outbox_category__ = Category.USER_UPDATE
        __outbox_shard__ = "account"
        __outbox_object__ = "external_number"
        id = mapped_column(BigInteger, primary_key=True)
        account = mapped_column(BigInteger, nullable=False)
        external_number = mapped_column(Integer, nullable=False)

    return Models(Base, Organization, Project, Membership)


@dataclass
class World:
    app: OutboxApp
    models: Models


@pytest.fixture
async def world(engine: AsyncEngine) -> World:
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    await create_tables(engine, app)
    models = declare_models(app)
    async with engine.begin() as conn:
        await conn.run_sync(models.Base.metadata.create_all)
    return World(app, models)


async def outbox_rows(engine: AsyncEngine, app: OutboxApp) -> list[tuple[Any, ...]]:
    """(scope, shard, category, object, payload) of every committed row, in id order."""
    table = app.table()
    async with engine.connect() as conn:
        result = await conn.execute(
            select(
                table.c.shard_scope,
                table.c.shard_identifier,
                table.c.category,
                table.c.object_identifier,
                table.c.payload,
            ).order_by(table.c.id)
        )
        return [tuple(row) for row in result]


def org_row(org_id: int) -> tuple[Any, ...]:
    return (Scope.ORGANIZATION, org_id, Category.ORGANIZATION_UPDATE, org_id, None)


def project_row(org_id: int, project_id: int, operation: str, name: str) -> tuple[Any, ...]:
    return (
        Scope.ORGANIZATION,
        org_id,
        Category.PROJECT_UPDATE,
        project_id,
        {"operation": operation, "name": name},
    )


# -- saving and deleting ---------------------------------------------------------------------------


async def test_insert_update_and_delete_write_their_rows(engine, sync_engine, world) -> None:
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        org = Organization(id=41, name="acme")
        project = Project(id=7, name="apollo", organization=org)  # FK set by the flush
        session.add_all([org, project])
        session.commit()
        assert await outbox_rows(engine, world.app) == [
            org_row(41),
            project_row(41, 7, "insert", "apollo"),
        ]

        project.name = "gemini"
        session.commit()
        assert project.name == "gemini"  # loaded again: the commit expired it
        project.name = "gemini"  # no net change: no UPDATE, so no row
        session.commit()
        session.delete(project)
        session.commit()
    assert (await outbox_rows(engine, world.app))[2:] == [
        project_row(41, 7, "update", "gemini"),
        project_row(41, 7, "delete", "gemini"),
    ]


async def test_a_payload_over_the_limit_fails_the_flush_and_nothing_commits(
    engine, sync_engine, world
) -> None:
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        session.add(Organization(id=51, name="acme"))
        session.commit()
        session.add(Project(id=8, name="x" * 2**20, organization_id=51))
        with pytest.raises(PayloadTooLargeError, match="PROJECT_UPDATE for object 8 is 1 MiB"):
            session.commit()
        session.rollback()
        assert session.scalar(select(func.count()).select_from(Project)) == 0
    assert await outbox_rows(engine, world.app) == [org_row(51)]


async def test_database_generated_primary_keys_are_known(engine, sync_engine, world) -> None:
    """A new object's id exists only after its INSERT: the row is written after it."""
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        org = Organization(name="globex")  # id from the database
        session.add(org)
        session.flush()
        project = Project(name="zeus", organization_id=org.id)
        session.add(project)
        session.commit()
        ids = org.id, project.id
    assert await outbox_rows(engine, world.app) == [
        org_row(ids[0]),
        project_row(ids[0], ids[1], "insert", "zeus"),
    ]


async def test_row_rolls_back_with_the_model_change(engine, sync_engine, world) -> None:
    Organization = world.models.Organization
    table = world.app.table()
    with Session(sync_engine) as session:
        session.add(Organization(id=5, name="initech"))
        session.flush()
        # Written by the flush, in the session's transaction...
        inside = session.execute(select(func.count()).select_from(table)).scalar_one()
        assert inside == 1
        # ... and not visible to anyone else before commit.
        assert await outbox_rows(engine, world.app) == []
        session.rollback()
    assert await outbox_rows(engine, world.app) == []
    with Session(sync_engine) as session:
        assert session.get(Organization, 5) is None


async def test_cascades_orphans_and_expired_instances(engine, sync_engine, world) -> None:
    """Deletes the unit of work decides on its own (delete-orphan, cascade) write rows too, and
    a deleted instance whose attributes were expired still gets its shard identifier."""
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        org = Organization(id=3, name="umbrella")
        org.projects = [
            Project(id=30, name="a"),
            Project(id=31, name="b"),
            Project(id=32, name="c"),
        ]
        session.add(org)
        session.commit()
    written = len(await outbox_rows(engine, world.app))
    assert written == 4

    with Session(sync_engine) as session:
        org = session.get(Organization, 3)
        assert org is not None
        orphan = next(p for p in org.projects if p.id == 30)
        org.projects.remove(orphan)  # delete-orphan: never in session.deleted
        session.commit()  # expires every instance
        expired = session.get(Project, 31)
        session.expire(expired)
        session.delete(expired)
        session.commit()
        session.delete(session.get(Organization, 3))  # cascades to project 32
        session.commit()
    rows = (await outbox_rows(engine, world.app))[written:]
    assert rows[:2] == [project_row(3, 30, "delete", "a"), project_row(3, 31, "delete", "b")]
    assert sorted(rows[2:], key=lambda r: r[2]) == [
        org_row(3),
        project_row(3, 32, "delete", "c"),
    ]


async def test_declared_shard_and_object_attributes(engine, sync_engine, world) -> None:
    Membership = world.models.Membership
    with Session(sync_engine) as session:
        session.add(Membership(id=1, account=900, external_number=77))
        session.commit()
    assert await outbox_rows(engine, world.app) == [
        (Scope.USER, 900, Category.USER_UPDATE, 77, None)
    ]


async def test_missing_identifier_at_flush_fails_the_flush(engine, sync_engine, world) -> None:
    Project = world.models.Project
    with Session(sync_engine) as session:
        session.add(Project(id=1, name="loose"))  # no organization: no shard identifier
        with pytest.raises(OutboxModelError, match=r"shard identifier \(organization_id\) is None"):
            session.commit()
        session.rollback()
    assert await outbox_rows(engine, world.app) == []
    with Session(sync_engine) as session:
        assert session.get(Project, 1) is None  # the model change did not commit either


# -- async sessions and outbox_context -------------------------------------------------------------


async def test_async_session_rows_are_flushed_by_outbox_context(servers, engine) -> None:
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    models = declare_models(app)
    async with engine.begin() as conn:
        await conn.run_sync(models.Base.metadata.create_all)
    async with running_worker(servers, app, fast_settings()) as settings:
        app.configure_flush(
            settings.model_copy(update={"temporal_address": servers.temporal_address})
        )
        async with AsyncSession(engine) as session:
            async with outbox_context(session, flush=True) as outbox:
                org = models.Organization(id=12, name="hooli")
                session.add_all([org, models.Project(id=120, name="nucleus", organization=org)])
                await session.commit()
        # Handled before the context returned: the ORM's rows were recorded like app.write's.
        assert outbox.report.handled
        assert [r.shard for r in outbox.report] == ["ORGANIZATION:12"]
        assert sorted((c.category, c.object_identifier) for c in recorder.calls) == [
            (Category.ORGANIZATION_UPDATE, 12),
            (Category.PROJECT_UPDATE, 120),
        ]
        assert await table_empty(engine, app)


# -- bulk statements -------------------------------------------------------------------------------


async def test_bulk_statements_write_no_rows(engine, sync_engine, world) -> None:
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        session.add(Organization(id=8, name="stark"))
        session.commit()
    before = await outbox_rows(engine, world.app)
    with Session(sync_engine) as session:
        session.execute(insert(Project), [{"id": 80, "organization_id": 8, "name": "x"}])
        session.bulk_insert_mappings(Project, [{"id": 81, "organization_id": 8, "name": "y"}])
        session.execute(update(Project).where(Project.organization_id == 8).values(name="z"))
        session.execute(delete(Project).where(Project.id == 81))
        session.commit()
    assert await outbox_rows(engine, world.app) == before
    with Session(sync_engine) as session:
        assert session.scalars(select(Project.name)).all() == ["z"]


async def test_write_outbox_rows_for_bulk_statements(engine, sync_engine, world) -> None:
    Organization, Project = world.models.Organization, world.models.Project
    with Session(sync_engine) as session:
        session.add(Organization(id=9, name="wayne"))
        session.commit()
    written = len(await outbox_rows(engine, world.app))
    with Session(sync_engine) as session:
        created = session.scalars(
            insert(Project).returning(Project, sort_by_parameter_order=True),
            [
                {"id": 90, "organization_id": 9, "name": "a"},
                {"id": 91, "organization_id": 9, "name": "b"},
            ],
        ).all()
        write_outbox_rows(session, created, operation="insert")
        renamed = session.scalars(
            update(Project).where(Project.id == 91).values(name="c").returning(Project)
        ).all()
        write_outbox_rows(session, renamed)
        session.commit()
    async with AsyncSession(engine) as session:
        gone = (
            await session.scalars(delete(Project).where(Project.id == 90).returning(Project))
        ).all()
        await write_outbox_rows_async(session, gone, operation="delete")
        await session.commit()
    assert (await outbox_rows(engine, world.app))[written:] == [
        project_row(9, 90, "insert", "a"),
        project_row(9, 91, "insert", "b"),
        project_row(9, 91, "update", "c"),
        project_row(9, 90, "delete", "a"),
    ]


async def test_write_outbox_rows_refusals(engine, sync_engine, world) -> None:
    Project = world.models.Project

    class Plain:
        pass

    with Session(sync_engine) as session:
        with pytest.raises(OutboxModelError, match="not a mapped class declared with OutboxModel"):
            write_outbox_rows(session, [Plain()])
        with pytest.raises(OutboxModelError, match="organization_id"):
            # Checked before anything is written: the valid first instance writes nothing.
            write_outbox_rows(
                session, [Project(id=1, organization_id=1, name="a"), Project(id=2, name="b")]
            )
        with pytest.raises(ValueError, match="operation"):
            write_outbox_rows(session, [], operation="upsert")  # type: ignore[arg-type]
        session.commit()
    async with AsyncSession(engine) as async_session:
        with pytest.raises(TypeError, match="write_outbox_rows_async"):
            write_outbox_rows(async_session, [])  # type: ignore[arg-type]
    assert await outbox_rows(engine, world.app) == []


# -- declarations that do not fit -----------------------------------------------------------------


def declare(app: OutboxApp, **attributes: Any) -> type:
    """Declare a model on a fresh base with ``attributes`` (columns and outbox options)."""

    class Base(DeclarativeBase):
        pass

    class_name = attributes.pop("class_name", "Model")
    namespace: dict[str, Any] = {
        "__tablename__": f"model_{unique_table()}",
        "__outbox_app__": app,
        "id": mapped_column(BigInteger, primary_key=True),
        **attributes,
    }
    return type(class_name, (OutboxModel, Base), namespace)


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({}, r"declare __outbox_category__"),
        (
            {"__outbox_category__": Category.PROJECT_UPDATE},
            r"Model: cannot infer the shard identifier of scope ORGANIZATION: it has no attribute "
            r"'organization_id' and is not the Organization model; declare __outbox_shard__",
        ),
        (
            {"__outbox_category__": Category.USER_UPDATE, "__outbox_shard__": "owner_id"},
            r"__outbox_shard__ is 'owner_id', which is not the name of an attribute of Model",
        ),
        (
            {"__outbox_category__": 99, "user_id": mapped_column(BigInteger)},
            r"99 is not registered",
        ),
        (
            {
                "__outbox_category__": Category.USER_UPDATE,
                "user_id": mapped_column(BigInteger),
                "__outbox_table__": "elsewhere",
            },
            r"__outbox_table__: table 'elsewhere' is not part of this app",
        ),
        (
            {
                "__outbox_category__": Category.USER_UPDATE,
                "user_id": mapped_column(BigInteger),
                "id": mapped_column(String, primary_key=True),
            },
            r"primary key, which must be one integer column \(it is id VARCHAR\); declare "
            r"__outbox_object__",
        ),
        (
            {
                "__outbox_category__": Category.USER_UPDATE,
                "user_id": mapped_column(BigInteger, primary_key=True),
                "id": mapped_column(BigInteger, primary_key=True),
            },
            r"must be one integer column",
        ),
        (
            {"__outbox_category__": Category.ORGANIZATION_UPDATE, "class_name": "Team"},
            r"Team: cannot infer the shard identifier",
        ),
    ],
)
def test_declarations_that_do_not_fit_are_refused_when_mapped(attributes, message) -> None:
    app = OutboxApp(scopes=SCOPES, categories=[Category])
    with pytest.raises(OutboxModelError, match=message):
        declare(app, **attributes)


class AuditScope(IntEnum):
    AUDIT_LOG = 3


class AuditCategory(IntEnum):
    AUDIT_LOG_EVENT = 20


async def test_inferred_shard_identifiers(engine, sync_engine) -> None:
    """``<scope>_id`` when the class has it, else the primary key of the scope's own model (the
    scope name in CamelCase)."""
    app = OutboxApp(
        scopes={**SCOPES, AuditScope.AUDIT_LOG: {AuditCategory.AUDIT_LOG_EVENT}},
        tables=[OutboxTable(unique_table())],
    )
    await create_tables(engine, app)
    organization = declare(
        app, class_name="Organization", __outbox_category__=Category.ORGANIZATION_UPDATE
    )
    project = declare(
        app,
        class_name="Project",
        __outbox_category__=Category.PROJECT_UPDATE,
        organization_id=mapped_column(BigInteger),
    )
    user = declare(app, class_name="User", __outbox_category__=Category.USER_UPDATE)
    audit_log = declare(
        app, class_name="AuditLog", __outbox_category__=AuditCategory.AUDIT_LOG_EVENT
    )
    with Session(sync_engine) as session:
        instances = [
            organization(id=5),
            project(id=6, organization_id=5),
            user(id=7),
            audit_log(id=8),
        ]
        write_outbox_rows(session, instances, operation="insert")
        session.commit()
    assert [row[:4] for row in await outbox_rows(engine, app)] == [
        (Scope.ORGANIZATION, 5, Category.ORGANIZATION_UPDATE, 5),
        (Scope.ORGANIZATION, 5, Category.PROJECT_UPDATE, 6),
        (Scope.USER, 7, Category.USER_UPDATE, 7),
        (AuditScope.AUDIT_LOG, 8, AuditCategory.AUDIT_LOG_EVENT, 8),
    ]


def test_app_must_be_declared_and_regional_tables_are_refused() -> None:
    with pytest.raises(OutboxModelError, match="__outbox_app__ must be the OutboxApp"):
        declare(None, __outbox_category__=Category.USER_UPDATE)  # type: ignore[arg-type]
    regional = OutboxApp(scopes=SCOPES, tables=[OutboxTable("outbox", regional=True)])
    with pytest.raises(OutboxModelError, match="regional"):
        declare(
            regional, __outbox_category__=Category.USER_UPDATE, user_id=mapped_column(BigInteger)
        )


# -- minted object identifiers ---------------------------------------------------------------------


async def test_next_object_identifier_is_unique(engine, sync_engine) -> None:
    app = OutboxApp(scopes=SCOPES, tables=[OutboxTable(unique_table())])
    await create_tables(engine, app)
    minted: list[int] = []
    with Session(sync_engine) as session:
        minted.append(next_object_identifier(session, app))
        session.rollback()  # used up anyway: never handed out again
        minted.append(next_object_identifier(session, app))
        session.commit()
    with sync_engine.connect() as conn:
        minted.append(next_object_identifier(conn, app, app.table().name))
    async with AsyncSession(engine) as session:
        minted.append(await next_object_identifier_async(session, app))
        with pytest.raises(TypeError, match="next_object_identifier_async"):
            next_object_identifier(session, app)
    async with engine.connect() as conn:
        minted.append(await next_object_identifier_async(conn, app))
        # A row written after minting gets a higher id: they share the table's sequence.
        row_id = await app.write_async(
            conn, category=Category.USER_UPDATE, shard_identifier=1, object_identifier=minted[-1]
        )
        await conn.commit()
    assert minted == sorted(set(minted)) and row_id > minted[-1]


async def test_minted_identifiers_never_coalesce(engine) -> None:
    """Three events of one shard and category, each with a minted identifier: three handler
    calls. With one shared identifier they would have been one call. (The worker's coalescing,
    in-process: tests/test_testing_drain.py shows it is the worker's.)"""
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    async with engine.begin() as conn:
        for _ in range(3):
            await app.write_async(
                conn,
                category=Category.USER_UPDATE,
                shard_identifier=4,
                object_identifier=await next_object_identifier_async(conn, app),
            )
        for _ in range(3):
            await app.write_async(
                conn, category=Category.USER_UPDATE, shard_identifier=5, object_identifier=1
            )
    await drain_outbox_async(app, engine)
    assert await table_empty(engine, app)
    by_shard = sorted((c.shard, c.coalesced) for c in recorder.calls)
    assert by_shard == [("2:4", 1), ("2:4", 1), ("2:4", 1), ("2:5", 3)]
