"""The command line names any shard the table holds, with or without the app, and every refusal
says what to do: `python -m outbox_bridge` run as a subprocess against the test servers and a
worker running in this process."""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

import click
import pytest
from click.testing import CliRunner
from sqlalchemy import text

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.cli import main as cli_main
from outbox_bridge.config import OutboxSettings
from outbox_bridge.dev.embedded import free_port
from tests.harness import (
    COMMAND_POLL_INTERVAL,
    Category,
    create_tables,
    fast_settings,
    fresh_app,
    running_worker,
    unique_table,
    wait_until,
    write_rows,
)
from tests.support import Run, clean_env, run_cli, run_python, with_password

CANARY = "s3cr3t-naming-canary"


async def cli(servers: Any, *args: str, app: str | None = None, **env: str) -> Run:
    """``outbox-bridge ARGS`` against the test servers, in this process; with ``app``, the
    sample app (same scope and category names as the harness) on table ``app``."""
    return await run_cli(*args, env=cli_env(servers, app, env))


async def cli_process(servers: Any, *args: str, **env: str) -> Run:
    """:func:`cli` as ``python -m outbox_bridge``: all it prints, Temporal's core included."""
    return await run_python("-m", "outbox_bridge", *args, env=cli_env(servers, None, env))


def cli_env(servers: Any, app: str | None, env: dict[str, str]) -> dict[str, str]:
    settings = {
        "TEMPORAL_ADDRESS": servers.temporal_address,
        "OUTBOX_DATABASE_URL": servers.database_url,
    }
    if app is not None:
        settings |= {"OUTBOX_APP": "tests.sample_app:app", "SAMPLE_OUTBOX_TABLE": app}
    return clean_env(**(settings | env))


async def insert(engine: Any, table: str, scope: int, shard: int, category: int) -> int:
    """A row as a plain-SQL producer of another service writes it."""
    async with engine.begin() as conn:
        result = await conn.execute(
            text(
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                "object_identifier) VALUES (:scope, :shard, :category, 1) RETURNING id"
            ),
            {"scope": scope, "shard": shard, "category": category},
        )
        return int(result.scalar_one())


def one_error_line(run: Run) -> str:
    """The single line a refusal prints on stderr (no traceback, nothing on stdout)."""
    assert run.stdout == "", run.output
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr and "tonic::" not in run.stderr, run.stderr
    return lines[0]


async def blocked(servers: Any, shard: str, *, table: str, app: str | None = None) -> bool:
    found = await cli(servers, "status", shard, "--table", table, "--json", app=app)
    return found.code == 0 and json.loads(found.stdout)["state"] == "blocked"


# -- a scope the app does not register ------------------------------------------------------------


async def test_a_shard_of_a_scope_the_app_does_not_register_is_named_by_its_number(
    servers, engine
) -> None:
    """A plain-SQL row of scope 9, which the app does not know: its shard blocks, the worker
    says to skip shard 9:6003, and `status` and `skip` take that name, with the app or
    without (the old command line refused it: unknown scope '9')."""
    recorder, table, app = await fresh_app(engine)
    row = await insert(engine, table, 9, 6003, Category.PROJECT_UPDATE)
    settings = fast_settings()
    async with running_worker(servers, app, settings):
        await wait_until(
            lambda: blocked(servers, "9:6003", table=table, app=table),
            timeout=60,
            interval=COMMAND_POLL_INTERVAL,
        )
        shown = await cli(servers, "status", "9:6003", "--json", app=table)
        error = json.loads(shown.stdout)["last_error"]
        assert error["error_type"] == "CategoryScopeError", error
        assert "skip shard 9:6003" in error["message"], error
        without_app = await cli(servers, "status", "9:6003", "--table", table, "--json")
        assert without_app.code == 0, without_app.output
        assert json.loads(without_app.stdout)["shard"] == "9:6003"

        queue = {"OUTBOX_TASK_QUEUE": settings.task_queue}
        skipped = await cli(servers, "skip", "9:6003", "--reason", "not ours", app=table, **queue)
        assert skipped.code == 0, skipped.output
        shown = await cli(servers, "status", "9:6003", "--json", app=table)
        assert json.loads(shown.stdout)["skip"]["reason"] == "not ours"
    assert recorder.calls == []
    async with engine.connect() as conn:  # skipped, kept
        assert (await conn.execute(text(f"SELECT id FROM {table}"))).scalars().all() == [row]


class ZeroScope(IntEnum):
    ORG = 0


class ZeroCategory(IntEnum):
    ORG_UPDATE = 1


async def test_a_scope_whose_value_is_0_is_named_in_a_scope_error(servers, engine) -> None:
    """The error of a row whose category belongs to another scope names that scope, also when
    its value is 0 (it said `belongs to scope ?`)."""
    table = unique_table()
    app = OutboxApp(
        scopes={ZeroScope.ORG: [ZeroCategory.ORG_UPDATE]},
        categories=[ZeroCategory],
        tables=[OutboxTable(table)],
    )

    @app.handler(ZeroCategory.ORG_UPDATE)
    async def handle(message: OutboxMessage) -> None:
        pass

    await create_tables(engine, app)
    await insert(engine, table, 5, 1, ZeroCategory.ORG_UPDATE)
    async with running_worker(servers, app):
        await wait_until(
            lambda: blocked(servers, "5:1", table=table), timeout=60, interval=COMMAND_POLL_INTERVAL
        )
        shown = await cli(servers, "status", "5:1", "--table", table, "--json")
    message = json.loads(shown.stdout)["last_error"]["message"]
    assert "category ORG_UPDATE belongs to scope ORG, but the row is in scope 5" in message


