"""A process that used the producer API, flush included, exits with its own exit code: never an
abort at interpreter exit, whether Temporal answers, is down, or accepts connections and never
answers.

Temporal's client runs in native threads that call into Python to hand back each result; one
still doing so while the interpreter finalizes aborted the process (``Fatal Python error:
PyGILState_Release``, SIGABRT) in a few runs out of a hundred, after the right report. So each
case runs a producer script many times, in parallel subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.dev.embedded import free_port
from tests.harness import (
    Recorder,
    Servers,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    unique_table,
)
from tests.support import ROOT, Run, clean_env, run_python

# A producer as an application writes one: one row, flushed from a sync or an async session, the
# report printed; then it exits with a code of its own.
PRODUCER = """
import asyncio, json, os, sys

from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox_bridge import outbox_context
from tests.sample_app import SampleCategory, app

URL = os.environ["OUTBOX_DATABASE_URL"]
TIMEOUT = float(os.environ["FLUSH_TIMEOUT"])
ROW = dict(category=SampleCategory.PROJECT_UPDATE, shard_identifier=1, object_identifier=1)


def flush_sync():
    engine = create_engine(URL)
    with Session(engine) as session:
        with outbox_context(session, flush=True, timeout=TIMEOUT) as outbox:
            app.write(session, **ROW)
            session.commit()
    engine.dispose()
    return outbox.report


async def flush_async():
    engine = create_async_engine(URL)
    async with AsyncSession(engine) as session:
        async with outbox_context(session, flush=True, timeout=TIMEOUT) as outbox:
            await app.write_async(session, **ROW)
            await session.commit()
    await engine.dispose()
    return outbox.report


report = asyncio.run(flush_async()) if sys.argv[1] == "async" else flush_sync()
print(json.dumps([[r.shard, str(r.outcome), r.detail] for r in report]))
sys.exit(EXIT_CODE)
"""
EXIT_CODE = 3
# Runs per case, half of them sync: two in the default suite, the full loop in the ``faults``
# tier (`pytest -m faults`); OUTBOX_EXIT_RUNS=100 for the long proof.
RUNS = int(os.environ.get("OUTBOX_EXIT_RUNS", "10"))
EACH_RUNS = pytest.mark.parametrize(
    "runs", [pytest.param(2, id="twice"), pytest.param(RUNS, marks=pytest.mark.faults, id="full")]
)
AT_ONCE = 4


async def run_producers(script: Path, env: dict[str, str], runs: int) -> list[Run]:
    slots = asyncio.Semaphore(AT_ONCE)

    async def one(kind: str) -> Run:
        async with slots:
            return await run_python(str(script), kind, env=env, timeout=120)

    return await asyncio.gather(*(one("async" if i % 2 else "sync") for i in range(runs)))


def outcomes(runs: list[Run]) -> list[str]:
    """Each run's flush outcome, once each run is checked to have exited with its own code."""
    found = []
    for run in runs:
        assert "Fatal Python error" not in run.stderr, run.output
        assert run.code == EXIT_CODE, run.output
        [[shard, outcome, _]] = json.loads(run.stdout.splitlines()[-1])
        assert shard == "ORGANIZATION:1"
        found.append(outcome)
    return found


@pytest.fixture
def producer(tmp_path: Path) -> Path:
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER.replace("EXIT_CODE", str(EXIT_CODE)))
    return script


def producer_env(servers: Servers, table: str, temporal: str, timeout: float) -> dict[str, str]:
    return clean_env(
        OUTBOX_DATABASE_URL=servers.database_url,
        TEMPORAL_ADDRESS=temporal,
        SAMPLE_OUTBOX_TABLE=table,
        FLUSH_TIMEOUT=str(timeout),
        PYTHONPATH=str(ROOT),  # the script imports the sample app
    )


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """An address that accepts connections and never answers: a Temporal that is slow."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        for writer in held:
            writer.close()


@EACH_RUNS
async def test_producers_exit_with_their_own_code_with_temporal_up(
    servers: Servers, engine: AsyncEngine, producer: Path, runs: int
) -> None:
    table = unique_table()
    app = make_app(table, Recorder())
    await create_tables(engine, app)
    settings = fast_settings()
    async with running_worker(servers, app, settings):
        env = producer_env(servers, table, servers.temporal_address, timeout=30)
        env["OUTBOX_TASK_QUEUE"] = settings.task_queue
        done = await run_producers(producer, env, runs)
    assert outcomes(done) == ["handled"] * runs


@EACH_RUNS
async def test_producers_exit_with_their_own_code_with_temporal_down(
    servers: Servers, engine: AsyncEngine, producer: Path, runs: int
) -> None:
    table = unique_table()
    await create_tables(engine, make_app(table, Recorder()))
    env = producer_env(servers, table, f"127.0.0.1:{free_port()}", timeout=2)
    done = await run_producers(producer, env, runs)
    assert outcomes(done) == ["unavailable"] * runs
    assert all("cannot connect to Temporal" in run.stdout for run in done)


async def test_producers_exit_with_their_own_code_when_temporal_never_answers(
    servers: Servers, engine: AsyncEngine, producer: Path
) -> None:
    """The flush answers ``unavailable`` at its timeout, even before the client connected."""
    table = unique_table()
    await create_tables(engine, make_app(table, Recorder()))
    async with silent_server() as address:
        env = producer_env(servers, table, address, timeout=1)
        runs = await run_producers(producer, env, 2)
    assert outcomes(runs) == ["unavailable"] * 2
    assert all("did not answer" in run.stdout for run in runs)
