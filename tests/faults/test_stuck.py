"""Shards that get stuck: a handler that hangs past its timeout, shard workflows that Temporal
loses (terminated, reset, or the whole namespace's data gone), and a poison row that blocks
its shard for the whole run (the design contract, section 1 and invariants 4 and 5:
docs/explanation/contract.md)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import pytest
from sqlalchemy import text
from temporalio.service import RPCError

from tests.faults.fault_app import ERROR_CANARY, FaultCategory, FaultScope
from tests.faults.harness import (
    calls_of_shard,
    clean_env,
    command,
    histories_containing,
    outbox_count,
    temporal_command,
    wipe_temporal,
)
from tests.faults.history import set_control
from tests.faults.scenario import variants
from tests.faults.test_crashes import mixed_shards
from tests.harness import wait_until

ORG, USER = int(FaultScope.ORGANIZATION), int(FaultScope.USER)


@dataclass(frozen=True)
class Size:
    rows: int
    shards: int
    hangs: int = 0


def workflow_id(table: str, scope: int, shard: int) -> str:
    return f"outbox:{table}:{FaultScope(scope).name}:{shard}"


async def failed_at_least(engine, table: str, shard: int, times: int) -> bool:
    outcomes = await calls_of_shard(engine, table, shard)
    return outcomes.count("failed") >= times


@pytest.mark.parametrize(
    "size",
    variants(Size(rows=200, shards=8, hangs=1), Size(rows=3_000, shards=40, hangs=4)),
)
async def test_a_handler_that_hangs_past_its_timeout_never_overlaps_its_retry(
    size: Size, new_scenario, engine, fault_client, record_figures
) -> None:
    scenario = new_scenario("handler hangs")
    # Each hanging object has a row in an organization (a plain-def handler: its thread
    # cannot be interrupted, so the stale attempt runs on) and one in a user shard (an
    # async handler: cancelled when its attempt times out).
    hanging = [900 + n for n in range(size.hangs)]
    await scenario.prepare(hang_objects=[*hanging, *(h + 50 for h in hanging)], hang_seconds=5.0)
    workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 4)
    worker = scenario.worker(OUTBOX_HANDLER_TIMEOUT="2")
    worker.start()
    await worker.ready()
    await workload.write(size.rows // 2)
    for n, obj in enumerate(hanging):
        await workload.write_exact(
            [
                (ORG, 1000 + 3 * n, int(FaultCategory.PROJECT_UPDATE), obj),
                (USER, 1002 + 3 * n, int(FaultCategory.USER_UPDATE), obj + 50),
            ]
        )
    await workload.write(size.rows - workload.committed)
    scenario.clock.fault()
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"{2 * size.hangs} handler calls hung 5 s (timeout 2 s)",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # A timed-out attempt keeps the shard lock until its hung call returns, and deletes
        # what its round handled on its way out, so we expect no repeat; the timeout allows
        # one per hanging plain-def call, which returns ok after its attempt was given up.
        # (An async call is cancelled: its retry repeats no successful call.)
        max_duplicates=size.hangs,
    )
    async with engine.connect() as conn:
        hung = (
            await conn.execute(
                text(
                    "SELECT handler, outcome FROM fault_calls WHERE outbox_table = :t "
                    "AND finished - started >= 2"
                ),
                {"t": scenario.table},
            )
        ).all()
    # The plain-def calls ran to their end; the async ones were cancelled at the timeout.
    assert sorted(hung) == sorted(
        [("sync", "ok")] * size.hangs + [("async", "cancelled")] * size.hangs
    )


# A blocked shard's head call that hangs this long (past the handler timeout of 2 s).
HANG_SECONDS = 8.0
HANGING_OBJECT = 900


@pytest.mark.parametrize("size", variants(Size(rows=200, shards=8), Size(rows=3_000, shards=40)))
async def test_a_plain_def_call_that_outlives_its_attempt_never_overlaps_its_retry_elsewhere(
    size: Size, new_scenario, engine, fault_client, record_figures
) -> None:
    """Two workers. A blocked shard's head is retried by its category activity; one attempt's
    plain-def call hangs past the handler timeout (its thread cannot be stopped), and its
    worker is stopped meanwhile, as in a rolling deploy: the retries run in the other worker
    while the stale call still runs. Nothing but the shard's lock keeps them apart; the calls
    of the shard must still run one at a time (invariant 5)."""
    scenario = new_scenario("plain-def call outlives its attempt")
    blocked = 1
    await scenario.prepare(poison_shards=[blocked], hang_seconds=HANG_SECONDS)
    workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 7)
    workers = [scenario.worker(name, OUTBOX_HANDLER_TIMEOUT="2") for name in ("one", "two")]
    for worker in workers:
        worker.start()
        await worker.ready()
    await workload.write(size.rows // 2)
    project = int(FaultCategory.PROJECT_UPDATE)
    await workload.write_exact(
        [(ORG, blocked, project, HANGING_OBJECT), (ORG, blocked, project, HANGING_OBJECT + 1)]
    )
    await wait_until(
        partial(failed_at_least, engine, scenario.table, blocked, 2),
        timeout=120,
        what=f"shard {blocked} blocked",
    )
    await set_control(engine, scenario.table, hang_objects=[HANGING_OBJECT])
    stale, other = await scenario.hung_worker()
    stale.terminate()  # it polls no further task, and exits once the hung call has returned
    scenario.clock.fault()
    await workload.write(size.rows - workload.committed)
    assert await stale.stop() == 0, stale.output()[-5000:]
    await set_control(engine, scenario.table, poison_shards=[])
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults=f"a plain-def call hung {HANG_SECONDS:g} s (timeout 2 s) while its worker "
        "stopped; {failed:,} failures of the blocked head",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # The stopped worker deletes what it handled before it exits, and the hung call
        # failed: nothing can be repeated.
        max_duplicates=0,
    )
    async with engine.connect() as conn:
        calls = (
            await conn.execute(
                text(
                    "SELECT pid, outcome, finished - started AS seconds FROM fault_calls "
                    "WHERE outbox_table = :t AND shard_identifier = :s ORDER BY seq"
                ),
                {"t": scenario.table, "s": blocked},
            )
        ).all()
    # The stale call ran to its end (its worker waited for it), and the other worker handled
    # the shard in the end.
    assert [(c.pid, c.outcome) for c in calls if c.seconds >= HANG_SECONDS] == [
        (stale.pid, "failed")
    ]
    assert any(c.pid == other.pid and c.outcome == "ok" for c in calls)


async def reset_to_first_task(address: str, workflow: str) -> None:
    """``temporal workflow reset`` to the first workflow task, as an operator would: again
    while the server answers that the workflow is busy (a workflow task is running)."""

    async def reset() -> bool:
        try:
            await temporal_command(
                address,
                "workflow",
                "reset",
                "--workflow-id",
                workflow,
                "--type",
                "FirstWorkflowTask",
                "--reason",
                "reset by an operator",
                "--yes",
            )
        except AssertionError as exc:
            if "Workflow is busy" in str(exc):
                return False
            raise
        return True

    await wait_until(reset, timeout=60, interval=0.2, what=f"the reset of {workflow}")


@pytest.mark.parametrize(
    "size",
    variants(Size(rows=300, shards=10), Size(rows=4_000, shards=60)),
)
async def test_lost_shard_workflows_are_restored_from_the_table(
    size: Size, new_scenario, engine, fault_temporal, fault_client, record_figures
) -> None:
    """A shard workflow terminated, another reset, then every workflow lost with the dev
    server's database file: the bridge restores processing from the table."""
    scenario = new_scenario("workflows lost")
    poison = {1: ORG, 2: ORG, 3: USER}  # blocked, so that their workflows live on
    await scenario.prepare(poison_shards=list(poison))
    workload = scenario.workload(mixed_shards(size.shards), seed=size.rows + 5)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    poisoned = [(scope, shard) for shard, scope in poison.items()]
    await workload.write(size.rows // 3, shards=[*mixed_shards(size.shards), *poisoned])
    for shard in poison:
        await wait_until(
            partial(failed_at_least, engine, scenario.table, shard, 2),
            timeout=120,
            what=f"shard {shard} blocked",
        )
    # Terminated by hand.
    await fault_client.get_workflow_handle(workflow_id(scenario.table, ORG, 1)).terminate(
        reason="terminated by an operator"
    )
    # Reset to its first workflow task: its activities run again.
    await reset_to_first_task(fault_temporal.address, workflow_id(scenario.table, ORG, 2))
    scenario.clock.fault()
    await workload.write(size.rows // 3, shards=[*mixed_shards(size.shards), *poisoned])
    # Every workflow lost: the dev server's data is gone.
    lost = fault_client.get_workflow_handle(workflow_id(scenario.table, USER, 3))
    run_id = (await lost.describe()).run_id
    await wipe_temporal(fault_temporal)
    scenario.clock.fault()
    with pytest.raises(RPCError, match="not found"):
        await fault_client.get_workflow_handle(lost.id, run_id=run_id).describe()
    await set_control(engine, scenario.table, poison_shards=[])
    await workload.write(size.rows - workload.committed)
    recovery = await scenario.drained(timeout=600)
    await scenario.finish(
        workload,
        faults="1 terminate, 1 reset, 1 namespace wiped",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # The terminate and the reset cancel attempts of poison shards, whose calls fail, and
        # the wipe cancels drains, which delete what they handled on their way out; category
        # activities run only in the poison shards, whose calls fail until the wipe is over.
        # Nothing can be repeated.
        max_duplicates=0,
    )


@pytest.mark.parametrize(
    "size",
    variants(Size(rows=0, shards=20), Size(rows=0, shards=1_000)),
)
async def test_a_poison_row_blocks_one_shard_while_the_others_drain(
    size: Size, new_scenario, engine, fault_temporal, fault_client, record_figures
) -> None:
    scenario = new_scenario("poison row")
    poison = 1
    await scenario.prepare(poison_shards=[poison])
    others = [(ORG if n % 2 else USER, 10_000 + n) for n in range(size.shards)]
    workload = scenario.workload(others, seed=size.shards, rollback_share=0.02)
    worker = scenario.worker()
    worker.start()
    await worker.ready()
    poison_rows = [
        (ORG, poison, int(FaultCategory.PROJECT_UPDATE), 1),
        (ORG, poison, int(FaultCategory.ORGANIZATION_UPDATE), 2),
        (ORG, poison, int(FaultCategory.PROJECT_UPDATE), 1),
    ]
    await workload.write_exact(poison_rows)
    scenario.clock.fault()
    await workload.write(3 * size.shards)
    # Every other shard drains while the poison shard stays blocked with all its rows.
    await scenario.drained(timeout=600, left=len(poison_rows))
    assert await outbox_count(engine, scenario.table) == len(poison_rows)
    outcomes = await calls_of_shard(engine, scenario.table, poison)
    assert outcomes and set(outcomes) == {"failed"}

    env = clean_env(
        OUTBOX_APP="tests.faults.fault_app:app",
        FAULT_OUTBOX_TABLE=scenario.table,
        OUTBOX_DATABASE_URL=scenario.database_url,
        TEMPORAL_ADDRESS=fault_temporal.address,
    )
    status = await command(env, "status", f"ORGANIZATION:{poison}")
    assert "blocked" in status and "PoisonError" in status, status
    reason = "skip-reason-marker poison row under investigation"
    skipped = await command(env, "skip", f"ORGANIZATION:{poison}", "--reason", reason)
    assert "skipped" in skipped
    handle = fault_client.get_workflow_handle(workflow_id(scenario.table, ORG, poison))

    async def no_pending_activity() -> bool:
        return not (await handle.describe()).raw_description.pending_activities

    await wait_until(no_pending_activity, timeout=60, what="the retrying attempt cancelled")
    failures = len(await calls_of_shard(engine, scenario.table, poison))
    await asyncio.sleep(3)  # three times the maximum retry interval: a skipped shard stays put
    assert len(await calls_of_shard(engine, scenario.table, poison)) == failures
    status = await command(env, "status", f"ORGANIZATION:{poison}")
    assert "skipped" in status and "poison row under investigation" in status, status
    assert scenario.password not in status

    await set_control(engine, scenario.table, poison_shards=[])  # the fix is deployed
    await command(env, "resume", f"ORGANIZATION:{poison}")
    recovery = await scenario.drained(timeout=120)
    # Each coalescing group of the poison shard was delivered once.
    outcomes = await calls_of_shard(engine, scenario.table, poison)
    assert outcomes.count("ok") == 2 and outcomes[-2:] == ["ok", "ok"]
    await scenario.finish(
        workload,
        faults=f"1 poison shard, {{failed:,}} failures, skip + resume; {size.shards:,} shards",
        recovery=recovery,
        client=fault_client,
        record=record_figures,
        # No crash, restart or timeout: the skip cancels only the attempt of the poison
        # shard, whose calls fail. Nothing can be repeated.
        max_duplicates=0,
    )
    # The history scanner sees what does reach history: the skip reason, and (errors are not
    # redacted here) the handler's error message.
    found = await histories_containing(fault_client, ["skip-reason-marker", ERROR_CANARY])
    assert found["skip-reason-marker"] and found[ERROR_CANARY]
