"""A team's program with the outbox in its worker exits with its own exit code, every time.

``worker.shutdown()`` returns once the outbox has stopped too, so whatever the program does next
(await the run, cancel the run's task, or simply return from ``main``) finds nothing of the
outbox left to cancel, and the stop prints nothing. Before, a cancel after the shutdown landed
in the middle of the outbox's stop: the drains printed tracebacks and the process hung at exit
in some runs. A program that fails while its worker runs, never stopping it, still ends its
event loop. ``python worker.py`` and ``outbox-bridge worker`` stop as quietly on SIGTERM and
SIGINT, letting the handler call in flight finish."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.harness import Servers, unique_table, wait_until
from tests.support import ROOT, Run, clean_env, init_db, run_python, worker_process

# The team's program: its worker with the outbox, one row handled, more rows in flight or none,
# then its ending. ``await``: worker.shutdown(), then the run awaited; ``cancel``: the run's
# task cancelled if it has not ended; ``return``: main returns; all exit with code 5.
# ``fail``: main fails while its worker runs, without stopping it: asyncio.run then cancels
# every task, the outbox's and the SDK's among them. What the interpreter does at exit after
# that is the SDK's (it can hang or abort in its native threads after an unclean stop), so that
# program leaves with os._exit(3) once its loop has ended.
PROGRAM = """
import asyncio, os, sys, uuid
from sqlalchemy.ext.asyncio import create_async_engine
from temporalio.client import Client
from temporalio.worker import Worker
from outbox_bridge import OutboxPlugin
from tests.harness import Category, Recorder, install_tables, make_app, table_empty, unique_table, wait_until, write_rows
from tests.user_workflows import OrderWorkflow

database_url, address, in_flight, ending = sys.argv[1:]
recorder = Recorder()
app = make_app(unique_table(), recorder)
calling = asyncio.Event()

async def slow(message):
    calling.set()
    await asyncio.sleep(0.2)

recorder.behaviour[int(Category.USER_UPDATE)] = slow

def row(category, shard):
    return {"category": category, "shard_identifier": shard, "object_identifier": shard}

async def main():
    await install_tables(database_url, app)  # what init-db does: the plugin only checks
    client = await Client.connect(address)
    suffix = uuid.uuid4().hex[:8]
    plugin = OutboxPlugin(app, database_url=database_url, task_queue=f"outbox-{suffix}")
    worker = Worker(client, task_queue=f"orders-{suffix}", workflows=[OrderWorkflow], plugins=[plugin])
    running = asyncio.create_task(worker.run())
    engine = create_async_engine(database_url)
    await write_rows(engine, app, [row(Category.ORGANIZATION_UPDATE, 1)])
    await wait_until(lambda: table_empty(engine, app), timeout=60, what="the row handled")
    print("handled", recorder.ids(), flush=True)
    if in_flight == "rows":
        await write_rows(engine, app, [row(Category.USER_UPDATE, n) for n in range(1, 200)])
        await wait_until(calling.is_set, timeout=60, what="a handler call in flight")
    await engine.dispose()
    if ending == "fail":
        raise RuntimeError("the program failed")
    await worker.shutdown()
    left = sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())
    print("stopped; the run had ended:", running.done(), "; tasks left:", left, flush=True)
    if ending == "await":
        await running
    elif ending == "cancel" and not running.done():
        running.cancel()

try:
    asyncio.run(main())
except RuntimeError as error:
    print("the event loop ended:", error, flush=True)
    os._exit(3)
