"""Acceptance tests of the command lines: ``python worker.py`` and ``python -m outbox_bridge``
run as real subprocesses (the worker in the shape of the design contract,
docs/explanation/contract.md), the tools' commands in this process (``run_cli``).

The worker is pointed at the test servers (OUTBOX_DATABASE_URL, TEMPORAL_ADDRESS), so nothing
embedded starts. The database URL carries a password (the embedded PostgreSQL trusts any password
on its Unix socket) that must never appear in any output.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.cli import main as cli_main
from outbox_bridge.cli.flags import build_settings, settings_options
from outbox_bridge.config import (
    OutboxSettings,
    SettingGroup,
    env_name,
    env_names,
    retired_variables,
    setting_group,
)
from outbox_bridge.dev.embedded import free_port
from outbox_bridge.errors import ConfigurationError
from tests.harness import COMMAND_POLL_INTERVAL, Servers, unique_table, wait_until
from tests.sample_app import CALLS_DDL, CALLS_TABLE, SampleCategory, SampleScope
from tests.support import (
    BANNER,
    WorkerProcess,
    clean_env,
    clear_settings,
    init_db,
    run_cli,
    run_python,
    with_password,
    worker_process,
)

CANARY = "s3cr3t-canary"
SAMPLE_APP = "tests.sample_app:app"


def canary_url(servers: Servers) -> tuple[str, str]:
    """The test database URL with a password, and that password (the canary)."""
    return with_password(servers.database_url, CANARY)


def worker_env(servers: Servers, table: str, **extra: str) -> dict[str, str]:
    url, _ = canary_url(servers)
    return clean_env(
        OUTBOX_DATABASE_URL=url,
        TEMPORAL_ADDRESS=servers.temporal_address,
        OUTBOX_TASK_QUEUE=f"tq-cli-{uuid.uuid4().hex[:8]}",
        SAMPLE_OUTBOX_TABLE=table,
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_SWEEP_INTERVAL="1",
        OUTBOX_INITIAL_RETRY_INTERVAL="0.2",
        OUTBOX_MAX_RETRY_INTERVAL="1",
        **extra,
    )


def one_line(text_: str) -> str:
    return " ".join(text_.split())


# -- worker.py: help and refusals -----------------------------------------------------------------


async def test_worker_help_documents_every_setting(servers) -> None:
    env = worker_env(servers, unique_table(), COLUMNS="80")
    result = await run_python("worker.py", "--help", env=env)
    assert result.code == 0, result.output
    assert result.stdout.startswith("Usage: worker.py")
    help_text = one_line(result.stdout)
    for name, field in OutboxSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in help_text, f"{flag} missing from --help"
        names = ", else ".join(env_names(name, field))
        assert f"[env: {names}]" in help_text, f"env of {name} missing"
        if field.annotation is bool:
            assert f"--no-{flag[2:]}" in help_text
    assert "[env: OUTBOX_DATABASE_URL]" in help_text
    assert "[env: TEMPORAL_ADDRESS]" in help_text
    assert "-h, --help" in help_text
    _, canary = canary_url(servers)
    assert canary not in result.output


async def test_worker_without_an_app_exits_2(servers) -> None:
    env = worker_env(servers, unique_table())
    result = await run_python("worker.py", env=env)
    assert result.code == 2, result.output
    assert result.stderr.startswith("outbox-bridge: error: no app to run")
    assert "OUTBOX_APP" in result.stderr and "--app" in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


async def test_worker_refuses_a_category_without_handler(servers) -> None:
    env = worker_env(servers, unique_table())
    result = await run_python("worker.py", "--app", "tests.sample_app:incomplete_app", env=env)
    assert result.code == 2, result.output
    assert "PROJECT_UPDATE" in result.stderr
    assert "no handler" in result.stderr
    assert "ORGANIZATION_UPDATE" not in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--app", "tests.sample_app:not_an_app"],
            "tests.sample_app:not_an_app is str, not an OutboxApp",
        ),
        (["--app", "no_such_module_for_outbox:app"], "cannot import 'no_such_module_for_outbox'"),
        (["--app", "tests.sample_app"], "module:attribute"),
        (["--app", SAMPLE_APP, "--demo"], "do not also give --app"),
        (["--app", SAMPLE_APP, "--partitions", "0"], "partitions"),
    ],
    ids=["not-an-app", "no-module", "bad-format", "app-and-demo", "bad-setting"],
)
async def test_worker_refuses_bad_configuration(servers, args, expected) -> None:
    result = await run_python("worker.py", *args, env=worker_env(servers, unique_table()))
    assert result.code == 2, result.output
    assert result.stderr.startswith("outbox-bridge: error: ")
    assert expected in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        pytest.param([], {"OUTBOX_SHARD_WORKFLOWS": "always"}, id="environment"),
        pytest.param(["--shard-workflows", "always"], {}, id="flag"),
    ],
)
async def test_the_retired_always_mode_is_refused_naming_the_upgrade(
    servers, flags: list[str], env: dict[str, str]
) -> None:
    """A worker still configured with the mode 0.x had (a workflow for every shard) stops at
    once, and says what to do instead."""
    result = await run_python(
        "worker.py", "--app", SAMPLE_APP, *flags, env={**worker_env(servers, unique_table()), **env}
    )
    assert result.code == 2, result.output
    assert result.stderr.startswith("outbox-bridge: error: "), result.stderr
    message = one_line(result.stderr)
    assert "--shard-workflows always was retired" in message, message
    assert "outbox-bridge upgrade-check" in message and "how-to/upgrade" in message, message
    assert "Traceback" not in result.output


async def test_worker_never_prints_the_database_password(servers) -> None:
    # A URL that cannot be parsed: the parse error must not echo it.
    table = unique_table()
    unparsable = f"postgresql://postgres:{CANARY}@localhost:notaport/postgres"
    result = await run_python(
        "worker.py",
        "--app",
        SAMPLE_APP,
        "--database-url",
        unparsable,
        env=worker_env(servers, table),
    )
    assert result.code == 2, result.output
    assert "cannot be parsed" in result.stderr
    assert CANARY not in result.output
    # A server that is not there: the worker fails, without the password in its report.
    unreachable = f"postgresql://postgres:{CANARY}@127.0.0.1:{free_port()}/postgres"
    result = await run_python(
        "worker.py",
        "--app",
        SAMPLE_APP,
        env={**worker_env(servers, table), "OUTBOX_DATABASE_URL": unreachable},
    )
    assert result.code != 0, result.output
    assert "127.0.0.1" in result.stderr
    assert CANARY not in result.output


def test_every_documented_env_var_is_read_and_flags_win(monkeypatch) -> None:
    """The env names shown by --help are the ones the settings read; a flag beats its env var."""
    samples: dict[object, tuple[str, object]] = {
        bool: ("true", True),
        int: ("300", 300),
        float: ("2.5", 2.5),
    }
    clear_settings(monkeypatch)
    for name, field in OutboxSettings.model_fields.items():
        plain = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        kind = plain[0] if len(plain) == 1 else field.annotation  # int | None: an int
        raw, expected = samples.get(kind, ("x1", None))
        if typing.get_origin(field.annotation) is typing.Literal:
            choice = typing.get_args(field.annotation)[-1]  # any allowed value but the default
            raw, expected = choice, choice
        elif name == "regions":
            raw, expected = "eu, us", ["eu", "us"]
        elif name == "skip_shards":
            raw, expected = "ORGANIZATION:42, USER:7", ["ORGANIZATION:42", "USER:7"]
        elif name == "shard_workflows":
            raw, expected = "on-demand", "on-demand"  # its only value; `always` is retired
        elif name == "max_payload_bytes":
            raw, expected = "2048", 2048  # at least 1 KiB
        elif name in ("temporal_tls_cert", "temporal_tls_key"):
            continue  # they go together; checked below
        with monkeypatch.context() as patch:
            patch.setenv(env_name(name, field), raw)
            value = getattr(build_settings({}), name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, Path):
            value = str(value)
        assert value == (raw if expected is None else expected), name
    monkeypatch.setenv("TEMPORAL_TLS_CERT", "/c.pem")
    monkeypatch.setenv("TEMPORAL_TLS_KEY", "/k.pem")
    monkeypatch.setenv("OUTBOX_PARTITIONS", "7")
    monkeypatch.setenv("OUTBOX_LISTEN", "false")
    settings = build_settings({"partitions": 9, "listen": None, "task_queue": None})
    assert settings.temporal_tls_cert == Path("/c.pem")
    assert settings.temporal_tls_key == Path("/k.pem")
    assert settings.partitions == 9  # the flag wins
    assert settings.listen is False  # no flag: the environment
    assert settings.task_queue == "outbox"  # neither: the default
    monkeypatch.setenv("OUTBOX_PARTITIONS", "0")
    with pytest.raises(ConfigurationError, match="partitions"):
        build_settings({})


# -- each command offers the settings it uses ------------------------------------------------------

SHARD_COMMAND = {SettingGroup.TEMPORAL, SettingGroup.APP}
COMMAND_GROUPS: dict[str, set[SettingGroup]] = {
    "worker": set(SettingGroup),
    "init-db": {SettingGroup.DATABASE, SettingGroup.APP},
    "grants": {SettingGroup.DATABASE, SettingGroup.APP},
    "status": SHARD_COMMAND | {SettingGroup.DATABASE},  # it lists the parked groups
    "skip": SHARD_COMMAND | {SettingGroup.SHARDS},  # it may start the shard's workflow
    "resume": SHARD_COMMAND,
    "history export": SHARD_COMMAND,
    "flush": SHARD_COMMAND | {SettingGroup.DATABASE, SettingGroup.SHARDS},
    "shards": SHARD_COMMAND | {SettingGroup.DATABASE},
    "park": SHARD_COMMAND | {SettingGroup.DATABASE},
    "unpark": SHARD_COMMAND | {SettingGroup.DATABASE},
    "parked": {SettingGroup.DATABASE, SettingGroup.APP},
    "replay": set(),
    "upgrade-check": {SettingGroup.TEMPORAL},
    "pause": {SettingGroup.DATABASE, SettingGroup.APP},
    "unpause": {SettingGroup.DATABASE, SettingGroup.APP},
    "pauses": {SettingGroup.DATABASE, SettingGroup.APP},
    "limit": {SettingGroup.DATABASE, SettingGroup.APP},
    "limits": {SettingGroup.DATABASE, SettingGroup.APP},
}


def _command(path: str) -> click.Command:
    command: click.Command = cli_main
    for name in path.split():
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", list(COMMAND_GROUPS))
def test_each_command_offers_the_settings_it_uses(path: str) -> None:
    offered = {p.name for p in _command(path).params} & set(OutboxSettings.model_fields)
    expected = {
        name
        for name, field in OutboxSettings.model_fields.items()
        if setting_group(field) in COMMAND_GROUPS[path]
    }
    assert offered == expected


def test_every_command_is_listed() -> None:
    listed = {path.split()[0] for path in COMMAND_GROUPS}
    assert set(cli_main.commands) == listed
    history = _command("history")
    assert isinstance(history, click.Group)
    assert set(history.commands) == {"export"}


def test_status_help_lists_connection_settings_only() -> None:
    result = CliRunner().invoke(cli_main, ["status", "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    help_text = one_line(result.output)
    for flag, env in [
        ("--temporal-address", "TEMPORAL_ADDRESS"),
        ("--app", "OUTBOX_APP"),
        ("--database-url", "OUTBOX_DATABASE_URL"),  # for the shard's parked groups
    ]:
        assert flag in help_text and f"[env: {env}]" in help_text
    for flag in ("--partitions", "--health-port", "--shutdown-grace", "--log-level"):
        assert f"{flag} " not in help_text, flag


def test_settings_a_command_offers_no_flag_for_come_from_the_environment(monkeypatch) -> None:
    seen: list[OutboxSettings] = []

    @click.command()
    @settings_options(SettingGroup.DATABASE)
    def command(**overrides: object) -> None:
        seen.append(build_settings(overrides))

    monkeypatch.setenv("OUTBOX_SHUTDOWN_GRACE", "3")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://from-env/db")
    result = CliRunner().invoke(command, ["--database-url", "postgresql://from-flag/db"])
    assert result.exit_code == 0, result.output
    [settings] = seen
    assert settings.shutdown_grace == 3
    assert settings.database_url is not None
    assert settings.database_url.get_secret_value() == "postgresql://from-flag/db"
    assert CliRunner().invoke(command, ["--shutdown-grace", "4"]).exit_code == 2  # not offered


@pytest.mark.parametrize("command", ["pause", "unpause"])
def test_pause_with_an_app_that_cannot_be_loaded_says_so_in_one_line(command: str) -> None:
    args = [command, "--category", "PROJECT_UPDATE", "--app", "no_such_module_for_outbox:app"]
    result = CliRunner().invoke(
        cli_main, [*args, *(["--reason", "r"] if command == "pause" else [])]
    )
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "outbox-bridge: error: cannot import 'no_such_module_for_outbox'" in result.output


# -- worker.py: end to end ------------------------------------------------------------------------


async def scalar(engine: AsyncEngine, statement: str, **params: object) -> object:
    async with engine.connect() as conn:
        return (await conn.execute(text(statement), params)).scalar_one()


async def test_worker_end_to_end(servers, engine) -> None:
    table = unique_table()
    async with engine.begin() as conn:
        await conn.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": CALLS_TABLE}
        )
        await conn.execute(text(CALLS_DDL))
    _, canary = canary_url(servers)
    await init_db(worker_env(servers, table), "--app", SAMPLE_APP)
    async with worker_process("--app", SAMPLE_APP, env=worker_env(servers, table)) as output:
        # init-db created its table; rows come from a plain SQL producer.
        async with engine.begin() as conn:
            insert = text(
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                "object_identifier, payload) VALUES (:scope, :shard, :category, :obj, "
                "CAST(:payload AS jsonb)) RETURNING id"
            )

            async def write(
                scope: int, shard: int, category: int, obj: int, payload: str | None
            ) -> int:
                result = await conn.execute(
                    insert,
                    {
                        "scope": scope,
                        "shard": shard,
                        "category": category,
                        "obj": obj,
                        "payload": payload,
                    },
                )
                return int(result.scalar_one())

            org, user = int(SampleScope.ORGANIZATION), int(SampleScope.USER)
            project = [
                await write(org, 7, SampleCategory.PROJECT_UPDATE, 5, f'{{"n": {n}}}')
                for n in range(3)
            ]
            organization = await write(org, 7, SampleCategory.ORGANIZATION_UPDATE, 7, None)
            user_row = await write(user, 9, SampleCategory.USER_UPDATE, 9, '{"user": 9}')

        async def drained() -> bool:
            return await scalar(engine, f"SELECT count(*) FROM {table}") == 0

        await wait_until(drained, timeout=30, what=f"an empty {table}")
        async with engine.connect() as conn:
            calls = (
                (
                    await conn.execute(
                        text(
                            f"SELECT row_id, shard_scope, shard_identifier, category, object_identifier, "
                            f"coalesced, payload, handler, seq FROM {CALLS_TABLE} WHERE outbox_table = :t "
                            "ORDER BY seq"
                        ),
                        {"t": table},
                    )
                )
                .mappings()
                .all()
            )
        handled = {c["row_id"]: c for c in calls}
        # Each coalescing group was handled once, with its highest id (the design contract,
        # invariant 3: docs/explanation/contract.md).
        assert set(handled) == {project[-1], organization, user_row}, calls
        assert handled[project[-1]]["coalesced"] == 3
        assert handled[project[-1]]["payload"] == {"n": 2}
        assert handled[project[-1]]["handler"] == "sync"
        assert (
            handled[project[-1]]["shard_scope"],
            handled[project[-1]]["shard_identifier"],
            handled[project[-1]]["object_identifier"],
        ) == (org, 7, 5)
        assert handled[organization]["coalesced"] == 1
        assert handled[organization]["payload"] is None
        assert handled[organization]["handler"] == "sync"
        assert handled[user_row]["handler"] == "async"
        assert handled[user_row]["payload"] == {"user": 9}
        user_call = handled[user_row]
        assert (user_call["shard_scope"], user_call["shard_identifier"]) == (user, 9)
        # Within shard ORGANIZATION:7, groups run in order of their lowest pending id (§3.2).
        assert handled[project[-1]]["seq"] < handled[organization]["seq"]

        output.proc.send_signal(signal.SIGTERM)
        code = await output.finish(30)
        assert code == 0, str(output)
    assert "outbox-bridge is running" in output.stdout
    assert "***" in output.stdout  # the banner shows the database with its password masked
    assert canary not in output.stdout, str(output)
    assert canary not in output.stderr, str(output)
    assert "Traceback" not in output.stderr, str(output)


# -- worker.py --demo ------------------------------------------------------------------------------

SUMMARY_ROW = re.compile(r"^\s*\d+\.\d\s+\d+\.\d(\s+\d+){6}\s*$", re.MULTILINE)
OUTAGE_SHARD = "ORGANIZATION:7"
# The demo's table is the same in every demo test, and so are its partitions' workflow ids: the
# demo tests share a task queue, so that each worker takes over what the last one left running.
DEMO_TASK_QUEUE = f"tq-demo-{uuid.uuid4().hex[:8]}"


async def demo_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    """``outbox-bridge ARGS --demo`` with the worker's settings; exit code and output (stdout,
    then stderr)."""
    done = await run_cli(*args, "--demo", env=env)
    return done.code, done.output


async def demo_state(env: dict[str, str]) -> dict[str, object]:
    """The outage shard's ``status --json``: state ``none`` while its partition still retries it
    (the first OUTBOX_HANDOVER_AFTER seconds), its workflow's state once handed over."""
    code, output = await demo_cli(env, "status", OUTAGE_SHARD, "--json")
    assert code == 0, output
    found: dict[str, object] = json.loads(output)
    return found


