"""Unit tests of the registry (the vocabulary of the design contract,
docs/explanation/contract.md): scopes, categories, tables, handlers and --app loading.

No servers: building an OutboxApp touches neither PostgreSQL nor Temporal.
"""

from __future__ import annotations

from enum import IntEnum

import pytest

from outbox_bridge import (
    Handler,
    MissingHandlerError,
    OutboxApp,
    OutboxError,
    OutboxMessage,
    OutboxTable,
    RegistryError,
)
from outbox_bridge.cli.connections import load_app
from tests.harness import SCOPES, Category, Scope


class OtherCategory(IntEnum):
    """A second category enum whose values clash with ``Category`` on purpose."""

    BILLING_UPDATE = 2  # same value as Category.PROJECT_UPDATE
    INVOICE_UPDATE = 50


class LowerScope(IntEnum):
    org = 1
    user = 2


async def _async_handler(message: OutboxMessage) -> None:
    return None


def _sync_handler(message: OutboxMessage) -> None:
    return None


def full_app(**kwargs: object) -> OutboxApp:
    return OutboxApp(scopes=SCOPES, categories=[Category], **kwargs)  # type: ignore[arg-type]


# -- building the registry ----------------------------------------------------------------------


def test_valid_registry_lookups() -> None:
    app = full_app(
        tables=[OutboxTable("first_outbox"), OutboxTable("second_outbox", regional=True)]
    )
    assert set(app.scopes) == {Scope.ORGANIZATION, Scope.USER}
    assert set(app.categories) == set(Category)
    assert app.scope_of(Category.PROJECT_UPDATE) is Scope.ORGANIZATION
    assert app.scope_of(int(Category.USER_UPDATE)) is Scope.USER
    assert app.scope_of(99) is None
    assert app.category(2) is Category.PROJECT_UPDATE
    assert app.category(99) is None
    assert app.scope(2) is Scope.USER
    assert app.scope(99) is None
    # The first table is the default one; each table is a Core table with the outbox columns.
    assert app.table().name == "first_outbox"
    assert app.table("second_outbox").name == "second_outbox"
    assert "region" in app.table("second_outbox").c
    assert "region" not in app.table("first_outbox").c
    assert app.table_spec("second_outbox").regional is True
    assert app.table_spec().regional is False
    assert set(app.metadata.tables) == {
        "first_outbox",
        "second_outbox",
        "first_outbox_owners",  # which shards their own workflow holds
        "second_outbox_owners",
        "first_outbox_parked",  # the parked coalescing groups
        "second_outbox_parked",
        "first_outbox_pauses",  # the paused categories and scopes
        "second_outbox_pauses",
        "first_outbox_limits",  # the categories' rate limits (token buckets)
        "second_outbox_limits",
    }


def test_default_table_is_outbox() -> None:
    app = full_app()
    assert list(app.tables) == ["outbox"]
    assert app.table().name == "outbox"


def test_category_in_two_scopes_names_both_scopes() -> None:
    with pytest.raises(RegistryError) as info:
        OutboxApp(
            scopes={
                Scope.ORGANIZATION: [Category.ORGANIZATION_UPDATE, Category.MEMBER_UPDATE],
                Scope.USER: [Category.USER_UPDATE, Category.MEMBER_UPDATE],
            }
        )
    message = str(info.value)
    assert "MEMBER_UPDATE" in message
    assert "ORGANIZATION" in message
    assert "USER" in message
    assert "exactly one scope" in message


def test_category_values_clashing_across_enums_in_two_scopes() -> None:
    # The table stores values: BILLING_UPDATE (2) in USER would be PROJECT_UPDATE (2) too.
    with pytest.raises(RegistryError) as info:
        OutboxApp(
            scopes={
                Scope.ORGANIZATION: [Category.PROJECT_UPDATE],
                Scope.USER: [OtherCategory.BILLING_UPDATE],
            }
        )
    message = str(info.value)
    assert "BILLING_UPDATE" in message
    assert "PROJECT_UPDATE" in message
    assert "ORGANIZATION" in message and "USER" in message


def test_category_values_clashing_within_one_scope() -> None:
    with pytest.raises(RegistryError) as info:
        OutboxApp(
            scopes={Scope.ORGANIZATION: [Category.PROJECT_UPDATE, OtherCategory.BILLING_UPDATE]}
        )
    message = str(info.value)
    assert "PROJECT_UPDATE" in message and "BILLING_UPDATE" in message
    assert "unique" in message


def test_same_category_listed_twice_in_one_scope_is_harmless() -> None:
    app = OutboxApp(scopes={Scope.USER: [Category.USER_UPDATE, Category.USER_UPDATE]})
    assert app.categories == [Category.USER_UPDATE]
    assert app.scope_of(Category.USER_UPDATE) is Scope.USER


