"""Outages of the servers under a running worker: the Temporal dev server killed and restarted
on its database file, PostgreSQL stopped and started again, and every connection of the worker
terminated by the server. The worker keeps running and recovers by itself (the design
contract, section 1: nothing is lost because a server went away;
docs/explanation/contract.md)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from functools import partial

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_bridge.config import sqlalchemy_url
from tests.faults.harness import outbox_count, with_password
from tests.faults.scenario import COUNTED_WORKER, repeats_per_lost_round, variants
from tests.faults.test_crashes import calls_of, calls_over, mixed_shards
from tests.harness import wait_until


@dataclass(frozen=True)
class Size:
    rows: int
    outages: int
    shards: int
    down_seconds: float


@pytest.mark.parametrize(
    "size",
    variants(
        Size(rows=600, outages=1, shards=20, down_seconds=1),
        Size(rows=6_000, outages=3, shards=100, down_seconds=5),
    ),
)
async def test_temporal_killed_and_restarted_on_its_database_file_mid_drain(
    size: Size, new_scenario, fault_temporal, fault_client, record_figures
) -> None:
    scenario = new_scenario("Temporal killed, restarted")
    await scenario.prepare(failure_rate=0.05)
    workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 2)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    per_phase = size.rows // (2 * size.outages + 1)
    for _ in range(size.outages):
        await workload.write(per_phase)
        await asyncio.sleep(1.0)  # mid-drain
        fault_temporal.kill()
        scenario.clock.fault()
        await workload.write(per_phase)  # rows keep committing while Temporal is away
        await asyncio.sleep(size.down_seconds)
        await fault_temporal.start(timeout=60)
        scenario.clock.fault()
    await workload.write(size.rows - workload.committed)
    recovery = await scenario.drained(timeout=600)
    assert worker.running, "the worker stopped during the Temporal outage"
    await scenario.finish(
        workload,
        faults=f"{size.outages} kill -9 of Temporal ({size.down_seconds:.0f} s down)",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # The worker and PostgreSQL stay up, and a drain deletes what it handled on its way
        # out, also when its attempt is cancelled (a workflow task or a heartbeat failed while
        # the server was away): we expect no repeat. But a category activity (a head that
        # failed once) cancelled while its plain-def handler runs does not delete the group
        # it handled, which then runs again: one group per shard and outage at most.
        max_duplicates=size.outages * size.shards,
    )


@pytest.mark.parametrize(
    "size",
    variants(
        Size(rows=600, outages=1, shards=20, down_seconds=2),
        Size(rows=6_000, outages=3, shards=100, down_seconds=5),
    ),
)
async def test_postgresql_stopped_and_restarted_mid_drain(
    size: Size, new_scenario, own_postgres, fault_client, record_figures
) -> None:
    postgres, raw_url = own_postgres
    url, password = with_password(sqlalchemy_url(raw_url).render_as_string(hide_password=False))
    engine = create_async_engine(url, pool_pre_ping=True)
    try:
        scenario = new_scenario(
            "PostgreSQL stopped, restarted", engine=engine, database=(url, password)
        )
        await scenario.prepare(failure_rate=0.05)
        workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 3)
        worker = scenario.worker()
        worker.start()
        await worker.ready()
        per_phase = size.rows // (size.outages + 1)
        for _ in range(size.outages):
            await workload.write(per_phase)
            await asyncio.sleep(1.0)  # mid-drain
            await asyncio.to_thread(postgres.stop)
            scenario.clock.fault()
            await asyncio.sleep(size.down_seconds)
            await asyncio.to_thread(postgres.start)
            scenario.clock.fault()
        await workload.write(size.rows - workload.committed)
        recovery = await scenario.drained(timeout=600)
        assert worker.running, "the worker stopped during the PostgreSQL outage"
        assert "bridge lost the database" in worker.output()
        failed = [w async for w in fault_client.list_workflows('ExecutionStatus="Failed"')]
        await scenario.finish(
            workload,
            faults=f"{size.outages} PostgreSQL restart ({size.down_seconds:.0f} s down), "
            f"{len(failed)} shard runs failed",
            recovery=recovery,
            client=fault_client,
            record=record_figures,
            # A round running when the database goes away cannot delete what it handled: it
            # is repeated, at most one round per shard and outage. Allowed: one repeated group
            # per shard and outage on average.
            max_duplicates=size.outages * size.shards,
        )
    finally:
        await engine.dispose()


@pytest.mark.parametrize("restarts", variants(1, 3))
async def test_the_bridge_listens_again_after_postgresql_restarts(
    restarts: int, new_scenario, own_postgres, fault_client, record_figures
) -> None:
    """With no scan or sweep for an hour, rows written after a restart reach the bridge only
    through NOTIFY: it must notice the lost connection, reconnect and LISTEN again."""
    postgres, raw_url = own_postgres
    url, password = with_password(sqlalchemy_url(raw_url).render_as_string(hide_password=False))
    engine = create_async_engine(url, pool_pre_ping=True)
    try:
        scenario = new_scenario(
            "PostgreSQL restarted, LISTEN", engine=engine, database=(url, password)
        )
        await scenario.prepare()
        workload = scenario.workload(mixed_shards(5), seed=9)
        worker = scenario.worker(OUTBOX_POLL_INTERVAL="3600", OUTBOX_SWEEP_INTERVAL="3600")
        worker.start()
        await worker.ready()
        await workload.write(50)
        await scenario.drained(timeout=120)
        for _ in range(restarts):
            await asyncio.to_thread(postgres.stop)
            scenario.clock.fault()
            await asyncio.sleep(1)
            await asyncio.to_thread(postgres.start)
            scenario.clock.fault()
            await wait_until(lambda: listening(engine, scenario.table), timeout=120, what="LISTEN")
            await workload.write(50)
            recovery = await scenario.drained(timeout=120)
        assert worker.running
        await scenario.finish(
            workload,
            faults=f"{restarts} PostgreSQL restart while idle, no scan or sweep",
            recovery=recovery,
            client=fault_client,
            record=record_figures,
            # PostgreSQL restarts only once the table is empty: no handled row is waiting for
            # its delete then, so nothing can be repeated.
            max_duplicates=0,
        )
    finally:
        await engine.dispose()


async def listening(engine, table: str) -> bool:
    """A backend of the worker has run LISTEN on the table's channel (since the restart: the
    server's backends all started after it)."""
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE query = :q"),
                {"q": f'LISTEN "{table}_rows"'},
            )
            return bool(result.scalar_one())
    except Exception:
        return False