async def outage_rows(engine: AsyncEngine) -> object:
    return await scalar(
        engine, "SELECT count(*) FROM outbox WHERE shard_scope = 1 AND shard_identifier = 7"
    )


@contextlib.asynccontextmanager
async def demo_worker(
    servers: Servers,
    engine: AsyncEngine,
    *args: str,
    ready: Callable[[WorkerProcess], bool],
    what: str,
) -> AsyncIterator[tuple[WorkerProcess, dict[str, str]]]:
    """``python worker.py --demo ARGS`` from the moment ``ready`` holds, and its settings; the
    block's end stops it with SIGINT (it must exit 0) and empties the demo's table."""
    env = worker_env(servers, unique_table(), OUTBOX_HEALTH_PORT="0")
    env["OUTBOX_TASK_QUEUE"] = DEMO_TASK_QUEUE
    # The demo writes 20 rows/s, each notified: a full sweep a second over a minute's run would
    # cost more CPU than the rows, and nothing here waits for one.
    env["OUTBOX_SWEEP_INTERVAL"] = "10"
    await init_db(env, "--demo")  # a demo on a database of its own installs nothing itself
    try:
        async with worker_process(
            "--demo", *args, env=env, ready=ready, timeout=90, what=what
        ) as output:
            yield output, env
            output.proc.send_signal(signal.SIGINT)
            code = await output.finish(30)
            assert code == 0, str(output)
    finally:
        async with engine.begin() as conn:  # the demo app's table, shared by no other test
            await conn.execute(text("DELETE FROM outbox"))