def test_category_in_no_scope_is_refused() -> None:
    scopes: dict[IntEnum, list[IntEnum]] = {
        Scope.ORGANIZATION: [Category.ORGANIZATION_UPDATE],
        Scope.USER: [Category.USER_UPDATE],
    }
    with pytest.raises(RegistryError) as info:
        OutboxApp(scopes=scopes, categories=[Category])
    message = str(info.value)
    assert "PROJECT_UPDATE" in message and "MEMBER_UPDATE" in message
    assert "Category" in message
    assert "no scope" in message
    # Without the declaration of the enum the partial registry is accepted (nothing to check).
    assert set(OutboxApp(scopes=scopes).categories) == {
        Category.ORGANIZATION_UPDATE,
        Category.USER_UPDATE,
    }


def test_scope_and_category_must_be_int_enums() -> None:
    with pytest.raises(RegistryError, match="IntEnum"):
        OutboxApp(scopes={1: [Category.USER_UPDATE]})  # type: ignore[type-var]
    with pytest.raises(RegistryError, match="IntEnum"):
        OutboxApp(scopes={Scope.USER: [10]})  # type: ignore[list-item]


def test_tables_must_be_given_and_unique() -> None:
    with pytest.raises(RegistryError, match="at least one table"):
        full_app(tables=[])
    with pytest.raises(RegistryError, match="unique"):
        full_app(tables=[OutboxTable("outbox"), OutboxTable("outbox", regional=True)])


@pytest.mark.parametrize(
    "name",
    [
        "Outbox; drop",
        "1abc",
        "",
        "Outbox",
        "out-box",
        "out box",
        "outbox\n",  # re.match with "$" would let a trailing newline through
        "ünïcode",
        "a" * 49,
        "user",  # reserved words: the NOTIFY trigger DDL would not parse
        "select",
        "order",
        "table",
    ],
)
def test_invalid_table_names(name: str) -> None:
    with pytest.raises(RegistryError) as info:
        OutboxTable(name)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name", ["outbox", "_private", "outbox_2", "a" * 48, "users", "orders"])
def test_valid_table_names(name: str) -> None:
    assert OutboxTable(name).name == name


def test_unknown_table() -> None:
    app = full_app(tables=[OutboxTable("outbox")])
    with pytest.raises(RegistryError) as info:
        app.table("missing")
    assert "missing" in str(info.value) and "outbox" in str(info.value)


# -- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given", ["organization", "Organization", "ORGANIZATION", " organization ", "1"]
)
def test_scope_by_name(given: str) -> None:
    assert full_app().scope_by_name(given) is Scope.ORGANIZATION


def test_scope_by_name_with_lower_case_enum_names() -> None:
    app = OutboxApp(
        scopes={
            LowerScope.org: [Category.ORGANIZATION_UPDATE],
            LowerScope.user: [Category.USER_UPDATE],
        }
    )
    assert app.scope_by_name("ORG") is LowerScope.org
    assert app.scope_by_name("user") is LowerScope.user


@pytest.mark.parametrize("given", ["ORGANISATION", "3", "-1", "--1", "²", "", "ORGANIZATION:1"])
def test_scope_by_name_unknown(given: str) -> None:
    with pytest.raises(RegistryError) as info:
        full_app().scope_by_name(given)
    message = str(info.value)
    assert repr(given) in message
    assert "known scopes: ORGANIZATION, USER" in message


def test_names_of_known_and_unknown_values() -> None:
    app = full_app()
    assert app.category_name(Category.MEMBER_UPDATE) == "MEMBER_UPDATE"
    assert app.category_name(3) == "MEMBER_UPDATE"
    assert app.category_name(77) == "UNKNOWN_CATEGORY_77"
    assert app.category_name(-4) == "UNKNOWN_CATEGORY_-4"
    assert app.scope_name(2) == "USER"
    assert app.scope_name(42) == "42"


# -- handlers -----------------------------------------------------------------------------------


def test_sync_and_async_handlers_are_accepted() -> None:
    app = full_app()
    assert (
        app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)(_sync_handler)
        is _sync_handler
    )

    @app.handler(Category.MEMBER_UPDATE)
    async def member(message: OutboxMessage) -> None:
        return None

    class CallableHandler:
        async def __call__(self, message: OutboxMessage) -> None:
            return None

    callable_handler = CallableHandler()
    app.handler(Category.USER_UPDATE)(callable_handler)
    app.check_handlers()
    assert app.handler_for(Category.ORGANIZATION_UPDATE) is _sync_handler
    assert app.handler_for(2) is _sync_handler
    assert app.handler_for(Category.MEMBER_UPDATE) is member
    assert app.handler_for(Category.USER_UPDATE) is callable_handler
    assert app.handler_for(99) is None
    assert not OutboxApp.is_async_handler(_sync_handler)
    assert OutboxApp.is_async_handler(member)
    assert OutboxApp.is_async_handler(_async_handler)
    assert OutboxApp.is_async_handler(callable_handler)


def test_duplicate_handler_is_refused_and_leaves_the_app_unchanged() -> None:
    app = full_app()
    app.handler(Category.PROJECT_UPDATE)(_sync_handler)
    with pytest.raises(RegistryError) as info:
        app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)(_async_handler)
    message = str(info.value)
    assert "PROJECT_UPDATE already has a handler" in message
    assert "_sync_handler" in message
    # The refused registration registered nothing, not even its first category.
    assert app.handler_for(Category.ORGANIZATION_UPDATE) is None
    assert app.handler_for(Category.PROJECT_UPDATE) is _sync_handler


