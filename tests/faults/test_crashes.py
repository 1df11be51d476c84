"""Worker crashes: kill -9 at random moments, and two workers on one task queue with one of
them frozen past its heartbeat timeout, then killed again and again (the design contract,
invariants 1, 2 and 5: docs/explanation/contract.md)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from functools import partial

import pytest
from sqlalchemy import text
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from outbox_bridge import OutboxSettings
from tests.faults.fault_app import FaultCategory, FaultScope
from tests.faults.harness import WorkerProcess, outbox_count
from tests.faults.history import Shard, Workload
from tests.faults.scenario import COUNTED_WORKER, Scenario, repeats_per_kill, variants
from tests.harness import wait_until


@dataclass(frozen=True)
class Size:
    rows: int
    kills: int
    shards: int


def mixed_shards(count: int) -> list[Shard]:
    """Two thirds organizations (plain-def handlers), one third users (async handlers)."""
    return [
        (int(FaultScope.USER if n % 3 == 2 else FaultScope.ORGANIZATION), 1000 + n)
        for n in range(count)
    ]


@pytest.mark.parametrize(
    "size",
    variants(
        Size(rows=1_000, kills=1, shards=30),
        Size(rows=20_000, kills=20, shards=150),
    ),
)
async def test_kill_9_at_random_moments_during_a_drain_with_failing_handlers(
    size: Size, new_scenario, fault_client, record_figures
) -> None:
    scenario = new_scenario("kill -9 worker")
    await scenario.prepare(failure_rate=0.1)
    shards = mixed_shards(size.shards)
    workload = scenario.workload(shards, seed=size.rows)
    # The default window: failing shards are retried by their partition, killed mid-way too.
    worker = scenario.worker(
        OUTBOX_REDACT_ERRORS="true", OUTBOX_HANDOVER_AFTER="5", **COUNTED_WORKER
    )
    moments = random.Random(size.kills)
    per_cycle = size.rows // (size.kills + 1)
    for kill in range(size.kills):
        worker.start()
        await workload.write(per_cycle)
        if kill % 5 == 4:
            await asyncio.sleep(moments.uniform(0.5, 2.5))  # while it starts
        else:
            await worker.ready()
            await asyncio.sleep(moments.uniform(0.2, 3.0))  # while it drains
        worker.kill()
        scenario.clock.fault()
    worker.start()
    await workload.write(size.rows - workload.committed)
    await worker.ready()
    recovery = await scenario.drained(timeout=900)
    verdict = await scenario.finish(
        workload,
        faults=f"{worker.kills} kill -9, {{failed:,}} handler failures; repeats per kill: "
        "{per_kill}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # A kill repeats what the worker had handled and not deleted yet, and the calls under
        # way; each repeat must repeat a call of a killed process (a running one deletes what
        # it handles).
        max_duplicates=size.kills * repeats_per_kill(shards),
        repeats_only_after_kills=True,
        max_repeats_per_kill=repeats_per_kill(shards),
        redacted=True,
    )
    assert verdict.failed_calls > 0


# The object of a row whose call hangs, and for how long.
HANGING_OBJECT, HANG_SECONDS = 900, 6.0


async def frozen_in_a_call(scenario: Scenario, workload: Workload, client: Client) -> None:
    """Write a row whose call hangs (the scenario hangs HANGING_OBJECT's first call), freeze
    the worker whose call it is until the partitions' drains have been retried in the other
    worker (past the heartbeat timeout), then let it run on: the other worker's rounds meet a
    shard whose stale call still runs, its lock held by a process that missed its heartbeats."""
    await workload.write_exact(
        [(int(FaultScope.ORGANIZATION), 1000, int(FaultCategory.PROJECT_UPDATE), HANGING_OBJECT)]
    )
    frozen, other = await scenario.hung_worker()
    frozen.freeze()
    await wait_until(
        partial(drains_taken_over, client, scenario.table, other),
        timeout=120,
        interval=0.2,
        what="the frozen worker's drains retried in the other",
    )
    frozen.thaw()


async def drains_taken_over(client: Client, table: str, worker: WorkerProcess) -> bool:
    """Whether every partition's drain of ``table`` runs in ``worker`` now."""
    partitions = OutboxSettings.model_fields["partitions"].default
    for partition in range(partitions):
        handle = client.get_workflow_handle(f"outbox:{table}:partition:{partition}")
        pending = (await handle.describe()).raw_description.pending_activities
        if not pending or not pending[0].last_worker_identity.startswith(f"{worker.pid}@"):
            return False
    return True


@pytest.mark.parametrize(
    "size",
    variants(Size(rows=500, kills=1, shards=20), Size(rows=5_000, kills=10, shards=60)),
)
async def test_two_workers_on_one_task_queue_one_killed_repeatedly(
    size: Size, new_scenario, engine, fault_client, record_figures
) -> None:
    scenario = new_scenario("two workers, one killed")
    await scenario.prepare(
        failure_rate=0.05, hang_objects=[HANGING_OBJECT], hang_seconds=HANG_SECONDS
    )
    shards = mixed_shards(size.shards)
    workload = scenario.workload(shards, seed=size.rows + 1)
    steady = scenario.worker("steady", **COUNTED_WORKER)
    victim = scenario.worker("victim", **COUNTED_WORKER)
    # The victim starts first, so its bridge is the active one until its first kill: shards it
    # starts run their first task in it (eager start), and after the kill in the other worker.
    victim.start()
    await victim.ready()
    steady.start()
    await steady.ready()
    moments = random.Random(size.kills)
    per_cycle = size.rows // (size.kills + 1)
    for kill in range(size.kills):
        await workload.write(per_cycle)
        await asyncio.sleep(moments.uniform(0.5, 3.0))
        if kill == 0:
            await frozen_in_a_call(scenario, workload, fault_client)
            await asyncio.sleep(moments.uniform(0.5, 3.0))
        victim.kill()
        scenario.clock.fault()
        victim.start()
        await victim.ready()
    await workload.write(size.rows - workload.committed)
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"1 worker frozen in a call past the heartbeat timeout, {victim.kills} kill -9 of "
        "one of 2 workers; repeats per kill: {per_kill}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # As in the kill -9 scenario: a kill repeats what the victim had handled and not
        # deleted, and its calls under way; the steady worker's calls are never repeated.
        max_duplicates=size.kills * repeats_per_kill(shards),
        repeats_only_after_kills=True,
        max_repeats_per_kill=repeats_per_kill(shards),
    )
    # Both workers handled rows, the steady one too (the victim's restarts alone would give
    # several processes), and some shard was handled by both: the per-shard lock kept them
    # apart (no overlaps).
    async with engine.connect() as conn:
        handled = (
            await conn.execute(
                text(
                    "SELECT DISTINCT pid, shard_scope, shard_identifier FROM fault_calls "
                    "WHERE outbox_table = :t AND outcome = 'ok'"
                ),
                {"t": scenario.table},
            )
        ).all()
    assert len(steady.pids) == 1, "the steady worker was restarted"
    handled_by: dict[str, set[Shard]] = {steady.name: set(), victim.name: set()}
    owner = {pid: worker.name for worker in (steady, victim) for pid in worker.pids}
    for pid, scope, shard in handled:
        assert pid in owner, f"a call of process {pid}, which is neither worker"
        handled_by[owner[pid]].add((scope, shard))
    assert handled_by[steady.name], "the steady worker handled no row"
    assert handled_by[victim.name], "the killed worker handled no row"
    assert handled_by[steady.name] & handled_by[victim.name], "no shard was handled by both workers"


