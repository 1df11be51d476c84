"""What the tools (every command but the worker) work on: the app (the one ``--app`` names, as
``module:attribute``, or the demo's), the database and Temporal."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from temporalio.client import Client

from outbox_bridge import registry
from outbox_bridge.cli.scope_directory import find_shard
from outbox_bridge.config import OutboxSettings, safe_url, sqlalchemy_url
from outbox_bridge.db.grants import INSUFFICIENT_PRIVILEGE, Role, privilege_error
from outbox_bridge.dev.embedded import EmbeddedPostgres
from outbox_bridge.errors import ConfigurationError, RegistryError
from outbox_bridge.registry import OutboxApp, OutboxTable
from outbox_bridge.runtime.temporal import connect, temporal_address
from outbox_bridge.workflows.models import ShardRef

# SQLSTATE of a table that does not exist.
UNDEFINED_TABLE = "42P01"
# The commands that only read run in a read-only transaction: they work for a role with SELECT
# alone, and cannot change anything whatever role runs them.
READ_ONLY = text("SET TRANSACTION READ ONLY")


def load_app(spec: str) -> OutboxApp:
    """Import ``module:attribute`` (from the working directory too) and return the
    :class:`OutboxApp` it names."""
    # As with ``python -m outbox_bridge``, whose path starts with the working directory; the
    # ``outbox-bridge`` script's path starts with its own folder instead.
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)
    return registry.load_app(spec)


def command_app(settings: OutboxSettings) -> OutboxApp | None:
    """The app named by ``--app`` (``module:attribute``), the demo app with ``--demo``, or None
    when neither is given."""
    if settings.demo and settings.app:
        raise RegistryError("--demo runs the demo app; do not also give --app")
    if settings.demo:
        from outbox_bridge import demo  # the worker's modules: only the demo needs them here

        return demo.app
    return load_app(settings.app) if settings.app else None


def worker_app(settings: OutboxSettings) -> OutboxApp:
    """The app the worker runs: :func:`command_app`, which must name one."""
    app = command_app(settings)
    if app is None:
        raise RegistryError(
            "no app to run: set OUTBOX_APP=module:attribute (or --app), or try --demo"
        )
    return app


def tables_of(app: OutboxApp | None, table: str | None, *, regional: bool = False) -> OutboxApp:
    """``app``, or without one an app of no scope whose only table is ``table`` (``outbox``
    when not given; ``regional`` says whether it has regions), enough to read it."""
    if app is not None:
        app.table(table)  # an unknown table is refused, naming the app's
        return app
    return OutboxApp(scopes={}, tables=[OutboxTable(table or "outbox", regional=regional)])


def shard_app(settings: OutboxSettings, shard: ShardRef) -> OutboxApp:
    """The app of the command (:func:`tables_of`), with the table of ``shard``."""
    return tables_of(command_app(settings), shard.table, regional=shard.region is not None)


async def temporal_client(settings: OutboxSettings) -> Client:
    """A client of the configured Temporal."""
    return await connect(settings, temporal_address(settings))


async def named_shard(
    settings: OutboxSettings, shard: str, table: str | None
) -> tuple[Client, ShardRef]:
    """A Temporal client, and the shard named ``shard`` (``SCOPE:ID``) in ``table``."""
    client = await temporal_client(settings)
    return client, await find_shard(client, shard, command_app(settings), table=table)


@contextlib.asynccontextmanager
async def database(settings: OutboxSettings, *, create: bool = False) -> AsyncIterator[AsyncEngine]:
    """The configured database, or the worker's embedded one under ``--data-dir`` (stopped
    afterwards); without ``create``, refused when neither is there rather than created empty."""
    postgres = None
    if settings.database_url is not None:
        url = settings.database_url.get_secret_value()
    else:
        data = settings.data_dir / "postgres"
        if not create and not data.is_dir():
            raise ConfigurationError(
                f"no database: OUTBOX_DATABASE_URL is not set, and there is no embedded "
                f"PostgreSQL under {settings.data_dir} (the worker's --data-dir). Set "
                "OUTBOX_DATABASE_URL (--database-url), or run the command from the worker's "
                "folder (or with its --data-dir)"
            )
        postgres = EmbeddedPostgres(data)
        url = postgres.start()
    engine = create_async_engine(sqlalchemy_url(url))
    try:
        yield engine
    finally:
        await engine.dispose()
        if postgres is not None:
            postgres.stop()


@contextlib.asynccontextmanager
async def connected(
    settings: OutboxSettings, table: str, *, begin: bool = False, read_only: bool = False
) -> AsyncIterator[AsyncConnection]:
    """A connection to the database (in a transaction with ``begin``; in a read-only one with
    ``read_only``: a role with SELECT alone is enough) to work on ``table``; a database error in
    the block becomes one line that says what to do."""
    async with database(settings) as engine:
        where = safe_url(engine.url)
        try:
            async with engine.begin() if begin else engine.connect() as conn:
                if read_only:
                    await conn.execute(READ_ONLY)
                yield conn
        except DBAPIError as exc:
            state = getattr(exc.orig, "sqlstate", None)
            if state == UNDEFINED_TABLE:
                raise ConfigurationError(
                    f"table {table} does not exist in {where}: give the worker's app (--app, or "
                    "OUTBOX_APP) and --table, or create it with `outbox-bridge init-db`"
                ) from None
            if state == INSUFFICIENT_PRIVILEGE:
                raise await privilege_error(
                    engine, exc, Role.READER if read_only else Role.OPERATOR
                ) from None
            # The driver's message names host and port, never the password.
            reason = " ".join(str(exc.orig).split())
            raise ConfigurationError(
                f"cannot read table {table} in {where}: {reason}. Check OUTBOX_DATABASE_URL "
                "(--database-url)"
            ) from None
        except SQLAlchemyError as exc:
            raise ConfigurationError(f"cannot read table {table} in {where}: {exc}") from None