async def test_demo_blocks_a_shard_to_skip_and_resume_and_summarises_failures(
    servers, engine
) -> None:
    """The demo, as the quick start walks through it: ORGANIZATION:7 stays blocked while its
    replica is down (here for 60 s: on a loaded machine the worker's start and the first
    three attempts took longer than 30), the banner says so, the shard can be skipped (its
    rows are kept) and resumed, and it drains once the outage is over. The console counts the
    handler failures under the summary lines instead of a log line each."""
    async with demo_worker(
        servers,
        engine,
        "--demo-outage",
        "60",
        ready=lambda output: "handler failures: " in output.stdout,
        what="a line of handler failures",
    ) as (output, env):

        async def blocked_on_the_outage() -> bool:
            # The first failures are retried by the partition for 5 s before the handover.
            state = await demo_state(env)  # "none" until then
            error = state.get("last_error") or {}
            return (
                state["state"] == "blocked"
                and int(str(state["attempts"])) >= 3
                and "planned outage" in str(error)
            )

        await wait_until(
            blocked_on_the_outage,
            timeout=50,
            interval=COMMAND_POLL_INTERVAL,
            what="ORGANIZATION:7 blocked",
        )
        code, said = await demo_cli(env, "skip", OUTAGE_SHARD, "--reason", "replica down")
        assert code == 0, said
        assert (await demo_state(env))["state"] == "skipped"
        assert int(str(await outage_rows(engine))) > 0  # skipped, its rows kept
        code, said = await demo_cli(env, "resume", OUTAGE_SHARD)
        assert code == 0, said

        async def drained() -> bool:
            return int(str(await outage_rows(engine))) == 0

        # Waited for in the database (a query, not a program per poll), then confirmed by flush.
        await wait_until(
            drained, timeout=90, interval=0.5, what="ORGANIZATION:7 drained after its outage"
        )
        code, said = await demo_cli(env, "flush", OUTAGE_SHARD, "--timeout", "5")
        assert code == 0, said
    banner = " ".join(output.stdout.split())
    assert "ORGANIZATION:7 is blocked: the project replica of organization 7 is down" in banner
    assert "(60 s)" in banner and "--log-failures logs each" in banner
    assert "workflow outbox:outbox:ORGANIZATION:7 in the Temporal UI" in banner
    assert "fails once" not in banner
    assert len(SUMMARY_ROW.findall(output.stdout)) >= 2, str(output)
    assert "handler failures: ORGANIZATION:7 ×" in output.stdout
    header = "written/s handled/s pending shards workflows blocked skipped deferred"
    assert header in banner, str(output)
    assert "handler failed" not in output.stderr, str(output)
    assert "Traceback" not in output.stdout + output.stderr, str(output)
    assert "outbox-bridge stopped" in output.stderr


