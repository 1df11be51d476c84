"""``python -m outbox_bridge`` / ``outbox-bridge``: the command line of outbox-bridge."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from outbox_bridge import __version__
from outbox_bridge.cli.connections import worker_app
from outbox_bridge.cli.flags import build_settings, settings_options
from outbox_bridge.cli.limit_commands import limit, limits
from outbox_bridge.cli.listing import shards
from outbox_bridge.cli.park_commands import park, parked, unpark_command
from outbox_bridge.cli.pause_commands import pause, pauses, unpause
from outbox_bridge.cli.schema_commands import grants, init_db
from outbox_bridge.cli.shard_commands import flush, history_export, resume, skip, status
from outbox_bridge.errors import OutboxError
from outbox_bridge.observability.logs import configure_logging, quiet_sdk_loggers


def run() -> None:
    """Entry point: run the command line, then :func:`leave`."""
    code = 0
    try:
        main.main(prog_name="outbox-bridge")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit without interpreter teardown, in which a process that used a Temporal client can
    crash (the SDK's runtime threads), turning a success into a failure exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="outbox-bridge", message="%(prog)s %(version)s")
def main() -> None:
    """outbox-bridge: a transactional outbox executed by Temporal.

    Run the worker with `outbox-bridge worker` (see its --help).
    """


@main.command(
    "worker", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@settings_options()
def worker(**overrides: Any) -> None:
    """Run the worker: the bridge that finds shards with rows, and the Temporal worker that
    drains them and runs their handlers.

    Every option is also an environment variable (shown with each). With no database URL and
    no Temporal address, embedded servers are started under --data-dir.
    """
    # The worker's modules load here, not with the command line: the tools start faster.
    from outbox_bridge import demo
    from outbox_bridge.runtime.worker import run as run_worker

    code = 0
    try:
        settings = build_settings(overrides)
        handler = configure_logging(settings.log_level, settings.log_format)
        if settings.demo:
            handler.addFilter(demo.IntendedFailures())
            settings = demo.demo_settings(settings)
        quiet_sdk_loggers()
        app = worker_app(settings)
        asyncio.run(run_worker(settings, app))
    except OutboxError as exc:
        print(f"outbox-bridge: error: {exc}", file=sys.stderr)
        code = 2
    except Exception:
        logging.getLogger("outbox_bridge").exception("outbox-bridge stopped on an unexpected error")
        code = 1
    leave(code)


@main.group("history")
def history() -> None:
    """Export shard workflow histories (to keep a replay corpus of your own)."""


history.add_command(history_export)


@main.command("replay")
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def replay(files: tuple[Path, ...]) -> None:
    """Replay exported histories against the current workflow code, as the worker runs it and
    under the sandbox; exit 1 on nondeterminism, naming the first event that differs."""
    from outbox_bridge.dev.replayer import HistoryReplayer

    click.echo(f"replaying {len(files)} histories, several at once", err=True)
    failures = asyncio.run(HistoryReplayer().replay_all(files))
    for path, failure in zip(files, failures, strict=True):
        click.echo(f"ok   {path}" if failure is None else f"FAIL {failure}")
    failed = sum(failure is not None for failure in failures)
    click.echo(f"{len(files) - failed} replayed, {failed} failed")
    sys.exit(1 if failed else 0)


for command in (
    init_db,
    grants,
    status,
    skip,
    resume,
    flush,
    shards,
    park,
    unpark_command,
    parked,
    pause,
    unpause,
    pauses,
    limit,
    limits,
):
    main.add_command(command)
