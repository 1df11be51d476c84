"""``outbox-bridge init-db`` and ``outbox-bridge grants``: what the schema owner runs. The
worker never changes the schema; these commands install and upgrade it, and give the other
roles (worker, producer, reader, operator) exactly the privileges they need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from outbox_bridge.cli.connections import command_app, database, tables_of
from outbox_bridge.cli.failures import exits_on_failure, run_or_exit
from outbox_bridge.cli.flags import build_settings, settings_options, tool_command
from outbox_bridge.config import OutboxSettings, SettingGroup, safe_url
from outbox_bridge.db.grants import Role, grant_statements
from outbox_bridge.db.install import LOCK_ATTEMPTS, LOCK_TIMEOUT_SECONDS, install_schema
from outbox_bridge.errors import ConfigurationError


def _progress(message: str) -> None:
    click.echo(message, err=True)


async def _init_db(settings: OutboxSettings, lock_timeout: float, attempts: int) -> list[str]:
    app = tables_of(command_app(settings), None)
    async with database(settings, create=True) as engine:
        click.echo(f"database: {safe_url(engine.url)}")
        changes = await install_schema(
            engine, app.metadata, progress=_progress, lock_timeout=lock_timeout, attempts=attempts
        )
        if not changes:
            click.echo("the schema is up to date: nothing changed, no table locked")
    return list(app.tables)


@tool_command("init-db")
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0.1, max=600),
    default=LOCK_TIMEOUT_SECONDS,
    show_default=True,
    help="Seconds a statement waits for its lock on a table before the attempt is rolled back "
    "(producers' INSERTs queue behind a waiting schema change).",
)
@click.option(
    "--attempts",
    type=click.IntRange(min=1, max=100),
    default=LOCK_ATTEMPTS,
    show_default=True,
    help="Attempts before giving up, with a growing pause between them.",
)
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def init_db(lock_timeout: float, attempts: int, **overrides: Any) -> None:
    """Create or upgrade the outbox tables, columns, indexes and NOTIFY triggers that are
    missing or different (idempotent; on an up-to-date database nothing runs and no table is
    locked). Run it as the tables' owner, before the workers start: they only check."""
    tables = run_or_exit(_init_db(build_settings(overrides), lock_timeout, attempts))
    click.echo(f"tables ready: {', '.join(tables)}")


async def _apply(settings: OutboxSettings, statements: list[str]) -> None:
    async with database(settings) as engine:
        try:
            async with engine.begin() as conn:
                for statement in statements:
                    await conn.execute(text(statement))
        except DBAPIError as exc:
            raise ConfigurationError(
                f"cannot apply the GRANTs in {safe_url(engine.url)}: "
                f"{' '.join(str(exc.orig).split())}. Run them as the tables' owner (the role "
                "that ran init-db), once the roles exist"
            ) from None


ROLE_HELP = {
    Role.WORKER: "The workers' role: SELECT, DELETE on the outbox; rows of the side tables.",
    Role.PRODUCER: "The producers' role: INSERT on the outbox (and SELECT on its id).",
    Role.READER: "A read-only operator's role: SELECT on every table.",
    Role.OPERATOR: "An operator's role: SELECT, and pause, park and unpark.",
}


def _role_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for role in reversed(Role):
        flag = f"--{role.value}"
        fn = click.option(flag, f"role_{role.value}", metavar="ROLE", help=ROLE_HELP[role])(fn)
    return fn


@tool_command("grants")
@_role_options
@click.option(
    "--schema",
    default="public",
    show_default=True,
    help="The schema the roles get USAGE on (the tables' names are found on the search_path).",
)
@click.option("--apply", is_flag=True, help="Run the GRANTs (as the tables' owner) after printing.")
@settings_options(SettingGroup.DATABASE, SettingGroup.APP)
def grants(schema: str, apply: bool, **options: Any) -> None:
    """Print the GRANT statements that give each role named exactly the privileges it needs
    on the app's outbox tables (and the tables beside them), and nothing else."""
    roles = {
        role: options.pop(f"role_{role.value}")
        for role in Role
        if options.get(f"role_{role.value}")
    }
    for role in Role:
        options.pop(f"role_{role.value}", None)
    if not roles:
        raise click.UsageError(
            "name at least one role: --worker, --producer, --reader or --operator"
        )
    with exits_on_failure():
        settings = build_settings(options)
        app = tables_of(command_app(settings), None)
    statements = grant_statements(app.metadata, roles, schema=schema)
    for statement in statements:
        click.echo(f"{statement};")
    if apply:
        run_or_exit(_apply(settings, statements))
        click.echo(f"-- applied {len(statements)} statements", err=True)
