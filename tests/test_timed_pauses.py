"""Timed pauses (`pause --for`, `--until`, the update's ``for_seconds``/``until``): they hold
until their end by the database's clock and then end by themselves, also across a worker
restart, with the end shown wherever the pause is."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ActivityError

from outbox_bridge.cli.pause_commands import duration_seconds, ends_text, left_text
from outbox_bridge.db.pauses import read_pauses
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.workflows.inputs import InvalidInput, pause_end
from outbox_bridge.workflows.models import PauseChange, PausesView, until_text
from tests.harness import (
    COMMAND_POLL_INTERVAL,
    Category,
    fast_settings,
    fresh_app,
    refusal,
    running_worker,
    table_empty,
    wait_until,
    write_rows,
)
from tests.test_cli_shards import cli
from tests.test_pauses import SLOW_SWEEP, _handled, _in_order, _row, _started
from tests.workflows.doubles import current_details

# Long enough for the rows to be written and seen waiting, short enough for the suite.
PAUSE_SECONDS = 12


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1h30m", 5400)],
)
def test_durations_read_as_seconds(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "soon", "5x", "m30", "-5m"])
def test_a_duration_that_is_not_one_is_refused_by_name(text: str) -> None:
    with pytest.raises(ConfigurationError, match="is not a duration"):
        duration_seconds(text)


@pytest.mark.unit
def test_a_pause_end_is_bounded_and_has_a_zone() -> None:
    assert pause_end(None, None) == (None, None)
    assert pause_end(60, None) == (60.0, None)
    assert pause_end(None, "2026-12-01T09:00:00Z") == (
        None,
        datetime(2026, 12, 1, 9, tzinfo=UTC),
    )
    for seconds in (0, -1, 400 * 86_400, float("nan"), True, "60"):
        with pytest.raises(InvalidInput, match="for_seconds"):
            pause_end(seconds, None)
    for until in ("2026-12-01T09:00:00", "tomorrow", 5):
        with pytest.raises(InvalidInput, match="until"):
            pause_end(None, until)
    with pytest.raises(InvalidInput, match="at most one"):
        pause_end(60, "2026-12-01T09:00:00Z")


@pytest.mark.unit
def test_the_end_of_a_pause_is_shown_with_the_time_left() -> None:
    now = datetime(2026, 12, 1, 9, tzinfo=UTC)
    shown = ends_text(now + timedelta(minutes=29, seconds=50), now)
    assert shown == ", ends 2026-12-01T09:29:50+00:00 (in 29m 50s)"
    assert ends_text(None, now) == ""
    assert [left_text(s) for s in (5, 90, 93_600, 0)] == ["5s", "1m 30s", "1d 2h", "0s"]
    assert until_text("2026-12-01T09:29:50.5+00:00") == ", until 2026-12-01 09:29:50 UTC"


async def test_a_timed_pause_ends_by_itself_on_time_across_a_worker_restart(
    servers, engine
) -> None:
    recorder, table, app = await fresh_app(engine)
    # Sweeps far apart: what ends the pause is its end, read by the shard waiting at it.
    settings = fast_settings(sweep_interval=SLOW_SWEEP)
    async with running_worker(servers, app, settings):
        code, out, err = await cli(
            servers,
            table,
            "pause",
            "--category",
            "project_update",
            "--reason",
            "maintenance window",
            "--for",
            f"{PAUSE_SECONDS}s",
        )
        assert code == 0, err
        assert "category PROJECT_UPDATE (2) paused, ends " in out
        async with engine.connect() as conn:
            [pause] = await read_pauses(conn, app.table())
        assert pause.ends_at is not None
        ends_at = pause.ends_at
        code, out, err = await cli(servers, table, "pauses", "--json")
        assert code == 0, err
        if datetime.now(UTC) < ends_at:  # a slow machine may get here after the end
            [listed] = json.loads(out)
            assert listed["ends_at"] is not None and listed["name"] == "PROJECT_UPDATE"
        waiting = await write_rows(
            engine, app, [_row(Category.PROJECT_UPDATE, 1, 10), _row(Category.MEMBER_UPDATE, 1, 1)]
        )
        free = await write_rows(engine, app, [_row(Category.MEMBER_UPDATE, 2, 2)])
        await wait_until(lambda: _handled(recorder, free), what="a shard without paused rows")
        shown: dict[str, Any] = {}

        async def paused_or_ended() -> bool:
            code, out, err = await cli(servers, table, "status", "ORGANIZATION:1", "--json")
            assert code == 0, err
            shown.update(json.loads(out))
            return shown["state"] == "paused" or datetime.now(UTC) >= ends_at

        await wait_until(paused_or_ended, interval=COMMAND_POLL_INTERVAL, what="paused")
        if shown["state"] == "paused":
            assert "maintenance window" in shown["paused"] and ", ends " in shown["paused"]

    # A worker restart while the pause holds: the end is in the table, nothing to resume.
    async with running_worker(servers, app, settings):
        await wait_until(lambda: table_empty(engine, app), what="the rows after the pause's end")
        code, out, err = await cli(servers, table, "pauses", "--json")
        assert code == 0 and json.loads(out) == [], err
    calls = {c.id: c for c in recorder.calls}
    assert all(calls[i].at >= ends_at for i in waiting), "a row ran before its pause ended"
    assert _in_order(recorder, waiting)
    assert sorted(recorder.ids()) == sorted([*waiting, *free])  # each once


async def test_a_timed_pause_by_update_shows_its_end_and_refuses_a_bad_one(
    servers, engine, client
) -> None:
    _, table, app = await fresh_app(engine)
    settings = fast_settings(sweep_interval=SLOW_SWEEP)
    handle = client.get_workflow_handle(f"outbox:{table}:control")
    async with running_worker(servers, app, settings):
        await wait_until(lambda: _started(handle), what="the control workflow")
        view = await handle.execute_update(
            "pause",
            PauseChange(category="project_update", reason="deploy", by="ann", for_seconds=3600),
            result_type=PausesView,
        )
        [shown] = view.pauses
        assert shown.ends_at is not None
        ends = datetime.fromisoformat(shown.ends_at)
        assert timedelta(minutes=55) < ends - datetime.now(UTC) <= timedelta(hours=1)
        assert until_text(shown.ends_at) in await current_details(handle)

        # Refused by the validator: both ends, an end without a zone, a pause of 400 days.
        for change, says in (
            (PauseChange(scope="USER", reason="x", for_seconds=60, until="2030-01-01T00:00Z"), ""),
            (PauseChange(scope="USER", reason="x", until="2030-01-01T00:00"), "time zone"),
            (PauseChange(scope="USER", reason="x", for_seconds=400 * 86_400), "for_seconds"),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update("pause", change, result_type=PausesView)
            assert says in refusal(refused.value)
        # An end already past is refused by the worker, which reads the clock.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(
                "pause",
                PauseChange(scope="USER", reason="x", until="2020-01-01T00:00:00Z"),
                result_type=PausesView,
            )
        cause = refused.value.cause
        assert isinstance(cause, ActivityError) and "has passed" in str(cause.cause)

        # The command line refuses a past end and a bad duration, and pauses nothing.
        for option in (["--until", "2020-01-01T00:00:00Z"], ["--for", "soon"]):
            code, _, err = await cli(
                servers, table, "pause", "--scope", "USER", "--reason", "x", *option
            )
            assert code != 0 and ("has passed" in err or "is not a duration" in err), err
        async with engine.connect() as conn:
            assert [p.number for p in await read_pauses(conn, app.table())] == [2]
