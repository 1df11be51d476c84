"""Forged notifications: any role that can connect may ``NOTIFY <table>_rows``, with anything.

:func:`parse_notification` checks every message against the table's shape and the column types
(unit tests, no server); a running worker refuses what does not fit, answers it with a scan,
and never restarts its bridge over it (integration tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from functools import partial
from unittest.mock import MagicMock

import pytest
from sqlalchemy import text

from outbox_bridge.config import OutboxSettings
from outbox_bridge.runtime.bridge import NOTIFIED_SCAN_INTERVAL, NOTIFIED_SWEEP_INTERVAL, Bridge
from outbox_bridge.runtime.hub import ShardHub, partition_of
from outbox_bridge.runtime.notifications import (
    MAX_PAYLOAD_BYTES,
    Notification,
    parse_notification,
)
from outbox_bridge.runtime.shards import parse_shard
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    Recorder,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
    write_rows,
)

# -- what the trigger sends ------------------------------------------------------------------------


def test_the_trigger_s_messages_are_read() -> None:
    assert parse_notification("[[1, 7, 42], [2, -5, 43]]", regional=False) == [
        Notification(None, 1, 7, 42),
        Notification(None, 2, -5, 43),
    ]
    assert parse_notification('[["eu:west", 1, 7, 42]]', regional=True) == [
        Notification("eu:west", 1, 7, 42)
    ]
    assert parse_notification("[]", regional=False) == []


def test_the_extremes_of_the_column_types_are_accepted() -> None:
    top = 2**63 - 1
    assert parse_notification(f"[[{-(2**31)}, {-(2**63)}, {top}]]", regional=False) == [
        Notification(None, -(2**31), -(2**63), top)
    ]
    assert parse_notification(f"[[{2**31 - 1}, {top}, 1]]", regional=False) == [
        Notification(None, 2**31 - 1, top, 1)
    ]


# -- what is refused, as a whole, with the reason ----------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("", "not JSON"),
        ("not json", "not JSON"),
        ("[[1, 2, 3]", "not JSON"),
        ("[[1, 2, 3]] trailing", "not JSON"),
        ("\x00", "not JSON"),
        ("{}", "not a list of shards"),
        ('{"scope": 1, "id": 2, "max_id": 3}', "not a list of shards"),
        ('"[[1, 2, 3]]"', "not a list of shards"),
        ("42", "not a list of shards"),
        ("null", "not a list of shards"),
        ("true", "not a list of shards"),
    ],
)
def test_malformed_messages_are_refused(payload: str, reason: str) -> None:
    assert parse_notification(payload, regional=False) == reason


@pytest.mark.parametrize("depth", [100, 10_000, 200_000])
def test_deep_nesting_is_refused_without_recursing_away(depth: int) -> None:
    for payload in ("[" * depth, "[" * depth + "]" * depth, "[[1, 2, " + "[" * depth + "]]"):
        result = parse_notification(payload, regional=False)
        assert isinstance(result, str), payload[:20]


@pytest.mark.parametrize(
    "entry",
    [
        "[1, 2]",  # too short
        "[1, 2, 3, 4]",  # a region (or anything) too many for a table without regions
        '["eu", 1, 2, 3]',  # a region for a table without regions
        "1",
        "null",
        '{"scope": 1}',
        '"1:2:3"',
    ],
)
def test_entries_of_the_wrong_shape_are_refused(entry: str) -> None:
    result = parse_notification(f"[[1, 7, 42], {entry}]", regional=False)
    assert result == "an entry is not [scope, id, max id] for this table"


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("[1, 2, 3]", "an entry is not [region, scope, id, max id] for this table"),
        ('["eu", 1, 2]', "an entry is not [region, scope, id, max id] for this table"),
        ("[null, 1, 2, 3]", "a region is not a non-empty string"),
        ('["", 1, 2, 3]', "a region is not a non-empty string"),
        ("[5, 1, 2, 3]", "a region is not a non-empty string"),
        ('[["eu"], 1, 2, 3]', "a region is not a non-empty string"),
    ],
)
def test_regional_entries_of_the_wrong_shape_are_refused(entry: str, reason: str) -> None:
    assert parse_notification(f"[{entry}]", regional=True) == reason


@pytest.mark.parametrize(
    "region",
    [
        "\\u0000",  # no text column can hold NUL
        "eu\\u0000west",
        "\\ud800",  # a lone surrogate: not text at all (UTF-8 cannot encode it)
        "eu\\udfff",
    ],
)
def test_a_region_no_text_column_can_hold_is_refused(region: str) -> None:
    result = parse_notification(f'[["{region}", 1, 2, 3]]', regional=True)
    assert result == "a region is not text a column can hold"


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("[true, 2, 3]", "a scope is not a 32-bit integer"),
        ("[false, 2, 3]", "a scope is not a 32-bit integer"),
        ("[1.0, 2, 3]", "a scope is not a 32-bit integer"),
        ('["1", 2, 3]', "a scope is not a 32-bit integer"),
        (f"[{2**31}, 2, 3]", "a scope is not a 32-bit integer"),
        (f"[{-(2**31) - 1}, 2, 3]", "a scope is not a 32-bit integer"),
        ("[NaN, 2, 3]", "a scope is not a 32-bit integer"),
        ("[1, true, 3]", "a shard identifier is not a 64-bit integer"),
        ("[1, 2.5, 3]", "a shard identifier is not a 64-bit integer"),
        (f"[1, {2**63}, 3]", "a shard identifier is not a 64-bit integer"),
        (f"[1, {-(2**63) - 1}, 3]", "a shard identifier is not a 64-bit integer"),
        ("[1, Infinity, 3]", "a shard identifier is not a 64-bit integer"),
        ("[1, null, 3]", "a shard identifier is not a 64-bit integer"),
        ("[1, 2, true]", "an id is not a positive 64-bit integer"),
        ("[1, 2, 0]", "an id is not a positive 64-bit integer"),
        ("[1, 2, -3]", "an id is not a positive 64-bit integer"),
        (f"[1, 2, {2**63}]", "an id is not a positive 64-bit integer"),
        ("[1, 2, 3e2]", "an id is not a positive 64-bit integer"),
        ("[1, 2, -Infinity]", "an id is not a positive 64-bit integer"),
        ('[1, 2, "3"]', "an id is not a positive 64-bit integer"),
        ("[1, 2, [3]]", "an id is not a positive 64-bit integer"),
    ],
)
def test_out_of_range_and_mistyped_values_are_refused(entry: str, reason: str) -> None:
    # A good entry first: one bad entry refuses the whole message.
    assert parse_notification(f"[[1, 7, 42], {entry}]", regional=False) == reason


def test_a_message_longer_than_a_notification_can_be_is_refused_unparsed() -> None:
    """PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more, and the trigger asks for a
    sweep before that: a longer message never came from PostgreSQL's NOTIFY, and the bridge
    does not spend a parse on it."""
    entries = [[1, n, n + 1] for n in range(100_000)]
    payload = json.dumps(entries)
    assert len(payload.encode()) > MAX_PAYLOAD_BYTES
    assert parse_notification(payload, regional=False) == "longer than a notification can be"
    # Bytes, not characters: a region of multi-byte characters counts each byte.
    forged = json.dumps([["é" * 4500, 1, 2, 3]], ensure_ascii=False)
    assert len(forged) < MAX_PAYLOAD_BYTES < len(forged.encode())
    assert parse_notification(forged, regional=True) == "longer than a notification can be"
    # Up to the limit, a long message of good entries is read.
    fitting = json.dumps([[1, n, n + 1] for n in range(500)])
    assert len(fitting) < MAX_PAYLOAD_BYTES
    assert len(parse_notification(fitting, regional=False)) == 500


def test_every_accepted_region_names_a_shard_whose_workflow_id_reads_back() -> None:
    """A region may hold ':' (shard names are read from the right): whatever region a message
    names, the workflow id it leads to reads back as the same shard columns, never another
    shard's."""
    app = make_app("t_forged", Recorder(), regional=True)
    for region in ["eu", "eu:west", "eu:ORGANIZATION:1", "ORGANIZATION:1:", " ", "ü"]:
        parsed = parse_notification(json.dumps([[region, 1, 7, 42]]), regional=True)
        assert not isinstance(parsed, str), region
        [entry] = parsed
        shard = ShardRef("t_forged", entry.scope, "ORGANIZATION", entry.shard_identifier, region)
        back = parse_shard(shard.key, app)
        assert (back.region, back.scope, back.shard_identifier) == (region, 1, 7)
        # The partition of any accepted region can be computed (it is hashed as UTF-8).
        partition_of(ShardRef("t_forged", 1, "ORGANIZATION", 7, region), 4)


