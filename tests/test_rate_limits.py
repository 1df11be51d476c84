"""Rate limits per category shared by every worker: the declared ``rate_limit`` and its checks,
the token bucket in PostgreSQL, turns between shards, a real worker whose limited category
waits while the others drain, and a change at run time from the command line."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge import OutboxApp, OutboxTable, RegistryError
from outbox_bridge.db.limits import RateLimit, parse_rate, read_limits, set_limit, take_tokens
from outbox_bridge.db.schema import limits_of
from outbox_bridge.runtime.rate_limits import RateLimits, waiting_line
from outbox_bridge.workflows.models import PartitionRef, ShardRef
from tests.harness import (
    SCOPES,
    Category,
    Recorder,
    Servers,
    create_tables,
    fast_settings,
    running_worker,
    sql,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)
from tests.otel import metric_reader, points
from tests.test_cli_shards import cli

LIMITED = Category.ORGANIZATION_UPDATE


def limited_app(recorder: Recorder, rate: str | None = "50/s") -> OutboxApp:
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    app.handler(LIMITED, rate_limit=rate)(recorder.handle)
    app.handler(*(c for c in Category if c is not LIMITED))(recorder.handle)
    return app


def test_a_rate_is_calls_per_second_minute_or_hour() -> None:
    assert parse_rate("50/s") == RateLimit(50.0)
    assert parse_rate(" 300 / m ") == RateLimit(5.0)
    assert parse_rate("1000/H").per_second == pytest.approx(1000 / 3600)
    assert [str(parse_rate(text)) for text in ("50/s", "300/m", "1000/h", "0.5/s")] == [
        "50/s",
        "5/s",
        "1000/h",
        "30/m",
    ]


def test_the_waiting_line_says_how_long_the_last_calls_waited() -> None:
    assert waiting_line("SEARCH", 50.0, 3, []) == "SEARCH 50/s: 3 waiting"
    assert waiting_line("SEARCH", 50.0, 3, [0.0, 2.0, 0.4]) == (
        "SEARCH 50/s: 3 waiting; the last 3 calls waited 0.4 s at the median, 2.0 s at most"
    )
    assert waiting_line("SEARCH", 1 / 3600, 1, [12.0]).endswith(
        "1/h: 1 waiting; the last call waited 12.0 s at the median, 12.0 s at most"
    )


@pytest.mark.parametrize("bad", ["50", "50/d", "fast", "0/s", "-1/s", "1000000/s", 50, ""])
def test_a_bad_rate_is_refused_when_the_handler_is_registered(bad: Any) -> None:
    recorder = Recorder()
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    with pytest.raises(RegistryError, match=r"rate_limit .* (is not a rate|must be above 0)"):
        app.handler(LIMITED, rate_limit=bad)(recorder.handle)
    assert app.handler_for(LIMITED) is None and app.rate_limit(LIMITED) is None


async def _refill(engine: AsyncEngine, app: OutboxApp) -> None:
    """Make the bucket look untouched for an hour: it is full."""
    limits = limits_of(app.table(None)).name
    await sql(engine, f"UPDATE {limits} SET refilled_at = now() - interval '1 hour', tokens = 0")


async def _take(engine: AsyncEngine, app: OutboxApp, declared: float | None, want: int) -> Any:
    async with engine.begin() as conn:
        return await take_tokens(conn, app.table(None), int(LIMITED), declared, want)


async def test_the_bucket_refills_by_the_time_elapsed_up_to_one_second_of_its_rate(
    engine: AsyncEngine,
) -> None:
    app = limited_app(Recorder())
    await create_tables(engine, app)
    first = await _take(engine, app, 50.0, 1000)  # creates the bucket, empty
    assert first.per_second == 50.0 and first.tokens < 50
    await _refill(engine, app)
    assert (await _take(engine, app, 50.0, 1000)).tokens == 50  # a burst of one second
    await _refill(engine, app)
    assert (await _take(engine, app, 50.0, 10)).tokens == 10  # no more than asked
    assert (await _take(engine, app, 50.0, 1000)).tokens >= 40  # the rest stays in the bucket


async def test_a_rate_set_at_run_time_replaces_the_declared_one_until_turned_off(
    engine: AsyncEngine,
) -> None:
    app = limited_app(Recorder())
    await create_tables(engine, app)
    table = app.table(None)
    async with engine.begin() as conn:
        assert (await take_tokens(conn, table, int(LIMITED), None, 5)).per_second is None
        await set_limit(conn, table, int(LIMITED), parse_rate("10/s"), "ann")
    await _refill(engine, app)
    grant = await _take(engine, app, 50.0, 1000)
    assert (grant.tokens, grant.per_second) == (10, 10.0)
    async with engine.begin() as conn:
        await set_limit(conn, table, int(LIMITED), None, "bob")
        [record] = await read_limits(conn, table)
    assert (record.per_second, record.set_by) == (None, "bob")
    assert record.set_role and record.set_at is not None  # as PostgreSQL authenticated it
    await _refill(engine, app)
    assert (await _take(engine, app, 50.0, 1000)).tokens == 50


async def test_concurrent_takes_never_hand_out_more_than_the_bucket_held(
    engine: AsyncEngine,
) -> None:
    app = limited_app(Recorder())
    await create_tables(engine, app)
    await _take(engine, app, 50.0, 1)
    await _refill(engine, app)
    started = time.monotonic()
    grants = await asyncio.gather(*(_take(engine, app, 50.0, 10) for _ in range(12)))
    elapsed = time.monotonic() - started
    # The full bucket (50), plus what refilled while the takes ran, and not a token more.
    assert 50 <= sum(g.tokens for g in grants) <= 50 + int(50 * elapsed) + 1


async def test_waiting_shards_take_turns_so_that_a_flooding_shard_takes_its_share_only(
    engine: AsyncEngine,
) -> None:
    app = limited_app(Recorder(), "100/s")
    await create_tables(engine, app)
    rates = RateLimits(app, engine)
    table = app.table(None).name
    granted: list[int] = []

    async def call(shard: int) -> None:
        ref = ShardRef(table, 1, "ORGANIZATION", shard)
        assert await rates.token(ref, int(LIMITED), time.monotonic() + 30, None)
        granted.append(shard)

    flood = [call(1) for _ in range(12)]  # shard 1 queued first, twelve times
    with metric_reader() as reader:
        try:
            await asyncio.gather(*flood, call(2), call(3), call(4))
        finally:
            rates.close()
        waits = list(points(reader.get_metrics_data(), "outbox.rate_limit.wait"))
    # In turn: shard 1 once, then each other shard, before shard 1 again (first come, first
    # served would give shard 1 its twelve tokens first).
    assert sorted(granted[:4]) == [1, 2, 3, 4], granted
    assert granted[4:] == [1] * 11
    # A round of 2 s reads from each shard no more groups than tokens are due in it, shared
    # by the 4 shards that asked: 100/s × 2 s / 4; an unlimited category has no cap.
    groups = rates.round_groups(table, 2.0)
    assert groups(int(LIMITED)) == 50
    assert groups(int(Category.PROJECT_UPDATE)) is None
    # Each call's wait, by category (the bucket started empty: every call waited).
    [wait] = waits
    assert wait.attributes == {"outbox.category": "ORGANIZATION_UPDATE"}
    assert wait.count == 15 and wait.sum > 0


def _row(category: Category, shard: int, obj: int) -> dict[str, Any]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj}


async def _drains_say(client: Client, table: str, partitions: int, text: str) -> bool:
    """Whether the heartbeat details of a running drain of ``table`` list ``text``."""
    for partition in range(partitions):
        handle = client.get_workflow_handle(PartitionRef(table, partition, partitions).workflow_id)
        for pending in (await handle.describe()).raw_description.pending_activities:
            details = await client.data_converter.decode(list(pending.heartbeat_details.payloads))
            if details and any(text in line for line in details[-1].get("rate_limited", [])):
                return True
    return False


async def test_a_limited_category_waits_while_others_drain_until_a_limit_set_at_run_time(
    servers: Servers, engine: AsyncEngine, client: Client
) -> None:
    recorder = Recorder()
    # One call an hour, from an empty bucket: none of the limited category runs on its own.
    app = limited_app(recorder, "1/h")
    await create_tables(engine, app)
    table = app.table(None).name
    limited = await write_rows(engine, app, [_row(LIMITED, s, 1) for s in (1, 2, 3)])
    # Behind a limited row in its shard (order per shard), and in shards of their own.
    behind = await write_rows(engine, app, [_row(Category.PROJECT_UPDATE, 1, 2)])
    others = await write_rows(engine, app, [_row(Category.PROJECT_UPDATE, s, 1) for s in (4, 5)])
    async with running_worker(servers, app, fast_settings()) as settings:
        await wait_until(lambda: set(others) <= set(recorder.ids()), what="other shards drained")
        # Visible while they wait: the drains' live details, shards and status.
        waiting = "ORGANIZATION_UPDATE 1/h: "
        await wait_until(
            lambda: _drains_say(client, table, settings.partitions, waiting),
            what="a drain's heartbeat naming the category waiting",
        )
        code, out, err = await cli(servers, table, "shards", "--json")
        assert code == 0, err
        limited_line = "ORGANIZATION_UPDATE 1/h (declared), calls wait for tokens"
        listed = {entry["shard"]: entry["rate_limited"] for entry in json.loads(out)}
        assert listed == {f"ORGANIZATION:{s}": limited_line for s in (1, 2, 3)}
        code, out, err = await cli(servers, table, "status", "ORGANIZATION:2", "--json")
        assert code == 0, err
        assert json.loads(out)["rate_limited"] == limited_line
        code, out, err = await cli(servers, table, "limit", "organization_update", "100/s")
        assert code == 0, err
        assert "limited to 100/s in every worker" in out
        await wait_until(lambda: table_empty(engine, app), what="the limited rows handled")
    handled = recorder.ids()
    assert handled.index(limited[0]) < handled.index(behind[0])
    assert set(handled) == {*limited, *behind, *others}
    code, out, err = await cli(servers, table, "limits", "--json")
    assert code == 0, err
    [listed] = json.loads(out)
    assert (listed["category"], listed["override"]) == ("ORGANIZATION_UPDATE", "100/s")
    assert listed["set_by"] and listed["set_role"] and listed["set_at"]
    code, out, err = await cli(servers, table, "limit", "ORGANIZATION_UPDATE", "off")
    assert code == 0, err
    code, out, err = await cli(servers, table, "limits", "--json")
    assert json.loads(out)[0]["override"] is None


async def test_a_shard_done_drains_again_while_its_round_waits_for_another_shard(
    servers: Servers, engine: AsyncEngine
) -> None:
    recorder = Recorder()
    app = limited_app(recorder, "100/s")
    await create_tables(engine, app)
    # A call of the limited category that does not return until told: its round stays open,
    # as one waiting for a token would.
    go_on, started = asyncio.Event(), asyncio.Event()

    async def held_up(message: Any) -> None:
        started.set()
        await go_on.wait()

    recorder.behaviour[int(LIMITED)] = held_up
    [waiting] = await write_rows(engine, app, [_row(LIMITED, 1, 1)])
    [first] = await write_rows(engine, app, [_row(Category.PROJECT_UPDATE, 2, 1)])
    # One partition: both shards in one round, whose held call does not time out meanwhile.
    async with running_worker(servers, app, fast_settings(partitions=1, handler_timeout=120.0)):
        await wait_until(lambda: first in recorder.ids() and started.is_set(), what="first")
        # The other shard's next row is drained by a later round while the first one still
        # waits for its call (before, the shard waited for its round to end).
        [later] = await write_rows(engine, app, [_row(Category.PROJECT_UPDATE, 2, 2)])
        await wait_until(lambda: later in recorder.ids(), what="the later row, beside the wait")
        assert waiting not in recorder.ids()
        go_on.set()
        await wait_until(lambda: table_empty(engine, app), what="every row handled")
    assert set(recorder.ids()) == {waiting, first, later}


async def test_limit_refuses_a_bad_rate_and_an_unknown_category(
    servers: Servers, engine: AsyncEngine
) -> None:
    app = limited_app(Recorder())
    await create_tables(engine, app)
    table = app.table(None).name
    code, _, err = await cli(servers, table, "limit", "organization_update", "fast")
    assert code != 0 and "RATE 'fast' is not a rate" in err and "Traceback" not in err
    code, _, err = await cli(servers, table, "limit", "no_such_category", "5/s")
    assert code != 0 and "unknown category 'no_such_category'" in err
    async with engine.connect() as conn:
        assert await read_limits(conn, app.table(None)) == []