@dataclass(frozen=True)
class Terminations:
    rows: int  # kept waiting before each termination
    terminations: int
    shards: int


@pytest.mark.parametrize(
    "size",
    variants(
        Terminations(rows=2_000, terminations=2, shards=100),
        Terminations(rows=20_000, terminations=5, shards=200),
    ),
)
async def test_the_worker_s_connections_terminated_mid_drain_repeat_few_groups(
    size: Terminations, new_scenario, engine, fault_client, record_figures
) -> None:
    """``pg_terminate_backend`` of every connection of the worker (a failover, a pooler or an
    idle timeout closing them), again and again while it drains a backlog at full speed. The
    worker stays up, and a termination repeats no more calls than a ``kill -9`` may: a round
    that lost its connection deletes what it had handled from a new one, under the shards'
    locks taken again."""
    scenario = new_scenario("worker's connections terminated mid-drain")
    await scenario.prepare()
    workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 7, objects=10_000)
    name = f"outbox-worker-{scenario.table}"
    url = make_url(scenario.database_url).update_query_dict({"application_name": name})
    worker = scenario.worker(
        OUTBOX_DATABASE_URL=url.render_as_string(hide_password=False), **COUNTED_WORKER
    )
    moments = random.Random(size.terminations + 7)
    struck: list[float] = []
    worker.start()
    await worker.ready()
    for _ in range(size.terminations):
        before = await calls_of(engine, scenario.table, worker.pid)
        written = size.rows - await outbox_count(engine, scenario.table)
        await workload.write(written)
        # Mid-drain: the worker has handled part of this backlog.
        handled = moments.randrange(written // 10, written // 2)
        await wait_until(
            partial(calls_over, engine, scenario.table, worker.pid, before + handled),
            timeout=120,
            interval=0.01,
            what="the drain under way",
        )
        assert await outbox_count(engine, scenario.table), "drained before the termination"
        struck.append(time.time())
        assert await terminate(engine, name), "no connection of the worker to terminate"
        scenario.clock.fault()
    recovery = await scenario.drained(timeout=900)
    assert worker.running, "the worker stopped when its connections were terminated"
    await scenario.finish(
        workload,
        faults=f"{size.terminations} terminations of every worker connection; repeats per "
        "termination: {per_fault}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        max_duplicates=size.terminations * REPEATS_PER_TERMINATION,
        faults_at=struck,
        max_repeats_per_fault=REPEATS_PER_TERMINATION,
    )


# Repeated calls allowed per termination: the groups a kill -9 may leave handled and not
# deleted (only a shard another execution took before the lost round's delete runs again).
REPEATS_PER_TERMINATION = repeats_per_lost_round()


async def terminate(engine, application_name: str) -> int:
    """Terminate every connection named ``application_name``; how many there were."""
    async with engine.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = :name"
            ),
            {"name": application_name},
        )
        return int(result.scalar_one())