# -- without the app --------------------------------------------------------------------------------


async def test_without_an_app_the_commands_learn_scope_names_from_the_workflows(
    servers, engine
) -> None:
    """Without --app: `shards` shows what the table holds (scope numbers) and says what it
    lacks; once a shard of the scope has a workflow, `shards` and `status` name it as the
    worker does, with its state (it showed 1:8 and `none`, and status refused
    ORGANIZATION:8 with an empty list of known scopes)."""
    recorder, table, app = await fresh_app(engine)

    async def always_fails(message: OutboxMessage) -> None:
        raise ConnectionError("replica unavailable")

    recorder.behaviour[Category.PROJECT_UPDATE] = always_fails
    rows = [{"category": Category.PROJECT_UPDATE, "shard_identifier": 8, "object_identifier": 1}]
    await write_rows(engine, app, rows)

    listed = await cli(servers, "shards", "--table", table, "--json")
    assert listed.code == 0, listed.output
    assert [(e["shard"], e["state"]) for e in json.loads(listed.stdout)] == [("1:8", "none")]
    assert "Scope 1 is shown by its number" in listed.stderr and "--app" in listed.stderr

    async def named_and_blocked() -> bool:
        found = await cli(servers, "shards", "--table", table, "--json")
        entries = json.loads(found.stdout) if found.code == 0 else []
        return [(e["shard"], e["state"]) for e in entries] == [("ORGANIZATION:8", "blocked")]

    async with running_worker(servers, app):
        await wait_until(
            named_and_blocked,
            timeout=60,
            interval=COMMAND_POLL_INTERVAL,
            what="ORGANIZATION:8 listed, blocked",
        )
        listed = await cli(servers, "shards", "--table", table)
        assert "PROJECT_UPDATE" in listed.stdout and listed.stderr == "", listed.output
        for name in ("ORGANIZATION:8", "organization:8", "1:8"):
            shown = await cli(servers, "status", name, "--table", table, "--json")
            assert shown.code == 0, shown.output
            assert json.loads(shown.stdout)["shard"] == "ORGANIZATION:8"
        unknown = await cli(servers, "status", "USER:99", "--table", table)
        assert unknown.code == 2
        line = one_error_line(unknown)
        assert "scopes seen: ORGANIZATION (1)" in line and "--app module:attribute" in line
        filtered = await cli(servers, "shards", "--table", table, "--scope", "organization")
        assert "ORGANIZATION:8" in filtered.stdout, filtered.output


# -- help ----------------------------------------------------------------------------------------

WORKER_ONLY = {
    name
    for name, field in OutboxSettings.model_fields.items()
    if name not in {"database_url", "data_dir", "temporal_address", "temporal_namespace"}
    and name not in {"temporal_profile", "app", "demo", "task_queue"}
}


@pytest.mark.parametrize("command", ["skip", "resume", "status", "flush", "pause", "unpause"])
def test_each_shard_command_lists_its_own_options_only(command: str) -> None:
    """At most 12 options (they had 16, 12, 13 and 19), none of the worker's own, and --demo
    described as these commands use it."""
    group = cli_main
    assert isinstance(group, click.Group)
    found = group.commands[command]
    options = [p for p in found.get_params(click.Context(found)) if isinstance(p, click.Option)]
    assert len(options) <= 12, [o.name for o in options]
    assert not {o.name for o in options} & WORKER_ONLY
    shown = CliRunner().invoke(cli_main, [command, "--help"], terminal_width=100)
    assert shown.exit_code == 0, shown.output
    help_text = " ".join(shown.output.split())
    for flag in ("--temporal-port", "--temporal-tls", "--skip-shards", "--shard-workflows"):
        assert flag not in help_text, flag
    assert "writes demo traffic" not in help_text
    assert "Use the demo app's scope names and table" in help_text
    assert "TLS, API key" in help_text  # where the settings it does not offer come from


# -- failures in one line ------------------------------------------------------------------------


async def test_connection_failures_are_one_line_that_says_what_to_do(servers, tmp_path) -> None:
    port = free_port()
    run = await cli_process(
        servers, "status", "ORGANIZATION:1", TEMPORAL_ADDRESS=f"127.0.0.1:{port}"
    )
    assert run.code == 2
    line = one_error_line(run)
    assert f"cannot connect to Temporal at 127.0.0.1:{port}" in line
    assert "connection refused" in line and "TEMPORAL_ADDRESS" in line

    run = await cli_process(
        servers, "status", "ORGANIZATION:1", TEMPORAL_NAMESPACE="no-such-namespace"
    )
    line = one_error_line(run)
    assert "no-such-namespace" in line and "TEMPORAL_NAMESPACE" in line

    unreachable, canary = with_password(f"postgresql://postgres@127.0.0.1:{free_port()}/x", CANARY)
    run = await cli_process(servers, "shards", OUTBOX_DATABASE_URL=unreachable)
    assert run.code == 2
    line = one_error_line(run)
    assert "cannot read table outbox in postgresql+psycopg://postgres:***@127.0.0.1" in line
    assert "OUTBOX_DATABASE_URL" in line and canary not in line

    run = await cli_process(servers, "shards", "--table", unique_table())
    line = one_error_line(run)
    assert "does not exist" in line and "--app" in line and "init-db" in line

    env = clean_env(TEMPORAL_ADDRESS=servers.temporal_address)  # no database URL
    run = await run_python(
        "-m",
        "outbox_bridge",
        "flush",
        "--demo",
        "ORGANIZATION:1",
        "--data-dir",
        str(tmp_path),
        env=env,
    )
    line = one_error_line(run)
    assert "no database" in line and "OUTBOX_DATABASE_URL" in line