@dataclass(frozen=True)
class Backlog:
    rows: int  # kept waiting before each start
    kills: int
    shards: int


async def calls_of(engine, table: str, pid: int) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            text("SELECT count(*) FROM fault_calls WHERE outbox_table = :t AND pid = :p"),
            {"t": table, "p": pid},
        )
        return int(result.scalar_one())


@pytest.mark.parametrize(
    "size",
    variants(
        Backlog(rows=1_000, kills=1, shards=30),
        Backlog(rows=20_000, kills=10, shards=200),
    ),
)
async def test_kill_9_mid_drain_of_a_backlog_repeats_few_groups_per_kill(
    size: Backlog, new_scenario, engine, fault_client, record_figures
) -> None:
    """What one ``kill -9`` costs at full speed: a backlog of distinct groups drained as fast as
    the handlers go, nothing failing, the worker killed mid-drain again and again. A kill
    repeats the groups handled and not deleted yet (at most ``max_undeleted_groups`` across the
    worker's drains, by default its calls at once) and the calls under way."""
    scenario = new_scenario("kill -9 mid-drain of a backlog")
    await scenario.prepare()
    # Few rows coalesce: nearly every row is a group of its own, handled by its own call.
    shards = mixed_shards(size.shards)
    workload = scenario.workload(shards, seed=size.rows + 6, objects=10_000)
    worker = scenario.worker(**COUNTED_WORKER)
    moments = random.Random(size.kills + 6)
    for _ in range(size.kills):
        await workload.write(size.rows - await outbox_count(engine, scenario.table))
        worker.start()
        await worker.ready()
        # Mid-drain: this process has handled a part of the backlog, chosen at random (a
        # part, not a time: however fast the drain, the kill comes while rows remain).
        await wait_until(
            partial(calls_over, engine, scenario.table, worker.pid, kill_after(size, moments)),
            timeout=120,
            interval=0.02,
            what="the drain under way",
        )
        assert await outbox_count(engine, scenario.table), "the backlog was drained before the kill"
        worker.kill()
        scenario.clock.fault()
    worker.start()
    await worker.ready()
    recovery = await scenario.drained(timeout=900)
    await scenario.finish(
        workload,
        faults=f"{worker.kills} kill -9 mid-drain; repeats per kill: {{per_kill}}; calls at "
        "once in the last second before each kill: {at_kill}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        max_duplicates=size.kills * repeats_per_kill(shards),
        repeats_only_after_kills=True,
        max_repeats_per_kill=repeats_per_kill(shards),
    )


