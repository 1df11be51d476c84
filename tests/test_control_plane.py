"""What someone with access to the Temporal namespace can do to a running outbox, against the
real worker, PostgreSQL and Temporal dev server: a forged ``reconfigure`` out of bounds is
refused and shown, one within bounds lasts until the next sweep, forged shard signals change
nothing, and the sender Temporal recorded is kept beside the declared ``by``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from outbox_bridge.workflows.models import (
    PartitionOptions,
    PartitionRef,
    PartitionStatus,
    PauseChange,
    PausesView,
    ResumeInput,
    ShardState,
    ShardStatus,
    SkipInput,
)
from tests.harness import (
    Category,
    Servers,
    fast_settings,
    fresh_app,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli
from tests.workflows.doubles import current_details

PARTITIONS = 2
# The command line's tables, one line a row.
WIDE = {"COLUMNS": "400"}
# Within bounds, and as harmful as bounds allow: one shard a round, a day between scans.
HARMFUL = PartitionOptions(
    round_seconds=3600,
    max_shards=1,
    max_groups=1,
    max_rounds=1,
    poll_interval_seconds=86_400,
    rescan_interval_seconds=86_400,
)


async def as_someone(servers: Servers, identity: str) -> Client:
    """A client of the namespace that says it is ``identity``."""
    return await Client.connect(servers.temporal_address, identity=identity)


async def partition_status(handle: WorkflowHandle[Any, Any]) -> PartitionStatus:
    status: PartitionStatus = await handle.query("status", result_type=PartitionStatus)
    return status


async def shard_status(handle: WorkflowHandle[Any, Any]) -> ShardStatus:
    status: ShardStatus = await handle.query("status", result_type=ShardStatus)
    return status


def rows(count: int, category: Category = Category.ORGANIZATION_UPDATE) -> list[dict[str, Any]]:
    return [
        {"category": category, "shard_identifier": n % 20, "object_identifier": n}
        for n in range(count)
    ]


async def test_a_forged_reconfigure_is_refused_or_lasts_one_sweep(servers, engine) -> None:
    recorder, table, app = await fresh_app(engine)
    settings = fast_settings(partitions=PARTITIONS, sweep_interval=1.0)
    mallory = await as_someone(servers, "mallory")
    async with running_worker(servers, app, settings):
        wanted = settings.partition_options()
        handles = [
            mallory.get_workflow_handle(PartitionRef(table, n, PARTITIONS).workflow_id)
            for n in range(PARTITIONS)
        ]

        async def on(options: PartitionOptions) -> bool:
            try:
                statuses = [await partition_status(handle) for handle in handles]
            except Exception:  # not started yet
                return False
            return all(status.options == options for status in statuses)

        await wait_until(lambda: on(wanted), what="the partitions on the worker's options")
        # Out of bounds: refused, shown, nothing applied.
        for handle in handles:
            await handle.signal("reconfigure", {"max_shards": 0})

        async def refused() -> bool:
            statuses = [await partition_status(handle) for handle in handles]
            return all(s.refused is not None and s.refused.count == 1 for s in statuses)

        await wait_until(refused, what="the refusals")
        status = await partition_status(handles[0])
        assert status.refused is not None and status.refused.last is not None
        assert "reconfigure at " in status.refused.last
        assert "max_shards 0 is outside 1..10,000" in status.refused.last
        assert status.options == wanted
        # Within bounds but harmful: taken, then undone by the next sweep.
        for handle in handles:
            await handle.signal("reconfigure", HARMFUL)
        await wait_until(lambda: reasserted(handles), what="the worker's options reasserted")
        await wait_until(lambda: on(wanted), what="the partitions on the worker's options again")
        # Rows written after the forged signal are all handled.
        await write_rows(engine, app, rows(200))
        await wait_until(lambda: table_empty(engine, app), timeout=60, what="200 rows handled")
    assert len(recorder.calls) == 200


async def reasserted(handles: list[WorkflowHandle[Any, Any]]) -> bool:
    """Each partition's history shows the forged options followed by the worker's."""
    for handle in handles:
        signals = [
            event.workflow_execution_signaled_event_attributes
            async for event in handle.fetch_history_events()
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        ]
        senders = [s.identity for s in signals if s.signal_name == "reconfigure"]
        if "mallory" not in senders:
            return False
        last_forged = len(senders) - 1 - senders[::-1].index("mallory")
        if not any(who != "mallory" for who in senders[last_forged + 1 :]):
            return False
    return True


async def test_forged_shard_signals_change_nothing_and_skips_name_their_sender(
    servers, engine
) -> None:
    recorder, table, app = await fresh_app(engine)
    fixed = recorder.fail_until_fixed(Category.PROJECT_UPDATE)
    mallory = await as_someone(servers, "mallory")
    carol = await as_someone(servers, "carol-laptop")
    async with running_worker(servers, app, fast_settings()):
        await write_rows(
            engine,
            app,
            [{"category": Category.PROJECT_UPDATE, "shard_identifier": 8, "object_identifier": 1}],
        )
        shard = mallory.get_workflow_handle(f"outbox:{app.table().name}:ORGANIZATION:8")

        async def blocked() -> bool:
            try:
                return (await shard_status(shard)).state == ShardState.BLOCKED
            except Exception:  # no workflow yet
                return False

        await wait_until(blocked, what="the shard blocked in its own workflow")
        await shard.signal("handover", {"max_id": -5, "held_for": "failed"})
        await shard.signal("skip", {"reason": "x" * 1001, "by": "mallory"})
        await shard.signal("notify", "everything")

        async def refused() -> bool:
            status = await shard_status(shard)
            return status.refused is not None and status.refused.count == 3

        await wait_until(refused, what="three refusals")
        status = await shard_status(shard)
        assert status.state == ShardState.BLOCKED and status.skip is None
        # A skip by update, declared by dave, sent by carol-laptop.
        skipped = await carol.get_workflow_handle(shard.id).execute_update(
            "skip", SkipInput(reason="replica down", by="dave"), result_type=ShardStatus
        )
        assert skipped.skip is not None and skipped.skip.by == "dave"

        async def sender_known() -> bool:
            skip = (await shard_status(shard)).skip
            return skip is not None and skip.via is not None

        await wait_until(sender_known, what="the skip's sender")
        skip = (await shard_status(shard)).skip
        assert skip is not None and skip.via == "temporal:carol-laptop"
        assert skip.who == "dave (via temporal:carol-laptop)"
        # Resumed, and skipped again by signal: the signal's sender, whatever `by` says.
        await carol.get_workflow_handle(shard.id).execute_update(
            "resume", ResumeInput(by="dave"), result_type=ShardStatus
        )
        await mallory.get_workflow_handle(shard.id).signal(
            "skip", SkipInput(reason="looks odd", by="carol")
        )

        async def skipped_by_signal() -> bool:
            skip = (await shard_status(shard)).skip
            return skip is not None and skip.reason == "looks odd" and skip.via is not None

        await wait_until(skipped_by_signal, what="the signal's sender")
        skip = (await shard_status(shard)).skip
        assert skip is not None and (skip.by, skip.via) == ("carol", "temporal:mallory")
        code, out, err = await cli(servers, table, "status", "ORGANIZATION:8", env=WIDE)
        assert code == 0, err
        assert "by carol (via temporal:mallory) at " in out
        assert "Refused 3 signals; last: notify at " in out
        fixed.set()
        await carol.get_workflow_handle(shard.id).execute_update(
            "resume", ResumeInput(by="carol"), result_type=ShardStatus
        )
        await wait_until(lambda: table_empty(engine, app), what="the shard drained")


async def test_a_pause_by_update_records_its_sender_beside_by(servers, engine) -> None:
    _, table, app = await fresh_app(engine)
    ann = await as_someone(servers, "ann-laptop")
    async with running_worker(servers, app, fast_settings()):
        control = ann.get_workflow_handle(f"outbox:{table}:control")

        async def running() -> bool:
            try:
                await control.describe()
            except Exception:
                return False
            return True

        await wait_until(running, what="the control workflow")
        view = await control.execute_update(
            "pause",
            PauseChange(category="PROJECT_UPDATE", reason="search is down", by="bob"),
            result_type=PausesView,
        )
        [pause] = view.pauses
        assert (pause.paused_by, pause.paused_via) == ("bob", "temporal:ann-laptop")
        async with engine.connect() as conn:
            stored = (
                await conn.execute(
                    text(
                        f"SELECT paused_by, paused_via, paused_role, session_user FROM {table}_pauses"
                    )
                )
            ).one()
        assert tuple(stored) == (
            "bob",
            "temporal:ann-laptop",
            stored.session_user,
            stored.session_user,
        )
        code, out, err = await cli(servers, table, "pauses", env=WIDE)
        assert code == 0, err
        [row] = [line for line in out.splitlines() if "PROJECT_UPDATE" in line]
        # by, the role PostgreSQL authenticated (the worker's, which wrote the row), via
        assert [cell.strip() for cell in row.split("│")[5:8]] == [
            "bob",
            stored.session_user,
            "temporal:ann-laptop",
        ]
        assert "**Paused** category PROJECT_UPDATE (2) by bob (via temporal:ann-laptop)" in (
            await current_details(control)
        )
        # A forged view of the pauses is refused; the pause stays shown.
        await control.signal("refresh", {"pauses": "nothing"})

        async def refused() -> bool:
            return "**Refused 1 signal; last: refresh at " in await current_details(control)

        await wait_until(refused, what="the refused refresh shown")
        assert "by bob (via temporal:ann-laptop)" in await current_details(control)
