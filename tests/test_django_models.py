"""Outbox rows from Django models (outbox_bridge.contrib.django.models.OutboxModel): saves and
deletes write their rows in the change's transaction, QuerySet.delete() and cascades too, bulk
operations write none until write_outbox_rows; declarations follow the SQLAlchemy mixin's rules
and refusals, at class definition. Real PostgreSQL; no worker."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, models, transaction
from django.test.utils import isolate_apps

from outbox_bridge import OutboxApp, OutboxModelError, OutboxTable
from outbox_bridge.contrib.django.models import (
    OutboxModel,
    write_outbox_rows,
    write_outbox_rows_async,
)
from tests.django_app.models import Note, Organization, Project
from tests.django_app.outbox import app
from tests.django_support import rows
from tests.harness import SCOPES, Category, Scope

pytestmark = pytest.mark.usefixtures("empty_outbox")

ORG, USER = int(Scope.ORGANIZATION), int(Scope.USER)


@pytest.fixture
def empty_outbox(django_db_blocker: Any) -> None:
    with django_db_blocker.unblock(), connections["default"].cursor() as cursor:
        cursor.execute("DELETE FROM django_outbox")


def written() -> list[tuple[int, int, int, int, Any]]:
    """(scope, shard, category, object, payload) of each row, oldest first."""
    return [
        (
            r["shard_scope"],
            r["shard_identifier"],
            r["category"],
            r["object_identifier"],
            r["payload"],
        )
        for r in rows()
    ]


@pytest.mark.django_db(transaction=True)
def test_saves_and_deletes_write_their_rows() -> None:
    organization = Organization.objects.create(name="acme")
    org = organization.pk
    project = Project.objects.create(organization=organization, name="apollo")
    project.name = "artemis"
    project.save()
    key = project.pk
    project.delete()
    update = Category.PROJECT_UPDATE
    assert written() == [
        # The scope's own model: its primary key is the shard identifier.
        (ORG, org, Category.ORGANIZATION_UPDATE, org, None),
        # organization_id, the foreign key's column: the shard identifier.
        (ORG, org, update, key, {"operation": "insert", "name": "apollo"}),
        (ORG, org, update, key, {"operation": "update", "name": "artemis"}),
        (ORG, org, update, key, {"operation": "delete", "name": "artemis"}),
    ]


@pytest.mark.django_db(transaction=True)
def test_queryset_deletes_and_cascades_write_a_row_per_object() -> None:
    organization = Organization.objects.create(name="acme")
    projects = [Project.objects.create(organization=organization, name=n) for n in "ab"]
    keys = [organization.pk, *(p.pk for p in projects)]
    Project.objects.filter(pk=keys[1]).delete()
    organization.delete()  # cascades to the other project, which Django deletes first
    assert [r[2:] for r in written()[3:]] == [
        (Category.PROJECT_UPDATE, keys[1], {"operation": "delete", "name": "a"}),
        (Category.PROJECT_UPDATE, keys[2], {"operation": "delete", "name": "b"}),
        (Category.ORGANIZATION_UPDATE, keys[0], None),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_save_in_autocommit_commits_with_its_row_or_not_at_all(monkeypatch) -> None:
    organization = Organization.objects.create(name="acme")  # no atomic() around it
    assert len(written()) == 1

    def refuse(self: Project, operation: str) -> Any:
        raise RuntimeError("the row cannot be built")

    monkeypatch.setattr(Project, "outbox_payload", refuse)
    with pytest.raises(RuntimeError):
        Project.objects.create(organization=organization, name="never")
    assert not Project.objects.exists()  # the model change rolled back with its row
    assert len(written()) == 1


@pytest.mark.django_db(transaction=True)
def test_a_change_rolled_back_leaves_no_row() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Organization.objects.create(name="acme")
        raise RuntimeError("the request failed")
    assert written() == []


@pytest.mark.django_db(transaction=True)
def test_bulk_operations_write_no_row_until_write_outbox_rows() -> None:
    organization = Organization.objects.create(name="acme")
    with transaction.atomic():
        created = Project.objects.bulk_create(
            [Project(organization=organization, name=n) for n in ("a", "b")]
        )
        Project.objects.filter(organization=organization).update(name="renamed")
        Note.objects.create(text="no outbox row")
        assert len(written()) == 1  # the organization's
        ids = write_outbox_rows(created, operation="insert")
    assert [r["id"] for r in rows()][1:] == ids
    assert [r[3:] for r in written()[1:]] == [
        (created[0].pk, {"operation": "insert", "name": "a"}),
        (created[1].pk, {"operation": "insert", "name": "b"}),
    ]


@pytest.mark.django_db(transaction=True)
def test_write_outbox_rows_checks_every_row_before_writing_any() -> None:
    organization = Organization.objects.create(name="acme")
    valid = Project(id=1, organization=organization, name="a")
    unsaved = Project(name="b")  # no organization: no shard identifier
    with transaction.atomic():
        with pytest.raises(
            OutboxModelError,
            match=r"cannot write the outbox row of a new Project: its shard identifier "
            r"\(organization_id\) is None, not an integer; set it before saving it",
        ):
            write_outbox_rows([valid, unsaved])
        with pytest.raises(OutboxModelError, match="Note is not a concrete model declared"):
            write_outbox_rows([Note(id=1)])
        with pytest.raises(ValueError, match="operation"):
            write_outbox_rows([valid], operation="upsert")  # type: ignore[arg-type]
    assert len(written()) == 1


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_model_saved_on_another_database_writes_its_row_there() -> None:
    organization = Organization(name="elsewhere")
    organization.save(using="other")
    organization.delete()  # on the database it came from
    assert written() == []
    assert [r["category"] for r in rows(using="other")] == [Category.ORGANIZATION_UPDATE] * 2
    with connections["other"].cursor() as cursor:
        cursor.execute("DELETE FROM django_outbox")


@pytest.fixture
async def async_db(transactional_db: None) -> Any:
    yield
    await sync_to_async(connections.close_all, thread_sensitive=True)()


async def test_async_saves_deletes_and_bulk_rows(async_db) -> None:
    organization = Organization(name="acme")
    await organization.asave()
    projects = await Project.objects.abulk_create([Project(organization=organization, name="a")])
    await write_outbox_rows_async(projects, operation="insert")
    await organization.adelete()
    found = [(r[2], r[4]) for r in await sync_to_async(written, thread_sensitive=True)()]
    assert found == [
        (Category.ORGANIZATION_UPDATE, None),
        (Category.PROJECT_UPDATE, {"operation": "insert", "name": "a"}),
        (Category.PROJECT_UPDATE, {"operation": "delete", "name": "a"}),
        (Category.ORGANIZATION_UPDATE, None),
    ]


# -- declarations --------------------------------------------------------------------------------


def declare(outbox: OutboxApp | None, **attributes: Any) -> type[models.Model]:
    """Define a model (in an isolated app registry) with ``attributes``: fields and outbox
    options."""
    class_name = attributes.pop("class_name", "Model")
    namespace: dict[str, Any] = {
        "__module__": "tests.django_app.models",
        "__outbox_app__": outbox,
        **attributes,
    }
    return type(class_name, (OutboxModel,), namespace)


# The SQLAlchemy mixin's refusals (tests/test_orm.py), with Django's fields.
REFUSALS = [
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
    ({"__outbox_category__": 99, "user_id": models.BigIntegerField()}, r"99 is not registered"),
    (
        {
            "__outbox_category__": Category.USER_UPDATE,
            "user_id": models.BigIntegerField(),
            "__outbox_table__": "elsewhere",
        },
        r"__outbox_table__: table 'elsewhere' is not part of this app",
    ),
    (
        {
            "__outbox_category__": Category.USER_UPDATE,
            "user_id": models.BigIntegerField(),
            "code": models.CharField(max_length=10, primary_key=True),
        },
        r"primary key, which must be one integer column \(it is code CharField\); declare "
        r"__outbox_object__",
    ),
    (
        {"__outbox_category__": Category.ORGANIZATION_UPDATE, "class_name": "Team"},
        r"Team: cannot infer the shard identifier",
    ),
]


@isolate_apps("tests.django_app")
@pytest.mark.parametrize(("attributes", "message"), REFUSALS)
def test_declarations_that_do_not_fit_are_refused_when_defined(attributes, message) -> None:
    outbox = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable("django_outbox")])
    with pytest.raises(OutboxModelError, match=message):
        declare(outbox, **attributes)


@isolate_apps("tests.django_app")
def test_the_app_must_be_declared_and_regional_tables_are_refused() -> None:
    with pytest.raises(OutboxModelError, match="__outbox_app__ must be the OutboxApp"):
        declare(None, __outbox_category__=Category.USER_UPDATE)
    regional = OutboxApp(scopes=SCOPES, tables=[OutboxTable("outbox", regional=True)])
    with pytest.raises(OutboxModelError, match="regional"):
        declare(
            regional, __outbox_category__=Category.USER_UPDATE, user_id=models.BigIntegerField()
        )


@isolate_apps("tests.django_app")
@pytest.mark.django_db(transaction=True)
def test_inferred_and_declared_identifiers() -> None:
    """``<scope>_id`` when the model has it, else the primary key of the scope's own model; an
    inherited primary key (a parent link) is an integer too."""
    user = declare(app, class_name="User", __outbox_category__=Category.USER_UPDATE)
    member = declare(
        app,
        class_name="Member",
        __outbox_category__=Category.MEMBER_UPDATE,
        __outbox_shard__="team",
        __outbox_object__="number",
        team=models.BigIntegerField(),
        number=models.IntegerField(),
    )
    parent = declare(
        app,
        class_name="Parent",
        __outbox_category__=Category.ORGANIZATION_UPDATE,
        __outbox_shard__="tenant",
        tenant=models.BigIntegerField(),
    )
    child = type("Child", (parent,), {"__module__": "tests.django_app.models"})
    with transaction.atomic():
        write_outbox_rows(
            [user(id=7), member(id=1, team=5, number=9), child(id=3, parent_ptr_id=3, tenant=4)],
            operation="insert",
            using="default",
        )
    assert [r[:4] for r in written()] == [
        (USER, 7, Category.USER_UPDATE, 7),
        (ORG, 5, Category.MEMBER_UPDATE, 9),
        (ORG, 4, Category.ORGANIZATION_UPDATE, 3),
    ]