def test_refusals_are_logged_as_warnings_with_the_message_cut_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bridge's refusal: a warning with the reason and at most 200 characters of the
    message, a scan asked of the table's partitions, nothing taken from the message."""
    app = make_app("t_forged", Recorder())
    hub = ShardHub()
    inbox = hub.open_partition("t_forged", 0, 1)
    bridge = Bridge(
        app=app,
        engine=MagicMock(),
        listen_url="",
        settings=OutboxSettings(task_queue="tq"),
        supervisor=MagicMock(),
        hub=hub,
    )
    with caplog.at_level(logging.WARNING, "outbox_bridge.runtime.bridge"):
        bridge._take_notification(app.table(), "x" * 5000)
        bridge._take_notification(app.table(), '[["eu", 1, 2, 3]]')
        bridge._take_notification(app.table(), "[[1, 2, 3]]")
        # The second is counted, and logged when a minute has passed (or the bridge stops).
        assert len(caplog.records) == 1
        bridge._refusals["t_forged"].flush(now=True)
    assert bridge.notifications_refused == 2
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 2
    assert all(len(r) < 400 for r in refusals)
    assert "not JSON" in refusals[0] and "an entry is not" in refusals[1]
    assert refusals[0].startswith("refused a notification on t_forged_rows (not JSON)")
    assert inbox.rescan
    assert inbox.news == {ShardRef("t_forged", 1, "ORGANIZATION", 2): 3}
    assert bridge.handed_to_drains == 1