async def test_demo_logs_each_failure_with_log_failures(servers, engine) -> None:
    """With --log-failures, each failed call has a log line of its own, without the
    traceback of an intended failure."""
    async with demo_worker(
        servers,
        engine,
        "--log-failures",
        # The first failure can be logged before the banner is printed: wait for both.
        ready=lambda output: "ReplicaUnavailable" in output.stderr and BANNER in output.stdout,
        what="a log line of a failed call, and the banner",
    ) as (output, _):
        pass
    failures = [line for line in output.stderr.splitlines() if "ReplicaUnavailable" in line]
    assert failures and all("handler failed: " in line for line in failures), str(output)
    assert "Traceback" not in output.stdout + output.stderr, str(output)
    assert "--log-failures logs each" not in output.stdout
    # The banner explains the summary lines that follow it (stdout is a pipe: --demo turns
    # them on).
    assert "Every 5 s a line follows" in " ".join(output.stdout.split()), str(output)


# -- python -m outbox_bridge --------------------------------------------------------------------


async def test_module_help() -> None:
    # ``python -m outbox_bridge`` is the command line: one interpreter shows it (each costs a
    # second or two of CPU); a command's help is the same command's run in this process.
    result = await run_python("-m", "outbox_bridge", "--help", env=clean_env())
    assert result.code == 0, result.output
    assert result.stdout.startswith("Usage: outbox-bridge")
    assert "init-db" in result.stdout
    result = await run_cli("init-db", "--help", env=clean_env())
    assert result.code == 0, result.output
    assert result.stdout.startswith("Usage: outbox-bridge init-db"), result.output
    help_text = one_line(result.stdout)
    assert "--database-url" in help_text and "[env: OUTBOX_DATABASE_URL]" in help_text
    assert "--app" in help_text and "[env: OUTBOX_APP]" in help_text


