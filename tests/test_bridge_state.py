"""The always-mode bridge's memory of shards stays as large as the backlog: shards that come and
go between sweeps (announced, drained and gone before the next sweep sees them) are forgotten.
Unit tests with a fake table and a fake Temporal: no server."""

from __future__ import annotations

import math
import types
from typing import Any
from unittest.mock import MagicMock

import pytest

from outbox_bridge.db.store import ShardRange
from outbox_bridge.runtime import bridge as bridge_module
from outbox_bridge.runtime.bridge import Bridge, BridgeOptions
from outbox_bridge.runtime.hub import ShardKey
from outbox_bridge.runtime.notifications import Notification
from outbox_bridge.workflows.models import ShardRef
from tests.harness import Recorder, make_app

SWEEP_SECONDS = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Starter:
    """Temporal takes every start and signal."""

    def __init__(self) -> None:
        self.started: list[str] = []

    async def start(self, shard: ShardRef, max_id: int, *, traffic: bool = False) -> bool:
        self.started.append(shard.key)
        return True

    async def notify(
        self, shard: ShardRef, max_id: int, *, late: bool = False, traffic: bool = False
    ) -> bool:
        return True


@pytest.mark.parametrize(("linger", "idle_timeout"), [(0.0, 0.0), (10.0, 60.0)])
async def test_the_bridge_forgets_shards_that_come_and_go_between_sweeps(
    monkeypatch: pytest.MonkeyPatch, linger: float, idle_timeout: float
) -> None:
    clock = Clock()
    monkeypatch.setattr(bridge_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    app = make_app("t_memory", Recorder())
    table = app.table()
    starter = Starter()
    bridge = Bridge(
        app=app,
        engine=MagicMock(),
        client=MagicMock(),  # no shard stalls in this test: Temporal is never asked
        listen_url="",
        options=BridgeOptions(
            task_queue="tq",
            sweep_interval=SWEEP_SECONDS,
            linger=linger,
            idle_timeout=idle_timeout,
        ),
        starter=starter,  # type: ignore[arg-type]
    )
    # A few shards keep a backlog throughout (their heads move: they are not stalled).
    steady = [ShardKey(table.name, None, 1, -n) for n in range(1, 21)]
    present: list[ShardRange] = []

    async def ranges(_table: Any, *, after_id: int | None) -> list[ShardRange]:
        return present

    async def statistics(_table: Any) -> None:
        pass  # the table's planner statistics: a database question, none here

    monkeypatch.setattr(bridge, "_ranges", ranges)
    monkeypatch.setattr(bridge, "_ensure_statistics", statistics)
    next_id = 1
    sizes: list[tuple[int, int, int]] = []
    for sweep in range(60):
        # Between two sweeps: 500 new shards are announced, signalled, drained and gone.
        for n in range(500):
            ident = sweep * 1000 + n
            bridge._take_entry(table.name, Notification(None, 1, ident, next_id))
            next_id += 1
        await bridge._flush_notifications()
        clock.now += SWEEP_SECONDS
        # The sweep sees the steady shards and 200 others that have rows right now.
        present = [
            ShardRange(None, 1, key.shard_identifier, next_id + i, next_id + i)
            for i, key in enumerate(steady)
        ] + [
            ShardRange(None, 2, sweep * 1000 + n, next_id + 100 + n, next_id + 100 + n)
            for n in range(200)
        ]
        next_id += 400
        await bridge._sweep_tables()
        sizes.append((len(bridge._known), len(bridge._last_min), len(bridge._last_contact)))
    assert len(starter.started) >= 60 * 500
    # As large as the backlog the last sweep saw, plus what was announced since it: never the
    # shards of all sweeps. The time of last contact is kept for as long as it decides
    # something (a lingering or idle workflow): the shards of that many sweeps more.
    backlog = len(steady) + 200
    window = max(linger, idle_timeout, 1.0)
    kept_contacts = (500 + 200) * math.ceil(window / SWEEP_SECONDS)
    known, last_min, contact = sizes[-1]
    assert last_min == backlog
    assert known <= backlog
    assert contact <= backlog + kept_contacts
    assert max(s[0] for s in sizes) <= backlog + 500
    assert max(s[2] for s in sizes) <= backlog + 500 + kept_contacts
    assert sizes[-1] == sizes[len(sizes) // 2]  # a steady state, not a slow growth
    for key in steady:
        assert key in bridge._last_min and key in bridge._known