# -- against a running worker ----------------------------------------------------------------------

# Each is sent with pg_notify on the table's channel, as any role that can connect may.
FORGED = [
    "garbage",
    "",
    '{"shards": [["eu", 1, 2, 3]]}',
    "[" * 3000 + "]" * 3000,
    "[" * 7000,
    '[["eu", true, 2, 3]]',
    '[["eu", 1, 2, 0]]',
    f'[["eu", 1, {2**63}, 3]]',
    '[["eu", 1.5, 2, 3]]',
    "[[1, 2, 3]]",  # no region, on a regional table
    '[["eu", 1, 2, NaN]]',
    '[["\\u0000", 1, 2, 3]]',
    '[["\\ud800", 1, 2, 3]]',
    '[["eu\\udfff", 1, 2, 3], ["eu", 1, 3, 4]]',
]
# Well-formed, but naming shards that have no rows: a region holding ':' that spells another
# shard's key, and a region as long as a notification allows.
FORGED_REGION = "eu:ORGANIZATION:1"
LONG_REGION = "x" * 7000


async def test_forged_notifications_never_restart_the_bridge(
    servers, engine, client, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage sent with NOTIFY on a table's channel is refused and answered with a scan (at
    most one a second): a row inserted without its notification (the trigger off, for that
    transaction) is handled within moments, although the worker's scans and sweeps are an hour
    apart. The bridge never fails
    or reconnects over a message, and no shard gets a workflow for news (the partitions drain
    them)."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder, regional=True)
    await create_tables(engine, app)
    settings = fast_settings(poll_interval=3600.0, sweep_interval=3600.0)
    channel = f"{table}_rows"

    async def notify(payload: str) -> None:
        async with engine.begin() as conn:
            await conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": channel, "p": payload})

    async def insert_silently(shard: int) -> int:
        async with engine.begin() as conn:
            # The trigger does not fire for this transaction: no notification.
            await conn.execute(text("SET LOCAL session_replication_role = replica"))
            new_id = await conn.execute(
                text(
                    f"INSERT INTO {table} (region, shard_scope, shard_identifier, category, "
                    "object_identifier) VALUES ('eu', 1, :s, 2, 1) RETURNING id"
                ),
                {"s": shard},
            )
            return int(new_id.scalar_one())

    def handled(row_id: int) -> bool:
        return row_id in recorder.ids()

    def eu_row(shard: int) -> dict[str, object]:
        return {
            "category": Category.PROJECT_UPDATE,
            "shard_identifier": shard,
            "object_identifier": 1,
            "region": "eu",
        }

    with caplog.at_level(logging.INFO, logger="outbox_bridge"):
        async with running_worker(servers, app, settings):
            # Drains running (the partitions have made their first full scan).
            [first] = await write_rows(engine, app, [eu_row(1)])
            await wait_until(partial(handled, first), what="a notified row")
            for payload in FORGED:
                silent = await insert_silently(2)
                assert len(payload.encode()) < 8000  # what NOTIFY lets through
                await notify(payload)
                await wait_until(
                    partial(handled, silent), timeout=10, what=f"a scan after {payload[:30]!r}"
                )
            await notify(json.dumps([[FORGED_REGION, 1, 7, 99], [LONG_REGION, 1, 7, 99]]))
            # A notification that is read, after the forged ones: the bridge still listens.
            [last] = await write_rows(engine, app, [eu_row(3)])
            await wait_until(partial(handled, last), timeout=10, what="a notified row after them")
            await wait_until(lambda: table_empty(engine, app), what="every row")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("outbox_bridge")]
    assert not [m for m in messages if "bridge failed" in m or "bridge lost" in m]
    assert len([m for m in messages if m.startswith("bridge active")]) == 1  # no reconnect
    # The first refusal at once; the others within the minute counted in one record.
    refused = [m for m in messages if m.startswith("refused ") and "notification" in m]
    assert refused[0].startswith("refused a notification")
    assert f"refused {len(FORGED) - 1} notifications on {channel}" in refused[1], refused
    assert len(refused) == 2
    assert len({c.id for c in recorder.calls}) == len(FORGED) + 2
    assert {c.shard for c in recorder.calls} == {"eu:1:1", "eu:1:2", "eu:1:3"}
    ids = [
        w.id
        async for w in client.list_workflows(
            f"WorkflowType = 'OutboxShard' AND TaskQueue = '{settings.task_queue}'"
        )
    ]
    assert ids == []  # partitions drained every real shard; nothing was started for news