async def test_init_db_creates_the_tables_idempotently(servers, engine) -> None:
    table = unique_table()
    url, canary = canary_url(servers)
    env = clean_env(SAMPLE_OUTBOX_TABLE=table)
    args = ["init-db", "--database-url", url, "--app", SAMPLE_APP]
    first = await run_cli(*args, env=env)
    assert first.code == 0, first.output
    assert f"tables ready: {table}" in first.stdout
    assert canary not in first.output
    assert await scalar(engine, "SELECT to_regclass(:t)::text", t=table) == table
    assert (
        await scalar(
            engine, "SELECT count(*) FROM pg_trigger WHERE tgname = :n", n=f"{table}_notify"
        )
        == 1
    )
    async with engine.begin() as conn:
        await conn.execute(
            text(
                f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier) "
                "VALUES (1, 1, 1, 1)"
            )
        )
    second = await run_cli(*args, env=env)
    assert second.code == 0, second.output
    assert f"tables ready: {table}" in second.stdout
    assert canary not in second.output
    assert await scalar(engine, f"SELECT count(*) FROM {table}") == 1  # rows kept


async def test_init_db_reads_the_environment(servers, engine) -> None:
    table = unique_table()
    url, canary = canary_url(servers)
    env = clean_env(SAMPLE_OUTBOX_TABLE=table, OUTBOX_DATABASE_URL=url, OUTBOX_APP=SAMPLE_APP)
    result = await run_cli("init-db", env=env)
    assert result.code == 0, result.output
    assert canary not in result.output
    assert await scalar(engine, "SELECT to_regclass(:t)::text", t=table) == table


