"""``python -m outbox_bridge`` / ``outbox-bridge``: the command line of outbox-bridge."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge.config import OutboxSettings, safe_url, sqlalchemy_url
from outbox_bridge.embedded import EmbeddedPostgres
from outbox_bridge.errors import ConfigurationError, OutboxError
from outbox_bridge.flags import build_settings, settings_options
from outbox_bridge.registry import OutboxApp, load_app
from outbox_bridge.schema import prepare_database


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """outbox-bridge: a transactional outbox executed by Temporal.

    Run the worker with `python worker.py` (see its --help).
    """


def _app(settings: OutboxSettings) -> OutboxApp:
    if settings.demo and settings.app:
        raise ConfigurationError("--demo uses the demo app; do not also give --app")
    if settings.demo:
        from outbox_bridge import demo

        return demo.app
    if settings.app:
        return load_app(settings.app)
    # Without an app, the default table: `outbox`, not regional.
    return OutboxApp(scopes={})


async def _init_db(settings: OutboxSettings) -> list[str]:
    app = _app(settings)
    postgres = None
    if settings.database_url is not None:
        url = settings.database_url.get_secret_value()
    else:
        postgres = EmbeddedPostgres(settings.data_dir / "postgres")
        url = postgres.start()
    engine = create_async_engine(sqlalchemy_url(url))
    try:
        await prepare_database(engine, app.metadata)
    finally:
        await engine.dispose()
        if postgres is not None:
            postgres.stop()
    click.echo(f"database: {safe_url(sqlalchemy_url(url))}")
    return list(app.tables)


@main.command("init-db")
@settings_options
def init_db(**overrides: Any) -> None:
    """Create the outbox tables, indexes and NOTIFY triggers that are missing (idempotent)."""
    try:
        tables = asyncio.run(_init_db(build_settings(overrides)))
    except OutboxError as exc:
        click.echo(f"outbox-bridge: error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"tables ready: {', '.join(tables)}")