FLOOD = 5000


async def test_a_flood_of_forged_notifications_costs_a_bounded_number_of_logs_and_scans(
    servers, engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 forged notifications of each kind (garbage, ``*``, ``pauses``) sent while a real
    row is written: the row is handled at once; the refusals are logged in two or three
    records, and the scans and sweeps the notifications ask for stay within one a second and
    one every five seconds."""
    recorder = Recorder()
    table = unique_table()
    app = make_app(table, recorder)
    await create_tables(engine, app)
    settings = fast_settings(poll_interval=3600.0, sweep_interval=3600.0)
    channel = f"{table}_rows"
    scans: list[float] = []
    sweeps: list[float] = []
    rescan, sweep = ShardHub.rescan, Bridge._sweep

    def counted_rescan(hub: ShardHub, name: str) -> None:
        if name == table:
            scans.append(time.monotonic())
        rescan(hub, name)

    async def counted_sweep(bridge: Bridge) -> None:
        sweeps.append(time.monotonic())
        await sweep(bridge)

    monkeypatch.setattr(ShardHub, "rescan", counted_rescan)
    monkeypatch.setattr(Bridge, "_sweep", counted_sweep)

    async def flood(kind: str) -> None:
        """5,000 forged messages in one round trip. PostgreSQL sends identical messages of one
        transaction once: distinct garbage in one, and '*' and 'pauses' one transaction each."""
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            if kind == "garbage":
                await conn.execute(
                    text("SELECT pg_notify(:c, 'garbage ' || g) FROM generate_series(1, :n) g"),
                    {"c": channel, "n": FLOOD},
                )
                return
            block = (
                f"DO $$ BEGIN FOR g IN 1..{FLOOD} LOOP "
                f"PERFORM pg_notify('{channel}', '{kind}'); COMMIT; END LOOP; END $$"
            )
            await conn.execute(text(block))

    with caplog.at_level(logging.INFO, logger="outbox_bridge"):
        async with running_worker(servers, app, settings):
            [first] = await write_rows(engine, app, [_row(1)])
            await wait_until(lambda: first in recorder.ids(), what="a notified row")
            began = time.monotonic()
            scans.clear()
            sweeps.clear()
            for kind in ("garbage", "*", "pauses"):
                flooding = asyncio.create_task(flood(kind))
                [row_id] = await write_rows(engine, app, [_row(2)])
                await wait_until(
                    partial(_handled, recorder, row_id), what=f"a row in a {kind} flood"
                )
                await flooding
            # Its notification comes after every forged one, read in order: all were taken.
            [last] = await write_rows(engine, app, [_row(3)])
            await wait_until(lambda: last in recorder.ids(), what="a row after the floods")
            took = time.monotonic() - began
    refused = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("refused ") and channel in r.getMessage()
    ]
    # The first logged at once, the rest in a minute's record or the stopping bridge's.
    assert 2 <= len(refused) <= 3, refused
    assert sum(_refused_count(m) for m in refused) == FLOOD
    assert len(scans) <= took / NOTIFIED_SCAN_INTERVAL + 2, (len(scans), took)
    assert len(sweeps) <= took / NOTIFIED_SWEEP_INTERVAL + 2, (len(sweeps), took)


def _handled(recorder: Recorder, row_id: int) -> bool:
    return row_id in recorder.ids()


def _row(shard: int) -> dict[str, object]:
    return {"category": Category.PROJECT_UPDATE, "shard_identifier": shard, "object_identifier": 1}


def _refused_count(message: str) -> int:
    if message.startswith("refused a notification"):
        return 1
    return int(message.split()[1].replace(",", ""))
