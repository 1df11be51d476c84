"""The registry: which categories belong to which scope, and which handler runs each category.

Scopes and categories are the application's own ``IntEnum`` members; the outbox table stores
their values, so a value may be retired but never reused. An application that writes rows
imports this module, which loads nothing of the worker's.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, Unpack

from sqlalchemy import MetaData, Table

from outbox_bridge.config import DEFAULT_MAX_PAYLOAD_BYTES, MAX_PAYLOAD_LIMIT, MIN_PAYLOAD_LIMIT
from outbox_bridge.db.limits import RateLimit, parse_rate
from outbox_bridge.db.schema import outbox_table
from outbox_bridge.errors import InvalidRowError, MissingHandlerError, OutboxError, RegistryError
from outbox_bridge.observability.producer_spans import observed_write
from outbox_bridge.producer import PreparedRow, RowFields, RowSpec, bigint, build_insert
from outbox_bridge.sessions import record_write, sync_result

if TYPE_CHECKING:
    from temporalio.client import Client

    from outbox_bridge.config import OutboxSettings

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,47}")

# Words PostgreSQL reserves for table names (pg_get_keywords() catcode R or T, PostgreSQL 18):
# the NOTIFY trigger DDL names the table unquoted, so such a name would fail at create time.
_RESERVED_WORDS = frozenset(
    """all analyse analyze and any array as asc asymmetric authorization binary both case cast
    check collate collation column concurrently constraint create cross current_catalog
    current_date current_role current_schema current_time current_timestamp current_user default
    deferrable desc distinct do else end except false fetch for foreign freeze from full grant
    group having ilike in initially inner intersect into is isnull join lateral leading left like
    limit localtime localtimestamp natural not notnull null offset on only or order outer
    overlaps placing primary references returning right select session_user similar some
    symmetric system_user table tablesample then to trailing true union unique user using
    variadic verbose when where window with""".split()
)


@dataclass(frozen=True)
class OutboxMessage:
    """What a handler receives: the newest row of a coalescing group.

    Handlers must be idempotent: delivery is at least once, and a handler can run again for the
    same row after a crash or a timeout. ``coalesced`` counts the rows of the group (this one
    included) that are deleted when the handler returns.
    """

    id: int
    shard_scope: IntEnum | int
    shard_identifier: int
    category: IntEnum | int
    object_identifier: int
    payload: Any
    region: str | None
    date_added: datetime
    scheduled_for: datetime
    coalesced: int = 1


# The app's own scope enum (a Mapping's key type is invariant: dict[Scope, ...] must fit).
ScopeT = TypeVar("ScopeT", bound=IntEnum)

Handler: TypeAlias = Callable[[OutboxMessage], Awaitable[None] | None]


@dataclass(frozen=True)
class OutboxTable:
    """One outbox table drained by the app.

    A *regional* table has a ``region`` column that leads the shard key: a control-plane
    outbox writes one row per target region and each region's worker drains its own rows.
    """

    name: str = "outbox"
    regional: bool = False

    def __post_init__(self) -> None:
        # fullmatch: with match() and "$", a trailing newline would pass.
        if not isinstance(self.name, str) or not _IDENTIFIER.fullmatch(self.name):
            raise RegistryError(
                f"table name {self.name!r} is not a plain lower-case SQL identifier "
                "(letters, digits and underscores, at most 48 characters, not starting with a "
                "digit)"
            )
        if self.name in _RESERVED_WORDS:
            raise RegistryError(
                f"table name {self.name!r} is a reserved word in PostgreSQL; choose another "
                "name (e.g. outbox)"
            )


@dataclass
class FlushRoute:
    """How ``outbox_context(session, flush=True)`` reaches an app's shard workflows
    (:meth:`OutboxApp.configure_flush`); :mod:`outbox_bridge.flush` builds the flusher."""

    settings: OutboxSettings | None = None
    client: Client | None = None
    flusher: object | None = None


@dataclass(frozen=True, eq=False)
class CallLimit:
    """At most ``calls`` calls at once in one worker, and ``fleet_calls`` in every worker of the
    app on its database, of ``categories`` together (one registration's ``max_concurrency`` and
    ``fleet_max_concurrency``; None: no such limit; compared by identity)."""

    calls: int | None
    categories: tuple[IntEnum, ...]
    fleet_calls: int | None = None

    @property
    def name(self) -> str:
        return "+".join(_enum_name(category) for category in self.categories)


def _check_concurrency(value: object, name: str = "max_concurrency") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise RegistryError(
            f"{name} must be a positive integer or None, not {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise RegistryError(f"{name} must be at least 1, not {value}; leave it out for no limit")


def _check_payload_limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RegistryError(
            f"max_payload_bytes must be an integer, not {value!r} ({type(value).__name__})"
        )
    if not MIN_PAYLOAD_LIMIT <= value <= MAX_PAYLOAD_LIMIT:
        raise RegistryError(
            f"max_payload_bytes must be between {MIN_PAYLOAD_LIMIT:,} (1 KiB) and "
            f"{MAX_PAYLOAD_LIMIT:,} (256 MiB, what one jsonb value holds), not {value:,}"
        )
    return int(value)


def _enum_name(member: IntEnum | int) -> str:
    return member.name if isinstance(member, IntEnum) else str(int(member))


class ScopeRegistry:
    """The scopes and categories of an app, checked once when it is built: every category
    belongs to exactly one scope, and no two share a value. The lookups by value and name of
    :class:`OutboxApp`."""

    def __init__(
        self,
        scopes: Mapping[ScopeT, Iterable[IntEnum]],
        categories: Iterable[type[IntEnum]] = (),
    ) -> None:
        self._scope_of: dict[int, IntEnum] = {}
        self._categories: dict[int, IntEnum] = {}
        self._scopes: dict[int, IntEnum] = {}
        for scope, members in scopes.items():
            self._add_scope(scope, members)
        self._check_declared_enums(categories)

    def _add_scope(self, scope: IntEnum, members: Iterable[IntEnum]) -> None:
        if not isinstance(scope, IntEnum):
            raise RegistryError(f"scope {scope!r} must be an IntEnum member")
        if int(scope) in self._scopes:
            raise RegistryError(f"scope value {int(scope)} is declared twice")
        self._scopes[int(scope)] = scope
        for category in members:
            if not isinstance(category, IntEnum):
                raise RegistryError(
                    f"category {category!r} of {scope.name} must be an IntEnum member"
                )
            owner = self._scope_of.get(int(category))
            if owner is not None:
                known = self._categories[int(category)]
                if owner is scope and known is category:
                    continue  # listed twice in the same scope: harmless
                if owner is scope:
                    raise RegistryError(
                        f"categories {known.name} and {category.name} of scope {scope.name} "
                        f"share the value {int(category)}; category values must be unique"
                    )
                raise RegistryError(
                    f"category {category.name} (value {int(category)}) is in two scopes: "
                    f"{owner.name} and {scope.name}"
                    + (f" (it clashes with {known.name})" if known is not category else "")
                    + "; every category belongs to exactly one scope"
                )
            self._scope_of[int(category)] = scope
            self._categories[int(category)] = category

    def _check_declared_enums(self, enums: Iterable[type[IntEnum]]) -> None:
        for enum in enums:
            orphans = [m.name for m in enum if int(m) not in self._categories]
            if orphans:
                raise RegistryError(
                    f"categories {', '.join(orphans)} of {enum.__name__} belong to no scope; "
                    "add each one to the scope it belongs to"
                )

    @property
    def scopes(self) -> list[IntEnum]:
        return list(self._scopes.values())

    @property
    def categories(self) -> list[IntEnum]:
        return list(self._categories.values())

    def scope(self, value: int) -> IntEnum | None:
        return self._scopes.get(int(value))

    def category(self, value: int) -> IntEnum | None:
        return self._categories.get(int(value))

    def scope_of(self, category: int) -> IntEnum | None:
        return self._scope_of.get(int(category))

    def scope_name(self, value: int) -> str:
        scope = self._scopes.get(int(value))
        return scope.name if scope is not None else str(int(value))

    def category_name(self, value: int) -> str:
        category = self._categories.get(int(value))
        return category.name if category is not None else f"UNKNOWN_CATEGORY_{int(value)}"

    def scope_by_name(self, name: str) -> IntEnum:
        """The scope called ``name`` (case-insensitive), or whose value is ``name``."""
        wanted = name.strip().upper()
        for scope in self._scopes.values():
            if scope.name.upper() == wanted:
                return scope
        with contextlib.suppress(ValueError):
            if int(name) in self._scopes:
                return self._scopes[int(name)]
        known = ", ".join(s.name for s in self._scopes.values())
        raise RegistryError(f"unknown scope {name!r}; known scopes: {known}")


class OutboxApp(ScopeRegistry):
    """The scopes, categories, tables and handlers of one application.

    Building the app checks the registry once: every category belongs to exactly one scope and
    category values are unique. ``check_handlers()`` (called by the worker) refuses a category
    without a handler.

    ``max_payload_bytes`` bounds a payload (the UTF-8 bytes of its JSON text) on both sides:
    ``write`` refuses a larger one (:class:`~outbox_bridge.PayloadTooLargeError`, nothing
    written), and the worker never reads a larger row whole: its shard blocks on it. A worker's
    ``OUTBOX_MAX_PAYLOAD_BYTES`` replaces it for what that worker reads.
    """

    def __init__(
        self,
        scopes: Mapping[ScopeT, Iterable[IntEnum]],
        *,
        categories: Iterable[type[IntEnum]] = (),
        tables: Sequence[OutboxTable] = (OutboxTable(),),
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.max_payload_bytes = _check_payload_limit(max_payload_bytes)
        super().__init__(scopes, categories)
        self._handlers: dict[int, Handler] = {}
        self._limits: dict[int, CallLimit] = {}
        self._rates: dict[int, RateLimit] = {}
        self.flush_route = FlushRoute()
        if not tables:
            raise RegistryError("an OutboxApp needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise RegistryError(f"table names must be unique, got {names}")
        self.tables: dict[str, OutboxTable] = {t.name: t for t in tables}
        self.metadata = MetaData()
        self._sql_tables: dict[str, Table] = {
            t.name: outbox_table(t.name, self.metadata, regional=t.regional) for t in tables
        }

    # -- tables ----------------------------------------------------------------------------

    def table(self, name: str | None = None) -> Table:
        """The SQLAlchemy Core table for ``name`` (the first table when omitted)."""
        if name is None:
            return next(iter(self._sql_tables.values()))
        try:
            return self._sql_tables[name]
        except KeyError:
            raise RegistryError(
                f"table {name!r} is not part of this app; its tables are {list(self.tables)}"
            ) from None

    def table_spec(self, name: str | None = None) -> OutboxTable:
        return self.tables[self.table(name).name]

    # -- handlers --------------------------------------------------------------------------

    def handler(
        self,
        *categories: IntEnum,
        max_concurrency: int | None = None,
        fleet_max_concurrency: int | None = None,
        rate_limit: str | None = None,
    ) -> Callable[[Handler], Handler]:
        """Register the decorated function as the handler of ``categories``.

        Handlers may be ``async def`` or plain ``def`` (run in a thread). They must be
        idempotent. A handler that raises is retried forever with capped backoff while its
        shard waits.

        Args:
            categories: the categories it handles, each in one scope of the app.
            max_concurrency: at most this many calls of this handler run at once in one
                worker, its categories together (for a rate-limited API). A group over the
                limit waits for a free slot holding only its own shard: other shards and
                other categories go on. The limit is per worker, not per task queue: with
                ``N`` workers, up to ``N × max_concurrency`` calls run at once. ``None``
                (the default): no limit of its own.
            fleet_max_concurrency: at most this many calls of this handler run at once in
                all the workers of the app on its database together, its categories
                together. A call waits for a slot of it as for one of ``max_concurrency``
                (taken after it); a worker that dies frees its slots. Each worker holds them
                on one database connection of its own. ``None`` (the default): no such limit.
            rate_limit: at most this many calls per second, minute or hour (``"50/s"``,
                ``"300/m"``, ``"1000/h"``) of each of its categories, in every worker of the
                app together (a token bucket per table and category in ``<table>_limits``,
                with a burst of one second's worth). A group waiting for its turn holds back
                only its own shard, like ``max_concurrency``; waiting shards are served in
                turn. ``outbox-bridge limit`` changes it at run time. ``None`` (the
                default): no limit unless an operator sets one.
        """
        if not categories:
            raise RegistryError("app.handler() needs at least one category")
        _check_concurrency(max_concurrency)
        _check_concurrency(fleet_max_concurrency, "fleet_max_concurrency")
        rate = None if rate_limit is None else parse_rate(rate_limit)

        def register(fn: Handler) -> Handler:
            if not callable(fn):
                raise RegistryError(f"a handler must be callable, got {fn!r}")
            # Check every category before registering any, so that a refused registration
            # leaves the app unchanged.
            seen: set[int] = set()
            for category in categories:
                if isinstance(category, bool) or not isinstance(category, int):
                    raise RegistryError(f"category {category!r} must be an IntEnum member")
                if int(category) in seen:
                    raise RegistryError(f"{_enum_name(category)} is given twice")
                seen.add(int(category))
                if int(category) not in self._categories:
                    raise RegistryError(
                        f"cannot register a handler for {_enum_name(category)}: it is in no scope"
                    )
                if int(category) in self._handlers:
                    other = self._handlers[int(category)]
                    raise RegistryError(
                        f"{_enum_name(category)} already has a handler "
                        f"({getattr(other, '__qualname__', other)!s})"
                    )
            limit = None
            if max_concurrency is not None or fleet_max_concurrency is not None:
                limit = CallLimit(max_concurrency, categories, fleet_max_concurrency)
            for category in categories:
                self._handlers[int(category)] = fn
                if limit is not None:
                    self._limits[int(category)] = limit
                if rate is not None:
                    self._rates[int(category)] = rate
            return fn

        return register

    def handler_for(self, category: int) -> Handler | None:
        return self._handlers.get(int(category))

    def call_limit(self, category: int) -> CallLimit | None:
        """The concurrency limits of ``category``'s handler, shared by the categories
        registered with it; None when it has none."""
        return self._limits.get(int(category))

    def rate_limit(self, category: int) -> RateLimit | None:
        """The declared ``rate_limit`` of ``category``; None when it has none."""
        return self._rates.get(int(category))

    def wrap_handlers(self, wrapper: Callable[[Handler], Handler]) -> None:
        """Replace every handler ``fn`` with ``wrapper(fn)`` (once, whatever its categories),
        for code that must run around each call in the worker, such as Django's connection
        handling. The wrapper must keep the handler's kind, async or plain."""
        wrapped: dict[int, Handler] = {}
        for fn in self._handlers.values():
            if id(fn) not in wrapped:
                replacement = wrapper(fn)
                was, now = (
                    "async" if self.is_async_handler(f) else "plain" for f in (fn, replacement)
                )
                if was != now:
                    raise RegistryError(
                        f"the wrapper of {getattr(fn, '__qualname__', fn)!s} changed it from "
                        f"{was} to {now}"
                    )
                wrapped[id(fn)] = replacement
        # Every wrapper checked before any handler is replaced.
        self._handlers = {category: wrapped[id(fn)] for category, fn in self._handlers.items()}

    def check_handlers(self) -> None:
        """Raise :class:`MissingHandlerError` unless every category has a handler."""
        missing = [c.name for c in self._categories.values() if int(c) not in self._handlers]
        if missing:
            raise MissingHandlerError(
                f"no handler for categories {', '.join(missing)}; register one with "
                "@app.handler(Category.X) for each (a retired category still needs a handler "
                "while rows of it may exist)"
            )

    @staticmethod
    def is_async_handler(fn: Handler) -> bool:
        # A callable object with an ``async def __call__`` is async too.
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )

    # -- producing -------------------------------------------------------------------------

    def write(
        self,
        session: Any,
        *,
        category: IntEnum | int,
        shard_identifier: int,
        object_identifier: int,
        payload: Any = None,
        shard_scope: IntEnum | int | None = None,
        region: str | None = None,
        scheduled_for: datetime | timedelta | None = None,
        table: str | None = None,
    ) -> int:
        """Write one outbox row with ``session`` (a SQLAlchemy ``Session`` or ``Connection``)
        and return its id. Never commits: the row commits or rolls back with the caller's
        transaction. Raises :class:`~outbox_bridge.InvalidRowError` without writing anything
        when the row does not fit the registry, :class:`~outbox_bridge.PayloadTooLargeError`
        (one of them) when its payload is over ``max_payload_bytes``.

        The scope follows from the category; pass ``shard_scope`` to have it checked.
        ``scheduled_for`` (an aware datetime, or a delay) defers the row: its shard waits.
        """
        row = self.prepare(
            RowSpec(
                category,
                shard_identifier,
                object_identifier,
                payload,
                shard_scope,
                region,
                scheduled_for,
                table,
            )
        )
        with observed_write(row) as seen:
            result = sync_result(session.execute(seen.statement), "app.write")
            row_id = seen.written(int(result.scalar_one()))
        record_write(session, self, row.shard, row_id)
        return row_id

    async def write_async(self, session: Any, **row: Unpack[RowFields]) -> int:
        """:meth:`write` for an ``AsyncSession`` or ``AsyncConnection``, with its keyword
        arguments."""
        prepared = self.prepare(RowSpec(**row))
        with observed_write(prepared) as seen:
            result = await session.execute(seen.statement)
            row_id = seen.written(int(result.scalar_one()))
        record_write(session, self, prepared.shard, row_id)
        return row_id

    def prepare(self, spec: RowSpec) -> PreparedRow:
        """Check ``spec`` and build its INSERT ... RETURNING id without running it, for
        integrations with a connection of their own (:mod:`outbox_bridge.contrib.django`).
        Raises like :meth:`write` (:class:`~outbox_bridge.RegistryError` for an unknown
        table)."""
        table = self.table(spec.table)
        category = self.category(bigint("category", spec.category))
        if category is None:
            raise InvalidRowError(f"category {spec.category!r} is not registered in any scope")
        scope = self._scope_of[int(category)]
        if spec.shard_scope is not None and bigint("shard_scope", spec.shard_scope) != int(scope):
            given = self.scope_name(int(spec.shard_scope))
            raise InvalidRowError(
                f"category {category.name} belongs to scope {scope.name}, not {given}"
            )
        regional = self.tables[table.name].regional
        return build_insert(
            table,
            spec,
            regional=regional,
            category=category,
            scope=scope,
            max_payload_bytes=self.max_payload_bytes,
        )

    # -- flushing ------------------------------------------------------------------------------

    def configure_flush(
        self, settings: OutboxSettings | None = None, *, client: Client | None = None
    ) -> None:
        """How ``outbox_context(session, flush=True)`` reaches the shard workflows: the
        worker's settings (Temporal address, namespace, TLS or API key, task queue and shard
        settings) and, for async code, optionally a connected Temporal ``client``. Without
        this call, the settings come from the environment (``OutboxSettings()``). Nothing
        connects until the first flush."""
        self.flush_route = FlushRoute(settings, client)


def load_app(
    spec: str,
    *,
    given_as: str = "--app",
    error: type[OutboxError] = RegistryError,
    dotted: bool = False,
) -> OutboxApp:
    """Import the :class:`OutboxApp` named ``module:attribute`` (or, if ``dotted``,
    ``module.attribute``); errors of type ``error`` name the spec as ``given_as``."""
    module_name, colon, attribute = spec.partition(":")
    if dotted and not colon:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute or module_name.startswith("."):
        raise error(f"{given_as} must look like module:attribute, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"cannot import {module_name!r} for {given_as} {spec}: {exc}") from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, OutboxApp):
        what = type(app).__name__ if app is not None else "missing"
        raise error(f"{spec} is {what}, not an OutboxApp")
    return app