async def test_init_db_masks_a_password_given_as_a_query_parameter(servers, engine) -> None:
    table = unique_table()
    url = make_url(servers.database_url)
    password = str(url.password) if url.password else CANARY
    in_query = url.set(password=None).update_query_dict({"password": password})
    result = await run_cli(
        "init-db",
        "--app",
        SAMPLE_APP,
        env=clean_env(
            SAMPLE_OUTBOX_TABLE=table,
            OUTBOX_DATABASE_URL=in_query.render_as_string(hide_password=False),
        ),
    )
    assert result.code == 0, result.output
    assert "password=***" in result.stdout
    assert password not in result.output
    assert await scalar(engine, "SELECT to_regclass(:t)::text", t=table) == table


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--app", "tests.sample_app:not_an_app"], "is str, not an OutboxApp"),
        (["--database-url", f"mysql://root:{CANARY}@localhost/db"], "only PostgreSQL"),
        (
            ["--database-url", f"postgresql://postgres:{CANARY}@127.0.0.1:{free_port()}/postgres"],
            "cannot create the outbox tables in postgresql+psycopg://postgres:***@127.0.0.1",
        ),
        (["--demo", "--app", SAMPLE_APP], "do not also give --app"),
    ],
    ids=["not-an-app", "not-postgres", "unreachable", "app-and-demo"],
)
async def test_init_db_refusals(args, expected) -> None:
    result = await run_cli("init-db", *args, env=clean_env())
    assert result.code == 2, result.output
    assert result.stderr.startswith("outbox-bridge: error: ")
    assert expected in result.stderr
    assert CANARY not in result.output
    assert "Traceback" not in result.output


def test_the_settings_1_0_retired_are_named_when_still_set() -> None:
    environ = {"OUTBOX_LINGER": "10", "OUTBOX_IDLE_TIMEOUT": "0", "OUTBOX_PARTITIONS": "4"}
    assert retired_variables(environ) == ["OUTBOX_LINGER", "OUTBOX_IDLE_TIMEOUT"]


def test_the_tools_start_without_loading_the_worker() -> None:
    """``outbox-bridge status`` and the other tools import the command line, not the worker's
    runtime, the demo or the replayer: each of those loads only in its own command."""
    probe = (
        "import sys, outbox_bridge.cli; "
        "print(sorted(m for m in ('outbox_bridge.runtime.worker', 'outbox_bridge.demo', "
        "'outbox_bridge.dev.replayer') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