def test_handler_for_a_category_given_twice() -> None:
    app = full_app()
    with pytest.raises(RegistryError, match="twice"):
        app.handler(Category.USER_UPDATE, Category.USER_UPDATE)(_sync_handler)
    assert app.handler_for(Category.USER_UPDATE) is None


def test_handler_for_a_category_in_no_scope() -> None:
    app = full_app()
    with pytest.raises(RegistryError) as info:
        app.handler(OtherCategory.INVOICE_UPDATE)(_sync_handler)
    assert "INVOICE_UPDATE" in str(info.value) and "no scope" in str(info.value)
    with pytest.raises(RegistryError, match="no scope"):
        app.handler(123)(_sync_handler)  # type: ignore[arg-type]


def test_handler_needs_categories_and_a_callable() -> None:
    app = full_app()
    with pytest.raises(RegistryError, match="at least one category"):
        app.handler()
    with pytest.raises(RegistryError, match="callable"):
        app.handler(Category.USER_UPDATE)("not a function")  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="IntEnum"):
        app.handler("USER_UPDATE")(_sync_handler)  # type: ignore[arg-type]


def test_check_handlers_lists_every_missing_category() -> None:
    app = full_app()
    with pytest.raises(MissingHandlerError) as info:
        app.check_handlers()
    for category in Category:
        assert category.name in str(info.value)
    app.handler(Category.ORGANIZATION_UPDATE, Category.MEMBER_UPDATE)(_sync_handler)
    with pytest.raises(MissingHandlerError) as info:
        app.check_handlers()
    message = str(info.value)
    assert "PROJECT_UPDATE" in message and "USER_UPDATE" in message
    assert "ORGANIZATION_UPDATE" not in message and "MEMBER_UPDATE" not in message
    assert "@app.handler" in message
    assert isinstance(info.value, RegistryError)
    app.handler(Category.PROJECT_UPDATE, Category.USER_UPDATE)(_async_handler)
    app.check_handlers()


def test_an_empty_registry_needs_no_handler() -> None:
    OutboxApp(scopes={}).check_handlers()


def test_wrap_handlers_wraps_each_handler_once_and_keeps_its_kind() -> None:
    app = full_app()
    app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)(_sync_handler)
    app.handler(Category.USER_UPDATE)(_async_handler)
    seen: list[object] = []

    def wrapper(fn: Handler) -> Handler:
        seen.append(fn)
        if OutboxApp.is_async_handler(fn):

            async def async_wrapped(message: OutboxMessage) -> None:
                return None

            return async_wrapped

        def wrapped(message: OutboxMessage) -> None:
            return None

        return wrapped

    app.wrap_handlers(wrapper)
    assert seen == [_sync_handler, _async_handler]  # the shared handler once
    organization = app.handler_for(Category.ORGANIZATION_UPDATE)
    assert organization is app.handler_for(Category.PROJECT_UPDATE)
    assert organization is not _sync_handler and organization is not None
    assert not OutboxApp.is_async_handler(organization)
    user = app.handler_for(Category.USER_UPDATE)
    assert user is not None and OutboxApp.is_async_handler(user)
    assert app.handler_for(Category.MEMBER_UPDATE) is None

    with pytest.raises(RegistryError, match="changed it from async to plain"):
        app.wrap_handlers(lambda fn: _sync_handler)
    assert app.handler_for(Category.USER_UPDATE) is user  # a refused wrapper changes nothing
    assert app.handler_for(Category.ORGANIZATION_UPDATE) is organization


# -- load_app -----------------------------------------------------------------------------------


def test_load_app() -> None:
    from tests import sample_app

    assert load_app("tests.sample_app:app") is sample_app.app
    assert load_app("tests.sample_app:incomplete_app") is sample_app.incomplete_app


@pytest.mark.parametrize(
    "spec", ["tests.sample_app", "tests.sample_app:", ":app", "", ":", ".sample_app:app"]
)
def test_load_app_bad_format(spec: str) -> None:
    with pytest.raises(RegistryError) as info:
        load_app(spec)
    assert "module:attribute" in str(info.value)
    assert repr(spec) in str(info.value)


def test_load_app_missing_module() -> None:
    with pytest.raises(RegistryError) as info:
        load_app("no_such_module_for_outbox:app")
    message = str(info.value)
    assert "cannot import 'no_such_module_for_outbox'" in message
    assert "No module named" in message


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ("tests.sample_app:no_such_attribute", "missing"),
        ("tests.sample_app:not_an_app", "str"),
        ("tests.sample_app:SampleCategory", "EnumType"),
    ],
)
def test_load_app_not_an_outbox_app(spec: str, what: str) -> None:
    with pytest.raises(RegistryError) as info:
        load_app(spec)
    assert str(info.value) == f"{spec} is {what}, not an OutboxApp"


def test_every_registry_error_is_an_outbox_error() -> None:
    assert issubclass(RegistryError, OutboxError)
    assert issubclass(MissingHandlerError, RegistryError)