sys.exit(5)
"""
# How many times each clean ending runs, with rows in flight and without (4 programs at once):
# an unclean stop hung or aborted a run now and then, so one run proves little. The default
# suite runs each once; the full loop is in the ``faults`` tier (`pytest -m faults`), and
# OUTBOX_EXIT_RUNS=100 makes it the long proof.
RUNS = int(os.environ.get("OUTBOX_EXIT_RUNS", "3"))
CLEAN = list(itertools.product(["rows", "none"], ["await", "cancel", "return"]))


@pytest.fixture
def program(tmp_path: Path) -> Path:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return script


async def run_program(servers: Servers, program: Path, in_flight: str, ending: str) -> Run:
    return await run_python(
        str(program),
        servers.database_url,
        servers.temporal_address,
        in_flight,
        ending,
        env=clean_env(PYTHONPATH=str(ROOT)),
        timeout=120,  # a failure detector: a run ends in seconds
    )


async def test_a_program_that_fails_while_its_worker_runs_ends_its_event_loop(
    servers: Servers, program: Path
) -> None:
    run = await run_program(servers, program, "none", "fail")
    assert "handled [1]" in run.stdout, run.output
    assert "the event loop ended: the program failed" in run.stdout, run.output
    assert run.code == 3, run.output


# 18 programs, 4 at a time: 1.5-2 minutes on a loaded machine (48 took 9 minutes).
@pytest.mark.timeout(max(600, 15 * RUNS * len(CLEAN)))
@pytest.mark.parametrize(
    "runs", [pytest.param(1, id="once"), pytest.param(RUNS, marks=pytest.mark.faults, id="full")]
)
async def test_a_program_that_stops_its_worker_exits_with_its_own_code_every_time(
    servers: Servers, program: Path, runs: int
) -> None:
    at_once = asyncio.Semaphore(4)

    async def one(in_flight: str, ending: str) -> tuple[str, Run]:
        async with at_once:
            run = await run_program(servers, program, in_flight, ending)
        return f"{in_flight} in flight, then {ending}", run

    done = await asyncio.gather(*(one(*case) for case in CLEAN for _ in range(runs)))
    for case, run in done:
        assert run.code == 5, f"{case}:\n{run.output}"
        # shutdown() returned with the outbox stopped: nothing of it was left to cancel.
        assert run.stdout.splitlines()[-1:] == [
            "stopped; the run had ended: True ; tasks left: []"
        ], f"{case}:\n{run.output}"
        # No traceback, no warning: Python prints the loggers' warnings on stderr.
        assert run.stderr == "", f"{case}:\n{run.output}"


# A log line of the worker at level warning or above (its console format).
WARNING_LINE = re.compile(r"\[(warning|error|critical)\s*\]")


@pytest.mark.parametrize(
    ("command", "signum"),
    [
        (["worker.py"], signal.SIGTERM),
        (["worker.py"], signal.SIGINT),
        (["-m", "outbox_bridge", "worker"], signal.SIGTERM),
        (["-m", "outbox_bridge", "worker"], signal.SIGINT),
    ],
    ids=["worker.py-SIGTERM", "worker.py-SIGINT", "outbox-bridge-SIGTERM", "outbox-bridge-SIGINT"],
)
async def test_the_worker_command_stops_on_a_signal_with_no_traceback(
    servers: Servers, engine: AsyncEngine, tmp_path: Path, command: list[str], signum: int
) -> None:
    table = unique_table()
    env = clean_env(
        OUTBOX_DATABASE_URL=servers.database_url,
        TEMPORAL_ADDRESS=servers.temporal_address,
        OUTBOX_TASK_QUEUE=f"tq-stop-{table}",
        OUTBOX_APP="tests.test_health:hold_app",  # its handler waits for a file
        OUTBOX_HEALTH_PORT="0",
        HOLD_OUTBOX_TABLE=table,
        HOLD_DIR=str(tmp_path),
    )
    await init_db(env)
    script, *args = command
    async with worker_process(*args, env=env, script=script) as worker:
        async with engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                        "object_identifier) VALUES (1, 1, 1, 1) RETURNING id"
                    )
                )
            ).scalar_one()
        await wait_until(lambda: (tmp_path / f"started-{row}").exists(), what="the call")
        worker.proc.send_signal(signum)
        (tmp_path / "release").touch()  # the call in flight ends within the grace
        code = await worker.finish(timeout=60)
    assert code == 0, str(worker)
    assert "Traceback" not in worker.stderr, str(worker)
    assert not WARNING_LINE.search(worker.stderr), str(worker)
    async with engine.connect() as conn:
        left = (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one()
    assert left == 0  # handled and deleted before the exit