def kill_after(size: Backlog, moments: random.Random) -> int:
    """Calls of a worker after which it is killed: between a tenth and half of the backlog."""
    return max(200, round(size.rows * moments.uniform(0.1, 0.5)))


async def calls_over(engine, table: str, pid: int, count: int) -> bool:
    return await calls_of(engine, table, pid) >= count


async def drains_by_worker(client: Client, table: str) -> dict[int, int]:
    """The partition drains of ``table`` that run now, counted by worker process id."""
    partitions = OutboxSettings.model_fields["partitions"].default
    running: dict[int, int] = {}
    for partition in range(partitions):
        handle = client.get_workflow_handle(f"outbox:{table}:partition:{partition}")
        for pending in (await handle.describe()).raw_description.pending_activities:
            if pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
                pid = int(pending.last_worker_identity.split("@")[0])
                running[pid] = running.get(pid, 0) + 1
    return running


async def spread_over(
    client: Client, table: str, workers: list[WorkerProcess], *, balanced: bool = True
) -> bool:
    """Whether every partition's drain runs, in ``workers`` only, and (``balanced``) each
    runs one at least and none two more than another."""
    running = await drains_by_worker(client, table)
    counts = [running.get(worker.pid, 0) for worker in workers]
    partitions = OutboxSettings.model_fields["partitions"].default
    if sum(counts) != partitions:
        return False
    return not balanced or (min(counts) >= 1 and max(counts) - min(counts) <= 1)


# Longer than any wait below for a graceful handover: a drain handed on after the heartbeat
# timeout (as a killed worker's is) would fail the wait.
SPREAD_HEARTBEAT_TIMEOUT = 60


@pytest.mark.parametrize(
    "size",
    variants(
        Size(rows=1_000, kills=0, shards=30),
        Size(rows=12_000, kills=3, shards=150),
        # Three worker processes take a minute and more on a loaded machine: with the full
        # suite. The default suite sees drains spread by the bench's workers smoke test.
        fast_by_default=False,
    ),
)
async def test_workers_that_join_share_the_partitions_and_those_that_leave_hand_them_on(
    size: Size, new_scenario, fault_client, record_figures
) -> None:
    """One worker, then a second and a third join mid-drain: the partitions' drains spread
    over them (none runs two more than another) without any setting changed. One stops
    gracefully: its drains go to the others at once, well before the heartbeat timeout. One is
    killed (as many times as the size says) and comes back. Nothing is lost, order holds, no
    two calls of a shard overlap, and only the kills repeat calls."""
    scenario = new_scenario("workers joining and leaving")
    await scenario.prepare(failure_rate=0.05)
    shards = mixed_shards(size.shards)
    workload = scenario.workload(shards, seed=size.rows + 2)
    settings = {
        **COUNTED_WORKER,
        "OUTBOX_HEARTBEAT_TIMEOUT": str(SPREAD_HEARTBEAT_TIMEOUT),
        # Three workers beside the other scenarios on one PostgreSQL: fewer connections each
        # (a killed worker's stay open until the server notices).
        "OUTBOX_DATABASE_POOL_SIZE": "10",
    }
    first, second, third = (scenario.worker(name, **settings) for name in ("1st", "2nd", "3rd"))
    per_step = size.rows // (4 + size.kills)
    table = scenario.table

    async def spread(*workers: WorkerProcess, timeout: float = 90, balanced: bool = True) -> None:
        names = ", ".join(worker.name for worker in workers)
        await wait_until(
            partial(spread_over, fault_client, table, list(workers), balanced=balanced),
            timeout=timeout,
            interval=0.5,
            what=f"the partitions' drains {'spread over' if balanced else 'running in'} {names}",
        )

    first.start()
    await first.ready()
    await workload.write(per_step)
    second.start()
    await second.ready()
    await workload.write(per_step)
    await spread(first, second)
    third.start()
    await third.ready()
    await workload.write(per_step)
    await spread(first, second, third)
    # A graceful stop mid-drain: its drains end at once and the others take them, within
    # a wait shorter than the heartbeat timeout.
    await workload.write(per_step)
    stopped = time.monotonic()
    second.terminate()
    await spread(first, third, timeout=SPREAD_HEARTBEAT_TIMEOUT / 2, balanced=False)
    handed_on = time.monotonic() - stopped
    await spread(first, third)
    assert await second.stop() == 0
    for _ in range(size.kills):
        await workload.write(per_step)
        await asyncio.sleep(1.0)
        third.kill()
        scenario.clock.fault()
        third.start()
        await third.ready()
        await spread(first, third, timeout=SPREAD_HEARTBEAT_TIMEOUT * 3)
    await workload.write(size.rows - workload.committed)
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"2 workers joined a first, 1 stopped (its drains running elsewhere "
        f"{handed_on:.1f} s after its SIGTERM), {third.kills} kill -9 of another; repeats per "
        "kill: {per_kill}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        max_duplicates=size.kills * repeats_per_kill(shards),
        repeats_only_after_kills=True,
        max_repeats_per_kill=repeats_per_kill(shards),
    )
