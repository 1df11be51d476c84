"""Handover races: a shard changing hands between the partitions that drain the healthy shards
and the shard's own OutboxShard workflow, while rows keep arriving, and faults at the moment it
changes hands (the design contract, section 4 and invariants 1, 2, 4 and 5:
docs/explanation/contract.md).

- a handler fails while new rows for its shard keep arriving (the partition hands the shard
  over, the workflow retries its head, drains what came meanwhile and gives it back);
- an operator skips a shard (``outbox-bridge skip``) while a partition is in the middle of it;
- a flush (``outbox-bridge flush``) of a shard that a partition is draining;
- the shard's own workflow terminated by hand while it holds the shard (the sweep restarts it);
- ``kill -9`` of the worker while many failing groups are being handed over.

Each checks, besides the history: every row handled in the end, and nobody stuck (every shard given back, no shard
workflow left running).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge.runtime.shards import parse_shard, shard_status
from tests.faults.fault_app import FaultCategory, FaultScope, make_app
from tests.faults.harness import calls_of_shard, command, temporal_command
from tests.faults.history import Shard, Workload, set_control
from tests.faults.scenario import COUNTED_WORKER, repeats_per_kill, variants
from tests.faults.test_crashes import mixed_shards
from tests.faults.test_stuck import failed_at_least
from tests.harness import wait_until

ORG = int(FaultScope.ORGANIZATION)
PROJECT = int(FaultCategory.PROJECT_UPDATE)


def shard_name(shard: int) -> str:
    return f"ORGANIZATION:{shard}"


def workflow_id(table: str, shard: int) -> str:
    return f"outbox:{table}:ORGANIZATION:{shard}"


async def keep_writing(
    workload: Workload,
    rows: int,
    *,
    shards: Sequence[Shard] | None = None,
    pause: float = 0.02,
) -> None:
    """Commit ``rows`` rows in transactions of the workload's size, a short pause apart: rows
    keep arriving while the test injects its faults. (One writer at a time: the history check
    relies on ids committing in order.)"""
    target = workload.committed + rows
    while workload.committed < target:
        await workload.write(min(workload.batch, target - workload.committed), shards=shards)
        await asyncio.sleep(pause)


async def write_groups(workload: Workload, shard: int, count: int, first_object: int = 0) -> None:
    """``count`` rows in ``shard``, each its own coalescing group (a drain takes a while)."""
    for start in range(first_object, first_object + count, 50):
        end = min(start + 50, first_object + count)
        await workload.write_exact([(ORG, shard, PROJECT, obj) for obj in range(start, end)])


async def ok_calls(engine, table: str, shard: int) -> int:
    return (await calls_of_shard(engine, table, shard)).count("ok")


async def pending_rows(engine, table: str, shard: int, up_to: int | None = None) -> int:
    condition = "" if up_to is None else " AND id <= :up_to"
    async with engine.connect() as conn:
        result = await conn.execute(
            text(
                f"SELECT count(*) FROM {table} WHERE shard_scope = :scope "
                f"AND shard_identifier = :shard{condition}"
            ),
            {"scope": ORG, "shard": shard, "up_to": up_to},
        )
        return int(result.scalar_one())


async def in_the_middle(engine, table: str, shard: int, done: int = 10) -> None:
    """Wait until ``shard`` is being drained: ``done`` groups handled, rows left."""

    async def middle() -> bool:
        return await ok_calls(engine, table, shard) >= done

    await wait_until(middle, timeout=120, interval=0.05, what=f"shard {shard} mid-drain")
    assert await pending_rows(engine, table, shard), f"shard {shard} drained too fast"


async def shard_workflow_runs(client: Client, task_queue: str) -> dict[str, int]:
    """OutboxShard runs of the task queue by status (Running, Completed, ...)."""
    counts: dict[str, int] = {}
    query = f"WorkflowType = 'OutboxShard' AND TaskQueue = '{task_queue}'"
    async for execution in client.list_workflows(query):
        name = execution.status.name if execution.status else "UNKNOWN"
        counts[name] = counts.get(name, 0) + 1
    return counts


# -- a handler fails while rows keep arriving -------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    rows: int
    shards: int
    flips: int  # times a third of the shards turn poison, then healthy again


@pytest.mark.parametrize(
    "size",
    variants(
        Traffic(rows=800, shards=12, flips=2),
        Traffic(rows=15_000, shards=60, flips=12),
    ),
)
async def test_a_handler_fails_while_rows_for_its_shard_keep_arriving(
    size: Traffic, new_scenario, engine, fault_client, record_figures
) -> None:
    scenario = new_scenario("handler fails, rows keep arriving")
    shards = mixed_shards(size.shards)
    await scenario.prepare(failure_rate=0.2)
    workload = scenario.workload(shards, seed=size.rows + 11)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    # A third of the shards fails every call for a while, now and then: blocked shards whose
    # rows keep coming, then a fix that lets them drain and be given back.
    flaky = [ident for _, ident in shards[::3]]
    stop = asyncio.Event()

    async def flip() -> None:
        for _ in range(size.flips):
            await set_control(engine, scenario.table, poison_shards=flaky)
            await asyncio.sleep(0.8)
            await set_control(engine, scenario.table, poison_shards=[])
            if stop.is_set():
                return
            await asyncio.sleep(0.8)

    flipping = asyncio.create_task(flip())
    await keep_writing(workload, size.rows)
    stop.set()
    await flipping
    await set_control(engine, scenario.table, failure_rate=0.0, poison_shards=[])
    scenario.clock.fault()
    recovery = await scenario.drained(timeout=600)
    verdict = await scenario.finish(
        workload,
        faults=f"{{failed:,}} handler failures, {size.flips} poison periods, rows arriving",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # No crash, restart or timeout: a failing head is handed over without repeating what
        # succeeded before it.
        max_duplicates=0,
    )
    assert verdict.failed_calls > 0
    runs = await shard_workflow_runs(fault_client, scenario.task_queue)
    # Failing shards were handed to their workflows, which gave them back once empty.
    assert runs.get("COMPLETED", 0) >= len(flaky), runs


# -- a skip while a partition is in the middle of the shard -----------------------------------


@dataclass(frozen=True)
class Skips:
    groups: int  # rows of each skipped shard, each its own group
    skipped: int  # shards skipped, one after the other
    others: int  # rows in other shards, drained meanwhile
    shards: int


@pytest.mark.parametrize(
    "size",
    variants(
        Skips(groups=150, skipped=1, others=300, shards=10),
        Skips(groups=600, skipped=4, others=4_000, shards=80),
    ),
)
async def test_a_skip_while_a_drain_is_in_the_middle_of_the_shard(
    size: Skips, new_scenario, engine, fault_client, record_figures
) -> None:
    """``outbox-bridge skip`` of a shard that is being drained (by a partition on demand: the
    command starts the shard's workflow with update-with-start). Once the command answers, no
    handler of the shard runs or starts; its rows stay until it is resumed."""
    scenario = new_scenario("skip mid-drain")
    skipped = [100 + n for n in range(size.skipped)]
    # Each call of a skipped shard takes 20 ms: a drain of it lasts seconds.
    await scenario.prepare(slow_shards=skipped, slow_seconds=0.02)
    workload = scenario.workload(mixed_shards(size.shards), seed=size.groups + 12)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    env = scenario.env()
    app = make_app(scenario.table)
    for shard in skipped:
        await write_groups(workload, shard, size.groups)
        await workload.write(size.others // size.skipped // 2)
        await in_the_middle(engine, scenario.table, shard)
        reason = f"skip of shard {shard} mid-drain"
        await command(env, "skip", shard_name(shard), "--reason", reason)
        answered = time.time()
        scenario.clock.fault()
        # Rows written while it is skipped are kept too.
        await write_groups(workload, shard, 20, first_object=size.groups)
        await workload.write(size.others // size.skipped // 2)
        await asyncio.sleep(1.5)
        async with engine.connect() as conn:
            late = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM fault_calls WHERE outbox_table = :t "
                        "AND shard_identifier = :s AND finished >= :at"
                    ),
                    {"t": scenario.table, "s": shard, "at": answered},
                )
            ).scalar_one()
        assert late == 0, f"{late} handler calls of shard {shard} ran after the skip answered"
        assert await pending_rows(engine, scenario.table, shard) >= 20
        status = await shard_status(fault_client, parse_shard(shard_name(shard), app))
        assert status.state == "skipped" and status.skip and status.skip.reason == reason
        await command(env, "resume", shard_name(shard))
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"{size.skipped} skip mid-drain + resume, {size.groups} groups each",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # A skip waits for the running group (a partition's round goes on to its end; a
        # shard workflow's drain is cancelled after the running handler): what they handled
        # is deleted, nothing is repeated.
        max_duplicates=0,
    )


# -- a flush of a shard that a partition is draining ------------------------------------------


@dataclass(frozen=True)
class Flushes:
    groups: int  # rows of each flushed shard, each its own group
    flushed: int  # shards flushed at once
    arriving: int  # rows written to the flushed shards while the flushes wait
    shards: int


@pytest.mark.parametrize(
    "size",
    variants(
        Flushes(groups=150, flushed=1, arriving=100, shards=10),
        Flushes(groups=800, flushed=4, arriving=1_000, shards=80),
    ),
)
async def test_a_flush_of_a_shard_that_a_drain_is_in_the_middle_of(
    size: Flushes, new_scenario, engine, fault_client, record_figures
) -> None:
    """``outbox-bridge flush`` of shards that are being drained (by a partition on demand: the
    flush starts the shard's workflow, which takes the shard over once the partition's round
    in it ends), while rows keep arriving in them: each flush answers ``handled``, and by then
    every row it waited for is gone."""
    scenario = new_scenario("flush mid-drain")
    flushed = [200 + n for n in range(size.flushed)]
    # Each call of a flushed shard takes 30 ms: its drain lasts seconds, longer than the flush
    # command takes to start.
    await scenario.prepare(slow_shards=flushed, slow_seconds=0.03)
    background = mixed_shards(size.shards)
    workload = scenario.workload(background, seed=size.groups + 13)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    for shard in flushed:
        await write_groups(workload, shard, size.groups)
    await workload.write(size.shards * 5)
    for shard in flushed:
        await in_the_middle(engine, scenario.table, shard)
    up_to = {}
    async with engine.connect() as conn:
        for shard in flushed:
            up_to[shard] = (
                await conn.execute(
                    text(
                        f"SELECT max(id) FROM {scenario.table} WHERE shard_scope = :scope "
                        "AND shard_identifier = :shard"
                    ),
                    {"scope": ORG, "shard": shard},
                )
            ).scalar_one()
    env = scenario.env()
    scenario.clock.fault()

    async def flush(shard: int) -> str:
        output = await command(
            env, "flush", shard_name(shard), "--timeout", "120", "--json", timeout=150
        )
        assert not await pending_rows(engine, scenario.table, shard, up_to[shard]), (
            f"the flush of shard {shard} answered while rows it waited for were pending"
        )
        return output

    flushing = [asyncio.create_task(flush(shard)) for shard in flushed]
    # Rows keep arriving in the flushed shards (after what the flushes wait for) and others.
    await keep_writing(
        workload,
        size.arriving,
        shards=[*background, *((ORG, shard) for shard in flushed)],
        pause=0.05,
    )
    for output in await asyncio.gather(*flushing):
        assert '"outcome": "handled"' in output, output
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"{size.flushed} flush mid-drain, {size.groups} groups each, rows arriving",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # The flush's workflow waits for the partition's round to end (the shard lock) and
        # then drains what is left: nothing is repeated.
        max_duplicates=0,
    )


# -- the owner workflow terminated by hand ----------------------------------------------------


@dataclass(frozen=True)
class Terminations:
    rows: int
    shards: int
    owners: int  # shards whose workflow is terminated, twice each


@pytest.mark.parametrize(
    "size",
    variants(
        Terminations(rows=400, shards=10, owners=2),
        Terminations(rows=6_000, shards=60, owners=8),
        fast_by_default=False,
    ),
)
async def test_a_shard_workflow_terminated_while_it_holds_the_shard_is_restarted(
    size: Terminations, new_scenario, engine, fault_temporal, fault_client, record_figures
) -> None:
    """The OutboxShard workflow of a shard that needs one is terminated by hand, twice: while
    its head fails (the partition handed it over), and while it drains the rows that came
    meanwhile. The active bridge's sweep starts it again from the table each time."""
    scenario = new_scenario("shard workflow terminated")
    owners = [300 + n for n in range(size.owners)]
    await scenario.prepare(poison_shards=owners, slow_shards=owners, slow_seconds=0.01)
    background = mixed_shards(size.shards)
    owned = [(ORG, shard) for shard in owners]
    workload = scenario.workload([*background, *owned], seed=size.rows + 14)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    await workload.write(size.rows // 4)
    for shard in owners:
        await wait_until(
            partial(failed_at_least, engine, scenario.table, shard, 2),
            timeout=120,
            what=f"shard {shard} blocked",
        )
    terminated = 0
    finished_by_drain: list[int] = []

    async def terminate(shards: Sequence[int], *, cli_first: bool) -> None:
        """Terminate the workflows of ``shards`` (every other one with the temporal command
        line), and wait until the sweep (every 3 s here) has started each again, or the drain
        the terminated run left under way has finished its shard's rows."""
        nonlocal terminated
        handles = [fault_client.get_workflow_handle(workflow_id(scenario.table, s)) for s in shards]
        runs = [(await handle.describe()).run_id for handle in handles]
        for n, handle in enumerate(handles):
            if (n % 2 == 0) == cli_first:
                await temporal_command(
                    fault_temporal.address,
                    "workflow",
                    "terminate",
                    "--workflow-id",
                    handle.id,
                    "--reason",
                    "terminated by an operator",
                )
            else:
                await handle.terminate(reason="terminated by an operator")
        terminated += len(handles)
        scenario.clock.fault()

        async def restarted() -> bool:
            back = 0
            for handle, run, shard in zip(handles, runs, shards, strict=True):
                if (await handle.describe()).run_id != run:
                    continue
                if not await needs_no_workflow(engine, scenario.table, shard):
                    return False
                back += 1
            finished_by_drain.append(back)
            return True

        await wait_until(restarted, timeout=60, interval=0.2, what="the workflows restarted")

    # Blocked: their heads fail, and rows keep arriving behind them.
    writing = asyncio.create_task(keep_writing(workload, size.rows // 4, pause=0.05))
    await terminate(owners, cli_first=True)
    await writing
    # Draining: the fix is deployed; each call takes 10 ms, so each workflow drains the rows
    # that came meanwhile for a few seconds.
    for shard in owners:
        await write_groups(workload, shard, 400, first_object=1000)
    await set_control(engine, scenario.table, poison_shards=[])
    for shard in owners:
        await in_the_middle(engine, scenario.table, shard, done=5)
    await terminate(owners, cli_first=False)
    await keep_writing(workload, size.rows - workload.committed, pause=0.01)
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=(
            f"{terminated} terminations of {size.owners} shard workflows (blocked, draining); "
            f"shards the drain under way finished: {sum(finished_by_drain)}"
        ),
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # A terminated workflow's running drain is abandoned: the worker may be cancelling it
        # (deleting what it handled) or not, and a group it handled but had not deleted yet is
        # handled again by the restarted workflow. At most one group per termination.
        max_duplicates=terminated,
    )


async def needs_no_workflow(engine: AsyncEngine, table: str, shard: int) -> bool:
    """Whether ORGANIZATION ``shard`` is free or has no rows: the sweep starts a workflow only
    for a held shard with rows. A terminated run's drain may still be under way in the worker
    and finish the shard's rows; the shard is then given back, or stays held until its next
    row, whose sweep starts its workflow."""
    async with engine.connect() as conn:
        found = await conn.execute(
            text(
                f"SELECT EXISTS (SELECT 1 FROM {table}_owners WHERE shard_scope = :scope "
                f"AND shard_identifier = :shard) AND EXISTS (SELECT 1 FROM {table} "
                "WHERE shard_scope = :scope AND shard_identifier = :shard)"
            ),
            {"scope": ORG, "shard": shard},
        )
        return not found.scalar_one()


# -- kill -9 during handovers -----------------------------------------------------------------


@dataclass(frozen=True)
class Kills:
    rows: int
    kills: int
    shards: int


KILL_MOMENTS = random.Random(15)


@pytest.mark.parametrize(
    "size",
    variants(
        Kills(rows=1_000, kills=1, shards=20),
        Kills(rows=15_000, kills=10, shards=120),
        fast_by_default=False,
    ),
)
async def test_kill_9_while_many_failing_groups_are_handed_over(
    size: Kills, new_scenario, engine, fault_client, record_figures
) -> None:
    """A third of the handler calls fail, so shards are handed over all the time (on
    demand), and the worker is killed with ``kill -9`` while it hands them over: signals
    sent or not, holds written or not, category activities running."""
    scenario = new_scenario("kill -9 during handovers")
    await scenario.prepare(failure_rate=0.3)
    shards = mixed_shards(size.shards)
    workload = scenario.workload(shards, seed=size.rows + 15)
    worker = scenario.worker(**COUNTED_WORKER)
    per_cycle = size.rows // (size.kills + 1)
    for _ in range(size.kills):
        worker.start()
        await worker.ready()
        await keep_writing(workload, per_cycle, pause=0.01)
        await asyncio.sleep(KILL_MOMENTS.uniform(0.0, 1.5))
        worker.kill()
        scenario.clock.fault()
    worker.start()
    await worker.ready()
    await keep_writing(workload, size.rows - workload.committed, pause=0.01)
    await set_control(engine, scenario.table, failure_rate=0.0)
    recovery = await scenario.drained(timeout=900)
    await scenario.finish(
        workload,
        faults=f"{worker.kills} kill -9, {{failed:,}} handler failures; repeats per kill: "
        "{per_kill}",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # A kill repeats what the worker had handled and not deleted, and its calls under way
        # (category activities among them).
        max_duplicates=size.kills * repeats_per_kill(shards),
        repeats_only_after_kills=True,
        max_repeats_per_kill=repeats_per_kill(shards),
    )
